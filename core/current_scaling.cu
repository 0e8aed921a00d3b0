#include "core/current_scaling.h"

#include "core/cuda_check.h"
#include "core/scaling.h"

namespace fp8lm::cuda {

namespace {

__global__ void current_scale_and_record_kernel(float* scale, float* scale_inv, float* history_slot,
                                                const float* tensor_amax, float fp8_max, int margin) {
  const float amax = *tensor_amax;
  const float new_scale = compute_scale(amax, fp8_max, margin, *scale);
  *scale = new_scale;
  *scale_inv = 1.0f / new_scale;
  if (history_slot != nullptr) {
    const float recorded = *history_slot;
    // NaN must stay visible to the update rule, as in ScalingTable::record_amax.
    if (!(amax <= recorded)) *history_slot = amax;
  }
}

}  // namespace

void current_scale_and_record(float* scale, float* scale_inv, float* history_slot, const float* tensor_amax,
                              float fp8_max, int margin, cudaStream_t stream) {
  current_scale_and_record_kernel<<<1, 1, 0, stream>>>(scale, scale_inv, history_slot, tensor_amax, fp8_max, margin);
  CUDA_CHECK_LAUNCH();
}

}  // namespace fp8lm::cuda
