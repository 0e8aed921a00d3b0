// Megatron-LM indexed datasets (core/indexed_dataset.h): the byte layout, validation, splits,
// blends, `fp8lm tokenize --output-format megatron` and training with --data-path.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "cli_testing.h"
#include "core/error.h"
#include "core/indexed_dataset.h"
#include "core/token_data.h"
#include "core/tokenizer.h"
#include "byte_vocabulary.h"
#include "error_testing.h"
#include "temp_dir.h"

namespace fp8lm {
namespace {

namespace fs = std::filesystem;
using Catch::Matchers::ContainsSubstring;
using testing::run_fp8lm;
using testing::TempDir;
using testing::ByteVocabulary;
using testing::write_byte_vocabulary;
using testing::input_error_message;

std::string read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

template <typename T>
void put(std::string& out, T value) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

// An index in the layout documented in core/indexed_dataset.h, built byte by byte.
std::string handmade_index(uint8_t dtype_code, const std::vector<int32_t>& lengths, const std::vector<int64_t>& pointers,
                           const std::vector<int64_t>& document_indices) {
  std::string idx("MMIDIDX\0\0", 9);
  put<uint64_t>(idx, 1);
  put<uint8_t>(idx, dtype_code);
  put<uint64_t>(idx, lengths.size());
  put<uint64_t>(idx, document_indices.size());
  for (int32_t v : lengths) put(idx, v);
  for (int64_t v : pointers) put(idx, v);
  for (int64_t v : document_indices) put(idx, v);
  return idx;
}

std::vector<std::vector<uint16_t>> sample_documents() {
  return {{1, 2, 3}, {}, {4}, {5, 6, 7, 8, 9}, {50256, 0, 65}};
}

void write_dataset(const std::string& prefix, const std::vector<std::vector<uint16_t>>& documents,
                   int64_t vocab_size = 50257) {
  IndexedDatasetWriter writer(prefix, vocab_size);
  for (const auto& document : documents) writer.add_document(document);
  writer.finish();
}

// Documents of `tokens_each` tokens whose values encode the source (tag * 100 + i % 50), so a
// sample's first token tells which source it came from.
std::vector<std::vector<uint16_t>> tagged_documents(int tag, int count, int tokens_each) {
  std::vector<std::vector<uint16_t>> documents;
  for (int d = 0; d < count; ++d) {
    std::vector<uint16_t> document;
    for (int t = 0; t < tokens_each; ++t) document.push_back(uint16_t(tag * 100 + (d * tokens_each + t) % 50));
    documents.push_back(document);
  }
  return documents;
}

// `documents` documents of random tokens below 256 (the tiny model's vocabulary), document d
// 20 + d % length_period tokens long, drawn from `seed`: PREFIX.bin and PREFIX.idx at `prefix`.
void write_random_dataset(const std::string& prefix, uint64_t seed, int documents, int length_period) {
  IndexedDatasetWriter writer(prefix, 256);
  uint64_t state = seed;
  for (int d = 0; d < documents; ++d) {
    std::vector<uint16_t> document;
    for (int t = 0; t < 20 + d % length_period; ++t) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      document.push_back(uint16_t((state >> 33) % 256));
    }
    writer.add_document(document);
  }
  writer.finish();
}

// `command` exits 2 before any work, its message naming `named` (a flag or a file).
void expect_refused(const std::string& command, const std::string& named) {
  const auto result = run_fp8lm(command);
  INFO(command << "\n" << result.output);
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.output, ContainsSubstring(named));
}

}  // namespace

TEST_CASE("indexed dataset: the writer's documents read back exactly, uint16 and int32", "[indexed]") {
  TempDir dir;
  for (const int64_t vocab : {int64_t{50257}, int64_t{65500}}) {
    INFO("vocab " << vocab);
    const std::string prefix = dir.file("data_" + std::to_string(vocab));
    write_dataset(prefix, sample_documents(), vocab);
    CHECK(!fs::exists(prefix + ".bin.tmp"));
    CHECK(!fs::exists(prefix + ".idx.tmp"));
    const IndexedDataset dataset = IndexedDataset::open(prefix);
    // Megatron's choice: uint16 below 65500 tokens, int32 from there.
    CHECK(dataset.dtype_code() == (vocab < 65500 ? IndexedDtypeCode::uint16 : IndexedDtypeCode::int32));
    REQUIRE(dataset.num_documents() == sample_documents().size());
    CHECK(dataset.num_sequences() == sample_documents().size());
    CHECK(dataset.num_tokens() == 12);
    for (size_t d = 0; d < sample_documents().size(); ++d) {
      CHECK(dataset.read_document(d, 50257) == sample_documents()[d]);
    }
    CHECK(fs::file_size(prefix + ".bin") == 12 * (vocab < 65500 ? 2u : 4u));
  }
}

