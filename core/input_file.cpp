#include "core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace fp8lm {

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a plain file";
}

}  // namespace

InputFile InputFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, before fstat could
  // tell what the path is. O_NOCTTY: a terminal named by mistake must not become ours.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) throw InputError(detail::concat(path, ": cannot open (", std::strerror(errno), ")"));
  InputFile file;
  file.path_ = path;
  file.fd_ = fd;  // closed by the destructor from here on, also when a check below throws
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    throw InputError(detail::concat(path, ": cannot stat (", std::strerror(errno), ")"));
  }
  if (!S_ISREG(info.st_mode)) {
    throw InputError(detail::concat(path, ": not a regular file (", file_kind(info.st_mode), ")"),
                     "fp8lm reads its inputs from regular files only: a FIFO or a device could block or never end");
  }
  // Regular files ignore O_NONBLOCK today; clearing it keeps reads blocking on every filesystem.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  file.size_ = static_cast<uint64_t>(info.st_size);
  return file;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_exact_at(uint64_t offset, void* out, size_t bytes) const {
  auto* destination = static_cast<unsigned char*>(out);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t got = ::pread(fd_, destination + done, bytes - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw RuntimeError(detail::concat(path_, ": read of ", bytes, " bytes at offset ", offset, " failed (",
                                        std::strerror(errno), ")"));
    }
    if (got == 0) {
      struct stat info {};
      const bool known = ::fstat(fd_, &info) == 0;
      throw RuntimeError(
          detail::concat(path_, ": the file ends at byte ", known ? uint64_t(info.st_size) : offset + done,
                         " but ", offset + bytes, " were needed; it held ", size_,
                         " bytes when it was opened (truncated while in use)"),
          "do not modify or replace input files while a run reads them");
    }
    done += static_cast<size_t>(got);
  }
}

void InputFile::advise_sequential() const {
  if (fd_ >= 0) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
}

void InputFile::advise_random() const {
  if (fd_ >= 0) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
}

std::string read_input_file(const std::string& path, uint64_t max_bytes) {
  const InputFile file = InputFile::open(path);
  if (file.size() > max_bytes) {
    throw InputError(detail::concat(path, ": ", file.size(), " bytes, more than the ", max_bytes,
                                    " bytes a config or manifest may have"),
                     "is it the right file?");
  }
  std::string text;
  char buffer[1 << 16];
  for (uint64_t offset = 0;;) {
    const ssize_t got = ::pread(file.fd(), buffer, sizeof buffer, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw InputError(detail::concat(path, ": read failed (", std::strerror(errno), ")"));
    }
    if (got == 0) break;
    if (text.size() + static_cast<size_t>(got) > max_bytes) {  // it grew since it was opened
      throw InputError(detail::concat(path, ": more than the ", max_bytes, " bytes a config or manifest may have"));
    }
    text.append(buffer, static_cast<size_t>(got));
    offset += static_cast<uint64_t>(got);
  }
  return text;
}

}  // namespace fp8lm
