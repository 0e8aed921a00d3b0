// LayerNorm over the last dimension, with learned weight and bias.
//   mean = sum(x)/C, rstd = 1/sqrt(sum((x-mean)^2)/C + eps), out = (x-mean)*rstd*w + b
// Saves mean and rstd per row for backward. BF16 on the GPU (FP32 statistics).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/fp8_stats.h"
#include "core/gradient_ref.h"

namespace fp8lm::cpu {

// out [N,C], mean [N], rstd [N], inp [N,C], weight [C], bias [C]
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps);

// One output element from its row's statistics; the forward and layernorm_output both take it
// from here, so that an output computed again is the forward's bit for bit.
inline float layernorm_element(float x, float mean, float rstd, float weight, float bias) {
  return (x - mean) * rstd * weight + bias;
}

// out [N,C] = the forward's output again from inp [N,C] and the forward's mean [N], rstd [N].
void layernorm_output(float* out, const float* inp, const float* mean, const float* rstd, const float* weight,
                      const float* bias, int N, int C);

// Accumulates (+=) into dinp [N,C], dweight [C], dbias [C].
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C);

// The residual add of a block's branch, folded into the LayerNorm that follows it (the
// row-parallel GEMM that produced `branch` wrote neither its bias nor the residual):
//   residual_out [N,C] = residual_in + (branch + branch_bias)   (FP32; branch_bias [C] broadcast
//                        over rows; nullptr counts as 0. The GPU rounds residual_out to BF16 and
//                        normalizes the rounded values.)
//   out [N,C], mean [N], rstd [N] = layernorm_forward(residual_out)
// residual_in [N,C], branch [N,C], weight [C], bias [C]. residual_out may alias residual_in.
// branch == nullptr: nothing is added, residual_out is not written (may be nullptr) and
// residual_in is normalized; branch_bias must then be nullptr too.
void residual_layernorm_forward(float* out, float* residual_out, float* mean, float* rstd, const float* residual_in,
                                const float* branch, const float* branch_bias, const float* weight,
                                const float* bias, int N, int C, float eps);

}  // namespace fp8lm::cpu