TEST_CASE("indexed dataset: the byte layout is Megatron's, pinned by hand-built files", "[indexed]") {
  TempDir dir;
  SECTION("the writer writes exactly the documented bytes") {
    write_dataset(dir.file("w"), {{7, 8}, {9}});
    const std::string expected = handmade_index(8, {2, 1}, {0, 4}, {0, 1, 2});
    CHECK(read_bytes(dir.file("w.idx")) == expected);
    CHECK(expected.size() == 34 + 2 * 4 + 2 * 8 + 3 * 8);
    std::string bin;
    for (uint16_t t : {7, 8, 9}) put(bin, t);
    CHECK(read_bytes(dir.file("w.bin")) == bin);
  }
  SECTION("a hand-built int32 dataset with two sequences in one document is read") {
    // Document 0 is sequences 0 and 1 (as preprocess_data.py --split-sentences writes), document 1 is sequence 2.
    write_bytes(dir.file("h.idx"), handmade_index(4, {2, 3, 1}, {0, 8, 20}, {0, 2, 3}));
    std::string bin;
    for (int32_t t : {10, 11, 12, 13, 14, 15}) put(bin, t);
    write_bytes(dir.file("h.bin"), bin);
    const IndexedDataset dataset = IndexedDataset::open(dir.file("h"));
    CHECK(dataset.dtype_code() == IndexedDtypeCode::int32);
    CHECK(dataset.num_sequences() == 3);
    REQUIRE(dataset.num_documents() == 2);
    CHECK(dataset.read_document(0, 256) == std::vector<uint16_t>{10, 11, 12, 13, 14});
    CHECK(dataset.read_document(1, 256) == std::vector<uint16_t>{15});
    CHECK(dataset.document_span(1, 2).first_byte == 20);
    CHECK(dataset.document_span(0, 2).tokens == 6);
  }
  SECTION("uint8 and int64 token files are read too") {
    write_bytes(dir.file("u8.idx"), handmade_index(1, {3}, {0}, {0, 1}));
    write_bytes(dir.file("u8.bin"), std::string("\x01\x02\xff", 3));
    CHECK(IndexedDataset::open(dir.file("u8")).read_document(0, 256) == std::vector<uint16_t>{1, 2, 255});
    write_bytes(dir.file("i64.idx"), handmade_index(5, {2}, {0}, {0, 1}));
    std::string bin;
    put<int64_t>(bin, 3);
    put<int64_t>(bin, 50000);
    write_bytes(dir.file("i64.bin"), bin);
    CHECK(IndexedDataset::open(dir.file("i64")).read_document(0, 50257) == std::vector<uint16_t>{3, 50000});
  }
}

TEST_CASE("indexed dataset: a truncated .idx or .bin is refused naming the file and the offset", "[indexed]") {
  TempDir dir;
  write_dataset(dir.file("good"), sample_documents());
  const std::string idx = read_bytes(dir.file("good.idx"));
  const std::string bin = read_bytes(dir.file("good.bin"));
  // Cuts inside the magic, the version, the dtype, the counts, each array, and one byte short.
  for (const size_t cut : {size_t{0}, size_t{5}, size_t{12}, size_t{17}, size_t{30}, size_t{40}, size_t{60},
                           size_t{100}, idx.size() - 1}) {
    INFO("cut at " << cut);
    write_bytes(dir.file("t.idx"), idx.substr(0, cut));
    write_bytes(dir.file("t.bin"), bin);
    const std::string message = input_error_message([&] { IndexedDataset::open(dir.file("t")); });
    CHECK_THAT(message, ContainsSubstring(dir.file("t.idx") + ": truncated at byte offset " + std::to_string(cut)));
  }
  write_bytes(dir.file("t.idx"), idx);
  write_bytes(dir.file("t.bin"), bin.substr(0, bin.size() - 3));
  const std::string message = input_error_message([&] { IndexedDataset::open(dir.file("t")); });
  CHECK_THAT(message, ContainsSubstring(dir.file("t.bin") + ": truncated at byte offset " + std::to_string(bin.size() - 3)));
  CHECK_THAT(message, ContainsSubstring("up to byte offset " + std::to_string(bin.size())));
  // A missing file is named too.
  fs::remove(dir.file("t.bin"));
  CHECK_THAT(input_error_message([&] { IndexedDataset::open(dir.file("t")); }), ContainsSubstring(dir.file("t.bin")));
  CHECK_THAT(input_error_message([&] { IndexedDataset::open(dir.file("nope")); }), ContainsSubstring(dir.file("nope.idx")));
}

