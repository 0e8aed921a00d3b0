// Opening the files a user names as input (configs, token shards, safetensors, checkpoint
// manifests). One rule for every reader: only a regular file is read. A FIFO would block the
// open until some writer appears (forever, for a mistyped path), a character device such as
// /dev/zero never ends, and a directory fails deep inside a parser with a message that names
// nothing. Each is refused when it is opened, with an InputError naming the file, and the open
// itself never blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace fp8lm {

// A read-only descriptor of a regular file, closed on destruction. Reads go through pread,
// so a file that shrinks while it is being read gives an error naming it rather than the
// SIGBUS a memory map would raise.
class InputFile {
 public:
  // Opens `path`; InputError naming it when it is missing, unreadable or not a regular file.
  static InputFile open(const std::string& path);

  InputFile() = default;
  InputFile(InputFile&& other) noexcept { swap(other); }
  InputFile& operator=(InputFile&& other) noexcept {
    InputFile(std::move(other)).swap(*this);
    return *this;
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }  // when it was opened

  // Reads exactly `bytes` at `offset`. RuntimeError naming the file when the file now ends
  // before offset + bytes (it was truncated after it was opened) or the read fails.
  void read_exact_at(uint64_t offset, void* out, size_t bytes) const;

  // Access-pattern hints to the kernel's read-ahead.
  void advise_sequential() const;
  void advise_random() const;

 private:
  void swap(InputFile& other) noexcept {
    std::swap(path_, other.path_);
    std::swap(fd_, other.fd_);
    std::swap(size_, other.size_);
  }
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole content of a small regular file (a config, a manifest), refused as InputFile::open
// refuses. A file above `max_bytes` is an InputError too: a shard passed as --config by
// mistake must not be read into memory whole before the parser rejects its first byte.
inline constexpr uint64_t kMaxTextInputBytes = uint64_t{64} << 20;
std::string read_input_file(const std::string& path, uint64_t max_bytes = kMaxTextInputBytes);

}  // namespace fp8lm
