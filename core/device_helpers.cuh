// Device helpers shared by the fused kernels (layers/*.cu): 16-byte BF16 vectors, FP8
// pair conversion, and the running-amax protocol every FP8 producer follows. Included
// by .cu files only.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/gradient_ref.h"
#include "core/launch.cuh"

namespace fp8lm::cuda::device {

using bf16 = __nv_bfloat16;

// Eight BF16 values packed in 16 bytes, to and from FP32 (packing rounds to nearest even).
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// The same, but valid == false zero-fills the 16 bytes (src unread).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Every copy this thread started has landed (other threads' copies need a barrier too).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Eight BF16 values (16 bytes, 16-byte aligned) to and from FP32.
__device__ __forceinline__ void load_bf16x8(const bf16* p, float (&f)[8]) {
  unpack_bf16x8(*reinterpret_cast<const uint4*>(p), f);
}

__device__ __forceinline__ void store_bf16x8(bf16* p, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(p) = pack_bf16x8(f);
}

// GPT-2's GELU, the tanh form (cpu::gelu_forward's), in FP32.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2/pi) (x + 0.044715 x^3)
  return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Two FP8 codes, a in the low byte (lower address), b in the high byte.
__device__ __forceinline__ uint32_t fp8x2(float a, float b, __nv_fp8_interpretation_t interp) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, interp));
}

// Eight values times s as 8 FP8 codes in two little-endian words (value 0 in the lowest byte).
__device__ __forceinline__ uint2 fp8x8(const float (&v)[8], float s, __nv_fp8_interpretation_t interp) {
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    word[h] = fp8x2(v[4 * h] * s, v[4 * h + 1] * s, interp) | (fp8x2(v[4 * h + 2] * s, v[4 * h + 3] * s, interp) << 16);
  }
  return make_uint2(word[0], word[1]);
}

// The sum over a warp's 32 lanes, a butterfly: every lane ends with the same bits (IEEE
// addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
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

// gradient[i] += sum, the sum in FP32: a BF16 gradient (--grad-reduce-in-bf16) is widened,
// added to and rounded once, as cuBLASLt's epilogue does for a BF16 D with beta = 1.
__device__ __forceinline__ void add_to_gradient(GradientRef gradient, size_t i, float sum) {
  if (gradient.bf16) {
    bf16* g = static_cast<bf16*>(gradient.data) + i;
    *g = __float2bfloat16_rn(__bfloat162float(*g) + sum);
  } else {
    static_cast<float*>(gradient.data)[i] += sum;
  }
}

// gradient[i .. i+7] += sums[0..7]; i a multiple of 8 and the gradient 16-byte aligned: two
// float4 read-modify-writes in FP32, one 16-byte one in BF16.
__device__ __forceinline__ void add_to_gradient8(GradientRef gradient, size_t i, const float (&sums)[8]) {
  if (gradient.bf16) {
    bf16* g = static_cast<bf16*>(gradient.data) + i;
    float values[8];
    load_bf16x8(g, values);
#pragma unroll
    for (int j = 0; j < 8; j++) values[j] += sums[j];
    store_bf16x8(g, values);
    return;
  }
  float4* d = reinterpret_cast<float4*>(static_cast<float*>(gradient.data) + i);
  float4 lo = d[0], hi = d[1];
  lo.x += sums[0];
  lo.y += sums[1];
  lo.z += sums[2];
  lo.w += sums[3];
  hi.x += sums[4];
  hi.y += sums[5];
  hi.z += sums[6];
  hi.w += sums[7];
  d[0] = lo;
  d[1] = hi;
}

