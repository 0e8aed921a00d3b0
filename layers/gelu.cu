// GELU kernels (see layers/gelu.h and docs/GPU_DESIGN.md).
//
// Forward: elementwise over chunks of 8 (16-byte loads), bias add + GELU + (FP8 cast or
// BF16 store) in one pass; the bf16(pre + bias) is written back for the backward.
//
// Backward: one 256-thread block per 64x64 tile of [M,F]. Each thread reads two chunks of
// 8 (rows r and r+32 of the tile), computes dpre = bf16(dout * gelu'(pre)), writes the
// row-major result (FP8 codes or bf16) directly, and, for FP8, the codes into a shared tile
// from which the block writes the transposed layout [F,M] with coalesced stores. dbias:
// per-tile column sums in a fixed order into scratch [ceil(M/64)][F], then a second kernel
// sums the tiles in a fixed order. No floating-point atomics: bit-reproducible.
#include "layers/gelu.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/code_tile.cuh"
#include "core/device_helpers.cuh"
#include "core/check_cuda.h"
#include "core/error.h"
#include "core/fp8_stats.cuh"
#include "core/launch.cuh"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2/pi), as cpu::gelu
constexpr float kCubicCoefficient = 0.044715f;

constexpr int kForwardThreads = 256;
constexpr int kForwardMaxBlocks = 4096;
constexpr int kTile = kCodeTile;  // backward tile: 64 rows x 64 columns (core/code_tile.cuh)
constexpr int kTileThreads = kCodeTileThreads;
constexpr int kCodePitch = kCodeTilePitch;

// ---- small device helpers ------------------------------------------------------------

__device__ __forceinline__ float gelu_derivative(float x) {
  const float u = kSqrt2OverPi * (x + kCubicCoefficient * x * x * x);
  const float tanh_u = tanhf(u);
  const float du_dx = kSqrt2OverPi * (1.0f + 3.0f * kCubicCoefficient * x * x);
  return 0.5f * (1.0f + tanh_u) + 0.5f * x * (1.0f - tanh_u * tanh_u) * du_dx;
}

// The FP8 cast statistics of eight values v (already bf16-rounded) cast with s into `packed`.
__device__ __forceinline__ void tally_fp8x8(Fp8CastTally& tally, const float (&v)[8], float s, uint2 packed,
                                            __nv_fp8_interpretation_t interp) {
  const Fp8Dtype dtype = interp == __NV_E4M3 ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2;
#pragma unroll
  for (int j = 0; j < 8; j++) tally.add(v[j], v[j] * s, fp8_code_at(j < 4 ? packed.x : packed.y, j % 4), dtype);
}

// ---- forward ---------------------------------------------------------------------------

// kStats (with kFp8): also tallies the FP8 cast statistics into *counts.
template <bool kFp8, bool kStats = false>
__global__ void __launch_bounds__(kForwardThreads)
    bias_gelu_forward_kernel(bf16* __restrict__ out_bf16, uint8_t* __restrict__ out_fp8, float* amax,
                             const float* __restrict__ scale, __nv_fp8_interpretation_t interp, bf16* __restrict__ pre,
                             const bf16* __restrict__ bias, int M, int F, Fp8CastCounts* counts) {
  device::start_after_previous_kernel();
  static_assert(kFp8 || !kStats, "statistics describe FP8 casts");
  const size_t chunks_per_row = static_cast<size_t>(F / 8);
  const size_t total = static_cast<size_t>(M) * chunks_per_row;
  const float s = kFp8 ? *scale : 1.0f;
  unsigned amax_local = 0u;
  Fp8CastTally tally;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(i % chunks_per_row) * 8;
    const size_t offset = i * 8;  // = row * F + col
    float p[8], b[8], g[8];
    load_bf16x8(pre + offset, p);
    load_bf16x8(bias + col, b);
#pragma unroll
    for (int j = 0; j < 8; j++) p[j] = round_bf16(p[j] + b[j]);
    store_bf16x8(pre + offset, p);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = gelu_tanh(p[j]);
    if constexpr (kFp8) {
#pragma unroll
      for (int j = 0; j < 8; j++) {
        g[j] = round_bf16(g[j]);
        amax_local = max(amax_local, abs_bits(g[j]));
      }
      const uint2 packed = fp8x8(g, s, interp);
      *reinterpret_cast<uint2*>(out_fp8 + offset) = packed;
      if constexpr (kStats) tally_fp8x8(tally, g, s, packed, interp);
    } else {
      store_bf16x8(out_bf16 + offset, g);
    }
  }
  if constexpr (kFp8) block_amax_update(amax, amax_local);
  if constexpr (kStats) commit_fp8_tally(counts, tally, s);
}

