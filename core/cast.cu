// Kernels of core/cast_cuda.h. No spdlog here (nvcc, C++20): errors throw through CUDA_CHECK.
#include "core/cast_cuda.h"

#include <cuda_fp8.h>

#include <cstring>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/error.h"
#include "core/fp8_stats.cuh"
#include "core/launch.cuh"
#include "core/scaling.h"

namespace fp8lm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = kCastTile;  // 64 x 64 elements per block
static_assert(kTile == 64 && kTile == device::kByteTile && kThreads == 256,
              "the thread mappings below assume 64x64 tiles and 256 threads");

// ---- element helpers -----------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <Fp8Dtype kDtype>
__device__ __forceinline__ uint16_t to_fp8x2(float lo, float hi) {
  // cvt.rn.satfinite.{e4m3,e5m2}x2.f32: the same instruction __nv_cvt_float_to_fp8 uses; lo -> low byte.
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                  kDtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// |x| as the int the running amax compares: the bits of a non-negative float order like
// the values; any NaN becomes the quiet NaN 0x7FC00000, larger than +inf (0x7F800000).
__device__ __forceinline__ int amax_bits(float x) {
  unsigned bits = __float_as_uint(x) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) bits = 0x7FC00000u;
  return static_cast<int>(bits);
}

// Block-wide max of `local` (amax bits), then one atomicMax into *amax. Every thread of
// the block must call it (it synchronizes).
__device__ void commit_block_amax(float* amax, int local) {
  __shared__ int warp_max[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_xor_sync(0xFFFFFFFFu, local, offset));
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = local;
  __syncthreads();
  if (warp == 0) {
    local = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_xor_sync(0xFFFFFFFFu, local, offset));
    if (lane == 0 && local > 0) atomicMax(reinterpret_cast<int*>(amax), local);
  }
}

template <typename T, int kCount>
__device__ __forceinline__ void load_vector(float (&x)[kCount], const T* source) {
  static_assert(kCount * sizeof(T) % 16 == 0, "whole 16-byte loads");
  constexpr int kLoads = kCount * sizeof(T) / 16;
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const uint4 raw = reinterpret_cast<const uint4*>(source)[l];
    T values[16 / sizeof(T)];
    memcpy(values, &raw, 16);
#pragma unroll
    for (int j = 0; j < 16 / static_cast<int>(sizeof(T)); ++j) x[l * (16 / sizeof(T)) + j] = to_float(values[j]);
  }
}

