// Helpers for GPU tests: skip without a GPU, fresh random inputs, poisoned outputs,
// and the relative error ||out - ref|| / ||ref|| that every kernel test bounds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_message.hpp>
#include <catch2/catch_test_macros.hpp>
#include <cuda_bf16.h>

#include "core/check_cuda.h"
#include "core/device.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "core/random.h"

// GPU tests call this first; on a machine without a usable GPU the test is reported
// as SKIPPED (ctest: SKIP_RETURN_CODE 4), never as passed.
#define FP8LM_REQUIRE_GPU()                                                              \
  do {                                                                                   \
    if (!::fp8lm::cuda_available()) SKIP("no CUDA GPU: " + ::fp8lm::cuda_availability().reason); \
  } while (0)

namespace fp8lm::testing {

inline std::vector<float> random_floats(size_t n, uint64_t seed, float std_dev = 1.0f, float mean = 0.0f) {
  Random random(seed);
  std::vector<float> values(n);
  for (float& v : values) v = mean + std_dev * static_cast<float>(random.normal());
  return values;
}

// n random FP8 codes, finite in both E4M3 and E5M2 (exponent field below all-ones), either sign.
inline std::vector<uint8_t> random_fp8_codes(size_t n, uint64_t seed) {
  Random random(seed);
  std::vector<uint8_t> codes(n);
  for (auto& c : codes) c = uint8_t(random.next_u64() % 0x70) | uint8_t((random.next_u64() & 1) << 7);
  return codes;
}

// Values rounded to BF16, so CPU references see exactly what the GPU reads.
inline std::vector<float> bf16_rounded(std::vector<float> values) {
  for (float& v : values) v = round_to_bf16(v);
  return values;
}

inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& values) {
  std::vector<__nv_bfloat16> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = bf16_from_float(values[i]);
    std::memcpy(&out[i], &bits, sizeof bits);
  }
  return out;
}

inline std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, &values[i], sizeof bits);
    out[i] = bf16_to_float(bits);
  }
  return out;
}

// ||out - ref||_2 / ||ref||_2; infinity when out has a NaN/inf (poison left behind).
inline double relative_error(const std::vector<float>& out, const std::vector<float>& ref) {
  REQUIRE(out.size() == ref.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    diff += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// Poison byte for outputs: 0xFF makes NaN in FP32, BF16, FP16 and E4M3/E5M2 (0xFF).
inline constexpr int kPoisonByte = 0xFF;

template <typename T>
cuda::DeviceBuffer<T> device_copy(const std::vector<T>& host) {
  cuda::DeviceBuffer<T> buffer(host.size());
  buffer.upload(host);
  return buffer;
}

inline void device_sync() { CUDA_CHECK(cudaDeviceSynchronize()); }

// Mean milliseconds of fn() on the legacy stream over `iterations` calls, after two warm-up calls.
template <typename F>
double time_ms(F&& fn, int iterations) {
  for (int i = 0; i < 2; ++i) fn();  // warm-up
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  CUDA_CHECK(cudaEventRecord(start, nullptr));
  for (int i = 0; i < iterations; ++i) fn();
  CUDA_CHECK(cudaEventRecord(stop, nullptr));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return static_cast<double>(ms) / iterations;
}

// An output buffer filled with kPoisonByte, so an element the kernel never writes fails.
template <typename T>
cuda::DeviceBuffer<T> poisoned(size_t n) {
  cuda::DeviceBuffer<T> buffer(n);
  buffer.fill_bytes(kPoisonByte);
  return buffer;
}

inline cuda::DeviceBuffer<float> device_scalar(float value) { return device_copy(std::vector<float>{value}); }

template <typename T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

inline float max_abs(const std::vector<float>& values) {
  float m = 0.0f;
  for (float v : values) m = std::max(m, std::fabs(v));
  return m;
}

inline std::vector<uint8_t> encode_all(const std::vector<float>& values, float scale, Fp8Dtype dtype) {
  std::vector<uint8_t> codes(values.size());
  for (size_t i = 0; i < values.size(); i++) codes[i] = fp8_encode(values[i] * scale, dtype);
  return codes;
}

// FP8 codes in value order: -127..127 (both zeros are 0), so adjacent values differ by 1.
inline int code_ordinal(uint8_t code) {
  return (code & 0x80) ? -static_cast<int>(code & 0x7f) : static_cast<int>(code & 0x7f);
}

// A GPU kernel's FP8 codes against the CPU's: a code may differ only where the two FP32 values
// lie on either side of a BF16 rounding boundary (summation order, FMA, tanhf), which is rare,
// so fewer than kCodeMismatchFraction of them differ and each by one FP8 step (never NaN).
inline constexpr double kCodeMismatchFraction = 1e-3;

inline void check_codes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& expected, Fp8Dtype dtype,
                        const std::string& what) {
  REQUIRE(got.size() == expected.size());
  size_t mismatches = 0, far = 0;
  for (size_t i = 0; i < got.size(); i++) {
    if (got[i] == expected[i]) continue;
    mismatches++;
    const bool nan = std::isnan(fp8_decode(got[i], dtype)) || std::isnan(fp8_decode(expected[i], dtype));
    if (nan || std::abs(code_ordinal(got[i]) - code_ordinal(expected[i])) > 1) far++;
  }
  INFO(what << " (" << to_string(dtype) << "): " << mismatches << " of " << got.size()
            << " FP8 codes differ, " << far << " by more than one step or NaN");
  CHECK(far == 0);
  CHECK(static_cast<double>(mismatches) < kCodeMismatchFraction * static_cast<double>(got.size()));
}

}  // namespace fp8lm::testing