// The cast statistics of fp8(bf16(gelu(pre)) * scale), as bias_gelu_forward_kernel<true, true>
// tallies them, from the saved pre (the bias already in it); no output.
__global__ void __launch_bounds__(kForwardThreads)
    count_gelu_fp8_cast_kernel(Fp8CastCounts* counts, const float* __restrict__ scale,
                               __nv_fp8_interpretation_t interp, const bf16* __restrict__ pre, size_t chunks) {
  device::start_after_previous_kernel();
  const float s = *scale;
  Fp8CastTally tally;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float p[8], g[8];
    load_bf16x8(pre + i * 8, p);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = round_bf16(gelu_tanh(p[j]));
    tally_fp8x8(tally, g, s, fp8x8(g, s, interp), interp);
  }
  commit_fp8_tally(counts, tally, s);
}

// ---- backward --------------------------------------------------------------------------

// Grid (ceil(F/64), ceil(M/64)), 256 threads. partials [gridDim.y][F].
// kStats (with kFp8): also tallies the FP8 cast statistics into *counts.
// kRecompute (with kFp8): also writes gelu(pre) cast with *gelu_scale, transposed, into gelu_t.
template <bool kFp8, bool kStats = false, bool kRecompute = false>
__global__ void __launch_bounds__(kTileThreads)
    gelu_backward_tile_kernel(uint8_t* dpre_fp8, uint8_t* __restrict__ dpre_t, bf16* dpre_bf16,
                              float* __restrict__ partials, float* amax, const float* __restrict__ scale,
                              __nv_fp8_interpretation_t interp, const bf16* dout, const bf16* __restrict__ pre, int M,
                              int F, Fp8CastCounts* counts, uint8_t* __restrict__ gelu_t,
                              const float* __restrict__ gelu_scale, __nv_fp8_interpretation_t gelu_interp) {
  device::start_after_previous_kernel();
  static_assert(kFp8 || !kStats, "statistics describe FP8 casts");
  static_assert(kFp8 || !kRecompute, "the recomputed output is the FP8 path's");
  __shared__ float column_sums[32][kTile];               // [row group][tile column]
  __shared__ alignas(16) uint8_t codes[kTile * kCodePitch];  // [tile row][tile column], FP8 only
  __shared__ alignas(16) uint8_t gelu_codes[kRecompute ? kTile * kCodePitch : 4];
  const int tid = threadIdx.x;
  const int chunk = tid % 8;       // column chunk: tile columns chunk*8 .. chunk*8+7
  const int row_group = tid / 8;   // tile rows row_group and row_group + 32
  const int m0 = blockIdx.y * kTile, f0 = blockIdx.x * kTile;
  const int f = f0 + chunk * 8;    // F % 8 == 0: a chunk is all in or all out
  const float s = kFp8 ? *scale : 1.0f;
  const float gs = kRecompute ? *gelu_scale : 1.0f;

  float colsum[8];
#pragma unroll
  for (int j = 0; j < 8; j++) colsum[j] = 0.0f;
  unsigned amax_local = 0u;
  Fp8CastTally tally;

#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = row_group + 32 * h;
    const int m = m0 + r;
    uint2 packed = make_uint2(0u, 0u), gelu_packed = make_uint2(0u, 0u);
    if (m < M && f < F) {
      const size_t offset = static_cast<size_t>(m) * F + f;
      float dy[8], x[8], d[8];
      load_bf16x8(dout + offset, dy);
      load_bf16x8(pre + offset, x);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        d[j] = round_bf16(dy[j] * gelu_derivative(x[j]));
        colsum[j] += d[j];
      }
      if constexpr (kFp8) {
#pragma unroll
        for (int j = 0; j < 8; j++) amax_local = max(amax_local, abs_bits(d[j]));
        packed = fp8x8(d, s, interp);
        *reinterpret_cast<uint2*>(dpre_fp8 + offset) = packed;
        if constexpr (kStats) tally_fp8x8(tally, d, s, packed, interp);
        if constexpr (kRecompute) {
          float g[8];  // as bias_gelu_forward_kernel computes and rounds it
#pragma unroll
          for (int j = 0; j < 8; j++) g[j] = round_bf16(gelu_tanh(x[j]));
          gelu_packed = fp8x8(g, gs, gelu_interp);
        }
      } else {
        store_bf16x8(dpre_bf16 + offset, d);  // same thread read this chunk of dout: in place is safe
      }
    }
    if constexpr (kFp8) {
      uint32_t* code_words = reinterpret_cast<uint32_t*>(codes + r * kCodePitch + chunk * 8);
      code_words[0] = packed.x;
      code_words[1] = packed.y;
    }
    if constexpr (kRecompute) {
      uint32_t* code_words = reinterpret_cast<uint32_t*>(gelu_codes + r * kCodePitch + chunk * 8);
      code_words[0] = gelu_packed.x;
      code_words[1] = gelu_packed.y;
    }
  }

