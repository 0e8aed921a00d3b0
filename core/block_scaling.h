// FP8 block scaling (--fp8-recipe blockwise): DeepSeek-V3's recipe, Transformer Engine's
// Float8BlockScaling, cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (1x128 tiles) and
// CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F (128x128 blocks) on Hopper.
//
// Every GEMM operand is row-major [rows, cols] with cols the GEMM's K (core/gemm.h: "NT").
//   activations and gradients: one scale per 1x128 tile, a row and 128 consecutive columns;
//   weights:                   one scale per 128x128 block.
// A tile's (block's) values x are stored as q = fp8(x * s), and s^-1 = scale_inv is what the
// GEMM multiplies by. The scale comes from the tile's own amax, now (no history):
//
//   s = 2^floor(log2(fp8_max / 2^margin / amax))     (a power of two, rounded down)
//   s = 1 when amax is 0 (an all-zero tile), infinite or NaN
//
// which is Transformer Engine's rule with its defaults (power-of-two scales, epsilon 0):
// fp8_max / amax rounded to nearest, FLT_MAX where that overflows, then its mantissa bits
// cleared. Powers of two make s and scale_inv exact reciprocals and the GEMM's rescaling of
// each block's partial sum exact; the cost is up to one binade of the format's range.
//
// The scale arrays are FP32 in the layout cuBLASLt reads (K-major operands, as fp8lm's are),
// with tiles(n) = ceil(n / 128):
//   1x128 tiles of X [R, C]:    scale_inv[(c / 128) * round_up4(R) + r]            (tiles(C) x round_up4(R))
//   128x128 blocks of W [R, C]: scale_inv[(r / 128) * round_up4(tiles(C)) + c / 128]  (tiles(R) x round_up4(tiles(C)))
// i.e. column-major over (row, column tile) for tiles, row-major over (row block, column
// block) for blocks, the inner dimension padded to a multiple of 4 floats (16 bytes). The
// padding entries are never read.
//
// Which operand carries which (Hopper: 1Dx1D, 1Dx2D and 2Dx1D are supported, 2Dx2D is not):
//   forward  Y  = X [M,K] (1x128) . W [N,K] (128x128)^T
//   dgrad    dX = dY [M,N] (1x128) . Wt [K,N] (128x128, W's blocks transposed)^T
//   wgrad    dW = dYt [N,M] (1x128) . Xt [K,M] (1x128)^T
// The transposed copy of an activation or gradient (Xt, dYt) is quantized from the
// high-precision values with its own tiles, along the other dimension: its codes are not
// the transpose of X's. A weight's transposed copy is W's codes transposed.
//
// Ragged edges: a dimension need not be a multiple of 128. The last tile of a row (the last
// row or column of blocks) is then shorter, and its scale comes from the values it holds, as
// Transformer Engine's quantizer and cuBLASLt treat it (gpt2-1558m's n_embd is 1600 = 12.5 x 128).
// Every dimension of a GEMM operand must be a multiple of 16, cuBLASLt's FP8 alignment (and
// the vector width of the casts); the rows of a 1x128 operand without a transposed copy may
// be any count. A start-up refusal names the model dimension otherwise.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/fp8.h"
#include "core/tensor.h"

namespace fp8lm {

inline constexpr int kScaleBlock = 128;     // elements along a tile, and a block's side
inline constexpr int kBlockAlignment = 16;  // every dimension of a block-scaled operand is a multiple of this

FP8LM_HOST_DEVICE constexpr int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }

// Index of the scale of row r, column tile `tile` (= c / 128) of a 1x128-tiled [rows, *].
FP8LM_HOST_DEVICE constexpr int64_t tile_scale_index(int64_t r, int64_t tile, int64_t rows) {
  return tile * round_up4(rows) + r;
}
// Index of the scale of block (row_block, col_block) of a 128x128-blocked [*, cols].
FP8LM_HOST_DEVICE constexpr int64_t block_scale_index(int64_t row_block, int64_t col_block, int64_t cols) {
  return row_block * round_up4((cols + kScaleBlock - 1) / kScaleBlock) + col_block;
}

