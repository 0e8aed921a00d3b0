// The per-step decision of the training step: the gradient norm, the clip coefficient,
// whether the step is skipped (non-finite loss or gradient) and AdamW's step count t.
// It lives in backend memory (device memory on the GPU) so that a step needs no host
// sync: finalize_step writes it, the AdamW passes and the scale update read it, and the
// host copies it back only when it logs. decide_step() is the one rule, run by the CPU
// backend directly and by the CUDA backend's one-thread kernel (optim/grad_clip.cu).
#pragma once

#include <cmath>

#include "core/fp8.h"  // FP8LM_HOST_DEVICE
#include "optim/grad_clip.h"

namespace fp8lm {

// Plain data: the host may copy it in both directions (checkpoints, logging).
struct StepControl {
  float loss = 0.0f;           // loss_sum / loss_divisor of the last finalized step
  float grad_norm = 0.0f;      // global L2 gradient norm (before clipping), rounded to float
  float grad_scale = 1.0f;     // clip coefficient for AdamW (1 = no clipping)
  int skip = 0;                // 1: non-finite loss or norm, the optimizer must not update
  int consecutive_skips = 0;   // skipped steps in a row (0 after an applied step)
  int total_skips = 0;         // skipped steps since the start (or the restored value)
  long long step_count = 0;    // AdamW t: applied steps so far (t of the step just finalized)
};

//   grad_norm  = sqrt(sum_of_squares)                (double, stored as float)
//   loss       = loss_sum / loss_divisor
//   skip       = !isfinite(loss) || !isfinite(grad_norm)
//   grad_scale = clip_coefficient(grad_norm, max_grad_norm)
//   skip:  consecutive_skips += 1, total_skips += 1, step_count unchanged
//   else:  consecutive_skips = 0, step_count += 1 (the t the AdamW passes then use)
FP8LM_HOST_DEVICE inline void decide_step(StepControl& control, double sum_of_squares, float loss_sum,
                                          float loss_divisor, double max_grad_norm) {
  const double norm = sqrt(sum_of_squares);
  const float loss = loss_sum / loss_divisor;
  const bool skip = !is_finite(loss) || !is_finite(norm);
  control.loss = loss;
  control.grad_norm = static_cast<float>(norm);
  control.grad_scale = clip_coefficient(norm, max_grad_norm);
  control.skip = skip ? 1 : 0;
  if (skip) {
    control.consecutive_skips += 1;
    control.total_skips += 1;
  } else {
    control.consecutive_skips = 0;
    control.step_count += 1;
  }
}

}  // namespace fp8lm
