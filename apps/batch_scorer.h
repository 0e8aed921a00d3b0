// What evaluation needs from a model: one batch's loss, each row's loss, and the host groups
// over which the batches of data-parallel ranks are summed. The training engine scores its
// periodic evaluations (apps/engine.h); fp8lm eval scores with a forward-only model
// (apps/evaluator.h), which holds no gradients, optimizer state or backward activations. The
// evaluation loops (apps/trainer.cpp: validation_loss, choice_accuracy) take either.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "layers/documents.h"

namespace fp8lm {

class Communicator;
class GptModel;
class Ops;
class ProcessGroups;

// A batch's loss over every data-parallel rank.
struct BatchLoss {
  double sum = 0.0;     // of the token losses (masked targets add 0)
  double tokens = 0.0;  // that count: the unmasked targets
  double mean() const { return sum / std::max(tokens, 1.0); }
};

class BatchScorer {
 public:
  virtual ~BatchScorer() = default;
  // One batch's loss over every data-parallel rank, forward only; touches no training state.
  // inputs/targets [B,T] on the host; targets may be kMaskedTarget (core/loss_mask.h) only in
  // a run that masks them.
  virtual BatchLoss evaluate(const int32_t* inputs, const int32_t* targets) = 0;
  // Each row's loss of one batch [B,T] on this rank, forward only: its token losses' sum and
  // its unmasked targets (multiple-choice scoring, core/choice_eval.h). Waits for the device.
  virtual std::vector<BatchLoss> row_losses(const int32_t* inputs, const int32_t* targets) = 0;
  // The host (MPI) groups of this rank's run.
  virtual const ProcessGroups& host_groups() const = 0;
};

// How a run reads its batches: whether it masks targets (--eod-mask-loss; otherwise a masked
// target is a program error), and its documents (--reset-position-ids, --reset-attention-mask).
struct BatchReading {
  bool loss_mask = false;
  DocumentMasking documents;
};

// The forward pass both scorers run, over a model built to train or to evaluate (layers/gpt.h).
// `device_sum` is one float in the backend's memory, the token losses' sum. score_batch sums
// over `data_parallel` (host memory).
BatchLoss score_batch(Ops& ops, GptModel& model, float* device_sum, Communicator& data_parallel,
                      const BatchReading& reading, const int32_t* inputs, const int32_t* targets);
std::vector<BatchLoss> score_rows(Ops& ops, GptModel& model, float* device_sum, const BatchReading& reading,
                                  const int32_t* inputs, const int32_t* targets);

}  // namespace fp8lm
