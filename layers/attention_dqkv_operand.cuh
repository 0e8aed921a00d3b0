// The backward's FP8 output: c_attn's output-gradient operand written by the wgmma backward
// kernels' epilogues (attention_backward_wgmma.cuh) instead of dqkv in BF16. Included once,
// by attention.cu.
//
// Why: under delayed scaling the operand's scale is known before the backward runs, so the
// kernels that hold each 64x64 tile of dqkv in registers can write its codes, their
// transpose, the tile's column sums (c_attn's bias gradient) and its amax themselves. The
// BF16 dqkv is then never written, and the cast kernel that read it back is gone: 4 bytes an
// element less, about 3 ms of gpt2-1558m's step.
//
// Exactly the cast's bits (core/cast.cu, cast_transpose_kernel over the BF16 dqkv): each
// value is rounded to BF16 first, as the BF16 store did; codes = fp8(bf16 * scale) with the
// same saturating conversion; the amax is the max of |bf16| (order-free); and the column sums
// take the cast kernel's order: per 64-row tile, rows r and r + 32 of each of 32 lanes, then
// the lanes in turn. That needs the kernels' tiles to be the cast's tiles: T a multiple of 64
// (attention_backward_writes_operand).

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/device_helpers.cuh"
#include "layers/attention_forward.cuh"
#include "layers/attention_tiles.cuh"

namespace fp8lm::cuda {

namespace {

// Where the epilogue writes: the kernel-side form of DqkvOperand (layers/attention.h).
struct DqkvOperandTarget {
  uint8_t* codes;         // [B*T, 3C]
  uint8_t* codes_t;       // [3C, B*T]
  float* bias_partials;   // [B*T/64, 3C] (nullable: no bias gradient)
  float* amax;            // raised to the block's max |bf16| (nullable)
  const float* scale;     // device scalar
  __nv_fp8_interpretation_t kind;
};

constexpr int kOperandTile = 64;
constexpr int kOperandTileLd = kOperandTile + 1;  // float row stride: a column's reads hit distinct banks
using OperandTile = float[kOperandTile][kOperandTileLd];

// Stage 1, before a __syncthreads: this thread's accumulators of one 64x64 tile of dqkv, in the
// wgmma layout (warp w: rows 16w + g and 16w + g + 8, columns 8nt + c2 and 8nt + c2 + 1) and
// already scaled, rounded to BF16 into `tile`. Returns `amax` raised to their largest |bf16|.
__device__ __forceinline__ uint32_t stage_operand_tile(OperandTile& tile, const float (&values)[8][4], uint32_t amax) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int c2 = 2 * (lane & 3);
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(values[nt][2 * r], values[nt][2 * r + 1]);
      const float lo = __low2float(pair), hi = __high2float(pair);
      tile[16 * warp + g + 8 * r][8 * nt + c2] = lo;
      tile[16 * warp + g + 8 * r][8 * nt + c2 + 1] = hi;
      amax = max(amax, max(amax_bits(lo), amax_bits(hi)));
    }
  return amax;
}

__device__ __forceinline__ uint16_t operand_codes(const DqkvOperandTarget& target, float lo, float hi, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo * scale, hi * scale), __NV_SATFINITE, target.kind);
}

// Stage 2, after that __syncthreads: the staged tile, rows row0.. (a multiple of 64) and
// columns col0.. of [M, N] (M = B*T, N = 3C), as codes, transposed codes and column sums.
// Reads `tile` only. Every thread of the block calls it.
__device__ __forceinline__ void write_operand_tile(const DqkvOperandTarget& target, const OperandTile& tile, int row0,
                                                   int col0, int M, int N) {
  const float scale = *target.scale;
  // Codes, row-major: thread t converts 32 columns of row t / 2, two 16-byte chunks.
  {
    const int r = threadIdx.x / 2;
#pragma unroll
    for (int chunk = 0; chunk < 2; ++chunk) {
      const int c0 = (threadIdx.x % 2) * 32 + chunk * 16;
      uint8_t q[16];
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const uint16_t pair = operand_codes(target, tile[r][c0 + j], tile[r][c0 + j + 1], scale);
        q[j] = static_cast<uint8_t>(pair & 0xFF);
        q[j + 1] = static_cast<uint8_t>(pair >> 8);
      }
      device::store_bytes<16>(target.codes + static_cast<size_t>(row0 + r) * N + col0 + c0, q);
    }
  }
  // The transpose [N, M]: row col0 + c gets the codes of rows row0 + r .. row0 + r + 15, 16
  // per thread and pass (each converted again: cheaper than a byte tile and a barrier).
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int i = static_cast<int>(threadIdx.x) + pass * kThreads;
    const int c = i / 4;
    const int r = (i % 4) * 16;
    uint8_t q[16];
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const uint16_t pair = operand_codes(target, tile[r + j][c], tile[r + j + 1][c], scale);
      q[j] = static_cast<uint8_t>(pair & 0xFF);
      q[j + 1] = static_cast<uint8_t>(pair >> 8);
    }
    device::store_bytes<16>(target.codes_t + static_cast<size_t>(col0 + c) * M + row0 + r, q);
  }
  // Column sums in the cast kernel's order (see the top of this file); unrolled, so that the
  // loads are issued before the chain of adds.
  if (target.bias_partials != nullptr && threadIdx.x < kOperandTile) {
    const int c = threadIdx.x;
    float sum = 0.0f;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      float lane_sum = 0.0f;
      lane_sum += tile[l][c];
      lane_sum += tile[l + 32][c];
      sum += lane_sum;
    }
    target.bias_partials[static_cast<size_t>(row0 / kOperandTile) * N + col0 + c] = sum;
  }
}

}  // namespace

}  // namespace fp8lm::cuda