bool aligned(const void* pointer, size_t bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

// ---- cast + transpose + amax + dbias partials -----------------------------------------
//
// One block per 64x64 tile of in [M,N]. Thread t handles kVec consecutive columns
// (16 bytes of input) of rows t / kThreadsPerRow + p * kLanes, p < kPasses.
// out == nullptr and out_t == nullptr: column sums only (column_sum).
// kStats: also tallies the FP8 cast statistics of the quantized elements into *counts.
template <typename T, Fp8Dtype kDtype, bool kStats = false>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ partial,
                          float* amax, const T* __restrict__ in, const float* __restrict__ scale_pointer, int M,
                          int N, bool vec_in, bool vec_out, bool vec_t, Fp8CastCounts* counts) {
  device::start_after_previous_kernel();
  constexpr int kVec = 16 / sizeof(T);             // 8 (bf16) or 4 (float)
  constexpr int kThreadsPerRow = kTile / kVec;     // 8 or 16
  constexpr int kLanes = kThreads / kThreadsPerRow;  // 32 or 16 rows at a time
  constexpr int kPasses = kTile / kLanes;          // 2 or 4
  __shared__ device::ByteTile tile;
  __shared__ float lane_sums[kLanes][kTile];

  const int row0 = blockIdx.y * kTile;
  const int col0 = blockIdx.x * kTile;
  const int lane = threadIdx.x / kThreadsPerRow;
  const int c = (threadIdx.x % kThreadsPerRow) * kVec;
  const int gc = col0 + c;
  const bool full = row0 + kTile <= M && col0 + kTile <= N;
  const bool quantize = out != nullptr || out_t != nullptr;
  const float scale = quantize ? *scale_pointer : 1.0f;

  float sums[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) sums[j] = 0.0f;
  int local_amax = 0;
  Fp8CastTally tally;

#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = lane + p * kLanes;
    const int gr = row0 + r;
    const size_t offset = static_cast<size_t>(gr) * N + gc;
    float x[kVec];
    if (full && vec_in) {
      load_vector(x, in + offset);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] = (gr < M && gc + j < N) ? to_float(in[offset + j]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      sums[j] += x[j];
      local_amax = max(local_amax, amax_bits(x[j]));
    }
    if (quantize) {
      uint8_t q[kVec];
#pragma unroll
      for (int j = 0; j < kVec; j += 2) {
        const uint16_t pair = to_fp8x2<kDtype>(x[j] * scale, x[j + 1] * scale);
        q[j] = static_cast<uint8_t>(pair & 0xFF);
        q[j + 1] = static_cast<uint8_t>(pair >> 8);
      }
      if constexpr (kStats) {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (gr < M && gc + j < N) tally.add(x[j], x[j] * scale, q[j], kDtype);
      }
      if (out) {
        if (full && vec_out) {
          device::store_bytes<kVec>(out + offset, q);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            if (gr < M && gc + j < N) out[offset + j] = q[j];
        }
      }
      if (out_t) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) tile[r][c + j] = q[j];
      }
    }
  }

  if (partial) {  // fixed order: rows of a lane (above), then lanes 0..kLanes-1
#pragma unroll
    for (int j = 0; j < kVec; ++j) lane_sums[lane][c + j] = sums[j];
    __syncthreads();
    if (threadIdx.x < kTile && col0 + static_cast<int>(threadIdx.x) < N) {
      float s = 0.0f;
      for (int l = 0; l < kLanes; ++l) s += lane_sums[l][threadIdx.x];
      partial[static_cast<size_t>(blockIdx.y) * N + col0 + threadIdx.x] = s;
    }
  }
  if (out_t) {
    __syncthreads();
    device::write_transposed(out_t, tile, row0, col0, M, N, full, vec_t);
  }
  if (amax) commit_block_amax(amax, local_amax);
  if constexpr (kStats) device::commit_fp8_tally(counts, tally, scale);
}

// out [N] += the sum over t < tiles of partial [t, N] in device::add_column_sums_kernel's order
// (eight interleaved runs of tiles, then the eight run sums in turn), added once to the FP32
// or BF16 gradient. One run of adds a column, even with 32 loads in flight, cost 8-15 us a
// call at gpt2-1558m's 128 tiles and 34 us at gpt2-124m's 512 (call 79): too few threads.
void launch_add_column_partials(GradientRef out, const float* partial, int tiles, int N, cudaStream_t stream) {
  launch_kernel(device::add_column_sums_kernel, (N + 31) / 32, dim3(32, 8), 0, stream, out, GradientRef{}, N, partial,
                tiles, N);
}

// ---- FP8 byte transpose ----------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) transpose_fp8_kernel(uint8_t* __restrict__ out,
                                                                 const uint8_t* __restrict__ in, int M, int N,
                                                                 bool vec_in, bool vec_t) {
  device::start_after_previous_kernel();
  __shared__ device::ByteTile tile;
  const int row0 = blockIdx.y * kTile;
  const int col0 = blockIdx.x * kTile;
  const bool full = row0 + kTile <= M && col0 + kTile <= N;
  // Thread t reads 16 bytes of one row: r = t / 4, c = 16 * (t % 4).
  const int r = threadIdx.x / 4;
  const int c = (threadIdx.x % 4) * 16;
  const int gr = row0 + r;
  const int gc = col0 + c;
  const size_t offset = static_cast<size_t>(gr) * N + gc;
  if (full && vec_in) {
    const uint4 raw = *reinterpret_cast<const uint4*>(in + offset);
    uint8_t q[16];
    memcpy(q, &raw, 16);
#pragma unroll
    for (int j = 0; j < 16; ++j) tile[r][c + j] = q[j];
  } else if (gr < M) {
    for (int j = 0; j < 16 && gc + j < N; ++j) tile[r][c + j] = in[offset + j];
  }
  __syncthreads();
  device::write_transposed(out, tile, row0, col0, M, N, full, vec_t);
}

// ---- element-wise cast / amax ------------------------------------------------------------