// Gradients as the optimizer and the norm read them: FP32, or BF16 widened to FP32.
__device__ __forceinline__ float gradient_at(const float* gradients, uint64_t i) { return gradients[i]; }
__device__ __forceinline__ float gradient_at(const bf16* gradients, uint64_t i) { return __bfloat162float(gradients[i]); }
// Four consecutive gradients from i (a multiple of 4): one 16-byte (FP32) or 8-byte (BF16) load.
__device__ __forceinline__ void load_gradient4(const float* gradients, uint64_t i, float (&out)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(gradients + i);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
__device__ __forceinline__ void load_gradient4(const bf16* gradients, uint64_t i, float (&out)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(gradients + i);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 lo = __bfloat1622float2(pairs[0]), hi = __bfloat1622float2(pairs[1]);
  out[0] = lo.x;
  out[1] = lo.y;
  out[2] = hi.x;
  out[3] = hi.y;
}

// kCount bytes (4, 8 or 16) to an address aligned to kCount.
template <int kCount>
__device__ __forceinline__ void store_bytes(uint8_t* target, const uint8_t (&q)[kCount]) {
  if constexpr (kCount == 4) {
    uint32_t word;
    memcpy(&word, q, 4);
    *reinterpret_cast<uint32_t*>(target) = word;
  } else if constexpr (kCount == 8) {
    uint2 word;
    memcpy(&word, q, 8);
    *reinterpret_cast<uint2*>(target) = word;
  } else {
    static_assert(kCount == 16, "4, 8 or 16 bytes");
    uint4 word;
    memcpy(&word, q, 16);
    *reinterpret_cast<uint4*>(target) = word;
  }
}

// A 64x64 tile of FP8 codes staged in shared memory, written transposed by a block of 256
// threads (the cast-transpose kernels and the optimizer's weight casts).
inline constexpr int kByteTile = 64;
using ByteTile = uint8_t[kByteTile][kByteTile + 1];  // +1: the column reads below hit distinct banks

// out_t [N,M] gets tile [r][c] (rows row0.., columns col0.. of the [M,N] source) at
// out_t[(col0 + c) * M + row0 + r]. Thread t writes 16 consecutive bytes of one out_t row:
// c = t / 4, r = 16 * (t % 4) .. +15, so 4 threads write one 64-byte run. full: the tile lies
// inside [M,N]; vec_ok: M % 16 == 0 and out_t 16-byte aligned.
__device__ __forceinline__ void write_transposed(uint8_t* __restrict__ out_t, const ByteTile& tile, int row0,
                                                 int col0, int M, int N, bool full, bool vec_ok) {
  const int c = threadIdx.x / 4;
  const int r = (threadIdx.x % 4) * 16;
  const int gc = col0 + c;
  const int gr = row0 + r;
  if (full && vec_ok) {
    uint8_t q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) q[i] = tile[r + i][c];
    store_bytes<16>(out_t + static_cast<size_t>(gc) * M + gr, q);
  } else if (gc < N) {
    for (int i = 0; i < 16 && gr + i < M; ++i) out_t[static_cast<size_t>(gc) * M + gr + i] = tile[r + i][c];
  }
}

// One definition per translation unit (a .cu-only header, no relocatable device code).
namespace {

// dst_lo[c] += sum_r partials[r][c] for c < split, dst_hi[c - split] += ... for c >= split,
// each a parameter gradient (FP32 or BF16: add_to_gradient). partials [rows][cols]
// (per-block partial sums); dst_hi may be empty when split == cols. Block (32, 8): column blockIdx.x*32 + tx; thread row ty sums rows
// ty, ty+8, ... in order; the 8 sums are then added in order. Deterministic.
// Launch with grid ceil(cols/32), block (32, 8).
__global__ void __launch_bounds__(256) add_column_sums_kernel(GradientRef dst_lo, GradientRef dst_hi,
                                                              int split, const float* __restrict__ partials,
                                                              int rows, int cols) {
  device::start_after_previous_kernel();
  __shared__ float sums[8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * 32 + tx;
  float sum = 0.0f;
  if (col < cols) {
    // Unrolled 16 deep so that 16 loads are in flight before their adds (same order).
#pragma unroll 16
    for (int r = ty; r < rows; r += 8) sum += partials[static_cast<size_t>(r) * cols + col];
  }
  sums[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < cols) {
    float total = sums[0][tx];
#pragma unroll
    for (int g = 1; g < 8; g++) total += sums[g][tx];
    if (col < split) {
      add_to_gradient(dst_lo, col, total);
    } else {
      add_to_gradient(dst_hi, col - split, total);
    }
  }
}

}  // namespace

}  // namespace fp8lm::cuda::device