TEST_CASE("indexed dataset: bad magic, version, dtype, pointers or document indices are refused", "[indexed]") {
  TempDir dir;
  write_bytes(dir.file("x.bin"), std::string(6, '\0'));  // three uint16 tokens
  auto error_for = [&](const std::string& index) {
    write_bytes(dir.file("x.idx"), index);
    return input_error_message([&] { IndexedDataset::open(dir.file("x")); });
  };
  const std::string good = handmade_index(8, {3}, {0}, {0, 1});
  write_bytes(dir.file("x.idx"), good);
  CHECK(IndexedDataset::open(dir.file("x")).num_documents() == 1);

  std::string bad = good;
  bad[3] = 'X';
  CHECK_THAT(error_for(bad), ContainsSubstring(dir.file("x.idx") + ": bad magic at byte offset 0"));
  bad = good;
  bad[9] = 2;
  CHECK_THAT(error_for(bad), ContainsSubstring("unsupported version 2 at byte offset 9"));
  for (const uint8_t code : {uint8_t{0}, uint8_t{6}, uint8_t{7}, uint8_t{9}}) {
    bad = good;
    bad[17] = char(code);
    CHECK_THAT(error_for(bad), ContainsSubstring("dtype code " + std::to_string(code) + " at byte offset 17"));
  }
  CHECK_THAT(error_for(handmade_index(8, {3}, {2}, {0, 1})),
             ContainsSubstring("sequence 0 points to byte 2 of the .bin (byte offset 38)"));
  CHECK_THAT(error_for(handmade_index(8, {-3}, {0}, {0, 1})), ContainsSubstring("negative length -3 (byte offset 34)"));
  CHECK_THAT(error_for(handmade_index(8, {3}, {0}, {0, 2})), ContainsSubstring("document index 1 is 2 (byte offset 54)"));
  CHECK_THAT(error_for(handmade_index(8, {1, 2}, {0, 2}, {1, 2})), ContainsSubstring("document index 0 is 1"));
  CHECK_THAT(error_for(good + "\x01"), ContainsSubstring("(a multimodal dataset)"));
  CHECK_THAT(error_for(good + "\x01\x02"), ContainsSubstring("2 unexpected bytes after byte offset 62"));
  CHECK_THAT(error_for(handmade_index(8, {2}, {0}, {0, 1})), ContainsSubstring(dir.file("x.bin") + ": 2 bytes after byte offset 4"));
}

TEST_CASE("indexed dataset: a token id >= the vocabulary is an error naming the file and offset", "[indexed]") {
  TempDir dir;
  write_dataset(dir.file("d"), {{1, 2, 3, 4}, {5, 300, 6, 7}});
  DataLoaderOptions options;
  options.seq_len = 3;
  options.vocab_size = 256;
  const DataBlend blend = parse_data_path({dir.file("d")});
  const std::string message =
      input_error_message([&] { open_indexed_loader(blend, parse_split("1"), DataSplit::train, options); });
  CHECK_THAT(message, ContainsSubstring(dir.file("d.bin") + ": token 300 at index 5 is >= vocab_size 256 (byte offset 10)"));
  // The same through an int32 dataset: a negative id too.
  write_bytes(dir.file("n.idx"), handmade_index(4, {4}, {0}, {0, 1}));
  std::string bin;
  for (int32_t t : {1, 2, -7, 3}) put(bin, t);
  write_bytes(dir.file("n.bin"), bin);
  CHECK_THAT(input_error_message([&] { open_indexed_loader(parse_data_path({dir.file("n")}), parse_split("1"),
                                                            DataSplit::train, options); }),
             ContainsSubstring(dir.file("n.bin") + ": token -7 at index 2 is negative (byte offset 8)"));
}

TEST_CASE("split: Megatron's fractions of the documents, disjoint and covering", "[indexed]") {
  auto range = [](const std::string& split, DataSplit which, uint64_t n) {
    return split_documents(parse_split(split), which, n);
  };
  CHECK(range("969,30,1", DataSplit::train, 1000)->end == 969);
  CHECK(range("969,30,1", DataSplit::valid, 1000)->begin == 969);
  CHECK(range("969,30,1", DataSplit::valid, 1000)->end == 999);
  CHECK(range("969,30,1", DataSplit::test, 1000)->end == 1000);
  CHECK(!range("98,2,0", DataSplit::test, 1000));
  CHECK(!range("1", DataSplit::valid, 10));
  CHECK(range("1", DataSplit::train, 10)->end == 10);
  // Python's round() rounds half to even: 2.5 -> 2.
  CHECK(range("1,1", DataSplit::train, 5)->end == 2);
  CHECK(range("1,1", DataSplit::valid, 5)->begin == 2);
  CHECK(range("3/1/1", DataSplit::valid, 5)->begin == 3);

  for (const std::string split : {"969,30,1", "1,1,1", "98,2,0", "0,1,1", "10,0,1", "0.5,0.25,0.25"}) {
    for (uint64_t n : {0, 1, 2, 3, 7, 100, 12345}) {
      INFO(split << " of " << n);
      uint64_t next = 0;
      for (DataSplit which : {DataSplit::train, DataSplit::valid, DataSplit::test}) {
        const auto r = range(split, which, n);
        if (!r) continue;
        CHECK(r->begin == next);
        CHECK(r->end >= r->begin);
        next = r->end;
      }
      CHECK(next == n);
    }
  }
  for (const std::string bad : {"", "a,b", "1,-1", "1,2,3,4", "0,0,0", "1,,2"}) {
    INFO("'" << bad << "'");
    CHECK_THAT(input_error_message([&] { parse_split(bad); }), ContainsSubstring("--split"));
  }
}

