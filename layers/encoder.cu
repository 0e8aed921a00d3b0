// Token + position embedding kernels (see layers/encoder.h).
//
// Forward: elementwise over chunks of 8 (16-byte loads of the tables, 32-byte FP32 rows).
// Backward: grids of one-warp blocks; each thread owns 8 columns. A token's dwte row is
// owned by one block that sums its dout rows in the index's ascending order; a
// position's dwpe row by one block that sums its rows in ascending order. Every output
// element has one owner and a fixed order: no atomics, bit-reproducible, and equal to the
// CPU twins, which use the same order.
#include "layers/encoder.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/device_helpers.cuh"
#include "core/check_cuda.h"
#include "core/error.h"
#include "core/launch.cuh"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr int kForwardThreads = 256;
constexpr int kForwardMaxBlocks = 4096;
constexpr int kBackwardThreads = 32;  // one warp per block: 32 chunks of 8 columns


// out [N,C] f32 = wte row of the token (slice-local), or zeros for another slice's token.
__global__ void __launch_bounds__(kForwardThreads)
    embedding_lookup_kernel(float* __restrict__ out, const int32_t* __restrict__ tokens, const bf16* __restrict__ wte,
                            int vocab_begin, int vocab_count, int C, size_t total_chunks) {
  device::start_after_previous_kernel();
  const size_t chunks_per_row = static_cast<size_t>(C / 8);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total_chunks;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t row = i / chunks_per_row;
    const int col = static_cast<int>(i % chunks_per_row) * 8;
    const int local = tokens[row] - vocab_begin;
    float x[8];
    if (local >= 0 && local < vocab_count) {
      load_bf16x8(wte + static_cast<size_t>(local) * C + col, x);
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) x[j] = 0.0f;
    }
    float4* o = reinterpret_cast<float4*>(out + i * 8);
    o[0] = make_float4(x[0], x[1], x[2], x[3]);
    o[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

// out [N,C] bf16 = token_embeddings [N,C] + wpe[(first_row + n) % T], one rounding.
__global__ void __launch_bounds__(kForwardThreads)
    add_position_embedding_kernel(bf16* __restrict__ out, const float* __restrict__ token_embeddings,
                                  const bf16* __restrict__ wpe, int first_row, int T, int C, size_t total_chunks,
                                  const int32_t* stored_wpe_row, const int32_t* __restrict__ position_ids) {
  device::start_after_previous_kernel();
  if (stored_wpe_row) wpe += static_cast<size_t>(*stored_wpe_row) * C;
  const size_t chunks_per_row = static_cast<size_t>(C / 8);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total_chunks;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t row = i / chunks_per_row;
    const int col = static_cast<int>(i % chunks_per_row) * 8;
    const int t = position_ids != nullptr
                      ? position_ids[static_cast<size_t>(first_row) + row]
                      : static_cast<int>((static_cast<size_t>(first_row) + row) % static_cast<size_t>(T));
    const float4* e = reinterpret_cast<const float4*>(token_embeddings + i * 8);
    const float4 lo = e[0], hi = e[1];
    float a[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float b[8];
    load_bf16x8(wpe + static_cast<size_t>(t) * C + col, b);
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] += b[j];
    store_bf16x8(out + i * 8, a);
  }
}

// One block per unique token of the slice: its dout rows summed in ascending order.
__global__ void __launch_bounds__(kBackwardThreads)
    embedding_lookup_backward_kernel(GradientRef dwte, const bf16* __restrict__ dout,
                                     const int32_t* __restrict__ unique_tokens, const int32_t* __restrict__ offsets,
                                     const int32_t* __restrict__ positions, int C) {
  device::start_after_previous_kernel();
  const int col = (blockIdx.y * kBackwardThreads + threadIdx.x) * 8;
  if (col >= C) return;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  float x[8];
  const int u = blockIdx.x;
  const int begin = offsets[u], end = offsets[u + 1];
  // Loads may run ahead of the adds (unrolled), the adds stay in ascending order.
#pragma unroll 4
  for (int p = begin; p < end; p++) {
    load_bf16x8(dout + static_cast<size_t>(positions[p]) * C + col, x);
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] += x[j];
  }
  add_to_gradient8(dwte, static_cast<size_t>(unique_tokens[u]) * C + col, acc);
}

// One block per position t: the local rows at t (every T-th row) summed in order.
__global__ void __launch_bounds__(kBackwardThreads)
    position_embedding_backward_kernel(GradientRef dwpe, const bf16* __restrict__ dout, int first_row, int T,
                                       int N, int C) {
  device::start_after_previous_kernel();
  const int col = (blockIdx.y * kBackwardThreads + threadIdx.x) * 8;
  if (col >= C) return;
  const int t = blockIdx.x;
  const int first = ((t - first_row) % T + T) % T;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  float x[8];
#pragma unroll 4
  for (int n = first; n < N; n += T) {
    load_bf16x8(dout + static_cast<size_t>(n) * C + col, x);
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] += x[j];
  }
  add_to_gradient8(dwpe, static_cast<size_t>(t) * C + col, acc);
}

