// Training data: token shards on disk and the loader that cuts them into micro-batches.
//
// Shard formats (both little-endian uint16 tokens), chosen by --data-format, never guessed:
//   llmc       - the default. A header of 256 int32: [0] = 20240520 (magic), [1] = 1 (version),
//                [2] = number of tokens; then the tokens. A file whose magic, version or token
//                count is wrong is an error naming it.
//   raw-uint16 - nanoGPT's format: the tokens and nothing else. A file that starts with the
//                llm.c magic is refused under this format (its header would be read as tokens),
//                so a raw file whose first two tokens are 54472, 308 cannot be read.
// Every shard is validated when it is opened (header, size, every token < vocab_size), so a
// bad file fails before training starts, with an InputError naming it. Shards are read with
// pread, not a memory map: a file truncated while the run reads it then ends the run with an
// error naming it (a map would raise SIGBUS), and every window read is range-checked again, so
// a file rewritten after validation cannot feed an out-of-range token to the embedding.
//
// Samples: a window of T+1 consecutive tokens inside one shard (inputs = the first T, targets =
// the last T). Windows start at multiples of T, so no target is seen twice per epoch; a shard of
// n tokens holds floor((n-1)/T) samples.
//
// Order: each epoch visits every sample once, in shard order or in a permutation seeded by
// (seed, epoch). One global micro-batch step takes world*B samples from that order and
// data-parallel rank r reads the r-th block of B. An epoch's remainder (< world*B samples) is
// dropped. The order depends only on (seed, epoch, the shards), never on the platform or the
// standard library, so a resumed run reads exactly the batches it would have read.
//
// Blends (several sources with weights): an epoch has as many picks as the sources have
// samples together. Pick j of an epoch comes from the source whose share falls furthest below
// its weight (Megatron's blending: argmax_i w_i * max(j, 1) - picks_i, the first on a tie);
// the schedule restarts with every epoch. Source i's c-th pick overall is the sample at
// c mod n_i of its own order for source epoch floor(c / n_i) (n_i: its samples), shuffled
// with a seed of (seed, i, source epoch), so a source given more weight than its size repeats
// and one given less is read partly, each without repeats inside its own epoch. The
// position is still (epoch, next_sample): the per-source counts are replayed from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/input_file.h"

namespace fp8lm {

inline constexpr int32_t kLlmcShardMagic = 20240520;
inline constexpr int32_t kLlmcShardVersion = 1;
inline constexpr int kLlmcHeaderInts = 256;  // the header is 1024 bytes

enum class TokenFileFormat : uint8_t { llmc, raw_uint16 };
std::string_view to_string(TokenFileFormat format);  // "llmc", "raw-uint16": --data-format's values

// The integer type of the tokens in a file: llm.c and raw shards hold uint16; Megatron's
// indexed datasets (core/indexed_dataset.h) name theirs in the index. Little-endian.
enum class TokenElementType : uint8_t { uint8, int8, int16, int32, int64, uint16 };
size_t element_bytes(TokenElementType type);
std::string_view to_string(TokenElementType type);

// Expands a data path flag into shard files: a comma-separated list of files and/or glob(3)
// patterns. The result is sorted, so the data order does not depend on how the list was
// written. A pattern that matches nothing is an InputError naming it.
std::vector<std::string> expand_shard_paths(const std::string& path_spec);

// One shard's tokens: an open, validated file, or an owned, validated vector. Move-only.
class TokenShard {
 public:
  // Opens and validates a shard file in `format`; every problem is an InputError naming the
  // file. min_tokens: the fewest tokens the caller can use (one sample, seq_len + 1).
  static TokenShard open_file(const std::string& path, TokenFileFormat format, int vocab_size,
                              size_t min_tokens);
  // Validates tokens held in memory (mock data, tests); `name` stands for the file in errors.
  static TokenShard from_tokens(std::vector<uint16_t> tokens, std::string name, int vocab_size,
                                size_t min_tokens);
  // `count` tokens of `type` at byte `first_byte` of the file `path` (a span another format's
  // index located, e.g. a split of a Megatron .bin). Validated like a shard file: the file must
  // hold the span, and every token must be in [0, vocab_size); errors name the file and the
  // token's byte offset.
  static TokenShard open_span(const std::string& path, uint64_t first_byte, size_t count, TokenElementType type,
                              int vocab_size, size_t min_tokens);

  TokenShard(TokenShard&&) noexcept = default;
  TokenShard& operator=(TokenShard&&) noexcept = default;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  // Copies tokens [first, first + count) into `out`. A file shard that was truncated, or
  // whose tokens left the vocabulary, since it was validated is a RuntimeError naming it.
  void read(uint64_t first, size_t count, uint16_t* out /*[count]*/) const;

  size_t size() const { return num_tokens_; }
  const std::string& name() const { return name_; }
  bool is_file() const { return file_.is_open(); }

 private:
  TokenShard() = default;

