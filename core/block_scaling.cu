// Kernels of core/block_scaling_cuda.h. No spdlog here (nvcc, C++20): errors throw through
// CUDA_CHECK / FP8LM_CHECK.
#include "core/block_scaling_cuda.h"

#include <cuda_fp8.h>

#include "core/block_scaling.h"
#include "core/check_cuda.h"
#include "core/error.h"
#include "core/launch.cuh"

namespace fp8lm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kScaleBlock == 128, "the thread mappings below assume 128-element tiles");

// Two FP8 codes (cvt.rn.satfinite, the instruction the other casts use); lo -> low byte.
template <Fp8Dtype kDtype>
__device__ __forceinline__ uint16_t to_fp8x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                  kDtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Four codes of x * scale as one little-endian word (x[0] in the lowest byte).
template <Fp8Dtype kDtype>
__device__ __forceinline__ uint32_t codes4(const float (&x)[4], float scale) {
  const uint32_t lo = to_fp8x2<kDtype>(x[0] * scale, x[1] * scale);
  const uint32_t hi = to_fp8x2<kDtype>(x[2] * scale, x[3] * scale);
  return lo | (hi << 16);
}

// |x| as an int that orders like the value; any NaN becomes the quiet NaN 0x7FC00000, above
// +inf, so a max over these keeps a NaN visible (the CPU's tile amax is NaN then, too).
__device__ __forceinline__ int amax_bits(float x) {
  unsigned bits = __float_as_uint(x) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) bits = 0x7FC00000u;
  return static_cast<int>(bits);
}

__device__ __forceinline__ int warp_max(int value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = max(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  return value;
}

// Four consecutive values (8 or 16 bytes, aligned: every offset below is a multiple of 4 elements).
__device__ __forceinline__ void load4(float (&x)[4], const float* p) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load4(float (&x)[4], const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  x[0] = __low2float(a), x[1] = __high2float(a), x[2] = __low2float(b), x[3] = __high2float(b);
}

// ---- 1x128 tiles along the rows: out [M,N] ---------------------------------------------
// One warp per (row, tile): lane l holds columns 4l..4l+3 of the tile. A ragged last tile
// (N not a multiple of 128; N a multiple of 16) leaves its upper lanes idle: they read and
// write nothing and add 0 to the amax. grid (ceil(N / 128), ceil(M / 8)).
template <typename T, Fp8Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    tiles_rowwise_kernel(uint8_t* __restrict__ out, float* __restrict__ scale_inv, const T* __restrict__ in, int M,
                         int N, int margin) {
  device::start_after_previous_kernel();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.y * kWarps + warp;
  if (r >= M) return;  // the whole warp leaves together
  const int tile = blockIdx.x;
  const bool active = 4 * lane < scale_tile_width(tile, N);
  const size_t at = static_cast<size_t>(r) * N + static_cast<size_t>(tile) * kScaleBlock + 4 * lane;
  float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (active) load4(x, in + at);
  int bits = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) bits = max(bits, amax_bits(x[j]));
  const float scale = block_scale(__int_as_float(warp_max(bits)), fp8_max(kDtype), margin);
  if (active) *reinterpret_cast<uint32_t*>(out + at) = codes4<kDtype>(x, scale);
  if (lane == 0) scale_inv[tile_scale_index(r, tile, M)] = 1.0f / scale;
}

// ---- 1x128 tiles along the columns, written transposed: out_t [N,M] ---------------------
// One block per 128 rows x 32 columns of in, staged in shared memory; warp w then quantizes
// columns 4w..4w+3, lane l holding rows 4l..4l+3, and writes each column's 128 codes as one
// row run of out_t. A ragged last row tile (M not a multiple of 128) or column slab (N not a
// multiple of 32) stages zeros outside the tensor and writes nothing there (M and N are
// multiples of 16, so 4 rows or 4 columns are in or out together). grid (ceil(N / 32), ceil(M / 128)).
constexpr int kSlabColumns = 32;

