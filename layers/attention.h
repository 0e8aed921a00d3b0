// Causal multi-head self-attention on a packed QKV tensor, computed as flash
// attention defines it: per row, the softmax's log-sum-exp is kept (O(T) memory), and
// backward recomputes the probabilities from it. No T x T matrix outlives a row here,
// and none is stored in global memory on the GPU.
//
//   qkv [B,T,3C] packs q | k | v; head h uses columns [h*HS, (h+1)*HS) of each, HS = C/NH.
//   S[t,s] = q_t . k_s / sqrt(HS) for s <= t (causal), lse[t] = log(sum_s exp(S[t,s]))
//   P[t,s] = exp(S[t,s] - lse[t]),  out_t = sum_s P[t,s] v_s
// Backward, with D_t = dout_t . out_t:
//   dv_s = sum_t P[t,s] dout_t,  dP[t,s] = dout_t . v_s,  dS = P * (dP - D_t)
//   dq_t = sum_s dS[t,s] k_s / sqrt(HS),  dk_s = sum_t dS[t,s] q_t / sqrt(HS)
// BF16 inputs/outputs with FP32 softmax statistics on the GPU; FP32 here.
#pragma once

namespace fp8lm::cpu {

// out [B,T,C] (heads concatenated), lse [B,NH,T], qkv [B,T,3C]
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH);

// Writes (=) dqkv [B,T,3C] from dout [B,T,C], the forward's qkv, out and lse.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int C, int NH);

}  // namespace fp8lm::cpu
