// LayerNorm kernels (see layers/layernorm.h and docs/GPU_DESIGN.md).
//
// Forward: one warp per row; each lane holds chunks lane, lane+32, ... of 8 bf16 (one
// 16-byte load each) in registers, packed as BF16 (every row value is a BF16 number, so
// nothing is lost, and a 4096-wide row takes 64 registers a lane), so the row is read from
// memory once. Mean and variance
// are FP32 warp reductions in two passes over the registers (as the CPU reference).
// The FP8 variant rounds each output to BF16 first and quantizes that, so its codes are
// those of a cast of the BF16 output. The residual variant builds the row from
// residual_in + (branch + branch_bias) instead of loading it, rounds it to BF16, writes it
// back as the new residual stream and continues with the rounded values in registers: from
// there on the code is the plain kernel's, so the results are bit for bit those of the plain
// kernel run on the stored residual.
//
// Backward, rows up to 2048 wide: one pass. A block takes a run of rows, two at a time, a
// thread for each 8 columns, and keeps its columns' weight and bias gradient sums in registers
// over the run; each block's sums go to scratch. Wider rows: two kernels, the input gradient
// one warp per row, then the weight and bias gradients apart as a column reduction over row
// splits into scratch. Either way a last kernel adds the partial sums in a fixed order into
// dweight/dbias. No floating-point atomics: bit-reproducible.
#include "layers/layernorm.h"

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

constexpr int kWarpsPerBlock = 8;  // rows per block (forward), warps per block (backward)
constexpr int kThreads = kWarpsPerBlock * 32;

// ---- small device helpers ------------------------------------------------------------

// One output element from its row's statistics: the forward and the operand recomputed for
// the backward both take it from here, so their codes agree bit for bit.
__device__ __forceinline__ float layernorm_element(float x, float row_mean, float row_rstd, float w, float b) {
  return (x - row_mean) * row_rstd * w + b;
}

// LayerNorm backward of one row, in the two passes both backward kernels make over it:
// first g = dy * w and the row sums of g and g * xhat (xhat = (x - mean) * rstd), then
// dx += rstd * (g - mean(g) - xhat * mean(g * xhat)) with those means.
__device__ __forceinline__ void add_row_sums(const float (&x)[8], const float (&dy)[8], const float (&w)[8],
                                             float row_mean, float row_rstd, float& sum_g, float& sum_g_xhat) {
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const float xhat = (x[j] - row_mean) * row_rstd;
    const float g = dy[j] * w[j];
    sum_g += g;
    sum_g_xhat += g * xhat;
  }
}
__device__ __forceinline__ void add_input_gradient(float (&dx)[8], const float (&x)[8], const float (&dy)[8],
                                                   const float (&w)[8], float row_mean, float row_rstd,
                                                   float mean_g, float mean_g_xhat) {
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const float xhat = (x[j] - row_mean) * row_rstd;
    const float g = dy[j] * w[j];
    dx[j] += row_rstd * (g - mean_g - xhat * mean_g_xhat);
  }
}

// ---- forward ---------------------------------------------------------------------------

// The residual add of the residual variant (unused by the plain one). No __restrict__: out
// may alias in (in place; each lane reads its chunks before it writes them).
struct ResidualArgs {
  bf16* out;                // [N,C]
  const bf16* in;           // [N,C]
  const bf16* branch;       // [N,C]
  const bf16* branch_bias;  // [C], nullable
};

