// Key/value cache kernels (see layers/kv_cache.h).
//
// Append: elementwise over channel pairs. A first FP8 append runs an amax pass (per-block
// maxima, atomicMax on the float bits) and a one-thread kernel that turns the amaxes into
// scales, so the scales never visit the host.
//
// Decode (flash-decoding): the positions of each (head, sequence) in splits of 128, one
// 128-thread block each: neighbouring lanes read a cache row together, 16 bytes each (8 BF16
// values or 16 E4M3 codes), keys and values in one batch of loads; the block's softmax is
// taken relative to its own maximum, and each group of a row's lanes sums the values of the
// rows it scored, the groups' partial sums added in a fixed order. A second kernel rescales
// the splits' parts to the largest maximum and adds them in split order. No floating-point
// atomics: bit-reproducible.
#include "layers/kv_cache.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/error.h"
#include "core/launch.cuh"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr int kAppendThreads = 256;
constexpr int kAmaxMaxBlocks = 1024;
constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

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
  device::start_after_previous_kernel();
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
  device::start_after_previous_kernel();
  scales[0] = kv_cache_scale(amaxes[0]);
  scales[1] = kv_cache_scale(amaxes[1]);
}

__global__ void __launch_bounds__(kAppendThreads) kv_cache_append_kernel(void* keys, void* values, bool fp8,
                                                                         const float* scales,
                                                                         const bf16* __restrict__ qkv, int B, int n,
                                                                         int C, int capacity, int position,
                                                                         const int32_t* stored_position) {
  device::start_after_previous_kernel();
  if (stored_position) position = *stored_position;
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

__host__ __device__ inline int decode_splits(int length) { return (length + kDecodeThreads - 1) / kDecodeThreads; }

// A lane's 16 bytes of a cache row, to FP32: 8 BF16 values or 16 E4M3 codes.
template <bool kFp8>
__device__ __forceinline__ void unpack_cache_piece(const uint4& raw, float (&v)[kFp8 ? 16 : 8]) {
  if constexpr (!kFp8) {
    unpack_bf16x8(raw, v);
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        __nv_fp8x2_e4m3 pair;
        pair.__x = static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * half));
        const float2 f = static_cast<float2>(pair);
        v[4 * w + 2 * half] = f.x;
        v[4 * w + 2 * half + 1] = f.y;
      }
  }
}

