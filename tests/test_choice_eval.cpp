// llm.c's multiple-choice eval file (core/choice_eval.h): the bytes against a hand-built file,
// the round trip, every malformed field refused with the file and byte offset, the rows a
// completion makes, and the choice of the lowest mean loss.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "apps/checkpointing.h"
#include "core/choice_eval.h"
#include "core/error.h"
#include "core/loss_mask.h"
#include "core/tokenizer.h"
#include "byte_vocabulary.h"
#include "cli_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Example 0 (label 1): context [5, 6], endings [7] and [8, 9].
ChoiceExample small_example() { return ChoiceExample{.index = 0, .label = 1, .context = {5, 6}, .endings = {{7}, {8, 9}}}; }

// The file llm.c's write_evalfile makes of small_example(), built word by word.
std::vector<uint8_t> hand_built_file() {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240522;
  header[1] = 1;
  header[2] = 1;
  header[3] = 26;  // 13 words
  const std::vector<uint16_t> words = {65535, 26, 0, 1, 2, 2, 5, 6, 1, 7, 2, 8, 9};
  std::vector<uint8_t> bytes(header.size() * 4 + words.size() * 2);
  std::memcpy(bytes.data(), header.data(), header.size() * 4);
  std::memcpy(bytes.data() + header.size() * 4, words.data(), words.size() * 2);
  return bytes;
}

