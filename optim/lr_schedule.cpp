#include "optim/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace fp8lm {

std::string_view to_string(LrDecayStyle style) {
  switch (style) {
    case LrDecayStyle::cosine: return "cosine";
    case LrDecayStyle::linear: return "linear";
    case LrDecayStyle::constant: return "constant";
  }
  return "?";
}

void validate_lr_schedule(const LrSchedule& schedule) {
  FP8LM_INPUT_CHECK(schedule.min_lr >= 0.0, "--min-lr must be >= 0, got ", schedule.min_lr);
  FP8LM_INPUT_CHECK(schedule.max_lr >= schedule.min_lr, "--lr (", schedule.max_lr,
                    ") must be >= --min-lr (", schedule.min_lr, ")");
  FP8LM_INPUT_CHECK(schedule.warmup_init_lr >= 0.0 && schedule.warmup_init_lr <= schedule.max_lr,
                    "--lr-warmup-init (", schedule.warmup_init_lr, ") must be in [0, --lr (", schedule.max_lr, ")]");
  FP8LM_INPUT_CHECK(schedule.warmup_iters >= 0.0, "--lr-warmup-iters must be >= 0, got ",
                    schedule.warmup_iters);
  if (schedule.style != LrDecayStyle::constant) {
    FP8LM_INPUT_CHECK(schedule.decay_iters >= schedule.warmup_iters, "--lr-decay-iters (",
                      schedule.decay_iters, ") must be >= --lr-warmup-iters (", schedule.warmup_iters,
                      ")");
  }
}

double learning_rate(int64_t iteration, const LrSchedule& schedule) {
  validate_lr_schedule(schedule);
  FP8LM_CHECK(iteration >= 0, "iteration=", iteration);
  const double n = static_cast<double>(iteration + 1);  // optimizer steps taken once this one is done
  const double warmup = schedule.warmup_iters;
  const double decay = schedule.decay_iters;

  if (warmup > 0.0 && n <= warmup)
    return schedule.warmup_init_lr + (schedule.max_lr - schedule.warmup_init_lr) * n / warmup;
  if (schedule.style == LrDecayStyle::constant) return schedule.max_lr;
  if (n > decay) return schedule.min_lr;  // also covers decay == warmup: no decay phase

  // Here warmup < n <= decay, so decay - warmup > 0.
  const double ratio = (n - warmup) / (decay - warmup);
  const double coeff = schedule.style == LrDecayStyle::cosine
                           ? 0.5 * (1.0 + std::cos(std::numbers::pi * ratio))
                           : 1.0 - ratio;
  return schedule.min_lr + coeff * (schedule.max_lr - schedule.min_lr);
}

}  // namespace fp8lm
