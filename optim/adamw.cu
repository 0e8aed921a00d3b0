// Kernels of optim/adamw_cuda.h. No spdlog here (nvcc, C++20).
//
// Work decomposition: one block of 256 threads per chunk of kGradNormChunk (8192)
// elements of one tensor (DeviceTensorTable: chunk -> tensor is one table load), 4
// consecutive elements per thread per iteration with vector loads and stores, so the
// kernels stream at close to memory bandwidth. Bytes moved per parameter:
//   fp8_fp16: pass 1 reads grad, m, v (7 B), and takes the gradient norm in that read where
//             the table is the norm's (otherwise the norm kernel reads the gradients first,
//             4 B more); pass 2 reads grad, master, m, v (11 B) and writes master, bf16, m,
//             v (9 B; 7 B for a tensor without a working value): 27 B. A Linear weight whose FP8 operand the
//             update writes (weight casts) adds its E4M3 code (1 B) and then, in the
//             transpose kernel, reads it and writes W^T (2 B): 30 B, against 27 B plus a
//             separate cast from the master (4 B read, 2 B written) after the update.
//   fp32:     reads grad, master, m, v (16 B), writes master, bf16, m, v (14 B): 30 B.
//
// Exactness. The per-element arithmetic is adamw_moments()/adamw_param() of
// optim/adamw.h, whose operations are spelled with the _rn intrinsics on the device:
// the same operations in the same order, each rounded once, never contracted into an FMA.
// The host reference (g++ -O3, ISO C++ mode: -ffp-contract=off, and no FMA in the x86-64
// baseline) evaluates the same IEEE operations, so the moments, the master weights, the
// codes and the scales agree bit for bit (tests/test_optim_gpu.cpp compares bitwise).
// The bias corrections 1 - beta^t use the device's double pow (max error 2 ulp of
// double) where the host uses glibc's (< 1 ulp); both are rounded to float, so they
// differ only if the exact value lies within a few double ulps of a float rounding
// boundary (probability ~1e-8 per (beta, t)); tests check t = 1..4096 and a few large t.
#include "optim/adamw_cuda.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/dtype.h"
#include "core/error.h"
#include "core/launch.cuh"
#include "optim/grad_clip.h"
#include "optim/grad_norm.cuh"

namespace fp8lm::cuda {
namespace {

constexpr int kThreads = 256;       // per chunk block
constexpr int kScaleThreads = 256;  // the one block of the scale update
// 64x64 tiles of weight codes per block of their transpose: enough to look a tensor up once
// per run, few enough for every multiprocessor to get many blocks (gpt2-124m has 21,000
// tiles, gpt2-1558m 360,000).
constexpr uint32_t kWeightTilesPerBlock = 8;
constexpr float kMomentMMax = kE4M3Max;  // m is stored as E4M3 (kFirstMomentDtype)
constexpr float kMomentVMax = kFp16Max;  // v is stored as FP16
static_assert(kFirstMomentDtype == Fp8Dtype::e4m3, "the kernels store m as E4M3");

// ---- table lookup ------------------------------------------------------------------------

struct ChunkRange {
  uint64_t begin;  // slab index of the chunk's first element
  uint32_t n;      // elements in the chunk (1..kGradNormChunk)
  int k;           // tensor index
};

// first_chunk: where a launch over part of the table starts (0 for the whole table).
__device__ __forceinline__ ChunkRange chunk_of_block(const DeviceTensorTable& table, uint32_t first_chunk = 0) {
  const uint32_t c = first_chunk + blockIdx.x;
  ChunkRange r;
  r.k = table.chunk_tensor[c];
  const uint64_t tensor_begin = table.offsets[r.k];
  const uint64_t tensor_end = tensor_begin + table.numels[r.k];
  r.begin = tensor_begin + static_cast<uint64_t>(c - table.chunk_begin[r.k]) * kGradNormChunk;
  const uint64_t left = tensor_end - r.begin;
  r.n = static_cast<uint32_t>(left < kGradNormChunk ? left : kGradNormChunk);
  return r;
}

// Where the chunk's first element sits in the gradient and working slabs: at its table
// index, or at the tensor's slab offset (the distributed optimizer's pieces, reduced and
// gathered in place in the model's slabs) plus its place in the tensor.
__device__ __forceinline__ uint64_t slab_index(const DeviceTensorTable& table, const uint64_t* slab_offsets,
                                               const ChunkRange& c) {
  return slab_offsets == nullptr ? c.begin : slab_offsets[c.k] + (c.begin - table.offsets[c.k]);
}

// Where the chunk's first working value goes: beside its gradient (slab index gb), or, when the
// working copy has offsets of its own, there; kNoWorkingValue (optim/adamw.h) for a tensor without one.
__device__ __forceinline__ uint64_t working_index(const DeviceTensorTable& table, const uint64_t* working_offsets,
                                                  const ChunkRange& c, uint64_t gb) {
  if (working_offsets == nullptr) return gb;
  const uint64_t offset = working_offsets[c.k];
  return offset == kNoWorkingValue ? kNoWorkingValue : offset + (c.begin - table.offsets[c.k]);
}

// ---- per-element helpers (the arithmetic itself is optim/adamw.h's, shared with the host) ----

// adamw_step_scalars(): 1 - beta^t in double, rounded to float.
__device__ __forceinline__ float bias_correction(float beta, long long t) {
  return static_cast<float>(__dsub_rn(1.0, pow(static_cast<double>(beta), static_cast<double>(t))));
}

// The storage formats (optim/adamw.cpp: quantize_m/quantize_v/dequantize_m/dequantize_v).
__device__ __forceinline__ float decode_m(uint8_t code, float scale_inv) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __fmul_rn(__half2float(__half(h)), scale_inv);  // E4M3 -> FP16 -> FP32 is exact
}
__device__ __forceinline__ float decode_v(uint16_t bits, float scale_inv) {
  return __fmul_rn(__half2float(__ushort_as_half(bits)), scale_inv);
}
__device__ __forceinline__ uint8_t encode_m(float m, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(m, scale), __NV_SATFINITE, __NV_E4M3));
}
// FP16 conversion overflows to infinity, so saturate first; the comparison keeps NaN.
__device__ __forceinline__ uint16_t encode_v(float v, float scale) {
  const float scaled = __fmul_rn(v, scale);
  return __half_as_ushort(__float2half_rn(scaled > kMomentVMax ? kMomentVMax : scaled));
}
__device__ __forceinline__ uint16_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

