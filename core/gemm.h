// GEMM: the one entry point every Linear layer calls, on the CPU and the GPU.
//
// Everything is "NT": C[M,N] = A[M,K] . B[N,K]^T, both operands contiguous along K.
// That is the only FP8 layout Hopper's tensor cores accept (cuBLASLt's "TN" in its
// column-major terms), so the CPU reference uses it too and gets its transposed
// operands from the same transposes the GPU needs:
//   forward  Y [M,N]  = X [M,K]   . W [N,K]^T
//   dgrad    dX [M,K] = dY [M,N]  . Wt [K,N]^T     (Wt = W transposed)
//   wgrad    dW [N,K] = dYt [N,M] . Xt [K,M]^T     (dYt, Xt transposed)
//
// Precision of the operands (accumulation is FP32 in every mode):
//   fp32 - as given.
//   bf16 - each operand rounded to BF16.
//   fp8  - each operand quantized with its own scale to exact FP8 values,
//          q = fp8(x * scale); the product is multiplied by scale_inv_a * scale_inv_b,
//          which is what cuBLASLt does with its A/B scale pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/fp8.h"

namespace fp8lm {

enum class GemmPrecision : uint8_t { fp32, bf16, fp8 };
std::string_view to_string(GemmPrecision precision);

// Whether the GPU serves GEMMs of a few rows (decoding steps) with its small-M kernel
// (core/gemm_small_m_cuda.h) or, like every other GEMM, with cuBLASLt. `off` exists to measure
// and test the kernel against cuBLASLt (fp8lm sample --small-m-gemm off).
enum class SmallMGemm : uint8_t { on, off };

// Which of cuBLASLt's candidate algorithms a plan keeps (core/gemm_cuda.cpp). The heuristic's
// first is not always the fastest: on gpt2-1558m's forward GEMMs another candidate was up to 11%
// faster (H200, tests/bench_gemm_algorithms_gpu.cpp). `timed` (the default) times the candidates
// once, when a large GEMM that overwrites its output (no C == D accumulation) first runs, and
// keeps the fastest among those whose output equals the heuristic's first, bit for bit, on that
// call's operands: training stays bit-reproducible whichever candidate wins. It waits for the
// device once per new plan (the first step), and never while a CUDA graph is being captured.
// --gemm-algorithm timed|heuristic.
enum class GemmAlgorithmChoice : uint8_t { timed, heuristic };
std::string_view to_string(GemmAlgorithmChoice choice);

// Which FP8 GEMMs sum on the tensor cores alone (cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM; about
// 14 bits kept in the running sums, DeepSeek-V3's report) rather than promoting their partial sums
// to FP32 registers every few steps of K. `forward` is Transformer Engine's default (its
// recipes' use_split_accumulator: off in fprop, on in dgrad and wgrad); `all` also the
// backward's dgrad and wgrad, 8.5% less GEMM time there on gpt2-1558m's shapes (one H100,
// tests/bench_gemm_algorithms_gpu.cpp). Block-scaled GEMMs always promote (cuBLASLt requires it).
// The CPU reference accumulates in FP32 either way. --fp8-fast-accumulation forward|all.
enum class Fp8FastAccumulation : uint8_t { forward, all };
inline constexpr int64_t kFastAccumulationMaxK = 16384;

// Under `all`, whether one backward FP8 GEMM sums on the tensor cores alone. Never a sum the
// model marks as promoted (GemmCall::promote_partial_sums): the LM head's dgrad and wgrad, whose
// terms are dlogits, almost all small softmax probabilities beside each target's -1, which a
// 14-bit running sum drops. On the tensor cores alone the dgrad (over the vocabulary, 50,304)
// made gpt2-124m's loss 4.4% worse (device call 194), and the wgrad (over a micro-batch's 8,192
// tokens) 0.2% worse (call 200); marked, not measured by length, because under tensor parallelism
// a rank's slice of the vocabulary is short. And never a sum longer than kFastAccumulationMaxK
// products, whose running sum would keep too few bits of each (the layers' dgrad sums 4C at
// most, their wgrad a micro-batch's tokens).
constexpr bool backward_sums_on_tensor_cores(Fp8FastAccumulation choice, bool block_scaled,
                                             bool promote_partial_sums, int64_t K) {
  return choice == Fp8FastAccumulation::all && !block_scaled && !promote_partial_sums &&
         K <= kFastAccumulationMaxK;
}
std::string_view to_string(Fp8FastAccumulation choice);

namespace cpu {

// C [M,N] = alpha * A [M,K] . B [N,K]^T  (+ C when accumulate). FP32 accumulation in
// a fixed order (independent of thread count).
void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, bool accumulate);

// out [cols,rows] = in [rows,cols]^T
void transpose(float* out, const float* in, int rows, int cols);

// max |x| over n values; NaN if any value is NaN.
float amax(const float* x, size_t n);

// out = fp8_round(x * scale): the exact FP8 values the GPU would store, kept as FP32.
void quantize_fp8(float* out, const float* x, size_t n, float scale, Fp8Dtype dtype);

// out = round_to_bf16(x)
void round_bf16(float* out, const float* x, size_t n);

}  // namespace cpu
}  // namespace fp8lm