TEST_CASE("data path: one prefix or weight/prefix pairs, normalised", "[indexed]") {
  const DataBlend one = parse_data_path({"a/b"});
  CHECK(one.prefixes == std::vector<std::string>{"a/b"});
  CHECK(one.weights == std::vector<double>{1.0});
  const DataBlend two = parse_data_path({"3", "A", "1", "B"});
  CHECK(two.prefixes == std::vector<std::string>{"A", "B"});
  CHECK(two.weights == std::vector<double>{0.75, 0.25});
  for (const auto& bad : std::vector<std::vector<std::string>>{{}, {"0.3", "A", "0.7"}, {"A", "B"}, {"0", "A", "1", "B"},
                                                              {"-1", "A", "2", "B"}, {"x1", "A", "1", "B"}}) {
    CHECK_THAT(input_error_message([&] { parse_data_path(bad); }), ContainsSubstring("--data-path"));
  }
}

TEST_CASE("a blend draws samples in proportion to the weights, deterministically and resumably", "[indexed]") {
  TempDir dir;
  write_dataset(dir.file("a"), tagged_documents(1, 20, 9));  // 180 tokens: 44 samples of 4 (+1 token)
  write_dataset(dir.file("b"), tagged_documents(2, 10, 9));  // 90 tokens: 22 samples
  DataLoaderOptions options;
  options.seq_len = 4;
  options.micro_batch_size = 3;
  options.vocab_size = 256;
  const DataBlend blend = parse_data_path({"0.3", dir.file("a"), "0.7", dir.file("b")});
  std::optional<DataLoader> loader = open_indexed_loader(blend, parse_split("1"), DataSplit::train, options);
  REQUIRE(loader);
  REQUIRE(loader->num_sources() == 2);
  CHECK(loader->samples_per_epoch() == 44 + 22);
  CHECK(loader->source_samples_per_epoch(0) + loader->source_samples_per_epoch(1) == loader->steps_per_epoch() * 3);

  // Two epochs and a half: after every sample, each source's count is within one of its share.
  std::vector<int32_t> inputs(12), targets(12);
  std::map<int, uint64_t> counts;
  std::map<int, std::vector<int32_t>> seen_b;  // B's samples, to check it repeats only across its epochs
  uint64_t drawn = 0;
  std::vector<std::vector<int32_t>> batches;
  for (int step = 0; step < 55; ++step) {
    const DataPosition before = loader->position();
    loader->next_batch(inputs.data(), targets.data());
    batches.push_back(inputs);
    for (int b = 0; b < 3; ++b) {
      const int tag = inputs[size_t(b) * 4] / 100;
      REQUIRE((tag == 1 || tag == 2));
      ++counts[tag];
      const uint64_t in_epoch = before.next_sample + uint64_t(b) + 1;
      const double a_share = 0.3 * double(in_epoch);
      if (before.epoch == 0) {
        CHECK(std::abs(double(counts[1]) - a_share) <= 1.0);
        CHECK(std::abs(double(counts[2]) - (double(in_epoch) - a_share)) <= 1.0);
      }
    }
    drawn += 3;
  }
  CHECK(std::abs(double(counts[1]) / double(drawn) - 0.3) < 0.02);

  // The same seed gives the same batches; resuming at a saved position reads what reading on reads.
  std::optional<DataLoader> again = open_indexed_loader(blend, parse_split("1"), DataSplit::train, options);
  for (int step = 0; step < 30; ++step) again->next_batch(inputs.data(), targets.data());
  const DataPosition saved = again->position();
  std::optional<DataLoader> resumed = open_indexed_loader(blend, parse_split("1"), DataSplit::train, options);
  resumed->set_position(saved);
  for (int step = 30; step < 55; ++step) {
    INFO("step " << step);
    resumed->next_batch(inputs.data(), targets.data());
    CHECK(inputs == batches[size_t(step)]);
  }

  // Two data-parallel ranks together read what one rank reads.
  DataLoaderOptions rank_options = options;
  rank_options.micro_batch_size = 1;
  rank_options.data_parallel_size = 3;
  std::vector<std::vector<int32_t>> per_rank;
  for (int rank = 0; rank < 3; ++rank) {
    rank_options.data_parallel_rank = rank;
    std::optional<DataLoader> r = open_indexed_loader(blend, parse_split("1"), DataSplit::train, rank_options);
    std::vector<int32_t> all;
    std::vector<int32_t> in(4), tg(4);
    for (int step = 0; step < 20; ++step) {
      r->next_batch(in.data(), tg.data());
      all.insert(all.end(), in.begin(), in.end());
    }
    per_rank.push_back(all);
  }
  for (int step = 0; step < 20; ++step) {
    for (int rank = 0; rank < 3; ++rank) {
      const std::vector<int32_t> expected(batches[size_t(step)].begin() + rank * 4, batches[size_t(step)].begin() + rank * 4 + 4);
      const std::vector<int32_t> got(per_rank[size_t(rank)].begin() + step * 4, per_rank[size_t(rank)].begin() + step * 4 + 4);
      CHECK(got == expected);
    }
  }
}