// Pass 2 of one element (fp8_fp16): the moments again from the stored codes, the parameter
// update, and the re-quantized moments and BF16 copy.
struct Pass2Scales {
  float m_inv, v_inv;      // the scales the stored moments were quantized with, inverted
  float m_scale, v_scale;  // the new ones
};
__device__ __forceinline__ void pass2_element(float g, float& p, uint8_t& mc, uint16_t& vb, uint16_t& pb,
                                              const Pass2Scales& q, const AdamWStepScalars& s) {
  float m = decode_m(mc, q.m_inv), v = decode_v(vb, q.v_inv);
  adamw_moments(g, m, v, s);
  p = adamw_param(p, m, v, s);
  pb = bf16_bits(p);
  mc = encode_m(m, q.m_scale);
  vb = encode_v(v, q.v_scale);
}

// ---- vector packing ------------------------------------------------------------------------

__device__ __forceinline__ void unpack4(const float4 a, float (&out)[4]) {
  out[0] = a.x;
  out[1] = a.y;
  out[2] = a.z;
  out[3] = a.w;
}
__device__ __forceinline__ float4 pack4(const float (&in)[4]) { return make_float4(in[0], in[1], in[2], in[3]); }
__device__ __forceinline__ void unpack4(const uint32_t a, uint8_t (&out)[4]) {
#pragma unroll
  for (int l = 0; l < 4; ++l) out[l] = static_cast<uint8_t>(a >> (8 * l));
}
__device__ __forceinline__ uint32_t pack4(const uint8_t (&in)[4]) {
  return static_cast<uint32_t>(in[0]) | (static_cast<uint32_t>(in[1]) << 8) | (static_cast<uint32_t>(in[2]) << 16) |
         (static_cast<uint32_t>(in[3]) << 24);
}
__device__ __forceinline__ void unpack4(const uint2 a, uint16_t (&out)[4]) {
  out[0] = static_cast<uint16_t>(a.x);
  out[1] = static_cast<uint16_t>(a.x >> 16);
  out[2] = static_cast<uint16_t>(a.y);
  out[3] = static_cast<uint16_t>(a.y >> 16);
}
__device__ __forceinline__ uint2 pack4(const uint16_t (&in)[4]) {
  return make_uint2(static_cast<uint32_t>(in[0]) | (static_cast<uint32_t>(in[1]) << 16),
                    static_cast<uint32_t>(in[2]) | (static_cast<uint32_t>(in[3]) << 16));
}

template <typename V, typename T>
__device__ __forceinline__ V load_vec(const T* base, uint64_t i) {
  return *reinterpret_cast<const V*>(base + i);
}
template <typename V, typename T>
__device__ __forceinline__ void store_vec(T* base, uint64_t i, V value) {
  *reinterpret_cast<V*>(base + i) = value;
}

// ---- kernels -------------------------------------------------------------------------------

// Pass 1 (fp8_fp16): the per-tensor amax of the updated moments; nothing but the amax is
// written. amax_bits [2, count]: m then v, as float bits (values >= 0, so unsigned
// comparison orders them; NaN never enters, as on the CPU's running_max).
// kMode: after_decision, the pass as the step's decision (control) says; with_norm, before the
// decision, as if the clip coefficient were 1, also writing each chunk's gradient sum of
// squares to norm_partial exactly as grad_norm_squared's chunk kernel does (the same chunks,
// the same per-thread order, the same block tree); if_clipped, after the decision, only when
// it clips (the amaxes zeroed first by zero_amaxes_if_clipped_kernel).
enum class Pass1 { after_decision, with_norm, if_clipped };

