// Token shards, the data loader and mock data.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "core/error.h"
#include "core/input_file.h"
#include "core/loss_mask.h"
#include "error_testing.h"
#include "temp_dir.h"
#include "core/mock_data.h"
#include "core/token_data.h"

namespace fs = std::filesystem;
using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

using testing::TempDir;
using testing::input_error_message;

void write_bytes(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), std::streamsize(bytes));
  REQUIRE(out.good());
}

// An llm.c shard; the header fields can be overridden to build broken files.
void write_llmc_shard(const std::string& path, const std::vector<uint16_t>& tokens,
                      int32_t version = kLlmcShardVersion, int64_t header_tokens = -1) {
  std::vector<int32_t> header(kLlmcHeaderInts, 0);
  header[0] = kLlmcShardMagic;
  header[1] = version;
  header[2] = int32_t(header_tokens >= 0 ? header_tokens : int64_t(tokens.size()));
  std::vector<char> bytes(header.size() * 4 + tokens.size() * 2);
  std::memcpy(bytes.data(), header.data(), header.size() * 4);
  std::memcpy(bytes.data() + header.size() * 4, tokens.data(), tokens.size() * 2);
  write_bytes(path, bytes.data(), bytes.size());
}

void write_raw_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_bytes(path, tokens.data(), tokens.size() * 2);
}

// Tokens 0, 1, 2, ... (mod vocab): a window's first token tells which sample it is.
std::vector<uint16_t> counting_tokens(size_t count, size_t start = 0, int vocab_size = 65536) {
  std::vector<uint16_t> tokens(count);
  for (size_t i = 0; i < count; ++i) tokens[i] = uint16_t((start + i) % size_t(vocab_size));
  return tokens;
}

DataLoaderOptions small_options(int B, int T, uint64_t seed = 7, bool shuffle = true,
                                TokenFileFormat format = TokenFileFormat::llmc) {
  DataLoaderOptions options;
  options.format = format;
  options.micro_batch_size = B;
  options.seq_len = T;
  options.vocab_size = 65536;
  options.seed = seed;
  options.shuffle = shuffle;
  return options;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch next(DataLoader& loader) {
  const auto& o = loader.options();
  Batch batch{std::vector<int32_t>(size_t(o.micro_batch_size) * o.seq_len),
              std::vector<int32_t>(size_t(o.micro_batch_size) * o.seq_len)};
  loader.next_batch(batch.inputs.data(), batch.targets.data());
  return batch;
}

std::vector<Batch> read_batches(DataLoader& loader, int count) {
  std::vector<Batch> batches;
  for (int i = 0; i < count; ++i) batches.push_back(next(loader));
  return batches;
}

// With counting tokens in one shard, sample s starts with token s*T.
std::vector<int> sample_ids(const Batch& batch, int B, int T) {
  std::vector<int> ids;
  for (int b = 0; b < B; ++b) ids.push_back(batch.inputs[size_t(b) * T] / T);
  return ids;
}

// The RuntimeError message `action` throws (fails the test when it throws nothing).
std::string runtime_error_message(const std::function<void()>& action) {
  try {
    action();
  } catch (const RuntimeError& error) {
    return error.full_message();
  }
  FAIL("expected a RuntimeError");
  return {};
}

std::vector<uint16_t> read_all(const TokenShard& shard) {
  std::vector<uint16_t> tokens(shard.size());
  shard.read(0, tokens.size(), tokens.data());
  return tokens;
}

}  // namespace

TEST_CASE("llm.c shard is read back exactly", "[data]") {
  TempDir dir;
  const auto tokens = counting_tokens(1001, 0, 50257);
  const std::string path = dir.file("train_000.bin");
  write_llmc_shard(path, tokens);

  const TokenShard shard = TokenShard::open_file(path, TokenFileFormat::llmc, 50257, 5);
  REQUIRE(shard.is_file());
  REQUIRE(shard.size() == tokens.size());
  REQUIRE(read_all(shard) == tokens);

  // In order: sample s is tokens [s*T, s*T + T]; (1001 - 1) / 4 = 250 samples.
  DataLoader loader({path}, small_options(2, 4, 7, /*shuffle=*/false));
  REQUIRE(loader.samples_per_epoch() == 250);
  const Batch first = next(loader);
  REQUIRE(first.inputs == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  REQUIRE(first.targets == std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8});
}