TEST_CASE("a source's samples are each read once per source epoch", "[indexed]") {
  std::vector<std::vector<TokenShard>> sources(2);
  std::vector<uint16_t> a, b;
  for (int i = 0; i < 41; ++i) a.push_back(uint16_t(i));        // 10 samples of 4: first tokens 0, 4, ..., 36
  for (int i = 0; i < 21; ++i) b.push_back(uint16_t(100 + i));  // 5 samples
  sources[0].push_back(TokenShard::from_tokens(a, "a", 256, 5));
  sources[1].push_back(TokenShard::from_tokens(b, "b", 256, 5));
  DataLoaderOptions options;
  options.seq_len = 4;
  options.vocab_size = 256;
  DataLoader loader(std::move(sources), {0.5, 0.5}, options);
  // 15 picks per epoch: 8 from a, 7 from b; b's second source epoch starts within the first.
  std::vector<int32_t> firsts;
  std::vector<int32_t> in(4), tg(4);
  for (int i = 0; i < 30; ++i) {
    loader.next_batch(in.data(), tg.data());
    firsts.push_back(in[0]);
  }
  std::vector<int32_t> from_b;
  for (int32_t f : firsts) {
    if (f >= 100) from_b.push_back(f);
  }
  REQUIRE(from_b.size() >= 10);
  for (size_t epoch = 0; epoch < 2; ++epoch) {
    std::set<int32_t> distinct(from_b.begin() + epoch * 5, from_b.begin() + epoch * 5 + 5);
    CHECK(distinct.size() == 5);
  }
}

TEST_CASE("tokenize --output-format megatron writes one document per input document, EOD after each", "[indexed][cli]") {
  TempDir dir;
  const ByteVocabulary files = write_byte_vocabulary(dir);
  const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(files.vocab_file, files.merge_file);

  std::vector<std::string> texts;
  std::ofstream jsonl(dir.file("docs.jsonl"));
  for (int i = 0; i < 40; ++i) {
    texts.push_back("Document " + std::to_string(i) + " says hello to the indexed dataset. " + std::string(size_t(i % 7), 'x'));
    jsonl << nlohmann::json{{"text", texts.back()}}.dump() << "\n";
  }
  jsonl.close();
  const std::string flags = " --vocab-file " + files.vocab_file + " --merge-file " + files.merge_file;
  const auto run = run_fp8lm("tokenize --output-format megatron --input " + dir.file("docs.jsonl") + " --output " +
                             dir.file("out") + flags);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("--data-path " + dir.file("out/text_document")));
  const IndexedDataset dataset = IndexedDataset::open(dir.file("out/text_document"));
  REQUIRE(dataset.num_documents() == texts.size());
  for (size_t d = 0; d < texts.size(); ++d) {
    std::vector<uint16_t> expected;
    for (int32_t id : tokenizer.encode(texts[d])) expected.push_back(uint16_t(id));
    expected.push_back(257);
    CHECK(dataset.read_document(d, 258) == expected);
  }
  for (const auto& entry : fs::directory_iterator(dir.file("out"))) {
    CHECK(entry.path().extension() != ".tmp");
  }

  // --val-fraction belongs to llm.c output; a second run into the same directory is refused.
  const auto val = run_fp8lm("tokenize --output-format megatron --val-fraction 0.1 --input " + dir.file("docs.jsonl") +
                             " --output " + dir.file("out2") + flags);
  CHECK(val.exit_code == 2);
  CHECK_THAT(val.output, ContainsSubstring("--val-fraction"));
  const auto again = run_fp8lm("tokenize --output-format megatron --input " + dir.file("docs.jsonl") + " --output " +
                               dir.file("out") + flags);
  CHECK(again.exit_code == 2);
  CHECK_THAT(again.output, ContainsSubstring("text_document"));

  // The tiny model's 256-token vocabulary cannot hold <|endoftext|> (257): refused before training.
  const std::string train = "train --config " + testing::source_path("configs/tiny.json") +
                            " --device cpu --seq-length 16 --micro-batch-size 2 --train-iters 2 --eval-iters 0 "
                            "--log-level warn --data-path " + dir.file("out/text_document");
  const auto refused = run_fp8lm(train);
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, ContainsSubstring(dir.file("out/text_document.bin") + ": token 257 at index "));
  CHECK_THAT(refused.output, ContainsSubstring("(byte offset "));
  const auto trained = run_fp8lm(train + " --vocab-size 258 --split 9,1,0 --eval-interval 2 --eval-iters 1");
  INFO(trained.output);
  CHECK(trained.exit_code == 0);
}