template <typename G, Pass1 kMode>
__global__ void __launch_bounds__(kThreads)
    adamw_fp8_pass1_kernel(const G* __restrict__ grads, const uint8_t* __restrict__ m_codes,
                           const uint16_t* __restrict__ v_bits, const float* __restrict__ m_scales,
                           const float* __restrict__ v_scales, DeviceTensorTable table,
                           const uint64_t* __restrict__ slab_offsets, AdamWHyperparams hp,
                           const StepControl* __restrict__ control, unsigned* __restrict__ amax_bits, bool vec_ok,
                           double* __restrict__ norm_partial, uint32_t first_chunk) {
  device::start_after_previous_kernel();
  float grad_scale = 1.0f;
  if constexpr (kMode != Pass1::with_norm) {
    if (control->skip) return;  // uniform over the grid
    grad_scale = control->grad_scale;
    if (kMode == Pass1::if_clipped && grad_scale == 1.0f) return;
  }
  const ChunkRange c = chunk_of_block(table, first_chunk);
  // Moments need only beta and grad_scale (bias corrections enter the parameter update).
  const AdamWStepScalars s = adamw_scalars(hp, false, grad_scale, 1.0f, 1.0f);
  double sum_of_squares = 0.0;
  const float m_inv = __fdiv_rn(1.0f, m_scales[c.k]);
  const float v_inv = __fdiv_rn(1.0f, v_scales[c.k]);

  float amax_m = 0.0f, amax_v = 0.0f;
  auto element = [&](float g, uint8_t mc, uint16_t vb) {
    if constexpr (kMode == Pass1::with_norm) sum_of_squares = device::add_square(sum_of_squares, g);
    float m = decode_m(mc, m_inv), v = decode_v(vb, v_inv);
    adamw_moments(g, m, v, s);
    const float abs_m = fabsf(m);
    amax_m = abs_m > amax_m ? abs_m : amax_m;  // running_max(): NaN never wins
    amax_v = v > amax_v ? v : amax_v;
  };

  const uint64_t b = c.begin, gb = slab_index(table, slab_offsets, c);  // gb: grads
  uint32_t scalar_from = 0;
  if (vec_ok && b % 4 == 0 && gb % 4 == 0) {
    const uint32_t nvec = c.n / 4;
#pragma unroll 2
    for (uint32_t j = threadIdx.x; j < nvec; j += kThreads) {
      const uint64_t i = b + 4ull * j;
      float g[4];
      uint8_t mc[4];
      uint16_t vb[4];
      device::load_gradient4(grads, gb + 4ull * j, g);
      unpack4(load_vec<uint32_t>(m_codes, i), mc);
      unpack4(load_vec<uint2>(v_bits, i), vb);
#pragma unroll
      for (int l = 0; l < 4; ++l) element(g[l], mc[l], vb[l]);
    }
    scalar_from = nvec * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < c.n; i += kThreads) element(device::gradient_at(grads, gb + i), m_codes[b + i], v_bits[b + i]);

  if constexpr (kMode == Pass1::with_norm) {
    sum_of_squares = device::block_sum_fixed<kThreads>(sum_of_squares);
    if (threadIdx.x == 0) norm_partial[first_chunk + blockIdx.x] = sum_of_squares;
  }
  // Block max (exact, order-independent), then one atomic per block and moment.
  __shared__ float warp_m[kThreads / 32], warp_v[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax_m = fmaxf(amax_m, __shfl_xor_sync(0xFFFFFFFFu, amax_m, offset));
    amax_v = fmaxf(amax_v, __shfl_xor_sync(0xFFFFFFFFu, amax_v, offset));
  }
  if (threadIdx.x % 32 == 0) {
    warp_m[threadIdx.x / 32] = amax_m;
    warp_v[threadIdx.x / 32] = amax_v;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float block_m = 0.0f, block_v = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) {
      block_m = fmaxf(block_m, warp_m[w]);
      block_v = fmaxf(block_v, warp_v[w]);
    }
    if (block_m > 0.0f) atomicMax(amax_bits + c.k, __float_as_uint(block_m));
    if (block_v > 0.0f) atomicMax(amax_bits + table.count + c.k, __float_as_uint(block_v));
  }
}

// Before Pass1::if_clipped: the amaxes of the pass before the decision zeroed, when it clips.
__global__ void zero_amaxes_if_clipped_kernel(unsigned* __restrict__ amax_bits, int n,
                                              const StepControl* __restrict__ control) {
  device::start_after_previous_kernel();
  if (control->skip || control->grad_scale == 1.0f) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) amax_bits[i] = 0u;
}

// Between the passes (one block): for every tensor, keep the inverse of the old scales
// (pass 2 dequantizes with them) and store the new scales; and the bias corrections.
// scratch: [0, 2count) amax bits, [2count, 3count) old 1/m_scale, [3count, 4count) old
// 1/v_scale, [4count] 1 - beta1^t, [4count + 1] 1 - beta2^t.
__global__ void __launch_bounds__(kScaleThreads)
    adamw_fp8_scales_kernel(float* __restrict__ m_scales, float* __restrict__ v_scales, float* __restrict__ scratch,
                            int count, float beta1, float beta2, const StepControl* __restrict__ control) {
  device::start_after_previous_kernel();
  if (control->skip) return;
  const unsigned* amax_bits = reinterpret_cast<const unsigned*>(scratch);
  for (int k = threadIdx.x; k < count; k += kScaleThreads) {
    const float amax_m = __uint_as_float(amax_bits[k]);
    const float amax_v = __uint_as_float(amax_bits[count + k]);
    scratch[2 * count + k] = __fdiv_rn(1.0f, m_scales[k]);
    scratch[3 * count + k] = __fdiv_rn(1.0f, v_scales[k]);
    m_scales[k] = moment_scale(amax_m, kMomentMMax);
    v_scales[k] = moment_scale(amax_v, kMomentVMax);
  }
  if (threadIdx.x == 0) {
    const long long t = control->step_count;
    scratch[4 * count] = bias_correction(beta1, t);
    scratch[4 * count + 1] = bias_correction(beta2, t);
  }
}

