// Safetensors reading and writing (core/safetensors.h) and CRC-32 (core/checksum.h).
//
// Round trips of every dtype (0-d and empty tensors, metadata included), the on-disk layout
// the format documents, one malformed file per validation rule (each an InputError naming
// the file and the problem), and a fuzz loop (every truncation, 1000 corrupted headers)
// in which each variant must either load or throw InputError, never anything else.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "core/checksum.h"
#include "core/dtype.h"
#include "core/error.h"
#include "temp_dir.h"
#include "core/fp8.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;
using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

using testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  REQUIRE(out.good());
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string le64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xFF);
  return bytes;
}

// A raw file: the header size field (the header's length unless overridden), the header text
// and `data_bytes` bytes of data.
std::string raw_file(const std::string& header, size_t data_bytes, int64_t size_field = -1) {
  return le64(size_field < 0 ? header.size() : static_cast<uint64_t>(size_field)) + header +
         std::string(data_bytes, '\x5A');
}

// What SafetensorsFile::open says about `path`: the InputError's message, or a marker.
std::string open_error(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const InputError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not an InputError: ") + e.what() + ")";
  }
  return "(no error)";
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

struct TestTensor {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// One tensor of every dtype, a 0-d scalar and two empty tensors, added with mixed element
// sizes so the writer's layout order matters.
std::vector<TestTensor> every_dtype_tensors() {
  std::vector<TestTensor> tensors;
  tensors.push_back({"u8.odd", SafetensorsDtype::U8, {7}, as_bytes(std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 255})});
  tensors.push_back({"f64", SafetensorsDtype::F64, {2}, as_bytes(std::vector<double>{1.5, -2.25e300})});
  tensors.push_back({"f32.matrix", SafetensorsDtype::F32, {2, 3},
                     as_bytes(std::vector<float>{1.0f, -2.0f, 3.5f, 1e-30f, 6e30f, -0.0f})});
  tensors.push_back({"f16", SafetensorsDtype::F16, {3},
                     as_bytes(std::vector<uint16_t>{fp16_from_float(0.5f), fp16_from_float(-65504.0f),
                                                    fp16_from_float(0x1p-24f)})});
  tensors.push_back({"bf16", SafetensorsDtype::BF16, {1, 3},
                     as_bytes(std::vector<uint16_t>{bf16_from_float(1.0f), bf16_from_float(-3.5f),
                                                    bf16_from_float(0x1p100f)})});
  tensors.push_back({"e4m3", SafetensorsDtype::F8_E4M3, {5},
                     as_bytes(std::vector<uint8_t>{fp8_encode(0.5f, Fp8Dtype::e4m3), fp8_encode(-448.0f, Fp8Dtype::e4m3),
                                                   fp8_encode(0x1p-9f, Fp8Dtype::e4m3), fp8_encode(3.25f, Fp8Dtype::e4m3),
                                                   fp8_encode(0.0f, Fp8Dtype::e4m3)})});
  tensors.push_back({"e5m2", SafetensorsDtype::F8_E5M2, {3},
                     as_bytes(std::vector<uint8_t>{fp8_encode(57344.0f, Fp8Dtype::e5m2), fp8_encode(-0x1p-16f, Fp8Dtype::e5m2),
                                                   fp8_encode(1.5f, Fp8Dtype::e5m2)})});
  tensors.push_back({"i64", SafetensorsDtype::I64, {3}, as_bytes(std::vector<int64_t>{-1, INT64_MAX, 42})});
  tensors.push_back({"i32", SafetensorsDtype::I32, {2, 2}, as_bytes(std::vector<int32_t>{-7, 8, INT32_MIN, 0})});
  tensors.push_back({"i16", SafetensorsDtype::I16, {3}, as_bytes(std::vector<int16_t>{-300, 300, 1})});
  tensors.push_back({"i8", SafetensorsDtype::I8, {5}, as_bytes(std::vector<int8_t>{-128, 127, 0, 1, -1})});
  tensors.push_back({"bool", SafetensorsDtype::BOOL, {3}, as_bytes(std::vector<uint8_t>{1, 0, 1})});
  tensors.push_back({"scalar", SafetensorsDtype::F32, {}, as_bytes(std::vector<float>{2.75f})});
  tensors.push_back({"empty.f16", SafetensorsDtype::F16, {0, 4}, {}});
  tensors.push_back({"empty.i64", SafetensorsDtype::I64, {3, 0}, {}});
  return tensors;
}

