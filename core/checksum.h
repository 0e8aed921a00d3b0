// CRC-32 checksums of buffers and files, for checkpoint integrity checks.
//
// crc32 is the standard CRC-32 (ISO-HDLC: zlib, gzip, PNG, Ethernet): polynomial 0x04C11DB7
// (reflected 0xEDB88320), initial value and final XOR 0xFFFFFFFF. Check value:
// crc32("123456789", 9) == 0xCBF43926. `seed` is a previous result, so a stream can be
// checksummed in pieces: crc32(b, nb, crc32(a, na)) == crc32(a followed by b).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fp8lm {

uint32_t crc32(const void* data, size_t bytes, uint32_t seed = 0);

// CRC-32 of a file's contents, read in chunks, as 8 lowercase hex digits ("cbf43926").
// InputError naming the file when it cannot be opened or read.
std::string file_crc32_hex(const std::string& path);

// A CRC-32 as 8 lowercase hex digits, as file_crc32_hex writes it.
std::string crc32_hex(uint32_t crc);

}  // namespace fp8lm