// Pass 2 (fp8_fp16): the same moments again, the parameter update, re-quantization.
// kCasts: a tensor with an FP8 weight operand (casts.cast_of_tensor) also gets its codes
// fp8_e4m3(master * scale) written in row-major order, and max |master| raised into its
// state's amax slot: cast_transpose_fp8's values from the FP32 master (the transposed copy
// follows in transpose_weight_codes_kernel). Under control->skip such a tensor is only cast,
// from its unchanged master; the others are left alone.
template <typename G, bool kCasts>
__global__ void __launch_bounds__(kThreads)
    adamw_fp8_pass2_kernel(float* __restrict__ master, uint16_t* __restrict__ params_bf16,
                           const G* __restrict__ grads, uint8_t* __restrict__ m_codes,
                           uint16_t* __restrict__ v_bits, const float* __restrict__ m_scales,
                           const float* __restrict__ v_scales, DeviceTensorTable table,
                           const uint64_t* __restrict__ slab_offsets, AdamWHyperparams hp,
                           const StepControl* __restrict__ control, const float* __restrict__ scratch, bool vec_ok,
                           DeviceWeightCastTable casts, const float* __restrict__ fp8_scales,
                           float* __restrict__ amax_row, const uint64_t* __restrict__ working_offsets) {
  device::start_after_previous_kernel();
  const bool skip = control->skip != 0;
  if (!kCasts && skip) return;
  const ChunkRange c = chunk_of_block(table);
  uint8_t* codes = nullptr;  // this chunk's first code
  int state = -1;
  float fp8_scale = 0.0f;
  if constexpr (kCasts) {
    const int cast = casts.cast_of_tensor[c.k];
    if (cast >= 0) {
      const DeviceWeightCast& w = casts.casts[cast];
      codes = w.codes + (c.begin - table.offsets[c.k]);
      state = w.state;
      fp8_scale = fp8_scales[state];
    }
    if (skip && codes == nullptr) return;  // block-uniform
  }
  const int count = table.count;
  const float m_inv = scratch[2 * count + c.k];  // the scales the stored moments were quantized with
  const float v_inv = scratch[3 * count + c.k];
  const float m_scale = m_scales[c.k];  // the new scales
  const float v_scale = v_scales[c.k];
  const AdamWStepScalars s =
      adamw_scalars(hp, table.decay[c.k] != 0, control->grad_scale, scratch[4 * count], scratch[4 * count + 1]);

  const Pass2Scales q{m_inv, v_inv, m_scale, v_scale};
  auto update = [&](float g, float& p, uint8_t& mc, uint16_t& vb, uint16_t& pb) { pass2_element(g, p, mc, vb, pb, q, s); };
  unsigned local_amax = 0;

  const uint64_t b = c.begin, gb = slab_index(table, slab_offsets, c);  // gb: grads
  const uint64_t wb = working_index(table, working_offsets, c, gb);    // wb: params_bf16
  const bool has_working = wb != kNoWorkingValue;
  uint32_t scalar_from = 0;
  if (vec_ok && b % 4 == 0 && gb % 4 == 0 && (!has_working || wb % 4 == 0) &&
      reinterpret_cast<uintptr_t>(codes) % 4 == 0) {
    const uint32_t nvec = c.n / 4;
#pragma unroll 2
    for (uint32_t j = threadIdx.x; j < nvec; j += kThreads) {
      const uint64_t i = b + 4ull * j, gi = gb + 4ull * j;
      float p[4];
      unpack4(load_vec<float4>(master, i), p);
      if (!kCasts || !skip) {
        float g[4];
        uint8_t mc[4];
        uint16_t vb[4], pb[4];
        device::load_gradient4(grads, gi, g);
        unpack4(load_vec<uint32_t>(m_codes, i), mc);
        unpack4(load_vec<uint2>(v_bits, i), vb);
#pragma unroll
        for (int l = 0; l < 4; ++l) update(g[l], p[l], mc[l], vb[l], pb[l]);
        store_vec(master, i, pack4(p));
        if (has_working) store_vec(params_bf16, wb + 4ull * j, pack4(pb));
        store_vec(m_codes, i, pack4(mc));
        store_vec(v_bits, i, pack4(vb));
      }
      if (kCasts && codes != nullptr) {
        uint8_t q8[4];
#pragma unroll
        for (int l = 0; l < 4; l += 2) {
          const uint32_t pair =
              device::fp8x2(__fmul_rn(p[l], fp8_scale), __fmul_rn(p[l + 1], fp8_scale), __NV_E4M3);
          q8[l] = static_cast<uint8_t>(pair & 0xFF);
          q8[l + 1] = static_cast<uint8_t>(pair >> 8);
          local_amax = max(local_amax, max(device::abs_bits(p[l]), device::abs_bits(p[l + 1])));
        }
        store_vec(codes, 4ull * j, pack4(q8));
      }
    }
    scalar_from = nvec * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < c.n; i += kThreads) {
    const uint64_t e = b + i, ge = gb + i;
    float p = master[e];
    if (!kCasts || !skip) {
      uint8_t mc = m_codes[e];
      uint16_t vb = v_bits[e], pb;
      update(device::gradient_at(grads, ge), p, mc, vb, pb);
      master[e] = p;
      if (has_working) params_bf16[wb + i] = pb;
      m_codes[e] = mc;
      v_bits[e] = vb;
    }
    if (kCasts && codes != nullptr) {
      codes[i] = static_cast<uint8_t>(device::fp8x2(__fmul_rn(p, fp8_scale), 0.0f, __NV_E4M3) & 0xFF);
      local_amax = max(local_amax, device::abs_bits(p));
    }
  }
  if (kCasts && codes != nullptr) device::block_amax_update(amax_row == nullptr ? nullptr : amax_row + state, local_amax);
}

