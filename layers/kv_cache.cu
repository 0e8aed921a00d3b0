// Key/value cache kernels (see layers/kv_cache.h).
//
// Append: elementwise over channel pairs. A first FP8 append runs an amax pass (per-block
// maxima, atomicMax on the float bits) and a one-thread kernel that turns the amaxes into
// scales, so the scales never visit the host.
//
// Decode: one 128-thread block per (head, sequence). The four warps take keys in turn; the
// lanes of a warp split the head's channels in pairs, so a key row is one coalesced load,
// and a shuffle reduction gives its score. The softmax runs over the scores in shared
// memory. For the weighted sum of the values, the threads split into groups of HS/2 (one
// channel pair each); each group takes every groups-th position and the groups' partial
// sums are added in a fixed order. No floating-point atomics: bit-reproducible.
#include "layers/kv_cache.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/error.h"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr int kAppendThreads = 256;
constexpr int kAmaxMaxBlocks = 1024;
constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

// A channel pair of a cache row, as FP32.
__device__ __forceinline__ float2 load_pair(const void* base, size_t element, bool fp8) {
  if (fp8) {
    __nv_fp8x2_e4m3 pair;
    pair.__x = *reinterpret_cast<const __nv_fp8x2_storage_t*>(static_cast<const uint8_t*>(base) + element);
    return static_cast<float2>(pair);
  }
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(base) + element));
}

__device__ __forceinline__ void store_pair(void* base, size_t element, float2 value, bool fp8, float scale) {
  if (fp8) {
    const uint32_t codes = fp8x2(value.x * scale, value.y * scale, __NV_E4M3);
    *reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(base) + element) = static_cast<uint16_t>(codes);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(base) + element) = __floats2bfloat162_rn(value.x, value.y);
  }
}

// amaxes[0] = max |k|, amaxes[1] = max |v| over qkv [rows, 3C] (running max on the bits).
__global__ void __launch_bounds__(kAppendThreads) key_value_amax_kernel(float* amaxes, const bf16* __restrict__ qkv,
                                                                        int64_t rows, int C) {
  unsigned key_bits = 0, value_bits = 0;
  const int64_t pairs = rows * (C / 2);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (C / 2), c = 2 * (i % (C / 2));
    const bf16* r = qkv + row * 3 * C;
    const float2 k = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(r + C + c));
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(r + 2 * C + c));
    key_bits = max(key_bits, max(abs_bits(k.x), abs_bits(k.y)));
    value_bits = max(value_bits, max(abs_bits(v.x), abs_bits(v.y)));
  }
  block_amax_update(amaxes, key_bits);
  __syncthreads();  // block_amax_update's shared slots are reused
  block_amax_update(amaxes + 1, value_bits);
}

__global__ void kv_scales_kernel(float* scales, const float* amaxes) {
  scales[0] = kv_cache_scale(amaxes[0]);
  scales[1] = kv_cache_scale(amaxes[1]);
}

__global__ void __launch_bounds__(kAppendThreads) kv_cache_append_kernel(void* keys, void* values, bool fp8,
                                                                         const float* scales,
                                                                         const bf16* __restrict__ qkv, int B, int n,
                                                                         int C, int capacity, int position) {
  const int64_t pairs = int64_t(B) * n * (C / 2);
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= pairs) return;
  const int64_t row = i / (C / 2);  // b * n + t
  const int c = int(2 * (i % (C / 2)));
  const int64_t b = row / n, t = row % n;
  const bf16* r = qkv + row * 3 * C;
  const size_t at = size_t(b * capacity + position + t) * C + c;
  const float k_scale = fp8 ? scales[0] : 1.0f, v_scale = fp8 ? scales[1] : 1.0f;
  store_pair(keys, at, __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(r + C + c)), fp8, k_scale);
  store_pair(values, at, __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(r + 2 * C + c)), fp8, v_scale);
}

