// Helpers for GPU tests: skip without a GPU, fresh random inputs, poisoned outputs,
// and the relative error ||out - ref|| / ||ref|| that every kernel test bounds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <cuda_bf16.h>

#include "core/device.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
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

}  // namespace fp8lm::testing