// The transposed copies of the weight codes pass 2 wrote: codes_t [cols, rows] of codes
// [rows, cols], in 64x64 tiles through shared memory. Each block takes a contiguous run of
// tiles_per_block tiles, so that it looks a cast up once per run. Thread t reads 16 bytes of
// tile row t / 4.
__global__ void __launch_bounds__(kThreads)
    transpose_weight_codes_kernel(DeviceWeightCastTable casts, uint32_t tiles_per_block) {
  device::start_after_previous_kernel();
  static_assert(kThreads == 256 && device::kByteTile == 64, "4 threads of 16 bytes per tile row");
  constexpr int kTile = device::kByteTile;
  __shared__ device::ByteTile tile;
  const uint32_t first = blockIdx.x * tiles_per_block;
  const uint32_t end = min(first + tiles_per_block, casts.num_tiles);
  if (first >= end) return;
  int cast = 0, hi = casts.count - 1;  // the last cast whose first tile is <= first (block-uniform)
  while (cast < hi) {
    const int mid = (cast + hi + 1) / 2;
    if (casts.casts[mid].first_tile <= first) cast = mid; else hi = mid - 1;
  }
  const int r = static_cast<int>(threadIdx.x / 4), c = static_cast<int>(threadIdx.x % 4) * 16;
  for (uint32_t t = first; t < end; ++cast) {
    const DeviceWeightCast w = casts.casts[cast];
    const uint32_t cast_end = cast + 1 < casts.count ? min(casts.casts[cast + 1].first_tile, end) : end;
    const int tiles_x = (w.cols + kTile - 1) / kTile;
    const bool vec_in = w.cols % 16 == 0 && reinterpret_cast<uintptr_t>(w.codes) % 16 == 0;
    const bool vec_t = w.rows % 16 == 0 && reinterpret_cast<uintptr_t>(w.codes_t) % 16 == 0;
    for (; t < cast_end; ++t) {
      const uint32_t index = t - w.first_tile;
      const int row0 = static_cast<int>(index / tiles_x) * kTile;
      const int col0 = static_cast<int>(index % tiles_x) * kTile;
      const bool full = row0 + kTile <= w.rows && col0 + kTile <= w.cols;
      const int gr = row0 + r, gc = col0 + c;
      const uint8_t* row = w.codes + static_cast<size_t>(gr) * w.cols + gc;
      if (full && vec_in) {
        const uint4 raw = *reinterpret_cast<const uint4*>(row);
        uint8_t bytes[16];
        memcpy(bytes, &raw, 16);
#pragma unroll
        for (int i = 0; i < 16; ++i) tile[r][c + i] = bytes[i];
      } else {
        for (int i = 0; i < 16; ++i) tile[r][c + i] = (gr < w.rows && gc + i < w.cols) ? row[i] : 0;
      }
      __syncthreads();
      device::write_transposed(w.codes_t, tile, row0, col0, w.rows, w.cols, full, vec_t);
      __syncthreads();  // the tile is refilled by the next one
    }
  }
}

