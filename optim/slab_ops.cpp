// CPU reference of optim/slab_ops.h: plain loops, the specification of the GPU kernels.
#include "optim/slab_ops.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/scaling.h"
#include "optim/grad_clip.h"  // kGradNormChunk

namespace fp8lm::cpu {

namespace {

// The GPU kernels' work items: each tensor cut into chunks of kGradNormChunk elements.
// The CPU walks the same chunks so that many small tensors still spread over the threads;
// per-chunk results are combined afterwards in layout order, so the result does not
// depend on the thread count.
struct Chunk {
  size_t begin, end;  // element range inside the slab (or chunk of a slab)
  int tensor;         // index into layout.tensors()
};

std::vector<Chunk> chunks_of(const TensorLayout& layout) {
  std::vector<Chunk> chunks;
  const auto& tensors = layout.tensors();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorInfo& t = tensors[k];
    for (size_t start = 0; start < t.numel; start += kGradNormChunk) {
      const size_t stop = t.numel - start < kGradNormChunk ? t.numel : start + kGradNormChunk;
      chunks.push_back({t.offset + start, t.offset + stop, static_cast<int>(k)});
    }
  }
  return chunks;
}

// Running max that ignores NaN: a NaN never compares greater (optim/adamw.cpp's rule).
inline float max_ignoring_nan(float amax, float x) { return x > amax ? x : amax; }

// Running max that propagates NaN and keeps it: once NaN, always NaN. A new NaN is written
// as the quiet NaN 0x7FC00000, which is what the GPU's atomicMax on the float bits leaves
// (core/cast_cuda.h). For a slot that is not NaN this is ScalingTable::record_amax's rule
// (!(x <= slot) -> slot = x); unlike it, a NaN slot is never replaced, so a NaN in one of
// several tensors that share a slot survives the tensors after it, as on the GPU.
inline float max_keeping_nan(float slot, float x) {
  if (std::isnan(slot)) return slot;
  if (std::isnan(x)) return std::numeric_limits<float>::quiet_NaN();
  return x > slot ? x : slot;
}

int64_t as_count(size_t n) { return static_cast<int64_t>(n); }

constexpr size_t kParallelElements = size_t{1} << 16;  // below this one thread is faster

}  // namespace

void tensor_amaxes(float* amaxes, const float* values, const TensorLayout& layout) {
  const std::vector<Chunk> chunks = chunks_of(layout);
  if (chunks.empty()) return;
  FP8LM_CHECK(amaxes != nullptr && values != nullptr, "tensor_amaxes needs amaxes and values");
  std::vector<float> partial(chunks.size());
  const int64_t count = as_count(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    float amax = 0.0f;
    for (size_t i = chunks[c].begin; i < chunks[c].end; ++i) amax = max_ignoring_nan(amax, std::fabs(values[i]));
    partial[c] = amax;
  }
  for (size_t c = 0; c < chunks.size(); ++c) {
    float& slot = amaxes[chunks[c].tensor];
    slot = max_ignoring_nan(slot, partial[c]);
  }
}

void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                        float headroom) {
  FP8LM_CHECK(count >= 0, "scales_from_amaxes count ", count);
  FP8LM_CHECK(fp8_max > 0.0f && headroom > 0.0f, "scales_from_amaxes fp8_max ", fp8_max, " headroom ", headroom);
  if (count == 0) return;
  FP8LM_CHECK(scales != nullptr && scale_inv != nullptr && amaxes != nullptr,
              "scales_from_amaxes needs scales, scale_inv and amaxes");
  for (int k = 0; k < count; ++k) {
    // headroom folds 1/N into the scale: N ranks' codes, each <= fp8_max / N, sum to <= fp8_max.
    scales[k] = compute_scale(amaxes[k] * headroom, fp8_max, /*margin=*/0, /*previous_scale=*/1.0f);
    scale_inv[k] = 1.0f / scales[k];
  }
}