// Block-wide reduction of one value per thread (max or sum), the result on every thread.
template <bool kMax>
__device__ float block_reduce(float value, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  float result = shared[0];
  for (int w = 1; w < kDecodeWarps; ++w) result = kMax ? fmaxf(result, shared[w]) : result + shared[w];
  return result;
}

// grid (NH, B), block kDecodeThreads; dynamic shared memory: length + kDecodeThreads * 2
// floats (scores, then the groups' partial sums).
__global__ void __launch_bounds__(kDecodeThreads) attention_decode_kernel(bf16* __restrict__ out,
                                                                          const bf16* __restrict__ qkv,
                                                                          const void* keys, const void* values,
                                                                          bool fp8, const float* scales, int C,
                                                                          int NH, int capacity, int length) {
  extern __shared__ float shared[];
  float* scores = shared;                 // [length]
  float* partial = shared + length;       // [groups][HS]
  __shared__ float reduce_slots[kDecodeWarps];
  const int h = blockIdx.x, b = blockIdx.y;
  const int HS = C / NH, pairs = HS / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float k_scale_inv = fp8 ? 1.0f / scales[0] : 1.0f;
  const float v_scale_inv = fp8 ? 1.0f / scales[1] : 1.0f;
  const float score_scale = k_scale_inv * rsqrtf(float(HS));
  const bf16* q = qkv + size_t(b) * 3 * C + size_t(h) * HS;
  const size_t cache_row0 = size_t(b) * capacity;

  // Scores: q . k_s, a warp per key, lanes over channel pairs.
  float local_max = -INFINITY;
  for (int s = warp; s < length; s += kDecodeWarps) {
    const size_t row = (cache_row0 + s) * C + size_t(h) * HS;
    float dot = 0.0f;
    for (int p = lane; p < pairs; p += 32) {
      const float2 qq = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(q + 2 * p));
      const float2 kk = load_pair(keys, row + 2 * p, fp8);
      dot += qq.x * kk.x + qq.y * kk.y;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) scores[s] = dot * score_scale;
    local_max = fmaxf(local_max, dot * score_scale);
  }
  const float max_score = block_reduce<true>(local_max, reduce_slots);  // syncs: every score is written

  float local_sum = 0.0f;
  for (int s = threadIdx.x; s < length; s += blockDim.x) {
    const float e = __expf(scores[s] - max_score);
    scores[s] = e;
    local_sum += e;
  }
  const float sum = block_reduce<false>(local_sum, reduce_slots);  // syncs: every exp is written

  // out = sum_s P[s] v_s: groups of `pairs` threads, group g over positions g, g + groups, ...
  const int groups = max(1, kDecodeThreads / pairs);
  const int group = threadIdx.x / pairs, p = threadIdx.x % pairs;
  float2 acc = make_float2(0.0f, 0.0f);
  if (group < groups) {
    for (int s = group; s < length; s += groups) {
      const float2 vv = load_pair(values, (cache_row0 + s) * C + size_t(h) * HS + 2 * p, fp8);
      acc.x += scores[s] * vv.x;
      acc.y += scores[s] * vv.y;
    }
    partial[group * HS + 2 * p] = acc.x;
    partial[group * HS + 2 * p + 1] = acc.y;
  }
  __syncthreads();
  if (group == 0) {
    float2 total = make_float2(partial[2 * p], partial[2 * p + 1]);
    for (int g = 1; g < groups; ++g) {
      total.x += partial[g * HS + 2 * p];
      total.y += partial[g * HS + 2 * p + 1];
    }
    const float norm = v_scale_inv / sum;
    *reinterpret_cast<__nv_bfloat162*>(out + size_t(b) * C + size_t(h) * HS + 2 * p) =
        __floats2bfloat162_rn(total.x * norm, total.y * norm);
  }
}