// K: chunks of 8 per lane (the row width is at most K * 32 * 8).
// kResidual: the row is residual.in + (residual.branch + residual.branch_bias), rounded to
// BF16 and stored to residual.out; inp is unused. Otherwise the row is inp and residual unused.
// kStats (with kFp8): also tallies the FP8 cast statistics into *counts.
template <int K, bool kFp8, bool kResidual, bool kStats = false>
__global__ void __launch_bounds__(kThreads)
    layernorm_forward_kernel(bf16* __restrict__ out_bf16, uint8_t* __restrict__ out_fp8, float* amax,
                             const float* __restrict__ scale, __nv_fp8_interpretation_t interp,
                             float* __restrict__ mean, float* __restrict__ rstd, const bf16* __restrict__ inp,
                             ResidualArgs residual, const bf16* __restrict__ weight, const bf16* __restrict__ bias,
                             int N, int C, float eps, Fp8CastCounts* counts) {
  device::start_after_previous_kernel();
  static_assert(kFp8 || !kStats, "statistics describe FP8 casts");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarpsPerBlock + warp;
  const int chunks = C / 8;
  unsigned amax_local = 0u;
  Fp8CastTally tally;

  if (row < N) {  // warp-uniform
    uint4 packed[K];  // the row's chunks, BF16
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = lane + 32 * k;
      if (i < chunks) {
        const size_t offset = static_cast<size_t>(row) * C + static_cast<size_t>(i) * 8;
        float x[8];
        if constexpr (kResidual) {
          float r[8], b[8];
          load_bf16x8(residual.in + offset, r);
          load_bf16x8(residual.branch + offset, b);
          if (residual.branch_bias != nullptr) {  // uniform
            float bb[8];
            load_bf16x8(residual.branch_bias + i * 8, bb);
#pragma unroll
            for (int j = 0; j < 8; j++) b[j] += bb[j];
          }
          // One rounding: the BF16 value stored is the value normalized below.
#pragma unroll
          for (int j = 0; j < 8; j++) x[j] = r[j] + b[j];
          packed[k] = pack_bf16x8(x);
          *reinterpret_cast<uint4*>(residual.out + offset) = packed[k];
          unpack_bf16x8(packed[k], x);
        } else {
          packed[k] = *reinterpret_cast<const uint4*>(inp + offset);
          unpack_bf16x8(packed[k], x);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) sum += x[j];
      }
    }
    sum = warp_sum(sum);
    const float row_mean = sum / C;

    float squared_deviation = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      if (lane + 32 * k < chunks) {
        float x[8];
        unpack_bf16x8(packed[k], x);
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const float d = x[j] - row_mean;
          squared_deviation += d * d;
        }
      }
    }
    squared_deviation = warp_sum(squared_deviation);
    const float row_rstd = 1.0f / sqrtf(squared_deviation / C + eps);

    const float s = kFp8 ? *scale : 1.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = lane + 32 * k;
      if (i < chunks) {
        float x[8], w[8], b[8], y[8];
        unpack_bf16x8(packed[k], x);
        load_bf16x8(weight + i * 8, w);
        load_bf16x8(bias + i * 8, b);
#pragma unroll
        for (int j = 0; j < 8; j++) y[j] = layernorm_element(x[j], row_mean, row_rstd, w[j], b[j]);
        const size_t offset = static_cast<size_t>(row) * C + static_cast<size_t>(i) * 8;
        if constexpr (kFp8) {
#pragma unroll
          for (int j = 0; j < 8; j++) {
            y[j] = round_bf16(y[j]);
            amax_local = max(amax_local, abs_bits(y[j]));
          }
          const uint2 codes = fp8x8(y, s, interp);
          const uint32_t word[2] = {codes.x, codes.y};
          *reinterpret_cast<uint2*>(out_fp8 + offset) = codes;
          if constexpr (kStats) {
            const Fp8Dtype dtype = interp == __NV_E4M3 ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2;
#pragma unroll
            for (int j = 0; j < 8; j++) tally.add(y[j], y[j] * s, device::fp8_code_at(word[j / 4], j % 4), dtype);
          }
        } else {
          store_bf16x8(out_bf16 + offset, y);
        }
      }
    }
    if (lane == 0) {
      if (mean != nullptr) mean[row] = row_mean;
      if (rstd != nullptr) rstd[row] = row_rstd;
    }
  }
  if constexpr (kFp8) block_amax_update(amax, amax_local);
  if constexpr (kStats) device::commit_fp8_tally(counts, tally, kFp8 ? *scale : 1.0f);
}