TEST_CASE("data-path flags are validated before any work, naming the flag or file", "[indexed][cli]") {
  TempDir dir;
  write_dataset(dir.file("d"), tagged_documents(1, 10, 9));
  const std::string base = "train --config " + testing::source_path("configs/tiny.json") +
                           " --device cpu --seq-length 8 --micro-batch-size 2 --train-iters 1 --log-level warn ";
  auto expect_error = [&](const std::string& args, const std::string& named) { expect_refused(base + args, named); };
  expect_error("--data-path 0.3 " + dir.file("d") + " 0.7", "--data-path");
  expect_error("--data-path x " + dir.file("d") + " 1 " + dir.file("d"), "--data-path");
  expect_error("--data-path " + dir.file("d") + " --split 1,x", "--split");
  expect_error("--data-path " + dir.file("d") + " --split 0,1,0", "--split");
  expect_error("--train-data-path " + dir.file("d.bin") + " --split 1,1,0", "--split needs --data-path");
  // Megatron scripts swap --data-path for --mock-data and keep their --split: accepted, and
  // shown at start-up as having no effect.
  const auto mock = run_fp8lm(base + "--mock-data --split 1,1,0 --log-level info");
  CHECK(mock.exit_code == 0);
  CHECK_THAT(mock.output, ContainsSubstring("--split 1,1,0 with --mock-data: the mock stream has no documents"));
  expect_error("--data-path " + dir.file("d") + " --train-data-path " + dir.file("d.bin"), "--data-path contradicts");
  expect_error("--data-path " + dir.file("d") + " --mock-data", "--data-path contradicts --mock-data");
  expect_error("--data-path " + dir.file("d") + " --data-format raw-uint16", "--data-format");
  expect_error("--data-path " + dir.file("missing"), dir.file("missing.idx"));
  expect_error("--data-path 1 " + dir.file("d") + " 1 " + dir.file("missing"), dir.file("missing.idx"));
  // The valid split of 10 documents at 99,1,0 is empty-ish: 0 documents, fewer tokens than one sample.
  expect_error("--data-path " + dir.file("d") + " --split 99,1,0", "the valid split (documents 10 to 10 of 10)");
}

TEST_CASE("training on a --data-path blend resumes bit-exactly", "[indexed][cli][checkpoint]") {
  TempDir dir;
  // Random tokens below the tiny model's vocabulary, in documents of varied lengths.
  for (const char* name : {"a", "b"}) write_random_dataset(dir.file(name), name[0], 60, 13);
  const std::string args = "train --config " + testing::source_path("configs/tiny.json") +
                           " --device cpu --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
                           "--log-interval 1 --eval-interval 4 --eval-iters 2 --log-level warn --train-iters 8 --bf16 "
                           "--data-path 0.4 " + dir.file("a") + " 0.6 " + dir.file("b") + " --split 90,10,0 ";
  auto run = [](const std::string& a) {
    const auto result = run_fp8lm(a);
    INFO(a << "\n" << result.output);
    REQUIRE(result.exit_code == 0);
  };
  run(args + "--save " + dir.file("straight") + " --metrics-file " + dir.file("straight.jsonl"));
  run(args + "--exit-interval 4 --save " + dir.file("split") + " --metrics-file " + dir.file("split.jsonl"));
  run(args + "--load " + dir.file("split") + " --save " + dir.file("split") + " --metrics-file " + dir.file("split.jsonl"));

  auto losses = [](const std::string& path) {
    std::vector<std::pair<std::string, double>> out;
    std::ifstream file(path);
    std::string line;
    while (std::getline(file, line)) {
      const auto json = nlohmann::json::parse(line);
      for (const char* key : {"loss", "val_loss"}) {
        if (json.contains(key)) out.emplace_back(key + std::to_string(json["iter"].get<int64_t>()), json[key].get<double>());
      }
    }
    return out;
  };
  const auto straight = losses(dir.file("straight.jsonl"));
  const auto split = losses(dir.file("split.jsonl"));
  CHECK(straight.size() >= 10);  // 8 training losses and 2 validation losses
  CHECK(split == straight);      // to the last bit
  CHECK(read_bytes(dir.file("straight/iter_0000008/model.safetensors")) ==
        read_bytes(dir.file("split/iter_0000008/model.safetensors")));
  const auto state = nlohmann::json::parse(read_bytes(dir.file("split/iter_0000008/state.json")));
  CHECK(state["args"]["data_path"].size() == 4);
  CHECK(state["args"]["split"] == "90,10,0");

  // fp8lm eval scores the same validation split of the same blend: the loss the run logged last.
  const auto eval = run_fp8lm("eval --load " + dir.file("straight") + " --device cpu --log-level warn --data-path 0.4 " +
                              dir.file("a") + " 0.6 " + dir.file("b") + " --split 90,10,0");
  INFO(eval.output);
  REQUIRE(eval.exit_code == 0);
  double last_val_loss = 0;
  for (const auto& [key, value] : straight)
    if (key.rfind("val_loss", 0) == 0) last_val_loss = value;
  const std::string json_line = eval.output.substr(eval.output.rfind("{\""));
  CHECK(nlohmann::json::parse(json_line)["loss"].get<double>() == last_val_loss);
}

