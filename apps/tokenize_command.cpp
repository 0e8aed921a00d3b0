// fp8lm tokenize: text files, or JSON/JSONL documents, to llm.c token shards with GPT-2's BPE.
//
// Documents: a text file is one document; in JSON/JSONL each record is one (a string, or an
// object whose --json-key field is a string). Each document is preceded by <|endoftext|>
// (50256), as llm.c's data scripts write it, so the first token of every shard stream is 50256.
// Validation: document d (counted over all inputs, in order) goes to val when
// floor((d+1)*f) > floor(d*f) for f = --val-fraction: an even spread of round-down(f*n) of n
// documents, independent of the number of threads.
//
// Streaming: the inputs are read in units of about 1 MiB (a long text document is cut only
// where gpt2_split_point says the pieces do not change), a batch of units is encoded in
// parallel, and the ids are appended to the shards in input order, so memory stays bounded
// (batch size x workers, plus the longest text run without a cut point, or the longest JSON
// record) and the output does not depend on the number of workers. A .json file that holds one
// JSON array is parsed whole; use JSONL for large corpora.
//
// Output: DIR/train_000000.bin ... and DIR/val_000000.bin ..., llm.c's format (1024-byte
// header: magic 20240520, version 1, token count; then uint16 tokens), at most --shard-tokens
// tokens each, each written as NAME.tmp and renamed when complete. On failure every file this
// run wrote is removed.
//
// --output-format hellaswag: one JSONL file of multiple-choice records (HellaSwag's
// hellaswag_val.jsonl: "ctx", "endings", "label") to llm.c's eval file DIR/STEM.bin
// (core/choice_eval.h) as llm.c's dev/data/hellaswag.py renders them: the context as it is,
// each ending with a space before it; --hellaswag-path scores it.
//
// --output-format megatron: one Megatron-LM indexed dataset DIR/text_document.{bin,idx}
// (core/indexed_dataset.h) holding every document, one document per input document, each
// followed by <|endoftext|> as Megatron's preprocess_data.py --append-eod writes it. Its
// train/valid/test split is made at training time (--split), so --val-fraction and
// --shard-tokens do not apply.
#include <glob.h>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/cli.h"
#include "apps/commands.h"
#include "apps/shard_writer.h"
#include "core/choice_eval.h"
#include "core/indexed_dataset.h"
#include "core/error.h"
#include "core/logging.h"
#include "core/token_data.h"
#include "core/input_file.h"
#include "core/tokenizer.h"