// FP32 state: one pass.
template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_fp32_kernel(float* __restrict__ master, uint16_t* __restrict__ params_bf16, const G* __restrict__ grads,
                      float* __restrict__ m_state, float* __restrict__ v_state, DeviceTensorTable table,
                      const uint64_t* __restrict__ slab_offsets, AdamWHyperparams hp,
                      const StepControl* __restrict__ control, bool vec_ok,
                      const uint64_t* __restrict__ working_offsets) {
  device::start_after_previous_kernel();
  if (control->skip) return;
  __shared__ float bias_corrections[2];
  if (threadIdx.x == 0) {
    const long long t = control->step_count;
    bias_corrections[0] = bias_correction(hp.beta1, t);
    bias_corrections[1] = bias_correction(hp.beta2, t);
  }
  __syncthreads();
  const ChunkRange c = chunk_of_block(table);
  const AdamWStepScalars s =
      adamw_scalars(hp, table.decay[c.k] != 0, control->grad_scale, bias_corrections[0], bias_corrections[1]);

  auto update = [&](float g, float& p, float& m, float& v, uint16_t& pb) {
    adamw_moments(g, m, v, s);
    p = adamw_param(p, m, v, s);
    pb = bf16_bits(p);
  };

  const uint64_t b = c.begin, gb = slab_index(table, slab_offsets, c);  // gb: grads
  const uint64_t wb = working_index(table, working_offsets, c, gb);    // wb: params_bf16
  const bool has_working = wb != kNoWorkingValue;
  uint32_t scalar_from = 0;
  if (vec_ok && b % 4 == 0 && gb % 4 == 0 && (!has_working || wb % 4 == 0)) {
    const uint32_t nvec = c.n / 4;
#pragma unroll 2
    for (uint32_t j = threadIdx.x; j < nvec; j += kThreads) {
      const uint64_t i = b + 4ull * j, gi = gb + 4ull * j;
      float g[4], p[4], m[4], v[4];
      uint16_t pb[4];
      device::load_gradient4(grads, gi, g);
      unpack4(load_vec<float4>(master, i), p);
      unpack4(load_vec<float4>(m_state, i), m);
      unpack4(load_vec<float4>(v_state, i), v);
#pragma unroll
      for (int l = 0; l < 4; ++l) update(g[l], p[l], m[l], v[l], pb[l]);
      store_vec(master, i, pack4(p));
      if (has_working) store_vec(params_bf16, wb + 4ull * j, pack4(pb));
      store_vec(m_state, i, pack4(m));
      store_vec(v_state, i, pack4(v));
    }
    scalar_from = nvec * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < c.n; i += kThreads) {
    const uint64_t e = b + i, ge = gb + i;
    float p = master[e], m = m_state[e], v = v_state[e];
    uint16_t pb;
    update(device::gradient_at(grads, ge), p, m, v, pb);
    master[e] = p;
    if (has_working) params_bf16[wb + i] = pb;
    m_state[e] = m;
    v_state[e] = v;
  }
}

__global__ void bias_corrections_kernel(float* out, const long long* steps, int n, float beta1, float beta2) {
  device::start_after_previous_kernel();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[2 * i] = bias_correction(beta1, steps[i]);
  out[2 * i + 1] = bias_correction(beta2, steps[i]);
}

// ---- host helpers --------------------------------------------------------------------------

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The vector path loads four gradients at once: 16 bytes in FP32, 8 in BF16.
bool gradients_aligned(GradientView grads) { return aligned(grads.data, grads.bf16 ? 8 : 16); }

// Launches `launch(typed)` with the gradients as their storage type (float or bf16).
template <typename Launch>
void with_gradient_type(GradientView grads, Launch&& launch) {
  if (grads.bf16) {
    launch(static_cast<const __nv_bfloat16*>(grads.data));
  } else {
    launch(static_cast<const float*>(grads.data));
  }
}


}  // namespace

size_t adamw_fp8_fp16_scratch_size(const DeviceTensorTable& table) { return 4 * static_cast<size_t>(table.count) + 2; }

namespace {

template <Pass1 kMode>
void launch_pass1(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits, const float* m_scales,
                  const float* v_scales, const DeviceTensorTable& table, const AdamWHyperparams& hp,
                  const StepControl* control, unsigned* amax_bits, const uint64_t* slab_offsets, double* norm_partial,
                  cudaStream_t stream, uint32_t first_chunk = 0, uint32_t end_chunk = UINT32_MAX) {
  end_chunk = end_chunk == UINT32_MAX ? table.num_chunks : end_chunk;
  FP8LM_CHECK(first_chunk <= end_chunk && end_chunk <= table.num_chunks, "AdamW pass 1: chunks [", first_chunk, ", ",
              end_chunk, ") outside the table's ", table.num_chunks);
  if (end_chunk == first_chunk) return;
  const bool vec_ok = gradients_aligned(grads) && aligned(m_codes, 4) && aligned(v_bits, 8);
  with_gradient_type(grads, [&](const auto* typed) {
    using G = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
    launch_kernel(adamw_fp8_pass1_kernel<G, kMode>, end_chunk - first_chunk, kThreads, 0, stream, typed, m_codes,
                  v_bits, m_scales, v_scales, table, slab_offsets, hp, control, amax_bits, vec_ok, norm_partial,
                  first_chunk);
  });
}

}  // namespace

void adamw_fp8_fp16_moment_amaxes(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                  const float* m_scales, const float* v_scales, const DeviceTensorTable& table,
                                  const AdamWHyperparams& hp, const StepControl* control, float* scratch,
                                  cudaStream_t stream, const uint64_t* slab_offsets) {
  check_adamw_hyperparams(hp);
  if (table.count == 0) return;
  FP8LM_CHECK(grads && m_codes && v_bits && m_scales && v_scales && control && scratch,
              "adamw_fp8_fp16_moment_amaxes needs every array");
  unsigned* amax_bits = reinterpret_cast<unsigned*>(scratch);
  CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, 2 * static_cast<size_t>(table.count) * sizeof(unsigned), stream));
  launch_pass1<Pass1::after_decision>(grads, m_codes, v_bits, m_scales, v_scales, table, hp, control, amax_bits,
                                      slab_offsets, nullptr, stream);
}