const std::map<std::string, std::string> kMetadata = {
    {"format", "pt"}, {"step", "100"}, {"note", "h\xC3\xA9llo, \"quoted\"\n"}};

std::string write_every_dtype_file(const TempDir& dir, const std::string& name = "model.safetensors") {
  SafetensorsWriter writer;
  for (const TestTensor& t : every_dtype_tensors()) {
    writer.add(t.name, t.dtype, t.shape, t.bytes.empty() ? nullptr : t.bytes.data(), t.bytes.size());
  }
  for (const auto& [key, value] : kMetadata) writer.set_metadata(key, value);
  const std::string path = dir.file(name);
  writer.write(path);
  return path;
}

std::string tensor_bytes(const SafetensorsTensorView& view) {
  return std::string(reinterpret_cast<const char*>(view.data), view.bytes);
}

const std::string kGoodEntry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

}  // namespace

TEST_CASE("safetensors dtype names and sizes", "[safetensors]") {
  const std::vector<std::pair<SafetensorsDtype, size_t>> expected = {
      {SafetensorsDtype::F64, 8}, {SafetensorsDtype::F32, 4},     {SafetensorsDtype::F16, 2},
      {SafetensorsDtype::BF16, 2}, {SafetensorsDtype::F8_E4M3, 1}, {SafetensorsDtype::F8_E5M2, 1},
      {SafetensorsDtype::I64, 8}, {SafetensorsDtype::I32, 4},     {SafetensorsDtype::I16, 2},
      {SafetensorsDtype::I8, 1},  {SafetensorsDtype::U8, 1},      {SafetensorsDtype::BOOL, 1}};
  for (const auto& [dtype, size] : expected) {
    CHECK(dtype_size(dtype) == size);
    CHECK(safetensors_dtype_from_string(to_string(dtype)) == dtype);
  }
  CHECK(to_string(SafetensorsDtype::F8_E4M3) == "F8_E4M3");
  CHECK(to_string(SafetensorsDtype::BF16) == "BF16");
  CHECK_FALSE(safetensors_dtype_from_string("F9").has_value());
  CHECK_FALSE(safetensors_dtype_from_string("f32").has_value());
  CHECK_FALSE(safetensors_dtype_from_string("").has_value());
}

TEST_CASE("safetensors round trip of every dtype, scalars, empty tensors and metadata", "[safetensors]") {
  TempDir dir;
  const std::string path = write_every_dtype_file(dir);
  CHECK_FALSE(fs::exists(path + ".tmp"));

  SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.path() == path);
  CHECK(file.metadata() == kMetadata);
  const std::vector<TestTensor> expected = every_dtype_tensors();
  REQUIRE(file.size() == expected.size());
  for (const TestTensor& t : expected) {
    INFO(t.name);
    REQUIRE(file.contains(t.name));
    const SafetensorsTensorView& view = file.tensor(t.name);
    CHECK(view.name == t.name);
    CHECK(view.dtype == t.dtype);
    CHECK(view.shape == t.shape);
    CHECK(view.bytes == t.bytes.size());
    CHECK(view.numel() * dtype_size(view.dtype) == view.bytes);
    CHECK(tensor_bytes(view) == std::string(t.bytes.begin(), t.bytes.end()));
    // The mapping is page-aligned, so this is the alignment of the offset in the file.
    CHECK(reinterpret_cast<uintptr_t>(view.data) % dtype_size(view.dtype) == 0);
  }
  CHECK(file.tensor("scalar").numel() == 1);
  CHECK(file.tensor("empty.f16").numel() == 0);
  CHECK_FALSE(file.contains("nope"));
  CHECK_FALSE(file.contains("__metadata__"));

  // names() is file order: data pointers never go backwards, and it matches tensors().
  const std::vector<std::string> names = file.names();
  REQUIRE(names.size() == file.tensors().size());
  for (size_t i = 0; i < names.size(); ++i) {
    CHECK(names[i] == file.tensors()[i].name);
    if (i > 0) CHECK(file.tensors()[i - 1].data <= file.tensors()[i].data);
  }

  // Moving the file keeps the views valid (the mapping does not move).
  const SafetensorsTensorView* before = &file.tensor("i64");
  SafetensorsFile moved = std::move(file);
  CHECK(&moved.tensor("i64") == before);
  CHECK(tensor_bytes(moved.tensor("i64")) == tensor_bytes(*before));
  SafetensorsFile assigned = SafetensorsFile::open(write_every_dtype_file(dir, "other.safetensors"));
  assigned = std::move(moved);
  CHECK(assigned.path() == path);
  CHECK(assigned.tensor("u8.odd").data[6] == 255);
}

