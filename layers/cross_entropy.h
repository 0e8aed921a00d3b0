// Softmax cross-entropy over the vocabulary, fused with its backward: the full
// probability tensor is never stored, the logits buffer is overwritten with its
// gradient.
//   loss[i]   = logsumexp(logits[i, :V]) - logits[i, target[i]]
//   dlogits[i, v] = (softmax(logits[i, :V])[v] - [v == target[i]]) * dloss,  v < V
//   dlogits[i, v] = 0 for padded columns V <= v < Vp
// The padded columns (vocab rounded up to 128) never take part in the softmax.
#pragma once

#include <cstdint>

namespace fp8lm::cpu {

// logits [N,Vp] (in: logits, out: dlogits when dloss != 0), losses [N], targets [N].
// dloss is the gradient of the objective w.r.t. each token's loss (1/(B*T*accum) for
// a mean); pass 0 for a forward-only pass, which leaves the logits untouched.
void cross_entropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss);

}  // namespace fp8lm::cpu
