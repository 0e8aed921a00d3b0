#include "core/token_data.h"

#include <glob.h>
#include <sys/resource.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "core/error.h"
#include "core/loss_mask.h"

namespace fp8lm {

// The shard formats are little-endian and are read into uint16 buffers as they are.
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

// The first token >= vocab_size in tokens[0, count), or count. Scanned in blocks: the max over
// a block vectorises, so the scan is bound by memory bandwidth; only a block that holds a bad
// token is searched again for its position.
size_t find_token_out_of_range(const uint16_t* tokens /*[count]*/, size_t count, int vocab_size) {
  constexpr size_t kBlock = size_t{1} << 16;
  for (size_t begin = 0; begin < count; begin += kBlock) {
    const size_t end = std::min(count, begin + kBlock);
    uint16_t block_max = 0;
    for (size_t i = begin; i < end; ++i) block_max = std::max(block_max, tokens[i]);
    if (block_max < vocab_size) continue;
    for (size_t i = begin; i < end; ++i) {
      if (tokens[i] >= vocab_size) return i;
    }
  }
  return count;
}

// `index`: the token's index in its shard; `first_token_byte`: where the shard's tokens begin
// in its file (for the byte offset a hex dump would show), or -1 for tokens held in memory.
std::string token_out_of_range_message(const std::string& name, int64_t token, uint64_t index, int vocab_size,
                                       int64_t first_token_byte, size_t token_bytes = 2) {
  std::string where;
  if (first_token_byte >= 0) {
    where = detail::concat(" (byte offset ", uint64_t(first_token_byte) + token_bytes * index, ")");
  }
  if (token < 0) return detail::concat(name, ": token ", token, " at index ", index, " is negative", where);
  return detail::concat(name, ": token ", token, " at index ", index, " is >= vocab_size ", vocab_size, where);
}

template <typename Element>
size_t convert_elements(const unsigned char* bytes, size_t count, int vocab_size, uint16_t* out, int64_t& bad_value) {
  for (size_t i = 0; i < count; ++i) {
    Element value;
    std::memcpy(&value, bytes + i * sizeof(Element), sizeof(Element));
    const int64_t token = static_cast<int64_t>(value);
    if (token < 0 || token >= vocab_size) {
      bad_value = token;
      return i;
    }
    out[i] = static_cast<uint16_t>(token);
  }
  return count;
}

// Converts `count` elements of `type` to uint16 tokens. Returns the index of the first that is
// negative or >= vocab_size (its value in bad_value), or count.
size_t convert_tokens(const unsigned char* bytes, size_t count, TokenElementType type, int vocab_size, uint16_t* out,
                      int64_t& bad_value) {
  switch (type) {
    case TokenElementType::uint8: return convert_elements<uint8_t>(bytes, count, vocab_size, out, bad_value);
    case TokenElementType::int8: return convert_elements<int8_t>(bytes, count, vocab_size, out, bad_value);
    case TokenElementType::int16: return convert_elements<int16_t>(bytes, count, vocab_size, out, bad_value);
    case TokenElementType::int32: return convert_elements<int32_t>(bytes, count, vocab_size, out, bad_value);
    case TokenElementType::int64: return convert_elements<int64_t>(bytes, count, vocab_size, out, bad_value);
    case TokenElementType::uint16: return convert_elements<uint16_t>(bytes, count, vocab_size, out, bad_value);
  }
  return count;
}

// Throws an InputError naming the first token >= vocab_size.
void check_token_range(const uint16_t* tokens /*[count]*/, size_t count, int vocab_size, const std::string& name,
                       uint64_t first_index = 0, int64_t first_token_byte = -1) {
  const size_t bad = find_token_out_of_range(tokens, count, vocab_size);
  if (bad == count) return;
  throw InputError(token_out_of_range_message(name, tokens[bad], first_index + bad, vocab_size, first_token_byte),
                   "the shard was tokenized for a larger vocabulary than the model's");
}

void check_token_count(size_t num_tokens, size_t min_tokens, const std::string& name) {
  if (num_tokens == 0) throw InputError(detail::concat(name, ": empty file (no tokens)"));
  if (num_tokens < min_tokens) {
    throw InputError(detail::concat(name, ": holds ", num_tokens, " tokens, too few tokens for one sample (seq_len + 1 = ",
                                    min_tokens, ")"));
  }
}

std::string format_hint(TokenFileFormat format) {
  return format == TokenFileFormat::llmc
             ? "llm.c shards start with magic 20240520; for nanoGPT-style raw uint16 token files pass "
               "--data-format raw-uint16"
             : "raw uint16 token files hold tokens only; for llm.c shards (magic 20240520) drop --data-format "
               "raw-uint16";
}

// Where the shard's tokens begin in its file and how many there are, from the file's size and
// (llm.c) header, which are validated against `format`.
struct TokenExtent {
  uint64_t first_byte = 0;
  size_t count = 0;
};

TokenExtent locate_tokens(const InputFile& file, TokenFileFormat format) {
  const std::string& name = file.path();
  const uint64_t file_bytes = file.size();
  int32_t header[3] = {0, 0, 0};
  file.read_exact_at(0, header, std::min<uint64_t>(file_bytes, sizeof(header)));
  const bool has_magic = file_bytes >= sizeof(int32_t) && header[0] == kLlmcShardMagic;

  if (format == TokenFileFormat::raw_uint16) {
    if (has_magic) {
      throw InputError(detail::concat(name, ": starts with the llm.c shard magic ", kLlmcShardMagic,
                                      ", but --data-format raw-uint16 would read its header as tokens"),
                       format_hint(format));
    }
    if (file_bytes % 2 != 0) {
      throw InputError(detail::concat(name, ": odd size (", file_bytes,
                                      " bytes) for a raw uint16 token file, which must have an even size"),
                       format_hint(format));
    }
    return {0, size_t(file_bytes / 2)};
  }

  if (!has_magic) {
    if (file_bytes < sizeof(int32_t)) {
      throw InputError(detail::concat(name, ": not an llm.c token shard (", file_bytes,
                                      " bytes, too short for the header's magic)"),
                       format_hint(format));
    }
    throw InputError(detail::concat(name, ": not an llm.c token shard (wrong magic ", header[0], ", expected ",
                                    kLlmcShardMagic, ")"),
                     format_hint(format));
  }
  if (file_bytes < kLlmcHeaderBytes) {
    throw InputError(detail::concat(name, ": truncated llm.c header (the file is ", file_bytes,
                                    " bytes, the header alone is ", kLlmcHeaderBytes, ")"));
  }
  if (header[1] != kLlmcShardVersion) {
    throw InputError(detail::concat(name, ": unsupported version ", header[1], " of the llm.c shard format"),
                     "only version 1 (uint16 tokens) is supported");
  }
  const uint64_t payload_bytes = file_bytes - kLlmcHeaderBytes;
  const int64_t header_tokens = header[2];
  if (payload_bytes % 2 != 0 || header_tokens < 0 || static_cast<uint64_t>(header_tokens) != payload_bytes / 2) {
    throw InputError(detail::concat(name, ": header says ", header_tokens, " tokens but the file holds ",
                                    payload_bytes / 2, payload_bytes % 2 != 0 ? " and a stray byte" : ""),
                     "the file is truncated or was not fully written");
  }
  return {kLlmcHeaderBytes, size_t(payload_bytes / 2)};
}

// Every token of a file shard < vocab_size, read in large sequential chunks.
void check_file_token_range(const InputFile& file, const TokenExtent& extent, int vocab_size,
                            TokenElementType type = TokenElementType::uint16) {
  constexpr size_t kChunkTokens = size_t{1} << 19;
  if (type == TokenElementType::uint16) {
    std::vector<uint16_t> chunk(std::min(kChunkTokens, extent.count));
    for (size_t first = 0; first < extent.count; first += chunk.size()) {
      const size_t count = std::min(chunk.size(), extent.count - first);
      file.read_exact_at(extent.first_byte + 2 * uint64_t(first), chunk.data(), 2 * count);
      check_token_range(chunk.data(), count, vocab_size, file.path(), first, int64_t(extent.first_byte));
    }
    return;
  }
  const size_t bytes = element_bytes(type);
  std::vector<unsigned char> raw(std::min(kChunkTokens, extent.count) * bytes);
  std::vector<uint16_t> tokens(raw.size() / bytes);
  for (size_t first = 0; first < extent.count; first += tokens.size()) {
    const size_t count = std::min(tokens.size(), extent.count - first);
    file.read_exact_at(extent.first_byte + bytes * uint64_t(first), raw.data(), bytes * count);
    int64_t bad_value = 0;
    const size_t bad = convert_tokens(raw.data(), count, type, vocab_size, tokens.data(), bad_value);
    if (bad != count) {
      throw InputError(token_out_of_range_message(file.path(), bad_value, first + bad, vocab_size,
                                                  int64_t(extent.first_byte), bytes),
                       "the data was tokenized for a larger vocabulary than the model's");
    }
  }
}

// Every shard keeps its descriptor open for the run. Raises the soft limit on open files to fit
// `shards` more (with room for the rest of the process: MPI, NCCL, checkpoints, logs), up to
// the hard limit; beyond it, an InputError.
void reserve_open_files(size_t shards) {
  constexpr uint64_t kHeadroom = 256;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const uint64_t needed = uint64_t(shards) + kHeadroom;
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= needed) return;
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < needed) {
    throw InputError(detail::concat("data path: ", shards, " shard files need about ", needed,
                                    " open files, above this process's limit of ", uint64_t(limit.rlim_max)),
                     "raise the limit (ulimit -n), or use fewer, larger shards");
  }
  limit.rlim_cur = needed;
  ::setrlimit(RLIMIT_NOFILE, &limit);
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