constexpr int kChunk = 8;  // elements per thread per step

// kCast: write the codes (else the amax alone). kStats: tally the FP8 cast statistics of
// the codes into *counts; with kCast false, a statistics pass that writes nothing.
template <typename T, Fp8Dtype kDtype, bool kCast, bool kStats = false>
__global__ void __launch_bounds__(kThreads) cast_kernel(uint8_t* __restrict__ out, float* amax,
                                                        const T* __restrict__ in,
                                                        const float* __restrict__ scale_pointer, size_t n,
                                                        bool vec_in, bool vec_out, Fp8CastCounts* counts) {
  device::start_after_previous_kernel();
  const float scale = (kCast || kStats) ? *scale_pointer : 1.0f;
  const size_t chunks = (n + kChunk - 1) / kChunk;
  int local_amax = 0;
  Fp8CastTally tally;
  for (size_t chunk = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < chunks;
       chunk += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i0 = chunk * kChunk;
    const bool whole = i0 + kChunk <= n;
    float x[kChunk];
    if (whole && vec_in) {
      load_vector(x, in + i0);
    } else {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) x[j] = i0 + j < n ? to_float(in[i0 + j]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) local_amax = max(local_amax, amax_bits(x[j]));
    if constexpr (kCast || kStats) {
      uint8_t q[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; j += 2) {
        const uint16_t pair = to_fp8x2<kDtype>(x[j] * scale, x[j + 1] * scale);
        q[j] = static_cast<uint8_t>(pair & 0xFF);
        q[j + 1] = static_cast<uint8_t>(pair >> 8);
      }
      if constexpr (kStats) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j)
          if (i0 + j < n) tally.add(x[j], x[j] * scale, q[j], kDtype);
      }
      if constexpr (kCast) {
        if (whole && vec_out) {
          device::store_bytes<kChunk>(out + i0, q);
        } else {
#pragma unroll
          for (int j = 0; j < kChunk; ++j)
            if (i0 + j < n) out[i0 + j] = q[j];
        }
      }
    }
  }
  if (amax) commit_block_amax(amax, local_amax);
  if constexpr (kStats) device::commit_fp8_tally(counts, tally, scale);
}

__global__ void raise_amax_kernel(float* amax, const float* value) {
  device::start_after_previous_kernel();
  const float v = fabsf(*value);
  atomicMax(reinterpret_cast<unsigned*>(amax), isnan(v) ? 0x7FC00000u : __float_as_uint(v));
}

__global__ void current_scale_kernel(float* scale, float* scale_inv, const float* amax, float fp8_max, int margin) {
  device::start_after_previous_kernel();
  const float s = compute_scale(*amax, fp8_max, margin, *scale);
  *scale = s;
  *scale_inv = 1.0f / s;
}

// ---- launchers ---------------------------------------------------------------------------

dim3 tile_grid(int M, int N) {
  const dim3 grid((N + kTile - 1) / kTile, (M + kTile - 1) / kTile);
  FP8LM_CHECK(grid.y <= 65535u, "too many rows for the tile grid: M=", M);
  return grid;
}

template <typename T>
void launch_cast_transpose(uint8_t* out, uint8_t* out_t, GradientRef dbias, float* amax, const T* in, const float* scale,
                           Fp8Dtype dtype, int M, int N, float* scratch, cudaStream_t stream, Fp8CastCounts* counts) {
  FP8LM_CHECK(M >= 0 && N >= 0, "cast_transpose_fp8 shape M=", M, " N=", N);
  if (M == 0 || N == 0) return;
  FP8LM_CHECK(in != nullptr && (out != nullptr || out_t != nullptr) && scale != nullptr,
              "cast_transpose_fp8 needs in, out or out_t, and scale");
  FP8LM_CHECK(!dbias || scratch != nullptr, "cast_transpose_fp8 with dbias needs scratch of ",
              dbias_scratch_floats(M, N), " floats");
  constexpr int kVec = 16 / sizeof(T);
  const dim3 grid = tile_grid(M, N);
  const bool vec_in = N % kVec == 0 && aligned(in, 16);
  const bool vec_out = N % kVec == 0 && aligned(out, kVec);
  const bool vec_t = M % 16 == 0 && aligned(out_t, 16);
  float* partial = dbias ? scratch : nullptr;
  // Without statistics, the very kernel the casts always ran (kStats = false).
  auto launch = [&](auto kernel) {
    launch_kernel(kernel, grid, kThreads, 0, stream, out, out_t, partial, amax, in, scale, M, N, vec_in, vec_out, vec_t,
                  counts);
  };
  if (dtype == Fp8Dtype::e4m3) {
    counts ? launch(cast_transpose_kernel<T, Fp8Dtype::e4m3, true>) : launch(cast_transpose_kernel<T, Fp8Dtype::e4m3>);
  } else {
    counts ? launch(cast_transpose_kernel<T, Fp8Dtype::e5m2, true>) : launch(cast_transpose_kernel<T, Fp8Dtype::e5m2>);
  }
  if (dbias) launch_add_column_partials(dbias, scratch, static_cast<int>(grid.y), N, stream);
}

