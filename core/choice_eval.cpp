#include "core/choice_eval.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "core/error.h"
#include "core/input_file.h"
#include "core/loss_mask.h"

namespace fp8lm {

namespace {

constexpr int kHeaderInts = 256;
constexpr uint64_t kHeaderBytes = kHeaderInts * sizeof(int32_t);
constexpr uint16_t kStartOfExample = 65535;

// Reads the examples' uint16 stream word by word, with the byte offset of every word for errors.
class WordReader {
 public:
  WordReader(const InputFile& file, std::vector<uint16_t> words)
      : file_(file), words_(std::move(words)) {}
  bool done() const { return next_ == words_.size(); }
  uint64_t offset() const { return kHeaderBytes + 2 * next_; }  // of the next word
  uint16_t take(const char* what) {
    if (next_ == words_.size())
      throw InputError(file_.path() + ": truncated at byte offset " + std::to_string(offset()) + ": " + what +
                       " is missing");
    return words_[next_++];
  }

 private:
  const InputFile& file_;
  std::vector<uint16_t> words_;
  size_t next_ = 0;
};

std::string at(const std::string& path, uint64_t offset) {
  return path + ": byte offset " + std::to_string(offset) + ": ";
}

}  // namespace

std::vector<ChoiceExample> read_choice_file(const std::string& path, int vocab_size, int seq_length) {
  const InputFile file = InputFile::open(path);
  if (file.size() < kHeaderBytes)
    throw InputError(path + ": " + std::to_string(file.size()) + " bytes, shorter than the " +
                         std::to_string(kHeaderBytes) + "-byte header of llm.c's eval file",
                     "HellaSwag's comes from llm.c's dev/data/hellaswag.py (hellaswag_val.bin)");
  std::array<int32_t, kHeaderInts> header{};
  file.read_exact_at(0, header.data(), kHeaderBytes);
  if (header[0] != kChoiceFileMagic)
    throw InputError(path + ": magic " + std::to_string(header[0]) + ", not llm.c's eval file's " +
                         std::to_string(kChoiceFileMagic),
                     "an llm.c token shard (20240520) is training data; --hellaswag-path takes "
                     "dev/data/hellaswag.py's hellaswag_val.bin");
  if (header[1] != 1) throw InputError(path + ": version " + std::to_string(header[1]) + ", not 1 (GPT-2's uint16 tokens)");
  if (header[2] <= 0) throw InputError(path + ": " + std::to_string(header[2]) + " examples in the header");
  const uint64_t stream_bytes = file.size() - kHeaderBytes;
  if (stream_bytes % 2 != 0) throw InputError(path + ": " + std::to_string(file.size()) + " bytes, an odd count");
  std::vector<uint16_t> words(stream_bytes / 2);
  if (!words.empty()) file.read_exact_at(kHeaderBytes, words.data(), stream_bytes);
  WordReader reader(file, std::move(words));

  std::vector<ChoiceExample> examples;
  auto tokens = [&](const char* what, int64_t example) {
    const uint64_t length_offset = reader.offset();
    const int length = reader.take(what);
    if (length == 0)
      throw InputError(at(path, length_offset) + "example " + std::to_string(example) + " has an empty " + what);
    std::vector<int32_t> out(length);
    for (int32_t& token : out) {
      const uint64_t offset = reader.offset();
      token = reader.take(what);
      if (token >= vocab_size)
        throw InputError(at(path, offset) + "token " + std::to_string(token) + " of example " +
                             std::to_string(example) + "'s " + what + " is outside the model's vocabulary of " +
                             std::to_string(vocab_size),
                         "the file was tokenized for another vocabulary");
    }
    return out;
  };
  while (!reader.done()) {
    const uint64_t start = reader.offset();
    const uint16_t marker = reader.take("the start of an example");
    if (marker != kStartOfExample)
      throw InputError(at(path, start) + std::to_string(marker) + " where an example starts (65535)");
    const uint16_t bytes = reader.take("the example's size");
    ChoiceExample example;
    example.index = reader.take("the example's index");
    example.label = reader.take("the example's label");
    const int completions = reader.take("the example's completion count");
    if (completions < 2)
      throw InputError(at(path, start) + "example " + std::to_string(example.index) + " has " +
                       std::to_string(completions) + " completions (at least 2)");
    if (example.label >= completions)
      throw InputError(at(path, start) + "example " + std::to_string(example.index) + "'s label " +
                       std::to_string(example.label) + " is not one of its " + std::to_string(completions) +
                       " completions");
    example.context = tokens("context", example.index);
    for (int k = 0; k < completions; ++k) {
      example.endings.push_back(tokens("ending", example.index));
      const size_t row_tokens = example.context.size() + example.endings.back().size();
      if (row_tokens > size_t(seq_length) + 1)
        throw InputError(at(path, start) + "example " + std::to_string(example.index) + ": context and ending " +
                             std::to_string(k) + " are " + std::to_string(row_tokens) +
                             " tokens, more than a row of --seq-length " + std::to_string(seq_length) + " holds (" +
                             std::to_string(seq_length + 1) + ")",
                         "evaluate with a longer --seq-length");
    }
    if (reader.offset() - start != bytes)
      throw InputError(at(path, start) + "example " + std::to_string(example.index) + " says it is " +
                       std::to_string(bytes) + " bytes, but its fields make " + std::to_string(reader.offset() - start));
    examples.push_back(std::move(example));
  }
  if (examples.size() != size_t(header[2]))
    throw InputError(path + ": the header counts " + std::to_string(header[2]) + " examples, the file holds " +
                     std::to_string(examples.size()));
  return examples;
}

std::string choice_file_bytes(const std::vector<ChoiceExample>& examples) {
  std::vector<uint16_t> stream;
  int32_t longest = 0;
  for (const ChoiceExample& example : examples) {
    const size_t start = stream.size();
    FP8LM_CHECK(example.endings.size() >= 2 && example.label >= 0 && size_t(example.label) < example.endings.size(),
                "choice_file_bytes: example ", example.index, " needs 2 or more endings and a label among them");
    stream.insert(stream.end(), {kStartOfExample, 0, uint16_t(example.index), uint16_t(example.label),
                                 uint16_t(example.endings.size())});
    auto append = [&](const std::vector<int32_t>& tokens) {
      FP8LM_CHECK(!tokens.empty() && tokens.size() < kStartOfExample, "choice_file_bytes: example ", example.index,
                  " has an empty or oversized token list");
      stream.push_back(uint16_t(tokens.size()));
      for (int32_t token : tokens) {
        FP8LM_CHECK(token >= 0 && token < kStartOfExample, "choice_file_bytes: token ", token);
        stream.push_back(uint16_t(token));
      }
    };
    append(example.context);
    for (const auto& ending : example.endings) append(ending);
    const size_t bytes = 2 * (stream.size() - start);
    FP8LM_CHECK(bytes < 65536, "choice_file_bytes: example ", example.index, " is ", bytes, " bytes (at most 65535)");
    stream[start + 1] = uint16_t(bytes);
    longest = std::max(longest, int32_t(bytes));
  }
  std::array<int32_t, kHeaderInts> header{};
  header[0] = kChoiceFileMagic;
  header[1] = 1;
  header[2] = int32_t(examples.size());
  header[3] = longest;
  std::string bytes(kHeaderBytes + 2 * stream.size(), '\0');
  std::memcpy(bytes.data(), header.data(), kHeaderBytes);
  std::memcpy(bytes.data() + kHeaderBytes, stream.data(), 2 * stream.size());
  return bytes;
}

void fill_choice_row(const ChoiceExample& example, int ending_index, int seq_length, int32_t* inputs,
                     int32_t* targets) {
  const size_t T = size_t(seq_length), context = example.context.size();
  FP8LM_CHECK(ending_index >= 0 && size_t(ending_index) < example.endings.size(), "fill_choice_row: example ",
              example.index, " has no ending ", ending_index);
  const std::vector<int32_t>& ending = example.endings[size_t(ending_index)];
  FP8LM_CHECK(context >= 1 && !ending.empty() && context + ending.size() <= T + 1, "fill_choice_row: example ",
              example.index, " does not fit a row of ", T);
  std::fill_n(inputs, T, 0);
  std::fill_n(targets, T, kMaskedTarget);
  std::copy(example.context.begin(), example.context.end(), inputs);
  // All but the ending's last token are inputs; position context - 1 + j predicts ending[j].
  std::copy(ending.begin(), ending.end() - 1, inputs + context);
  std::copy(ending.begin(), ending.end(), targets + context - 1);
}

int predicted_choice(std::span<const double> mean_losses) {
  FP8LM_CHECK(!mean_losses.empty(), "predicted_choice: no completions");
  int best = 0;
  for (size_t k = 1; k < mean_losses.size(); ++k)
    if (mean_losses[k] < mean_losses[best]) best = int(k);
  return best;
}

}  // namespace fp8lm
