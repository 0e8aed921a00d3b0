// Writes a stream of tokens as llm.c shards PREFIX_000000.bin, PREFIX_000001.bin, ... in a
// directory: a 1024-byte header (magic 20240520, version 1, token count) and uint16 tokens,
// at most shard_tokens per shard. Each shard is written as NAME.tmp and renamed to NAME when
// it is complete, so a reader never sees a partial shard under a final name.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace fp8lm {

class ShardWriter {
 public:
  // `written` collects every path this writer created (temporary or final), for clean-up on
  // failure.
  ShardWriter(std::filesystem::path dir, std::string prefix, int64_t shard_tokens,
              std::vector<std::filesystem::path>& written);
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  ~ShardWriter();

  void append(const uint16_t* tokens, size_t count);
  // Completes the last, partial shard (nothing when it holds no token).
  void finish();

  uint64_t total_tokens() const { return total_; }
  int shards() const { return shard_index_; }  // completed shards

  std::filesystem::path final_path(int index) const;
  std::filesystem::path temp_path(int index) const;

 private:
  void open_next();
  void close_current();
  [[noreturn]] void fail(const char* what) const;

  std::filesystem::path dir_;
  std::string prefix_;
  int64_t shard_tokens_;
  std::vector<std::filesystem::path>& written_;
  std::FILE* file_ = nullptr;
  int64_t in_shard_ = 0;
  int shard_index_ = 0;
  uint64_t total_ = 0;
};

}  // namespace fp8lm
