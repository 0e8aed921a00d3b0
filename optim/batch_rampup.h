// Megatron-LM's batch-size ramp-up, --rampup-batch-size START INCREMENT SAMPLES
// (megatron/core/num_microbatches_calculator.py): the global batch starts at START sequences and
// grows by INCREMENT at each of (global batch - START) / INCREMENT equal shares of the first
// SAMPLES sequences, then stays at --global-batch-size. A step's batch is a function of the
// sequences consumed before it, so a resumed run (whose data position is saved) continues the
// ramp where it stopped.
//
//   n = (G - START) / INCREMENT increments, s = SAMPLES / n sequences each
//   batch(consumed) = G                                   for consumed > SAMPLES
//                   = START + floor(consumed / s) * INCREMENT  otherwise
//
// As in Megatron a ramped run counts its length in samples (--train-samples): every step of the
// ramp, then whole global batches for what is left (rampup_train_iters).
#pragma once

#include <cstdint>

namespace fp8lm {

struct BatchRampup {
  int64_t start = 0;         // START; 0: no ramp-up
  int64_t increment = 0;     // INCREMENT
  int64_t samples = 0;       // SAMPLES
  int64_t global_batch = 0;  // G, --global-batch-size: the batch after the ramp

  bool enabled() const { return start > 0; }
};

// Throws InputError naming --rampup-batch-size: START, INCREMENT or SAMPLES below 1,
// START above G, G - START not a multiple of INCREMENT, START equal to G (nothing to ramp), or a
// batch of the ramp that is not a whole number of micro-batch steps (`sequences_per_micro_step`,
// --micro-batch-size x the data-parallel size), as Megatron's consistency check asserts.
void validate_batch_rampup(const BatchRampup& rampup, int64_t sequences_per_micro_step);

// The global batch of the step that starts after `consumed_samples` sequences.
int64_t global_batch_at(const BatchRampup& rampup, uint64_t consumed_samples);

// Megatron's update_train_iters with a ramp-up: steps while the sequences consumed are within
// the ramp (and within train_samples), then train_samples' remaining whole global batches.
int64_t rampup_train_iters(const BatchRampup& rampup, int64_t train_samples);

}  // namespace fp8lm
