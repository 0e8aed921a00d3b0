// FP8 casts, transposes and amaxes on the GPU: the producers of every FP8 GEMM operand
// that no fused kernel writes. All launchers are asynchronous on `stream`; every pointer
// is device memory. CPU twins: cpu::quantize_fp8, cpu::transpose, cpu::amax (core/gemm.h),
// fp8_encode (core/fp8.h), compute_scale (core/scaling.h).
//
// Conversion: code = __nv_cvt_float_to_fp8(float(x) * scale, __NV_SATFINITE, E4M3/E5M2)
// (cvt.rn.satfinite: round to nearest even, finite overflow and infinities saturate to
// +-max, NaN -> 0x7F), bit for bit what the CPU's fp8_encode(x * scale) returns.
//
// Running amax: `float* amax` points at one float (an amax-history slot) that holds a
// value >= 0; a launcher raises it to max(*amax, max |x|) with an integer atomicMax on
// the float's bits. That is valid because for non-negative IEEE floats the order of the
// values equals the order of their bit patterns read as integers (sign bit 0, then
// exponent, then mantissa). A NaN input is made visible: it contributes the bits
// 0x7FC00000 (quiet NaN), which as an int is larger than +inf's 0x7F800000, so the slot
// ends up NaN and the scale update (compute_scale) refuses it.
//
// Column sums (dbias) are deterministic: per 64-row tile partial sums go to `scratch`
// [ceil(M/64), N], then a second kernel adds them in a fixed order into the output.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/gradient_ref.h"
#include "core/fp8_stats.h"

namespace fp8lm::cuda {

// Rows and columns of one cast_transpose tile (also the row block of the column sums).
inline constexpr int kCastTile = 64;

// Floats of scratch that cast_transpose_fp8 (with dbias) and column_sum need for [M,N].
inline size_t dbias_scratch_floats(int M, int N) {
  return static_cast<size_t>((M + kCastTile - 1) / kCastTile) * static_cast<size_t>(N);
}

// One read of in [M,N] writes:
//   out   [M,N] = fp8(in * scale)           (row-major codes; nullable when out_t is not)
//   out_t [N,M] = the codes transposed      (nullable)
//   dbias [N]  += column sums of in (the UNQUANTIZED values, FP32 sums, added to an FP32
//                 or BF16 gradient: core/gradient_ref.h)   (empty: none; else needs
//                 scratch of dbias_scratch_floats(M, N) floats)
//   *amax       = max(*amax, max |in|)      (nullable)
//   *counts    += the cast's statistics (core/fp8_stats.h)   (nullable: a statistics step only)
// scale: device pointer [1].
void cast_transpose_fp8(uint8_t* out, uint8_t* out_t, GradientRef dbias, float* amax, const __nv_bfloat16* in,
                        const float* scale, Fp8Dtype dtype, int M, int N, float* scratch, cudaStream_t stream,
                        Fp8CastCounts* counts = nullptr);
void cast_transpose_fp8(uint8_t* out, uint8_t* out_t, GradientRef dbias, float* amax, const float* in,
                        const float* scale, Fp8Dtype dtype, int M, int N, float* scratch, cudaStream_t stream,
                        Fp8CastCounts* counts = nullptr);

// out [N,M] = in [M,N]^T, FP8 codes (1 byte in, 1 byte out).
void transpose_fp8(uint8_t* out, const uint8_t* in, int M, int N, cudaStream_t stream);

// *amax = max(*amax, max |in[i]|) over n values.
void amax_of(float* amax, const __nv_bfloat16* in, size_t n, cudaStream_t stream);
void amax_of(float* amax, const float* in, size_t n, cudaStream_t stream);

// out [n] = fp8(in * scale); *amax = max(*amax, max |in|) when amax is not nullptr;
// *counts += the cast's statistics when counts is not nullptr.
void cast_fp8(uint8_t* out, float* amax, const __nv_bfloat16* in, const float* scale, Fp8Dtype dtype, size_t n,
              cudaStream_t stream, Fp8CastCounts* counts = nullptr);
void cast_fp8(uint8_t* out, float* amax, const float* in, const float* scale, Fp8Dtype dtype, size_t n,
              cudaStream_t stream, Fp8CastCounts* counts = nullptr);

// *amax = max(*amax, |*value|) by the rule above (NaN -> 0x7FC00000): folds an amax that
// another writer SETS (cuBLASLt's CUBLASLT_MATMUL_DESC_AMAX_D_POINTER) into a running slot.
void raise_amax(float* amax, const float* value, cudaStream_t stream);

// *counts += the statistics of casting in [n] with *scale (core/fp8_stats.h), writing no
// codes: for a producer whose FP8 output is exactly that cast of a BF16 tensor it also keeps
// (attention_forward's out and out_fp8).
void count_fp8_cast(Fp8CastCounts* counts, const __nv_bfloat16* in, const float* scale, Fp8Dtype dtype, size_t n,
                    cudaStream_t stream);

// out [N] += column sums of in [M,N] (FP32, fixed order; out FP32 or BF16, rounded once):
// the dbias of the BF16 path. scratch: dbias_scratch_floats(M, N) floats.
void column_sum(GradientRef out, const __nv_bfloat16* in, int M, int N, float* scratch, cudaStream_t stream);

// out [N] += the sums over t < tiles of partial [tiles, N], in a fixed order: the last step of
// the dbias above, for kernels that leave per-tile column sums as the cast does
// (layers/attention_dqkv_operand.cuh).
void add_column_partials(GradientRef out, const float* partial, int tiles, int N, cudaStream_t stream);

// Current scaling on the device (one thread): *scale = compute_scale(*amax, fp8_max,
// margin, *scale); *scale_inv = 1 / *scale. scale and scale_inv: [1] each.
void compute_current_scale(float* scale, float* scale_inv, const float* amax, float fp8_max, int margin,
                           cudaStream_t stream);

}  // namespace fp8lm::cuda