// ---- GPU (layers/layernorm.cu) -------------------------------------------------------
// Forward: one warp per row, 16-byte loads (8 bf16), the row kept in registers, FP32
// statistics (two passes over the registers, as the CPU reference). Backward (rows up to 2048
// wide): a block per run of rows, a thread per 8 columns (layernorm.cu says why). Requirements, checked on the host
// before launch (FP8LM_CHECK): C % 8 == 0 and 8 <= C <= 8192; bf16 pointers 16-byte
// aligned, FP8 outputs 8-byte aligned, FP32 accumulators 4-byte aligned.
namespace fp8lm::cuda {

// The largest row width the LayerNorm kernels take (8 bf16 per chunk x 32 chunks per lane x
// 32 lanes): 4096 (6.7B) and 8192 (70B-class) widths included.
inline constexpr int kLayerNormMaxC = 8192;

// out [N,C] = bf16(LayerNorm(inp)); mean [N], rstd [N] (written; either may be nullptr).
// inp [N,C], weight [C], bias [C].
void layernorm_forward_bf16(__nv_bfloat16* out, float* mean, float* rstd, const __nv_bfloat16* inp,
                            const __nv_bfloat16* weight, const __nv_bfloat16* bias, int N, int C, float eps,
                            cudaStream_t stream);

// LayerNorm fused with the FP8 cast of the next GEMM's input:
//   out [N,C] = fp8(bf16(LayerNorm(inp)) * *scale)   (uint8_t codes, RNE, saturating)
// i.e. exactly the codes a cast of layernorm_forward_bf16's output would give.
// amax: running max (+= as max) of |bf16(LayerNorm(inp))| on the float's bits (atomicMax);
// a NaN makes it 0x7fc00000. amax may be nullptr (not recorded); scale may not.
// counts (nullable, statistics steps only): += the cast's statistics (core/fp8_stats.h).
void layernorm_forward_fp8(uint8_t* out, float* amax, const float* scale, Fp8Dtype dtype, float* mean, float* rstd,
                           const __nv_bfloat16* inp, const __nv_bfloat16* weight, const __nv_bfloat16* bias, int N,
                           int C, float eps, cudaStream_t stream, Fp8CastCounts* counts = nullptr);

// The residual add folded into the LayerNorm (see cpu::residual_layernorm_forward):
//   residual_out [N,C] = bf16(float(residual_in) + (float(branch) + float(branch_bias)))  (one rounding)
//   out, mean, rstd    = layernorm_forward_bf16 / _fp8 of the BF16 residual_out
// Bit for bit what "residual_out = bf16(residual_in + (branch + branch_bias))" followed by
// layernorm_forward_bf16 / _fp8 on residual_out gives (out, mean, rstd and amax), in one read
// of the three inputs. residual_in [N,C], branch [N,C], branch_bias [C] (nullptr: nothing is
// added, not even a zero), weight [C], bias [C]; residual_out [N,C] written.
// residual_out may alias residual_in (in place) but not branch; out aliases none of them.
// branch may not be nullptr (layernorm_forward_* is the no-branch case). Requirements as
// above; residual_in, residual_out, branch and branch_bias 16-byte aligned.
void residual_layernorm_forward_bf16(__nv_bfloat16* out, __nv_bfloat16* residual_out, float* mean, float* rstd,
                                     const __nv_bfloat16* residual_in, const __nv_bfloat16* branch,
                                     const __nv_bfloat16* branch_bias, const __nv_bfloat16* weight,
                                     const __nv_bfloat16* bias, int N, int C, float eps, cudaStream_t stream);

// As layernorm_forward_fp8 (out [N,C] FP8 codes, amax running max, scale [1], counts) on the
// residual above.
void residual_layernorm_forward_fp8(uint8_t* out, float* amax, const float* scale, Fp8Dtype dtype,
                                    __nv_bfloat16* residual_out, float* mean, float* rstd,
                                    const __nv_bfloat16* residual_in, const __nv_bfloat16* branch,
                                    const __nv_bfloat16* branch_bias, const __nv_bfloat16* weight,
                                    const __nv_bfloat16* bias, int N, int C, float eps, cudaStream_t stream,
                                    Fp8CastCounts* counts = nullptr);

// layernorm_forward_fp8's codes again, transposed, from its input and saved statistics:
//   out_t [C,N] = (fp8(bf16(LayerNorm(inp)) * *scale))^T   with mean [N], rstd [N] the forward's
// bit for bit the forward's codes (and a current-scaling forward's: its cast of the BF16
// output with the same scale). No amax is recorded. out_t, inp, weight, bias 16-byte aligned.
void layernorm_operand_transposed_fp8(uint8_t* out_t, const float* scale, Fp8Dtype dtype,
                                      const __nv_bfloat16* inp, const float* mean, const float* rstd,
                                      const __nv_bfloat16* weight, const __nv_bfloat16* bias, int N, int C,
                                      cudaStream_t stream);

// Scratch (FP32 elements) that layernorm_backward needs for N rows of width C.
size_t layernorm_backward_scratch_floats(int N, int C);

// dinp [N,C] += (read bf16, add in FP32, write bf16); dweight [C] +=, dbias [C] += (FP32
// sums, deterministic: per-block partials in scratch, then a fixed-order reduction; each
// added once to an FP32 or BF16 gradient, core/gradient_ref.h).
// dout [N,C], inp [N,C], weight [C], mean [N], rstd [N] (as saved by the forward).
// scratch: layernorm_backward_scratch_floats(N, C) floats (contents need not be initialised).
// dinp must not alias dout or inp.
void layernorm_backward(__nv_bfloat16* dinp, GradientRef dweight, GradientRef dbias, const __nv_bfloat16* dout,
                        const __nv_bfloat16* inp, const __nv_bfloat16* weight, const float* mean, const float* rstd,
                        int N, int C, float* scratch, cudaStream_t stream);

}  // namespace fp8lm::cuda