// Split decoding (flash-decoding): the cache positions of a (head, sequence) are cut into
// splits of kDecodeThreads, one block each, so that a short batch still fills the GPU (one
// block per (head, sequence) over 1,024 positions ran at 36 GB/s on an H100). Each block
// writes its part of the softmax unnormalised, relative to its own maximum; a second kernel
// combines the parts in split order. partials [B][NH][splits][HS + 2]: the weighted value sum,
// then the split's maximum score and its sum of exponentials.
// A cache row of the head is read by neighbouring lanes 16 bytes each (8 BF16 values or 16
// E4M3 codes: an FP8 split issues half as many loads as a BF16 one, each as wide), and every
// key and value load of the split is issued before the first is used, so a block waits on
// memory once (a thread per key reading 4 bytes at a time ran at 1.0 TB/s at batch 32, call
// 135; the values loaded after the softmax and 8-byte FP8 lanes cost 6.9% of a batch-32 FP8-
// cache step at gpt2-1558m, docs/INFERENCE.md).
// Scores: each lane's products in order, then a butterfly over the row's lanes. Values: group g
// of the row-lane groups sums positions g, g + groups, ... in order; a warp's groups are added
// by a butterfly, the warps' sums in warp order.
// With stored_position (a recorded step replayed at any position) the length is read from
// memory and the grid covers the whole cache: blocks past the length return at once.
// grid (NH, B, splits), block kDecodeThreads.
template <int HS, bool kFp8>
__global__ void __launch_bounds__(kDecodeThreads) attention_decode_split_kernel(float* __restrict__ partials,
                                                                                const bf16* __restrict__ qkv,
                                                                                void* keys, void* values,
                                                                                const float* scales, int C, int NH,
                                                                                int capacity, int length,
                                                                                const int32_t* stored_position,
                                                                                bool append) {
  device::start_after_previous_kernel();
  constexpr int kPerLane = kFp8 ? 16 : 8;                      // values in a lane's 16 bytes
  constexpr int kLanesPerRow = HS / kPerLane;
  constexpr int kRowsPerStep = kDecodeThreads / kLanesPerRow;  // rows the block reads at once (= lane groups)
  constexpr int kSteps = kDecodeThreads / kRowsPerStep;        // rows of the split per lane group
  // The values' loads go out with the keys' unless that would hold more than 8 pieces a thread
  // (BF16 at head size 128, whose 16 key pieces already take 64 registers; not measured).
  constexpr bool kValuesWithKeys = kSteps <= 8;
  constexpr size_t kElementBytes = kFp8 ? 1 : 2;
  static_assert(HS % kPerLane == 0 && 32 % kLanesPerRow == 0, "a row's lanes lie in one warp");
  if (stored_position) length = *stored_position + 1;
  const int split = blockIdx.z, first = split * kDecodeThreads;
  if (first >= length) return;  // beyond the stored length: the combining kernel reads no part of it
  __shared__ float scores[kDecodeThreads];
  __shared__ float warp_sums[kDecodeWarps][HS];
  __shared__ float reduce_slots[kDecodeWarps];
  const int h = blockIdx.x, b = blockIdx.y, splits = gridDim.z;
  const int lane_of_row = threadIdx.x % kLanesPerRow, group = threadIdx.x / kLanesPerRow;
  const int channel = h * HS + kPerLane * lane_of_row;  // this thread's channels of the head
  const size_t cache_row0 = size_t(b) * capacity + first;
  const int count = min(kDecodeThreads, length - first);
  const bf16* new_qkv = qkv + size_t(b) * 3 * C + channel;  // this token's q; + C its key, + 2C its value

  // This thread's piece of rows group + kRowsPerStep * s (s < kSteps). With `append`, the new
  // token's row (the last position, in the last split) comes from qkv (part 1: the key, 2: the
  // value) and is stored into the cache as kv_cache_append stores it.
  const int new_row = append ? length - 1 - first : -1;
  auto load_rows = [&](void* cache, int part, uint4 (&raw)[kSteps]) {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int row = group + kRowsPerStep * s;
      uint8_t* piece = static_cast<uint8_t*>(cache) + ((cache_row0 + row) * C + channel) * kElementBytes;
      if (row == new_row) {
        const uint4* source = reinterpret_cast<const uint4*>(new_qkv + size_t(part) * C);
        if constexpr (kFp8) {
          float x[8];
          uint2 codes[2];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            unpack_bf16x8(source[half], x);
            codes[half] = fp8x8(x, scales[part - 1], __NV_E4M3);
          }
          raw[s] = make_uint4(codes[0].x, codes[0].y, codes[1].x, codes[1].y);
        } else {
          raw[s] = *source;
        }
        *reinterpret_cast<uint4*>(piece) = raw[s];
      } else {
        raw[s] = row < count ? *reinterpret_cast<const uint4*>(piece) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  uint4 key_pieces[kSteps], value_pieces[kSteps];
  load_rows(keys, 1, key_pieces);
  if constexpr (kValuesWithKeys) load_rows(values, 2, value_pieces);

  float q[kPerLane];
#pragma unroll
  for (int half = 0; half < kPerLane / 8; ++half) {
    float eight[8];
    unpack_bf16x8(reinterpret_cast<const uint4*>(new_qkv)[half], eight);
#pragma unroll
    for (int j = 0; j < 8; ++j) q[8 * half + j] = eight[j];
  }
  const float k_scale_inv = kFp8 ? 1.0f / scales[0] : 1.0f;
  const float score_scale = k_scale_inv * rsqrtf(float(HS));

  // Scores.
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    float k[kPerLane];
    unpack_cache_piece<kFp8>(key_pieces[s], k);
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) dot += q[j] * k[j];
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const int row = group + kRowsPerStep * s;
    if (lane_of_row == 0) scores[row] = row < count ? dot * score_scale : -INFINITY;
  }
  __syncthreads();
  const float score = scores[threadIdx.x];
  const float max_score = block_reduce<true>(score, reduce_slots);  // syncs: every score is read
  const float e = threadIdx.x < count ? __expf(score - max_score) : 0.0f;
  scores[threadIdx.x] = e;
  const float sum = block_reduce<false>(e, reduce_slots);  // syncs: every exponential is written

  // The weighted value sum: group g over rows g, g + kRowsPerStep, ... (the rows it scored).
  if constexpr (!kValuesWithKeys) load_rows(values, 2, value_pieces);
  float acc[kPerLane] = {};
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int row = group + kRowsPerStep * s;
    if (row >= count) continue;
    float v[kPerLane];
    unpack_cache_piece<kFp8>(value_pieces[s], v);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] += scores[row] * v[j];
  }
  // A warp's groups summed by a butterfly over the lane bits that number them (every lane ends
  // with the same bits), then the warps' sums in warp order: a short chain, where a sum over
  // every group in turn from shared memory was on the step's critical path at batch 1.
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
#pragma unroll
    for (int offset = kLanesPerRow; offset < 32; offset *= 2) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], offset);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < kLanesPerRow)
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) warp_sums[warp][kPerLane * lane_of_row + j] = acc[j];
  __syncthreads();
  float* part = partials + ((size_t(b) * NH + h) * splits + split) * (HS + 2);
  for (int d = threadIdx.x; d < HS; d += kDecodeThreads) {
    float total = warp_sums[0][d];
#pragma unroll
    for (int w = 1; w < kDecodeWarps; ++w) total += warp_sums[w][d];
    part[d] = total;
  }
  if (threadIdx.x == 0) {
    part[HS] = max_score;
    part[HS + 1] = sum;
  }
}

