// Per-tensor operations on whole slabs, for data-parallel communication of gradients and
// weights (docs/DEVELOPING.md's layout: CPU reference in fp8lm::cpu, CUDA launchers in
// fp8lm::cuda, same names and arguments).
//
// Gradients in FP8 (FP8-LM's automatic scaling): every rank takes its per-tensor amaxes
// (tensor_amaxes), the caller MAX-all-reduces them so every rank holds the same numbers,
// scales_from_amaxes folds the number of ranks N into the scale (headroom N: each code is
// at most fp8_max / N in magnitude, so the sum of N ranks' codes stays within fp8_max),
// quantize_tensors casts the slab to FP8 codes, the codes are reduce-scattered as bytes, and
// the receiving rank adds the N ranks' codes in FP32, in rank order, and multiplies by
// scale_inv (sum_fp8_chunks).
// Weights in FP8: the owning rank casts its shard with quantize_tensors, taking each
// tensor's scale from the FP8 scaling table through scale_index, and recording its amax.
// BF16 gradients: convert_f32_to_bf16 / convert_bf16_to_f32 over whole slabs.
//
// A "layout" (TensorLayout on the CPU, DeviceTensorTable on the GPU) lists the tensors of a
// slab; the per-tensor operations read and write only the tensors' elements, never the
// padding between them. Every result is deterministic, and the GPU's is bit-identical to the
// CPU's (NaN results: both NaN; see each function for its NaN rule).
//
// The header needs the CUDA runtime's types (cudaStream_t, __nv_bfloat16) but no kernels,
// like layers/<op>.h: it is usable from .cpp files compiled by g++.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/fp8_stats.h"
#include "core/tensor.h"
#include "optim/grad_clip_cuda.h"  // DeviceTensorTable

namespace fp8lm::cpu {

// Running max of |values| per tensor, NaN ignored (a NaN never wins the comparison, as
// optim/adamw.cpp's running_max): for tensor k,
//   amaxes[k] = max(amaxes[k], max_i |values[offset_k + i]|)
// A tensor with numel 0, or only NaNs, leaves its entry as it was. The caller zeroes amaxes.
//   amaxes [count] (count = layout.tensors().size()), values [layout.total_elements()]
void tensor_amaxes(float* amaxes, const float* values, const TensorLayout& layout);

// scales[k] = compute_scale(amaxes[k] * headroom, fp8_max, /*margin=*/0, /*previous=*/1),
// scale_inv[k] = 1 / scales[k]. headroom (> 0) is the number of ranks whose values will be
// summed, 1 for none. An amax of 0 or a non-finite amax * headroom gives scale 1.
//   scales [count], scale_inv [count], amaxes [count]
void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                        float headroom);

// For each tensor k with s = scale_index ? scale_index[k] : k and s >= 0 (s < 0: the tensor
// is skipped, its codes and amax slot untouched):
//   codes[offset_k + i] = fp8_encode(values[offset_k + i] * scales[s], dtype)
//     (FP32 product, then round to nearest even, saturating; NaN -> 0x7F)
//   recorded_amax[s] = max(recorded_amax[s], max_i |values[offset_k + i]|)   (if non-null)
//     NaN propagates and stays (core/cast_cuda.h's amax convention): a NaN value makes the
//     slot the quiet NaN 0x7FC00000, which no later value replaces. Several tensors may
//     share a slot. Slots hold values >= 0 (or NaN) on entry.
//   counts[s] += the casts' statistics (core/fp8_stats.h)                     (if non-null)
//   codes [layout.total_elements()] FP8 bytes, values [layout.total_elements()],
//   scales [max s + 1], scale_index [count] (nullable), recorded_amax [max s + 1] (nullable),
//   counts [max s + 1] (nullable: statistics steps only)
void quantize_tensors(uint8_t* codes, const float* values, const TensorLayout& layout, const float* scales,
                      const int* scale_index, float* recorded_amax, Fp8Dtype dtype, Fp8CastCounts* counts = nullptr);

// Sum of `ranks` chunks of FP8 codes, each laid out by `layout` (offsets relative to a chunk):
//   out[offset_k + i] = (sum over r = 0, 1, ..., ranks - 1 of
//                        fp8_decode(chunks[r * chunk_stride + offset_k + i])) * scale_inv[k]
// The sum starts from rank 0's value and adds the others in rank order, in FP32.
//   out [layout.total_elements()], chunks [(ranks - 1) * chunk_stride + layout.total_elements()],
//   scale_inv [count]; ranks >= 1; chunk_stride >= layout.total_elements() when ranks > 1.
void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride, const TensorLayout& layout,
                    const float* scale_inv, Fp8Dtype dtype);

// out [n] = BF16 bits of in [n], round to nearest even (bf16_from_float, core/dtype.h).
void convert_f32_to_bf16(uint16_t* out, const float* in, size_t n);
// out [n] = the values of the BF16 bits in [n] (exact).
void convert_bf16_to_f32(float* out, const uint16_t* in, size_t n);

// out [n] = the values of the FP8 codes [n] (exact; fp8_decode).
void decode_fp8(float* out, const uint8_t* codes, size_t n, Fp8Dtype dtype);

}  // namespace fp8lm::cpu

// ---- GPU (optim/slab_ops.cu) ----------------------------------------------------------
// The same operations, asynchronous on `stream`; every pointer is device memory and the
// table is a DeviceTensorTable (optim/grad_clip_cuda.h) built from the same layout. The
// per-tensor kernels run one block per kGradNormChunk chunk of the table (a block never
// crosses a tensor nor touches padding); they load FP32 16 bytes at a time and store FP8
// codes 4 at a time where the tensor's addresses allow it, element by element otherwise,
// with identical results. Amaxes go through an integer atomicMax on the float's bits
// (exact and order-independent, so still deterministic). Empty work is a no-op.
namespace fp8lm::cuda {

// amaxes [table.count], values [table.total_elements]. NaN ignored, as cpu::tensor_amaxes.
void tensor_amaxes(float* amaxes, const float* values, const DeviceTensorTable& table, cudaStream_t stream);

// scales [count], scale_inv [count], amaxes [count]. As cpu::scales_from_amaxes.
void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                        float headroom, cudaStream_t stream);

// codes [table.total_elements], values [table.total_elements], scales [max s + 1],
// scale_index [table.count] (nullable), recorded_amax [max s + 1] (nullable; NaN -> 0x7FC00000),
// counts [max s + 1] (nullable: statistics steps only).
void quantize_tensors(uint8_t* codes, const float* values, const DeviceTensorTable& table, const float* scales,
                      const int* scale_index, float* recorded_amax, Fp8Dtype dtype, cudaStream_t stream,
                      Fp8CastCounts* counts = nullptr);

// out [table.total_elements], chunks [(ranks - 1) * chunk_stride + table.total_elements],
// scale_inv [table.count]. As cpu::sum_fp8_chunks, bit for bit.
void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride,
                    const DeviceTensorTable& table, const float* scale_inv, Fp8Dtype dtype, cudaStream_t stream);

// out [n], in [n]: __float2bfloat16_rn / exact widening.
void convert_f32_to_bf16(__nv_bfloat16* out, const float* in, size_t n, cudaStream_t stream);
void convert_bf16_to_f32(float* out, const __nv_bfloat16* in, size_t n, cudaStream_t stream);

}  // namespace fp8lm::cuda