int elementwise_blocks(size_t n) {
  const size_t chunks = (n + kChunk - 1) / kChunk;
  const size_t blocks = (chunks + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? blocks : 4096);  // grid-stride beyond that
}

template <typename T>
void launch_amax(float* amax, const T* in, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  FP8LM_CHECK(amax != nullptr && in != nullptr, "amax_of needs amax and in");
  const bool vec_in = aligned(in, 16);
  launch_kernel(cast_kernel<T, Fp8Dtype::e4m3, false>, elementwise_blocks(n), kThreads, 0, stream, nullptr, amax, in,
                nullptr, n, vec_in, false, /*counts=*/nullptr);
}

template <typename T>
void launch_cast(uint8_t* out, float* amax, const T* in, const float* scale, Fp8Dtype dtype, size_t n,
                 cudaStream_t stream, Fp8CastCounts* counts) {
  if (n == 0) return;
  FP8LM_CHECK(out != nullptr && in != nullptr && scale != nullptr, "cast_fp8 needs out, in and scale");
  const bool vec_in = aligned(in, 16);
  const bool vec_out = aligned(out, kChunk);
  const int blocks = elementwise_blocks(n);
  auto launch = [&](auto kernel) {
    launch_kernel(kernel, blocks, kThreads, 0, stream, out, amax, in, scale, n, vec_in, vec_out, counts);
  };
  if (dtype == Fp8Dtype::e4m3) {
    counts ? launch(cast_kernel<T, Fp8Dtype::e4m3, true, true>) : launch(cast_kernel<T, Fp8Dtype::e4m3, true>);
  } else {
    counts ? launch(cast_kernel<T, Fp8Dtype::e5m2, true, true>) : launch(cast_kernel<T, Fp8Dtype::e5m2, true>);
  }
}

// The statistics of casting in [n] with *scale, without writing the codes.
template <typename T>
void launch_count(Fp8CastCounts* counts, const T* in, const float* scale, Fp8Dtype dtype, size_t n,
                  cudaStream_t stream) {
  if (n == 0) return;
  FP8LM_CHECK(counts != nullptr && in != nullptr && scale != nullptr, "count_fp8_cast needs counts, in and scale");
  const bool vec_in = aligned(in, 16);
  const int blocks = elementwise_blocks(n);
  if (dtype == Fp8Dtype::e4m3) {
    launch_kernel(cast_kernel<T, Fp8Dtype::e4m3, false, true>, blocks, kThreads, 0, stream, nullptr, nullptr, in, scale,
                  n, vec_in, false, counts);
  } else {
    launch_kernel(cast_kernel<T, Fp8Dtype::e5m2, false, true>, blocks, kThreads, 0, stream, nullptr, nullptr, in, scale,
                  n, vec_in, false, counts);
  }
}

}  // namespace

void cast_transpose_fp8(uint8_t* out, uint8_t* out_t, GradientRef dbias, float* amax, const __nv_bfloat16* in,
                        const float* scale, Fp8Dtype dtype, int M, int N, float* scratch, cudaStream_t stream,
                        Fp8CastCounts* counts) {
  launch_cast_transpose(out, out_t, dbias, amax, in, scale, dtype, M, N, scratch, stream, counts);
}

