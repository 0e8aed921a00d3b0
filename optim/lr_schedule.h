// The learning-rate schedule: linear warm-up, then cosine / linear / inverse-square-root decay
// to min_lr, warm-up-stable-decay (WSD), or a constant max_lr; and the weight-decay schedule.
// Both with Megatron-LM's formulas (megatron/core/optimizer_param_scheduler.py).
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
//   inverse-square-root  lr = max(min_lr, max_lr * sqrt(max(W, 1 sample) / n))   (for W < n <= D)
//   WSD                  S = D - wsd_decay_iters (the anneal's start)
//                        n <= S: lr = max_lr; otherwise r = (n - S) / wsd_decay_iters and
//                        lr = min_lr + (max_lr - min_lr) * c(r), c by --lr-wsd-decay-style:
//                        exponential 2 * 0.5^r - 1, linear 1 - r, cosine 0.5 * (1 + cos(pi * r)),
//                        minus_sqrt 1 - sqrt(r)
//
// Megatron itself evaluates get_lr() before incrementing its step counter, so its first
// step runs at num_steps = 0, i.e. with lr = init_lr (0 by default) during warm-up: a
// step that changes nothing. The shift by one avoids that wasted step; the curve is
// otherwise Megatron's, one step earlier. Consequences: iterations W-1 and D-1 hit
// max_lr and min_lr exactly, and with D = --train-iters the last step runs at min_lr.
// Without warm-up (W = 0) iteration 0 is already one step into the decay. W and D need not be
// whole: --lr-warmup-fraction F makes W = F x D, and a sample-based run (--train-samples) counts
// both in samples, that is in steps of one global batch (apps/run_setup.h). The only bound that
// does not scale with the unit is the inverse square root's clamp of W to one sample, which
// `samples_per_iter` (the global batch) places in steps.
//
// Weight decay (Megatron's get_wd, at the same n): with --weight-decay-incr-style constant it is
// --weight-decay throughout; linear and cosine move it from --start-weight-decay to
// --end-weight-decay over I = incr_iters steps (the run's length): for n > I, end; otherwise
// r = n / I and wd = start + (end - start) * c, c = r (linear) or 0.5 * (1 + cos(pi * (1 - r)))
// (cosine).
#pragma once

#include <cstdint>
#include <string_view>

namespace fp8lm {

enum class LrDecayStyle : uint8_t { cosine, linear, constant, inverse_square_root, wsd };
// The anneal of a WSD schedule (--lr-wsd-decay-style; Megatron's default exponential).
enum class WsdDecayStyle : uint8_t { exponential, linear, cosine, minus_sqrt };
enum class WeightDecayIncrStyle : uint8_t { constant, linear, cosine };  // --weight-decay-incr-style

// Megatron's spellings: "cosine", "linear", "constant", "inverse-square-root", "WSD"; "exponential",
// "linear", "cosine", "minus_sqrt"; "constant", "linear", "cosine".
std::string_view to_string(LrDecayStyle style);
std::string_view to_string(WsdDecayStyle style);
std::string_view to_string(WeightDecayIncrStyle style);

struct LrSchedule {
  double max_lr = 6e-4;        // --lr
  double min_lr = 0.0;         // --min-lr
  double warmup_iters = 0.0;   // --lr-warmup-iters, or --lr-warmup-fraction x decay_iters
  double warmup_init_lr = 0.0; // --lr-warmup-init
  double decay_iters = 0.0;    // --lr-decay-iters, or --lr-decay-samples / the global batch (>= warmup_iters unless constant)
  LrDecayStyle style = LrDecayStyle::linear;  // --lr-decay-style (Megatron's default)
  double wsd_decay_iters = 0.0;  // WSD: --lr-wsd-decay-iters, or --lr-wsd-decay-samples / the global batch
  WsdDecayStyle wsd_style = WsdDecayStyle::exponential;  // --lr-wsd-decay-style
  double samples_per_iter = 1.0;  // the global batch: Megatron counts the schedule in samples
};

struct WeightDecaySchedule {
  double start = 0.01;  // --start-weight-decay (constant: --weight-decay)
  double end = 0.01;    // --end-weight-decay (constant: --weight-decay)
  double incr_iters = 0.0;  // the run's optimizer steps: --train-iters, or --train-samples / the global batch
  WeightDecayIncrStyle style = WeightDecayIncrStyle::constant;
};

// Throws InputError, naming the flag, when the schedule is inconsistent:
// min_lr < 0, max_lr < min_lr, warmup_init_lr outside [0, max_lr], warmup_iters < 0, or
// decay_iters < warmup_iters (every style but constant, which never reads decay_iters), a
// negative wsd_decay_iters (WSD), samples_per_iter < 1.
void validate_lr_schedule(const LrSchedule& schedule);

// The learning rate of optimizer step `iteration` (0-based, see above). Validates the
// schedule; iteration must be >= 0.
double learning_rate(int64_t iteration, const LrSchedule& schedule);
// The same at n = `steps` (> 0), a step count that need not be whole: a ramped global batch's
// step ends at its sequences consumed over the final global batch (optim/batch_rampup.h).
double learning_rate_after(double steps, const LrSchedule& schedule);

// Throws InputError, naming the flag: start < 0, end < start, a constant style whose start and
// end differ, incr_iters < 0.
void validate_weight_decay_schedule(const WeightDecaySchedule& schedule);

// The weight decay of optimizer step `iteration` (0-based, as learning_rate).
double weight_decay(int64_t iteration, const WeightDecaySchedule& schedule);
double weight_decay_after(double steps, const WeightDecaySchedule& schedule);  // as learning_rate_after

}  // namespace fp8lm