template <typename T, Fp8Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    tiles_columnwise_kernel(uint8_t* __restrict__ out_t, float* __restrict__ scale_inv_t, const T* __restrict__ in,
                            int M, int N, int margin) {
  device::start_after_previous_kernel();
  __shared__ float slab[kScaleBlock][kSlabColumns + 1];
  constexpr int kVec = 4;  // values per load
  constexpr int kThreadsPerRow = kSlabColumns / kVec;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  const int row0 = blockIdx.y * kScaleBlock, col0 = blockIdx.x * kSlabColumns;
  const int rows_here = min(kScaleBlock, M - row0), columns_here = min(kSlabColumns, N - col0);
#pragma unroll
  for (int pass = 0; pass < kScaleBlock / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + threadIdx.x / kThreadsPerRow;
    const int c = (threadIdx.x % kThreadsPerRow) * kVec;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r < rows_here && c < columns_here) load4(x, in + static_cast<size_t>(row0 + r) * N + col0 + c);
#pragma unroll
    for (int j = 0; j < 4; ++j) slab[r][c + j] = x[j];
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kSlabColumns / kWarps; ++i) {
    const int c = warp * (kSlabColumns / kWarps) + i;
    if (c >= columns_here) break;  // the same for the whole warp
    float x[4];
    int bits = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[j] = slab[4 * lane + j][c];
      bits = max(bits, amax_bits(x[j]));
    }
    const float scale = block_scale(__int_as_float(warp_max(bits)), fp8_max(kDtype), margin);
    if (4 * lane < rows_here)
      *reinterpret_cast<uint32_t*>(out_t + static_cast<size_t>(col0 + c) * M + row0 + 4 * lane) =
          codes4<kDtype>(x, scale);
    if (lane == 0) scale_inv_t[tile_scale_index(col0 + c, blockIdx.y, N)] = 1.0f / scale;
  }
}

// ---- 128x128 blocks: out [M,N], out_t [N,M] ------------------------------------------------
// One block of threads per 128x128 block. Thread t holds rows t/32 + 8p (p < 16), columns
// 4(t%32)..+3: 64 values in registers. The block's amax sets the one scale; the codes go to
// out row by row and, through shared memory, to out_t column by column. A ragged block (M or
// N not a multiple of 128, both multiples of 16) holds zeros outside the tensor and writes
// nothing there. grid (ceil(N / 128), ceil(M / 128)).
template <typename T, Fp8Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    blocks_kernel(uint8_t* __restrict__ out, float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                  float* __restrict__ scale_inv_t, const T* __restrict__ in, int M, int N, int margin) {
  device::start_after_previous_kernel();
  constexpr int kRowStep = kThreads / 32;            // rows apart between a thread's passes
  constexpr int kPasses = kScaleBlock / kRowStep;    // 16
  __shared__ uint32_t codes[kScaleBlock][kScaleBlock / 4 + 1];  // [row][4-column group], padded
  __shared__ int warp_amax[kWarps];
  const int row0 = blockIdx.y * kScaleBlock, col0 = blockIdx.x * kScaleBlock;
  const int height = min(kScaleBlock, M - row0), width = min(kScaleBlock, N - col0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool column_in = 4 * lane < width;
  float x[kPasses][4];
  int bits = 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = warp + kRowStep * p;
#pragma unroll
    for (int j = 0; j < 4; ++j) x[p][j] = 0.0f;
    if (r < height && column_in) load4(x[p], in + static_cast<size_t>(row0 + r) * N + col0 + 4 * lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) bits = max(bits, amax_bits(x[p][j]));
  }
  bits = warp_max(bits);
  if (lane == 0) warp_amax[warp] = bits;
  __syncthreads();
  bits = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) bits = max(bits, warp_amax[w]);
  const float scale = block_scale(__int_as_float(bits), fp8_max(kDtype), margin);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = warp + kRowStep * p;
    const uint32_t word = codes4<kDtype>(x[p], scale);
    if (r < height && column_in) *reinterpret_cast<uint32_t*>(out + static_cast<size_t>(row0 + r) * N + col0 + 4 * lane) = word;
    codes[r][lane] = word;
  }
  if (threadIdx.x == 0) {
    scale_inv[block_scale_index(blockIdx.y, blockIdx.x, N)] = 1.0f / scale;
    if (scale_inv_t) scale_inv_t[block_scale_index(blockIdx.x, blockIdx.y, M)] = 1.0f / scale;
  }
  if (out_t == nullptr) return;
  __syncthreads();
  // Thread t writes column c = t / 2 of the block, rows 64 (t % 2) .. +63, as 4 runs of 16
  // bytes (height is a multiple of 16: a run is in or out whole).
  const int c = threadIdx.x / 2, half = threadIdx.x % 2;
  if (c >= width) return;
  uint32_t run[16];
#pragma unroll
  for (int w = 0; w < 16; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int r = 64 * half + 4 * w + b;
      const uint32_t code = (codes[r][c / 4] >> (8 * (c % 4))) & 0xFFu;
      word |= code << (8 * b);
    }
    run[w] = word;
  }
  uint4* target = reinterpret_cast<uint4*>(out_t + static_cast<size_t>(col0 + c) * M + row0 + 64 * half);
#pragma unroll
  for (int q = 0; q < 4; ++q)
    if (64 * half + 16 * q < height) target[q] = make_uint4(run[4 * q], run[4 * q + 1], run[4 * q + 2], run[4 * q + 3]);
}