std::string read_error(const std::string& path, int vocab_size = 300, int seq_length = 16) {
  try {
    read_choice_file(path, vocab_size, seq_length);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("the multiple-choice file: llm.c's bytes, written and read back", "[choice-eval]") {
  const testing::TempDir dir;
  write_file_durably(dir.file("small.bin"), choice_file_bytes({small_example()}));
  CHECK(file_bytes(dir.file("small.bin")) == hand_built_file());

  // Mixed completion counts, long token lists, ids up to 65534.
  std::vector<ChoiceExample> examples = {small_example()};
  ChoiceExample wide{.index = 1, .label = 3, .context = std::vector<int32_t>(40, 65534), .endings = {}};
  for (int k = 0; k < 4; ++k) wide.endings.push_back(std::vector<int32_t>(size_t(k + 1), 100 + k));
  examples.push_back(wide);
  write_file_durably(dir.file("two.bin"), choice_file_bytes(examples));
  const std::vector<ChoiceExample> back = read_choice_file(dir.file("two.bin"), 65535, 64);
  REQUIRE(back.size() == 2);
  for (size_t e = 0; e < 2; ++e) {
    CHECK(back[e].index == examples[e].index);
    CHECK(back[e].label == examples[e].label);
    CHECK(back[e].context == examples[e].context);
    CHECK(back[e].endings == examples[e].endings);
  }
}

TEST_CASE("the multiple-choice file: every malformed field is refused, naming the file and byte offset",
          "[choice-eval]") {
  const testing::TempDir dir;
  const std::string path = dir.file("bad.bin");
  auto with = [&](auto change) {
    std::vector<uint8_t> bytes = hand_built_file();
    change(bytes);
    write_bytes(path, bytes);
    return read_error(path);
  };
  auto set_word = [](std::vector<uint8_t>& bytes, size_t word, uint16_t value) {
    std::memcpy(bytes.data() + 1024 + 2 * word, &value, 2);
  };
  CHECK(with([](auto&) {}) == "(no error)");
  CHECK_THAT(with([](auto& b) { b.resize(100); }), ContainsSubstring("shorter than the 1024-byte header"));
  CHECK_THAT(with([](auto& b) { b[0] = 0x58; }), ContainsSubstring(path + ": magic ") &&
                                                     ContainsSubstring("not llm.c's eval file's 20240522"));
  CHECK_THAT(with([](auto& b) { b[4] = 2; }), ContainsSubstring("version 2, not 1"));
  CHECK_THAT(with([](auto& b) { b.resize(b.size() - 2); }),
             ContainsSubstring(path + ": truncated at byte offset 1048: ending is missing"));
  CHECK_THAT(with([&](auto& b) { set_word(b, 0, 7); }),
             ContainsSubstring(path + ": byte offset 1024: 7 where an example starts"));
  CHECK_THAT(with([&](auto& b) { set_word(b, 3, 2); }), ContainsSubstring("label 2 is not one of its 2 completions"));
  CHECK_THAT(with([&](auto& b) { set_word(b, 4, 1); }), ContainsSubstring("has 1 completions (at least 2)"));
  CHECK_THAT(with([&](auto& b) { set_word(b, 7, 300); }),
             ContainsSubstring(path + ": byte offset 1038: token 300 of example 0's context is outside the model's "
                                      "vocabulary of 300"));
  CHECK_THAT(with([&](auto& b) { set_word(b, 8, 0); }), ContainsSubstring("example 0 has an empty ending"));
  CHECK_THAT(with([&](auto& b) { set_word(b, 1, 28); }),
             ContainsSubstring("example 0 says it is 28 bytes, but its fields make 26"));
  CHECK_THAT(with([](auto& b) { b[8] = 2; }), ContainsSubstring("the header counts 2 examples, the file holds 1"));
  CHECK_THAT(with([](auto& b) { b.push_back(0); }), ContainsSubstring("an odd count"));
  // A context and ending longer than a row of the sequence holds: refused, not cut short.
  write_file_durably(path, choice_file_bytes({small_example()}));
  CHECK(read_error(path, 300, 3) == "(no error)");  // 2 + 2 tokens: 3 inputs, the last ending token a target only
  CHECK_THAT(read_error(path, 300, 2), ContainsSubstring("context and ending 1 are 4 tokens, more than a row of "
                                                         "--seq-length 2 holds (3)"));
}

TEST_CASE("a completion's row: the context and ending as inputs, the ending's tokens its only targets",
          "[choice-eval]") {
  const int T = 4, M = kMaskedTarget;
  std::vector<int32_t> inputs(2 * T, -7), targets(2 * T, -7);
  for (int k = 0; k < 2; ++k) fill_choice_row(small_example(), k, T, inputs.data() + k * T, targets.data() + k * T);
  CHECK(inputs == std::vector<int32_t>{5, 6, 0, 0, /**/ 5, 6, 8, 0});
  CHECK(targets == std::vector<int32_t>{M, 7, M, M, /**/ M, 8, 9, M});
  // The longest that fits: context + ending = T + 1.
  const ChoiceExample full{.index = 3, .label = 0, .context = {1, 2}, .endings = {{3, 4, 5}, {6}}};
  std::vector<int32_t> full_inputs(2 * T), full_targets(2 * T);
  for (int k = 0; k < 2; ++k)
    fill_choice_row(full, k, T, full_inputs.data() + k * T, full_targets.data() + k * T);
  CHECK(full_inputs == std::vector<int32_t>{1, 2, 3, 4, /**/ 1, 2, 0, 0});
  CHECK(full_targets == std::vector<int32_t>{M, 3, 4, 5, /**/ M, 6, M, M});
}

TEST_CASE("the model's choice is the completion with the lowest mean loss, the first of equal ones", "[choice-eval]") {
  CHECK(predicted_choice(std::vector<double>{2.0, 1.0, 1.0, 3.0}) == 1);
  CHECK(predicted_choice(std::vector<double>{0.5, 0.5}) == 0);
  CHECK(predicted_choice(std::vector<double>{4.0, 3.0, 2.0, 1.0}) == 3);
}

TEST_CASE("tokenize --output-format hellaswag renders HellaSwag's records as llm.c does", "[choice-eval][cli]") {
  const testing::TempDir dir;
  const testing::ByteVocabulary files = testing::write_byte_vocabulary(dir);
  const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(files.vocab_file, files.merge_file);
  const std::string flags = " --vocab-file " + files.vocab_file + " --merge-file " + files.merge_file;
  const std::vector<std::pair<std::string, std::vector<std::string>>> records = {
      {"A man is sitting on a roof. he", {"is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                                          "is holding a rubik's cube.", "starts pulling up roofing on a roof."}},
      {"aa", {"b", "aaa"}}};
  {
    std::ofstream jsonl(dir.file("hellaswag_val.jsonl"));
    for (size_t r = 0; r < records.size(); ++r)
      jsonl << nlohmann::json{{"ctx", records[r].first}, {"endings", records[r].second}, {"label", r == 0 ? 2 : 0},
                              {"ind", 24}}
                   .dump()
            << "\n";
  }
  const auto run = testing::run_fp8lm("tokenize --output-format hellaswag --input " + dir.file("hellaswag_val.jsonl") +
                                      " --output " + dir.file("out") + flags);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("--hellaswag-path " + dir.file("out/hellaswag_val.bin")));
  const std::vector<ChoiceExample> examples = read_choice_file(dir.file("out/hellaswag_val.bin"), 258, 128);
  REQUIRE(examples.size() == 2);
  for (size_t r = 0; r < 2; ++r) {
    CHECK(examples[r].index == int64_t(r));
    CHECK(examples[r].label == (r == 0 ? 2 : 0));
    CHECK(examples[r].context == tokenizer.encode(records[r].first));
    REQUIRE(examples[r].endings.size() == records[r].second.size());
    for (size_t k = 0; k < records[r].second.size(); ++k)
      CHECK(examples[r].endings[k] == tokenizer.encode(" " + records[r].second[k]));  // a space first, as llm.c
  }

  // Bad records name the file and line; flags of the shard formats are refused.
  auto refused = [&](const std::string& line, const std::string& extra = "") {
    const std::string path = dir.file("bad.jsonl");
    std::ofstream(path) << "{\"ctx\": \"x\", \"endings\": [\"a\", \"b\"], \"label\": 0}\n" << line << "\n";
    static int n = 0;
    const auto bad = testing::run_fp8lm("tokenize --output-format hellaswag --input " + path + " --output " +
                                        dir.file("bad" + std::to_string(n++)) + flags + extra);
    CHECK(bad.exit_code == 2);
    return bad.output;
  };
  CHECK_THAT(refused("{\"ctx\": \"x\", \"endings\": [\"a\", \"b\"], \"label\": 2}"),
             ContainsSubstring(dir.file("bad.jsonl") + ":2: label 2 is not one of its 2 endings"));
  CHECK_THAT(refused("{\"ctx\": \"x\", \"label\": 0}"), ContainsSubstring(":2: a record needs \"ctx\""));
  CHECK_THAT(refused("not json"), ContainsSubstring(dir.file("bad.jsonl") + ":2: not JSON"));
  CHECK_THAT(refused("", " --val-fraction 0.1"), ContainsSubstring("--val-fraction: not used with --output-format hellaswag"));
}