TEST_CASE("safetensors read_as_float decodes F32, F64, F16, BF16 and both FP8 formats", "[safetensors]") {
  TempDir dir;
  SafetensorsFile file = SafetensorsFile::open(write_every_dtype_file(dir));
  CHECK(read_as_float(file.tensor("f32.matrix")) == std::vector<float>{1.0f, -2.0f, 3.5f, 1e-30f, 6e30f, -0.0f});
  CHECK(read_as_float(file.tensor("f64")) == std::vector<float>{1.5f, -INFINITY});  // -2.25e300 overflows FP32
  CHECK(read_as_float(file.tensor("f16")) == std::vector<float>{0.5f, -65504.0f, 0x1p-24f});
  CHECK(read_as_float(file.tensor("bf16")) == std::vector<float>{1.0f, -3.5f, 0x1p100f});
  CHECK(read_as_float(file.tensor("e4m3")) == std::vector<float>{0.5f, -448.0f, 0x1p-9f, 3.25f, 0.0f});
  CHECK(read_as_float(file.tensor("e5m2")) == std::vector<float>{57344.0f, -0x1p-16f, 1.5f});
  CHECK(read_as_float(file.tensor("scalar")) == std::vector<float>{2.75f});
  CHECK(read_as_float(file.tensor("empty.f16")).empty());

  // FP8 rounding happens at encode time; decode is exact.
  std::vector<uint8_t> codes;
  std::vector<float> rounded;
  for (float x : {0.1f, -7.3f, 300.0f, 1000.0f}) {
    codes.push_back(fp8_encode(x, Fp8Dtype::e4m3));
    rounded.push_back(fp8_round(x, Fp8Dtype::e4m3));
  }
  SafetensorsTensorView view{"codes", SafetensorsDtype::F8_E4M3, {4}, codes.data(), codes.size()};
  CHECK(read_as_float(view) == rounded);

  try {
    read_as_float(file.tensor("i32"));
    FAIL("read_as_float accepted I32");
  } catch (const InputError& e) {
    CHECK_THAT(std::string(e.what()), ContainsSubstring("\"i32\"") && ContainsSubstring("I32"));
  }
}