// Grid (ceil(C/64), ceil(N/64)), 256 threads: out_t [C,N] = fp8(bf16(LayerNorm(inp)) * *scale)
// from the forward's mean and rstd: layernorm_forward_fp8's codes transposed (the same
// elements rounded the same way), for the wgrad GEMM of the Linear the LayerNorm feeds.
__global__ void __launch_bounds__(kCodeTileThreads)
    layernorm_operand_transposed_kernel(uint8_t* __restrict__ out_t, const float* __restrict__ scale,
                                        __nv_fp8_interpretation_t interp, const bf16* __restrict__ inp,
                                        const float* __restrict__ mean, const float* __restrict__ rstd,
                                        const bf16* __restrict__ weight, const bf16* __restrict__ bias, int N,
                                        int C) {
  device::start_after_previous_kernel();
  __shared__ alignas(16) uint8_t codes[kCodeTile * kCodeTilePitch];
  const int tid = threadIdx.x;
  const int n0 = blockIdx.y * kCodeTile, c0 = blockIdx.x * kCodeTile;
  const int c = c0 + (tid % 8) * 8;  // this thread's 8 columns, the same in both of its rows
  float w[8], b[8];
  if (c < C) {
    load_bf16x8(weight + c, w);
    load_bf16x8(bias + c, b);
  }
  stage_code_tile(codes, n0, c0, N, C, tid, *scale, interp, [&](int n, int, float (&y)[8]) {
    float x[8];
    load_bf16x8(inp + static_cast<size_t>(n) * C + c, x);
    const float row_mean = mean[n], row_rstd = rstd[n];
#pragma unroll
    for (int j = 0; j < 8; j++) y[j] = round_bf16(layernorm_element(x[j], row_mean, row_rstd, w[j], b[j]));
  });
  __syncthreads();
  store_code_tile_transposed(out_t, codes, n0, c0, N, C, tid);
}

// ---- backward --------------------------------------------------------------------------

// Rows wider than 2048 (K > 8): two kernels. dinp [N,C] += the input gradient, one warp per
// row (grid-strided over rows); the weight and bias gradients are a column reduction over
// the rows, done apart by the kernel below. (Kept in registers, their 16 * K per-lane partial
// sums held a whole block and left one block per multiprocessor at C = 1600, 706 GB/s on an
// H100; in shared memory, as the one-pass kernel keeps them, a 4096-wide row leaves two warps
// a block and is 1.31x slower than these two kernels: device call 40.)
template <int K>
__global__ void __launch_bounds__(kThreads)
    layernorm_backward_input_kernel(bf16* __restrict__ dinp, const bf16* __restrict__ dout,
                                    const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                                    const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C) {
  device::start_after_previous_kernel();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = C / 8;
  const int total_warps = gridDim.x * kWarpsPerBlock;
  for (int row = blockIdx.x * kWarpsPerBlock + warp; row < N; row += total_warps) {  // warp-uniform
    const size_t row_offset = static_cast<size_t>(row) * C;
    const float row_mean = mean[row];
    const float row_rstd = rstd[row];
    // Pass 1: the two row sums. Pass 2 reloads the row (an L1/L2 hit) rather than keeping
    // it in registers.
    float sum_g = 0.0f, sum_g_xhat = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = lane + 32 * k;
      if (i < chunks) {
        float x[8], dy[8], w[8];
        load_bf16x8(inp + row_offset + i * 8, x);
        load_bf16x8(dout + row_offset + i * 8, dy);
        load_bf16x8(weight + i * 8, w);
        add_row_sums(x, dy, w, row_mean, row_rstd, sum_g, sum_g_xhat);
      }
    }
    sum_g = warp_sum(sum_g);
    sum_g_xhat = warp_sum(sum_g_xhat);
    const float mean_g = sum_g / C;
    const float mean_g_xhat = sum_g_xhat / C;

#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = lane + 32 * k;
      if (i < chunks) {
        float x[8], dy[8], w[8], dx[8];
        load_bf16x8(inp + row_offset + i * 8, x);
        load_bf16x8(dout + row_offset + i * 8, dy);
        load_bf16x8(weight + i * 8, w);
        load_bf16x8(dinp + row_offset + i * 8, dx);
        add_input_gradient(dx, x, dy, w, row_mean, row_rstd, mean_g, mean_g_xhat);
        store_bf16x8(dinp + row_offset + i * 8, dx);
      }
    }
  }
}