TEST_CASE("Megatron's per-split paths: --train-data-path and --valid-data-path name indexed datasets used whole",
          "[indexed][cli]") {
  TempDir dir;
  for (const char* name : {"a", "b"}) write_random_dataset(dir.file(name), name[0], 40, 11);
  const std::string base = "train --config " + testing::source_path("configs/tiny.json") +
                           " --device cpu --seq-length 16 --micro-batch-size 2 --lr 1e-3 --log-interval 1 "
                           "--log-level warn --train-iters 6 --bf16 ";
  auto losses_of = [&](const std::string& args, const std::string& metrics) {
    const auto result = run_fp8lm(base + args + " --metrics-file " + dir.file(metrics));
    INFO(args << "\n" << result.output);
    REQUIRE(result.exit_code == 0);
    return testing::metrics_losses(dir.file(metrics));
  };
  // A blend for training is --data-path's blend with all of each dataset in the train split.
  const std::string blend = "0.4 " + dir.file("a") + " 0.6 " + dir.file("b");
  const std::vector<double> per_split = losses_of("--eval-iters 0 --train-data-path " + blend, "per_split.jsonl");
  const std::vector<double> split_whole =
      losses_of("--eval-iters 0 --data-path " + blend + " --split 1,0,0", "split_whole.jsonl");
  REQUIRE(per_split.size() == 6);
  CHECK(per_split == split_whole);  // bit for bit: the same samples in the same order
  // A repeated flag keeps its last list, as every other flag its last value.
  CHECK(losses_of("--eval-iters 0 --train-data-path " + dir.file("nothing.bin") + " --train-data-path " + blend,
                  "repeated.jsonl") == per_split);
  // The lists in files (Megatron's --data-args-path and --per-split-data-args-path).
  write_bytes(dir.file("data_args.txt"), blend + "\n");
  CHECK(losses_of("--eval-iters 0 --data-args-path " + dir.file("data_args.txt") + " --split 1,0,0",
                  "data_args.jsonl") == per_split);
  write_bytes(dir.file("per_split.json"), "{\"train\": \"" + blend + "\", \"valid\": [\"" + dir.file("b") +
                                              "\"], \"test\": []}");
  CHECK(losses_of("--eval-iters 0 --per-split-data-args-path " + dir.file("per_split.json"), "per_split_json.jsonl") ==
        per_split);
  // One PREFIX (PREFIX.idx exists) is a dataset too; validation on another whole dataset, whose
  // loss fp8lm eval reproduces from the checkpoint, as from --data-path's valid split of it.
  const auto trained = run_fp8lm(base + "--train-data-path " + dir.file("a") + " --valid-data-path " + dir.file("b") +
                                 " --eval-interval 6 --eval-iters 3 --save " + dir.file("ckpt") + " --metrics-file " +
                                 dir.file("valid.jsonl") + " --log-level info");
  INFO(trained.output);
  REQUIRE(trained.exit_code == 0);
  CHECK_THAT(trained.output, ContainsSubstring(dir.file("b") + " (indexed, whole)"));
  const std::vector<double> val_loss = testing::metrics_field(dir.file("valid.jsonl"), "val_loss");
  REQUIRE(val_loss.size() == 1);
  auto eval_loss = [&](const std::string& data) {
    const auto eval = run_fp8lm("eval --load " + dir.file("ckpt") + " --device cpu --log-level warn " + data);
    INFO(data << "\n" << eval.output);
    REQUIRE(eval.exit_code == 0);
    return nlohmann::json::parse(eval.output.substr(eval.output.rfind("{\"")))["loss"].get<double>();
  };
  CHECK(eval_loss("--valid-data-path " + dir.file("b")) == val_loss[0]);
  CHECK(eval_loss("--valid-data-path 1 " + dir.file("b")) == val_loss[0]);
  CHECK(eval_loss("--data-path " + dir.file("b") + " --split 0,1,0") == val_loss[0]);

  // Malformed lists name the flag; a name without PREFIX.idx stays an llm.c shard glob.
  auto expect_error = [&](const std::string& args, const std::string& named) { expect_refused(base + args, named); };
  expect_error("--train-data-path 0.4 " + dir.file("a") + " 0.6", "--train-data-path: 3 values, not weight/prefix pairs");
  expect_error("--train-data-path " + dir.file("a") + " " + dir.file("b"),
               "--train-data-path takes one llm.c shard glob (quote it) or Megatron's indexed datasets");
  expect_error("--train-data-path 1 " + dir.file("a") + " --valid-data-path 0 " + dir.file("b"),
               "--valid-data-path: '0' (value 1) is not a positive weight");
  expect_error("--train-data-path " + dir.file("a") + " --data-path " + dir.file("b"), "--data-path contradicts");
  expect_error("--train-data-path 1 " + dir.file("a") + " 1 " + dir.file("missing"), dir.file("missing.idx"));
  expect_error("--train-data-path " + dir.file("missing"), dir.file("missing"));
  expect_error("--data-args-path " + dir.file("none.txt"), "--data-args-path " + dir.file("none.txt") + ": cannot read");
  expect_error("--data-args-path " + dir.file("data_args.txt") + " --data-path " + dir.file("a"),
               "--data-args-path contradicts --data-path");
  write_bytes(dir.file("bad.json"), "{\"train\": 3}");
  expect_error("--per-split-data-args-path " + dir.file("bad.json"), "\"train\" must be a list of strings");
  write_bytes(dir.file("no_train.json"), "{\"valid\": \"x\"}");
  expect_error("--per-split-data-args-path " + dir.file("no_train.json"), "no \"train\" list");
  write_bytes(dir.file("not_json.json"), "train: a");
  expect_error("--per-split-data-args-path " + dir.file("not_json.json"), "not a JSON object");
  expect_error("--per-split-data-args-path " + dir.file("per_split.json") + " --train-data-path " + dir.file("a"),
               "--per-split-data-args-path contradicts");
}

