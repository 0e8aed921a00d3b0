// exp_vectorizable: the CPU reference's e^x where it runs over whole rows (the loss).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace fp8lm::cpu {

// e^x in FP32, within 1.22 ulp of the exact value over the whole float range (checked against
// a double-precision exp, tests/test_layers_cpu.cpp), written without calls or branches so
// that the loops that call it vectorize (with -fno-trapping-math, which lets the selects run as
// vector blends): the loss takes two exponentials a logit (a GPT-2 vocabulary
// is 50,257 wide), and one call to the C library's expf per value made it the largest cost of a
// CPU step after the GEMMs. x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, Cody and Waite,
// so that n ln2 is exact), e^r by its Taylor series to r^7 (the next term is below 1e-8 of it),
// times 2^n built from the exponent bits in two halves, so that results down to the smallest
// subnormal come out rounded once.
inline float exp_vectorizable(float x) {
  constexpr float kLowest = -104.0f;               // e^x rounds to 0 below
  constexpr float kHighest = 88.72283935546875f;  // e^x overflows above
  constexpr float kRoundingShift = 12582912.0f;    // 1.5 * 2^23: adding it rounds to an integer
  const float clamped = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);  // NaN stays NaN
  const float shifted = clamped * 1.44269504088896341f + kRoundingShift;
  const float n = shifted - kRoundingShift;
  const int32_t exponent = int32_t(std::bit_cast<uint32_t>(shifted) - std::bit_cast<uint32_t>(kRoundingShift));  // n
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t half = exponent >> 1;
  const float result = p * std::bit_cast<float>(uint32_t(half + 127) << 23) *
                       std::bit_cast<float>(uint32_t(exponent - half + 127) << 23);
  return x > kHighest ? INFINITY : result;
}

}  // namespace fp8lm::cpu