TEST_CASE("safetensors writer output follows the documented layout", "[safetensors]") {
  TempDir dir;
  const std::string path = write_every_dtype_file(dir);
  const std::string bytes = read_bytes(path);
  REQUIRE(bytes.size() >= 8);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<uint8_t>(bytes[i]);
  REQUIRE(8 + header_size <= bytes.size());
  CHECK(header_size % 8 == 0);  // so the data buffer starts 8-byte aligned
  const std::string header_text = bytes.substr(8, header_size);
  const size_t last_brace = header_text.find_last_of('}');
  REQUIRE(last_brace != std::string::npos);
  CHECK(header_text.find_first_not_of(' ', last_brace + 1) == std::string::npos);  // space padding only
  CHECK(header_text.size() - last_brace - 1 < 8);

  // ordered_json keeps the file's key order: it must be sorted.
  const nlohmann::ordered_json header = nlohmann::ordered_json::parse(header_text);
  REQUIRE(header.is_object());
  std::vector<std::string> keys;
  for (const auto& item : header.items()) keys.push_back(item.key());
  CHECK(std::is_sorted(keys.begin(), keys.end()));
  REQUIRE(header.contains("__metadata__"));
  CHECK(header["__metadata__"]["step"] == "100");
  CHECK(header["f32.matrix"]["dtype"] == "F32");
  CHECK(header["f32.matrix"]["shape"] == nlohmann::json::array({2, 3}));
  CHECK(header["scalar"]["shape"] == nlohmann::json::array());

  // Tensors are packed back to back from 0 to the end of the file, larger elements first,
  // each at an offset that is a multiple of its element size.
  struct Range {
    uint64_t begin, end;
    size_t element;
  };
  std::vector<Range> ranges;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") continue;
    const auto dtype = safetensors_dtype_from_string(item.value()["dtype"].get<std::string>());
    REQUIRE(dtype.has_value());
    ranges.push_back({item.value()["data_offsets"][0].get<uint64_t>(), item.value()["data_offsets"][1].get<uint64_t>(),
                      dtype_size(*dtype)});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t expected_begin = 0;
  size_t previous_element = 8;
  for (const Range& r : ranges) {
    CHECK(r.begin == expected_begin);
    CHECK(r.begin % r.element == 0);
    CHECK(r.element <= previous_element);
    expected_begin = r.end;
    previous_element = r.element;
  }
  CHECK(8 + header_size + expected_begin == bytes.size());

  // A file without metadata has no "__metadata__" key, and writing replaces an old file.
  SafetensorsWriter writer;
  const float one = 1.0f;
  writer.add("x", SafetensorsDtype::F32, {}, &one, sizeof one);
  writer.write(path);
  const SafetensorsFile small = SafetensorsFile::open(path);
  CHECK(small.metadata().empty());
  CHECK(small.names() == std::vector<std::string>{"x"});
  CHECK(read_bytes(path).find("__metadata__") == std::string::npos);
}

TEST_CASE("safetensors writer: borrowed data, misuse and I/O failures", "[safetensors]") {
  TempDir dir;
  std::vector<float> values = {1.0f, 2.0f, 3.0f};
  SafetensorsWriter writer;
  writer.add_borrowed("borrowed", SafetensorsDtype::F32, {3}, values.data(), 12);
  writer.add("copied", SafetensorsDtype::F32, {3}, values.data(), 12);
  values[0] = 9.0f;  // seen by the borrowed tensor only
  writer.write(dir.file("w.safetensors"));
  const SafetensorsFile file = SafetensorsFile::open(dir.file("w.safetensors"));
  CHECK(read_as_float(file.tensor("borrowed")) == std::vector<float>{9.0f, 2.0f, 3.0f});
  CHECK(read_as_float(file.tensor("copied")) == std::vector<float>{1.0f, 2.0f, 3.0f});

  CHECK_THROWS_AS(writer.add("wrong.size", SafetensorsDtype::F32, {3}, values.data(), 8), RuntimeError);
  CHECK_THROWS_AS(writer.add("copied", SafetensorsDtype::F32, {3}, values.data(), 12), RuntimeError);
  CHECK_THROWS_AS(writer.add("negative", SafetensorsDtype::F32, {-1}, values.data(), 0), RuntimeError);
  CHECK_THROWS_AS(writer.add("__metadata__", SafetensorsDtype::F32, {3}, values.data(), 12), RuntimeError);
  CHECK_THROWS_AS(writer.add("", SafetensorsDtype::F32, {3}, values.data(), 12), RuntimeError);
  CHECK_THROWS_AS(writer.add("bad\xFFutf8", SafetensorsDtype::F32, {3}, values.data(), 12), RuntimeError);
  CHECK_THROWS_AS(writer.add("huge", SafetensorsDtype::F32, {INT64_MAX, 4}, values.data(), 12), RuntimeError);
  CHECK_THROWS_AS(writer.add("null", SafetensorsDtype::F32, {3}, nullptr, 12), RuntimeError);
  CHECK_THROWS_AS(writer.set_metadata("k", "\xC0\x80"), RuntimeError);
  CHECK(writer.size() == 2);

  const std::string missing_dir = dir.file("no/such/dir/x.safetensors");
  try {
    writer.write(missing_dir);
    FAIL("write into a missing directory succeeded");
  } catch (const RuntimeError& e) {
    CHECK_THAT(std::string(e.what()), ContainsSubstring(missing_dir));
  }
}

