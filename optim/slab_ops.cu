// Kernels of optim/slab_ops.h. No spdlog here (nvcc, C++20): errors throw through CUDA_CHECK.
#include "optim/slab_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/error.h"
#include "core/fp8_stats.cuh"
#include "core/launch.cuh"
#include "core/scaling.h"
#include "optim/grad_clip.h"  // kGradNormChunk

namespace fp8lm::cuda {
namespace {

constexpr int kThreads = 256;             // per chunk block and per element-wise block
constexpr int kMaxElementwiseBlocks = 4096;  // grid-stride beyond that
static_assert(kGradNormChunk % 4 == 0, "chunks of a tensor start 4-element aligned when the tensor does");

template <typename T>
__host__ __device__ __forceinline__ bool aligned(const T* pointer, size_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

// ---- chunk decomposition --------------------------------------------------------------

// The elements block `c` owns: [begin, begin + n) of tensor `tensor`, n <= kGradNormChunk.
struct ChunkSpan {
  uint64_t begin;
  uint32_t n;
  int tensor;
};

__device__ __forceinline__ ChunkSpan chunk_span(const DeviceTensorTable& table, uint32_t c) {
  ChunkSpan span;
  span.tensor = table.chunk_tensor[c];
  const uint64_t start = static_cast<uint64_t>(c - table.chunk_begin[span.tensor]) * kGradNormChunk;
  const uint64_t left = table.numels[span.tensor] - start;
  span.begin = table.offsets[span.tensor] + start;
  span.n = static_cast<uint32_t>(left < kGradNormChunk ? left : kGradNormChunk);
  return span;
}

// ---- element helpers -----------------------------------------------------------------

template <Fp8Dtype kDtype>
__host__ __device__ constexpr __nv_fp8_interpretation_t interp() {
  return kDtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2;
}

// cvt.rn.satfinite: round to nearest even, saturate finite overflow and infinities, NaN -> 0x7F;
// bit for bit core/fp8.h's fp8_encode.
template <Fp8Dtype kDtype>
__device__ __forceinline__ uint8_t encode(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, interp<kDtype>()));
}

// Four codes in one word, x[0] at the lowest address (little-endian).
template <Fp8Dtype kDtype>
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
  return device::fp8x2(a, b, interp<kDtype>()) | (device::fp8x2(c, d, interp<kDtype>()) << 16);
}

// Every FP8 value is an FP16 value (E4M3 down to 2^-9, E5M2 down to 2^-16 are FP16 normals or
// subnormals), so code -> half -> float is exact.
template <Fp8Dtype kDtype>
__device__ __forceinline__ float decode(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), interp<kDtype>());
  return __half2float(__half(h));
}

// |x| as amax bits with NaN ignored (contributes 0, so it never wins): tensor_amaxes.
__device__ __forceinline__ unsigned abs_bits_ignoring_nan(float x) {
  const unsigned bits = device::abs_bits(x);
  return bits > 0x7f800000u ? 0u : bits;
}

// ---- tensor_amaxes -------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    tensor_amaxes_kernel(float* amaxes, const float* __restrict__ values, DeviceTensorTable table) {
  device::start_after_previous_kernel();
  const ChunkSpan span = chunk_span(table, blockIdx.x);
  const float* x = values + span.begin;
  unsigned local = 0;
  uint32_t scalar_from = 0;
  if (aligned(x, 16)) {
    const uint32_t groups = span.n / 4;
    for (uint32_t j = threadIdx.x; j < groups; j += kThreads) {
      const float4 v = reinterpret_cast<const float4*>(x)[j];
      local = max(local, max(max(abs_bits_ignoring_nan(v.x), abs_bits_ignoring_nan(v.y)),
                             max(abs_bits_ignoring_nan(v.z), abs_bits_ignoring_nan(v.w))));
    }
    scalar_from = groups * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < span.n; i += kThreads) local = max(local, abs_bits_ignoring_nan(x[i]));
  device::block_amax_update(amaxes + span.tensor, local);  // skips the atomic when the chunk's max is 0
}

