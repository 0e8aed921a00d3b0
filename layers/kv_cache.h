// Incremental decoding: the key/value cache and the attention of one new token against it.
//
//   cache rows: keys/values [B*capacity, C], row b*capacity + position (heads concatenated,
//               head h in columns [h*HS, (h+1)*HS), HS = C/NH, as in qkv)
//   append:     rows [position, position + n) of sequence b = k / v of qkv [B*n, 3C]
//   decode:     for the one new query q_b (qkv [B, 3C], at position length - 1):
//               S[s] = q . k_s / sqrt(HS) for s < length, P = softmax(S),
//               out_b = sum_s P[s] v_s                                           [B, C]
// The new token's own key and value are appended before the attention reads the cache,
// so the decode sees exactly the keys and values a later token will see.
//
// An FP8 (E4M3) cache stores fp8(k * k_scale) and fp8(v * v_scale) with one scale per
// tensor per layer. Its scales come from the first keys and values written (the prompt):
//   scale = kv_cache_scale(amax) = 448 / amax / 2      (one binade of headroom)
// so a later token up to twice the prompt's largest key or value is represented, and one
// beyond that saturates at +-448. (TensorRT-LLM calibrates static KV scales offline; the
// prompt is this run's calibration set.) The attention multiplies by 1/scale.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/scaling.h"

namespace fp8lm {

// The FP8 cache's scale for a tensor whose first entries have this amax (1 when it is 0
// or not finite: nothing to learn from).
FP8LM_HOST_DEVICE inline float kv_cache_scale(float amax) {
  return compute_scale(amax, kE4M3Max, /*margin=*/1, /*previous_scale=*/1.0f);
}

}  // namespace fp8lm

namespace fp8lm::cpu {

// keys/values [B*capacity, C] (=, rows [position, position + n) of each sequence) from qkv
// [B*n, 3C]. With scales (FP8): the values stored are fp8_round(x * scale), E4M3.
void kv_cache_append(float* keys, float* values, const float* qkv, int B, int n, int C, int capacity, int position,
                     const float* scales);

// out [B, C] (=) from qkv [B, 3C] (the new tokens, whose keys and values are already in the
// cache) and cache positions [0, length). k_scale_inv / v_scale_inv undo an FP8 cache's
// scales (1 otherwise).
void attention_decode(float* out, const float* qkv, const float* keys, const float* values, int B, int C, int NH,
                      int capacity, int length, float k_scale_inv, float v_scale_inv);

}  // namespace fp8lm::cpu

// ---- GPU (layers/kv_cache.cu) ---------------------------------------------------------
// The same arithmetic on BF16 qkv with an FP32 softmax. The cache is BF16, or E4M3 codes
// (cache_fp8) with scales [2] in device memory (K's, V's). Requirements, checked on the
// host (FP8LM_CHECK): C % NH == 0, HS = C/NH even and at most 256; qkv 4-byte aligned.
namespace fp8lm::cuda {

// Scratch floats kv_cache_append needs (the two amaxes of a first append).
inline constexpr int kKvCacheScratchFloats = 2;

// stored_position (nullable, device memory): the kernels read the position there instead of
// `position` / `length - 1`, so that a recorded decoding step (Ops::record_ops) replays at whatever
// position the step stored (one-token steps after the prompt only). The host checks `position`.
//
// position == 0 with cache_fp8: first the amaxes of the new keys and values (into
// scratch [2], zeroed here) and the scales from them (kv_cache_scale), then the codes. The
// scales stay in device memory: no host sync.
void kv_cache_append(void* keys, void* values, bool cache_fp8, float* scales, float* scratch,
                     const __nv_bfloat16* qkv, int B, int n, int C, int capacity, int position, cudaStream_t stream,
                     const int32_t* stored_position = nullptr);

// out [B, C] (=, bf16). The positions of each (sequence, head) in splits of 128, one block
// each, combined by a second kernel through scratch: attention_decode_scratch_floats(...)
// floats for a cache of `capacity` positions (contents need not be initialised).
// out_fp8 [B, C] (nullable): the combining kernel also writes fp8(out * *out_scale), the codes
// cast_fp8 (core/cast_cuda.h) writes from the BF16 out, bit for bit, without recording an amax:
// the delayed-scaling cast of a decoding step, which records none, in the same launch.
size_t attention_decode_scratch_floats(int B, int C, int NH, int capacity);
// append: the token's own key and value (qkv's) are first written at position length - 1, as
// kv_cache_append (n = 1) writes them, by the blocks that read that row: they take it from qkv
// and store it as they go, one launch less per step (the cache's scales must exist: not the
// first FP8 append).
void attention_decode(__nv_bfloat16* out, const __nv_bfloat16* qkv, void* keys, void* values, bool cache_fp8,
                      const float* scales, int B, int C, int NH, int capacity, int length, float* scratch,
                      cudaStream_t stream, uint8_t* out_fp8 = nullptr, const float* out_scale = nullptr,
                      Fp8Dtype out_dtype = Fp8Dtype::e4m3, const int32_t* stored_position = nullptr,
                      bool append = false);

}  // namespace fp8lm::cuda
