// Fused softmax cross-entropy forward + backward (see layers/cross_entropy.h).
//
// One 512-thread block per row. Pass 1: each thread runs an online softmax (running max
// and sum of exp(x - max)) over its 16-byte chunks of the first V columns; the block
// combines the pairs, giving logsumexp. Pass 2 (dloss != 0): each thread re-reads its own
// chunks and overwrites them with (softmax - onehot) * dloss in bf16, zeros in the padded
// columns. A thread only ever writes the chunks it read, and the one cross-thread read
// (the target logit, by thread 0) happens before the block's first barrier, so in place is
// safe.
#include "layers/cross_entropy.h"

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/device_helpers.cuh"
#include "core/cuda_check.h"
#include "core/error.h"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kSumThreads = 1024;

// (m, s) <- the online-softmax union of (m, s) and (m2, s2): max and sum of exp(x - max).
// A side with max -inf holds no elements and contributes nothing (avoids -inf - -inf).
// NaN sums propagate, so a NaN logit makes the loss NaN.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float m_new = fmaxf(m, m2);
  const float a = m == -INFINITY ? 0.0f : s * expf(m - m_new);
  const float b = m2 == -INFINITY ? 0.0f : s2 * expf(m2 - m_new);
  m = m_new;
  s = a + b;
}

__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(bf16* __restrict__ logits, float* __restrict__ losses, const int32_t* __restrict__ targets,
                         int V, int Vp, float dloss) {
  __shared__ float warp_m[kWarps], warp_s[kWarps];
  __shared__ float row_lse;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  bf16* row = logits + static_cast<size_t>(blockIdx.x) * Vp;
  const int chunks = Vp / 8;
  const int target = targets[blockIdx.x];
  const bool target_valid = target >= 0 && target < V;

  // Thread 0 reads the target logit before the first barrier (no thread writes before the last one).
  float target_logit = NAN;
  if (tid == 0 && target_valid) target_logit = __bfloat162float(row[target]);

  // Pass 1: online softmax over this thread's elements v < V.
  float m = -INFINITY, s = 0.0f;
  for (int c = tid; c < chunks; c += kThreads) {
    float x[8];
    load_bf16x8(row + c * 8, x);
#pragma unroll
    for (int j = 0; j < 8; j++) {
      if (c * 8 + j < V) {
        if (x[j] > m) {
          s = s * expf(m - x[j]) + 1.0f;  // m == -inf: s * 0 + 1
          m = x[j];
        } else if (x[j] != -INFINITY) {
          s += expf(x[j] - m);  // NaN x lands here and makes s NaN
        }
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, offset);
    const float s2 = __shfl_xor_sync(kFullMask, s, offset);
    combine(m, s, m2, s2);
  }
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? warp_m[lane] : -INFINITY;
    s = lane < kWarps ? warp_s[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float m2 = __shfl_xor_sync(kFullMask, m, offset);
      const float s2 = __shfl_xor_sync(kFullMask, s, offset);
      combine(m, s, m2, s2);
    }
    if (lane == 0) row_lse = m + logf(s);
  }
  __syncthreads();
  const float lse = row_lse;
  if (tid == 0) losses[blockIdx.x] = target_valid ? lse - target_logit : NAN;

  if (dloss == 0.0f) return;  // forward only: the logits stay as they are

  // Pass 2: dlogits over this thread's own chunks.
  for (int c = tid; c < chunks; c += kThreads) {
    float x[8];
    load_bf16x8(row + c * 8, x);
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int v = c * 8 + j;
      const float probability = expf(x[j] - lse);
      x[j] = v < V ? (probability - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f;
    }
    store_bf16x8(row + c * 8, x);
  }
}

// *total += sum(losses): each thread sums a fixed strided subset in order, then a fixed tree.
__global__ void __launch_bounds__(kSumThreads) sum_losses_kernel(float* total, const float* __restrict__ losses, int N) {
  __shared__ float partial[kSumThreads];
  const int tid = threadIdx.x;
  float sum = 0.0f;
  for (int i = tid; i < N; i += kSumThreads) sum += losses[i];
  partial[tid] = sum;
  __syncthreads();
  for (int stride = kSumThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  if (tid == 0) *total += partial[0];
}

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

}  // namespace

void cross_entropy_forward_backward(bf16* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss, cudaStream_t stream) {
  const char* what = "cross_entropy_forward_backward";
  FP8LM_CHECK(N >= 0, what, ": N must be >= 0, got ", N);
  FP8LM_CHECK(V > 0 && V <= Vp && Vp % 8 == 0, what, ": needs 0 < V <= Vp and Vp % 8 == 0, got V=", V, " Vp=", Vp);
  FP8LM_CHECK(std::isfinite(dloss), what, ": dloss must be finite, got ", dloss);
  if (N == 0) return;
  FP8LM_CHECK(logits != nullptr && losses != nullptr && targets != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(logits, 16), what, ": logits must be 16-byte aligned");
  cross_entropy_kernel<<<N, kThreads, 0, stream>>>(logits, losses, targets, V, Vp, dloss);
  CUDA_CHECK_LAUNCH();
}

void sum_losses(float* total, const float* losses, int N, cudaStream_t stream) {
  FP8LM_CHECK(N >= 0, "sum_losses: N must be >= 0, got ", N);
  FP8LM_CHECK(total != nullptr && (N == 0 || losses != nullptr), "sum_losses: null pointer");
  sum_losses_kernel<<<1, kSumThreads, 0, stream>>>(total, losses, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace fp8lm::cuda
