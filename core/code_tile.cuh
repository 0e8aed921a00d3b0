// A 64 x 64 tile of FP8 codes staged in shared memory and stored transposed: how the kernels
// that produce a wgrad GEMM's input operand ([M,F] values, read by the GEMM as [F,M]) write it
// (layers/gelu.cu, layers/layernorm.cu). Included by .cu files only.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_fp8.h>

#include "core/device_helpers.cuh"

namespace fp8lm::cuda::device {

inline constexpr int kCodeTile = 64;                // rows x columns of a tile
inline constexpr int kCodeTileThreads = 256;        // 8 column chunks of 8 x 32 row groups
inline constexpr int kCodeTilePitch = kCodeTile + 4;  // bytes per shared code row (4-byte aligned, no bank conflicts)

// Casts a tile's values into codes[row * kCodeTilePitch + column]: thread tid takes the 8
// columns f0 + (tid % 8) * 8 .. +7 of rows m0 + tid / 8 and m0 + tid / 8 + 32.
// row_values(m, f, values) writes the BF16-rounded values of row m, columns f .. f + 7; it is
// called only where m < M and f < F (F a multiple of 8). Positions outside [M,F] stage code 0,
// which store_code_tile_transposed never stores. The caller syncs the block before the store.
template <typename RowValues>
__device__ __forceinline__ void stage_code_tile(uint8_t* codes, int m0, int f0, int M, int F, int tid, float scale,
                                                __nv_fp8_interpretation_t interp, RowValues&& row_values) {
  const int chunk = tid % 8, row_group = tid / 8;
  const int f = f0 + chunk * 8;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = row_group + 32 * h;
    const int m = m0 + r;
    uint2 packed = make_uint2(0u, 0u);
    if (m < M && f < F) {
      float values[8];
      row_values(m, f, values);
      packed = fp8x8(values, scale, interp);
    }
    uint32_t* code_words = reinterpret_cast<uint32_t*>(codes + r * kCodeTilePitch + chunk * 8);
    code_words[0] = packed.x;
    code_words[1] = packed.y;
  }
}

// codes[row * kCodeTilePitch + column] for tile rows m0.. and columns f0.., stored transposed
// into out_t [F,M] (coalesced along m). All kCodeTileThreads threads call it.
__device__ __forceinline__ void store_code_tile_transposed(uint8_t* __restrict__ out_t, const uint8_t* codes, int m0,
                                                           int f0, int M, int F, int tid) {
  if (M % 16 == 0 && m0 + kCodeTile <= M) {
    // 16-byte stores: thread -> (output row j = tid/4, rows m0 + seg*16 .. +15).
    const int j = tid / 4, seg = tid % 4;
    if (f0 + j < F) {
      uint32_t word[4];
#pragma unroll
      for (int w = 0; w < 4; w++) {
        uint32_t v = 0u;
#pragma unroll
        for (int b = 0; b < 4; b++)
          v |= static_cast<uint32_t>(codes[(seg * 16 + w * 4 + b) * kCodeTilePitch + j]) << (8 * b);
        word[w] = v;
      }
      *reinterpret_cast<uint4*>(out_t + static_cast<size_t>(f0 + j) * M + m0 + seg * 16) =
          make_uint4(word[0], word[1], word[2], word[3]);
    }
  } else {
    // Edge tiles or M not a multiple of 16: byte stores, still coalesced along m.
    for (int idx = tid; idx < kCodeTile * kCodeTile; idx += kCodeTileThreads) {
      const int j = idx / kCodeTile, i = idx % kCodeTile;
      if (f0 + j < F && m0 + i < M) out_t[static_cast<size_t>(f0 + j) * M + m0 + i] = codes[i * kCodeTilePitch + j];
    }
  }
}

}  // namespace fp8lm::cuda::device