TEST_CASE("raw uint16 shard is read with --data-format raw-uint16", "[data]") {
  TempDir dir;
  const auto tokens = counting_tokens(64, 100);
  const std::string path = dir.file("raw.bin");
  write_raw_shard(path, tokens);

  const TokenShard shard = TokenShard::open_file(path, TokenFileFormat::raw_uint16, 65536, 2);
  REQUIRE(shard.size() == 64);
  REQUIRE(read_all(shard) == tokens);

  DataLoader loader({path}, small_options(1, 8, 7, false, TokenFileFormat::raw_uint16));
  REQUIRE(loader.samples_per_epoch() == 7);  // (64 - 1) / 8
  const Batch batch = next(loader);
  REQUIRE(batch.inputs.front() == 100);
  REQUIRE(batch.targets.back() == 108);
}

TEST_CASE("glob and comma lists of shards are expanded and sorted", "[data]") {
  TempDir dir;
  // Written out of order, with different lengths, so the read order shows the sort.
  write_llmc_shard(dir.file("shard_2.bin"), counting_tokens(17, 2000));
  write_llmc_shard(dir.file("shard_0.bin"), counting_tokens(9, 0));
  write_llmc_shard(dir.file("shard_1.bin"), counting_tokens(13, 1000));
  write_raw_shard(dir.file("other.bin"), counting_tokens(9, 0));
  const std::vector<std::string> sorted = {dir.file("shard_0.bin"), dir.file("shard_1.bin"), dir.file("shard_2.bin")};

  REQUIRE(expand_shard_paths(dir.file("shard_*.bin")) == sorted);
  REQUIRE(expand_shard_paths(dir.file("shard_2.bin") + ", " + dir.file("shard_[01].bin")) == sorted);
  REQUIRE(expand_shard_paths(dir.file("other.bin")) == std::vector<std::string>{dir.file("other.bin")});

  // T = 4: shard_0 holds 2 samples, shard_1 3, shard_2 4, read in that order.
  DataLoader loader(expand_shard_paths(dir.file("shard_*.bin")), small_options(1, 4, 7, false));
  REQUIRE(loader.num_shards() == 3);
  REQUIRE(loader.samples_per_epoch() == 9);
  std::vector<int32_t> first_tokens;
  for (int i = 0; i < 9; ++i) first_tokens.push_back(next(loader).inputs.front());
  REQUIRE(first_tokens == std::vector<int32_t>{0, 4, 1000, 1004, 1008, 2000, 2004, 2008, 2012});
  REQUIRE(loader.position() == DataPosition{1, 0});
}

TEST_CASE("inputs and targets are the same window shifted by one", "[data]") {
  const int B = 3, T = 16;
  DataLoader loader(std::vector<std::vector<uint16_t>>{counting_tokens(1000)}, small_options(B, T));
  for (int step = 0; step < 10; ++step) {
    const Batch batch = next(loader);
    for (int b = 0; b < B; ++b) {
      const int32_t start = batch.inputs[size_t(b) * T];
      REQUIRE(start % T == 0);  // windows start at multiples of T
      for (int t = 0; t < T; ++t) {
        REQUIRE(batch.inputs[size_t(b) * T + t] == start + t);
        REQUIRE(batch.targets[size_t(b) * T + t] == start + t + 1);
      }
    }
  }
}

