// Reading and writing Hugging Face safetensors files.
//
// The format (little-endian throughout):
//   bytes [0, 8)        uint64 N, the size of the header
//   bytes [8, 8+N)      UTF-8 JSON object: tensor name -> {"dtype": "F32", "shape": [2, 3],
//                       "data_offsets": [begin, end]}, plus an optional
//                       "__metadata__": {string: string}. May end in padding spaces.
//   bytes [8+N, EOF)    the data buffer; data_offsets are relative to its start, `end`
//                       exclusive, and each tensor's bytes are row-major.
//
// Reader: SafetensorsFile::open maps the file read-only and validates the whole header
// before it returns, so every view it hands out lies inside the file. Any problem with the
// file throws InputError("<path>: <problem>") in one line. The rules are the reference
// library's (safetensors, Rust): the header begins with '{' (trailing padding spaces are
// allowed); the data buffer begins exactly at 8 + N; sorted by offset, the tensors tile it
// exactly, contiguous from byte 0 without gaps or overlaps, and the last one ends at the end
// of the file; each tensor's byte span equals dtype size x shape product, computed with
// overflow checks. (That tiling rule is what catches a header size field that is off by a
// few bytes: the JSON's padding would otherwise absorb it and shift every tensor.) Accepted
// beyond the strictest reading: unknown extra fields in a tensor entry. Also rejected: a file
// under 8 bytes; a header size over 100 MB or past the end of the file; a header that is not
// UTF-8, contains a NUL byte, is not JSON, nests over 64 levels, repeats a key at any level,
// or is not an object; a tensor entry that is not an object, lacks or mistypes "dtype" /
// "shape" / "data_offsets", names an unknown dtype, has a negative, non-integer or
// overflowing shape, or offsets that are not two non-negative integers with begin <= end;
// "__metadata__" that is not an object of strings.
// The mapping is only as stable as the file: truncating the file on disk while it is
// mapped makes later reads fault (SIGBUS), as with any mmap.
//
// Writer: SafetensorsWriter lays the tensors out back to back (no holes, as the format
// requires), ordered by element size, largest first, and in insertion order within one
// element size. With the data buffer starting 8-byte aligned (the header is padded with
// spaces to a multiple of 8), that keeps every tensor aligned to its element size, which is
// what typed access needs. The file is written to "<path>.tmp", fsynced and renamed over
// <path>, so <path> is either the old file or the complete new one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/mapped_file.h"

namespace fp8lm {

// The element types this reader and writer know, by their safetensors names (to_string):
// F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL. Any other name in a file is an
// error.
enum class SafetensorsDtype { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

// Bytes per element: 8, 4, 2, 2, 1, 1, 8, 4, 2, 1, 1, 1.
size_t dtype_size(SafetensorsDtype dtype);
// The format's name for the dtype, e.g. "BF16", "F8_E4M3".
std::string_view to_string(SafetensorsDtype dtype);
// The dtype with that exact (case-sensitive) name, or nullopt for an unknown name.
std::optional<SafetensorsDtype> safetensors_dtype_from_string(std::string_view name);

// One tensor of a file: its bytes, as stored (little-endian, row-major).
struct SafetensorsTensorView {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::F32;
  std::vector<int64_t> shape;  // empty for a 0-d scalar (one element)
  const uint8_t* data = nullptr;  // `bytes` bytes; not necessarily aligned (files from other writers)
  size_t bytes = 0;            // numel() * dtype_size(dtype)
  // Product of the shape; 1 for a 0-d scalar, 0 when any dimension is 0.
  size_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates it; InputError("<path>: <problem>") when the file is
  // missing, unreadable or malformed in any way.
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();  // unmaps: views from this file dangle afterwards

  const std::string& path() const { return path_; }
  // Tensor names in file order: by data_offsets begin (then end, then name for the
  // zero-byte tensors that share an offset). Same order as tensors().
  std::vector<std::string> names() const;
  const std::vector<SafetensorsTensorView>& tensors() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  bool contains(std::string_view name) const;
  // InputError("<path>: no tensor named \"<name>\"") when absent. The reference stays valid
  // as long as this object (moves included) lives.
  const SafetensorsTensorView& tensor(std::string_view name) const;
  // The "__metadata__" object; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // N, the header's size in bytes (padding included); the data buffer starts at 8 + N.
  size_t header_bytes() const { return header_bytes_; }

 private:
  SafetensorsFile() = default;

  std::string path_;
  MappedFile file_;
  size_t header_bytes_ = 0;
  std::vector<SafetensorsTensorView> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// The tensor's values as FP32. Supports F64 (rounded to nearest; overflow gives +-inf), F32, F16, BF16, F8_E4M3 and F8_E5M2
// (exact); any other dtype throws InputError naming the tensor and its dtype.
std::vector<float> read_as_float(const SafetensorsTensorView& tensor);

class SafetensorsWriter {
 public:
  // Adds a tensor, COPYING its `bytes` bytes (row-major, little-endian) so the caller's buffer
  // may go away at once. `data` may be null when bytes == 0. Throws RuntimeError (a caller
  // bug, not user input) naming the tensor when: the name is empty, "__metadata__", not
  // valid UTF-8 or already added; a dimension is negative; the element count overflows; or
  // bytes != numel * dtype_size(dtype).
  void add(std::string name, SafetensorsDtype dtype, std::vector<int64_t> shape, const void* data,
           size_t bytes);
  // As add(), but keeps only the pointer: `data` must stay valid and unchanged until the
  // last write() call. Saves a copy of large checkpoints.
  void add_borrowed(std::string name, SafetensorsDtype dtype, std::vector<int64_t> shape,
                    const void* data, size_t bytes);
  // Sets (or replaces) one "__metadata__" entry. RuntimeError when key or value is not UTF-8.
  void set_metadata(std::string key, std::string value);

  // Writes the file (see the layout notes at the top). The header's JSON has its keys sorted
  // (byte order) and is padded with spaces so the data starts at a multiple of 8;
  // "__metadata__" is present only when set_metadata was called. RuntimeError naming `path`
  // on any I/O failure (the .tmp file is removed again).
  void write(const std::string& path) const;

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    SafetensorsDtype dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> owned;  // the copy, for add()
    const uint8_t* borrowed = nullptr;  // for add_borrowed()
    bool is_borrowed = false;
    size_t bytes = 0;
    const uint8_t* data() const { return is_borrowed ? borrowed : owned.data(); }
  };
  void add_entry(Entry entry, const void* data);

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fp8lm
