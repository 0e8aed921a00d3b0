// Token + learned position embedding (GPT-2's "encoder").
//   out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
// BF16 on the GPU; FP32 here.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace fp8lm::cpu {

// out [B,T,C], tokens [B,T], wte [Vp,C], wpe [maxT,C]
void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C);

// Accumulates (+=) into dwte [Vp,C] and dwpe [maxT,C] from dout [B,T,C].
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C);

}  // namespace fp8lm::cpu

// ---- GPU (layers/encoder.cu) ---------------------------------------------------------
// Requirements, checked on the host before launch (FP8LM_CHECK): C % 8 == 0; bf16
// pointers 16-byte aligned, FP32 gradients 16-byte aligned. Token ids are not checked on
// the device: they must lie in [0, Vp) (the data loader's job).
namespace fp8lm::cuda {

// out [B,T,C] = bf16(float(wte[tokens[b,t]]) + float(wpe[t])); tokens [B,T] (device),
// wte [Vp,C], wpe [maxT,C] (T <= maxT).
void encoder_forward(__nv_bfloat16* out, const int32_t* tokens, const __nv_bfloat16* wte, const __nv_bfloat16* wpe,
                     int B, int T, int C, cudaStream_t stream);

// Deterministic backward, from the bucket index of layers/encoder_index.h (built on the
// host from the micro-batch's tokens and uploaded with them; all arrays on the device):
//   dwte [Vp,C] += for each unique token u: the sum of dout rows positions[offsets[u] ..
//                  offsets[u+1]) in that (ascending) order;
//   dwpe [maxT,C] += for t < T: sum over b = 0..B-1 (in order) of dout[b,t,:].
// unique_tokens [num_unique], offsets [num_unique+1], positions [B*T] (flat b*T+t).
// The same order as cpu::encoder_backward, so the result equals it bit for bit.
void encoder_backward(float* dwte, float* dwpe, const __nv_bfloat16* dout, const int32_t* unique_tokens,
                      const int32_t* offsets, const int32_t* positions, int num_unique, int B, int T, int C,
                      cudaStream_t stream);

}  // namespace fp8lm::cuda
