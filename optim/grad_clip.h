// Global gradient-norm clipping (Megatron's --clip-grad).
//
// The trainer computes the L2 norm of all gradients, checks that it is finite (a
// non-finite norm means an overflow somewhere: the step is skipped, see
// --max-skipped-steps), and passes clip_coefficient(norm, max_norm) to AdamW::step as
// its grad_scale, which multiplies every gradient as it is read. The gradients
// themselves are never rescaled in memory.
#pragma once

#include <cmath>
#include <cstddef>

#include "core/fp8.h"  // FP8LM_HOST_DEVICE
#include "core/tensor.h"

namespace fp8lm {

// Sum of squares of every tensor's gradient, in double; padding is skipped.
//   grads [layout.total_elements()]
// Deterministic for any thread count: each tensor is cut into fixed chunks of
// kGradNormChunk elements, each chunk is summed sequentially, and the chunk sums are
// added in layout order. Exposed separately so data/tensor-parallel ranks can add
// their partial sums before the square root. A non-finite gradient makes it non-finite.
inline constexpr size_t kGradNormChunk = 8192;
double grad_sum_of_squares(const float* grads, const TensorLayout& layout);

// sqrt(grad_sum_of_squares(grads, layout)).
double global_grad_norm(const float* grads, const TensorLayout& layout);

// The factor that brings the norm down to max_norm: min(1, max_norm / (norm + 1e-6)),
// as Megatron's clip_grad_norm computes it. Returns 1 (no clipping) when max_norm <= 0
// (clipping disabled) and when norm is not finite: the caller must then skip the step
// rather than apply it, since no factor repairs inf/NaN gradients.
// x - x is 0 for every finite x and NaN for infinities and NaN: the same test on the host
// and on the device, with no library overloads to choose between.
FP8LM_HOST_DEVICE inline bool is_finite(double x) { return x - x == 0.0; }

// One definition for the host and the GPU's step kernel.
FP8LM_HOST_DEVICE inline float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0 || !is_finite(norm)) return 1.0f;
  const double coeff = max_norm / (norm + 1e-6);
  return coeff < 1.0 ? static_cast<float>(coeff) : 1.0f;
}

}  // namespace fp8lm