TEST_CASE("the test set is scored once, at the end of training (Megatron's do_test): --split's test part, "
          "--test-data-path, or per-split lists; fp8lm eval reproduces it",
          "[indexed][cli]") {
  TempDir dir;
  for (const char* name : {"a", "b"}) write_random_dataset(dir.file(name), name[0], 60, 13);
  const std::string base = "train --config " + testing::source_path("configs/tiny.json") +
                           " --device cpu --seq-length 16 --micro-batch-size 2 --lr 1e-3 --log-interval 1 "
                           "--eval-interval 3 --eval-iters 2 --log-level info --train-iters 6 --bf16 ";
  auto train = [&](const std::string& args, const std::string& name) {
    const auto result = run_fp8lm(base + args + " --save " + dir.file(name) + " --metrics-file " + dir.file(name + ".jsonl"));
    INFO(args << "\n" << result.output);
    REQUIRE(result.exit_code == 0);
    return result.output;
  };
  auto eval_loss = [&](const std::string& ckpt, const std::string& data) {
    const auto eval = run_fp8lm("eval --load " + dir.file(ckpt) + " --device cpu --log-level warn " + data);
    INFO(data << "\n" << eval.output);
    REQUIRE(eval.exit_code == 0);
    return nlohmann::json::parse(eval.output.substr(eval.output.rfind("{\"")))["loss"].get<double>();
  };
  // --data-path's --split with a test part: one test loss, after the last validation, the
  // loss fp8lm eval gives on those documents (60 documents: 80,10,10's test part, 54-59, is
  // 90,10,0's validation part).
  const std::string split_log = train("--data-path " + dir.file("a") + " --split 80,10,10", "split");
  CHECK_THAT(split_log, ContainsSubstring("test loss"));
  const std::vector<double> test_loss = testing::metrics_field(dir.file("split.jsonl"), "test_loss");
  REQUIRE(test_loss.size() == 1);
  CHECK(testing::metrics_field(dir.file("split.jsonl"), "val_loss").size() == 2);
  CHECK(test_loss[0] == eval_loss("split", "--data-path " + dir.file("a") + " --split 90,10,0"));
  CHECK(test_loss[0] != testing::metrics_field(dir.file("split.jsonl"), "val_loss").back());
  // No test part, or one too small for a sample (said at start-up): no test loss.
  train("--data-path " + dir.file("a") + " --split 90,10,0", "no_test");
  CHECK(testing::metrics_field(dir.file("no_test.jsonl"), "test_loss").empty());
  const std::string tiny_test = train("--data-path " + dir.file("a") + " --split 90,9,1", "tiny_test");
  CHECK(testing::metrics_field(dir.file("tiny_test.jsonl"), "test_loss").empty());
  CHECK_THAT(tiny_test, ContainsSubstring("the test part of --data-path holds less than one global micro-batch"));
  // Megatron's per-split paths name the test set whole, on the command line or in a JSON file.
  train("--train-data-path " + dir.file("a") + " --valid-data-path " + dir.file("b") + " --test-data-path " +
            dir.file("b"),
        "per_split");
  const std::vector<double> per_split_test = testing::metrics_field(dir.file("per_split.jsonl"), "test_loss");
  REQUIRE(per_split_test.size() == 1);
  // The test set is the validation set here, scored by the same weights after the last step.
  CHECK(per_split_test[0] == testing::metrics_field(dir.file("per_split.jsonl"), "val_loss").back());
  write_bytes(dir.file("lists.json"), "{\"train\": [\"" + dir.file("a") + "\"], \"valid\": [\"" + dir.file("b") +
                                          "\"], \"test\": [\"" + dir.file("b") + "\"]}");
  train("--per-split-data-args-path " + dir.file("lists.json"), "lists");
  CHECK(testing::metrics_field(dir.file("lists.jsonl"), "test_loss") == per_split_test);
  expect_refused(base + "--data-path " + dir.file("a") + " --test-data-path " + dir.file("b"),
                 "--data-path contradicts --train-data-path, --valid-data-path and --test-data-path");
}

}  // namespace fp8lm
