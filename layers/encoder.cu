// Token + position embedding kernels (see layers/encoder.h).
//
// Forward: elementwise over chunks of 8 (16-byte loads of both tables).
// Backward: one launch, grid (num_unique + T, ceil(C/256)) of one-warp blocks; each thread
// owns 8 columns. Blocks x < num_unique own one unique token's dwte row and sum its dout
// rows in the index's ascending order; blocks x >= num_unique own one position t's dwpe
// row and sum b = 0..B-1 in order. Every output element has one owner and a fixed order:
// no atomics, bit-reproducible (and equal to cpu::encoder_backward, which uses the same
// order).
#include "layers/encoder.h"

#include <algorithm>
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

constexpr int kForwardThreads = 256;
constexpr int kForwardMaxBlocks = 4096;
constexpr int kBackwardThreads = 32;  // one warp per block: 32 chunks of 8 columns

// dst[0..7] += acc[0..7] (two float4 read-modify-writes).
__device__ __forceinline__ void add_f32x8(float* dst, const float (&acc)[8]) {
  float4* d = reinterpret_cast<float4*>(dst);
  float4 lo = d[0], hi = d[1];
  lo.x += acc[0];
  lo.y += acc[1];
  lo.z += acc[2];
  lo.w += acc[3];
  hi.x += acc[4];
  hi.y += acc[5];
  hi.z += acc[6];
  hi.w += acc[7];
  d[0] = lo;
  d[1] = hi;
}

__global__ void __launch_bounds__(kForwardThreads)
    encoder_forward_kernel(bf16* __restrict__ out, const int32_t* __restrict__ tokens, const bf16* __restrict__ wte,
                           const bf16* __restrict__ wpe, int T, int C, size_t total_chunks) {
  const size_t chunks_per_row = static_cast<size_t>(C / 8);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total_chunks;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t row = i / chunks_per_row;  // b*T + t
    const int col = static_cast<int>(i % chunks_per_row) * 8;
    const int t = static_cast<int>(row % static_cast<size_t>(T));
    const int token = tokens[row];
    float a[8], b[8];
    load_bf16x8(wte + static_cast<size_t>(token) * C + col, a);
    load_bf16x8(wpe + static_cast<size_t>(t) * C + col, b);
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] += b[j];
    store_bf16x8(out + i * 8, a);
  }
}

__global__ void __launch_bounds__(kBackwardThreads)
    encoder_backward_kernel(float* __restrict__ dwte, float* __restrict__ dwpe, const bf16* __restrict__ dout,
                            const int32_t* __restrict__ unique_tokens, const int32_t* __restrict__ offsets,
                            const int32_t* __restrict__ positions, int num_unique, int B, int T, int C) {
  const int col = (blockIdx.y * kBackwardThreads + threadIdx.x) * 8;
  if (col >= C) return;  // no block-level synchronisation below
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  float x[8];

  if (static_cast<int>(blockIdx.x) < num_unique) {
    const int u = blockIdx.x;
    const int begin = offsets[u], end = offsets[u + 1];
    // Loads may run ahead of the adds (unrolled), the adds stay in ascending order.
#pragma unroll 4
    for (int p = begin; p < end; p++) {
      load_bf16x8(dout + static_cast<size_t>(positions[p]) * C + col, x);
#pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += x[j];
    }
    add_f32x8(dwte + static_cast<size_t>(unique_tokens[u]) * C + col, acc);
  } else {
    const int t = blockIdx.x - num_unique;
#pragma unroll 4
    for (int b = 0; b < B; b++) {
      load_bf16x8(dout + (static_cast<size_t>(b) * T + t) * C + col, x);
#pragma unroll
      for (int j = 0; j < 8; j++) acc[j] += x[j];
    }
    add_f32x8(dwpe + static_cast<size_t>(t) * C + col, acc);
  }
}

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

void check_shape(int B, int T, int C, const char* what) {
  FP8LM_CHECK(B >= 0 && T >= 0, what, ": B and T must be >= 0, got B=", B, " T=", T);
  FP8LM_CHECK(C > 0 && C % 8 == 0, what, ": C must be a positive multiple of 8, got ", C);
  FP8LM_CHECK(static_cast<size_t>(B) * static_cast<size_t>(T) <= static_cast<size_t>(INT32_MAX), what,
              ": B*T does not fit int32");
}

}  // namespace

void encoder_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                     cudaStream_t stream) {
  const char* what = "encoder_forward";
  check_shape(B, T, C, what);
  FP8LM_CHECK(out != nullptr && tokens != nullptr && wte != nullptr && wpe != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(out, 16) && aligned(wte, 16) && aligned(wpe, 16), what,
              ": out, wte and wpe must be 16-byte aligned");
  const size_t total_chunks = static_cast<size_t>(B) * T * (C / 8);
  if (total_chunks == 0) return;
  const int blocks =
      static_cast<int>(std::min<size_t>((total_chunks + kForwardThreads - 1) / kForwardThreads, kForwardMaxBlocks));
  encoder_forward_kernel<<<blocks, kForwardThreads, 0, stream>>>(out, tokens, wte, wpe, T, C, total_chunks);
  CUDA_CHECK_LAUNCH();
}

void encoder_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* unique_tokens,
                      const int32_t* offsets, const int32_t* positions, int num_unique, int B, int T, int C,
                      cudaStream_t stream) {
  const char* what = "encoder_backward";
  check_shape(B, T, C, what);
  const int rows = B * T;
  if (rows == 0) return;
  FP8LM_CHECK(num_unique >= 1 && num_unique <= rows, what, ": num_unique must be in [1, B*T], got ", num_unique);
  FP8LM_CHECK(dwte != nullptr && dwpe != nullptr && dout != nullptr && unique_tokens != nullptr &&
                  offsets != nullptr && positions != nullptr,
              what, ": null pointer");
  FP8LM_CHECK(aligned(dwte, 16) && aligned(dwpe, 16) && aligned(dout, 16), what,
              ": dwte, dwpe and dout must be 16-byte aligned");
  const int column_blocks = (C / 8 + kBackwardThreads - 1) / kBackwardThreads;
  FP8LM_CHECK(column_blocks <= 65535, what, ": C too large, got ", C);
  const dim3 grid(static_cast<unsigned>(num_unique) + static_cast<unsigned>(T), column_blocks);
  encoder_backward_kernel<<<grid, kBackwardThreads, 0, stream>>>(dwte, dwpe, dout, unique_tokens, offsets, positions,
                                                                 num_unique, B, T, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace fp8lm::cuda