#pragma unroll
  for (int j = 0; j < 8; j++) column_sums[row_group][chunk * 8 + j] = colsum[j];
  __syncthreads();

  // dbias partial of this tile: rows summed in a fixed order (r, r+32 per thread, then groups 0..31).
  if (tid < kTile && f0 + tid < F) {
    float sum = 0.0f;
#pragma unroll 8
    for (int g = 0; g < 32; g++) sum += column_sums[g][tid];
    partials[static_cast<size_t>(blockIdx.y) * F + f0 + tid] = sum;
  }

  if constexpr (kFp8) {
    // Transposed codes: dpre_t[f][m] for the tile's 64 columns f and 64 rows m.
    store_code_tile_transposed(dpre_t, codes, m0, f0, M, F, tid);
    if constexpr (kRecompute) store_code_tile_transposed(gelu_t, gelu_codes, m0, f0, M, F, tid);
    block_amax_update(amax, amax_local);
    if constexpr (kStats) commit_fp8_tally(counts, tally, s);
  }
}

// Grid (ceil(F/64), ceil(M/64)), 256 threads: gelu_t [F,M] = fp8(bf16(gelu(pre)) * *scale),
// the forward's codes transposed, for the GELU backward's current-scaling path (whose gradient
// is cast only once its amax is known, so it cannot share the fused kernel's pass).
__global__ void __launch_bounds__(kTileThreads)
    gelu_recompute_transposed_kernel(uint8_t* __restrict__ gelu_t, const float* __restrict__ scale,
                                     __nv_fp8_interpretation_t interp, const bf16* __restrict__ pre, int M, int F) {
  device::start_after_previous_kernel();
  __shared__ alignas(16) uint8_t codes[kTile * kCodePitch];
  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * kTile, f0 = blockIdx.x * kTile;
  stage_code_tile(codes, m0, f0, M, F, tid, *scale, interp, [&](int m, int f, float (&g)[8]) {
    float x[8];
    load_bf16x8(pre + static_cast<size_t>(m) * F + f, x);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = round_bf16(gelu_tanh(x[j]));
  });
  __syncthreads();
  store_code_tile_transposed(gelu_t, codes, m0, f0, M, F, tid);
}

// ---- host side -------------------------------------------------------------------------

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

__nv_fp8_interpretation_t interpretation(Fp8Dtype dtype) {
  return dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2;
}

void check_shape(int M, int F, const char* what) {
  FP8LM_CHECK(M >= 0, what, ": M must be >= 0, got ", M);
  FP8LM_CHECK(F > 0 && F % 8 == 0, what, ": F must be a positive multiple of 8, got ", F);
  FP8LM_CHECK((M + kTile - 1) / kTile <= 65535, what, ": M too large for the tile grid, got ", M);
}

