// The learning-rate schedule: linear warm-up, then cosine / linear decay to min_lr
// (or a constant max_lr), with Megatron-LM's formulas.
//
// Iteration numbering. `iteration` is the 0-based index of the optimizer step about to
// run (the trainer's loop counter; skipped steps do not advance it). The schedule is
// Megatron's get_lr() evaluated at num_steps = iteration + 1, the number of optimizer
// steps taken once this one is done:
//
//   W = warmup_iters, D = decay_iters, n = iteration + 1, init = warmup_init_lr
//   n <= W (warm-up)     lr = init + (max_lr - init) * n / W   (iteration W-1: max_lr when W is whole)
//   constant style       lr = max_lr                   (for every n > W, as in Megatron)
//   n > D                lr = min_lr
//   otherwise            ratio = (n - W) / (D - W)     (in (0, 1]; iteration D-1 has ratio 1)
//                        cosine: lr = min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi * ratio))
//                        linear: lr = min_lr + (max_lr - min_lr) * (1 - ratio)
//
// Megatron itself evaluates get_lr() before incrementing its step counter, so its first
// step runs at num_steps = 0, i.e. with lr = init_lr (0 by default) during warm-up: a
// step that changes nothing. The shift by one avoids that wasted step; the curve is
// otherwise Megatron's, one step earlier. Consequences: iterations W-1 and D-1 hit
// max_lr and min_lr exactly, and with D = --train-iters the last step runs at min_lr.
// Without warm-up (W = 0) iteration 0 is already one step into the decay. W and D need not be
// whole: --lr-warmup-fraction F makes W = F x D, and a sample-based run (--train-samples) counts
// both in samples, that is in steps of one global batch (apps/run_setup.h).
#pragma once

#include <cstdint>
#include <string_view>

namespace fp8lm {

enum class LrDecayStyle : uint8_t { cosine, linear, constant };

std::string_view to_string(LrDecayStyle style);  // "cosine", "linear", "constant"

struct LrSchedule {
  double max_lr = 6e-4;        // --lr
  double min_lr = 0.0;         // --min-lr
  double warmup_iters = 0.0;   // --lr-warmup-iters, or --lr-warmup-fraction x decay_iters
  double warmup_init_lr = 0.0; // --lr-warmup-init
  double decay_iters = 0.0;    // --lr-decay-iters, or --lr-decay-samples / the global batch (>= warmup_iters unless constant)
  LrDecayStyle style = LrDecayStyle::linear;  // --lr-decay-style (Megatron's default)
};

// Throws InputError, naming the flag, when the schedule is inconsistent:
// min_lr < 0, max_lr < min_lr, warmup_init_lr outside [0, max_lr], warmup_iters < 0, or
// decay_iters < warmup_iters
// (cosine / linear only; a constant schedule never reads decay_iters).
void validate_lr_schedule(const LrSchedule& schedule);

// The learning rate of optimizer step `iteration` (0-based, see above). Validates the
// schedule; iteration must be >= 0.
double learning_rate(int64_t iteration, const LrSchedule& schedule);

}  // namespace fp8lm
