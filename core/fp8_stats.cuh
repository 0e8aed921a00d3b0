// The GPU half of the FP8 cast statistics (core/fp8_stats.h): every FP8-producing kernel
// keeps an Fp8CastTally per thread while a statistics step is on and folds the block's
// tallies into the state's Fp8CastCounts record with one set of integer atomics. Kernels
// take the counting as a template parameter, so the kernels of steps without statistics are
// the same code as before the statistics existed. Included by .cu files only.
#pragma once

#include <cstdint>

#include "core/fp8_stats.h"

namespace fp8lm::cuda::device {

// Every thread of the block must call this, with the same `counts` (it synchronises, before
// and after, so a kernel may call it more than once). Adds the block's counts into *counts,
// raises its amax and writes `scale` (every block writes the same value).
// Assumes blockDim.x * blockDim.y * blockDim.z is a multiple of 32 and at most 1024.
__device__ __forceinline__ void commit_fp8_tally(Fp8CastCounts* counts, const Fp8CastTally& tally, float scale) {
  __shared__ uint32_t warp_sums[5][32];  // elements, saturated, underflow, subnormal, amax bits
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int warp = thread / 32, lane = thread % 32;
  const int num_warps = (blockDim.x * blockDim.y * blockDim.z + 31) / 32;
  // A warp's 32 per-thread counts fit 32 bits (each thread counts few elements per launch).
  const uint32_t elements = __reduce_add_sync(0xffffffffu, tally.elements);
  const uint32_t saturated = __reduce_add_sync(0xffffffffu, tally.saturated);
  const uint32_t underflow = __reduce_add_sync(0xffffffffu, tally.underflow);
  const uint32_t subnormal = __reduce_add_sync(0xffffffffu, tally.subnormal);
  const uint32_t amax_bits = __reduce_max_sync(0xffffffffu, tally.amax_bits);
  __syncthreads();  // an earlier call's readers are done with warp_sums
  if (lane == 0) {
    warp_sums[0][warp] = elements;
    warp_sums[1][warp] = saturated;
    warp_sums[2][warp] = underflow;
    warp_sums[3][warp] = subnormal;
    warp_sums[4][warp] = amax_bits;
  }
  __syncthreads();
  if (thread == 0) {
    unsigned long long sums[4] = {0, 0, 0, 0};  // the block's totals in 64 bits
    uint32_t block_amax = 0;
    for (int w = 0; w < num_warps; ++w) {
      for (int k = 0; k < 4; ++k) sums[k] += warp_sums[k][w];
      block_amax = max(block_amax, warp_sums[4][w]);
    }
    unsigned long long* totals = reinterpret_cast<unsigned long long*>(&counts->elements);
    for (int k = 0; k < 4; ++k)  // elements, saturated, underflow, subnormal are consecutive
      if (sums[k] != 0) atomicAdd(totals + k, sums[k]);
    if (block_amax != 0) atomicMax(reinterpret_cast<unsigned int*>(&counts->amax_bits), block_amax);
    counts->scale = scale;
  }
  __syncthreads();
}

// The two FP8 codes of a packed pair (low byte first) and the eight of a uint2, for tallies.
__device__ __forceinline__ uint8_t fp8_code_at(uint32_t packed, int index) {
  return static_cast<uint8_t>(packed >> (8 * index));
}

}  // namespace fp8lm::cuda::device