// The weight and bias gradients' partial sums: block (32, 8) over 64 columns (two per thread,
// one 4-byte load of each operand) and row split blockIdx.y, rows [split * rows_per_split,
// ...); thread row ty sums rows ty, ty + 8, ... of the split in order, then the 8 sums are
// added in order. scratch [splits][2C]: dweight partials, then dbias partials. Deterministic.
constexpr int kParamColumns = 64;
__global__ void __launch_bounds__(kThreads)
    layernorm_backward_params_kernel(float* __restrict__ scratch, const bf16* __restrict__ dout,
                                     const bf16* __restrict__ inp, const float* __restrict__ mean,
                                     const float* __restrict__ rstd, int N, int C, int rows_per_split) {
  device::start_after_previous_kernel();
  __shared__ float sums[8][4][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * kParamColumns + 2 * tx;
  const int row_begin = blockIdx.y * rows_per_split;
  const int row_end = min(N, row_begin + rows_per_split);
  float dw0 = 0.0f, dw1 = 0.0f, db0 = 0.0f, db1 = 0.0f;
  if (col < C) {  // C is even: col + 1 < C too
    for (int row = row_begin + ty; row < row_end; row += 8) {
      const size_t at = static_cast<size_t>(row) * C + col;
      const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp + at));
      const float2 dy = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + at));
      const float row_mean = mean[row], row_rstd = rstd[row];
      dw0 += dy.x * ((x.x - row_mean) * row_rstd);
      dw1 += dy.y * ((x.y - row_mean) * row_rstd);
      db0 += dy.x;
      db1 += dy.y;
    }
  }
  sums[ty][0][tx] = dw0;
  sums[ty][1][tx] = dw1;
  sums[ty][2][tx] = db0;
  sums[ty][3][tx] = db1;
  __syncthreads();
  if (ty < 4 && col < C) {  // thread row q finishes quantity q: dw0, dw1, db0, db1
    float total = sums[0][ty][tx];
#pragma unroll
    for (int g = 1; g < 8; g++) total += sums[g][ty][tx];
    float* partial = scratch + static_cast<size_t>(blockIdx.y) * 2 * C;
    partial[(ty >= 2 ? C : 0) + col + (ty & 1)] = total;
  }
}

// One pass, rows up to 2048 wide: dinp [N,C] += the input gradient, and the weight and bias
// gradients' sums over the block's rows into partials [blocks][2C] (dweight's, then dbias's).
// A block takes the rows [blockIdx.x * rows_per_block, ...) kR at a time, and thread t owns
// columns 8t .. 8t + 7 of every row (one 16-byte chunk; threads past C / 8 hold zeros): so the
// weight and bias sums stay in 16 registers a thread for all its rows, and x, dy and dinp of
// kR rows are loaded at once, before any arithmetic waits on them. Each row's two sums are
// added over the warp (a butterfly: every lane the same bits), then over the warps in order
// through shared memory, one barrier for kR rows. Every sum has a fixed order for a given grid
// (a function of N and C: backward_rows_per_block), so the gradients are bit-reproducible.
// (Before, a warp took a row at a time and added its terms into its own 2C floats of shared
// memory: 65 us a call with the column sums at gpt2-1558m's width, 1.6 TB/s; this kernel 49 us,
// 2.15 TB/s, and the same at gpt2-124m's width 768; calls 125-126.)
template <int kR>
__global__ void __launch_bounds__(kThreads)
    layernorm_backward_kernel(bf16* __restrict__ dinp, float* __restrict__ partials, const bf16* __restrict__ dout,
                              const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                              const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C,
                              int rows_per_block) {
  device::start_after_previous_kernel();
  __shared__ float2 warp_row_sums[2][kWarpsPerBlock][kR];  // (sum g, sum g*xhat); two iterations' worth
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = threadIdx.x;
  const bool owns = chunk < C / 8;
  const size_t column = static_cast<size_t>(chunk) * 8;

  float w[8] = {}, sum_dw[8] = {}, sum_db[8] = {};
  if (owns) load_bf16x8(weight + column, w);

  const int first = blockIdx.x * rows_per_block;
  const int end = min(N, first + rows_per_block);
  int parity = 0;
  for (int row0 = first; row0 < end; row0 += kR, parity ^= 1) {  // block-uniform
    const int rows = min(kR, end - row0);
    uint4 x_raw[kR], dy_raw[kR], dx_raw[kR];
    float row_mean[kR], row_rstd[kR];
#pragma unroll
    for (int r = 0; r < kR; r++) {
      x_raw[r] = dy_raw[r] = dx_raw[r] = make_uint4(0u, 0u, 0u, 0u);
      row_mean[r] = row_rstd[r] = 0.0f;
      if (r < rows) {
        const size_t offset = static_cast<size_t>(row0 + r) * C + column;
        row_mean[r] = mean[row0 + r];
        row_rstd[r] = rstd[row0 + r];
        if (owns) {
          x_raw[r] = *reinterpret_cast<const uint4*>(inp + offset);
          dy_raw[r] = *reinterpret_cast<const uint4*>(dout + offset);
          dx_raw[r] = *reinterpret_cast<const uint4*>(dinp + offset);
          // The next iteration's rows into L2 meanwhile: 52 -> 49 us a call at width 1600,
          // the same at 768-1280 (call 126).
          if (row0 + kR + r < end) {
            const size_t next = offset + static_cast<size_t>(kR) * C;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(inp + next));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(dout + next));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(dinp + next));
          }
        }
      }
    }
    // The row sums: this thread's 8 columns, the warp, then the warps in order.
    float2 sums[kR];