TEST_CASE("safetensors reader accepts the format's legal variations", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("ok.safetensors");
  auto load = [&](const std::string& bytes) {
    write_bytes(path, bytes);
    return SafetensorsFile::open(path);
  };
  // Padding spaces (and other JSON whitespace) after the JSON.
  CHECK(load(raw_file("{\"a\":" + kGoodEntry + "}      ", 8)).size() == 1);
  CHECK(load(raw_file("{\"a\":" + kGoodEntry + "}\n\t ", 8)).size() == 1);
  // No tensors at all.
  CHECK(load(raw_file("{}", 0)).size() == 0);
  CHECK(load(raw_file("{\"__metadata__\":{}}", 0)).size() == 0);
  // Unknown extra fields; zero-byte tensors sharing an offset (between two tensors and at
  // the very end of the buffer), ordered by name.
  const SafetensorsFile odd = load(raw_file(
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"extra":[1]},)"
      R"("e1":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"e2":{"dtype":"BOOL","shape":[5,0],"data_offsets":[6,6]},)"
      R"("b":{"dtype":"I8","shape":[2],"data_offsets":[4,6]},"e0":{"dtype":"I8","shape":[0],"data_offsets":[4,4]}})",
      6));
  CHECK(odd.names() == std::vector<std::string>{"a", "e0", "e1", "b", "e2"});
  CHECK(odd.tensor("a").bytes == 4);
  // Unicode escapes in names decode; lookups use the decoded name.
  CHECK(load(raw_file("{\"\\u00e9\":" + kGoodEntry + "}", 8)).contains("\xC3\xA9"));

  // A missing tensor is an InputError naming the file and the tensor.
  try {
    odd.tensor("missing.weight");
    FAIL("no error for a missing tensor");
  } catch (const InputError& e) {
    CHECK_THAT(std::string(e.what()), ContainsSubstring(path) && ContainsSubstring("missing.weight"));
  }
}

