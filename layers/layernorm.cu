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
// Backward: one warp per row as well (grid-strided over rows). Rows up to 2048 wide: one pass,
// which also adds the row's weight and bias gradient terms into its warp's partial sums in
// shared memory, each block's sums to scratch; wider rows: the input gradient, then the
// weight and bias gradients apart as a column reduction over row splits into scratch. Either
// way a last kernel adds the partial sums in a fixed order into dweight/dbias. No
// floating-point atomics: bit-reproducible.
#include "layers/layernorm.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/device_helpers.cuh"
#include "core/check_cuda.h"
#include "core/error.h"
#include "core/fp8_stats.cuh"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 8;  // rows per block (forward), warps per block (backward)
constexpr int kOnePassMaxK = 8;    // the widest rows (8 * 32 * K) the one-pass backward takes
constexpr int kThreads = kWarpsPerBlock * 32;

// ---- small device helpers ------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the same bits (IEEE addition is commutative).
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
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
        for (int j = 0; j < 8; j++) y[j] = (x[j] - row_mean) * row_rstd * w[j] + b[j];
        const size_t offset = static_cast<size_t>(row) * C + static_cast<size_t>(i) * 8;
        if constexpr (kFp8) {
          uint32_t word[2];
#pragma unroll
          for (int j = 0; j < 8; j++) {
            y[j] = round_bf16(y[j]);
            amax_local = max(amax_local, abs_bits(y[j]));
          }
#pragma unroll
          for (int h = 0; h < 2; h++) {
            word[h] = fp8x2(y[4 * h] * s, y[4 * h + 1] * s, interp) |
                      (fp8x2(y[4 * h + 2] * s, y[4 * h + 3] * s, interp) << 16);
          }
          *reinterpret_cast<uint2*>(out_fp8 + offset) = make_uint2(word[0], word[1]);
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

// One pass: dinp [N,C] += the input gradient, one warp per row (grid-strided over rows), and
// the weight and bias gradients' sums over the block's rows into partials [blocks][2C]
// (dweight's, then dbias's). Each warp adds its rows, in order, into its own 2C floats of
// shared memory (lane l owns columns 8 (l + 32 k) .. +7, so no two lanes share one); the block
// then adds its warps' sums in warp order. So x and dy come from memory once, and the sums are
// bit-reproducible for a given grid (a function of N and C: backward_blocks).
// Rows up to 2048 wide (K <= 8); the row's x and dy stay in registers, packed BF16, between
// the two passes (64 registers).
template <int K>
__global__ void __launch_bounds__(kThreads)
    layernorm_backward_kernel(bf16* __restrict__ dinp, float* __restrict__ partials, const bf16* __restrict__ dout,
                              const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                              const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C) {
  static_assert(K <= kOnePassMaxK, "wider rows take the two-kernel form");
  extern __shared__ float4 warp_sums_raw[];
  float* warp_sums = reinterpret_cast<float*>(warp_sums_raw);  // [warps][2C]
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sum_dw = warp_sums + static_cast<size_t>(warp) * 2 * C;
  float* sum_db = sum_dw + C;
  for (int i = lane; i < 2 * C; i += 32) sum_dw[i] = 0.0f;
  __syncwarp();

  const int chunks = C / 8;
  const int total_warps = gridDim.x * warps;
  for (int row = blockIdx.x * warps + warp; row < N; row += total_warps) {  // warp-uniform
    const size_t row_offset = static_cast<size_t>(row) * C;
    const float row_mean = mean[row];
    const float row_rstd = rstd[row];
    // dinp, read in the second pass, is prefetched into L2 in the first: 7.02 -> 6.83 ms a
    // gpt2-1558m step (call 77). Loading it into registers instead cost a block a
    // multiprocessor (163 registers) and was slower: 8.43 ms. The warp's next row of x and dy
    // is prefetched too: the kernel waits on its loads (Nsight Compute, call 93: 60% of the
    // cycles between a warp's instructions stalled on L1TEX at 1.6 TB/s), and a row that
    // comes from L2 instead of HBM waits about half as long.
    const int next_row = row + total_warps;
    const size_t next_offset = static_cast<size_t>(next_row) * C;
    uint4 x_raw[K], dy_raw[K];
    float sum_g = 0.0f, sum_g_xhat = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int i = lane + 32 * k;
      if (i < chunks) {
        const uint4 xr = *reinterpret_cast<const uint4*>(inp + row_offset + i * 8);
        const uint4 dyr = *reinterpret_cast<const uint4*>(dout + row_offset + i * 8);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(dinp + row_offset + i * 8));
        if (next_row < N) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(inp + next_offset + i * 8));
          asm volatile("prefetch.global.L2 [%0];" ::"l"(dout + next_offset + i * 8));
        }
        x_raw[k] = xr;
        dy_raw[k] = dyr;
        float x[8], dy[8], w[8];
        unpack_bf16x8(xr, x);
        unpack_bf16x8(dyr, dy);
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
        unpack_bf16x8(x_raw[k], x);
        unpack_bf16x8(dy_raw[k], dy);
        load_bf16x8(weight + i * 8, w);
        load_bf16x8(dinp + row_offset + i * 8, dx);
        float4* dw4 = reinterpret_cast<float4*>(sum_dw + i * 8);
        float4* db4 = reinterpret_cast<float4*>(sum_db + i * 8);
        float4 dw[2] = {dw4[0], dw4[1]}, db[2] = {db4[0], db4[1]};
        float* dwf = reinterpret_cast<float*>(dw);
        float* dbf = reinterpret_cast<float*>(db);
        add_input_gradient(dx, x, dy, w, row_mean, row_rstd, mean_g, mean_g_xhat);
#pragma unroll
        for (int j = 0; j < 8; j++) {
          dwf[j] += dy[j] * ((x[j] - row_mean) * row_rstd);
          dbf[j] += dy[j];
        }
        dw4[0] = dw[0];
        dw4[1] = dw[1];
        db4[0] = db[0];
        db4[1] = db[1];
        store_bf16x8(dinp + row_offset + i * 8, dx);
      }
    }
  }
  __syncthreads();
  for (int col = threadIdx.x; col < 2 * C; col += blockDim.x) {
    float total = 0.0f;
    for (int w = 0; w < warps; w++) total += warp_sums[static_cast<size_t>(w) * 2 * C + col];
    partials[static_cast<size_t>(blockIdx.x) * 2 * C + col] = total;
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
#define FP8LM_LN_FORWARD(K)                                                                               \
  layernorm_forward_kernel<K, kFp8, kResidual, kStats><<<blocks, kThreads, 0, stream>>>(                  \
      out_bf16, out_fp8, amax, scale, interp, mean, rstd, inp, residual, weight, bias, N, C, eps, counts)
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
  CUDA_CHECK_LAUNCH();
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

// The one-pass backward's block: as many warps (1 to 8) as fit their 2C floats of partial sums
// in 64 KB of shared memory (5 at C = 1600, 2 at C = 4096); and its grid: enough warps for
// every row, at most kBackwardMaxBlocks, about three blocks on each of an H100's or H200's
// multiprocessors in one wave. Functions of N and C only, so the partial sums (and the
// gradients) are the same on every GPU.
constexpr int kBackwardSharedBytes = 64 * 1024;
constexpr int kBackwardMaxBlocks = 384;
int backward_warps(int C) { return std::clamp(kBackwardSharedBytes / (8 * C), 1, kWarpsPerBlock); }
bool one_pass_backward(int C) { return chunks_per_lane(C) <= kOnePassMaxK; }
int backward_blocks(int N, int C) {
  const int warps = backward_warps(C);
  return std::clamp((N + warps - 1) / warps, 1, kBackwardMaxBlocks);
}

struct BackwardLaunch {
  int blocks, threads;
  size_t shared;
  cudaStream_t stream;
  bf16* dinp;
  float* partials;
  const bf16 *dout, *inp, *weight;
  const float *mean, *rstd;
  int N, C;
};

template <int K>
void launch_backward(const BackwardLaunch& l) {
  // Above 48 KB of dynamic shared memory a kernel must opt in, once per instantiation.
  static const bool opted_in = [] {
    CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kBackwardSharedBytes));
    return true;
  }();
  (void)opted_in;
  layernorm_backward_kernel<K><<<l.blocks, l.threads, l.shared, l.stream>>>(l.dinp, l.partials, l.dout, l.inp,
                                                                            l.weight, l.mean, l.rstd, l.N, l.C);
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
    const BackwardLaunch go{blocks,  32 * backward_warps(C), static_cast<size_t>(backward_warps(C)) * 2 * C * sizeof(float),
                            stream,  dinp, scratch, dout, inp, weight, mean, rstd, N, C};
    switch (chunks_per_lane(C)) {
      case 1: launch_backward<1>(go); break;
      case 2: launch_backward<2>(go); break;
      case 3: launch_backward<3>(go); break;
      case 4: launch_backward<4>(go); break;
      case 5: launch_backward<5>(go); break;
      case 6: launch_backward<6>(go); break;
      case 7: launch_backward<7>(go); break;
      case 8: launch_backward<8>(go); break;
      default: FP8LM_CHECK(false, what, ": no one-pass kernel for C=", C);
    }
    CUDA_CHECK_LAUNCH();
    add_column_sums_kernel<<<reduce_blocks, reduce_block, 0, stream>>>(dweight, dbias, C, scratch, blocks, 2 * C);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const int blocks = input_blocks(N);
#define FP8LM_LN_BACKWARD(K)                                                                                       \
  layernorm_backward_input_kernel<K><<<blocks, kThreads, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C)
  switch (chunks_per_lane(C)) {
    case 12: FP8LM_LN_BACKWARD(12); break;
    case 16: FP8LM_LN_BACKWARD(16); break;
    case 24: FP8LM_LN_BACKWARD(24); break;
    case 32: FP8LM_LN_BACKWARD(32); break;
    default: FP8LM_CHECK(false, what, ": no kernel for C=", C);
  }
#undef FP8LM_LN_BACKWARD
  CUDA_CHECK_LAUNCH();
  const int splits = param_splits(N, C);
  const dim3 param_grid((C + kParamColumns - 1) / kParamColumns, splits);
  layernorm_backward_params_kernel<<<param_grid, dim3(32, 8), 0, stream>>>(scratch, dout, inp, mean, rstd, N, C,
                                                                           param_rows_per_split(N, C));
  CUDA_CHECK_LAUNCH();
  add_column_sums_kernel<<<reduce_blocks, reduce_block, 0, stream>>>(dweight, dbias, C, scratch, splits, 2 * C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace fp8lm::cuda