TEST_CASE("the loss mask (--eod-mask-loss): the loader masks exactly the targets whose input is the end-of-document token",
          "[data][loss-mask]") {
  const int B = 3, T = 16, kEnd = 7;
  // Tokens 0..9 repeating: every tenth input is the end-of-document token.
  auto tokens = [] { return std::vector<uint16_t>(counting_tokens(2000, 0, 10)); };
  auto blend = [&](const DataLoaderOptions& options) {
    std::vector<std::vector<TokenShard>> sources(2);
    for (auto& source : sources) source.push_back(TokenShard::from_tokens(tokens(), "mem", 65536, T + 1));
    return DataLoader(std::move(sources), {0.3, 0.7}, options);
  };
  DataLoaderOptions masked_options = small_options(B, T);
  masked_options.loss_mask_token = kEnd;
  for (const bool blended : {false, true}) {
    CAPTURE(blended);
    DataLoader plain = blended ? blend(small_options(B, T))
                               : DataLoader(std::vector<std::vector<uint16_t>>{tokens()}, small_options(B, T));
    DataLoader masked = blended ? blend(masked_options)
                                : DataLoader(std::vector<std::vector<uint16_t>>{tokens()}, masked_options);
    size_t masked_count = 0;
    for (int step = 0; step < 8; ++step) {
      const Batch a = next(plain), b = next(masked);
      REQUIRE(a.inputs == b.inputs);
      for (size_t i = 0; i < a.targets.size(); ++i) {
        if (a.inputs[i] == kEnd) {
          REQUIRE(b.targets[i] == kMaskedTarget);
          ++masked_count;
        } else {
          REQUIRE(b.targets[i] == a.targets[i]);
        }
      }
      CHECK(count_unmasked_targets(b.targets.data(), b.targets.size()) ==
            int64_t(b.targets.size()) - std::count(b.inputs.begin(), b.inputs.end(), kEnd));
    }
    CHECK(masked_count > 8 * B * T / 20);  // about one target in ten
  }
}

TEST_CASE("shuffle is deterministic per seed and covers each sample once per epoch", "[data]") {
  const int B = 4, T = 8;
  auto make = [&](uint64_t seed) {
    return DataLoader(std::vector<std::vector<uint16_t>>{counting_tokens(8 * 100 + 1)}, small_options(B, T, seed));
  };
  DataLoader a = make(42), b = make(42), c = make(43);
  REQUIRE(a.samples_per_epoch() == 100);
  REQUIRE(a.steps_per_epoch() == 25);
  const auto batches_a = read_batches(a, 25);
  REQUIRE(batches_a == read_batches(b, 25));
  REQUIRE(batches_a != read_batches(c, 25));

  std::vector<int> epoch0;
  for (const auto& batch : batches_a) {
    for (int id : sample_ids(batch, B, T)) epoch0.push_back(id);
  }
  std::vector<int> in_order(100);
  std::iota(in_order.begin(), in_order.end(), 0);
  REQUIRE(epoch0 != in_order);  // shuffled
  std::vector<int> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == in_order);  // every sample exactly once

  // The next epoch is a different permutation.
  REQUIRE(a.position() == DataPosition{1, 0});
  std::vector<int> epoch1;
  for (const auto& batch : read_batches(a, 25)) {
    for (int id : sample_ids(batch, B, T)) epoch1.push_back(id);
  }
  REQUIRE(epoch1 != epoch0);
  REQUIRE(a.consumed_samples() == 200);
}

