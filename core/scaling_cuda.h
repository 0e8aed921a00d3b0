// The delayed-scaling update on the GPU: the device twin of ScalingTable::update() and
// ScalingTable::discard_current_amaxes() (core/scaling.h), over the table's three
// contiguous device arrays, with no host sync. Asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "core/scaling.h"

namespace fp8lm::cuda {

// One update of every state s < S (one block per state), exactly as ScalingTable::update():
//   amax          = window amax of history[0..L), s] (max with NaN propagating, or
//                   history[0, s] for most_recent)
//   scale[s]      = compute_scale(amax, format_max[s], margin, scale[s])
//   scale_inv[s]  = 1 / scale[s]
//   history[:, s] rolled: new[i] = old[i+1], new[L-1] = old[0], then new[0] = 0.
// history [L,S] (row 0: this step's amaxes), scale [S], format_max [S] (fp8_max of each state's dtype),
// scale_inv [S * scale_inv_stride] (state s at s * scale_inv_stride: the CUDA backend keeps
// each 16 bytes apart, as cuBLASLt wants its scale pointers aligned).
// The caller decides when to update (delayed recipe, interval boundaries), as update() does.
void update_delayed_scales(float* history, float* scale, float* scale_inv, const float* format_max, int S, int L,
                           AmaxComputeAlgo algo, int margin, cudaStream_t stream, const int* skip = nullptr,
                           int scale_inv_stride = 1);

// history[0, s] = 0 for every state s < S (a skipped step leaves no amaxes behind).
void discard_current_amaxes(float* history, int S, int L, cudaStream_t stream, const int* only_if = nullptr);

// Current (tensorwise) scaling: the scale of one quantization comes from the amax of the
// very tensor being quantized. Used by the tensorwise recipe, and by the delayed recipe
// until its first update (a fresh run or one started from a BF16 checkpoint), so step 0
// never quantizes with scale 1. Per tensor: zero a temporary amax, amax_of() it
// (core/cast_cuda.h), then the function below, then cast with the new scale.
//   scale = compute_scale(*tensor_amax, fp8_max, margin, *scale); scale_inv = 1/scale;
//   and, when history_slot is given, *history_slot = max(*history_slot, *tensor_amax)
//   (recorded for the delayed window exactly as a fused producer records it). One thread.
void current_scale_and_record(float* scale, float* scale_inv, float* history_slot, const float* tensor_amax,
                              float fp8_max, int margin, cudaStream_t stream);

}  // namespace fp8lm::cuda