void adamw_fp8_fp16_first_pass_begin(const DeviceTensorTable& table, float* scratch, cudaStream_t stream) {
  if (table.count == 0) return;
  FP8LM_CHECK(scratch != nullptr, "adamw_fp8_fp16_first_pass_begin needs the scratch");
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, 2 * static_cast<size_t>(table.count) * sizeof(unsigned), stream));
}

void adamw_fp8_fp16_first_pass_part(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                    const float* m_scales, const float* v_scales, const DeviceTensorTable& table,
                                    uint32_t first_chunk, uint32_t end_chunk, const AdamWHyperparams& hp,
                                    float* scratch, double* norm_scratch, cudaStream_t stream) {
  check_adamw_hyperparams(hp);
  if (first_chunk == end_chunk) return;
  FP8LM_CHECK(grads && m_codes && v_bits && m_scales && v_scales && scratch && norm_scratch,
              "adamw_fp8_fp16_first_pass_part needs every array");
  // The chunks' vector paths must be the norm kernel's (it looks at the gradients only), or
  // the per-thread sums, hence the partials, would differ.
  FP8LM_CHECK(!gradients_aligned(grads) || (aligned(m_codes, 4) && aligned(v_bits, 8)),
              "adamw_fp8_fp16_first_pass_part: the moment slabs must be aligned as the gradients are");
  launch_pass1<Pass1::with_norm>(grads, m_codes, v_bits, m_scales, v_scales, table, hp, nullptr,
                                 reinterpret_cast<unsigned*>(scratch), nullptr, norm_scratch, stream, first_chunk,
                                 end_chunk);
}

void adamw_fp8_fp16_first_pass_finish(const DeviceTensorTable& table, double* sum_of_squares,
                                      const double* norm_scratch, cudaStream_t stream) {
  FP8LM_CHECK(sum_of_squares && (table.num_chunks == 0 || norm_scratch),
              "adamw_fp8_fp16_first_pass_finish needs the sum's output and the partials");
  grad_norm_finish(sum_of_squares, norm_scratch, table.num_chunks, stream);
}

void adamw_fp8_fp16_moment_amaxes_and_norm(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                           const float* m_scales, const float* v_scales,
                                           const DeviceTensorTable& table, const AdamWHyperparams& hp, float* scratch,
                                           double* sum_of_squares, double* norm_scratch, cudaStream_t stream) {
  adamw_fp8_fp16_first_pass_begin(table, scratch, stream);
  adamw_fp8_fp16_first_pass_part(grads, m_codes, v_bits, m_scales, v_scales, table, 0, table.num_chunks, hp, scratch,
                                 norm_scratch, stream);
  adamw_fp8_fp16_first_pass_finish(table, sum_of_squares, norm_scratch, stream);
}

void adamw_fp8_fp16_moment_amaxes_if_clipped(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                             const float* m_scales, const float* v_scales,
                                             const DeviceTensorTable& table, const AdamWHyperparams& hp,
                                             const StepControl* control, float* scratch, cudaStream_t stream) {
  check_adamw_hyperparams(hp);
  if (table.count == 0) return;
  FP8LM_CHECK(grads && m_codes && v_bits && m_scales && v_scales && control && scratch,
              "adamw_fp8_fp16_moment_amaxes_if_clipped needs every array");
  unsigned* amax_bits = reinterpret_cast<unsigned*>(scratch);
  launch_kernel(zero_amaxes_if_clipped_kernel, 1, 256, 0, stream, amax_bits, 2 * table.count, control);
  launch_pass1<Pass1::if_clipped>(grads, m_codes, v_bits, m_scales, v_scales, table, hp, control, amax_bits, nullptr,
                                  nullptr, stream);
}

void adamw_fp8_fp16_apply(float* master, __nv_bfloat16* params_bf16, GradientView grads, uint8_t* m_codes,
                          uint16_t* v_bits, float* m_scales, float* v_scales, const DeviceTensorTable& table,
                          const AdamWHyperparams& hp, const StepControl* control, float* scratch,
                          cudaStream_t stream, const uint64_t* slab_offsets,
                          const DeviceWeightCastTable* weight_casts, const float* fp8_scales, float* amax_row,
                          const uint64_t* working_offsets) {
  check_adamw_hyperparams(hp);
  if (table.count == 0) return;
  FP8LM_CHECK(master && params_bf16 && grads && m_codes && v_bits && m_scales && v_scales && control && scratch,
              "adamw_fp8_fp16_apply needs every array");
  const bool vec_ok = aligned(master, 16) && gradients_aligned(grads) && aligned(params_bf16, 8) &&
                      aligned(m_codes, 4) && aligned(v_bits, 8);
  uint16_t* bf16 = reinterpret_cast<uint16_t*>(params_bf16);
  // Also for empty tensors: their scales become 1 (amax 0), as on the CPU.
  launch_kernel(adamw_fp8_scales_kernel, 1, kScaleThreads, 0, stream, m_scales, v_scales, scratch, table.count,
                hp.beta1, hp.beta2, control);
  const bool casts = weight_casts != nullptr && weight_casts->count > 0;
  if (casts)
    FP8LM_CHECK(slab_offsets == nullptr && fp8_scales != nullptr,
                "adamw_fp8_fp16_apply: weight casts need the tensors at the table's offsets and the FP8 scales");
  if (table.num_chunks > 0) {
    const DeviceWeightCastTable none;
    with_gradient_type(grads, [&](const auto* typed) {
      using G = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
      auto kernel = casts ? adamw_fp8_pass2_kernel<G, true> : adamw_fp8_pass2_kernel<G, false>;
      launch_kernel(kernel, table.num_chunks, kThreads, 0, stream, master, bf16, typed, m_codes, v_bits, m_scales,
                    v_scales, table, slab_offsets, hp, control, scratch, vec_ok, casts ? *weight_casts : none,
                    fp8_scales, amax_row, working_offsets);
    });
  }
  if (casts && weight_casts->num_tiles > 0) {
    const uint32_t blocks = (weight_casts->num_tiles + kWeightTilesPerBlock - 1) / kWeightTilesPerBlock;
    launch_kernel(transpose_weight_codes_kernel, blocks, kThreads, 0, stream, *weight_casts, kWeightTilesPerBlock);
  }
}