template <bool kFp8, bool kStats = false>
void launch_forward(bf16* out_bf16, uint8_t* out_fp8, float* amax, const float* scale, Fp8Dtype dtype, bf16* pre,
                    const bf16* bias, int M, int F, cudaStream_t stream, Fp8CastCounts* counts = nullptr) {
  const char* what = kFp8 ? "bias_gelu_forward_fp8" : "bias_gelu_forward_bf16";
  check_shape(M, F, what);
  FP8LM_CHECK(pre != nullptr && bias != nullptr, what, ": null pre or bias");
  FP8LM_CHECK(aligned(pre, 16) && aligned(bias, 16), what, ": pre and bias must be 16-byte aligned");
  if constexpr (kFp8) {
    FP8LM_CHECK(out_fp8 != nullptr && scale != nullptr, what, ": null out or scale");
    FP8LM_CHECK(aligned(out_fp8, 8), what, ": out must be 8-byte aligned");
    FP8LM_CHECK(amax == nullptr || aligned(amax, 4), what, ": amax must be 4-byte aligned");
  } else {
    FP8LM_CHECK(out_bf16 != nullptr, what, ": null out");
    FP8LM_CHECK(aligned(out_bf16, 16), what, ": out must be 16-byte aligned");
    FP8LM_CHECK(out_bf16 != pre, what, ": out must not alias pre");
  }
  if (M == 0) return;
  const size_t total = static_cast<size_t>(M) * (F / 8);
  const int blocks = static_cast<int>(std::min<size_t>((total + kForwardThreads - 1) / kForwardThreads, kForwardMaxBlocks));
  launch_kernel(bias_gelu_forward_kernel<kFp8, kStats>, blocks, kForwardThreads, 0, stream, out_bf16, out_fp8, amax,
                scale, interpretation(dtype), pre, bias, M, F, counts);
}

template <bool kFp8, bool kStats = false, bool kRecompute = false>
void launch_backward(uint8_t* dpre_fp8, uint8_t* dpre_t, bf16* dpre_bf16, GradientRef dbias, float* amax,
                     const float* scale, Fp8Dtype dtype, const bf16* dout, const bf16* pre, int M, int F,
                     float* scratch, cudaStream_t stream, Fp8CastCounts* counts = nullptr,
                     GeluRecomputedOutput recomputed = {}) {
  const char* what = kFp8 ? "gelu_backward_cast_transpose_dbias_fp8" : "gelu_backward_dbias_bf16";
  check_shape(M, F, what);
  FP8LM_CHECK(dbias && dout != nullptr && pre != nullptr && scratch != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(dout, 16) && aligned(pre, 16), what, ": dout and pre must be 16-byte aligned");
  if constexpr (kFp8) {
    FP8LM_CHECK(dpre_fp8 != nullptr && dpre_t != nullptr && scale != nullptr, what, ": null dpre, dpre_t or scale");
    FP8LM_CHECK(aligned(dpre_fp8, 8), what, ": dpre must be 8-byte aligned");
    FP8LM_CHECK(aligned(dpre_t, 16), what, ": dpre_t must be 16-byte aligned");
    FP8LM_CHECK(amax == nullptr || aligned(amax, 4), what, ": amax must be 4-byte aligned");
    if constexpr (kRecompute) {
      FP8LM_CHECK(recomputed.codes_t != nullptr && recomputed.scale != nullptr, what,
                  ": null recomputed output or scale");
      FP8LM_CHECK(aligned(recomputed.codes_t, 16), what, ": the recomputed output must be 16-byte aligned");
    }
  } else {
    FP8LM_CHECK(dpre_bf16 != nullptr, what, ": null dpre");
    FP8LM_CHECK(aligned(dpre_bf16, 16), what, ": dpre must be 16-byte aligned");
  }
  if (M == 0) return;
  const int row_tiles = (M + kTile - 1) / kTile;
  const dim3 grid((F + kTile - 1) / kTile, row_tiles);
  launch_kernel(gelu_backward_tile_kernel<kFp8, kStats, kRecompute>, grid, kTileThreads, 0, stream, dpre_fp8, dpre_t,
                dpre_bf16, scratch, amax, scale, interpretation(dtype), dout, pre, M, F, counts, recomputed.codes_t,
                recomputed.scale, interpretation(recomputed.dtype));
  launch_kernel(add_column_sums_kernel, (F + 31) / 32, dim3(32, 8), 0, stream, dbias, GradientRef{}, F, scratch,
                row_tiles, F);
}

}  // namespace