TEST_CASE("safetensors reader rejects each kind of malformed file with a specific InputError", "[safetensors]") {
  TempDir dir;
  struct Case {
    const char* what;
    std::string bytes;
    const char* phrase;
  };
  auto one = [](const std::string& entry, size_t data = 8) { return raw_file("{\"a\":" + entry + "}", data); };
  const std::vector<Case> cases = {
      {"empty file", "", "empty file"},
      {"7-byte file", std::string(7, '\0'), "too short (7 bytes)"},
      {"header size 2^63", le64(uint64_t{1} << 63) + "{}" + std::string(8, '\0'),
       "header size 9223372036854775808 exceeds the limit"},
      {"header size > file", raw_file("{}", 8, 1000), "header size 1000 runs past the end of the file"},
      {"header size 0", raw_file("", 8), "header is not valid JSON"},
      {"header not JSON", raw_file("{not json}", 0), "header is not valid JSON"},
      {"header truncated JSON", raw_file("{\"a\":{\"dtype\":", 0), "header is not valid JSON"},
      {"header is an array", raw_file("[1,2]", 0), "header is an array, not a JSON object"},
      {"header is a string", raw_file("\"x\"", 0), "header is a string, not a JSON object"},
      {"header invalid UTF-8", raw_file("{\"a\xFF\":" + kGoodEntry + "}", 8), "header is not valid UTF-8 (file byte 11)"},
      {"header overlong UTF-8", raw_file("{\"\xC0\xAF\":{}}", 0), "not valid UTF-8"},
      {"header UTF-8 surrogate", raw_file("{\"\xED\xA0\x80\":{}}", 0), "not valid UTF-8"},
      {"header NUL byte", raw_file(std::string("{}\0{\"a\":1}", 10), 0), "header contains a NUL byte (file byte 10)"},
      {"deep nesting", raw_file(std::string(100, '[') + std::string(100, ']'), 0), "nests deeper than 64 levels"},
      {"duplicate tensor", raw_file("{\"a\":" + kGoodEntry + ",\"a\":" + kGoodEntry + "}", 8), "duplicate key \"a\""},
      {"duplicate field", one(R"({"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]})"),
       "duplicate key \"dtype\""},
      {"entry not an object", one("[1,2]"), "tensor \"a\": entry is an array, not a JSON object"},
      {"missing dtype", one(R"({"shape":[2],"data_offsets":[0,8]})"), "tensor \"a\": missing \"dtype\""},
      {"dtype not a string", one(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"), "\"dtype\" is an integer, not a string"},
      {"unknown dtype", one(R"({"dtype":"F9","shape":[2],"data_offsets":[0,8]})"), "tensor \"a\": unknown dtype \"F9\""},
      {"missing shape", one(R"({"dtype":"F32","data_offsets":[0,8]})"), "missing \"shape\""},
      {"shape not an array", one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"), "\"shape\" is an integer, not an array"},
      {"shape negative", one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), "shape[0] is negative (-2)"},
      {"shape fractional", one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"), "shape[0] is a non-integer number"},
      {"shape string", one(R"({"dtype":"F32","shape":[1,"2"],"data_offsets":[0,8]})"), "shape[1] is a string"},
      {"shape dim > int64", one(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]})"), "is too large"},
      {"shape overflows", one(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"), "overflows"},
      {"bytes overflow", one(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]})"), "overflows"},
      {"missing data_offsets", one(R"({"dtype":"F32","shape":[2]})"), "missing \"data_offsets\""},
      {"data_offsets one number", one(R"({"dtype":"F32","shape":[2],"data_offsets":[8]})"),
       "\"data_offsets\" must be [begin, end], two non-negative integers; it is an array of 1 elements"},
      {"data_offsets object", one(R"({"dtype":"F32","shape":[2],"data_offsets":{"0":8}})"), "it is an object"},
      {"data_offsets negative", one(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"), "data_offsets[0] is negative (-8)"},
      {"data_offsets fractional", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8.5]})"), "data_offsets[1] is a non-integer number"},
      {"data_offsets begin > end", one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"), "data_offsets begin 8 is after end 0"},
      {"offsets out of range", one(R"({"dtype":"F32","shape":[2],"data_offsets":[4,12]})"),
       "data_offsets [4, 12] run past the end of the data buffer (8 bytes"},
      {"offsets huge", one(R"({"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]})"),
       "run past the end of the data buffer"},
      {"size mismatch", one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
       "data_offsets [0, 8] hold 8 bytes, but shape [3] of F32 needs 12 bytes (size mismatch)"},
      {"overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "tensors \"a\" and \"b\" overlap (data bytes [0, 8) and [4, 12))"},
      {"overlap inside", raw_file(R"({"big":{"dtype":"U8","shape":[12],"data_offsets":[0,12]},)"
                                  R"("in":{"dtype":"U8","shape":[1],"data_offsets":[5,6]},)"
                                  R"("z":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}})", 12),
       "tensors \"big\" and \"in\" overlap"},
      {"identical ranges", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                    R"("b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})", 8), "overlap"},
      {"whitespace before the JSON", raw_file(" \n{\"a\":" + kGoodEntry + "}", 8), "header does not begin with '{'"},
      {"gap before the first tensor", one(R"({"dtype":"U8","shape":[4],"data_offsets":[2,6]})"),
       "data bytes [0, 2) before tensor \"a\" belong to no tensor"},
      {"gap between tensors", raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                       R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})", 5),
       "data bytes [2, 3) before tensor \"b\" belong to no tensor"},
      {"zero-byte tensor inside another", raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                                   R"("e":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})", 4),
       "tensors \"a\" and \"e\" overlap"},
      {"bytes after the last tensor", one(kGoodEntry, 9),
       "the tensors cover 8 bytes but the data buffer after the 54-byte header holds 9"},
      {"data but no tensors", raw_file("{\"__metadata__\":{}}", 3), "the tensors cover 0 bytes but the data buffer"},
      {"metadata non-string value", raw_file("{\"__metadata__\":{\"k\":\"v\",\"step\":3}}", 0),
       "\"__metadata__\" value of \"step\" is an integer, not a string"},
      {"metadata null value", raw_file("{\"__metadata__\":{\"k\":null}}", 0), "is null, not a string"},
      {"metadata not an object", raw_file("{\"__metadata__\":[\"a\"]}", 0), "\"__metadata__\" is an array, not an object of strings"},
      {"control char in name", raw_file("{\"a\\nb\":[1]}", 0), "tensor \"a\\nb\": entry is an array"},
  };
  const std::string path = dir.file("bad.safetensors");
  for (const Case& c : cases) {
    INFO(c.what);
    write_bytes(path, c.bytes);
    const std::string message = open_error(path);
    CHECK_THAT(message, ContainsSubstring(path + ": ") && ContainsSubstring(c.phrase));
    CHECK(message.find('\n') == std::string::npos);
  }

  CHECK_THAT(open_error(dir.file("does_not_exist.safetensors")), ContainsSubstring("cannot open"));
  CHECK_THAT(open_error(dir.path().string()), ContainsSubstring("not a regular file"));
}

