// Host-side BF16 and FP16 conversions, bit-exact with CUDA's round-to-nearest-even
// intrinsics (__float2bfloat16_rn, __float2half_rn). The CPU reference uses them to
// emulate what the GPU stores; the optimizer uses FP16 for its second moment.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8lm {

inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

inline float float_from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// ---- BF16: the top 16 bits of an FP32, rounded to nearest even. NaN stays NaN (quiet).
inline uint16_t bf16_from_float(float x) {
  uint32_t bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float bf16_to_float(uint16_t bf16) { return float_from_bits(static_cast<uint32_t>(bf16) << 16); }

// Rounds an FP32 value to the nearest BF16 value, returned as FP32.
inline float round_to_bf16(float x) { return bf16_to_float(bf16_from_float(x)); }

// ---- FP16 (IEEE binary16): 5 exponent bits, bias 15, max 65504, with infinities.
// Bit operations, as for FP8 (core/fp8.cpp); tests/test_fp8.cpp holds them to the
// frexp/ldexp form of the same rounding.
inline uint16_t fp16_from_float(float x) {
  const uint32_t bits = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7FFFu);  // NaN
  // At and beyond 65520 (max + half an ulp) it rounds to infinity.
  if (abs_bits >= float_bits(65520.0f)) return static_cast<uint16_t>(sign | 0x7C00u);
  if (abs_bits < float_bits(0x1p-14f)) {
    // Subnormal: a multiple of 2^-24 (exact scaling); adding and subtracting 2^23 rounds half
    // to even, and 1024 quanta carry into the smallest normal by themselves.
    const float quanta = float_from_bits(abs_bits) * 0x1p24f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>((quanta + 0x1p23f) - 0x1p23f));
  }
  // Normal: round FP32's 23 fraction bits to 10, half to even; a carry rolls into the exponent.
  const uint32_t rounded = (abs_bits + 0xFFFu + ((abs_bits >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | (rounded - ((127u - 15u) << 10)));
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0) return float_from_bits(float_bits(static_cast<float>(mantissa) * 0x1p-24f) | sign);
  if (exponent == 31) return float_from_bits(float_bits(mantissa ? NAN : INFINITY) | sign);
  return float_from_bits(sign | ((exponent + 127u - 15u) << 23) | (mantissa << 13));
}

inline constexpr float kFp16Max = 65504.0f;

}  // namespace fp8lm