// out = the splits' parts rescaled to the largest maximum, in split order; parts are
// `stride` splits apart, `splits` of them in use (from stored_position when set). grid (NH, B),
// block HS / 2 threads (a channel pair each). out_fp8 (nullable): also the codes of the BF16
// out times *out_scale, as cast_fp8 would write them from out.
__global__ void attention_decode_combine_kernel(bf16* __restrict__ out, uint8_t* __restrict__ out_fp8,
                                                const float* __restrict__ out_scale, __nv_fp8_interpretation_t interp,
                                                const float* __restrict__ partials, const float* scales, bool fp8,
                                                int C, int NH, int stride, int splits,
                                                const int32_t* stored_position) {
  device::start_after_previous_kernel();
  if (stored_position) splits = decode_splits(*stored_position + 1);
  const int h = blockIdx.x, b = blockIdx.y, p = threadIdx.x;
  const int HS = C / NH;
  const float* parts = partials + (size_t(b) * NH + h) * stride * (HS + 2);
  float max_score = -INFINITY;
  for (int s = 0; s < splits; ++s) max_score = fmaxf(max_score, parts[s * (HS + 2) + HS]);
  float sum = 0.0f;
  float2 total = make_float2(0.0f, 0.0f);
  for (int s = 0; s < splits; ++s) {
    const float* part = parts + s * (HS + 2);
    const float weight = __expf(part[HS] - max_score);
    sum += part[HS + 1] * weight;
    total.x += part[2 * p] * weight;
    total.y += part[2 * p + 1] * weight;
  }
  const float norm = (fp8 ? 1.0f / scales[1] : 1.0f) / sum;
  const size_t at = size_t(b) * C + size_t(h) * HS + 2 * p;
  const __nv_bfloat162 pair = __floats2bfloat162_rn(total.x * norm, total.y * norm);
  *reinterpret_cast<__nv_bfloat162*>(out + at) = pair;
  if (out_fp8) {
    const float2 rounded = __bfloat1622float2(pair);
    const float scale = *out_scale;
    *reinterpret_cast<uint16_t*>(out_fp8 + at) =
        static_cast<uint16_t>(device::fp8x2(rounded.x * scale, rounded.y * scale, interp));
  }
}

void check_shape(const char* what, int B, int C, int NH, int capacity) {
  FP8LM_CHECK(B > 0 && C > 0 && NH > 0 && capacity > 0, what, ": bad shape B=", B, " C=", C, " NH=", NH,
              " capacity=", capacity);
  FP8LM_CHECK(C % NH == 0, what, ": C=", C, " is not a multiple of NH=", NH);
  const int HS = C / NH;
  FP8LM_CHECK(HS == 32 || HS == 64 || HS == 128, what, ": head size ", HS,
              " must be 32, 64 or 128 (those of the attention kernels)");
}

}  // namespace