std::string_view to_string(TokenFileFormat format) {
  return format == TokenFileFormat::llmc ? "llmc" : "raw-uint16";
}

size_t element_bytes(TokenElementType type) {
  switch (type) {
    case TokenElementType::uint8:
    case TokenElementType::int8: return 1;
    case TokenElementType::int16:
    case TokenElementType::uint16: return 2;
    case TokenElementType::int32: return 4;
    case TokenElementType::int64: return 8;
  }
  return 0;
}

std::string_view to_string(TokenElementType type) {
  switch (type) {
    case TokenElementType::uint8: return "uint8";
    case TokenElementType::int8: return "int8";
    case TokenElementType::int16: return "int16";
    case TokenElementType::int32: return "int32";
    case TokenElementType::int64: return "int64";
    case TokenElementType::uint16: return "uint16";
  }
  return "?";
}

TokenShard TokenShard::open_span(const std::string& path, uint64_t first_byte, size_t count, TokenElementType type,
                                 int vocab_size, size_t min_tokens) {
  TokenShard shard;
  shard.name_ = path;
  shard.vocab_size_ = vocab_size;
  shard.element_ = type;
  shard.file_ = InputFile::open(path);
  const uint64_t end_byte = first_byte + uint64_t(count) * element_bytes(type);
  if (shard.file_.size() < end_byte) {
    throw InputError(detail::concat(path, ": truncated: the file ends at byte offset ", shard.file_.size(),
                                    ", the tokens it should hold end at byte offset ", end_byte),
                     "the file is truncated or was not fully written");
  }
  check_token_count(count, min_tokens, path);
  shard.file_.advise_sequential();
  check_file_token_range(shard.file_, TokenExtent{first_byte, count}, vocab_size, type);
  shard.file_.advise_random();
  shard.first_token_byte_ = first_byte;
  shard.num_tokens_ = count;
  return shard;
}