#pragma unroll
    for (int r = 0; r < kR; r++) {
      float x[8], dy[8];
      unpack_bf16x8(x_raw[r], x);
      unpack_bf16x8(dy_raw[r], dy);
      float sum_g = 0.0f, sum_g_xhat = 0.0f;
      add_row_sums(x, dy, w, row_mean[r], row_rstd[r], sum_g, sum_g_xhat);
      sums[r] = make_float2(warp_sum(sum_g), warp_sum(sum_g_xhat));
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kR; r++) warp_row_sums[parity][warp][r] = sums[r];
    }
    // One barrier an iteration: a warp rewrites this parity's slots two iterations later,
    // after the next iteration's barrier, which every warp reaches only after these reads.
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kR; r++) {
      float2 total = warp_row_sums[parity][0][r];
      for (int v = 1; v < warps; v++) {
        const float2 s = warp_row_sums[parity][v][r];
        total.x += s.x;
        total.y += s.y;
      }
      if (r < rows && owns) {
        float x[8], dy[8], dx[8];
        unpack_bf16x8(x_raw[r], x);
        unpack_bf16x8(dy_raw[r], dy);
        unpack_bf16x8(dx_raw[r], dx);
        add_input_gradient(dx, x, dy, w, row_mean[r], row_rstd[r], total.x / C, total.y / C);
#pragma unroll
        for (int j = 0; j < 8; j++) {
          sum_dw[j] += dy[j] * ((x[j] - row_mean[r]) * row_rstd[r]);
          sum_db[j] += dy[j];
        }
        store_bf16x8(dinp + static_cast<size_t>(row0 + r) * C + column, dx);
      }
    }
  }
  if (owns) {
    float4* dw_out = reinterpret_cast<float4*>(partials + static_cast<size_t>(blockIdx.x) * 2 * C + column);
    float4* db_out = reinterpret_cast<float4*>(partials + static_cast<size_t>(blockIdx.x) * 2 * C + C + column);
    dw_out[0] = make_float4(sum_dw[0], sum_dw[1], sum_dw[2], sum_dw[3]);
    dw_out[1] = make_float4(sum_dw[4], sum_dw[5], sum_dw[6], sum_dw[7]);
    db_out[0] = make_float4(sum_db[0], sum_db[1], sum_db[2], sum_db[3]);
    db_out[1] = make_float4(sum_db[4], sum_db[5], sum_db[6], sum_db[7]);
  }
}

// ---- host side -------------------------------------------------------------------------

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

__nv_fp8_interpretation_t interpretation(Fp8Dtype dtype) {
  return dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2;
}

// Chunks of 8 per lane for a row of C: the smallest instantiated K >= ceil(C / 256).
int chunks_per_lane(int C) {
  const int needed = (C / 8 + 31) / 32;
  for (int k : {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32}) {
    if (k >= needed) return k;
  }
  return -1;
}

void check_shape(int N, int C, const char* what) {
  FP8LM_CHECK(N >= 0, what, ": N must be >= 0, got ", N);
  FP8LM_CHECK(C >= 8 && C % 8 == 0 && C <= kLayerNormMaxC, what, ": C must be a multiple of 8 in [8, ",
              kLayerNormMaxC, "], got ", C);
}

