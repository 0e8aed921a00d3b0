// The CPU reference of FP8 block scaling (core/block_scaling.h): plain loops, the
// specification the CUDA kernels (core/block_scaling.cu) are tested against bit for bit.
#include "core/block_scaling.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"

namespace fp8lm {

std::string block_scaling_shape_problem(BlockScaling scaling, int64_t rows, int64_t cols, const std::string& what) {
  auto shape = [&] { return what + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]"; };
  if (scaling == BlockScaling::none) return "";
  if (rows <= 0 || cols <= 0) return shape() + " is empty";
  if (cols % kBlockAlignment != 0) return shape() + ": its columns are not a multiple of 16";
  if (scaling == BlockScaling::blocks_128x128 && rows % kBlockAlignment != 0)
    return shape() + ": its rows are not a multiple of 16";
  return "";
}

namespace cpu {

namespace {

void check_shape(BlockScaling scaling, int64_t rows, int64_t cols) {
  const std::string problem = block_scaling_shape_problem(scaling, rows, cols, "a block-scaled FP8 operand");
  FP8LM_CHECK(problem.empty(), problem);
}

// max |x| over the values, NaN if one is NaN (as cpu::amax).
float tile_amax(const float* x, int64_t count, int64_t stride) {
  float result = 0.0f;
  bool saw_nan = false;
  for (int64_t i = 0; i < count; ++i) {
    const float a = std::fabs(x[i * stride]);
    if (std::isnan(a)) saw_nan = true;
    result = a > result ? a : result;
  }
  return saw_nan ? NAN : result;
}

}  // namespace

void quantize_tiles_1x128(float* out, float* scale_inv, const float* in, int64_t rows, int64_t cols, Fp8Dtype dtype,
                          int margin) {
  check_shape(BlockScaling::tiles_1x128, rows, cols);
  const int64_t tiles = scale_tiles(cols);
  const float format_max = fp8_max(dtype);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const size_t first = size_t(r) * size_t(cols) + size_t(tile) * kScaleBlock;
      const int64_t width = scale_tile_width(tile, cols);
      const float scale = block_scale(tile_amax(in + first, width, 1), format_max, margin);
      for (int64_t c = 0; c < width; ++c) out[first + c] = fp8_round(in[first + c] * scale, dtype);
      scale_inv[tile_scale_index(r, tile, rows)] = 1.0f / scale;
    }
  }
}

void quantize_blocks_128x128(float* out, float* scale_inv, const float* in, int64_t rows, int64_t cols,
                             Fp8Dtype dtype, int margin) {
  check_shape(BlockScaling::blocks_128x128, rows, cols);
  const int64_t row_blocks = scale_tiles(rows), col_blocks = scale_tiles(cols);
  const float format_max = fp8_max(dtype);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const size_t corner = size_t(rb) * kScaleBlock * size_t(cols) + size_t(cb) * kScaleBlock;
      const int64_t height = scale_tile_width(rb, rows), width = scale_tile_width(cb, cols);
      float amax = 0.0f;
      for (int64_t r = 0; r < height; ++r) {
        const float row_amax = tile_amax(in + corner + size_t(r) * size_t(cols), width, 1);
        if (std::isnan(row_amax) || std::isnan(amax)) {
          amax = NAN;
        } else {
          amax = std::max(amax, row_amax);
        }
      }
      const float scale = block_scale(amax, format_max, margin);
      for (int64_t r = 0; r < height; ++r)
        for (int64_t c = 0; c < width; ++c) {
          const size_t at = corner + size_t(r) * size_t(cols) + c;
          out[at] = fp8_round(in[at] * scale, dtype);
        }
      scale_inv[block_scale_index(rb, cb, cols)] = 1.0f / scale;
    }
  }
}

void transpose_block_scales(float* scale_inv_t, const float* scale_inv, int64_t rows, int64_t cols) {
  check_shape(BlockScaling::blocks_128x128, rows, cols);
  for (int64_t rb = 0; rb < scale_tiles(rows); ++rb)
    for (int64_t cb = 0; cb < scale_tiles(cols); ++cb)
      scale_inv_t[block_scale_index(cb, rb, rows)] = scale_inv[block_scale_index(rb, cb, cols)];
}

namespace {

// The scale_inv that multiplies row `row` of an operand [rows, K] in K block `kb`.
float scale_of(const float* scale_inv, BlockScaling scaling, int64_t row, int64_t kb, int64_t rows, int64_t K) {
  if (scaling == BlockScaling::tiles_1x128) return scale_inv[tile_scale_index(row, kb, rows)];
  return scale_inv[block_scale_index(row / kScaleBlock, kb, K)];
}

// Columns [kb * 128, kb * 128 + width) of X [rows, K], contiguous [rows, width].
void copy_k_block(float* out, const float* X, int64_t rows, int64_t K, int64_t kb, int64_t width) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    std::copy(X + size_t(r) * size_t(K) + size_t(kb) * kScaleBlock,
              X + size_t(r) * size_t(K) + size_t(kb) * kScaleBlock + size_t(width), out + size_t(r) * size_t(width));
}

}  // namespace

void gemm_block_scaled(float* C, const float* A, const float* a_scale_inv, BlockScaling a_scaling, const float* B,
                       const float* b_scale_inv, BlockScaling b_scaling, int M, int N, int K, float alpha,
                       bool accumulate) {
  FP8LM_CHECK(a_scaling != BlockScaling::none && b_scaling != BlockScaling::none,
              "gemm_block_scaled: both operands must be block-scaled");
  // Mirrors cuBLASLt on Hopper, so that the reference never runs what the GPU cannot.
  FP8LM_CHECK(!(a_scaling == BlockScaling::blocks_128x128 && b_scaling == BlockScaling::blocks_128x128),
              "gemm_block_scaled: 128x128 x 128x128 blocks is not supported on Hopper (1x128 x 1x128, 1x128 x "
              "128x128 and 128x128 x 1x128 are)");
  check_shape(a_scaling, M, K);
  check_shape(b_scaling, N, K);
  const int64_t blocks = scale_tiles(K);
  std::vector<float> a_block(size_t(M) * kScaleBlock), b_block(size_t(N) * kScaleBlock), partial(size_t(M) * N),
      sum(size_t(M) * N, 0.0f);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t width = scale_tile_width(kb, K);
    copy_k_block(a_block.data(), A, M, K, kb, width);
    copy_k_block(b_block.data(), B, N, K, kb, width);
    gemm_nt(partial.data(), a_block.data(), b_block.data(), M, N, int(width), 1.0f, false);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < M; ++i) {
      const float sa = scale_of(a_scale_inv, a_scaling, i, kb, M, K);
      for (int j = 0; j < N; ++j) {
        const float sb = scale_of(b_scale_inv, b_scaling, j, kb, N, K);
        const size_t at = size_t(i) * N + j;
        sum[at] += (partial[at] * sa) * sb;
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      const size_t at = size_t(i) * N + j;
      C[at] = accumulate ? C[at] + alpha * sum[at] : alpha * sum[at];
    }
}

}  // namespace cpu
}  // namespace fp8lm