TEST_CASE("data-parallel ranks read disjoint samples that together make the single-rank order", "[data]") {
  const int B = 3, T = 4, steps = 12;  // 101 samples: 16 steps of 6 per epoch, 5 dropped; 12 stay in epoch 0
  const auto tokens = counting_tokens(4 * 101 + 1);
  DataLoaderOptions single = small_options(2 * B, T, 9);
  DataLoader whole(std::vector<std::vector<uint16_t>>{tokens}, single);

  std::vector<DataLoader> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    DataLoaderOptions options = small_options(B, T, 9);
    options.data_parallel_rank = rank;
    options.data_parallel_size = 2;
    ranks.emplace_back(std::vector<std::vector<uint16_t>>{tokens}, options);
  }
  REQUIRE(ranks[0].steps_per_epoch() == 16);

  std::set<int> seen;
  for (int step = 0; step < steps; ++step) {
    const auto expected = sample_ids(next(whole), 2 * B, T);
    std::vector<int> together;
    for (auto& rank : ranks) {
      for (int id : sample_ids(next(rank), B, T)) {
        REQUIRE(seen.insert(id).second);  // never read twice, by either rank
        together.push_back(id);
      }
    }
    REQUIRE(together == expected);  // rank 0 takes the first block of B, rank 1 the second
  }
  REQUIRE(ranks[0].position() == ranks[1].position());
  REQUIRE(ranks[0].consumed_samples() == uint64_t(steps * 2 * B));
}

TEST_CASE("resuming at a saved position reads the same batches as reading on", "[data]") {
  TempDir dir;
  write_llmc_shard(dir.file("a.bin"), counting_tokens(8 * 30 + 5));
  write_llmc_shard(dir.file("b.bin"), counting_tokens(8 * 23 + 1, 5000));
  const auto paths = expand_shard_paths(dir.file("*.bin"));
  const DataLoaderOptions options = small_options(4, 8, 11);  // 53 samples, 13 steps per epoch

  DataLoader straight(paths, options);
  REQUIRE(straight.steps_per_epoch() == 13);
  for (int k : {0, 5, 13, 20}) {  // at the start, mid-epoch, at and past the epoch boundary
    straight.reset();
    read_batches(straight, k);
    const DataPosition saved = straight.position();
    const uint64_t consumed = straight.consumed_samples();
    const auto expected = read_batches(straight, 10);

    DataLoader resumed(paths, options);
    resumed.set_position(saved);
    REQUIRE(resumed.consumed_samples() == consumed);
    REQUIRE(read_batches(resumed, 10) == expected);
  }
  // 13 steps finish epoch 0 (one sample dropped) and the position moves to epoch 1 at once.
  straight.reset();
  read_batches(straight, 13);
  REQUIRE(straight.position() == DataPosition{1, 0});
  REQUIRE(straight.consumed_samples() == 52);

  // A position past the end of the data belongs to other data.
  REQUIRE_THAT(input_error_message([&] { straight.set_position({0, 54}); }), ContainsSubstring("beyond"));
}