void kv_cache_append(void* keys, void* values, bool cache_fp8, float* scales, float* scratch, const bf16* qkv, int B,
                     int n, int C, int capacity, int position, cudaStream_t stream,
                     const int32_t* stored_position) {
  FP8LM_CHECK(B > 0 && C > 0 && C % 2 == 0 && capacity > 0, "kv_cache_append: bad shape B=", B, " C=", C,
              " capacity=", capacity);
  FP8LM_CHECK(n > 0 && position >= 0 && position + n <= capacity, "kv_cache_append: positions [", position, ", ",
              position + n, ") outside the cache's ", capacity);
  FP8LM_CHECK(reinterpret_cast<uintptr_t>(qkv) % 4 == 0, "kv_cache_append: qkv must be 4-byte aligned");
  FP8LM_CHECK(!cache_fp8 || (scales != nullptr && scratch != nullptr), "kv_cache_append: an FP8 cache needs scales");
  FP8LM_CHECK(stored_position == nullptr || (n == 1 && position > 0),
              "kv_cache_append: a stored position is for one-token steps after the prompt");
  const int64_t pairs = int64_t(B) * n * (C / 2);
  if (cache_fp8 && position == 0) {
    CUDA_CHECK(cudaMemsetAsync(scratch, 0, kKvCacheScratchFloats * sizeof(float), stream));
    const int blocks = int(std::min<int64_t>(kAmaxMaxBlocks, (pairs + kAppendThreads - 1) / kAppendThreads));
    launch_kernel(key_value_amax_kernel, blocks, kAppendThreads, 0, stream, scratch, qkv, int64_t(B) * n, C);
    launch_kernel(kv_scales_kernel, 1, 1, 0, stream, scales, scratch);
  }
  const int64_t blocks = (pairs + kAppendThreads - 1) / kAppendThreads;
  FP8LM_CHECK(blocks < (int64_t{1} << 31), "kv_cache_append: too many rows");
  launch_kernel(kv_cache_append_kernel, unsigned(blocks), kAppendThreads, 0, stream, keys, values, cache_fp8, scales,
                qkv, B, n, C, capacity, position, stored_position);
}

size_t attention_decode_scratch_floats(int B, int C, int NH, int capacity) {
  return size_t(B) * NH * decode_splits(capacity) * (C / NH + 2);
}

void attention_decode(bf16* out, const bf16* qkv, void* keys, void* values, bool cache_fp8, const float* scales,
                      int B, int C, int NH, int capacity, int length, float* scratch, cudaStream_t stream,
                      uint8_t* out_fp8, const float* out_scale, Fp8Dtype out_dtype, const int32_t* stored_position,
                      bool append) {
  check_shape("attention_decode", B, C, NH, capacity);
  FP8LM_CHECK(length >= 1 && length <= capacity, "attention_decode: length ", length, " outside [1, ", capacity, "]");
  FP8LM_CHECK(reinterpret_cast<uintptr_t>(qkv) % 16 == 0 && reinterpret_cast<uintptr_t>(keys) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(values) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0,
              "attention_decode: qkv, keys and values must be 16-byte aligned, out 4-byte aligned");
  FP8LM_CHECK(!cache_fp8 || scales != nullptr, "attention_decode: an FP8 cache needs scales");
  FP8LM_CHECK(scratch != nullptr, "attention_decode: null scratch");
  FP8LM_CHECK(out_fp8 == nullptr || (out_scale != nullptr && reinterpret_cast<uintptr_t>(out_fp8) % 2 == 0),
              "attention_decode: FP8 codes need their scale and a 2-byte-aligned output");
  const int HS = C / NH;
  const int splits = decode_splits(length);
  const int grid_splits = stored_position ? decode_splits(capacity) : splits;  // the parts' stride too
  const dim3 grid{unsigned(NH), unsigned(B), unsigned(grid_splits)};
  auto* split_kernel = cache_fp8 ? &attention_decode_split_kernel<128, true>  // check_shape: HS is 32, 64 or 128
                                 : &attention_decode_split_kernel<128, false>;
  if (HS == 32) split_kernel = cache_fp8 ? &attention_decode_split_kernel<32, true> : &attention_decode_split_kernel<32, false>;
  if (HS == 64) split_kernel = cache_fp8 ? &attention_decode_split_kernel<64, true> : &attention_decode_split_kernel<64, false>;
  launch_kernel(split_kernel, grid, kDecodeThreads, 0, stream, scratch, qkv, keys, values, scales, C, NH, capacity,
                length, stored_position, append);
  launch_kernel(attention_decode_combine_kernel, dim3(unsigned(NH), unsigned(B)), unsigned(HS / 2), 0, stream, out,
                out_fp8, out_scale, out_dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2, scratch, scales, cache_fp8, C,
                NH, grid_splits, splits, stored_position);
}

}  // namespace fp8lm::cuda