namespace fp8lm {

namespace {

namespace fs = std::filesystem;

constexpr size_t kUnitBytes = size_t{1} << 20;  // text per work unit
constexpr int kUnitsPerWorker = 4;              // units per batch, per worker

struct TokenizeOptions {
  std::string input, output, vocab_file, merge_file;
  std::string json_key = "text";
  double val_fraction = 0.01;
  int64_t shard_tokens = 100'000'000;  // llm.c's fineweb.py shard size
  std::string tokenizer_type = "GPT2BPETokenizer";
  int workers = 0;
  std::string log_level = "info";
  std::string output_format = "llmc";  // or "megatron", "hellaswag"
};

constexpr const char* kMegatronOutputName = "text_document";

enum class InputKind { kText, kJsonLines, kJsonArray };

struct CorpusFile {
  std::string path;
  InputKind kind;
  uint64_t bytes;
};

// --input: comma-separated files and glob(3) patterns; each pattern's matches sorted.
std::vector<std::string> expand_inputs(const std::string& spec) {
  std::vector<std::string> files;
  size_t begin = 0;
  while (begin <= spec.size()) {
    const size_t comma = std::min(spec.find(',', begin), spec.size());
    const std::string pattern = spec.substr(begin, comma - begin);
    begin = comma + 1;
    if (pattern.empty()) continue;
    glob_t matches{};
    const int status = glob(pattern.c_str(), GLOB_ERR, nullptr, &matches);
    std::vector<std::string> found;
    if (status == 0) found.assign(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
    globfree(&matches);
    if (found.empty()) {
      const bool is_pattern = pattern.find_first_of("*?[") != std::string::npos;
      throw InputError(is_pattern ? "--input: no file matches '" + pattern + "'" : "--input " + pattern + ": no such file");
    }
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  FP8LM_INPUT_CHECK(!files.empty(), "--input: no file given");
  return files;
}

InputKind kind_of(const std::string& path) {
  const std::string extension = fs::path(path).extension().string();
  if (extension == ".jsonl") return InputKind::kJsonLines;
  if (extension != ".json") return InputKind::kText;
  // A .json file is one array of records, or one record per line.
  std::ifstream file(path, std::ios::binary);
  char c = 0;
  while (file.get(c) && std::isspace(static_cast<unsigned char>(c))) {
  }
  return file && c == '[' ? InputKind::kJsonArray : InputKind::kJsonLines;
}

// One document, or a cut of a long text document.
struct Piece {
  std::string text;  // the text, or a JSON line still to parse
  bool is_json_line = false;
  bool starts_document = false;
  bool validation = false;
  const CorpusFile* file = nullptr;
  int64_t line = 0;  // JSON lines: 1-based, for errors
};

struct Unit {
  std::vector<Piece> pieces;
  std::vector<uint16_t> train, val;
  // Megatron output: each piece's token count in `train` and whether it starts a document.
  std::vector<size_t> piece_tokens;
  std::vector<bool> piece_starts_document;
  std::exception_ptr error;  // what encoding it threw, rethrown in input order
};

class ValidationSplit {
 public:
  explicit ValidationSplit(double fraction) : fraction_(fraction) {}
  // Whether the next document goes to validation.
  bool next() {
    const uint64_t d = documents_++;
    const bool val = fraction_ > 0 && std::floor(static_cast<double>(d + 1) * fraction_) > std::floor(static_cast<double>(d) * fraction_);
    val_documents_ += val;
    return val;
  }
  uint64_t documents() const { return documents_; }
  uint64_t val_documents() const { return val_documents_; }

 private:
  double fraction_;
  uint64_t documents_ = 0, val_documents_ = 0;
};

// Reads the inputs in order, as pieces of at most about kUnitBytes (one JSON record may be
// longer).
class InputReader {
 public:
  InputReader(const std::vector<CorpusFile>& files, const std::string& json_key, double val_fraction)
      : files_(files), json_key_(json_key), split_(val_fraction) {}

  // The next piece, or false at the end of the inputs.
  bool next(Piece& piece) {
    while (file_index_ < files_.size()) {
      const CorpusFile& file = files_[file_index_];
      if (!open_) open_file(file);
      const bool got = file.kind == InputKind::kText        ? next_text(file, piece)
                       : file.kind == InputKind::kJsonLines ? next_json_line(file, piece)
                                                            : next_array_record(file, piece);
      if (got) {
        piece.file = &file;
        return true;
      }
      close_file();
      ++file_index_;
    }
    return false;
  }

  uint64_t bytes_read() const { return bytes_done_ + file_bytes_read_; }
  const ValidationSplit& split() const { return split_; }

 private:
  void open_file(const CorpusFile& file) {
    open_ = true;
    document_started_ = false;
    text_done_ = false;
    line_ = 0;
    file_bytes_read_ = 0;
    carry_.clear();
    if (file.kind == InputKind::kJsonArray) {
      std::ifstream in(file.path, std::ios::binary);
      try {
        array_ = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        throw InputError(file.path + ": not valid JSON (" + e.what() + ")");
      }
      array_index_ = 0;
      bytes_done_ += file.bytes;
      return;
    }
    stream_ = std::make_unique<std::ifstream>(file.path, std::ios::binary);
    if (!*stream_) throw InputError(file.path + ": cannot open (" + std::strerror(errno) + ")");
  }
  void close_file() {
    if (stream_) bytes_done_ += files_[file_index_].bytes;
    file_bytes_read_ = 0;
    stream_.reset();
    array_ = nlohmann::json();
    open_ = false;
  }

  bool next_text(const CorpusFile& file, Piece& piece) {
    if (text_done_) return false;
    std::string buffer = std::move(carry_);
    carry_.clear();
    for (;;) {
      const size_t old = buffer.size();
      buffer.resize(old + kUnitBytes);
      stream_->read(buffer.data() + old, static_cast<std::streamsize>(kUnitBytes));
      const size_t got = static_cast<size_t>(stream_->gcount());
      buffer.resize(old + got);
      file_bytes_read_ += got;
      if (stream_->bad()) throw InputError(file.path + ": read error");
      if (stream_->eof()) {
        text_done_ = true;
        break;
      }
      // Only the new bytes (and the one before them) can hold a cut the last search missed.
      const size_t cut = gpt2_split_point(buffer, buffer.size() - 1, old == 0 ? 1 : old - 1);
      if (cut > 0) {
        carry_.assign(buffer, cut, std::string::npos);
        buffer.resize(cut);
        break;
      }
    }
    // An empty file is an empty document: its <|endoftext|> alone.
    if (buffer.empty() && document_started_) return false;
    piece.text = std::move(buffer);
    piece.is_json_line = false;
    piece.starts_document = !document_started_;
    if (!document_started_) validation_ = split_.next();
    piece.validation = validation_;
    document_started_ = true;
    return true;
  }

  bool next_json_line(const CorpusFile& file, Piece& piece) {
    std::string line;
    while (std::getline(*stream_, line)) {
      ++line_;
      file_bytes_read_ += line.size() + 1;
      if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
      piece.text = std::move(line);
      piece.is_json_line = true;
      piece.starts_document = true;
      piece.validation = split_.next();
      piece.line = line_;
      return true;
    }
    if (stream_->bad()) throw InputError(file.path + ": read error");
    return false;
  }

  bool next_array_record(const CorpusFile& file, Piece& piece) {
    if (!array_.is_array()) throw InputError(file.path + ": not a JSON array of records");
    if (array_index_ >= array_.size()) return false;
    const nlohmann::json& record = array_[array_index_++];
    piece.text = record_text(record, json_key_, file.path, "record " + std::to_string(array_index_ - 1));
    piece.is_json_line = false;
    piece.starts_document = true;
    piece.validation = split_.next();
    return true;
  }

 public:
  // A record's text: the record itself when it is a string, else its `json_key` field.
  static std::string record_text(const nlohmann::json& record, const std::string& json_key, const std::string& path,
                                 const std::string& where) {
    if (record.is_string()) return record.get<std::string>();
    const auto field = record.is_object() ? record.find(json_key) : record.end();
    if (!record.is_object() || field == record.end()) {
      throw InputError(path + ": " + where + " has no \"" + json_key + "\" field",
                       "records are strings or objects with a --json-key string field");
    }
    if (!field->is_string()) throw InputError(path + ": " + where + ": field \"" + json_key + "\" is not a string");
    return field->get<std::string>();
  }

 private:
  const std::vector<CorpusFile>& files_;
  std::string json_key_;
  ValidationSplit split_;
  size_t file_index_ = 0;
  bool open_ = false;
  std::unique_ptr<std::ifstream> stream_;
  std::string carry_;
  bool document_started_ = false, validation_ = false, text_done_ = false;
  int64_t line_ = 0;
  nlohmann::json array_;
  size_t array_index_ = 0;
  uint64_t bytes_done_ = 0;       // files finished
  uint64_t file_bytes_read_ = 0;  // of the open file
};

// Progress on stderr: bytes, MB/s and the time left. A bar redrawn in place on a terminal;
// otherwise (a log file) a line every 30 s.
class ProgressBar {
 public:
  explicit ProgressBar(uint64_t total_bytes) : total_(total_bytes), terminal_(::isatty(STDERR_FILENO) == 1) {}
  void update(uint64_t done, bool final = false) {
    const double elapsed = seconds_since(start_);
    if (!final && elapsed - last_draw_ < (terminal_ ? 0.2 : 30.0)) return;
    if (!terminal_ && final) return;  // the summary line follows
    last_draw_ = elapsed;
    const double fraction = total_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(done) / static_cast<double>(total_));
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
    const double left = rate > 0 ? static_cast<double>(total_ - std::min(done, total_)) / rate : 0.0;
    if (!terminal_) {
      spdlog::info("tokenize: {:.1f}/{:.1f} MB ({:.1f}%), {:.1f} MB/s, ETA {}:{:02d}", done / 1e6, total_ / 1e6,
                   100 * fraction, rate / 1e6, static_cast<int>(left) / 60, static_cast<int>(left) % 60);
      return;
    }
    constexpr int kWidth = 30;
    const int filled = final ? kWidth : static_cast<int>(fraction * kWidth);
    std::fprintf(stderr, "\rtokenize [%s%s] %5.1f%% %.1f/%.1f MB %6.1f MB/s ETA %d:%02d ",
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(), 100 * fraction, done / 1e6,
                 total_ / 1e6, rate / 1e6, static_cast<int>(left) / 60, static_cast<int>(left) % 60);
    if (final) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
  uint64_t total_;
  bool terminal_;
  Clock::time_point start_ = Clock::now();
  double last_draw_ = 0;
};

void append_ids(const std::vector<int32_t>& ids, std::vector<uint16_t>& out) {
  // The vocabulary was checked to fit uint16 when it was loaded.
  for (const int32_t id : ids) out.push_back(static_cast<uint16_t>(id));
}

// `megatron`: no <|endoftext|> before documents (the writer appends one after each), and each
// piece's extent is recorded so documents can be told apart.
void encode_unit(const Gpt2Tokenizer& tokenizer, const std::string& json_key, Unit& unit, BpeCache& cache,
                 bool megatron) {
  std::vector<int32_t> ids;
  for (const Piece& piece : unit.pieces) {
    ids.clear();
    if (piece.starts_document && !megatron) ids.push_back(tokenizer.end_of_text_id());
    if (piece.is_json_line) {
      const std::string where = "line " + std::to_string(piece.line);
      nlohmann::json record;
      try {
        record = nlohmann::json::parse(piece.text);
      } catch (const nlohmann::json::exception& e) {
        throw InputError(piece.file->path + ": " + where + ": not valid JSON (" + e.what() + ")",
                         "JSONL holds one JSON record per line");
      }
      tokenizer.encode(InputReader::record_text(record, json_key, piece.file->path, where), ids, cache);
    } else {
      tokenizer.encode(piece.text, ids, cache);
    }
    append_ids(ids, piece.validation ? unit.val : unit.train);
    if (megatron) {
      unit.piece_tokens.push_back(ids.size());
      unit.piece_starts_document.push_back(piece.starts_document);
    }
  }
}

TokenizeOptions parse_options(const std::vector<std::string>& args, bool& help) {
  TokenizeOptions o;
  CLI::App app{"fp8lm tokenize: text or JSON/JSONL documents to llm.c token shards with GPT-2's BPE", "fp8lm tokenize"};
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--input", o.input, "Input files: a comma-separated list of files and glob patterns (.txt: one "
                                     "document per file; .json/.jsonl: one document per record)")->required();
  app.add_option("--output", o.output, "Output directory for train_NNNNNN.bin and val_NNNNNN.bin")->required();
  app.add_option("--vocab-file", o.vocab_file, "GPT-2's encoder.json")->required();
  app.add_option("--merge-file", o.merge_file, "GPT-2's vocab.bpe")->required();
  app.add_option("--json-key", o.json_key, "The text field of JSON records");
  app.add_option("--val-fraction", o.val_fraction, "Fraction of the documents that go to val_*.bin, in [0, 1)");
  app.add_option("--shard-tokens", o.shard_tokens, "Tokens per shard at most");
  app.add_option("--tokenizer-type", o.tokenizer_type, "Only GPT2BPETokenizer (Megatron's name)");
  app.add_option("--workers", o.workers, "Threads (0: every core)");
  app.add_option("--output-format", o.output_format,
                 "llmc (train_/val_ shards), megatron (DIR/text_document.bin/.idx, Megatron's indexed dataset; "
                 "split at training time by --split) or hellaswag (a JSONL of ctx/endings/label records to llm.c's "
                 "multiple-choice file DIR/STEM.bin, for --hellaswag-path)")
      ->check(CLI::IsMember({"llmc", "megatron", "hellaswag"}));
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn or error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  if (!parse_subcommand_arguments(app, args, "tokenize")) {
    help = true;
    return o;
  }
  if (o.output_format == "hellaswag") {
    for (const char* flag : {"--val-fraction", "--shard-tokens", "--json-key"})
      FP8LM_INPUT_CHECK(app.count(flag) == 0, flag, ": not used with --output-format hellaswag (its records are "
                        "ctx, endings and label, every one written)");
  }
  if (o.output_format == "megatron") {
    FP8LM_INPUT_CHECK(app.count("--val-fraction") == 0, "--val-fraction: not used with --output-format megatron ",
                      "HINT: a Megatron dataset is split at training time by --split (e.g. --split 969,30,1)");
    FP8LM_INPUT_CHECK(app.count("--shard-tokens") == 0,
                      "--shard-tokens: not used with --output-format megatron (one .bin/.idx pair holds every document)");
    o.val_fraction = 0;
  }
  FP8LM_INPUT_CHECK(o.tokenizer_type == "GPT2BPETokenizer", "--tokenizer-type ", o.tokenizer_type,
                    ": not supported HINT: only GPT2BPETokenizer (byte-level BPE from encoder.json and vocab.bpe)");
  FP8LM_INPUT_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "--val-fraction ", o.val_fraction, ": must be in [0, 1)");
  FP8LM_INPUT_CHECK(o.shard_tokens >= 1 && o.shard_tokens <= INT32_MAX, "--shard-tokens ", o.shard_tokens,
                    ": must be in [1, 2147483647] (the llm.c header holds an int32 count)");
  FP8LM_INPUT_CHECK(o.workers >= 0, "--workers ", o.workers, ": must be >= 0 (0: every core)");
  FP8LM_INPUT_CHECK(!o.json_key.empty(), "--json-key: must not be empty");
  return o;
}

// --output-format hellaswag: the records of one JSONL file, tokenized as llm.c's
// render_example does, to DIR/STEM.bin. Every problem names the file and line.
int write_hellaswag(const std::string& input, const fs::path& out_dir, const Gpt2Tokenizer& tokenizer) {
  FP8LM_INPUT_CHECK(kind_of(input) == InputKind::kJsonLines, "--input ", input,
                    ": --output-format hellaswag reads one .jsonl file of ctx/endings/label records");
  std::ifstream in(input, std::ios::binary);
  FP8LM_INPUT_CHECK(in.good(), "--input ", input, ": cannot be read");
  std::vector<ChoiceExample> examples;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = input + ":" + std::to_string(number);
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(where + ": not JSON (" + e.what() + ")");
    }
    FP8LM_INPUT_CHECK(record.is_object() && record.contains("ctx") && record["ctx"].is_string() &&
                          record.contains("endings") && record["endings"].is_array() && record.contains("label") &&
                          record["label"].is_number_integer(),
                      where, ": a record needs \"ctx\" (a string), \"endings\" (strings) and \"label\" (an integer)");
    ChoiceExample example;
    example.index = int64_t(examples.size());
    example.label = record["label"].get<int>();
    example.context = tokenizer.encode(record["ctx"].get<std::string>());
    for (const nlohmann::json& ending : record["endings"]) {
      FP8LM_INPUT_CHECK(ending.is_string(), where, ": every ending must be a string");
      example.endings.push_back(tokenizer.encode(" " + ending.get<std::string>()));  // as llm.c: a space first
    }
    FP8LM_INPUT_CHECK(example.endings.size() >= 2 && example.label >= 0 && size_t(example.label) < example.endings.size(),
                      where, ": label ", example.label, " is not one of its ", example.endings.size(),
                      " endings (2 or more)");
    FP8LM_INPUT_CHECK(!example.context.empty(), where, ": an empty ctx leaves nothing to predict the first ending from");
    examples.push_back(std::move(example));
    FP8LM_INPUT_CHECK(examples.size() < 65536, input, ": more than 65,535 records (llm.c's file numbers them in uint16)");
  }
  FP8LM_INPUT_CHECK(!examples.empty(), "--input ", input, ": no records");
  const fs::path output = out_dir / (fs::path(input).stem().string() + ".bin");
  FP8LM_INPUT_CHECK(!fs::exists(output), "--output ", out_dir.string(), ": ", output.filename().string(),
                    " exists already HINT: use another directory, or delete it");
  write_file_durably(output.string(), choice_file_bytes(examples));
  spdlog::info("tokenize: {} multiple-choice examples to {} (score with --hellaswag-path {})", examples.size(),
               output.string(), output.string());
  return kExitOk;
}

// Refuses a directory that already holds shards: a glob over it would mix two runs.
void check_output_dir(const fs::path& dir) {
  std::error_code error;
  if (fs::exists(dir, error)) {
    FP8LM_INPUT_CHECK(fs::is_directory(dir, error), "--output ", dir.string(), ": not a directory");
    for (const auto& entry : fs::directory_iterator(dir, error)) {
      const std::string name = entry.path().filename().string();
      const bool shard = ((name.rfind("train_", 0) == 0 || name.rfind("val_", 0) == 0) &&
                          (name.ends_with(".bin") || name.ends_with(".bin.tmp"))) ||
                         name.rfind(std::string(kMegatronOutputName) + ".", 0) == 0;
      if (shard) {
        throw InputError("--output " + dir.string() + ": already holds shards (" + name + ")",
                         "use an empty directory, or delete the old train_*/val_*/text_document.* files");
      }
    }
  }
  fs::create_directories(dir, error);
  FP8LM_INPUT_CHECK(!error, "--output ", dir.string(), ": cannot create the directory (", error.message(), ")");
}

}  // namespace