TokenShard TokenShard::open_file(const std::string& path, TokenFileFormat format, int vocab_size,
                                 size_t min_tokens) {
  TokenShard shard;
  shard.name_ = path;
  shard.vocab_size_ = vocab_size;
  shard.file_ = InputFile::open(path);
  if (shard.file_.size() == 0) throw InputError(detail::concat(path, ": empty file (no tokens)"));
  const TokenExtent extent = locate_tokens(shard.file_, format);
  check_token_count(extent.count, min_tokens, path);
  shard.file_.advise_sequential();  // a hint for the one full scan
  check_file_token_range(shard.file_, extent, vocab_size);
  shard.file_.advise_random();  // training reads windows in shuffled order
  shard.first_token_byte_ = extent.first_byte;
  shard.num_tokens_ = extent.count;
  return shard;
}

TokenShard TokenShard::from_tokens(std::vector<uint16_t> tokens, std::string name, int vocab_size,
                                   size_t min_tokens) {
  check_token_count(tokens.size(), min_tokens, name);
  check_token_range(tokens.data(), tokens.size(), vocab_size, name);
  TokenShard shard;
  shard.name_ = std::move(name);
  shard.vocab_size_ = vocab_size;
  shard.owned_tokens_ = std::move(tokens);
  shard.num_tokens_ = shard.owned_tokens_.size();
  return shard;
}

