#include "core/safetensors.h"

#include "core/mapped_file.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"

namespace fp8lm {

// The format is little-endian; views hand out the file's bytes as they are.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using json = nlohmann::json;

// The header's size limit: as the reference implementation, 100 MB. Beyond it the file is
// not a safetensors file (or a hostile one), and we would not want to parse it anyway.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Legitimate headers nest three deep (object > tensor entry > shape array); allow slack,
// but stop pathological nesting early.
constexpr size_t kMaxJsonDepth = 64;

struct DtypeInfo {
  SafetensorsDtype dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DtypeInfo, 12> kDtypes{{
    {SafetensorsDtype::F64, "F64", 8},
    {SafetensorsDtype::F32, "F32", 4},
    {SafetensorsDtype::F16, "F16", 2},
    {SafetensorsDtype::BF16, "BF16", 2},
    {SafetensorsDtype::F8_E4M3, "F8_E4M3", 1},
    {SafetensorsDtype::F8_E5M2, "F8_E5M2", 1},
    {SafetensorsDtype::I64, "I64", 8},
    {SafetensorsDtype::I32, "I32", 4},
    {SafetensorsDtype::I16, "I16", 2},
    {SafetensorsDtype::I8, "I8", 1},
    {SafetensorsDtype::U8, "U8", 1},
    {SafetensorsDtype::BOOL, "BOOL", 1},
}};

const DtypeInfo& info_of(SafetensorsDtype dtype) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == dtype) return info;
  }
  throw RuntimeError(detail::concat("invalid SafetensorsDtype value ", static_cast<int>(dtype)));
}