TEST_CASE("safetensors reader refuses a header size field off by a few bytes, padding or not", "[safetensors]") {
  // The JSON's trailing padding can absorb a shrunk size field: the header still parses,
  // and only the rule that the tensors end exactly at the end of the file notices that every
  // tensor would be read a few bytes early.
  TempDir dir;
  const std::string padded = read_bytes(write_every_dtype_file(dir));
  const std::string hand_made = raw_file("{\"a\":" + kGoodEntry + "}" + std::string(7, ' '), 8);
  const std::string path = dir.file("shifted.safetensors");
  for (const std::string& good : {padded, hand_made}) {
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<uint8_t>(good[i]);
    for (int delta = -7; delta <= 7; ++delta) {
      if (delta == 0) continue;
      INFO("header size " << header_size << " changed by " << delta);
      write_bytes(path, le64(header_size + delta) + good.substr(8));
      const std::string message = open_error(path);
      CHECK_THAT(message, ContainsSubstring(path + ": "));
      if (delta < 0 && delta >= -4 && good == hand_made) CHECK_THAT(message, ContainsSubstring("the tensors cover 8 bytes"));
    }
  }
}

TEST_CASE("safetensors reader survives truncation and corrupted headers", "[safetensors]") {
  TempDir dir;
  const std::string good = read_bytes(write_every_dtype_file(dir));
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<uint8_t>(good[i]);

  // Loads, or throws InputError; anything else fails the test. A loaded file's views are read
  // end to end, so an out-of-bounds view would show up (under ASan, or as a crash).
  int loaded = 0;
  int rejected = 0;
  int variants = 0;
  auto try_load = [&](const std::string& bytes) {
    // A fresh name per variant: truncating and rewriting one file makes ext4 flush it to disk
    // each time (auto_da_alloc), which made this test take seconds.
    const std::string path = dir.file("fuzz" + std::to_string(variants++) + ".safetensors");
    struct Remove {
      std::string path;
      ~Remove() { std::remove(path.c_str()); }
    } remove_after{path};
    write_bytes(path, bytes);
    try {
      const SafetensorsFile file = SafetensorsFile::open(path);
      uint64_t sum = 0;
      for (const SafetensorsTensorView& view : file.tensors()) {
        REQUIRE(view.bytes == view.numel() * dtype_size(view.dtype));
        for (size_t i = 0; i < view.bytes; ++i) sum += view.data[i];
        if (view.dtype == SafetensorsDtype::F32 || view.dtype == SafetensorsDtype::F16 ||
            view.dtype == SafetensorsDtype::BF16 || view.dtype == SafetensorsDtype::F8_E5M2) {
          CHECK(read_as_float(view).size() == view.numel());
        }
      }
      for (const auto& [key, value] : file.metadata()) sum += key.size() + value.size();
      (void)sum;
      ++loaded;
      return true;
    } catch (const InputError&) {
      ++rejected;
      return false;
    }
  };

  // Every truncation fails: the writer packs tensors up to the last byte.
  for (size_t length = 0; length < good.size(); ++length) {
    INFO("truncated to " << length << " of " << good.size() << " bytes");
    CHECK_FALSE(try_load(good.substr(0, length)));
  }
  CHECK(try_load(good));

  // 1000 corrupted headers: 1 to 3 bytes of the size field or the JSON replaced by a random
  // byte, a flipped bit, or a JSON-significant character (to reach the deeper checks).
  std::mt19937 rng(20240531);
  const std::string json_chars = "{}[]\",:0123456789-.eE \\u";
  for (int variant = 0; variant < 1000; ++variant) {
    std::string bytes = good;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      // Mostly the JSON; sometimes the low bytes of the size field.
      const size_t at = rng() % 8 == 0 ? rng() % 3 : 8 + rng() % header_size;
      switch (rng() % 3) {
        case 0: bytes[at] = static_cast<char>(rng() & 0xFF); break;
        case 1: bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8))); break;
        default: bytes[at] = json_chars[rng() % json_chars.size()]; break;
      }
    }
    REQUIRE(bytes.size() == good.size());
    const bool loads = try_load(bytes);
    // The data buffer is pinned to 8 + N: no other header size field can load.
    if (bytes.compare(0, 8, good, 0, 8) != 0) CHECK_FALSE(loads);
  }
  INFO("loaded " << loaded << ", rejected " << rejected);
  CHECK(rejected > 500);
  CHECK(loaded > 1);  // the original, and corruptions that stay valid (e.g. inside metadata)
}

