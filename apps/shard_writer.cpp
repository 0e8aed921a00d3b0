#include "apps/shard_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "core/error.h"
#include "core/token_data.h"

namespace fp8lm {

namespace fs = std::filesystem;

ShardWriter::ShardWriter(fs::path dir, std::string prefix, int64_t shard_tokens, std::vector<fs::path>& written)
    : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), written_(written) {
  FP8LM_CHECK(shard_tokens_ >= 1 && shard_tokens_ <= INT32_MAX, "shard_tokens ", shard_tokens_);
}

ShardWriter::~ShardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void ShardWriter::append(const uint16_t* tokens, size_t count) {
  while (count > 0) {
    if (file_ == nullptr) open_next();
    const size_t take = std::min<size_t>(count, static_cast<size_t>(shard_tokens_ - in_shard_));
    if (std::fwrite(tokens, sizeof(uint16_t), take, file_) != take) fail("cannot write");
    tokens += take;
    count -= take;
    in_shard_ += static_cast<int64_t>(take);
    total_ += take;
    if (in_shard_ == shard_tokens_) close_current();
  }
}

void ShardWriter::finish() {
  if (file_ != nullptr) close_current();
}

fs::path ShardWriter::final_path(int index) const {
  char name[64];
  std::snprintf(name, sizeof(name), "_%06d.bin", index);
  return dir_ / (prefix_ + name);
}

fs::path ShardWriter::temp_path(int index) const { return fs::path(final_path(index).string() + ".tmp"); }

void ShardWriter::open_next() {
  const fs::path temp = temp_path(shard_index_);
  file_ = std::fopen(temp.c_str(), "wb");
  if (file_ == nullptr) fail("cannot create");
  written_.push_back(temp);
  const int32_t header[kLlmcHeaderInts] = {};  // completed in close_current
  if (std::fwrite(header, sizeof(header), 1, file_) != 1) fail("cannot write");
  in_shard_ = 0;
}

void ShardWriter::close_current() {
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = kLlmcShardMagic;
  header[1] = kLlmcShardVersion;
  header[2] = static_cast<int32_t>(in_shard_);
  if (std::fseek(file_, 0, SEEK_SET) != 0 || std::fwrite(header, sizeof(header), 1, file_) != 1) fail("cannot write");
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (closed != 0) fail("cannot write");
  const fs::path temp = temp_path(shard_index_), final_name = final_path(shard_index_);
  std::error_code error;
  fs::rename(temp, final_name, error);
  if (error) throw RuntimeError(final_name.string() + ": cannot rename from " + temp.string() + " (" + error.message() + ")");
  written_.back() = final_name;
  ++shard_index_;
}

void ShardWriter::fail(const char* what) const {
  throw RuntimeError(temp_path(shard_index_).string() + ": " + what + " (" + std::strerror(errno) + ")");
}

}  // namespace fp8lm