// Tiles (blocks) along a dimension of n elements, the last one partial when n is not a multiple of 128.
FP8LM_HOST_DEVICE constexpr int64_t scale_tiles(int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; }

// Elements of tile (block) `index` along a dimension of n: 128, or fewer for the last.
FP8LM_HOST_DEVICE constexpr int64_t scale_tile_width(int64_t index, int64_t n) {
  return n - index * kScaleBlock < kScaleBlock ? n - index * kScaleBlock : kScaleBlock;
}

// Floats of the scale array of a [rows, cols] operand.
constexpr int64_t tile_scale_count(int64_t rows, int64_t cols) { return scale_tiles(cols) * round_up4(rows); }
constexpr int64_t block_scale_count(int64_t rows, int64_t cols) {
  return scale_tiles(rows) * round_up4(scale_tiles(cols));
}
inline int64_t scale_count(BlockScaling scaling, int64_t rows, int64_t cols) {
  switch (scaling) {
    case BlockScaling::none: return 0;
    case BlockScaling::tiles_1x128: return tile_scale_count(rows, cols);
    case BlockScaling::blocks_128x128: return block_scale_count(rows, cols);
  }
  return 0;
}

// The scale of one tile or block from its amax (the rule above). amax is max |x| over the
// tile, NaN if a value is NaN.
FP8LM_HOST_DEVICE inline float block_scale(float amax, float format_max, int margin) {
  constexpr float kFloatMax = 3.402823466e38f;
  if (!(amax > 0.0f && amax <= kFloatMax)) return 1.0f;  // 0, infinite or NaN
  float scale = ldexpf(format_max, -margin) / amax;
  if (!(scale <= kFloatMax)) scale = kFloatMax;
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(scale);
#else
  std::memcpy(&bits, &scale, sizeof bits);
#endif
  bits &= 0xFF800000u;  // sign and exponent: the power of two at or below
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  std::memcpy(&scale, &bits, sizeof bits);
  return scale;
#endif
}

// What a shape must satisfy for block scaling: "" or the reason, naming `what`.
std::string block_scaling_shape_problem(BlockScaling scaling, int64_t rows, int64_t cols, const std::string& what);

namespace cpu {

// out [rows, cols] = fp8(in * s) with s the scale of each 1x128 tile of in (along cols);
// scale_inv [tile_scale_count(rows, cols)] = 1 / s. cols a multiple of 16.
void quantize_tiles_1x128(float* out, float* scale_inv, const float* in, int64_t rows, int64_t cols, Fp8Dtype dtype,
                          int margin);

// out [rows, cols] = fp8(in * s) with s the scale of each 128x128 block of in;
// scale_inv [block_scale_count(rows, cols)] = 1 / s. rows and cols multiples of 16.
void quantize_blocks_128x128(float* out, float* scale_inv, const float* in, int64_t rows, int64_t cols,
                             Fp8Dtype dtype, int margin);

// The block scales of W^T [cols, rows] from those of W [rows, cols]: block (i, j) of W is
// block (j, i) of W^T, so the codes' transpose and these scales are W^T's operand.
void transpose_block_scales(float* scale_inv_t, const float* scale_inv, int64_t rows, int64_t cols);

// C [M,N] = alpha * sum over K blocks kb of (A_kb . B_kb^T) * a_scale_inv(., kb) * b_scale_inv(., kb)
// (+ C when accumulate), A [M,K] and B [N,K] holding FP8 values (as FP32), each with its scale
// layout (1x128 tiles or 128x128 blocks; K a multiple of 16, its last block partial when not of
// 128). The order is fixed: each block's products summed as cpu::gemm_nt sums a K of 128 (or the
// last block's width), that sum times A's scale then B's, added to an FP32 accumulator in block
// order, then alpha and C.
void gemm_block_scaled(float* C, const float* A, const float* a_scale_inv, BlockScaling a_scaling, const float* B,
                       const float* b_scale_inv, BlockScaling b_scaling, int M, int N, int K, float alpha,
                       bool accumulate);

}  // namespace cpu
}  // namespace fp8lm