const char* forward_name(bool fp8, bool residual) {
  if (residual) return fp8 ? "residual_layernorm_forward_fp8" : "residual_layernorm_forward_bf16";
  return fp8 ? "layernorm_forward_fp8" : "layernorm_forward_bf16";
}

template <bool kFp8, bool kResidual, bool kStats = false>
void launch_forward(bf16* out_bf16, uint8_t* out_fp8, float* amax, const float* scale, Fp8Dtype dtype, float* mean,
                    float* rstd, const bf16* inp, const ResidualArgs& residual, const bf16* weight, const bf16* bias,
                    int N, int C, float eps, cudaStream_t stream, Fp8CastCounts* counts = nullptr) {
  FP8LM_CHECK(!kStats || counts != nullptr, "layernorm statistics need counts");
  const char* what = forward_name(kFp8, kResidual);
  check_shape(N, C, what);
  FP8LM_CHECK(weight != nullptr && bias != nullptr, what, ": null weight or bias");
  FP8LM_CHECK(aligned(weight, 16) && aligned(bias, 16), what, ": weight and bias must be 16-byte aligned");
  if constexpr (kResidual) {
    FP8LM_CHECK(residual.out != nullptr && residual.in != nullptr && residual.branch != nullptr, what,
                ": null residual_out, residual_in or branch");
    FP8LM_CHECK(aligned(residual.out, 16) && aligned(residual.in, 16) && aligned(residual.branch, 16) &&
                    (residual.branch_bias == nullptr || aligned(residual.branch_bias, 16)),
                what, ": residual_out, residual_in, branch and branch_bias must be 16-byte aligned");
    FP8LM_CHECK(residual.out != residual.branch, what, ": residual_out must not alias branch");
    const void* out = kFp8 ? static_cast<const void*>(out_fp8) : static_cast<const void*>(out_bf16);
    FP8LM_CHECK(out != residual.out && out != residual.in && out != residual.branch, what,
                ": out must not alias residual_out, residual_in or branch");
  } else {
    FP8LM_CHECK(inp != nullptr, what, ": null input");
    FP8LM_CHECK(aligned(inp, 16), what, ": inp must be 16-byte aligned");
  }
  if constexpr (kFp8) {
    FP8LM_CHECK(out_fp8 != nullptr && scale != nullptr, what, ": null out or scale");
    FP8LM_CHECK(aligned(out_fp8, 8), what, ": out must be 8-byte aligned");
    FP8LM_CHECK(amax == nullptr || aligned(amax, 4), what, ": amax must be 4-byte aligned");
  } else {
    FP8LM_CHECK(out_bf16 != nullptr, what, ": null out");
    FP8LM_CHECK(aligned(out_bf16, 16), what, ": out must be 16-byte aligned");
  }
  if (N == 0) return;
  const int blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const __nv_fp8_interpretation_t interp = interpretation(dtype);
#define FP8LM_LN_FORWARD(K)                                                                                           \
  launch_kernel(layernorm_forward_kernel<K, kFp8, kResidual, kStats>, blocks, kThreads, 0, stream, out_bf16, out_fp8, \
                amax, scale, interp, mean, rstd, inp, residual, weight, bias, N, C, eps, counts)
  switch (chunks_per_lane(C)) {
    case 1: FP8LM_LN_FORWARD(1); break;
    case 2: FP8LM_LN_FORWARD(2); break;
    case 3: FP8LM_LN_FORWARD(3); break;
    case 4: FP8LM_LN_FORWARD(4); break;
    case 5: FP8LM_LN_FORWARD(5); break;
    case 6: FP8LM_LN_FORWARD(6); break;
    case 7: FP8LM_LN_FORWARD(7); break;
    case 8: FP8LM_LN_FORWARD(8); break;
    case 12: FP8LM_LN_FORWARD(12); break;
    case 16: FP8LM_LN_FORWARD(16); break;
    case 24: FP8LM_LN_FORWARD(24); break;
    case 32: FP8LM_LN_FORWARD(32); break;
    default: FP8LM_CHECK(false, what, ": no kernel for C=", C);
  }
#undef FP8LM_LN_FORWARD
}