DeviceWeightCasts::DeviceWeightCasts(std::vector<DeviceWeightCast> casts, int tensors) {
  std::vector<int32_t> cast_of_tensor(static_cast<size_t>(tensors), -1);
  uint64_t tiles = 0;
  for (size_t i = 0; i < casts.size(); ++i) {
    DeviceWeightCast& w = casts[i];
    FP8LM_CHECK(w.tensor >= 0 && w.tensor < tensors && cast_of_tensor[static_cast<size_t>(w.tensor)] < 0,
                "AdamW weight cast of tensor ", w.tensor, ": not in the table of ", tensors, ", or cast twice");
    FP8LM_CHECK(w.codes != nullptr && w.state >= 0 && w.rows > 0 && w.cols > 0,
                "AdamW weight cast of tensor ", w.tensor, ": needs codes, a state and a shape");
    cast_of_tensor[static_cast<size_t>(w.tensor)] = static_cast<int32_t>(i);
    // A cast without a transposed copy (--no-fp8-weight-transpose-cache) takes no tiles of the
    // transpose's grid: the kernel's search lands on the next cast that has some.
    w.first_tile = static_cast<uint32_t>(tiles);
    if (w.codes_t != nullptr)
      tiles += static_cast<uint64_t>((w.rows + 63) / 64) * static_cast<uint64_t>((w.cols + 63) / 64);
    FP8LM_CHECK(tiles < static_cast<uint64_t>(std::numeric_limits<int32_t>::max()),
                "too many weight tiles for the optimizer kernels: ", tiles);
  }
  if (!casts.empty()) {
    casts_.allocate(casts.size());
    casts_.upload(casts);
  }
  cast_of_tensor_.allocate(cast_of_tensor.size());
  cast_of_tensor_.upload(cast_of_tensor);
  table_.casts = casts_.data();
  table_.cast_of_tensor = cast_of_tensor_.data();
  table_.count = static_cast<int>(casts.size());
  table_.num_tiles = static_cast<uint32_t>(tiles);
}

void adamw_step_fp8_fp16(float* master, __nv_bfloat16* params_bf16, GradientView grads, uint8_t* m_codes,
                         uint16_t* v_bits, float* m_scales, float* v_scales, const DeviceTensorTable& table,
                         const AdamWHyperparams& hp, const StepControl* control, float* scratch,
                         cudaStream_t stream) {
  adamw_fp8_fp16_moment_amaxes(grads, m_codes, v_bits, m_scales, v_scales, table, hp, control, scratch, stream);
  adamw_fp8_fp16_apply(master, params_bf16, grads, m_codes, v_bits, m_scales, v_scales, table, hp, control, scratch,
                       stream);
}

void adamw_step_fp32(float* master, __nv_bfloat16* params_bf16, GradientView grads, float* m, float* v,
                     const DeviceTensorTable& table, const AdamWHyperparams& hp, const StepControl* control,
                     cudaStream_t stream, const uint64_t* slab_offsets, const uint64_t* working_offsets) {
  check_adamw_hyperparams(hp);
  if (table.num_chunks == 0) return;
  FP8LM_CHECK(master && params_bf16 && grads && m && v && control, "adamw_step_fp32 needs every array");
  const bool vec_ok = aligned(master, 16) && gradients_aligned(grads) && aligned(params_bf16, 8) && aligned(m, 16) &&
                      aligned(v, 16);
  with_gradient_type(grads, [&](const auto* typed) {
    using G = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
    launch_kernel(adamw_fp32_kernel<G>, table.num_chunks, kThreads, 0, stream, master,
                  reinterpret_cast<uint16_t*>(params_bf16), typed, m, v, table, slab_offsets, hp, control, vec_ok,
                  working_offsets);
  });
}

void adamw_bias_corrections(float* out, const long long* steps, int n, float beta1, float beta2,
                            cudaStream_t stream) {
  FP8LM_CHECK(n >= 0, "n=", n);
  if (n == 0) return;
  FP8LM_CHECK(out && steps, "adamw_bias_corrections needs out and steps");
  launch_kernel(bias_corrections_kernel, (n + 255) / 256, 256, 0, stream, out, steps, n, beta1, beta2);
}

}  // namespace fp8lm::cuda