// ---- scales_from_amaxes --------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) scales_from_amaxes_kernel(float* __restrict__ scales,
                                                                      float* __restrict__ scale_inv,
                                                                      const float* __restrict__ amaxes, int count,
                                                                      float fp8_max, float headroom) {
  device::start_after_previous_kernel();
  const int k = blockIdx.x * kThreads + threadIdx.x;
  if (k >= count) return;
  const float s = compute_scale(__fmul_rn(amaxes[k], headroom), fp8_max, /*margin=*/0, /*previous_scale=*/1.0f);
  scales[k] = s;
  scale_inv[k] = __fdiv_rn(1.0f, s);
}

// ---- quantize_tensors ----------------------------------------------------------------------

// kStats: also tallies the FP8 cast statistics into counts[s].
template <Fp8Dtype kDtype, bool kStats = false>
__global__ void __launch_bounds__(kThreads)
    quantize_tensors_kernel(uint8_t* __restrict__ codes, const float* __restrict__ values, DeviceTensorTable table,
                            const float* __restrict__ scales, const int* __restrict__ scale_index,
                            float* recorded_amax, Fp8CastCounts* counts) {
  device::start_after_previous_kernel();
  const ChunkSpan span = chunk_span(table, blockIdx.x);
  const int s = scale_index ? scale_index[span.tensor] : span.tensor;
  if (s < 0) return;  // the whole block leaves: none of its threads reaches the block reduction
  const float scale = scales[s];
  const float* x = values + span.begin;
  uint8_t* q = codes + span.begin;
  unsigned local = 0;  // amax bits; NaN stays above +inf and becomes 0x7FC00000 at the commit
  Fp8CastTally tally;
  uint32_t scalar_from = 0;
  if (aligned(x, 16) && aligned(q, 4)) {
    const uint32_t groups = span.n / 4;
    for (uint32_t j = threadIdx.x; j < groups; j += kThreads) {
      const float4 v = reinterpret_cast<const float4*>(x)[j];
      local = max(local, max(max(device::abs_bits(v.x), device::abs_bits(v.y)),
                             max(device::abs_bits(v.z), device::abs_bits(v.w))));
      const uint32_t word = encode4<kDtype>(__fmul_rn(v.x, scale), __fmul_rn(v.y, scale), __fmul_rn(v.z, scale),
                                            __fmul_rn(v.w, scale));
      reinterpret_cast<uint32_t*>(q)[j] = word;
      if constexpr (kStats) {
        const float four[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          tally.add(four[e], __fmul_rn(four[e], scale), device::fp8_code_at(word, e), kDtype);
      }
    }
    scalar_from = groups * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < span.n; i += kThreads) {
    const float v = x[i];
    local = max(local, device::abs_bits(v));
    q[i] = encode<kDtype>(__fmul_rn(v, scale));
    if constexpr (kStats) tally.add(v, __fmul_rn(v, scale), q[i], kDtype);
  }
  if (recorded_amax != nullptr) device::block_amax_update(recorded_amax + s, local);
  if constexpr (kStats) device::commit_fp8_tally(counts + s, tally, scale);
}

// ---- sum_fp8_chunks ------------------------------------------------------------------------

// vec_ok: the chunks base and chunk_stride are multiples of 4 bytes, so every rank's copy of
// a 4-aligned chunk is 4-aligned too.
template <Fp8Dtype kDtype>
__global__ void __launch_bounds__(kThreads)
    sum_fp8_chunks_kernel(float* __restrict__ out, const uint8_t* __restrict__ chunks, int ranks,
                          size_t chunk_stride, DeviceTensorTable table, const float* __restrict__ scale_inv,
                          bool vec_ok) {
  device::start_after_previous_kernel();
  const ChunkSpan span = chunk_span(table, blockIdx.x);
  const float inv = scale_inv[span.tensor];
  const uint8_t* q = chunks + span.begin;
  float* y = out + span.begin;
  uint32_t scalar_from = 0;
  if (vec_ok && aligned(q, 4) && aligned(y, 16)) {
    const uint32_t groups = span.n / 4;
    for (uint32_t j = threadIdx.x; j < groups; j += kThreads) {
      uint32_t word = reinterpret_cast<const uint32_t*>(q)[j];
      float sum[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[e] = decode<kDtype>(static_cast<uint8_t>(word >> (8 * e)));
      for (int r = 1; r < ranks; ++r) {  // rank order, as the CPU
        word = reinterpret_cast<const uint32_t*>(q + static_cast<size_t>(r) * chunk_stride)[j];
#pragma unroll
        for (int e = 0; e < 4; ++e) sum[e] = __fadd_rn(sum[e], decode<kDtype>(static_cast<uint8_t>(word >> (8 * e))));
      }
      reinterpret_cast<float4*>(y)[j] =
          make_float4(__fmul_rn(sum[0], inv), __fmul_rn(sum[1], inv), __fmul_rn(sum[2], inv), __fmul_rn(sum[3], inv));
    }
    scalar_from = groups * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < span.n; i += kThreads) {
    float sum = decode<kDtype>(q[i]);
    for (int r = 1; r < ranks; ++r) sum = __fadd_rn(sum, decode<kDtype>(q[static_cast<size_t>(r) * chunk_stride + i]));
    y[i] = __fmul_rn(sum, inv);
  }
}

// ---- BF16 conversions (grid-stride over groups of 4, then the tail) -------------------------

__global__ void __launch_bounds__(kThreads) f32_to_bf16_kernel(__nv_bfloat16* __restrict__ out,
                                                               const float* __restrict__ in, size_t n, bool vec_ok) {
  device::start_after_previous_kernel();
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  const size_t thread = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  size_t scalar_from = 0;
  if (vec_ok) {  // in 16-byte aligned, out 8-byte aligned
    const size_t groups = n / 4;
    for (size_t g = thread; g < groups; g += stride) {
      const float4 v = reinterpret_cast<const float4*>(in)[g];
      const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
      uint2 raw;
      memcpy(&raw, pair, sizeof raw);
      reinterpret_cast<uint2*>(out)[g] = raw;
    }
    scalar_from = groups * 4;
  }
  for (size_t i = scalar_from + thread; i < n; i += stride) out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void __launch_bounds__(kThreads) bf16_to_f32_kernel(float* __restrict__ out,
                                                               const __nv_bfloat16* __restrict__ in, size_t n,
                                                               bool vec_ok) {
  device::start_after_previous_kernel();
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  const size_t thread = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  size_t scalar_from = 0;
  if (vec_ok) {  // in 8-byte aligned, out 16-byte aligned
    const size_t groups = n / 4;
    for (size_t g = thread; g < groups; g += stride) {
      const uint2 raw = reinterpret_cast<const uint2*>(in)[g];
      __nv_bfloat162 pair[2];
      memcpy(pair, &raw, sizeof raw);
      const float2 lo = __bfloat1622float2(pair[0]);
      const float2 hi = __bfloat1622float2(pair[1]);
      reinterpret_cast<float4*>(out)[g] = make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    scalar_from = groups * 4;
  }
  for (size_t i = scalar_from + thread; i < n; i += stride) out[i] = __bfloat162float(in[i]);
}

int elementwise_blocks(size_t n) {
  const size_t groups = (n + 3) / 4;
  const size_t blocks = (groups + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxElementwiseBlocks ? blocks : kMaxElementwiseBlocks);
}

void check_table(const DeviceTensorTable& table, const char* what) {
  FP8LM_CHECK(table.count >= 0, what, ": table count ", table.count);
  FP8LM_CHECK(table.offsets != nullptr && table.numels != nullptr && table.chunk_begin != nullptr &&
                  table.chunk_tensor != nullptr,
              what, ": the table has no device arrays");
}

}  // namespace

void tensor_amaxes(float* amaxes, const float* values, const DeviceTensorTable& table, cudaStream_t stream) {
  if (table.num_chunks == 0) return;
  check_table(table, "tensor_amaxes");
  FP8LM_CHECK(amaxes != nullptr && values != nullptr, "tensor_amaxes needs amaxes and values");
  launch_kernel(tensor_amaxes_kernel, table.num_chunks, kThreads, 0, stream, amaxes, values, table);
}

void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                        float headroom, cudaStream_t stream) {
  FP8LM_CHECK(count >= 0, "scales_from_amaxes count ", count);
  FP8LM_CHECK(fp8_max > 0.0f && headroom > 0.0f, "scales_from_amaxes fp8_max ", fp8_max, " headroom ", headroom);
  if (count == 0) return;
  FP8LM_CHECK(scales != nullptr && scale_inv != nullptr && amaxes != nullptr,
              "scales_from_amaxes needs scales, scale_inv and amaxes");
  launch_kernel(scales_from_amaxes_kernel, (count + kThreads - 1) / kThreads, kThreads, 0, stream, scales, scale_inv,
                amaxes, count, fp8_max, headroom);
}

void quantize_tensors(uint8_t* codes, const float* values, const DeviceTensorTable& table, const float* scales,
                      const int* scale_index, float* recorded_amax, Fp8Dtype dtype, cudaStream_t stream,
                      Fp8CastCounts* counts) {
  if (table.num_chunks == 0) return;
  check_table(table, "quantize_tensors");
  FP8LM_CHECK(codes != nullptr && values != nullptr && scales != nullptr,
              "quantize_tensors needs codes, values and scales");
  // Without statistics, the very kernel the casts always ran (kStats = false).
  auto launch = [&](auto kernel) {
    launch_kernel(kernel, table.num_chunks, kThreads, 0, stream, codes, values, table, scales, scale_index,
                  recorded_amax, counts);
  };
  if (dtype == Fp8Dtype::e4m3) {
    counts ? launch(quantize_tensors_kernel<Fp8Dtype::e4m3, true>) : launch(quantize_tensors_kernel<Fp8Dtype::e4m3>);
  } else {
    counts ? launch(quantize_tensors_kernel<Fp8Dtype::e5m2, true>) : launch(quantize_tensors_kernel<Fp8Dtype::e5m2>);
  }
}

void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride,
                    const DeviceTensorTable& table, const float* scale_inv, Fp8Dtype dtype, cudaStream_t stream) {
  FP8LM_CHECK(ranks >= 1, "sum_fp8_chunks needs at least one rank, got ", ranks);
  FP8LM_CHECK(ranks == 1 || chunk_stride >= table.total_elements, "sum_fp8_chunks: chunk_stride ", chunk_stride,
              " is shorter than a chunk (", table.total_elements, " elements)");
  if (table.num_chunks == 0) return;
  check_table(table, "sum_fp8_chunks");
  FP8LM_CHECK(out != nullptr && chunks != nullptr && scale_inv != nullptr,
              "sum_fp8_chunks needs out, chunks and scale_inv");
  const bool vec_ok = aligned(chunks, 4) && chunk_stride % 4 == 0;
  if (dtype == Fp8Dtype::e4m3) {
    launch_kernel(sum_fp8_chunks_kernel<Fp8Dtype::e4m3>, table.num_chunks, kThreads, 0, stream, out, chunks, ranks,
                  chunk_stride, table, scale_inv, vec_ok);
  } else {
    launch_kernel(sum_fp8_chunks_kernel<Fp8Dtype::e5m2>, table.num_chunks, kThreads, 0, stream, out, chunks, ranks,
                  chunk_stride, table, scale_inv, vec_ok);
  }
}

void convert_f32_to_bf16(__nv_bfloat16* out, const float* in, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  FP8LM_CHECK(out != nullptr && in != nullptr, "convert_f32_to_bf16 needs out and in");
  const bool vec_ok = aligned(in, 16) && aligned(out, 8);
  launch_kernel(f32_to_bf16_kernel, elementwise_blocks(n), kThreads, 0, stream, out, in, n, vec_ok);
}

void convert_bf16_to_f32(float* out, const __nv_bfloat16* in, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  FP8LM_CHECK(out != nullptr && in != nullptr, "convert_bf16_to_f32 needs out and in");
  const bool vec_ok = aligned(in, 8) && aligned(out, 16);
  launch_kernel(bf16_to_f32_kernel, elementwise_blocks(n), kThreads, 0, stream, out, in, n, vec_ok);
}

}  // namespace fp8lm::cuda