TEST_CASE("bad shard files give an InputError naming the file and the problem", "[data]") {
  TempDir dir;
  const auto tokens = counting_tokens(100);
  auto error_for = [&](const std::string& path, int vocab_size = 65536) {
    DataLoaderOptions options = small_options(1, 8);
    options.vocab_size = vocab_size;
    return input_error_message([&] { DataLoader loader({path}, options); });
  };

  const std::string bad_version = dir.file("bad_version.bin");
  write_llmc_shard(bad_version, tokens, /*version=*/7);
  REQUIRE_THAT(error_for(bad_version), ContainsSubstring(bad_version) && ContainsSubstring("unsupported version 7"));

  const std::string truncated = dir.file("truncated.bin");
  write_llmc_shard(truncated, tokens, kLlmcShardVersion, /*header_tokens=*/120);
  REQUIRE_THAT(error_for(truncated),
               ContainsSubstring(truncated) && ContainsSubstring("header says 120 tokens but the file holds 100"));

  const std::string odd = dir.file("odd.bin");
  write_bytes(odd, tokens.data(), 41);
  REQUIRE_THAT(input_error_message([&] {
                 DataLoader loader({odd}, small_options(1, 8, 7, true, TokenFileFormat::raw_uint16));
               }),
               ContainsSubstring(odd) && ContainsSubstring("odd size"));

  const std::string empty = dir.file("empty.bin");
  write_bytes(empty, tokens.data(), 0);
  REQUIRE_THAT(error_for(empty), ContainsSubstring(empty) && ContainsSubstring("empty file"));

  const std::string short_file = dir.file("short.bin");
  write_llmc_shard(short_file, counting_tokens(8));  // one sample needs seq_len + 1 = 9
  REQUIRE_THAT(error_for(short_file), ContainsSubstring(short_file) && ContainsSubstring("too few tokens"));

  const std::string big_token = dir.file("big_token.bin");
  auto with_big = counting_tokens(200, 0, 50000);
  with_big[123] = 60000;
  write_llmc_shard(big_token, with_big);
  // The byte offset is the header's 1024 bytes plus two per token.
  REQUIRE_THAT(error_for(big_token, 50257),
               ContainsSubstring(big_token) &&
                   ContainsSubstring("token 60000 at index 123 is >= vocab_size 50257 (byte offset 1270)"));
  // Past the first read chunk (2^19 tokens) the index and offset still count from the file's start.
  const std::string late_big_token = dir.file("late_big_token.bin");
  std::vector<uint16_t> long_tokens((size_t{1} << 19) + 100, 7);
  long_tokens[(size_t{1} << 19) + 3] = 50257;
  write_raw_shard(late_big_token, long_tokens);
  REQUIRE_THAT(input_error_message([&] {
                 DataLoaderOptions options = small_options(1, 8, 7, true, TokenFileFormat::raw_uint16);
                 options.vocab_size = 50257;
                 DataLoader loader({late_big_token}, options);
               }),
               ContainsSubstring(late_big_token) &&
                   ContainsSubstring("token 50257 at index 524291 is >= vocab_size 50257 (byte offset 1048582)"));

  const std::string missing_pattern = dir.file("nothing_*.bin");
  REQUIRE_THAT(input_error_message([&] { expand_shard_paths(missing_pattern); }),
               ContainsSubstring(missing_pattern) && ContainsSubstring("no file matches"));
  const std::string missing_file = dir.file("missing.bin");
  REQUIRE_THAT(input_error_message([&] { expand_shard_paths(missing_file); }),
               ContainsSubstring(missing_file) && ContainsSubstring("no such file"));

  // Too little data for one global step: 100 tokens hold 12 samples of 8, a step takes 2 x 8.
  DataLoaderOptions wide = small_options(8, 8);
  wide.data_parallel_size = 2;
  REQUIRE_THAT(input_error_message([&] { DataLoader loader(std::vector<std::vector<uint16_t>>{tokens}, wide); }),
               ContainsSubstring("fewer than one global micro-batch"));
}

TEST_CASE("the shard format is explicit: llm.c unless --data-format raw-uint16 says otherwise", "[data]") {
  TempDir dir;
  const auto tokens = counting_tokens(100, 3);
  auto error_for = [&](const std::string& path, TokenFileFormat format) {
    return input_error_message([&] { DataLoader loader({path}, small_options(1, 8, 7, true, format)); });
  };

  // A raw file is not trained as tokens unless raw-uint16 is asked for.
  const std::string raw = dir.file("raw.bin");
  write_raw_shard(raw, tokens);
  REQUIRE_THAT(error_for(raw, TokenFileFormat::llmc),
               ContainsSubstring(raw) && ContainsSubstring("not an llm.c token shard (wrong magic") &&
                   ContainsSubstring("--data-format raw-uint16"));
  REQUIRE_NOTHROW(DataLoader({raw}, small_options(1, 8, 7, true, TokenFileFormat::raw_uint16)));

  // An llm.c header with one wrong magic byte, or a wrong version, is an error, not tokens.
  const std::string near_magic = dir.file("near_magic.bin");
  write_llmc_shard(near_magic, tokens);
  {
    std::fstream file(near_magic, std::ios::in | std::ios::out | std::ios::binary);
    const int32_t wrong = kLlmcShardMagic + 1;
    file.write(reinterpret_cast<const char*>(&wrong), sizeof wrong);
  }
  REQUIRE_THAT(error_for(near_magic, TokenFileFormat::llmc),
               ContainsSubstring(near_magic) && ContainsSubstring("wrong magic 20240521, expected 20240520"));
  const std::string old_version = dir.file("version_2.bin");
  write_llmc_shard(old_version, tokens, /*version=*/2);
  REQUIRE_THAT(error_for(old_version, TokenFileFormat::llmc),
               ContainsSubstring(old_version) && ContainsSubstring("unsupported version 2"));

  // Read as raw, an llm.c shard would train on its header: refused.
  const std::string llmc = dir.file("llmc.bin");
  write_llmc_shard(llmc, tokens);
  REQUIRE_THAT(error_for(llmc, TokenFileFormat::raw_uint16),
               ContainsSubstring(llmc) && ContainsSubstring("starts with the llm.c shard magic"));

  // Too short even for the magic.
  const std::string tiny = dir.file("tiny.bin");
  write_bytes(tiny, tokens.data(), 2);
  REQUIRE_THAT(error_for(tiny, TokenFileFormat::llmc),
               ContainsSubstring(tiny) && ContainsSubstring("not an llm.c token shard (2 bytes"));
}

