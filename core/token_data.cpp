#include "core/token_data.h"

#include "core/mapped_file.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "core/error.h"

namespace fp8lm {

// The shard formats are little-endian and are read in place from the memory map.
static_assert(std::endian::native == std::endian::little, "token shards are read as little-endian");

namespace {

constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

std::string trim(const std::string& text) {
  const auto begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return {};
  const auto end = text.find_last_not_of(" \t");
  return text.substr(begin, end - begin + 1);
}

bool has_glob_characters(const std::string& pattern) {
  return pattern.find_first_of("*?[") != std::string::npos;
}

// Files matching one glob pattern (or naming one plain path).
std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t matches{};
  const int status = glob(pattern.c_str(), GLOB_ERR, nullptr, &matches);
  std::vector<std::string> files;
  if (status == 0) files.assign(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
  globfree(&matches);
  if (status == GLOB_NOMATCH || (status == 0 && files.empty())) {
    if (has_glob_characters(pattern)) {
      throw InputError(detail::concat("data path: no file matches '", pattern, "'"));
    }
    throw InputError(detail::concat(pattern, ": no such file"));
  }
  if (status != 0) {
    throw InputError(detail::concat("data path: cannot expand '", pattern, "' (",
                                    status == GLOB_ABORTED ? "read error" : "out of memory", ")"));
  }
  return files;
}

// Throws if any token is >= vocab_size, naming the first one. Scanned in blocks: the max over a
// block vectorises and the scan is then bound by memory bandwidth; only a block that holds a
// bad token is searched again for its position.
void check_token_range(const uint16_t* tokens /*[count]*/, size_t count, int vocab_size,
                       const std::string& name) {
  constexpr size_t kBlock = size_t{1} << 16;
  for (size_t begin = 0; begin < count; begin += kBlock) {
    const size_t end = std::min(count, begin + kBlock);
    uint16_t block_max = 0;
    for (size_t i = begin; i < end; ++i) block_max = std::max(block_max, tokens[i]);
    if (block_max < vocab_size) continue;
    for (size_t i = begin; i < end; ++i) {
      if (tokens[i] >= vocab_size) {
        throw InputError(detail::concat(name, ": token ", tokens[i], " at index ", i,
                                        " is >= vocab_size ", vocab_size),
                         "the shard was tokenized for a larger vocabulary than the model's");
      }
    }
  }
}

void check_token_count(size_t num_tokens, size_t min_tokens, const std::string& name) {
  if (num_tokens == 0) throw InputError(detail::concat(name, ": empty file (no tokens)"));
  if (num_tokens < min_tokens) {
    throw InputError(detail::concat(name, ": holds ", num_tokens, " tokens, too few tokens for one sample (seq_len + 1 = ",
                                    min_tokens, ")"));
  }
}

// The shard's token array inside a mapped file: after the llm.c header, or the whole raw file.
// Validates the header and size; sets `num_tokens`.
const uint16_t* locate_tokens(const unsigned char* bytes, size_t file_bytes, const std::string& name,
                              size_t* num_tokens) {
  int32_t first_int = 0;
  if (file_bytes >= sizeof(int32_t)) std::memcpy(&first_int, bytes, sizeof(first_int));

  if (first_int != kLlmcShardMagic) {  // nanoGPT raw uint16 tokens
    if (file_bytes % 2 != 0) {
      throw InputError(detail::concat(name, ": odd size (", file_bytes,
                                      " bytes) for a raw uint16 token file, which must have an even size"),
                       "raw shards are uint16 tokens with no header; llm.c shards start with magic 20240520");
    }
    *num_tokens = file_bytes / 2;
    return reinterpret_cast<const uint16_t*>(bytes);
  }

  if (file_bytes < kLlmcHeaderBytes) {
    throw InputError(detail::concat(name, ": truncated llm.c header (the file is ", file_bytes,
                                    " bytes, the header alone is ", kLlmcHeaderBytes, ")"));
  }
  int32_t header[3];
  std::memcpy(header, bytes, sizeof(header));
  if (header[1] != kLlmcShardVersion) {
    throw InputError(detail::concat(name, ": unsupported version ", header[1], " of the llm.c shard format"),
                     "only version 1 (uint16 tokens) is supported");
  }
  const size_t payload_bytes = file_bytes - kLlmcHeaderBytes;
  const int64_t header_tokens = header[2];
  if (payload_bytes % 2 != 0 || header_tokens < 0 || static_cast<uint64_t>(header_tokens) != payload_bytes / 2) {
    throw InputError(detail::concat(name, ": header says ", header_tokens, " tokens but the file holds ",
                                    payload_bytes / 2, payload_bytes % 2 != 0 ? " and a stray byte" : ""),
                     "the file is truncated or was not fully written");
  }
  *num_tokens = payload_bytes / 2;
  return reinterpret_cast<const uint16_t*>(bytes + kLlmcHeaderBytes);
}

// Seeds the shuffle of one epoch: SplitMix64's finaliser over (seed, epoch), so neighbouring
// epochs and seeds give unrelated permutations.
uint64_t epoch_seed(uint64_t seed, uint64_t epoch) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (epoch + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::vector<std::string> expand_shard_paths(const std::string& path_spec) {
  std::vector<std::string> files;
  size_t begin = 0;
  while (begin <= path_spec.size()) {
    size_t comma = path_spec.find(',', begin);
    if (comma == std::string::npos) comma = path_spec.size();
    const std::string item = trim(path_spec.substr(begin, comma - begin));
    if (!item.empty()) {
      const auto matches = glob_files(item);
      files.insert(files.end(), matches.begin(), matches.end());
    }
    begin = comma + 1;
  }
  if (files.empty()) throw InputError(detail::concat("data path '", path_spec, "' names no file"));
  // Byte order, not glob's locale collation, so every machine reads shards in the same order.
  std::sort(files.begin(), files.end());
  return files;
}

// ---------------------------------------------------------------------------------------------
// TokenShard

TokenShard TokenShard::open_file(const std::string& path, int vocab_size, size_t min_tokens) {
  TokenShard shard;
  shard.name_ = path;
  shard.file_ = MappedFile::open(path);
  if (shard.file_.size() == 0) throw InputError(detail::concat(path, ": empty file (no tokens)"));
  shard.tokens_ = locate_tokens(shard.file_.data(), shard.file_.size(), path, &shard.num_tokens_);
  check_token_count(shard.num_tokens_, min_tokens, path);
  shard.file_.advise_sequential();  // a hint for the one full scan
  check_token_range(shard.tokens_, shard.num_tokens_, vocab_size, path);
  shard.file_.advise_random();  // training reads windows in shuffled order
  return shard;
}

TokenShard TokenShard::from_tokens(std::vector<uint16_t> tokens, std::string name, int vocab_size,
                                   size_t min_tokens) {
  check_token_count(tokens.size(), min_tokens, name);
  check_token_range(tokens.data(), tokens.size(), vocab_size, name);
  TokenShard shard;
  shard.name_ = std::move(name);
  shard.owned_tokens_ = std::move(tokens);
  shard.tokens_ = shard.owned_tokens_.data();
  shard.num_tokens_ = shard.owned_tokens_.size();
  return shard;
}

TokenShard::TokenShard(TokenShard&& other) noexcept { *this = std::move(other); }

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this == &other) return *this;
  name_ = std::move(other.name_);
  // A moved vector keeps its buffer, so tokens_ stays valid for in-memory shards.
  owned_tokens_ = std::move(other.owned_tokens_);
  file_ = std::move(other.file_);
  tokens_ = std::exchange(other.tokens_, nullptr);
  num_tokens_ = std::exchange(other.num_tokens_, 0);
  return *this;
}

TokenShard::~TokenShard() = default;

// ---------------------------------------------------------------------------------------------
// DataLoader

DataLoader::DataLoader(const std::vector<std::string>& shard_paths, const DataLoaderOptions& options)
    : options_(options) {
  FP8LM_CHECK(options.seq_len > 0, "seq_len ", options.seq_len);
  if (shard_paths.empty()) throw InputError("data path: no shard files given");
  shards_.reserve(shard_paths.size());
  for (const auto& path : shard_paths) {
    shards_.push_back(TokenShard::open_file(path, options.vocab_size, size_t(options.seq_len) + 1));
  }
  init();
}

DataLoader::DataLoader(std::vector<std::vector<uint16_t>> shard_tokens, const DataLoaderOptions& options)
    : options_(options) {
  FP8LM_CHECK(options.seq_len > 0, "seq_len ", options.seq_len);
  FP8LM_CHECK(!shard_tokens.empty(), "no in-memory shards");
  shards_.reserve(shard_tokens.size());
  for (size_t i = 0; i < shard_tokens.size(); ++i) {
    shards_.push_back(TokenShard::from_tokens(std::move(shard_tokens[i]), detail::concat("in-memory shard ", i),
                                              options.vocab_size, size_t(options.seq_len) + 1));
  }
  init();
}

void DataLoader::init() {
  const DataLoaderOptions& o = options_;
  FP8LM_CHECK(o.micro_batch_size > 0, "micro_batch_size ", o.micro_batch_size);
  FP8LM_CHECK(o.vocab_size > 0 && o.vocab_size <= 65536, "vocab_size ", o.vocab_size, " (uint16 tokens)");
  FP8LM_CHECK(o.data_parallel_size > 0 && o.data_parallel_rank >= 0 && o.data_parallel_rank < o.data_parallel_size,
              "data-parallel rank ", o.data_parallel_rank, " of ", o.data_parallel_size);

  sample_offsets_.assign(1, 0);
  for (const auto& shard : shards_) {
    sample_offsets_.push_back(sample_offsets_.back() + (shard.size() - 1) / size_t(o.seq_len));
  }
  if (samples_per_epoch() < samples_per_step()) {
    throw InputError(detail::concat(shards_.front().name(), shards_.size() > 1 ? " and the other shards" : "",
                                    ": ", samples_per_epoch(), " samples of seq_len ", o.seq_len,
                                    ", fewer than one global micro-batch (", samples_per_step(), " samples)"),
                     "use more data, or a smaller --micro-batch-size or --seq-length");
  }
  reset();
}

uint64_t DataLoader::samples_per_step() const {
  return uint64_t(options_.micro_batch_size) * uint64_t(options_.data_parallel_size);
}

uint64_t DataLoader::num_tokens() const {
  uint64_t total = 0;
  for (const auto& shard : shards_) total += shard.size();
  return total;
}

uint64_t DataLoader::consumed_samples() const {
  return position_.epoch * steps_per_epoch() * samples_per_step() + position_.next_sample;
}

void DataLoader::set_position(const DataPosition& position) {
  if (position.next_sample > samples_per_epoch()) {
    throw InputError(detail::concat("data position: sample ", position.next_sample, " of epoch ", position.epoch,
                                    " is beyond the ", samples_per_epoch(), " samples of an epoch"),
                     "the checkpoint was made with other data or another --seq-length");
  }
  position_ = position;
  // Too few samples left for a full step: the step starts the next epoch, as reading on would.
  if (position_.next_sample + samples_per_step() > samples_per_epoch()) {
    position_.epoch += 1;
    position_.next_sample = 0;
  }
}

void DataLoader::prepare_order(uint64_t epoch) {
  if (!options_.shuffle || order_epoch_ == epoch) return;
  const uint64_t count = samples_per_epoch();
  order_.resize(count);
  for (uint64_t i = 0; i < count; ++i) order_[i] = i;
  // Fisher-Yates with our own bounded draws: mt19937_64's output sequence is fixed by the
  // standard, so the permutation is the same with every compiler and library.
  std::mt19937_64 engine(epoch_seed(options_.seed, epoch));
  for (uint64_t i = count - 1; i > 0; --i) std::swap(order_[i], order_[uniform_below(engine, i + 1)]);
  order_epoch_ = epoch;
}

uint64_t DataLoader::sample_at(uint64_t index_in_epoch) const {
  return options_.shuffle ? order_[index_in_epoch] : index_in_epoch;
}

void DataLoader::copy_sample(uint64_t sample, int32_t* inputs /*[T]*/, int32_t* targets /*[T]*/) const {
  // The shard whose sample range holds `sample`: the last offset <= sample.
  const auto after = std::upper_bound(sample_offsets_.begin(), sample_offsets_.end(), sample);
  const size_t shard_index = size_t(after - sample_offsets_.begin()) - 1;
  const uint64_t T = uint64_t(options_.seq_len);
  const uint16_t* window = shards_[shard_index].tokens() + (sample - sample_offsets_[shard_index]) * T;  // [T+1]
  for (uint64_t t = 0; t < T; ++t) {
    inputs[t] = window[t];
    targets[t] = window[t + 1];
  }
}

void DataLoader::next_batch(int32_t* inputs /*[B,T]*/, int32_t* targets /*[B,T]*/) {
  prepare_order(position_.epoch);
  const uint64_t B = uint64_t(options_.micro_batch_size);
  const uint64_t T = uint64_t(options_.seq_len);
  const uint64_t first = position_.next_sample + uint64_t(options_.data_parallel_rank) * B;
  for (uint64_t b = 0; b < B; ++b) copy_sample(sample_at(first + b), inputs + b * T, targets + b * T);
  set_position({position_.epoch, position_.next_sample + samples_per_step()});
}

}  // namespace fp8lm