void TokenShard::read(uint64_t first, size_t count, uint16_t* out /*[count]*/) const {
  FP8LM_CHECK(first <= num_tokens_ && count <= num_tokens_ - first, name_, ": tokens [", first, ", ", first + count,
              ") of ", num_tokens_);
  if (!file_.is_open()) {
    std::copy_n(owned_tokens_.data() + first, count, out);
    return;
  }
  if (element_ != TokenElementType::uint16) {
    const size_t bytes = element_bytes(element_);
    std::vector<unsigned char> raw(count * bytes);
    file_.read_exact_at(first_token_byte_ + bytes * first, raw.data(), raw.size());
    int64_t bad_value = 0;
    const size_t bad = convert_tokens(raw.data(), count, element_, vocab_size_, out, bad_value);
    if (bad != count) {
      throw RuntimeError(token_out_of_range_message(name_, bad_value, first + bad, vocab_size_,
                                                    int64_t(first_token_byte_), bytes) +
                             "; the file changed after it was validated",
                         "do not modify or replace input files while a run reads them");
    }
    return;
  }
  file_.read_exact_at(first_token_byte_ + 2 * first, out, 2 * count);
  // The file was validated when it was opened; one rewritten since must not reach the
  // embedding with an out-of-range index.
  const size_t bad = find_token_out_of_range(out, count, vocab_size_);
  if (bad != count) {
    throw RuntimeError(
        token_out_of_range_message(name_, out[bad], first + bad, vocab_size_, int64_t(first_token_byte_)) +
            "; the file changed after it was validated",
        "do not modify or replace input files while a run reads them");
  }
}

// ---------------------------------------------------------------------------------------------
// DataLoader