// The two-kernel form's grids.
int input_blocks(int N) { return std::max(1, std::min((N + kWarpsPerBlock - 1) / kWarpsPerBlock, 65535)); }

// Row splits of the weight and bias gradients: about kParamTargetBlocks blocks in all (a few
// waves on 132 multiprocessors), at least 64 rows a split. A function of N and C only, so the
// partial sums (and the gradients) are the same on every GPU.
constexpr int kParamTargetBlocks = 512;
int param_rows_per_split(int N, int C) {
  const int tiles = (C + kParamColumns - 1) / kParamColumns;
  const int splits = std::max(1, kParamTargetBlocks / tiles);
  return std::max(64, (N + splits - 1) / splits);
}
int param_splits(int N, int C) {
  const int rows = param_rows_per_split(N, C);
  return std::max(1, (N + rows - 1) / rows);
}

// The one-pass backward's grid: a block of ceil(C / 256) warps (a thread for each 8 columns)
// takes rows_per_block rows, two at a time, so that about kBackwardTargetWarps warps run at
// once in one wave: 14 a multiprocessor on an H100's or H200's 132 (two blocks of seven at
// C = 1600; the kernel's 104 registers allow two). Three blocks (80 registers, a spill) were no
// faster, and four rows at a time took 155 registers and one block (call 125). Functions of N
// and C only, so the partial sums (and the gradients) are the same on every GPU.
constexpr int kBackwardRows = 2;
constexpr int kBackwardTargetWarps = 132 * 14;
bool one_pass_backward(int C) { return C <= 8 * kThreads; }
int backward_warps(int C) { return (C / 8 + 31) / 32; }
int backward_rows_per_block(int N, int C) {
  const int target_blocks = std::max(1, kBackwardTargetWarps / backward_warps(C));
  return std::max(1, (N + target_blocks - 1) / target_blocks);
}
int backward_blocks(int N, int C) {
  const int rows = backward_rows_per_block(N, C);
  return std::max(1, (N + rows - 1) / rows);
}

}  // namespace

void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                            const bf16* bias, int N, int C, float eps, cudaStream_t stream) {
  launch_forward<false, false>(out, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, mean, rstd, inp, ResidualArgs{},
                               weight, bias, N, C, eps, stream);
}

void layernorm_forward_fp8(uint8_t* out, float* amax, const float* scale, Fp8Dtype dtype, float* mean, float* rstd,
                           const bf16* inp, const bf16* weight, const bf16* bias, int N, int C, float eps,
                           cudaStream_t stream, Fp8CastCounts* counts) {
  if (counts) {
    return launch_forward<true, false, true>(nullptr, out, amax, scale, dtype, mean, rstd, inp, ResidualArgs{}, weight,
                                             bias, N, C, eps, stream, counts);
  }
  launch_forward<true, false>(nullptr, out, amax, scale, dtype, mean, rstd, inp, ResidualArgs{}, weight, bias, N, C,
                              eps, stream);
}

void residual_layernorm_forward_bf16(bf16* out, bf16* residual_out, float* mean, float* rstd, const bf16* residual_in,
                                     const bf16* branch, const bf16* branch_bias, const bf16* weight,
                                     const bf16* bias, int N, int C, float eps, cudaStream_t stream) {
  launch_forward<false, true>(out, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, mean, rstd, nullptr,
                              ResidualArgs{residual_out, residual_in, branch, branch_bias}, weight, bias, N, C, eps,
                              stream);
}

void residual_layernorm_forward_fp8(uint8_t* out, float* amax, const float* scale, Fp8Dtype dtype,
                                    bf16* residual_out, float* mean, float* rstd, const bf16* residual_in,
                                    const bf16* branch, const bf16* branch_bias, const bf16* weight,
                                    const bf16* bias, int N, int C, float eps, cudaStream_t stream,
                                    Fp8CastCounts* counts) {
  const ResidualArgs residual{residual_out, residual_in, branch, branch_bias};
  if (counts) {
    return launch_forward<true, true, true>(nullptr, out, amax, scale, dtype, mean, rstd, nullptr, residual, weight,
                                            bias, N, C, eps, stream, counts);
  }
  launch_forward<true, true>(nullptr, out, amax, scale, dtype, mean, rstd, nullptr, residual, weight, bias, N, C, eps,
                             stream);
}