void cast_transpose_fp8(uint8_t* out, uint8_t* out_t, GradientRef dbias, float* amax, const float* in,
                        const float* scale, Fp8Dtype dtype, int M, int N, float* scratch, cudaStream_t stream,
                        Fp8CastCounts* counts) {
  launch_cast_transpose(out, out_t, dbias, amax, in, scale, dtype, M, N, scratch, stream, counts);
}

void transpose_fp8(uint8_t* out, const uint8_t* in, int M, int N, cudaStream_t stream) {
  FP8LM_CHECK(M >= 0 && N >= 0, "transpose_fp8 shape M=", M, " N=", N);
  if (M == 0 || N == 0) return;
  FP8LM_CHECK(out != nullptr && in != nullptr, "transpose_fp8 needs out and in");
  const bool vec_in = N % 16 == 0 && aligned(in, 16);
  const bool vec_t = M % 16 == 0 && aligned(out, 16);
  launch_kernel(transpose_fp8_kernel, tile_grid(M, N), kThreads, 0, stream, out, in, M, N, vec_in, vec_t);
}

void amax_of(float* amax, const __nv_bfloat16* in, size_t n, cudaStream_t stream) { launch_amax(amax, in, n, stream); }
void amax_of(float* amax, const float* in, size_t n, cudaStream_t stream) { launch_amax(amax, in, n, stream); }

void cast_fp8(uint8_t* out, float* amax, const __nv_bfloat16* in, const float* scale, Fp8Dtype dtype, size_t n,
              cudaStream_t stream, Fp8CastCounts* counts) {
  launch_cast(out, amax, in, scale, dtype, n, stream, counts);
}
void cast_fp8(uint8_t* out, float* amax, const float* in, const float* scale, Fp8Dtype dtype, size_t n,
              cudaStream_t stream, Fp8CastCounts* counts) {
  launch_cast(out, amax, in, scale, dtype, n, stream, counts);
}

void count_fp8_cast(Fp8CastCounts* counts, const __nv_bfloat16* in, const float* scale, Fp8Dtype dtype, size_t n,
                    cudaStream_t stream) {
  launch_count(counts, in, scale, dtype, n, stream);
}

void column_sum(GradientRef out, const __nv_bfloat16* in, int M, int N, float* scratch, cudaStream_t stream) {
  FP8LM_CHECK(M >= 0 && N >= 0, "column_sum shape M=", M, " N=", N);
  if (M == 0 || N == 0) return;
  FP8LM_CHECK(out && in != nullptr && scratch != nullptr, "column_sum needs out, in and scratch");
  const dim3 grid = tile_grid(M, N);
  const bool vec_in = N % 8 == 0 && aligned(in, 16);
  launch_kernel(cast_transpose_kernel<__nv_bfloat16, Fp8Dtype::e4m3>, grid, kThreads, 0, stream, nullptr, nullptr,
                scratch, nullptr, in, nullptr, M, N, vec_in, false, false,
                /*counts=*/nullptr);
  launch_add_column_partials(out, scratch, static_cast<int>(grid.y), N, stream);
}

void add_column_partials(GradientRef out, const float* partial, int tiles, int N, cudaStream_t stream) {
  FP8LM_CHECK(tiles >= 0 && N >= 0, "add_column_partials shape tiles=", tiles, " N=", N);
  if (tiles == 0 || N == 0) return;
  FP8LM_CHECK(out && partial != nullptr, "add_column_partials needs out and partial");
  launch_add_column_partials(out, partial, tiles, N, stream);
}

void raise_amax(float* amax, const float* value, cudaStream_t stream) {
  FP8LM_CHECK(amax != nullptr && value != nullptr, "raise_amax needs amax and value");
  launch_kernel(raise_amax_kernel, 1, 1, 0, stream, amax, value);
}

void compute_current_scale(float* scale, float* scale_inv, const float* amax, float fp8_max, int margin,
                           cudaStream_t stream) {
  FP8LM_CHECK(scale != nullptr && scale_inv != nullptr && amax != nullptr, "compute_current_scale needs pointers");
  FP8LM_CHECK(margin >= 0 && margin <= kMaxFp8Margin, "margin ", margin);
  launch_kernel(current_scale_kernel, 1, 1, 0, stream, scale, scale_inv, amax, fp8_max, margin);
}

}  // namespace fp8lm::cuda
