#include "core/gemm.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"

namespace fp8lm {

std::string_view to_string(GemmPrecision precision) {
  switch (precision) {
    case GemmPrecision::fp32: return "fp32";
    case GemmPrecision::bf16: return "bf16";
    case GemmPrecision::fp8: return "fp8";
  }
  return "?";
}

namespace cpu {

namespace {

constexpr int kLanes = 8;

// sums[r][c] = dot(row r of the kRows rows of A at `a`, row c of the kCols rows of B at `b`),
// each in kLanes interleaved partial sums added in a fixed order. The sizes are constants so
// the partials live in registers; each loaded piece of A and B serves kCols and kRows dot
// products.
template <int kRows, int kCols>
inline void dot_block(float (&sums)[kRows][kCols], const float* a, const float* b, int K) {
  float partial[kRows][kCols][kLanes] = {};
  int k = 0;
  for (; k + kLanes <= K; k += kLanes)
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kCols; ++c)
        for (int lane = 0; lane < kLanes; ++lane)
          partial[r][c][lane] += a[size_t(r) * K + k + lane] * b[size_t(c) * K + k + lane];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) {
      float sum = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) sum += partial[r][c][lane];
      for (int tail = k; tail < K; ++tail) sum += a[size_t(r) * K + tail] * b[size_t(c) * K + tail];
      sums[r][c] = sum;
    }
}

// One tile: rows [i0, i0 + rows) of C, columns [j_begin, j_end). Compiled twice, for AVX2
// and for baseline x86-64, and picked at load time: the wider vectors run the same
// additions in the same order (no FMA is enabled, so nothing is contracted), so the result
// is bit-identical on every machine.
__attribute__((target_clones("avx2", "default"))) void gemm_tile(float* C, const float* A, const float* B, int i0,
                                                                  int rows, int j_begin, int j_end, int N, int K,
                                                                  float alpha, bool accumulate) {
  constexpr int kRows = 4, kCols = 2;
  auto store = [&](int i, int j, float sum) {
    float& c = C[static_cast<size_t>(i) * N + j];
    c = accumulate ? c + alpha * sum : alpha * sum;
  };
  int j = j_begin;
  if (rows == kRows) {
    for (; j + kCols <= j_end; j += kCols) {
      float sums[kRows][kCols];
      dot_block<kRows, kCols>(sums, A + static_cast<size_t>(i0) * K, B + static_cast<size_t>(j) * K, K);
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < kCols; ++c) store(i0 + r, j + c, sums[r][c]);
    }
  }
  for (; j < j_end; ++j)
    for (int r = 0; r < rows; ++r) {
      float sum[1][1];
      dot_block<1, 1>(sum, A + static_cast<size_t>(i0 + r) * K, B + static_cast<size_t>(j) * K, K);
      store(i0 + r, j, sum[0][0]);
    }
}

}  // namespace

void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, bool accumulate) {
  // Each C[i][j] is one dot product of row i of A and row j of B, summed in eight interleaved
  // partial sums (the compiler vectorizes them without -ffast-math, in one fixed order).
  // Tiles of kRows rows of A reuse each row of B kRows times from registers and cache; tiles
  // of kColumns rows of B give every thread work when M is small (decoding). The order of
  // each dot product is the same for any tiling and thread count.
  constexpr int kRows = 4, kColumns = 256;
  const int row_tiles = (M + kRows - 1) / kRows, column_tiles = (N + kColumns - 1) / kColumns;
#pragma omp parallel for collapse(2) schedule(static)
  for (int row_tile = 0; row_tile < row_tiles; ++row_tile) {
    for (int column_tile = 0; column_tile < column_tiles; ++column_tile) {
      const int i0 = row_tile * kRows;
      gemm_tile(C, A, B, i0, std::min(kRows, M - i0), column_tile * kColumns,
                       std::min(N, (column_tile + 1) * kColumns), N, K, alpha, accumulate);
    }
  }
}

void transpose(float* out, const float* in, int rows, int cols) {
#pragma omp parallel for schedule(static)
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < rows; ++r) out[static_cast<size_t>(c) * rows + r] = in[static_cast<size_t>(r) * cols + c];
  }
}

float amax(const float* x, size_t n) {
  float result = 0.0f;
  bool saw_nan = false;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a)) saw_nan = true;
    result = a > result ? a : result;
  }
  return saw_nan ? NAN : result;
}

void quantize_fp8(float* out, const float* x, size_t n, float scale, Fp8Dtype dtype) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) out[i] = fp8_round(x[i] * scale, dtype);
}

void round_bf16(float* out, const float* x, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) out[i] = round_to_bf16(x[i]);
}

}  // namespace cpu
}  // namespace fp8lm
