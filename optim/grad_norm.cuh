// The gradient norm's per-element and per-block steps, shared by the norm kernel
// (optim/grad_clip.cu) and AdamW's first pass when it computes the norm too (optim/adamw.cu):
// the same operations in the same order give the same partial sums, bit for bit. .cu only.
#pragma once

namespace fp8lm::cuda::device {
namespace {

// Sum over the block in a fixed order: a shuffle-down tree per warp, then warp 0's
// thread 0 adds the warp sums in warp order. The result is valid in thread 0 only.
template <int kBlock>
__device__ __forceinline__ double block_sum_fixed(double x) {
  __shared__ double warp_sum[kBlock / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = __dadd_rn(x, __shfl_down_sync(0xFFFFFFFFu, x, offset));
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = x;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kBlock / 32; ++w) total = __dadd_rn(total, warp_sum[w]);
  }
  return total;
}

__device__ __forceinline__ double add_square(double sum, float g) {
  const double d = static_cast<double>(g);
  return __dadd_rn(sum, __dmul_rn(d, d));  // g*g rounded, then added (as the CPU, no FMA)
}

}  // namespace
}  // namespace fp8lm::cuda::device
