#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace fp8lm {

std::string_view to_string(LrDecayStyle style) {
  switch (style) {
    case LrDecayStyle::cosine: return "cosine";
    case LrDecayStyle::linear: return "linear";
    case LrDecayStyle::constant: return "constant";
    case LrDecayStyle::inverse_square_root: return "inverse-square-root";
    case LrDecayStyle::wsd: return "WSD";
  }
  return "?";
}

std::string_view to_string(WsdDecayStyle style) {
  switch (style) {
    case WsdDecayStyle::exponential: return "exponential";
    case WsdDecayStyle::linear: return "linear";
    case WsdDecayStyle::cosine: return "cosine";
    case WsdDecayStyle::minus_sqrt: return "minus_sqrt";
  }
  return "?";
}

std::string_view to_string(WeightDecayIncrStyle style) {
  switch (style) {
    case WeightDecayIncrStyle::constant: return "constant";
    case WeightDecayIncrStyle::linear: return "linear";
    case WeightDecayIncrStyle::cosine: return "cosine";
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
  FP8LM_INPUT_CHECK(schedule.style != LrDecayStyle::wsd || schedule.wsd_decay_iters >= 0.0,
                    "--lr-wsd-decay-iters must be >= 0, got ", schedule.wsd_decay_iters);
  FP8LM_CHECK(schedule.samples_per_iter >= 1.0, "samples_per_iter=", schedule.samples_per_iter);
}

double learning_rate(int64_t iteration, const LrSchedule& schedule) {
  FP8LM_CHECK(iteration >= 0, "iteration=", iteration);
  return learning_rate_after(static_cast<double>(iteration + 1), schedule);  // steps taken once this one is done
}

double learning_rate_after(double n, const LrSchedule& schedule) {
  validate_lr_schedule(schedule);
  FP8LM_CHECK(n > 0.0, "steps=", n);
  const double warmup = schedule.warmup_iters;
  const double decay = schedule.decay_iters;

  if (warmup > 0.0 && n <= warmup)
    return schedule.warmup_init_lr + (schedule.max_lr - schedule.warmup_init_lr) * n / warmup;
  if (schedule.style == LrDecayStyle::constant) return schedule.max_lr;
  if (n > decay) return schedule.min_lr;  // also covers decay == warmup: no decay phase

  // Here warmup < n <= decay.
  if (schedule.style == LrDecayStyle::inverse_square_root) {
    // Megatron clamps its warm-up to one sample (max(W, 1) in samples), not one step.
    const double clamped_warmup = std::max(warmup, 1.0 / schedule.samples_per_iter);
    return std::max(schedule.min_lr, schedule.max_lr * std::sqrt(clamped_warmup / n));
  }
  double coeff = 1.0;
  if (schedule.style == LrDecayStyle::wsd) {
    const double anneal_start = decay - schedule.wsd_decay_iters;
    if (n > anneal_start) {  // so wsd_decay_iters > 0
      const double ratio = (n - anneal_start) / schedule.wsd_decay_iters;
      switch (schedule.wsd_style) {
        case WsdDecayStyle::exponential: coeff = 2.0 * std::pow(0.5, ratio) - 1.0; break;
        case WsdDecayStyle::linear: coeff = 1.0 - ratio; break;
        case WsdDecayStyle::cosine: coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)); break;
        case WsdDecayStyle::minus_sqrt: coeff = 1.0 - std::sqrt(ratio); break;
      }
    }
  } else {
    // decay - warmup > 0 here
    const double ratio = (n - warmup) / (decay - warmup);
    coeff = schedule.style == LrDecayStyle::cosine ? 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) : 1.0 - ratio;
  }
  return schedule.min_lr + coeff * (schedule.max_lr - schedule.min_lr);
}

void validate_weight_decay_schedule(const WeightDecaySchedule& schedule) {
  FP8LM_INPUT_CHECK(schedule.start >= 0.0, "--start-weight-decay must be >= 0, got ", schedule.start);
  FP8LM_INPUT_CHECK(schedule.end >= schedule.start, "--end-weight-decay (", schedule.end,
                    ") must be >= --start-weight-decay (", schedule.start, "), as Megatron asserts");
  FP8LM_INPUT_CHECK(schedule.style != WeightDecayIncrStyle::constant || schedule.start == schedule.end,
                    "--weight-decay-incr-style constant keeps one weight decay (--weight-decay), got ", schedule.start,
                    " and ", schedule.end);
  FP8LM_CHECK(schedule.incr_iters >= 0.0, "incr_iters=", schedule.incr_iters);
}

double weight_decay(int64_t iteration, const WeightDecaySchedule& schedule) {
  FP8LM_CHECK(iteration >= 0, "iteration=", iteration);
  return weight_decay_after(static_cast<double>(iteration + 1), schedule);
}

double weight_decay_after(double n, const WeightDecaySchedule& schedule) {
  validate_weight_decay_schedule(schedule);
  FP8LM_CHECK(n > 0.0, "steps=", n);
  if (schedule.style == WeightDecayIncrStyle::constant || n > schedule.incr_iters) return schedule.end;
  const double ratio = n / schedule.incr_iters;
  const double coeff = schedule.style == WeightDecayIncrStyle::linear
                           ? ratio
                           : 0.5 * (std::cos(std::numbers::pi * (1.0 - ratio)) + 1.0);
  return schedule.start + coeff * (schedule.end - schedule.start);
}

}  // namespace fp8lm
