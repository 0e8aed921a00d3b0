// Softmax cross-entropy over the vocabulary, fused with its backward: the full
// probability tensor is never stored, the logits buffer is overwritten with its
// gradient (or, for an FP8 LM head on the GPU, the gradient's FP8 codes go apart).
//   loss[i]   = logsumexp(logits[i, :V]) - logits[i, target[i]]
//   dlogits[i, v] = (softmax(logits[i, :V])[v] - [v == target[i]]) * dloss,  v < V
//   dlogits[i, v] = 0 for padded columns V <= v < Vp
// The padded columns (vocab rounded up to 128) never take part in the softmax.
// A masked row (target kMaskedTarget, core/loss_mask.h: Megatron's --eod-mask-loss) has
// loss 0 and dlogits (softmax - 0) * 0 = 0: it takes no part in the loss or the gradient.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"

namespace fp8lm::cpu {

// logits [N,Vp] (in: logits, out: dlogits when dloss != 0), losses [N], targets [N] in
// [0, V) or kMaskedTarget.
// dloss is the gradient of the objective w.r.t. each token's loss (1/(B*T*accum) for
// a mean); pass 0 for a forward-only pass, which leaves the logits untouched.
void cross_entropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss);

// ---- vocabulary-parallel cross-entropy -------------------------------------------------
// Under tensor parallelism rank r of R holds the logits of the columns
// [vocab_begin, vocab_begin + Vs) of the padded vocabulary Vp = R * Vs (vocab_begin = r * Vs);
// the real columns are those with global index < V. The loss takes two passes around one
// all-gather (done by the caller) of per-row partial statistics:
//   1. cross_entropy_partials on every rank: max, sum of exp(x - max) and the target's logit
//      over the rank's slice;
//   2. all-gather the partials [N,3] into all_partials [R,N,3] (rank-major);
//   3. cross_entropy_finish on every rank: every rank combines all R partials in rank order
//      (the same bits on every rank), writes the losses and turns its slice into dlogits.
// With R = 1 (vocab_begin 0, Vs = Vp) the losses and dlogits are those of
// cross_entropy_forward_backward, bit for bit.

// partials [N,3]: per row (max m, sum s of exp(x - m), target logit t) over the slice's real
// columns. m = -inf and s = 0 when the slice has no real column; t = 0 when targets[i] is not
// in the slice (or masked). logits [N,Vs] (this rank's slice), targets [N] global ids in [0, V)
// or kMaskedTarget (a target
// outside throws, as in cross_entropy_forward_backward; the GPU gives a NaN loss instead).
// vocab_begin: a multiple of Vs.
void cross_entropy_partials(float* partials, const float* logits, const int32_t* targets, int N, int V, int Vs,
                            int vocab_begin);

// all_partials [R,N,3] (rank-major, every rank's cross_entropy_partials):
//   M = max_r m_r;  S = sum over r in order of (m_r == -inf ? 0 : s_r * exp(m_r - M));
//   (a rank with m_r == M adds s_r as is: the same value for finite M, since exp(0) = 1,
//   and an infinite max gives what the fused kernel gives rather than exp(inf - inf) = NaN)
//   lse = M + log(S);  losses [N] (written) = lse - t_{rank of the target}  (rank = target / Vs)
// dloss != 0: logits [N,Vs] (in place) become dlogits (exp(x - lse) - [global col == target])
// * dloss on real columns, 0 on padded ones; dloss == 0 leaves them untouched.
void cross_entropy_finish(float* logits, float* losses, const float* all_partials, const int32_t* targets, int N,
                          int V, int Vs, int vocab_begin, int R, float dloss);

}  // namespace fp8lm::cpu

// ---- GPU (layers/cross_entropy.cu) ---------------------------------------------------
namespace fp8lm::cuda {

// One block per row, two passes over the row: an online-softmax max/sum, then (when
// dloss != 0) dlogits written in place as bf16. A row of up to 110 KB (GPT-2's vocabulary)
// is first copied into shared memory, so it is read from HBM once; a wider one is read
// twice. The probabilities are never stored.
//   logits [N,Vp] (in: bf16 logits; out: bf16 dlogits when dloss != 0, padded columns
//                  V..Vp-1 set to 0; untouched when dloss == 0)
//   losses [N]    (written) logsumexp(logits[i,:V]) - logits[i,target[i]], FP32
//   targets [N]   (device) in [0, V), or kMaskedTarget: loss 0 and dlogits 0 (a NaN logit
//                 still makes them NaN); another target outside [0, V) makes that row's loss NaN (and
//                 its dlogits the softmax without the one-hot), so bad data shows in the loss.
// Requirements (FP8LM_CHECK before launch): 0 < V <= Vp, Vp % 8 == 0, logits 16-byte aligned.
void cross_entropy_forward_backward(__nv_bfloat16* logits, float* losses, const int32_t* targets, int N, int V,
                                    int Vp, float dloss, cudaStream_t stream);

// The same loss with pass 2 writing FP8 codes instead of BF16 dlogits (dloss != 0; the
// logits are left as they are): codes [N,Vp] = fp8(bf16(dlogit) * *scale) (SATFINITE, padded
// columns code 0) and *amax raised to max |bf16(dlogit)| (a NaN as the quiet NaN), which is
// cast_fp8 of the BF16 dlogits above, bit for bit, with neither written nor read again: the
// FP8 LM head's gradient operand (--fp8-lm-head) under a delayed per-tensor scale.
struct DlogitCodes {
  uint8_t* codes = nullptr;      // [N,Vp], 8-byte aligned
  const float* scale = nullptr;  // [1] device
  float* amax = nullptr;         // [1] device, a running max
  Fp8Dtype dtype = Fp8Dtype::e5m2;
};
void cross_entropy_forward_backward(__nv_bfloat16* logits, float* losses, const int32_t* targets, int N, int V,
                                    int Vp, float dloss, const DlogitCodes& dlogit_codes, cudaStream_t stream);

// Vocabulary-parallel cross-entropy (see the CPU twins above for the math), one block per
// row in each half; pass 1 and the block's combine are the fused kernel's code, so with R = 1
// the losses and dlogits are bit-identical to cross_entropy_forward_backward's.
// Requirements (FP8LM_CHECK before launch): Vs % 8 == 0, Vs > 0, 0 < V, vocab_begin a
// multiple of Vs; for the finish also R >= 1, vocab_begin < R * Vs, V <= R * Vs. logits
// 16-byte aligned. A target outside [0, V) makes its row's loss NaN (its dlogits are the
// softmax without the one-hot), as in the fused kernel.
//   partials [N,3] (written) FP32 (m, s, target logit or 0), logits [N,Vs] bf16 (read only),
//   targets [N] (device) global ids.
void cross_entropy_partials(float* partials, const __nv_bfloat16* logits, const int32_t* targets, int N, int V,
                            int Vs, int vocab_begin, cudaStream_t stream);

//   logits [N,Vs] (in: bf16 logits; out: bf16 dlogits when dloss != 0, padded columns 0;
//                  untouched when dloss == 0), losses [N] (written; the same on every rank),
//   all_partials [R,N,3] rank-major, targets [N] (device) global ids.
void cross_entropy_finish(__nv_bfloat16* logits, float* losses, const float* all_partials, const int32_t* targets,
                          int N, int V, int Vs, int vocab_begin, int R, float dloss, cudaStream_t stream);

// *total += sum(losses [N]) in a fixed order (one block; deterministic). total is a device
// pointer (the step's loss accumulates on the device across micro-batches).
void sum_losses(float* total, const float* losses, int N, cudaStream_t stream);

}  // namespace fp8lm::cuda