void bias_gelu_forward_fp8(uint8_t* out, float* amax, const float* scale, Fp8Dtype dtype, bf16* pre, const bf16* bias,
                           int M, int F, cudaStream_t stream, Fp8CastCounts* counts) {
  if (counts) return launch_forward<true, true>(nullptr, out, amax, scale, dtype, pre, bias, M, F, stream, counts);
  launch_forward<true>(nullptr, out, amax, scale, dtype, pre, bias, M, F, stream);
}

void count_gelu_fp8_cast(Fp8CastCounts* counts, const bf16* pre, const float* scale, Fp8Dtype dtype, int M, int F,
                         cudaStream_t stream) {
  const char* what = "count_gelu_fp8_cast";
  check_shape(M, F, what);
  FP8LM_CHECK(counts != nullptr && pre != nullptr && scale != nullptr, what, ": null counts, pre or scale");
  FP8LM_CHECK(aligned(pre, 16), what, ": pre must be 16-byte aligned");
  if (M == 0) return;
  const size_t chunks = static_cast<size_t>(M) * (F / 8);
  const int blocks = static_cast<int>(std::min<size_t>((chunks + kForwardThreads - 1) / kForwardThreads, kForwardMaxBlocks));
  launch_kernel(count_gelu_fp8_cast_kernel, blocks, kForwardThreads, 0, stream, counts, scale, interpretation(dtype),
                pre, chunks);
}

void bias_gelu_forward_bf16(bf16* out, bf16* pre, const bf16* bias, int M, int F, cudaStream_t stream) {
  launch_forward<false>(out, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, pre, bias, M, F, stream);
}

size_t gelu_backward_scratch_floats(int M, int F) {
  return static_cast<size_t>((std::max(M, 0) + kTile - 1) / kTile) * static_cast<size_t>(std::max(F, 0));
}

void gelu_backward_cast_transpose_dbias_fp8(uint8_t* dpre, uint8_t* dpre_t, GradientRef dbias, float* amax,
                                            const float* scale, Fp8Dtype dtype, const bf16* dout, const bf16* pre,
                                            int M, int F, float* scratch, cudaStream_t stream,
                                            Fp8CastCounts* counts, GeluRecomputedOutput recomputed) {
  const bool recompute = recomputed.codes_t != nullptr;
  if (counts && recompute) {
    return launch_backward<true, true, true>(dpre, dpre_t, nullptr, dbias, amax, scale, dtype, dout, pre, M, F,
                                             scratch, stream, counts, recomputed);
  }
  if (counts) {
    return launch_backward<true, true>(dpre, dpre_t, nullptr, dbias, amax, scale, dtype, dout, pre, M, F, scratch,
                                       stream, counts);
  }
  if (recompute) {
    return launch_backward<true, false, true>(dpre, dpre_t, nullptr, dbias, amax, scale, dtype, dout, pre, M, F,
                                              scratch, stream, nullptr, recomputed);
  }
  launch_backward<true>(dpre, dpre_t, nullptr, dbias, amax, scale, dtype, dout, pre, M, F, scratch, stream);
}

void gelu_recompute_transposed_fp8(GeluRecomputedOutput out, const bf16* pre, int M, int F, cudaStream_t stream) {
  const char* what = "gelu_recompute_transposed_fp8";
  check_shape(M, F, what);
  FP8LM_CHECK(out.codes_t != nullptr && out.scale != nullptr && pre != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(out.codes_t, 16) && aligned(pre, 16), what, ": codes_t and pre must be 16-byte aligned");
  if (M == 0) return;
  const dim3 grid((F + kTile - 1) / kTile, (M + kTile - 1) / kTile);
  launch_kernel(gelu_recompute_transposed_kernel, grid, kTileThreads, 0, stream, out.codes_t, out.scale,
                interpretation(out.dtype), pre, M, F);
}

void gelu_backward_dbias_bf16(bf16* dpre, GradientRef dbias, const bf16* dout, const bf16* pre, int M, int F,
                              float* scratch, cudaStream_t stream) {
  launch_backward<false>(nullptr, nullptr, dpre, dbias, nullptr, nullptr, Fp8Dtype::e4m3, dout, pre, M, F, scratch,
                         stream);
}

}  // namespace fp8lm::cuda
