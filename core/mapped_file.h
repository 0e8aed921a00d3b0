// A read-only memory map of a whole file, unmapped when the owner goes away. The safetensors
// reader validates what it maps before it uses it. A mapped file that another process
// truncates raises SIGBUS on the next access to a page past the new end, so readers that
// hold a file for a whole run (token shards) read through InputFile's pread instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace fp8lm {

class MappedFile {
 public:
  // Maps `path`. InputError naming it when it cannot be opened or is not a regular
  // file (InputFile::open's rule); an empty file gives an empty mapping (data() null, size() 0).
  static MappedFile open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept { swap(other); }
  MappedFile& operator=(MappedFile&& other) noexcept {
    MappedFile(std::move(other)).swap(*this);
    return *this;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return static_cast<const uint8_t*>(mapping_); }
  size_t size() const { return bytes_; }
  bool is_mapped() const { return mapping_ != nullptr; }
  // Access-pattern hints to the kernel.
  void advise_sequential() const;
  void advise_random() const;

 private:
  void swap(MappedFile& other) noexcept {
    std::swap(mapping_, other.mapping_);
    std::swap(bytes_, other.bytes_);
  }
  void* mapping_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace fp8lm
