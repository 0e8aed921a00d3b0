// GPT-2's tanh-approximated GELU ("gelu_new"):
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// On the GPU it is fused with the preceding bias add and the FP8 cast of the next
// GEMM's input; here it is the plain elementwise spec.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/fp8_stats.h"
#include "core/gradient_ref.h"

namespace fp8lm::cpu {

float gelu(float x);
float gelu_derivative(float x);

// out [N] = gelu(inp [N])
void gelu_forward(float* out, const float* inp, size_t N);
// dinp [N] = dout [N] * gelu'(inp [N])  (written, not accumulated)
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N);

}  // namespace fp8lm::cpu

// ---- GPU (layers/gelu.cu) ------------------------------------------------------------
// The same tanh formula as cpu::gelu / cpu::gelu_derivative, in FP32 on BF16 data.
// Requirements, checked on the host before launch (FP8LM_CHECK): F % 8 == 0; bf16 pointers
// 16-byte aligned; row-major FP8 outputs 8-byte aligned. M and F need not be multiples of
// the 64x64 tile.
namespace fp8lm::cuda {

// The bias add fused with GELU and the FP8 cast of the next GEMM's input (one kernel):
//   pre [M,F] (in: GEMM output without bias; out: bf16(pre + bias), saved for backward)
//   out [M,F] = fp8(bf16(gelu(bf16(pre + bias))) * *scale)   (uint8_t codes)
// bias [F]. amax: running max of |bf16(gelu(...))| (atomicMax on the float's bits; NaN ->
// 0x7fc00000); may be nullptr. out must not alias pre. counts (nullable, statistics steps
// only): += the cast's statistics (core/fp8_stats.h).
void bias_gelu_forward_fp8(uint8_t* out, float* amax, const float* scale, Fp8Dtype dtype, __nv_bfloat16* pre,
                           const __nv_bfloat16* bias, int M, int F, cudaStream_t stream,
                           Fp8CastCounts* counts = nullptr);

// The statistics of the FP8 cast of gelu(pre) (core/fp8_stats.h), writing no codes: *counts
// += those of fp8(bf16(gelu(pre)) * *scale), pre [M,F] as saved. For a statistics step whose
// GELU ran in the c_fc GEMM's epilogue (GemmCall::gelu_input), which counts nothing itself;
// the epilogue's own codes differ from these by one step in about 3% of the values.
void count_gelu_fp8_cast(Fp8CastCounts* counts, const __nv_bfloat16* pre, const float* scale, Fp8Dtype dtype, int M,
                         int F, cudaStream_t stream);

// BF16 twin: pre [M,F] += bias (rounded to bf16, saved); out [M,F] = bf16(gelu(pre)).
// out must not alias pre.
void bias_gelu_forward_bf16(__nv_bfloat16* out, __nv_bfloat16* pre, const __nv_bfloat16* bias, int M, int F,
                            cudaStream_t stream);

// Scratch (FP32 elements) the two GELU backward functions need: ceil(M/64) * F.
size_t gelu_backward_scratch_floats(int M, int F);

// GELU backward fused with the FP8 casts of c_fc's output gradient (one read of the inputs):
//   dpre   [M,F] = fp8(bf16(dout * gelu'(pre)) * *scale)    row-major codes
//   dpre_t [F,M] = the same codes transposed
//   dbias  [F]  += sum over rows of bf16(dout * gelu'(pre))  (FP32 sums, deterministic: per
//                   64-row tile partials in scratch, then a fixed-order reduction; added
//                   once to an FP32 or BF16 gradient, core/gradient_ref.h)
//   amax        running max of |bf16(dout * gelu'(pre))| (may be nullptr)
//   counts     += the cast's statistics (core/fp8_stats.h)   (nullable: statistics steps only)
//   recomputed.codes_t [F,M] = (optional) the forward's output again, transposed:
//                   fp8(bf16(gelu(pre)) * *recomputed.scale), exactly bias_gelu_forward_fp8's codes
//                   for the same pre and scale; no amax, no statistics (16-byte aligned)
// dout [M,F], pre [M,F] (bf16(pre + bias) as saved by the forward).
// scratch: gelu_backward_scratch_floats(M, F) floats (contents need not be initialised).
struct GeluRecomputedOutput {
  uint8_t* codes_t = nullptr;
  const float* scale = nullptr;
  Fp8Dtype dtype = Fp8Dtype::e4m3;
};
void gelu_backward_cast_transpose_dbias_fp8(uint8_t* dpre, uint8_t* dpre_t, GradientRef dbias, float* amax,
                                            const float* scale, Fp8Dtype dtype, const __nv_bfloat16* dout,
                                            const __nv_bfloat16* pre, int M, int F, float* scratch,
                                            cudaStream_t stream, Fp8CastCounts* counts = nullptr,
                                            GeluRecomputedOutput recomputed = {});

// The recomputed output alone (the current-scaling path, which casts the gradient in a pass
// of its own): out.codes_t [F,M] = fp8(bf16(gelu(pre)) * *out.scale), transposed.
void gelu_recompute_transposed_fp8(GeluRecomputedOutput out, const __nv_bfloat16* pre, int M, int F,
                                   cudaStream_t stream);

// BF16 twin: dpre [M,F] = bf16(dout * gelu'(pre)) (written); dbias [F] += its column sums
// (deterministic, as above). dpre may alias dout (in place).
void gelu_backward_dbias_bf16(__nv_bfloat16* dpre, GradientRef dbias, const __nv_bfloat16* dout,
                              const __nv_bfloat16* pre, int M, int F, float* scratch, cudaStream_t stream);

}  // namespace fp8lm::cuda