TEST_CASE("crc32 matches CRC-32/ISO-HDLC", "[safetensors]") {
  const std::string check = "123456789";
  CHECK(crc32(check.data(), check.size()) == 0xCBF43926u);
  CHECK(crc32(nullptr, 0) == 0u);
  CHECK(crc32("a", 1) == 0xE8B7BE43u);
  const std::string fox = "The quick brown fox jumps over the lazy dog";
  CHECK(crc32(fox.data(), fox.size()) == 0x414FA339u);

  // Chaining through the seed equals one pass, at every split point.
  for (size_t split = 0; split <= check.size(); ++split) {
    CHECK(crc32(check.data() + split, check.size() - split, crc32(check.data(), split)) == 0xCBF43926u);
  }

  // The table-driven (8 bytes per step) version agrees with a bit-at-a-time reference for all
  // lengths 0..100 at every alignment.
  auto bitwise = [](const uint8_t* p, size_t n) {
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      crc ^= p[i];
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
  };
  std::mt19937 rng(7);
  std::vector<uint8_t> buffer(128);
  for (uint8_t& b : buffer) b = static_cast<uint8_t>(rng());
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t length = 0; length <= 100; ++length) {
      REQUIRE(crc32(buffer.data() + offset, length) == bitwise(buffer.data() + offset, length));
    }
  }
}

TEST_CASE("file_crc32_hex streams a file's CRC-32", "[safetensors]") {
  TempDir dir;
  write_bytes(dir.file("check.txt"), "123456789");
  CHECK(file_crc32_hex(dir.file("check.txt")) == "cbf43926");
  write_bytes(dir.file("empty"), "");
  CHECK(file_crc32_hex(dir.file("empty")) == "00000000");

  const std::string path = write_every_dtype_file(dir);
  const std::string bytes = read_bytes(path);
  char expected[9];
  std::snprintf(expected, sizeof expected, "%08x", crc32(bytes.data(), bytes.size()));
  CHECK(file_crc32_hex(path) == expected);

  // Larger than the 1 MiB read buffer, so the chaining across reads is exercised.
  std::string big(3 * 1024 * 1024 + 17, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 2654435761u) >> 13);
  write_bytes(dir.file("big.bin"), big);
  std::snprintf(expected, sizeof expected, "%08x", crc32(big.data(), big.size()));
  CHECK(file_crc32_hex(dir.file("big.bin")) == expected);

  const std::string missing = dir.file("missing.bin");
  try {
    file_crc32_hex(missing);
    FAIL("no error for a missing file");
  } catch (const InputError& e) {
    CHECK_THAT(std::string(e.what()), ContainsSubstring(missing));
  }
}