int run_tokenize_command(const std::vector<std::string>& args) {
  bool help = false;
  const TokenizeOptions o = parse_options(args, help);
  if (help) return kExitOk;
  init_logging(o.log_level);

  // Everything that can be checked is checked before any work.
  const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(o.vocab_file, o.merge_file);
  FP8LM_INPUT_CHECK(tokenizer.vocab_size() <= 65536, o.vocab_file, ": ", tokenizer.vocab_size(),
                    " tokens do not fit the uint16 tokens of llm.c shards");
  std::vector<CorpusFile> files;
  uint64_t total_bytes = 0;
  for (const std::string& path : expand_inputs(o.input)) {
    const uint64_t bytes = InputFile::open(path).size();  // the one rule: a readable regular file
    files.push_back({path, kind_of(path), bytes});
    total_bytes += bytes;
  }
  const bool only_text = std::all_of(files.begin(), files.end(), [](const CorpusFile& f) { return f.kind == InputKind::kText; });
  if (only_text && o.val_fraction > 0 && std::floor(static_cast<double>(files.size()) * o.val_fraction) < 1) {
    throw InputError(detail::concat("--val-fraction ", o.val_fraction, " of ", files.size(),
                                    " document(s) puts none in validation (a text file is one document)"),
                     "give more text files or JSONL with one document per line, or --val-fraction 0 for no val split");
  }
  const fs::path out_dir(o.output);
  check_output_dir(out_dir);
  if (o.output_format == "hellaswag") {
    FP8LM_INPUT_CHECK(files.size() == 1, "--input ", o.input, ": --output-format hellaswag takes one .jsonl file, got ",
                      files.size());
    return write_hellaswag(files.front().path, out_dir, tokenizer);
  }

  const int workers = o.workers > 0 ? o.workers : omp_get_max_threads();
  spdlog::info("tokenize: {} file(s), {:.1f} MB, {} workers, GPT-2 BPE ({} tokens, {} merges) -> {}", files.size(),
               total_bytes / 1e6, workers, tokenizer.vocab_size(), tokenizer.num_merges(), out_dir.string());

  std::vector<fs::path> written;
  try {
    const bool megatron = o.output_format == "megatron";
    ShardWriter train(out_dir, "train", o.shard_tokens, written);
    ShardWriter val(out_dir, "val", o.shard_tokens, written);
    std::optional<IndexedDatasetWriter> indexed;
    if (megatron) indexed.emplace((out_dir / kMegatronOutputName).string(), tokenizer.vocab_size(), &written);
    const uint16_t end_of_text = static_cast<uint16_t>(tokenizer.end_of_text_id());
    bool document_open = false;
    InputReader reader(files, o.json_key, o.val_fraction);
    std::vector<BpeCache> caches(workers);
    ProgressBar progress(total_bytes);
    const auto start = std::chrono::steady_clock::now();
    bool more = true;
    while (more) {
      // A batch of units, each about kUnitBytes of text.
      std::vector<Unit> units;
      while (more && units.size() < static_cast<size_t>(workers * kUnitsPerWorker)) {
        Unit unit;
        size_t bytes = 0;
        Piece piece;
        while (bytes < kUnitBytes && (more = reader.next(piece))) {
          bytes += piece.text.size();
          unit.pieces.push_back(std::move(piece));
          piece = Piece{};
        }
        if (!unit.pieces.empty()) units.push_back(std::move(unit));
      }
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers)
      for (size_t u = 0; u < units.size(); ++u) {
        try {
          encode_unit(tokenizer, o.json_key, units[u], caches[omp_get_thread_num()], megatron);
        } catch (...) {  // an exception must not leave an OpenMP region
          units[u].error = std::current_exception();
        }
      }
      for (Unit& unit : units) {
        if (unit.error) std::rethrow_exception(unit.error);  // the first error in input order
        if (megatron) {
          size_t offset = 0;
          for (size_t p = 0; p < unit.piece_tokens.size(); ++p) {
            if (unit.piece_starts_document[p] && document_open) {
              indexed->append(&end_of_text, 1);
              indexed->end_document();
            }
            document_open = true;
            indexed->append(unit.train.data() + offset, unit.piece_tokens[p]);
            offset += unit.piece_tokens[p];
          }
          continue;
        }
        train.append(unit.train.data(), unit.train.size());
        val.append(unit.val.data(), unit.val.size());
      }
      progress.update(reader.bytes_read());
    }
    FP8LM_INPUT_CHECK(reader.split().documents() > 0, "--input ", o.input, ": no documents in ", files.size(),
                      " file(s) (JSON inputs hold no records)");
    train.finish();
    val.finish();
    if (megatron) {
      if (document_open) {
        indexed->append(&end_of_text, 1);
        indexed->end_document();
      }
      indexed->finish();
    }
    progress.update(total_bytes, true);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const ValidationSplit& split = reader.split();
    if (megatron) {
      spdlog::info("tokenize: {} documents, {:.1f} MB in {:.2f} s ({:.1f} MB/s): {} tokens in {}.bin/.idx "
                   "(Megatron indexed dataset; train with --data-path {})",
                   indexed->documents(), total_bytes / 1e6, seconds, seconds > 0 ? total_bytes / 1e6 / seconds : 0.0,
                   indexed->total_tokens(), (out_dir / kMegatronOutputName).string(),
                   (out_dir / kMegatronOutputName).string());
      return kExitOk;
    }
    spdlog::info("tokenize: {} documents ({} val), {:.1f} MB in {:.2f} s ({:.1f} MB/s): {} train tokens in {} shard(s), "
                 "{} val tokens in {} shard(s)",
                 split.documents(), split.val_documents(), total_bytes / 1e6, seconds,
                 seconds > 0 ? total_bytes / 1e6 / seconds : 0.0, train.total_tokens(), train.shards(),
                 val.total_tokens(), val.shards());
    if (o.val_fraction > 0 && split.val_documents() == 0) {
      spdlog::warn("tokenize: --val-fraction {} of {} documents put none in validation: no val shard was written",
                   o.val_fraction, split.documents());
    }
  } catch (...) {
    std::error_code ignored;
    for (const fs::path& path : written) fs::remove(path, ignored);
    throw;
  }
  return kExitOk;
}

}  // namespace fp8lm