  std::string name_;
  std::vector<uint16_t> owned_tokens_;  // in-memory shards only
  InputFile file_;                      // file shards only
  uint64_t first_token_byte_ = 0;       // past the llm.c header, or 0 for raw files
  size_t num_tokens_ = 0;
  int vocab_size_ = 0;
  TokenElementType element_ = TokenElementType::uint16;
};

// Where the next global micro-batch step begins: the epoch and the index into that epoch's
// sample order. Saved in checkpoints.
struct DataPosition {
  uint64_t epoch = 0;
  uint64_t next_sample = 0;
  bool operator==(const DataPosition&) const = default;
};

struct DataLoaderOptions {
  int micro_batch_size = 1;   // B: samples per rank per step
  int seq_len = 1;            // T
  int vocab_size = 50257;     // every token must be below this
  uint64_t seed = 1234;       // the shuffle seed
  int data_parallel_rank = 0;
  int data_parallel_size = 1;
  bool shuffle = true;        // false: samples in shard order (validation, debugging)
  TokenFileFormat format = TokenFileFormat::llmc;  // of shard files (--data-format)
  // >= 0: every target whose input is this token is kMaskedTarget (core/loss_mask.h), Megatron's
  // --eod-mask-loss with the end-of-document token; -1: no mask.
  int32_t loss_mask_token = -1;
};

class DataLoader {
 public:
  // Opens and validates shard files (already expanded; see expand_shard_paths). Each shard
  // keeps a descriptor open for the run; the soft open-file limit is raised to fit them.
  DataLoader(const std::vector<std::string>& shard_paths, const DataLoaderOptions& options);
  // Reads token streams held in memory; each vector is one shard.
  DataLoader(std::vector<std::vector<uint16_t>> shard_tokens, const DataLoaderOptions& options);
  // Reads shards already opened and validated (e.g. the splits of Megatron indexed datasets).
  DataLoader(std::vector<TokenShard> shards, const DataLoaderOptions& options);
  // A weighted blend of sources, each a group of shards (Megatron's --data-path 0.3 A 0.7 B).
  // Weights are positive and normalised here. See "Blends" above for the order.
  DataLoader(std::vector<std::vector<TokenShard>> sources, std::vector<double> weights,
             const DataLoaderOptions& options);

  DataLoader(DataLoader&&) noexcept = default;
  DataLoader& operator=(DataLoader&&) noexcept = default;

  // Writes this rank's next micro-batch and advances every rank's position by one global step.
  void next_batch(int32_t* inputs /*[B,T]*/, int32_t* targets /*[B,T]*/);

  DataPosition position() const { return position_; }
  // Resumes at a saved position. A next_sample past the epoch is an InputError (the checkpoint
  // came from other data); one too close to the end for a full step starts the next epoch,
  // exactly as reading on would.
  void set_position(const DataPosition& position);
  void reset() { set_position(DataPosition{}); }

  // Samples in one epoch, over all shards (before the remainder is dropped). A blend's epoch
  // has as many samples as its sources together, whatever the weights.
  uint64_t samples_per_epoch() const { return sample_offsets_.back(); }
  // Global steps (world*B samples each) in one epoch.
  uint64_t steps_per_epoch() const { return samples_per_epoch() / samples_per_step(); }
  // Samples read by all ranks since the start (epoch 0, sample 0); a finished epoch counts
  // the samples its steps read, not the dropped remainder.
  uint64_t consumed_samples() const;

  const DataLoaderOptions& options() const { return options_; }
  size_t num_shards() const { return shards_.size(); }
  const TokenShard& shard(size_t index) const { return shards_[index]; }
  uint64_t num_tokens() const;
  size_t num_sources() const { return blend_.empty() ? 1 : blend_.size(); }
  // Blends only: the samples each source gives to one epoch's steps (in proportion to its weight).
  uint64_t source_samples_per_epoch(size_t source) const { return blend_.at(source).picks_per_epoch; }
  // The source the blend schedule takes pick `index` of an epoch from, given how many picks each
  // source has given before it (`counts`); exposed for tests.
  size_t blend_pick(uint64_t index, const std::vector<uint64_t>& counts) const;

 private:
  void init();  // validates the options, builds the sample index, starts at epoch 0
  uint64_t samples_per_step() const;
  void prepare_order(uint64_t epoch);  // the permutation for `epoch`, when shuffling
  uint64_t sample_at(uint64_t index_in_epoch) const;
  void copy_sample(uint64_t sample, int32_t* inputs /*[T]*/, int32_t* targets /*[T]*/);

  // One source of a blend: shards [first_shard, end_shard), global samples
  // [first_sample, first_sample + num_samples).
  struct BlendSource {
    size_t first_shard = 0, end_shard = 0;
    uint64_t first_sample = 0, num_samples = 0;
    double weight = 0;               // normalised
    uint64_t picks_per_epoch = 0;    // samples it gives to one epoch's steps
    std::vector<uint64_t> order;     // its shuffled order for source epoch order_epoch
    uint64_t order_epoch = UINT64_MAX;
  };
  void init_blend(std::vector<size_t> source_shard_counts, std::vector<double> weights);
  std::vector<uint64_t> replay_blend(uint64_t picks) const;  // each source's picks among the first `picks`
  uint64_t blend_sample(size_t source, uint64_t picks_this_epoch);  // the global sample of that pick
  void next_blend_batch(int32_t* inputs, int32_t* targets);

  DataLoaderOptions options_;
  std::vector<BlendSource> blend_;       // empty: one source, the order above
  std::vector<uint64_t> blend_counts_;   // picks each source gave this epoch before position_
  std::vector<TokenShard> shards_;
  std::vector<uint64_t> sample_offsets_;  // [shards + 1]: first global sample of each shard
  DataPosition position_;
  std::vector<uint64_t> order_;           // the shuffled epoch's sample order (empty: in order)
  uint64_t order_epoch_ = UINT64_MAX;     // which epoch order_ holds
  std::vector<uint16_t> window_;          // [T+1]: one sample's tokens, read from its shard
};

// An unbiased integer in [0, bound) from a 64-bit engine whose every output is a uniform
// 64-bit value (std::mt19937_64, SplitMix64). Rejection sampling rather than
// std::uniform_int_distribution, whose algorithm differs between standard libraries.
template <typename Engine>
uint64_t uniform_below(Engine& engine, uint64_t bound) {
  // Outputs below `threshold` = 2^64 mod bound would make the small residues more likely.
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t value = engine();
    if (value >= threshold) return value % bound;
  }
}

}  // namespace fp8lm
