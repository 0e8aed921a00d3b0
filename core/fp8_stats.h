// FP8 cast statistics (--fp8-stats-interval, docs/NUMERICS.md): what quantizing a tensor
// into an FP8 GEMM operand did to its values. The definitions live here, once, for the CPU
// reference (layers/ops_cpu.cpp) and the GPU kernels (core/fp8_stats.cuh): each counted
// element is the pair (x, code), x the value before scaling and code = fp8(x * scale), the
// very code the cast writes.
//
//   saturated  the cast clipped the value: |x * scale| lies past the midpoint between
//              fp8_max and the step above it (E4M3 464, E5M2 61440; a tie goes where round to
//              nearest even sends it: E4M3's to 448, E5M2's beyond), so without the format's
//              limit it would not have rounded to +-max (infinities count). Values up to that
//              midpoint round to +-max anyway: under current scaling the amax element maps onto
//              fp8_max, one FP32 rounding of the scale may put it a few ulps above, and
//              counting those (every element equal to the amax, hundreds in a BF16 tensor)
//              reported saturation where nothing was clipped.
//   underflow  x != 0 but the code is +-0: the value was lost.
//   subnormal  the code is a nonzero subnormal (exponent field 0): fewer mantissa bits.
//
// NaN inputs count as elements and nothing else.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/fp8.h"

namespace fp8lm {

// What the quantizations into one FP8 operand did while statistics were being collected:
// one per scaling state, in backend memory, zeroed when a statistics step begins (a zeroed
// record is a valid empty one). The GPU adds to it with integer atomics, so the counts are
// exact whatever the order of the blocks.
struct Fp8CastCounts {
  uint64_t elements = 0;   // values quantized (a tensor quantized twice counts twice)
  uint64_t saturated = 0;
  uint64_t underflow = 0;
  uint64_t subnormal = 0;
  uint32_t amax_bits = 0;  // max |x| as the float's bits (non-negative floats order like their bits); NaN: 0x7FC00000
  float scale = 0.0f;      // the scale of the last quantization counted
};
static_assert(sizeof(Fp8CastCounts) == 40, "the GPU and the CPU share this layout");

// The smallest |x * scale| the cast clips (see saturated above): E4M3 past 464 (448 + 32/2; the
// tie rounds to 448, whose mantissa is even), E5M2 from 61440 on (57344 + 8192/2; the tie rounds
// to 65536, whose mantissa is even).
FP8LM_HOST_DEVICE constexpr bool fp8_clips(float scaled, Fp8Dtype dtype) {
  const float magnitude = scaled < 0.0f ? -scaled : scaled;
  return dtype == Fp8Dtype::e4m3 ? magnitude > 464.0f : magnitude >= 61440.0f;
}

// The smallest positive normal value of each format: 2^-6 (E4M3), 2^-14 (E5M2).
FP8LM_HOST_DEVICE constexpr float fp8_min_normal(Fp8Dtype dtype) {
  return dtype == Fp8Dtype::e4m3 ? 0.015625f : 6.103515625e-05f;
}

// Codes: sign bit 7, then the exponent field (4 bits E4M3, 5 bits E5M2), then the mantissa.
FP8LM_HOST_DEVICE constexpr bool fp8_code_is_zero(uint8_t code) { return (code & 0x7F) == 0; }
FP8LM_HOST_DEVICE constexpr bool fp8_code_is_subnormal(uint8_t code, Fp8Dtype dtype) {
  const uint8_t exponent_field = dtype == Fp8Dtype::e4m3 ? 0x78 : 0x7C;
  return !fp8_code_is_zero(code) && (code & exponent_field) == 0;
}

// |x| as the bits the amax compares: any NaN becomes the quiet NaN 0x7FC00000, above +inf.
FP8LM_HOST_DEVICE inline uint32_t fp8_stats_amax_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  bits &= 0x7FFFFFFFu;
  return bits > 0x7F800000u ? 0x7FC00000u : bits;
}

FP8LM_HOST_DEVICE inline float fp8_stats_amax(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// One thread's (or one CPU loop's) counts, 32-bit: a thread counts far fewer than 2^32
// elements per launch. Folded into an Fp8CastCounts record per block (GPU) or per call (CPU).
struct Fp8CastTally {
  uint32_t elements = 0, saturated = 0, underflow = 0, subnormal = 0;
  uint32_t amax_bits = 0;

  // x: the value before scaling; scaled = x * scale as the cast computed it; code = fp8(scaled).
  FP8LM_HOST_DEVICE void add(float x, float scaled, uint8_t code, Fp8Dtype dtype) {
    elements += 1;
    saturated += fp8_clips(scaled, dtype) ? 1u : 0u;
    underflow += (fp8_code_is_zero(code) && x != 0.0f) ? 1u : 0u;
    subnormal += fp8_code_is_subnormal(code, dtype) ? 1u : 0u;
    const uint32_t bits = fp8_stats_amax_bits(x);
    amax_bits = bits > amax_bits ? bits : amax_bits;
  }
};

// Host side: adds a tally to a record (the CPU backend's counts live in host memory).
inline void add_tally(Fp8CastCounts& counts, const Fp8CastTally& tally, float scale) {
  counts.elements += tally.elements;
  counts.saturated += tally.saturated;
  counts.underflow += tally.underflow;
  counts.subnormal += tally.subnormal;
  if (tally.amax_bits > counts.amax_bits) counts.amax_bits = tally.amax_bits;
  counts.scale = scale;
}

}  // namespace fp8lm
