// Token + learned position embedding (GPT-2's "encoder").
//   out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
// BF16 on the GPU; FP32 here.
#pragma once

#include <cstdint>

namespace fp8lm::cpu {

// out [B,T,C], tokens [B,T], wte [Vp,C], wpe [maxT,C]
void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C);

// Accumulates (+=) into dwte [Vp,C] and dwpe [maxT,C] from dout [B,T,C].
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C);

}  // namespace fp8lm::cpu