// Position of the first byte that does not start a well-formed UTF-8 sequence (overlong
// forms, surrogates and code points above U+10FFFF are malformed), or nullopt.
std::optional<size_t> first_invalid_utf8(const uint8_t* text, size_t bytes) {
  size_t i = 0;
  while (i < bytes) {
    const uint8_t lead = text[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    uint32_t code_point;
    uint32_t min_code_point;
    if ((lead & 0xE0) == 0xC0) {
      length = 2, code_point = lead & 0x1Fu, min_code_point = 0x80;
    } else if ((lead & 0xF0) == 0xE0) {
      length = 3, code_point = lead & 0x0Fu, min_code_point = 0x800;
    } else if ((lead & 0xF8) == 0xF0) {
      length = 4, code_point = lead & 0x07u, min_code_point = 0x10000;
    } else {
      return i;  // a continuation byte without a lead, or 0xF8..0xFF
    }
    if (bytes - i < length) return i;
    for (size_t k = 1; k < length; ++k) {
      const uint8_t next = text[i + k];
      if ((next & 0xC0) != 0x80) return i;
      code_point = (code_point << 6) | (next & 0x3Fu);
    }
    if (code_point < min_code_point || code_point > 0x10FFFF ||
        (code_point >= 0xD800 && code_point <= 0xDFFF)) {
      return i;
    }
    i += length;
  }
  return std::nullopt;
}

bool is_utf8(std::string_view text) {
  return !first_invalid_utf8(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// A name from a file, fit for a one-line message: a JSON string literal, ASCII only (control
// characters and non-ASCII escaped), cut after 100 bytes.
std::string quote_name(std::string_view text) {
  constexpr size_t kMaxBytes = 100;
  const bool cut = text.size() > kMaxBytes;
  std::string shown = json(std::string(text.substr(0, kMaxBytes))).dump(-1, ' ', true, json::error_handler_t::replace);
  return cut ? shown + "..." : shown;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  constexpr size_t kMaxDims = 8;
  std::string text = "[";
  for (size_t i = 0; i < shape.size() && i < kMaxDims; ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  if (shape.size() > kMaxDims) text += ", ...";
  return text + "]";
}

const char* json_type_name(const json& value) {
  // nlohmann's type_name() says "number" for all three number kinds; say which.
  if (value.is_number_float()) return "a non-integer number";
  if (value.is_number()) return "an integer";
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "a binary value";
  }
}

// Element count of `shape`, or nullopt when it overflows 64 bits.
std::optional<uint64_t> checked_numel(const std::vector<int64_t>& shape) {
  for (int64_t dim : shape) {
    if (dim == 0) return 0;  // [2^40, 2^40, 0] is an empty tensor, not an overflow
  }
  uint64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) return std::nullopt;
  }
  return numel;
}

std::optional<uint64_t> checked_bytes(const std::vector<int64_t>& shape, SafetensorsDtype dtype) {
  const std::optional<uint64_t> numel = checked_numel(shape);
  uint64_t bytes;
  if (!numel || __builtin_mul_overflow(*numel, static_cast<uint64_t>(dtype_size(dtype)), &bytes)) {
    return std::nullopt;
  }
  if (bytes > std::numeric_limits<size_t>::max()) return std::nullopt;
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Reading

// Thrown from inside the JSON parser's callback; turned into an InputError with the path.
struct HeaderProblem {
  std::string message;
};

// Parses the header text into JSON, rejecting invalid UTF-8, invalid JSON, duplicate keys (at
// any level: nlohmann would silently keep the last) and pathological nesting.
json parse_header_json(const std::string& path, const uint8_t* text, size_t bytes) {
  // JSON allows no raw NUL anywhere, and nlohmann would take one for the end of the input.
  if (const void* nul = std::memchr(text, 0, bytes)) {
    throw InputError(detail::concat(path, ": header contains a NUL byte (file byte ",
                                    8 + (static_cast<const uint8_t*>(nul) - text), ")"));
  }
  if (const std::optional<size_t> bad = first_invalid_utf8(text, bytes)) {
    throw InputError(detail::concat(path, ": header is not valid UTF-8 (file byte ", 8 + *bad, ")"));
  }
  // One set of keys per open container; arrays get an (unused) set to keep the stack even.
  std::vector<std::set<std::string>> open_keys;
  const json::parser_callback_t callback = [&open_keys](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (open_keys.size() >= kMaxJsonDepth) {
          throw HeaderProblem{detail::concat("header JSON nests deeper than ", kMaxJsonDepth, " levels")};
        }
        open_keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open_keys.empty()) open_keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_keys.empty() && parsed.is_string() &&
            !open_keys.back().insert(parsed.get_ref<const std::string&>()).second) {
          throw HeaderProblem{"duplicate key " + quote_name(parsed.get_ref<const std::string&>()) + " in the header JSON"};
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    const char* begin = reinterpret_cast<const char*>(text);
    return json::parse(begin, begin + bytes, callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const HeaderProblem& problem) {
    throw InputError(detail::concat(path, ": ", problem.message));
  } catch (const json::exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ...": keep the part
    // after the tag, ASCII only and short, so the message stays one readable line.
    std::string reason = e.what();
    if (const size_t tag_end = reason.find("] "); tag_end != std::string::npos) reason.erase(0, tag_end + 2);
    if (reason.size() > 200) reason = reason.substr(0, 200) + "...";
    for (char& c : reason) {
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
    }
    throw InputError(detail::concat(path, ": header is not valid JSON (", reason, ")"));
  }
}

struct ParsedTensor {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

ParsedTensor parse_tensor_entry(const std::string& path, const std::string& name, const json& entry,
                                uint64_t data_bytes) {
  const std::string where = detail::concat(path, ": tensor ", quote_name(name), ": ");
  auto error = [&where](const auto&... parts) { return InputError(detail::concat(where, parts...)); };
  if (!entry.is_object()) throw error("entry is ", json_type_name(entry), ", not a JSON object");
  auto field = [&](const char* key) -> const json& {
    const auto it = entry.find(key);
    if (it == entry.end()) throw error("missing \"", key, "\"");
    return *it;
  };

  ParsedTensor tensor{name, SafetensorsDtype::F32, {}, 0, 0};

  const json& dtype = field("dtype");
  if (!dtype.is_string()) throw error("\"dtype\" is ", json_type_name(dtype), ", not a string");
  const std::optional<SafetensorsDtype> known = safetensors_dtype_from_string(dtype.get_ref<const std::string&>());
  if (!known) throw error("unknown dtype ", quote_name(dtype.get_ref<const std::string&>()));
  tensor.dtype = *known;

  const json& shape = field("shape");
  if (!shape.is_array()) throw error("\"shape\" is ", json_type_name(shape), ", not an array of integers");
  tensor.shape.reserve(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    const json& dim = shape[i];
    if (dim.is_number_unsigned()) {
      const uint64_t value = dim.get<uint64_t>();
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw error("shape[", i, "] = ", value, " is too large");
      }
      tensor.shape.push_back(static_cast<int64_t>(value));
    } else if (dim.is_number_integer()) {  // nlohmann stores only negative integers as signed
      throw error("shape[", i, "] is negative (", dim.get<int64_t>(), ")");
    } else {
      throw error("shape[", i, "] is ", json_type_name(dim), ", not a non-negative integer");
    }
  }
  const std::optional<uint64_t> expected_bytes = checked_bytes(tensor.shape, tensor.dtype);
  if (!expected_bytes) throw error("shape ", shape_string(tensor.shape), " overflows (element or byte count > 2^64)");

  const json& offsets = field("data_offsets");
  if (offsets.is_array() && offsets.size() == 2) {
    for (size_t i = 0; i < 2; ++i) {
      if (offsets[i].is_number_integer() && !offsets[i].is_number_unsigned()) {
        throw error("data_offsets[", i, "] is negative (", offsets[i].get<int64_t>(), ")");
      }
      if (!offsets[i].is_number_integer()) {
        throw error("data_offsets[", i, "] is ", json_type_name(offsets[i]), ", not a non-negative integer");
      }
    }
  }
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    throw error("\"data_offsets\" must be [begin, end], two non-negative integers; it is ", json_type_name(offsets),
                offsets.is_array() ? detail::concat(" of ", offsets.size(), " elements") : std::string());
  }
  tensor.begin = offsets[0].get<uint64_t>();
  tensor.end = offsets[1].get<uint64_t>();
  if (tensor.begin > tensor.end) throw error("data_offsets begin ", tensor.begin, " is after end ", tensor.end);
  if (tensor.end - tensor.begin != *expected_bytes) {
    throw error("data_offsets [", tensor.begin, ", ", tensor.end, "] hold ", tensor.end - tensor.begin, " bytes, but shape ",
         shape_string(tensor.shape), " of ", to_string(tensor.dtype), " needs ", *expected_bytes, " bytes (size mismatch)");
  }
  if (tensor.end > data_bytes) {
    throw error("data_offsets [", tensor.begin, ", ", tensor.end, "] run past the end of the data buffer (", data_bytes,
         " bytes; file truncated?)");
  }
  return tensor;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& metadata) {
  if (!metadata.is_object()) {
    throw InputError(detail::concat(path, ": \"__metadata__\" is ", json_type_name(metadata),
                                    ", not an object of strings"));
  }
  std::map<std::string, std::string> result;
  for (const auto& [key, value] : metadata.items()) {
    if (!value.is_string()) {
      throw InputError(detail::concat(path, ": \"__metadata__\" value of ", quote_name(key), " is ", json_type_name(value),
                                      ", not a string"));
    }
    result.emplace(key, value.get<std::string>());
  }
  return result;
}

}  // namespace