TEST_CASE("a shard truncated while the loader reads it ends in an error naming the file, not SIGBUS", "[data]") {
  TempDir dir;
  const std::string path = dir.file("shrinking.bin");
  write_llmc_shard(path, counting_tokens(8 * 512 + 1));
  DataLoader loader({path}, small_options(2, 8, 7, /*shuffle=*/false));
  const Batch first = next(loader);
  REQUIRE(first.inputs.front() == 0);

  // Another process cuts the file to its header and 100 tokens: reading on must reach the
  // missing part within the epoch and report it.
  fs::resize_file(path, 1024 + 200);
  const std::string message = runtime_error_message([&] {
    for (uint64_t step = 1; step < loader.steps_per_epoch(); ++step) next(loader);
  });
  REQUIRE_THAT(message, ContainsSubstring(path) && ContainsSubstring("truncated while in use") &&
                            ContainsSubstring("ends at byte 1224"));
}

TEST_CASE("a shard rewritten after validation cannot feed an out-of-range token", "[data]") {
  TempDir dir;
  const std::string path = dir.file("rewritten.bin");
  write_llmc_shard(path, counting_tokens(8 * 16 + 1, 0, 256));
  DataLoaderOptions options = small_options(1, 8, 7, /*shuffle=*/false);
  options.vocab_size = 256;
  DataLoader loader({path}, options);
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(1024 + 2 * 20);  // token 20: in the third sample
    const uint16_t bad = 40000;
    file.write(reinterpret_cast<const char*>(&bad), sizeof bad);
  }
  next(loader);
  next(loader);
  REQUIRE_THAT(runtime_error_message([&] { next(loader); }),
               ContainsSubstring(path) && ContainsSubstring("token 40000 at index 20 is >= vocab_size 256") &&
                   ContainsSubstring("changed after it was validated"));
}

