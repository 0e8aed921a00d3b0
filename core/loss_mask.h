// Megatron's loss mask (--eod-mask-loss) as a target value: a position whose target is
// kMaskedTarget takes no part in the loss. Its token loss is 0, its row of the logits'
// gradient is 0, and it is not counted in the mean. The data loader writes it
// (DataLoaderOptions::loss_mask_token); the loss kernels (layers/cross_entropy.h) and the
// engine's normalisation (apps/engine.h) read it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fp8lm {

inline constexpr int32_t kMaskedTarget = -1;

// targets[i] = kMaskedTarget wherever inputs[i] == token: Megatron masks the prediction made
// from an end-of-document token, the first token of the next document.
inline void mask_targets_after_token(int32_t token, const int32_t* inputs, int32_t* targets, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (inputs[i] == token) targets[i] = kMaskedTarget;
}

// The positions that count in the loss: targets [n] that are not kMaskedTarget.
inline int64_t count_unmasked_targets(const int32_t* targets, size_t n) {
  int64_t count = 0;
  for (size_t i = 0; i < n; ++i) count += targets[i] != kMaskedTarget;
  return count;
}

}  // namespace fp8lm