void quantize_tensors(uint8_t* codes, const float* values, const TensorLayout& layout, const float* scales,
                      const int* scale_index, float* recorded_amax, Fp8Dtype dtype, Fp8CastCounts* counts) {
  const std::vector<Chunk> chunks = chunks_of(layout);
  if (chunks.empty()) return;
  FP8LM_CHECK(codes != nullptr && values != nullptr && scales != nullptr,
              "quantize_tensors needs codes, values and scales");
  auto slot_of = [&](int tensor) { return scale_index ? scale_index[tensor] : tensor; };
  std::vector<float> partial(chunks.size(), 0.0f);
  std::vector<Fp8CastTally> tallies(counts ? chunks.size() : 0);
  const int64_t count = as_count(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    const int s = slot_of(chunks[c].tensor);
    if (s < 0) continue;  // not this rank's to cast: codes left as they are
    const float scale = scales[s];
    float amax = 0.0f;
    for (size_t i = chunks[c].begin; i < chunks[c].end; ++i) {
      codes[i] = fp8_encode(values[i] * scale, dtype);  // FP32 product, then RNE + saturation
      amax = max_keeping_nan(amax, std::fabs(values[i]));
      if (counts) tallies[c].add(values[i], values[i] * scale, codes[i], dtype);
    }
    partial[c] = amax;
  }
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int s = slot_of(chunks[c].tensor);
    if (s < 0) continue;
    if (recorded_amax) recorded_amax[s] = max_keeping_nan(recorded_amax[s], partial[c]);
    if (counts) add_tally(counts[s], tallies[c], scales[s]);
  }
}

void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride, const TensorLayout& layout,
                    const float* scale_inv, Fp8Dtype dtype) {
  FP8LM_CHECK(ranks >= 1, "sum_fp8_chunks needs at least one rank, got ", ranks);
  FP8LM_CHECK(ranks == 1 || chunk_stride >= layout.total_elements(), "sum_fp8_chunks: chunk_stride ", chunk_stride,
              " is shorter than a chunk (", layout.total_elements(), " elements)");
  const std::vector<Chunk> work = chunks_of(layout);
  if (work.empty()) return;
  FP8LM_CHECK(out != nullptr && chunks != nullptr && scale_inv != nullptr,
              "sum_fp8_chunks needs out, chunks and scale_inv");
  const int64_t count = as_count(work.size());
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t c = 0; c < count; ++c) {
    const float inv = scale_inv[work[c].tensor];
    for (size_t i = work[c].begin; i < work[c].end; ++i) {
      // Rank order, FP32: the GPU adds in the same order with __fadd_rn.
      float sum = fp8_decode(chunks[i], dtype);
      for (int r = 1; r < ranks; ++r) sum += fp8_decode(chunks[static_cast<size_t>(r) * chunk_stride + i], dtype);
      out[i] = sum * inv;
    }
  }
}

void convert_f32_to_bf16(uint16_t* out, const float* in, size_t n) {
  if (n == 0) return;
  FP8LM_CHECK(out != nullptr && in != nullptr, "convert_f32_to_bf16 needs out and in");
  const int64_t count = as_count(n);
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (int64_t i = 0; i < count; ++i) out[i] = bf16_from_float(in[i]);
}

void convert_bf16_to_f32(float* out, const uint16_t* in, size_t n) {
  if (n == 0) return;
  FP8LM_CHECK(out != nullptr && in != nullptr, "convert_bf16_to_f32 needs out and in");
  const int64_t count = as_count(n);
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(in[i]);
}

void decode_fp8(float* out, const uint8_t* codes, size_t n, Fp8Dtype dtype) {
  if (n == 0) return;
  FP8LM_CHECK(out != nullptr && codes != nullptr, "decode_fp8 needs out and codes");
  const int64_t count = as_count(n);
#pragma omp parallel for schedule(static) if (n >= kParallelElements)
  for (int64_t i = 0; i < count; ++i) out[i] = fp8_decode(codes[i], dtype);
}

}  // namespace fp8lm::cpu
