// Host bytes of a GEMM's BF16 or FP32 operand (bias, C, D) and back, for the GEMM tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/dtype.h"
#include "core/gemm_cuda.h"

namespace fp8lm::testing {

// The bytes of `values` stored as `type` (bf16 rounds to nearest even; fp32 as is).
inline std::vector<uint8_t> gemm_bytes(const std::vector<float>& values, cuda::GemmType type) {
  REQUIRE((type == cuda::GemmType::fp32 || type == cuda::GemmType::bf16));
  std::vector<uint8_t> bytes(values.size() * cuda::gemm_type_bytes(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == cuda::GemmType::fp32) {
      std::memcpy(&bytes[4 * i], &values[i], 4);
    } else {
      const uint16_t bits = bf16_from_float(values[i]);
      std::memcpy(&bytes[2 * i], &bits, 2);
    }
  }
  return bytes;
}

// The values held by `bytes` of `type` (bf16 or fp32).
inline std::vector<float> gemm_values(const std::vector<uint8_t>& bytes, cuda::GemmType type) {
  REQUIRE((type == cuda::GemmType::fp32 || type == cuda::GemmType::bf16));
  std::vector<float> values(bytes.size() / cuda::gemm_type_bytes(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == cuda::GemmType::fp32) {
      std::memcpy(&values[i], &bytes[4 * i], 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &bytes[2 * i], 2);
      values[i] = bf16_to_float(bits);
    }
  }
  return values;
}

}  // namespace fp8lm::testing