void check_shape(const char* what, int B, int C, int NH, int capacity) {
  FP8LM_CHECK(B > 0 && C > 0 && NH > 0 && capacity > 0, what, ": bad shape B=", B, " C=", C, " NH=", NH,
              " capacity=", capacity);
  FP8LM_CHECK(C % NH == 0, what, ": C=", C, " is not a multiple of NH=", NH);
  const int HS = C / NH;
  FP8LM_CHECK(HS % 2 == 0 && HS <= 2 * kDecodeThreads, what, ": head size ", HS, " must be even and at most ",
              2 * kDecodeThreads);
}

}  // namespace

void kv_cache_append(void* keys, void* values, bool cache_fp8, float* scales, float* scratch, const bf16* qkv, int B,
                     int n, int C, int capacity, int position, cudaStream_t stream) {
  FP8LM_CHECK(B > 0 && C > 0 && C % 2 == 0 && capacity > 0, "kv_cache_append: bad shape B=", B, " C=", C,
              " capacity=", capacity);
  FP8LM_CHECK(n > 0 && position >= 0 && position + n <= capacity, "kv_cache_append: positions [", position, ", ",
              position + n, ") outside the cache's ", capacity);
  FP8LM_CHECK(reinterpret_cast<uintptr_t>(qkv) % 4 == 0, "kv_cache_append: qkv must be 4-byte aligned");
  FP8LM_CHECK(!cache_fp8 || (scales != nullptr && scratch != nullptr), "kv_cache_append: an FP8 cache needs scales");
  const int64_t pairs = int64_t(B) * n * (C / 2);
  if (cache_fp8 && position == 0) {
    CUDA_CHECK(cudaMemsetAsync(scratch, 0, kKvCacheScratchFloats * sizeof(float), stream));
    const int blocks = int(std::min<int64_t>(kAmaxMaxBlocks, (pairs + kAppendThreads - 1) / kAppendThreads));
    key_value_amax_kernel<<<blocks, kAppendThreads, 0, stream>>>(scratch, qkv, int64_t(B) * n, C);
    CUDA_CHECK_LAUNCH();
    kv_scales_kernel<<<1, 1, 0, stream>>>(scales, scratch);
    CUDA_CHECK_LAUNCH();
  }
  const int64_t blocks = (pairs + kAppendThreads - 1) / kAppendThreads;
  FP8LM_CHECK(blocks < (int64_t{1} << 31), "kv_cache_append: too many rows");
  kv_cache_append_kernel<<<unsigned(blocks), kAppendThreads, 0, stream>>>(keys, values, cache_fp8, scales, qkv, B, n,
                                                                          C, capacity, position);
  CUDA_CHECK_LAUNCH();
}

void attention_decode(bf16* out, const bf16* qkv, const void* keys, const void* values, bool cache_fp8,
                      const float* scales, int B, int C, int NH, int capacity, int length, cudaStream_t stream) {
  check_shape("attention_decode", B, C, NH, capacity);
  FP8LM_CHECK(length >= 1 && length <= capacity, "attention_decode: length ", length, " outside [1, ", capacity, "]");
  FP8LM_CHECK(reinterpret_cast<uintptr_t>(qkv) % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0,
              "attention_decode: qkv and out must be 4-byte aligned");
  FP8LM_CHECK(!cache_fp8 || scales != nullptr, "attention_decode: an FP8 cache needs scales");
  const int HS = C / NH;
  const int groups = std::max(1, kDecodeThreads / (HS / 2));
  const size_t shared_bytes = (size_t(length) + size_t(groups) * HS) * sizeof(float);
  static constexpr size_t kDefaultSharedLimit = 48 * 1024;
  if (shared_bytes > kDefaultSharedLimit) {
    CUDA_CHECK(cudaFuncSetAttribute(attention_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(shared_bytes)));
  }
  attention_decode_kernel<<<dim3(unsigned(NH), unsigned(B)), kDecodeThreads, shared_bytes, stream>>>(
      out, qkv, keys, values, cache_fp8, scales, C, NH, capacity, length);
  CUDA_CHECK_LAUNCH();
}

}  // namespace fp8lm::cuda