// One block per position id t: the rows of this rank's [first_row, first_row + N) whose id is t,
// in the index's ascending order (layers/documents.h).
__global__ void __launch_bounds__(kBackwardThreads)
    position_embedding_backward_by_id_kernel(GradientRef dwpe, const bf16* __restrict__ dout,
                                             const int32_t* __restrict__ position_offsets,
                                             const int32_t* __restrict__ position_rows, int first_row, int N, int C) {
  device::start_after_previous_kernel();
  const int col = (blockIdx.y * kBackwardThreads + threadIdx.x) * 8;
  if (col >= C) return;
  const int t = blockIdx.x;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  float x[8];
  const int begin = position_offsets[t], end = position_offsets[t + 1];
  for (int p = begin; p < end; p++) {
    const int n = position_rows[p] - first_row;
    if (n < 0 || n >= N) continue;  // another sequence-parallel rank's row
    load_bf16x8(dout + static_cast<size_t>(n) * C + col, x);
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] += x[j];
  }
  add_to_gradient8(dwpe, static_cast<size_t>(t) * C + col, acc);
}

int forward_blocks(size_t total_chunks) {
  return static_cast<int>(std::min<size_t>((total_chunks + kForwardThreads - 1) / kForwardThreads, kForwardMaxBlocks));
}

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

void check_shape(int N, int C, const char* what) {
  FP8LM_CHECK(N >= 0, what, ": N must be >= 0, got N=", N);
  FP8LM_CHECK(C > 0 && C % 8 == 0, what, ": C must be a positive multiple of 8, got ", C);
}

int column_blocks(int C, const char* what) {
  const int blocks = (C / 8 + kBackwardThreads - 1) / kBackwardThreads;
  FP8LM_CHECK(blocks <= 65535, what, ": C too large, got ", C);
  return blocks;
}

}  // namespace

void embedding_lookup(float* out, const int32_t* tokens, const bf16* wte, int vocab_begin, int vocab_count, int N,
                      int C, cudaStream_t stream) {
  const char* what = "embedding_lookup";
  check_shape(N, C, what);
  FP8LM_CHECK(out != nullptr && tokens != nullptr && wte != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(out, 16) && aligned(wte, 16), what, ": out and wte must be 16-byte aligned");
  const size_t total_chunks = static_cast<size_t>(N) * (C / 8);
  if (total_chunks == 0) return;
  launch_kernel(embedding_lookup_kernel, forward_blocks(total_chunks), kForwardThreads, 0, stream, out, tokens, wte,
                vocab_begin, vocab_count, C, total_chunks);
}

void add_position_embedding(bf16* out, const float* token_embeddings, const bf16* wpe, int first_row, int T, int N,
                            int C, cudaStream_t stream, const int32_t* stored_wpe_row, const int32_t* position_ids) {
  const char* what = "add_position_embedding";
  check_shape(N, C, what);
  FP8LM_CHECK(T > 0 && first_row >= 0, what, ": T must be > 0 and first_row >= 0");
  FP8LM_CHECK(out != nullptr && token_embeddings != nullptr && wpe != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(out, 16) && aligned(token_embeddings, 16) && aligned(wpe, 16), what,
              ": out, token_embeddings and wpe must be 16-byte aligned");
  const size_t total_chunks = static_cast<size_t>(N) * (C / 8);
  if (total_chunks == 0) return;
  launch_kernel(add_position_embedding_kernel, forward_blocks(total_chunks), kForwardThreads, 0, stream, out,
                token_embeddings, wpe, first_row, T, C, total_chunks, stored_wpe_row, position_ids);
}

void embedding_lookup_backward(GradientRef dwte, const bf16* dout, const int32_t* unique_tokens, const int32_t* offsets,
                               const int32_t* positions, int num_unique, int C, cudaStream_t stream) {
  const char* what = "embedding_lookup_backward";
  check_shape(num_unique, C, what);
  if (num_unique == 0) return;  // no token of this vocabulary slice in the batch
  FP8LM_CHECK(dwte && dout != nullptr && unique_tokens != nullptr && offsets != nullptr &&
                  positions != nullptr,
              what, ": null pointer");
  FP8LM_CHECK(aligned(dwte.data, 16) && aligned(dout, 16), what, ": dwte and dout must be 16-byte aligned");
  const dim3 grid(static_cast<unsigned>(num_unique), column_blocks(C, what));
  launch_kernel(embedding_lookup_backward_kernel, grid, kBackwardThreads, 0, stream, dwte, dout, unique_tokens, offsets,
                positions, C);
}

void position_embedding_backward(GradientRef dwpe, const bf16* dout, int first_row, int T, int N, int C,
                                 cudaStream_t stream, const int32_t* position_offsets, const int32_t* position_rows) {
  const char* what = "position_embedding_backward";
  check_shape(N, C, what);
  FP8LM_CHECK(T > 0 && first_row >= 0, what, ": T must be > 0 and first_row >= 0");
  if (N == 0) return;
  FP8LM_CHECK(dwpe && dout != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(dwpe.data, 16) && aligned(dout, 16), what, ": dwpe and dout must be 16-byte aligned");
  const dim3 grid(static_cast<unsigned>(T), column_blocks(C, what));
  FP8LM_CHECK((position_offsets == nullptr) == (position_rows == nullptr), what,
              ": position_offsets and position_rows come together");
  if (position_offsets != nullptr) {
    launch_kernel(position_embedding_backward_by_id_kernel, grid, kBackwardThreads, 0, stream, dwpe, dout,
                  position_offsets, position_rows, first_row, N, C);
    return;
  }
  launch_kernel(position_embedding_backward_kernel, grid, kBackwardThreads, 0, stream, dwpe, dout, first_row, T, N, C);
}

}  // namespace fp8lm::cuda
