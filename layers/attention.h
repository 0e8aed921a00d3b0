// Causal multi-head self-attention on a packed QKV tensor, computed as flash
// attention defines it: per row, the softmax's log-sum-exp is kept (O(T) memory), and
// backward recomputes the probabilities from it. No T x T matrix outlives a row here,
// and none is stored in global memory on the GPU.
//
//   qkv [B,T,3C] packs q | k | v; head h uses columns [h*HS, (h+1)*HS) of each, HS = C/NH.
//   S[t,s] = q_t . k_s / sqrt(HS) for first[t] <= s <= t, lse[t] = log(sum_s exp(S[t,s]))
//   P[t,s] = exp(S[t,s] - lse[t]),  out_t = sum_s P[t,s] v_s
// Backward, with D_t = dout_t . out_t:
//   dv_s = sum_t P[t,s] dout_t,  dP[t,s] = dout_t . v_s,  dS = P * (dP - D_t)
//   dq_t = sum_s dS[t,s] k_s / sqrt(HS),  dk_s = sum_t dS[t,s] q_t / sqrt(HS)
// BF16 inputs/outputs with FP32 softmax statistics on the GPU; FP32 here.
//
// Documents (Megatron's --reset-attention-mask): document_starts [B,T] (nullable) holds, for each
// query t of row b, the first position first[t] of the document that holds it; the query sees
// keys first[t]..t only. Each row is a run of whole documents, so first[] is nondecreasing along
// a row, first[t] <= t, and first[t] is first[t-1] or t (check_document_starts). nullptr: one
// document per row, first[t] = 0 (plain causal attention).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/gradient_ref.h"

namespace fp8lm {

// Throws (naming `what` and the first bad position) unless document_starts [B,T] (host memory)
// describes rows of whole documents: first[t] is first[t-1] or t, and first[0] = 0.
void check_document_starts(const int32_t* document_starts, int B, int T, const char* what);

}  // namespace fp8lm

namespace fp8lm::cpu {

// out [B,T,C] (heads concatenated), lse [B,NH,T], qkv [B,T,3C], document_starts [B,T] (nullable).
void attention_forward(float* out, float* lse, const float* qkv, const int32_t* document_starts, int B, int T, int C,
                       int NH);

// Writes (=) dqkv [B,T,3C] from dout [B,T,C], the forward's qkv, out and lse.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        const int32_t* document_starts, int B, int T, int C, int NH);

}  // namespace fp8lm::cpu

// ---- GPU (layers/attention.cu) -------------------------------------------------------
// Causal flash attention on the tensor cores (wgmma at head size 64 on Hopper, mma.sync
// otherwise; bit-identical outputs): BF16 in/out, FP32 accumulation and
// softmax statistics, O(T) memory (no T x T matrix in global memory). Head sizes
// HS = C/NH of 32, 64 and 128 (others throw RuntimeError with a HINT). Scale 1/sqrt(HS).
// Requirements, checked on the host (FP8LM_CHECK): qkv, and in backward dout and out,
// 16-byte aligned; other bf16/float pointers 4-byte aligned, out_fp8 2-byte aligned
// (cudaMalloc and 16-byte-aligned slab offsets give all of it).
namespace fp8lm::cuda {

// out [B,T,C] (=, bf16, heads concatenated), lse [B,NH,T] (=, natural log, FP32),
// qkv [B,T,3C].
// out_fp8 [B,T,C] (nullable): also writes fp8(bf16(out) * *out_scale) (RNE, saturating,
//   out_dtype), exactly the codes a cast of the returned bf16 `out` gives.
// out_amax (nullable): running max (atomicMax on the float's bits) of |bf16(out)|; a NaN
//   makes it 0x7fc00000. Updated whenever it is given, with or without out_fp8.
// out_scale (nullable): device pointer; nullptr means 1.
// document_starts [B,T] (nullable, device memory): each query's document start (above); its
// invariants are the caller's to hold (check_document_starts on the host).
void attention_forward(__nv_bfloat16* out, float* lse, uint8_t* out_fp8, float* out_amax, const float* out_scale,
                       Fp8Dtype out_dtype, const __nv_bfloat16* qkv, const int32_t* document_starts, int B, int T,
                       int C, int NH, cudaStream_t stream);

// FP32 scratch that attention_backward needs (D = rowsum(dout * out), [B,NH,T]).
size_t attention_backward_scratch_floats(int B, int T, int C, int NH);

// Writes (=) dqkv [B,T,3C] (bf16) from dout [B,T,C], the forward's qkv [B,T,3C], out [B,T,C],
// lse [B,NH,T] and document_starts [B,T] (nullable). scratch:
// attention_backward_scratch_floats(B,T,C,NH) floats (contents need not be initialised).
// Deterministic: no atomics, every element written by one thread in a fixed order, so two
// calls give bit-identical dqkv. dqkv must not alias the inputs.
void attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                        const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B, int T,
                        int C, int NH, float* scratch, cudaStream_t stream);

// c_attn's output-gradient operand, written by the backward in place of dqkv: exactly what
// cast_transpose_fp8(codes, codes_t, dbias, amax, dqkv, scale, dtype, B*T, 3C) (core/cast_cuda.h)
// writes from the BF16 dqkv that attention_backward would have written, bit for bit:
//   codes [B*T,3C] = fp8(bf16(dqkv) * *scale) (RNE, saturating), codes_t [3C,B*T] its transpose,
//   *amax raised to max |bf16(dqkv)| (nullable), dbias [3C] += its column sums (nullable),
//   summed in the cast's order.
struct DqkvOperand {
  uint8_t* codes = nullptr;
  uint8_t* codes_t = nullptr;
  GradientRef dbias;
  float* amax = nullptr;
  const float* scale = nullptr;
  Fp8Dtype dtype = Fp8Dtype::e5m2;
};

// Whether attention_backward_operand runs at this shape on this GPU: head size 64 on Hopper
// (the wgmma kernels write the operand in their epilogues) and T a multiple of 64 (so that
// their tiles are the cast's).
bool attention_backward_writes_operand(int B, int T, int C, int NH);

// FP32 scratch that attention_backward_operand needs: D, and the bias gradient's per-tile sums.
size_t attention_backward_operand_scratch_floats(int B, int T, int C, int NH);

// attention_backward followed by the cast of its dqkv, without dqkv: see DqkvOperand. codes
// and codes_t 16-byte aligned. Throws where attention_backward_writes_operand is false.
void attention_backward_operand(const DqkvOperand& operand, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B,
                                int T, int C, int NH, float* scratch, cudaStream_t stream);

// The mma.sync kernels at every head size, as GPUs without wgmma run them: for the tests that
// hold the wgmma kernels to them bit for bit. Same contracts as above.
void attention_forward_mma_sync(__nv_bfloat16* out, float* lse, uint8_t* out_fp8, float* out_amax,
                                const float* out_scale, Fp8Dtype out_dtype, const __nv_bfloat16* qkv,
                                const int32_t* document_starts, int B, int T, int C, int NH, cudaStream_t stream);
void attention_backward_mma_sync(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                 const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B,
                                 int T, int C, int NH, float* scratch, cudaStream_t stream);

}  // namespace fp8lm::cuda
