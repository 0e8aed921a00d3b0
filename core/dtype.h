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
inline uint16_t fp16_from_float(float x) {
  uint32_t bits = float_bits(x);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7FFFu);  // NaN
  float a = float_from_bits(abs_bits);
  // Round at the FP16 quantum; beyond 65520 (max + half ulp) it rounds to infinity.
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7C00u);
  if (a < 0x1p-14f) {  // subnormal: quantum 2^-24; nearbyint rounds ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24f)));
  }
  int exponent;
  std::frexp(a, &exponent);  // a = f * 2^exponent, f in [0.5, 1)
  int unbiased = exponent - 1;
  float quantum = std::ldexp(1.0f, unbiased - 10);
  uint32_t significand = static_cast<uint32_t>(std::nearbyint(a / quantum));  // in [1024, 2048]
  // A carry to 2048 rolls naturally into the next exponent field.
  uint32_t code = (static_cast<uint32_t>(unbiased + 15) << 10) + (significand - 1024u);
  return static_cast<uint16_t>(sign | code);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa + 1024u), static_cast<int>(exponent) - 25);
  }
  return float_from_bits(float_bits(magnitude) | sign);
}

inline constexpr float kFp16Max = 65504.0f;

}  // namespace fp8lm
