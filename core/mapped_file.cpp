#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace fp8lm {

MappedFile MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(detail::concat(path, ": cannot open (", std::strerror(errno), ")"));
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    throw InputError(detail::concat(path, ": not a regular file"));
  }
  MappedFile file;
  file.bytes_ = static_cast<size_t>(info.st_size);
  if (file.bytes_ == 0) {
    ::close(fd);
    return file;
  }
  void* mapping = ::mmap(nullptr, file.bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file readable
  if (mapping == MAP_FAILED) throw RuntimeError(detail::concat(path, ": mmap failed (", std::strerror(map_errno), ")"));
  file.mapping_ = mapping;
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
