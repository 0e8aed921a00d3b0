// Kernels of core/scaling_cuda.h. No spdlog here (nvcc, C++20).
#include "core/scaling_cuda.h"

#include "core/check_cuda.h"
#include "core/error.h"
#include "core/launch.cuh"

namespace fp8lm::cuda {
namespace {

constexpr int kThreads = 256;

// One block per state; the state's window is a column of the [L, S] history (stride S).
// The window is staged in shared memory so the roll can be done in place after every
// thread has read it.
__global__ void __launch_bounds__(kThreads)
    update_delayed_scales_kernel(float* __restrict__ history, float* __restrict__ scale,
                                 float* __restrict__ scale_inv, const float* __restrict__ format_max, int S, int L,
                                 AmaxComputeAlgo algo, int margin, const int* __restrict__ skip, int scale_inv_stride) {
  device::start_after_previous_kernel();
  extern __shared__ float window[];  // [L]
  if (skip != nullptr && *skip) {  // a skipped step: forget its amaxes, keep every scale
    if (threadIdx.x == 0) history[blockIdx.x] = 0.0f;
    return;
  }
  __shared__ float warp_max[kThreads / 32];
  float* h = history + blockIdx.x;  // slot i at h[i * S]

  // window_amax(): max over the window starting from 0, any NaN wins (as torch.max).
  // fmaxf differs from std::max only in the sign of a zero result, which compute_scale
  // does not see (0 and -0 both keep the previous scale).
  float local = 0.0f;
  int saw_nan = 0;
  for (int i = threadIdx.x; i < L; i += blockDim.x) {
    const float v = h[static_cast<size_t>(i) * S];
    window[i] = v;
    if (isnan(v)) saw_nan = 1;
    local = fmaxf(local, v);
  }
  saw_nan = __syncthreads_or(saw_nan);  // also makes window[] complete for everyone
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) local = fmaxf(local, __shfl_xor_sync(0xFFFFFFFFu, local, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();

  if (threadIdx.x == 0) {
    float amax;
    if (algo == AmaxComputeAlgo::most_recent) {
      amax = window[0];
    } else if (saw_nan) {
      amax = __int_as_float(0x7FC00000);
    } else {
      amax = 0.0f;
      for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) amax = fmaxf(amax, warp_max[w]);
    }
    const float s = compute_scale(amax, format_max[blockIdx.x], margin, scale[blockIdx.x]);
    scale[blockIdx.x] = s;
    scale_inv[static_cast<size_t>(blockIdx.x) * scale_inv_stride] = 1.0f / s;
  }

  // roll_history(): new[i] = old[i+1], new[L-1] = old[0], then new[0] = 0.
  for (int i = threadIdx.x; i < L; i += blockDim.x) {
    h[static_cast<size_t>(i) * S] = i == 0 ? 0.0f : (i == L - 1 ? window[0] : window[i + 1]);
  }
}

__global__ void discard_current_amaxes_kernel(float* history, int S, int L, const int* only_if) {
  device::start_after_previous_kernel();
  if (only_if != nullptr && !*only_if) return;
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < S) history[s] = 0.0f;  // row 0 of [L, S]
}

__global__ void current_scale_and_record_kernel(float* scale, float* scale_inv, float* history_slot,
                                                const float* tensor_amax, float fp8_max, int margin) {
  device::start_after_previous_kernel();
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

void update_delayed_scales(float* history, float* scale, float* scale_inv, const float* format_max, int S, int L,
                           AmaxComputeAlgo algo, int margin, cudaStream_t stream, const int* skip, int scale_inv_stride) {
  FP8LM_CHECK(S >= 0 && L >= 1, "update_delayed_scales: S=", S, " L=", L);
  FP8LM_CHECK(scale_inv_stride >= 1, "update_delayed_scales: scale_inv_stride ", scale_inv_stride);
  FP8LM_CHECK(margin >= 0 && margin <= kMaxFp8Margin, "update_delayed_scales: margin ", margin);
  if (S == 0) return;
  FP8LM_CHECK(history && scale && scale_inv && format_max, "update_delayed_scales needs every array");
  const size_t smem = static_cast<size_t>(L) * sizeof(float);
  if (smem > 48 * 1024) {  // above the default limit: opt in, up to the device's maximum
    int device = 0, optin = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (smem + 64 * sizeof(float) > static_cast<size_t>(optin))
      throw InputError("--fp8-amax-history-len " + std::to_string(L) + " is too long for the GPU scale update (at most " +
                       std::to_string(optin / sizeof(float) - 64) + ")");
    CUDA_CHECK(cudaFuncSetAttribute(update_delayed_scales_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  }
  launch_kernel(update_delayed_scales_kernel, S, kThreads, smem, stream, history, scale, scale_inv, format_max, S, L,
                algo, margin, skip, scale_inv_stride);
}

void discard_current_amaxes(float* history, int S, int L, cudaStream_t stream, const int* only_if) {
  FP8LM_CHECK(S >= 0 && L >= 1, "discard_current_amaxes: S=", S, " L=", L);
  if (S == 0) return;
  FP8LM_CHECK(history != nullptr, "discard_current_amaxes needs history");
  launch_kernel(discard_current_amaxes_kernel, (S + kThreads - 1) / kThreads, kThreads, 0, stream, history, S, L,
                only_if);
}

void current_scale_and_record(float* scale, float* scale_inv, float* history_slot, const float* tensor_amax,
                              float fp8_max, int margin, cudaStream_t stream) {
  launch_kernel(current_scale_and_record_kernel, 1, 1, 0, stream, scale, scale_inv, history_slot, tensor_amax, fp8_max,
                margin);
}

}  // namespace fp8lm::cuda
