// Device helpers shared by the fused kernels (layers/*.cu): 16-byte BF16 vectors, FP8
// pair conversion, and the running-amax protocol every FP8 producer follows. Included
// by .cu files only.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace fp8lm::cuda::device {

using bf16 = __nv_bfloat16;

// Eight BF16 values (16 bytes, 16-byte aligned) to and from FP32.
__device__ __forceinline__ void load_bf16x8(const bf16* p, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void store_bf16x8(bf16* p, const float (&f)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Two FP8 codes, a in the low byte (lower address), b in the high byte.
__device__ __forceinline__ uint32_t fp8x2(float a, float b, __nv_fp8_interpretation_t interp) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, interp));
}

// |x| as ordered bits: for x >= 0 the unsigned order is the float order, and every NaN
// (sign cleared) is above +inf.
__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(fabsf(x)); }

// Block-wide max of `bits` into *amax (atomicMax on the float's bits). Every thread of the
// block must call it (it synchronises). NaN is written as 0x7fc00000.
__device__ __forceinline__ void block_amax_update(float* amax, unsigned bits) {
  __shared__ unsigned warp_max[32];
  bits = __reduce_max_sync(0xffffffffu, bits);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_warps = (blockDim.x + 31) / 32;
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < num_warps ? warp_max[lane] : 0u;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (lane == 0 && amax != nullptr && bits != 0u) {
      if (bits > 0x7f800000u) bits = 0x7fc00000u;
      atomicMax(reinterpret_cast<int*>(amax), static_cast<int>(bits));
    }
  }
}

// One definition per translation unit (a .cu-only header, no relocatable device code).
namespace {

// dst_lo[c] += sum_r partials[r][c] for c < split, dst_hi[c - split] += ... for c >= split.
// partials [rows][cols] (per-block partial sums of a parameter gradient); dst_hi may be
// null when split == cols. Block (32, 8): column blockIdx.x*32 + tx; thread row ty sums rows
// ty, ty+8, ... in order; the 8 sums are then added in order. Deterministic.
// Launch with grid ceil(cols/32), block (32, 8).
__global__ void __launch_bounds__(256) add_column_sums_kernel(float* __restrict__ dst_lo, float* __restrict__ dst_hi,
                                                              int split, const float* __restrict__ partials,
                                                              int rows, int cols) {
  __shared__ float sums[8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * 32 + tx;
  float sum = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (int r = ty; r < rows; r += 8) sum += partials[static_cast<size_t>(r) * cols + col];
  }
  sums[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < cols) {
    float total = sums[0][tx];
#pragma unroll
    for (int g = 1; g < 8; g++) total += sums[g][tx];
    if (col < split) {
      dst_lo[col] += total;
    } else {
      dst_hi[col - split] += total;
    }
  }
}

}  // namespace

}  // namespace fp8lm::cuda::device
