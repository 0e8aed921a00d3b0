#include "core/mapped_file.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/input_file.h"

namespace fp8lm {

MappedFile MappedFile::open(const std::string& path) {
  const InputFile input = InputFile::open(path);  // refuses FIFOs, devices and directories
  MappedFile file;
  file.bytes_ = static_cast<size_t>(input.size());
  if (file.bytes_ == 0) return file;
  void* mapping = ::mmap(nullptr, file.bytes_, PROT_READ, MAP_PRIVATE, input.fd(), 0);
  if (mapping == MAP_FAILED) throw RuntimeError(detail::concat(path, ": mmap failed (", std::strerror(errno), ")"));
  file.mapping_ = mapping;  // the mapping keeps the file readable after `input` closes it
  return file;
}

MappedFile::~MappedFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, bytes_);
}

void MappedFile::advise_sequential() const {
  if (mapping_ != nullptr) ::madvise(mapping_, bytes_, MADV_SEQUENTIAL);
}

void MappedFile::advise_random() const {
  if (mapping_ != nullptr) ::madvise(mapping_, bytes_, MADV_RANDOM);
}

}  // namespace fp8lm
