// The small-M GEMM: the GEMV-shaped kernel that serves GEMMs of a few rows (decoding steps,
// one row per sequence) in place of cuBLASLt. Same contract as GemmEngine::gemm
// (core/gemm_cuda.h) for the problems it takes:
//
//   D [M,N] = alpha * a_scale_inv * b_scale_inv * (A [M,K] . B [N,K]^T) + beta * C [M,N] (+ bias [N])
//
// with A and B both E4M3 codes (per-tensor scale_inv, device pointers read by the kernel, any
// alignment) or both BF16, D, C and bias BF16, C nullptr or another buffer than D, M in
// [1, kSmallMMaxRows], K a multiple of 16, A and B 16-byte aligned (small_m_gemm_refusal says
// which condition a problem misses). GemmEngine::gemm decides, in one place, which GEMMs it
// serves; calling it with anything else is a RuntimeError, never a quietly different computation.
//
// Why: at M = 1 cuBLASLt's FP8 kernels (tiled for large M) read the weights of gpt2-1558m at
// ~550 GB/s on an H100, its BF16 ones at ~1,170 GB/s (docs/INFERENCE.md), while a decoding
// step's GEMMs are nothing but one pass over the weights. This kernel makes that one pass:
// every warp streams rows of B with 16-byte loads, several loads in flight per lane, and
// multiplies each loaded piece by all M rows of A at once, so B is read exactly once whatever M.
//
// Numerics: every product of two E4M3 (or two BF16) values is exact in FP32, and the sums are
// FP32; only the order of the summation differs from the CPU's cpu::gemm_nt (each lane sums its
// 16-byte pieces in K order, then the 32 lanes combine in a fixed butterfly). The epilogue adds
// beta * C, then the bias, to the FP32 result and rounds to BF16 once, as cuBLASLt's epilogue
// and CpuOps' add_epilogue do. No atomics: the result is bit-reproducible.
#pragma once

#include <cuda_runtime.h>

#include "core/gemm_cuda.h"

namespace fp8lm::cuda {

// The most rows of A one launch takes. Each lane keeps rows_of_B_per_warp x M FP32 sums in
// registers; 8 covers decoding batches up to 8 (beyond, cuBLASLt's tiles start to pay off).
inline constexpr int kSmallMMaxRows = 8;

// nullptr when the kernel takes the problem, else the condition it misses (a static string:
// no allocation on a decoding step's path).
const char* small_m_gemm_refusal(const GemmDesc& desc, const GemmArgs& args);

// Queues the GEMM on `stream`. Throws RuntimeError for a problem outside the contract above.
void gemm_small_m(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream);

}  // namespace fp8lm::cuda