DataLoader::DataLoader(const std::vector<std::string>& shard_paths, const DataLoaderOptions& options)
    : options_(options) {
  FP8LM_CHECK(options.seq_len > 0, "seq_len ", options.seq_len);
  if (shard_paths.empty()) throw InputError("data path: no shard files given");
  reserve_open_files(shard_paths.size());
  shards_.reserve(shard_paths.size());
  for (const auto& path : shard_paths) {
    shards_.push_back(TokenShard::open_file(path, options.format, options.vocab_size, size_t(options.seq_len) + 1));
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

DataLoader::DataLoader(std::vector<TokenShard> shards, const DataLoaderOptions& options)
    : options_(options), shards_(std::move(shards)) {
  FP8LM_CHECK(options.seq_len > 0, "seq_len ", options.seq_len);
  FP8LM_CHECK(!shards_.empty(), "no shards");
  init();
}

DataLoader::DataLoader(std::vector<std::vector<TokenShard>> sources, std::vector<double> weights,
                       const DataLoaderOptions& options)
    : options_(options) {
  FP8LM_CHECK(options.seq_len > 0, "seq_len ", options.seq_len);
  FP8LM_CHECK(!sources.empty() && sources.size() == weights.size(), sources.size(), " sources, ", weights.size(),
              " weights");
  std::vector<size_t> shard_counts;
  for (auto& source : sources) {
    FP8LM_CHECK(!source.empty(), "a blend source without shards");
    shard_counts.push_back(source.size());
    for (auto& shard : source) shards_.push_back(std::move(shard));
  }
  init();
  if (sources.size() > 1) init_blend(std::move(shard_counts), std::move(weights));
}

void DataLoader::init_blend(std::vector<size_t> source_shard_counts, std::vector<double> weights) {
  double total = 0;
  for (const double w : weights) {
    FP8LM_CHECK(std::isfinite(w) && w > 0, "blend weight ", w);
    total += w;
  }
  size_t shard = 0;
  for (size_t i = 0; i < source_shard_counts.size(); ++i) {
    BlendSource source;
    source.first_shard = shard;
    source.end_shard = shard + source_shard_counts[i];
    source.first_sample = sample_offsets_[source.first_shard];
    source.num_samples = sample_offsets_[source.end_shard] - source.first_sample;
    source.weight = weights[i] / total;
    blend_.push_back(std::move(source));
    shard = blend_.back().end_shard;
  }
  const std::vector<uint64_t> per_epoch = replay_blend(steps_per_epoch() * samples_per_step());
  for (size_t i = 0; i < blend_.size(); ++i) blend_[i].picks_per_epoch = per_epoch[i];
  reset();
}

size_t DataLoader::blend_pick(uint64_t index, const std::vector<uint64_t>& counts) const {
  // Megatron's rule, in doubles as Megatron computes it, so the schedules agree.
  const double at = std::max(static_cast<double>(index), 1.0);
  size_t best = 0;
  double best_error = blend_[0].weight * at - static_cast<double>(counts[0]);
  for (size_t i = 1; i < blend_.size(); ++i) {
    const double error = blend_[i].weight * at - static_cast<double>(counts[i]);
    if (error > best_error) {
      best_error = error;
      best = i;
    }
  }
  return best;
}

std::vector<uint64_t> DataLoader::replay_blend(uint64_t picks) const {
  std::vector<uint64_t> counts(blend_.size(), 0);
  for (uint64_t j = 0; j < picks; ++j) ++counts[blend_pick(j, counts)];
  return counts;
}

uint64_t DataLoader::blend_sample(size_t index, uint64_t picks_this_epoch) {
  BlendSource& source = blend_[index];
  const uint64_t pick = position_.epoch * source.picks_per_epoch + picks_this_epoch;
  const uint64_t source_epoch = pick / source.num_samples;
  const uint64_t in_epoch = pick % source.num_samples;
  if (!options_.shuffle) return source.first_sample + in_epoch;
  if (source.order_epoch != source_epoch) {
    source.order.resize(source.num_samples);
    for (uint64_t i = 0; i < source.num_samples; ++i) source.order[i] = i;
    // Each source its own stream: the seed mixed with the source's index, then the epoch.
    std::mt19937_64 engine(epoch_seed(epoch_seed(options_.seed, ~uint64_t(index)), source_epoch));
    for (uint64_t i = source.num_samples - 1; i > 0; --i) {
      std::swap(source.order[i], source.order[uniform_below(engine, i + 1)]);
    }
    source.order_epoch = source_epoch;
  }
  return source.first_sample + source.order[in_epoch];
}

void DataLoader::next_blend_batch(int32_t* inputs /*[B,T]*/, int32_t* targets /*[B,T]*/) {
  const uint64_t B = uint64_t(options_.micro_batch_size);
  const uint64_t T = uint64_t(options_.seq_len);
  const uint64_t mine = uint64_t(options_.data_parallel_rank) * B;
  // Every rank replays the whole step's picks, so each knows how far every source has read.
  for (uint64_t j = 0; j < samples_per_step(); ++j) {
    const size_t source = blend_pick(position_.next_sample + j, blend_counts_);
    if (j >= mine && j < mine + B) {
      copy_sample(blend_sample(source, blend_counts_[source]), inputs + (j - mine) * T, targets + (j - mine) * T);
    }
    ++blend_counts_[source];
  }
  position_.next_sample += samples_per_step();
  if (position_.next_sample + samples_per_step() > samples_per_epoch()) {
    position_.epoch += 1;
    position_.next_sample = 0;
    blend_counts_.assign(blend_.size(), 0);
  }
}

void DataLoader::init() {
  const DataLoaderOptions& o = options_;
  FP8LM_CHECK(o.micro_batch_size > 0, "micro_batch_size ", o.micro_batch_size);
  FP8LM_CHECK(o.vocab_size > 0 && o.vocab_size <= 65536, "vocab_size ", o.vocab_size, " (uint16 tokens)");
  FP8LM_CHECK(o.data_parallel_size > 0 && o.data_parallel_rank >= 0 && o.data_parallel_rank < o.data_parallel_size,
              "data-parallel rank ", o.data_parallel_rank, " of ", o.data_parallel_size);
  FP8LM_CHECK(o.loss_mask_token >= -1 && o.loss_mask_token < o.vocab_size, "loss_mask_token ", o.loss_mask_token,
              " (vocabulary ", o.vocab_size, ")");

  window_.resize(size_t(o.seq_len) + 1);
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
  if (!blend_.empty()) blend_counts_ = replay_blend(position_.next_sample);
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

void DataLoader::copy_sample(uint64_t sample, int32_t* inputs /*[T]*/, int32_t* targets /*[T]*/) {
  // The shard whose sample range holds `sample`: the last offset <= sample.
  const auto after = std::upper_bound(sample_offsets_.begin(), sample_offsets_.end(), sample);
  const size_t shard_index = size_t(after - sample_offsets_.begin()) - 1;
  const uint64_t T = uint64_t(options_.seq_len);
  shards_[shard_index].read((sample - sample_offsets_[shard_index]) * T, window_.size(), window_.data());
  for (uint64_t t = 0; t < T; ++t) {
    inputs[t] = window_[t];
    targets[t] = window_[t + 1];
  }
  if (options_.loss_mask_token >= 0) mask_targets_after_token(options_.loss_mask_token, inputs, targets, T);
}

void DataLoader::next_batch(int32_t* inputs /*[B,T]*/, int32_t* targets /*[B,T]*/) {
  if (!blend_.empty()) {
    next_blend_batch(inputs, targets);
    return;
  }
  prepare_order(position_.epoch);
  const uint64_t B = uint64_t(options_.micro_batch_size);
  const uint64_t T = uint64_t(options_.seq_len);
  const uint64_t first = position_.next_sample + uint64_t(options_.data_parallel_rank) * B;
  for (uint64_t b = 0; b < B; ++b) copy_sample(sample_at(first + b), inputs + b * T, targets + b * T);
  set_position({position_.epoch, position_.next_sample + samples_per_step()});
}

}  // namespace fp8lm