void layernorm_operand_transposed_fp8(uint8_t* out_t, const float* scale, Fp8Dtype dtype, const bf16* inp,
                                      const float* mean, const float* rstd, const bf16* weight, const bf16* bias,
                                      int N, int C, cudaStream_t stream) {
  const char* what = "layernorm_operand_transposed_fp8";
  check_shape(N, C, what);
  FP8LM_CHECK(out_t != nullptr && scale != nullptr && inp != nullptr && mean != nullptr && rstd != nullptr &&
                  weight != nullptr && bias != nullptr,
              what, ": null pointer");
  FP8LM_CHECK(aligned(out_t, 16) && aligned(inp, 16) && aligned(weight, 16) && aligned(bias, 16), what,
              ": out_t, inp, weight and bias must be 16-byte aligned");
  FP8LM_CHECK((N + kCodeTile - 1) / kCodeTile <= 65535, what, ": N too large for the tile grid, got ", N);
  if (N == 0) return;
  const dim3 grid((C + kCodeTile - 1) / kCodeTile, (N + kCodeTile - 1) / kCodeTile);
  launch_kernel(layernorm_operand_transposed_kernel, grid, kCodeTileThreads, 0, stream, out_t, scale,
                interpretation(dtype), inp, mean, rstd, weight, bias, N, C);
}

size_t layernorm_backward_scratch_floats(int N, int C) {
  const int rows = one_pass_backward(C) ? backward_blocks(N, C) : param_splits(N, C);
  return static_cast<size_t>(rows) * 2 * static_cast<size_t>(C);
}

void layernorm_backward(bf16* dinp, GradientRef dweight, GradientRef dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        cudaStream_t stream) {
  const char* what = "layernorm_backward";
  check_shape(N, C, what);
  FP8LM_CHECK(dinp != nullptr && dweight && dbias && dout != nullptr && inp != nullptr &&
                  weight != nullptr && mean != nullptr && rstd != nullptr && scratch != nullptr,
              what, ": null pointer");
  FP8LM_CHECK(aligned(dinp, 16) && aligned(dout, 16) && aligned(inp, 16) && aligned(weight, 16), what,
              ": dinp, dout, inp and weight must be 16-byte aligned");
  FP8LM_CHECK(dinp != dout && dinp != inp, what, ": dinp must not alias dout or inp");
  if (N == 0) return;
  const dim3 reduce_block(32, 8);
  const int reduce_blocks = (2 * C + 31) / 32;
  if (one_pass_backward(C)) {
    const int blocks = backward_blocks(N, C);
    launch_kernel(layernorm_backward_kernel<kBackwardRows>, blocks, 32 * backward_warps(C), 0, stream, dinp, scratch,
                  dout, inp, weight, mean, rstd, N, C, backward_rows_per_block(N, C));
    launch_kernel(add_column_sums_kernel, reduce_blocks, reduce_block, 0, stream, dweight, dbias, C, scratch, blocks,
                  2 * C);
    return;
  }
  const int blocks = input_blocks(N);
#define FP8LM_LN_BACKWARD(K)                                                                                          \
  launch_kernel(layernorm_backward_input_kernel<K>, blocks, kThreads, 0, stream, dinp, dout, inp, weight, mean, rstd, \
                N, C)
  switch (chunks_per_lane(C)) {
    case 12: FP8LM_LN_BACKWARD(12); break;
    case 16: FP8LM_LN_BACKWARD(16); break;
    case 24: FP8LM_LN_BACKWARD(24); break;
    case 32: FP8LM_LN_BACKWARD(32); break;
    default: FP8LM_CHECK(false, what, ": no kernel for C=", C);
  }
#undef FP8LM_LN_BACKWARD
  const int splits = param_splits(N, C);
  const dim3 param_grid((C + kParamColumns - 1) / kParamColumns, splits);
  launch_kernel(layernorm_backward_params_kernel, param_grid, dim3(32, 8), 0, stream, scratch, dout, inp, mean, rstd, N,
                C, param_rows_per_split(N, C));
  launch_kernel(add_column_sums_kernel, reduce_blocks, reduce_block, 0, stream, dweight, dbias, C, scratch, splits,
                2 * C);
}

}  // namespace fp8lm::cuda