TEST_CASE("input files must be regular files: FIFOs, devices and directories are refused at once", "[data]") {
  TempDir dir;
  const std::string fifo = dir.file("shard.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Without a writer, a blocking open of the FIFO would never return.
  REQUIRE_THAT(input_error_message([&] { InputFile::open(fifo); }),
               ContainsSubstring(fifo) && ContainsSubstring("not a regular file (a FIFO (named pipe))"));
  REQUIRE_THAT(input_error_message([&] { DataLoader loader({fifo}, small_options(1, 8)); }),
               ContainsSubstring(fifo) && ContainsSubstring("a FIFO"));
  REQUIRE_THAT(input_error_message([&] { read_input_file(fifo); }), ContainsSubstring("a FIFO"));
  REQUIRE_THAT(input_error_message([&] { InputFile::open(dir.path().string()); }),
               ContainsSubstring("not a regular file (a directory)"));
  if (fs::exists("/dev/zero")) {
    REQUIRE_THAT(input_error_message([&] { InputFile::open("/dev/zero"); }),
                 ContainsSubstring("/dev/zero: not a regular file (a character device)"));
  }
  REQUIRE_THAT(input_error_message([&] { InputFile::open(dir.file("missing")); }),
               ContainsSubstring("missing: cannot open (No such file or directory)"));

  // A regular file reads back whole.
  const std::string text_file = dir.file("config.json");
  write_bytes(text_file, "{\"n_layer\": 2}", 14);
  REQUIRE(read_input_file(text_file) == "{\"n_layer\": 2}");
  // A big file (a shard passed as --config) is refused before it is read whole.
  REQUIRE_THAT(input_error_message([&] { read_input_file(text_file, 10); }),
               ContainsSubstring(text_file) && ContainsSubstring("14 bytes, more than the 10 bytes"));
}

TEST_CASE("many shards raise the soft open-file limit: each keeps its descriptor", "[data]") {
  TempDir dir;
  std::vector<std::string> paths;
  for (int i = 0; i < 64; ++i) {
    paths.push_back(dir.file("shard_" + std::to_string(100 + i) + ".bin"));
    write_llmc_shard(paths.back(), counting_tokens(17, size_t(i) * 100));
  }
  rlimit original{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &original) == 0);
  if (original.rlim_max != RLIM_INFINITY && original.rlim_max < 400) SKIP("hard open-file limit below 400");
  rlimit low = original;
  low.rlim_cur = 200;  // below 64 shards + the loader's headroom of 256
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  {
    DataLoader loader(paths, small_options(1, 8, 7, /*shuffle=*/false));
    rlimit raised{};
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &raised) == 0);
    CHECK(raised.rlim_cur >= 64 + 256);
    CHECK(next(loader).inputs.front() == 0);
  }
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &original) == 0);
}

TEST_CASE("mock tokens are deterministic, within the vocabulary and learnable", "[data]") {
  const auto a = make_mock_tokens(100000, 50257, 1);
  REQUIRE(a == make_mock_tokens(100000, 50257, 1));
  REQUIRE(a != make_mock_tokens(100000, 50257, 2));
  REQUIRE(*std::max_element(a.begin(), a.end()) < 50257);
  const auto tiny = make_mock_tokens(20000, 256, 1);
  REQUIRE(*std::max_element(tiny.begin(), tiny.end()) < 256);
  // A longer stream with the same seed starts with the shorter one.
  const auto longer = make_mock_tokens(100100, 50257, 1);
  REQUIRE(std::equal(a.begin(), a.end(), longer.begin()));

  // Learnable: the next token is nearly determined by the previous one. The empirical
  // conditional entropy H(next | previous) is far below log(vocab) = 10.8 nats.
  std::map<uint16_t, std::map<uint16_t, int>> follow;
  for (size_t i = 0; i + 1 < a.size(); ++i) follow[a[i]][a[i + 1]] += 1;
  double entropy = 0.0;
  for (const auto& [previous, nexts] : follow) {
    int row_total = 0;
    for (const auto& [token, n] : nexts) row_total += n;
    for (const auto& [token, n] : nexts) {
      entropy -= double(n) / double(a.size() - 1) * std::log(double(n) / row_total);
    }
  }
  REQUIRE(entropy < 1.5);
  REQUIRE(mock_tokens_entropy_estimate() > 0.5);
  REQUIRE(mock_tokens_entropy_estimate() < 1.2);

  // The loaders: train and validation streams differ, both are usable for any batch shape.
  DataLoaderOptions options = small_options(4, 64);
  options.vocab_size = 256;
  options.data_parallel_size = 2;
  MockDataLoaders loaders = make_mock_data_loaders(options, 1000, 1000);
  REQUIRE(loaders.train.steps_per_epoch() >= 3);
  REQUIRE(loaders.valid.options().seed == options.seed + 1);
  REQUIRE(next(loaders.train) != next(loaders.valid));
}
