// A 64 x 64 tile of FP8 codes staged in shared memory and stored transposed: how the kernels
// that produce a wgrad GEMM's input operand ([M,F] values, read by the GEMM as [F,M]) write it
// (layers/gelu.cu, layers/layernorm.cu). Included by .cu files only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fp8lm::cuda::device {

inline constexpr int kCodeTile = 64;                // rows x columns of a tile
inline constexpr int kCodeTileThreads = 256;        // 8 column chunks of 8 x 32 row groups
inline constexpr int kCodeTilePitch = kCodeTile + 4;  // bytes per shared code row (4-byte aligned, no bank conflicts)

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
