#include "core/checksum.h"

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/input_file.h"

namespace fp8lm {

namespace {

constexpr uint32_t kReflectedPolynomial = 0xEDB88320u;

// Slicing-by-8 tables: table[0][b] is the CRC of the single byte b; table[k][b] is the CRC
// of b followed by k zero bytes, so eight bytes are folded in per step with eight lookups.
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;

constexpr CrcTables make_tables() {
  CrcTables tables{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kReflectedPolynomial : 0u);
    tables[0][byte] = crc;
  }
  for (size_t k = 1; k < 8; ++k) {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      const uint32_t previous = tables[k - 1][byte];
      tables[k][byte] = (previous >> 8) ^ tables[0][previous & 0xFFu];
    }
  }
  return tables;
}

constexpr CrcTables kTables = make_tables();
static_assert(kTables[0][1] == 0x77073096u, "CRC-32 table");

}  // namespace

uint32_t crc32(const void* data, size_t bytes, uint32_t seed) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t crc = ~seed;
  if constexpr (std::endian::native == std::endian::little) {
    while (bytes >= 8) {
      uint32_t low;
      uint32_t high;
      std::memcpy(&low, p, 4);
      std::memcpy(&high, p + 4, 4);
      low ^= crc;
      crc = kTables[7][low & 0xFFu] ^ kTables[6][(low >> 8) & 0xFFu] ^ kTables[5][(low >> 16) & 0xFFu] ^
            kTables[4][low >> 24] ^ kTables[3][high & 0xFFu] ^ kTables[2][(high >> 8) & 0xFFu] ^
            kTables[1][(high >> 16) & 0xFFu] ^ kTables[0][high >> 24];
      p += 8;
      bytes -= 8;
    }
  }
  while (bytes > 0) {
    crc = (crc >> 8) ^ kTables[0][(crc ^ *p) & 0xFFu];
    ++p;
    --bytes;
  }
  return ~crc;
}

std::string file_crc32_hex(const std::string& path) {
  const InputFile file = InputFile::open(path);  // refuses FIFOs, devices and directories
  const int fd = file.fd();
  std::vector<uint8_t> buffer(size_t{1} << 20);
  uint32_t crc = 0;
  for (;;) {
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      const int read_errno = errno;
      throw InputError(detail::concat(path, ": read failed while checksumming (", std::strerror(read_errno), ")"));
    }
    if (got == 0) break;
    crc = crc32(buffer.data(), static_cast<size_t>(got), crc);
  }
  return crc32_hex(crc);
}

std::string crc32_hex(uint32_t crc) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(8, '0');
  for (int i = 0; i < 8; ++i) hex[i] = kHex[(crc >> (28 - 4 * i)) & 0xFu];
  return hex;
}

}  // namespace fp8lm
