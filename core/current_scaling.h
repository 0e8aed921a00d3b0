// Current (tensorwise) scaling on the GPU: the scale of one quantization comes from
// the amax of the very tensor being quantized. Used by the tensorwise recipe, and by
// the delayed recipe until its first update (a fresh run or one started from a BF16
// checkpoint), so step 0 never quantizes with scale 1.
//
// The sequence per tensor: zero a temporary amax, amax_of() it (core/cast.h), then
// current_scale_and_record() below, then cast with the new scale.
#pragma once

#include <cuda_runtime.h>

namespace fp8lm::cuda {

// scale = compute_scale(*tensor_amax, fp8_max, margin, *scale); scale_inv = 1/scale;
// and, when history_slot is given, *history_slot = max(*history_slot, *tensor_amax)
// (the amax is recorded for the delayed recipe's window exactly as a fused producer
// records it). One thread; no host sync.
void current_scale_and_record(float* scale, float* scale_inv, float* history_slot, const float* tensor_amax,
                              float fp8_max, int margin, cudaStream_t stream);

}  // namespace fp8lm::cuda