size_t dtype_size(SafetensorsDtype dtype) { return info_of(dtype).size; }

std::string_view to_string(SafetensorsDtype dtype) { return info_of(dtype).name; }

std::optional<SafetensorsDtype> safetensors_dtype_from_string(std::string_view name) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

size_t SafetensorsTensorView::numel() const {
  size_t count = 1;
  for (int64_t dim : shape) count *= static_cast<size_t>(dim);
  return count;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  file.file_ = MappedFile::open(path);  // unmapped by the destructor, also when validation throws
  const uint64_t file_bytes = file.file_.size();
  if (file_bytes < 8) {
    if (file_bytes == 0) throw InputError(detail::concat(path, ": empty file (not a safetensors file)"));
    throw InputError(detail::concat(path, ": file too short (", file_bytes,
                                    " bytes) to hold the 8-byte header size of a safetensors file"));
  }
  const uint8_t* bytes = file.file_.data();

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    throw InputError(detail::concat(path, ": header size ", header_bytes, " exceeds the limit of ", kMaxHeaderBytes,
                                    " bytes (not a safetensors file?)"));
  }
  if (header_bytes > file_bytes - 8) {
    throw InputError(detail::concat(path, ": header size ", header_bytes, " runs past the end of the file (",
                                    file_bytes, " bytes; file truncated?)"));
  }
  file.header_bytes_ = header_bytes;
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_start;

  const json header = parse_header_json(path, bytes + 8, header_bytes);
  if (!header.is_object()) {
    throw InputError(detail::concat(path, ": header is ", json_type_name(header), ", not a JSON object"));
  }

  std::vector<ParsedTensor> parsed;
  parsed.reserve(header.size());
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      file.metadata_ = parse_metadata(path, value);
    } else {
      parsed.push_back(parse_tensor_entry(path, name, value, data_bytes));
    }
  }

  // The reference library (safetensors, Rust) requires the opening brace as the header's
  // first byte; trailing spaces are the writers' padding.
  if (bytes[8] != '{') {
    throw InputError(detail::concat(path, ": header does not begin with '{' (whitespace or other bytes before the JSON "
                                    "object; the safetensors format does not allow them)"));
  }

  // File order; zero-byte tensors may share an offset, the name breaks the tie.
  std::sort(parsed.begin(), parsed.end(), [](const ParsedTensor& a, const ParsedTensor& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  // As the reference library: the tensors tile the data buffer exactly, from byte 0 to the
  // end of the file, without gaps or overlaps. This is what pins the data buffer to 8 + N:
  // a header size field off by a few bytes (absorbed by the JSON's trailing padding) would
  // otherwise shift every tensor's bytes while each entry on its own still looks valid.
  uint64_t covered = 0;  // data bytes [0, covered) belong to the tensors checked so far
  const ParsedTensor* previous = nullptr;
  for (const ParsedTensor& tensor : parsed) {
    if (tensor.begin < covered) {
      throw InputError(detail::concat(path, ": tensors ", quote_name(previous->name), " and ", quote_name(tensor.name),
                                      " overlap (data bytes [", previous->begin, ", ", previous->end, ") and [",
                                      tensor.begin, ", ", tensor.end, "))"));
    }
    if (tensor.begin > covered) {
      throw InputError(detail::concat(path, ": data bytes [", covered, ", ", tensor.begin, ") before tensor ",
                                      quote_name(tensor.name),
                                      " belong to no tensor (the format packs tensors back to back from byte 0)"));
    }
    covered = tensor.end;
    previous = &tensor;
  }
  if (covered != data_bytes) {
    throw InputError(detail::concat(path, ": the tensors cover ", covered, " bytes but the data buffer after the ",
                                    header_bytes, "-byte header holds ", data_bytes,
                                    " (the header size field is wrong, or bytes were appended to the file)"));
  }

  file.tensors_.reserve(parsed.size());
  for (ParsedTensor& tensor : parsed) {
    SafetensorsTensorView view;
    view.name = std::move(tensor.name);
    view.dtype = tensor.dtype;
    view.shape = std::move(tensor.shape);
    view.data = bytes + data_start + tensor.begin;
    view.bytes = static_cast<size_t>(tensor.end - tensor.begin);
    file.index_.emplace(view.name, file.tensors_.size());
    file.tensors_.push_back(std::move(view));
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> result;
  result.reserve(tensors_.size());
  for (const SafetensorsTensorView& tensor : tensors_) result.push_back(tensor.name);
  return result;
}

bool SafetensorsFile::contains(std::string_view name) const { return index_.find(name) != index_.end(); }

const SafetensorsTensorView& SafetensorsFile::tensor(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    throw InputError(detail::concat(path_, ": no tensor named ", quote_name(name), " (the file has ", tensors_.size(),
                                    " tensors)"));
  }
  return tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------
// read_as_float

namespace {
template <typename Stored, typename Convert>
void decode_elements(const uint8_t* data, size_t count, float* out, Convert convert) {
  for (size_t i = 0; i < count; ++i) {
    Stored value;
    std::memcpy(&value, data + i * sizeof(Stored), sizeof(Stored));  // data may be unaligned
    out[i] = convert(value);
  }
}
}  // namespace

std::vector<float> read_as_float(const SafetensorsTensorView& tensor) {
  const std::optional<uint64_t> expected = checked_bytes(tensor.shape, tensor.dtype);
  FP8LM_CHECK(expected && *expected == tensor.bytes, "tensor ", quote_name(tensor.name), ": ", tensor.bytes,
              " bytes do not match shape ", shape_string(tensor.shape), " of ", to_string(tensor.dtype));
  FP8LM_CHECK(tensor.data || tensor.bytes == 0, "tensor ", quote_name(tensor.name), " has no data");
  const size_t count = tensor.bytes / dtype_size(tensor.dtype);
  std::vector<float> out(count);
  const uint8_t* data = tensor.data;
  switch (tensor.dtype) {
    case SafetensorsDtype::F32:
      if (count) std::memcpy(out.data(), data, tensor.bytes);
      break;
    case SafetensorsDtype::F64:
      // Round to nearest as IEEE does: beyond FLT_MAX + half an ulp (2^128 - 2^103) is
      // infinity. Spelled out because a cast of an out-of-range double is undefined in C++.
      decode_elements<double>(data, count, out.data(), [](double x) {
        constexpr double kMax = std::numeric_limits<float>::max();
        constexpr double kOverflow = 0x1p128 - 0x1p103;
        const double magnitude = std::fabs(x);
        if (!(magnitude > kMax)) return static_cast<float>(x);  // in range, or NaN
        return static_cast<float>(std::copysign(magnitude >= kOverflow ? HUGE_VAL : kMax, x));
      });
      break;
    case SafetensorsDtype::F16:
      decode_elements<uint16_t>(data, count, out.data(), [](uint16_t x) { return fp16_to_float(x); });
      break;
    case SafetensorsDtype::BF16:
      decode_elements<uint16_t>(data, count, out.data(), [](uint16_t x) { return bf16_to_float(x); });
      break;
    case SafetensorsDtype::F8_E4M3:
      decode_elements<uint8_t>(data, count, out.data(), [](uint8_t x) { return fp8_decode(x, Fp8Dtype::e4m3); });
      break;
    case SafetensorsDtype::F8_E5M2:
      decode_elements<uint8_t>(data, count, out.data(), [](uint8_t x) { return fp8_decode(x, Fp8Dtype::e5m2); });
      break;
    default:
      throw InputError(detail::concat("tensor ", quote_name(tensor.name), ": dtype ", to_string(tensor.dtype),
                                      " cannot be read as float (supported: F64, F32, F16, BF16, F8_E4M3, F8_E5M2)"));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::add(std::string name, SafetensorsDtype dtype, std::vector<int64_t> shape, const void* data,
                            size_t bytes) {
  Entry entry{std::move(name), dtype, std::move(shape), {}, nullptr, false, bytes};
  add_entry(std::move(entry), data);
}

void SafetensorsWriter::add_borrowed(std::string name, SafetensorsDtype dtype, std::vector<int64_t> shape,
                                     const void* data, size_t bytes) {
  Entry entry{std::move(name), dtype, std::move(shape), {}, static_cast<const uint8_t*>(data), true, bytes};
  add_entry(std::move(entry), data);
}

void SafetensorsWriter::add_entry(Entry entry, const void* data) {
  const std::string who = "safetensors writer: tensor " + quote_name(entry.name);
  if (entry.name.empty() || entry.name == "__metadata__" || !is_utf8(entry.name)) {
    throw RuntimeError(who + ": invalid name (empty, \"__metadata__\" or not UTF-8)");
  }
  for (const Entry& existing : entries_) {
    if (existing.name == entry.name) throw RuntimeError(who + ": added twice");
  }
  (void)info_of(entry.dtype);  // rejects an out-of-range enum value
  for (int64_t dim : entry.shape) {
    if (dim < 0) throw RuntimeError(detail::concat(who, ": negative dimension in shape ", shape_string(entry.shape)));
  }
  const std::optional<uint64_t> expected = checked_bytes(entry.shape, entry.dtype);
  if (!expected) throw RuntimeError(detail::concat(who, ": shape ", shape_string(entry.shape), " overflows"));
  if (*expected != entry.bytes) {
    throw RuntimeError(detail::concat(who, ": ", entry.bytes, " bytes given, but shape ", shape_string(entry.shape),
                                      " of ", to_string(entry.dtype), " needs ", *expected));
  }
  if (entry.bytes > 0 && data == nullptr) throw RuntimeError(who + ": null data");
  if (!entry.is_borrowed && entry.bytes > 0) {
    const uint8_t* source = static_cast<const uint8_t*>(data);
    entry.owned.assign(source, source + entry.bytes);
  }
  entries_.push_back(std::move(entry));
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  if (!is_utf8(key) || !is_utf8(value)) {
    throw RuntimeError("safetensors writer: metadata key " + quote_name(key) + ": key or value is not valid UTF-8");
  }
  metadata_[std::move(key)] = std::move(value);
}

namespace {

constexpr const char* kWriteHint = "check free disk space, quotas and permissions";

// Writes everything or throws RuntimeError; retries short writes and EINTR.
void write_all(int fd, const uint8_t* data, size_t bytes, const std::string& path, const std::string& tmp) {
  while (bytes > 0) {
    const ssize_t written = ::write(fd, data, std::min<size_t>(bytes, size_t{1} << 30));
    if (written < 0) {
      if (errno == EINTR) continue;
      throw RuntimeError(detail::concat(path, ": cannot write safetensors file: write to ", tmp, " failed (",
                                        std::strerror(errno), ")"),
                         kWriteHint);
    }
    data += written;
    bytes -= static_cast<size_t>(written);
  }
}

}  // namespace

void SafetensorsWriter::write(const std::string& path) const {
  // Layout: by element size, largest first, insertion order within one size (stable sort).
  std::vector<const Entry*> order;
  order.reserve(entries_.size());
  for (const Entry& entry : entries_) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(),
                   [](const Entry* a, const Entry* b) { return dtype_size(a->dtype) > dtype_size(b->dtype); });

  json header = json::object();  // an std::map: dump() writes the keys sorted
  uint64_t offset = 0;
  for (const Entry* entry : order) {
    header[entry->name] = json{{"dtype", std::string(to_string(entry->dtype))},
                               {"shape", entry->shape},
                               {"data_offsets", json::array({offset, offset + entry->bytes})}};
    offset += entry->bytes;
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned

  uint8_t size_field[8];
  for (int i = 0; i < 8; ++i) size_field[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_text.size()) >> (8 * i));

  const std::string tmp = path + ".tmp";
  auto fail = [&](const char* step) {
    throw RuntimeError(detail::concat(path, ": cannot write safetensors file: ", step, " ", tmp, " failed (",
                                      std::strerror(errno), ")"),
                       kWriteHint);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("creating");
  try {
    write_all(fd, size_field, sizeof size_field, path, tmp);
    write_all(fd, reinterpret_cast<const uint8_t*>(header_text.data()), header_text.size(), path, tmp);
    for (const Entry* entry : order) write_all(fd, entry->data(), entry->bytes, path, tmp);
    if (::fsync(fd) != 0) fail("fsync of");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int close_errno = errno;
    ::unlink(tmp.c_str());
    errno = close_errno;
    fail("closing");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    ::unlink(tmp.c_str());
    throw RuntimeError(detail::concat(path, ": cannot write safetensors file: renaming ", tmp, " failed (",
                                      std::strerror(rename_errno), ")"),
                       kWriteHint);
  }
  // Make the rename itself durable. Best effort: some file systems refuse fsync on directories.
  const size_t slash = path.find_last_of('/');
  const std::string directory = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace fp8lm
