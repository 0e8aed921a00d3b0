#include "core/gemm.h"

#include <algorithm>
#include <cmath>
#include <vector>

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

std::string_view to_string(GemmAlgorithmChoice choice) {
  return choice == GemmAlgorithmChoice::timed ? "timed" : "heuristic";
}

namespace cpu {

namespace {

// Every C[i][j] is one dot product of row i of A and row j of B, summed in kLanes
// interleaved partial sums (the compiler vectorizes them without -ffast-math) over k in
// order, then the lanes in order, then the k % kLanes tail. That order is the definition;
// the tiling below only decides which dot products run together and where their partial
// sums wait, so the result is bit-identical for any tile sizes and thread count.
constexpr int kLanes = 8;
constexpr int kRows = 4, kCols = 2;  // a register block: kRows x kCols dot products at once

template <int R, int Cn>
using Partials = float[R][Cn][kLanes];

// partial[r][c][lane] += a[r][k + lane] * b[c][k + lane] for k in [k_begin, k_end) step kLanes.
// R and Cn are constants so the partials live in registers; each loaded piece of A and B
// serves Cn and R dot products.
template <int R, int Cn>
inline void accumulate_block(Partials<R, Cn>& partial, const float* a, const float* b, size_t K, int k_begin,
                             int k_end) {
  for (int k = k_begin; k < k_end; k += kLanes)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < Cn; ++c)
        for (int lane = 0; lane < kLanes; ++lane) partial[r][c][lane] += a[r * K + k + lane] * b[c * K + k + lane];
}

struct TileJob {
  float* C;
  const float* A;
  const float* B;
  int N, K;
  float alpha;
  bool accumulate;
  int k_begin, k_end;          // this pass's share of the kLanes-multiple part of K
  float* saved = nullptr;      // [M][N][kLanes] partial sums between passes, or nullptr (one pass)
};

template <int R, int Cn>
inline void run_block(const TileJob& job, int i0, int j0) {
  const size_t K = size_t(job.K);
  const float* a = job.A + size_t(i0) * K;
  const float* b = job.B + size_t(j0) * K;
  Partials<R, Cn> partial;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Cn; ++c)
      for (int lane = 0; lane < kLanes; ++lane)
        partial[r][c][lane] =
            job.saved && job.k_begin > 0 ? job.saved[((size_t(i0 + r) * job.N) + j0 + c) * kLanes + lane] : 0.0f;
  accumulate_block<R, Cn>(partial, a, b, K, job.k_begin, job.k_end);
  const int vector_end = job.K / kLanes * kLanes;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Cn; ++c) {
      if (job.k_end < vector_end) {  // more passes to come: park the partial sums
        for (int lane = 0; lane < kLanes; ++lane)
          job.saved[((size_t(i0 + r) * job.N) + j0 + c) * kLanes + lane] = partial[r][c][lane];
        continue;
      }
      float sum = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) sum += partial[r][c][lane];
      for (int tail = vector_end; tail < job.K; ++tail) sum += a[r * K + tail] * b[c * K + tail];
      float& out = job.C[size_t(i0 + r) * job.N + j0 + c];
      out = job.accumulate ? out + job.alpha * sum : job.alpha * sum;
    }
}

// Rows [i0, i0 + rows) of C, columns [j_begin, j_end). Compiled twice, for AVX2 and for
// baseline x86-64, and picked at load time: the wider vectors run the same additions in
// the same order (no FMA is enabled, so nothing is contracted).
__attribute__((target_clones("avx2", "default"))) void run_tile(const TileJob& job, int i0, int rows, int j_begin,
                                                                 int j_end) {
  int j = j_begin;
  if (rows == kRows)
    for (; j + kCols <= j_end; j += kCols) run_block<kRows, kCols>(job, i0, j);
  for (; j < j_end; ++j)
    for (int r = 0; r < rows; ++r) run_block<1, 1>(job, i0 + r, j);
}

}  // namespace

void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, bool accumulate) {
  // Tiles of kTileRows x kTileColumns outputs, column tiles outermost: the threads split
  // the rows of B, and each tile of B (kTileColumns rows) is reused from cache by every row
  // tile of A. A long K (the LM head's dgrad: 50,304) runs in passes of kPassK, so that the
  // rows of A and B of one pass stay in cache; the partial sums wait in memory in between.
  constexpr int kTileRows = 64, kTileColumns = 64, kPassK = 2048;
  const int row_tiles = (M + kTileRows - 1) / kTileRows, column_tiles = (N + kTileColumns - 1) / kTileColumns;
  const int vector_end = K / kLanes * kLanes;
  std::vector<float> saved;
  const bool passes = vector_end > 2 * kPassK && size_t(M) * N <= (size_t(1) << 22);
  if (passes) saved.resize(size_t(M) * N * kLanes);
  int k_begin = 0;
  do {
    const int k_end = passes ? std::min(vector_end, k_begin + kPassK) : vector_end;
    const TileJob job{C, A, B, N, K, alpha, accumulate, k_begin, k_end, passes ? saved.data() : nullptr};
#pragma omp parallel for collapse(2) schedule(static)
    for (int column_tile = 0; column_tile < column_tiles; ++column_tile) {
      for (int row_tile = 0; row_tile < row_tiles; ++row_tile) {
        const int i0 = row_tile * kTileRows, j0 = column_tile * kTileColumns;
        for (int i = i0; i < std::min(M, i0 + kTileRows); i += kRows)
          run_tile(job, i, std::min(kRows, M - i), j0, std::min(N, j0 + kTileColumns));
      }
    }
    k_begin = k_end;
  } while (k_begin < vector_end);
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
