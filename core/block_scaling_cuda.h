// FP8 block scaling on the GPU: the casts that write block-scaled GEMM operands
// (core/block_scaling.h: scale rule and layouts). CPU twins: cpu::quantize_tiles_1x128,
// cpu::quantize_blocks_128x128, cpu::transpose_block_scales; the codes and scales match them
// bit for bit (code = cvt.rn.satfinite(x * s), s a power of two from the same rule).
// Every pointer is device memory; launchers are asynchronous on `stream`.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"

namespace fp8lm::cuda {

// An activation or gradient operand from in [M,N] (N a multiple of 16; ragged last tiles):
//   out       [M,N] = fp8(in * s), s per 1x128 tile along N;  scale_inv   [tile_scale_count(M, N)]
//   out_t     [N,M] = fp8(in^T * s'), s' per 1x128 tile along M (M a multiple of 16);
//                     scale_inv_t [tile_scale_count(N, M)]   (nullable, both or neither)
void quantize_tiles_1x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                          const __nv_bfloat16* in, int M, int N, Fp8Dtype dtype, int margin, cudaStream_t stream);
void quantize_tiles_1x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, const float* in, int M,
                          int N, Fp8Dtype dtype, int margin, cudaStream_t stream);

// A weight operand from in [M,N] (both multiples of 16; ragged last blocks):
//   out [M,N] = fp8(in * s), s per 128x128 block;  scale_inv [block_scale_count(M, N)]
//   out_t [N,M] = out^T;  scale_inv_t [block_scale_count(N, M)] the blocks transposed (nullable, both or neither)
void quantize_blocks_128x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                             const __nv_bfloat16* in, int M, int N, Fp8Dtype dtype, int margin, cudaStream_t stream);
void quantize_blocks_128x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, const float* in,
                             int M, int N, Fp8Dtype dtype, int margin, cudaStream_t stream);

}  // namespace fp8lm::cuda
