// Softmax cross-entropy over the vocabulary, fused with its backward: the full
// probability tensor is never stored, the logits buffer is overwritten with its
// gradient.
//   loss[i]   = logsumexp(logits[i, :V]) - logits[i, target[i]]
//   dlogits[i, v] = (softmax(logits[i, :V])[v] - [v == target[i]]) * dloss,  v < V
//   dlogits[i, v] = 0 for padded columns V <= v < Vp
// The padded columns (vocab rounded up to 128) never take part in the softmax.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace fp8lm::cpu {

// logits [N,Vp] (in: logits, out: dlogits when dloss != 0), losses [N], targets [N].
// dloss is the gradient of the objective w.r.t. each token's loss (1/(B*T*accum) for
// a mean); pass 0 for a forward-only pass, which leaves the logits untouched.
void cross_entropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss);

}  // namespace fp8lm::cpu

// ---- GPU (layers/cross_entropy.cu) ---------------------------------------------------
namespace fp8lm::cuda {

// One block per row, two passes over the row (16-byte loads): an online-softmax max/sum,
// then (when dloss != 0) dlogits written in place as bf16. The probabilities are never
// stored.
//   logits [N,Vp] (in: bf16 logits; out: bf16 dlogits when dloss != 0, padded columns
//                  V..Vp-1 set to 0; untouched when dloss == 0)
//   losses [N]    (written) logsumexp(logits[i,:V]) - logits[i,target[i]], FP32
//   targets [N]   (device) in [0, V); a target outside it makes that row's loss NaN (and
//                 its dlogits the softmax without the one-hot), so bad data shows in the loss.
// Requirements (FP8LM_CHECK before launch): 0 < V <= Vp, Vp % 8 == 0, logits 16-byte aligned.
void cross_entropy_forward_backward(__nv_bfloat16* logits, float* losses, const int32_t* targets, int N, int V,
                                    int Vp, float dloss, cudaStream_t stream);

// *total += sum(losses [N]) in a fixed order (one block; deterministic). total is a device
// pointer (the step's loss accumulates on the device across micro-batches).
void sum_losses(float* total, const float* losses, int N, cudaStream_t stream);

}  // namespace fp8lm::cuda