// ---- launchers ---------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
void launch_tiles(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, const T* in, int M, int N,
                  Fp8Dtype dtype, int margin, cudaStream_t stream) {
  FP8LM_CHECK(M > 0 && N > 0 && N % kBlockAlignment == 0, "quantize_tiles_1x128: shape [", M, ",", N,
              "] (N a multiple of 16)");
  FP8LM_CHECK((out_t == nullptr) == (scale_inv_t == nullptr), "quantize_tiles_1x128: out_t and scale_inv_t go together");
  FP8LM_CHECK(out_t == nullptr || M % kBlockAlignment == 0, "quantize_tiles_1x128: a transposed copy needs M (", M,
              ") a multiple of 16");
  FP8LM_CHECK(aligned16(in) && aligned16(out) && (out_t == nullptr || aligned16(out_t)),
              "quantize_tiles_1x128: 16-byte-aligned tensors");
  const dim3 rows_grid(unsigned(scale_tiles(N)), (M + kWarps - 1) / kWarps);
  FP8LM_CHECK(rows_grid.y <= 65535u, "quantize_tiles_1x128: too many rows, M=", M);
  if (dtype == Fp8Dtype::e4m3) {
    launch_kernel(tiles_rowwise_kernel<T, Fp8Dtype::e4m3>, rows_grid, kThreads, 0, stream, out, scale_inv, in, M, N,
                  margin);
  } else {
    launch_kernel(tiles_rowwise_kernel<T, Fp8Dtype::e5m2>, rows_grid, kThreads, 0, stream, out, scale_inv, in, M, N,
                  margin);
  }
  if (out_t == nullptr) return;
  const dim3 columns_grid((N + kSlabColumns - 1) / kSlabColumns, unsigned(scale_tiles(M)));
  FP8LM_CHECK(columns_grid.y <= 65535u, "quantize_tiles_1x128: too many rows, M=", M);
  if (dtype == Fp8Dtype::e4m3) {
    launch_kernel(tiles_columnwise_kernel<T, Fp8Dtype::e4m3>, columns_grid, kThreads, 0, stream, out_t, scale_inv_t, in,
                  M, N, margin);
  } else {
    launch_kernel(tiles_columnwise_kernel<T, Fp8Dtype::e5m2>, columns_grid, kThreads, 0, stream, out_t, scale_inv_t, in,
                  M, N, margin);
  }
}

template <typename T>
void launch_blocks(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, const T* in, int M, int N,
                   Fp8Dtype dtype, int margin, cudaStream_t stream) {
  FP8LM_CHECK(M > 0 && N > 0 && M % kBlockAlignment == 0 && N % kBlockAlignment == 0,
              "quantize_blocks_128x128: shape [", M, ",", N, "] (multiples of 16)");
  FP8LM_CHECK((out_t == nullptr) == (scale_inv_t == nullptr),
              "quantize_blocks_128x128: out_t and scale_inv_t go together");
  FP8LM_CHECK(aligned16(in) && aligned16(out) && (out_t == nullptr || aligned16(out_t)),
              "quantize_blocks_128x128: 16-byte-aligned tensors");
  const dim3 grid(unsigned(scale_tiles(N)), unsigned(scale_tiles(M)));
  FP8LM_CHECK(grid.y <= 65535u, "quantize_blocks_128x128: too many rows, M=", M);
  if (dtype == Fp8Dtype::e4m3) {
    launch_kernel(blocks_kernel<T, Fp8Dtype::e4m3>, grid, kThreads, 0, stream, out, scale_inv, out_t, scale_inv_t, in,
                  M, N, margin);
  } else {
    launch_kernel(blocks_kernel<T, Fp8Dtype::e5m2>, grid, kThreads, 0, stream, out, scale_inv, out_t, scale_inv_t, in,
                  M, N, margin);
  }
}

}  // namespace

void quantize_tiles_1x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                          const __nv_bfloat16* in, int M, int N, Fp8Dtype dtype, int margin, cudaStream_t stream) {
  launch_tiles(out, scale_inv, out_t, scale_inv_t, in, M, N, dtype, margin, stream);
}
void quantize_tiles_1x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, const float* in, int M,
                          int N, Fp8Dtype dtype, int margin, cudaStream_t stream) {
  launch_tiles(out, scale_inv, out_t, scale_inv_t, in, M, N, dtype, margin, stream);
}
void quantize_blocks_128x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                             const __nv_bfloat16* in, int M, int N, Fp8Dtype dtype, int margin, cudaStream_t stream) {
  launch_blocks(out, scale_inv, out_t, scale_inv_t, in, M, N, dtype, margin, stream);
}
void quantize_blocks_128x128(uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t, const float* in,
                             int M, int N, Fp8Dtype dtype, int margin, cudaStream_t stream) {
  launch_blocks(out, scale_inv, out_t, scale_inv_t, in, M, N, dtype, margin, stream);
}

}  // namespace fp8lm::cuda
