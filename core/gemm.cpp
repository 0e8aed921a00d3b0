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

std::string_view to_string(Fp8FastAccumulation choice) {
  return choice == Fp8FastAccumulation::forward ? "forward" : "all";
}

namespace cpu {

namespace {

// Every C[i][j] is one dot product of row i of A and row j of B, summed in kLanes
// interleaved partial sums (partial sum l takes the terms k = l, l + kLanes, l + 2 kLanes,
// ...) over k in order, then the lanes in order starting from 0.0f, then the K % kLanes
// tail in order. That order is the definition (block scaling and the GPU tests rely on it);
// nothing below changes it, so the result is bit-identical for any blocking and thread count.
//
// The vectors run across outputs, not along K: the 8 columns j0..j0+7 of one row of C are one
// vector per lane l (element c of partial[l] is lane l's partial sum of C[i][j0 + c]). So the
// lanes are summed in order by whole-vector additions and a row of C is stored whole: no
// horizontal sums, which cost more than the products when K is a few vectors long (the LM
// head's forward has K = n_embd). B is packed into panels of kLanes columns for that:
// panel[k][c] = B[j0 + c][k], zeros past N.
constexpr int kLanes = 8;

// kLanes floats as one vector (GCC's vector extension: one AVX register, or two SSE registers in
// the baseline build). + and * are the scalar operations lane by lane; nothing is contracted
// into an FMA (-ffp-contract=off, CMakeLists.txt; neither clone enables FMA either).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
// Lanes never crosses a call boundary (every helper is inlined into its target clone), so the
// warning that its calling convention differs between the AVX and baseline builds is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

[[gnu::always_inline]] inline Lanes load_lanes(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// A long K runs in passes of kPassK so that one pass's rows of A and panels stay in cache; the
// partial sums wait in memory between passes.
constexpr int kPassK = 2048;

struct PassJob {
  const float* A;
  const float* panels;  // [N / kLanes rounded up][pass length][kLanes]
  float* C;
  float* saved;         // [M][panels][kLanes][kLanes] partial sums between passes, or nullptr (one pass)
  int M, N, K, panel_count;
  int k_begin, k_end;   // this pass, within [0, K / kLanes * kLanes); the last pass also takes the tail
  float alpha;
  bool accumulate;
};

// Rows [row_begin, row_end) of C against one panel of columns. Compiled for AVX2 and for
// baseline x86-64, picked at load time; both run the same additions in the same order.
// (The quickstart's CPU LM head, 512 x 50,304 x 64 on 2 cores: the forward 316 -> about 115 ms
// against the former form, which vectorized along K and summed each dot product's lanes
// apart.)
__attribute__((target_clones("avx2", "default"))) void run_panel(const PassJob& job, int panel, int row_begin,
                                                                  int row_end) {
  const int K = job.K, vector_end = K / kLanes * kLanes;
  const bool first_pass = job.k_begin == 0, last_pass = job.k_end == vector_end;
  const int pass_length = (last_pass ? K : job.k_end) - job.k_begin;
  const float* panel_base = job.panels + size_t(panel) * pass_length * kLanes - size_t(job.k_begin) * kLanes;
  const int j0 = panel * kLanes, columns = std::min(kLanes, job.N - j0);
  for (int i = row_begin; i < row_end; ++i) {
    const float* a = job.A + size_t(i) * K;
    float* saved = job.saved ? job.saved + (size_t(i) * job.panel_count + panel) * kLanes * kLanes : nullptr;
    Lanes partial[kLanes];
    for (int lane = 0; lane < kLanes; ++lane)
      partial[lane] = first_pass ? Lanes{} : load_lanes(saved + lane * kLanes);
    for (int k = job.k_begin; k < job.k_end; k += kLanes)
      for (int lane = 0; lane < kLanes; ++lane)
        partial[lane] += a[k + lane] * load_lanes(panel_base + size_t(k + lane) * kLanes);
    if (!last_pass) {
      __builtin_memcpy(saved, partial, sizeof partial);
      continue;
    }
    Lanes sum{};
    for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
    for (int tail = vector_end; tail < K; ++tail) sum += a[tail] * load_lanes(panel_base + size_t(tail) * kLanes);
    sum *= job.alpha;
    float* c = job.C + size_t(i) * job.N + j0;
    if (columns == kLanes) {
      if (job.accumulate) sum += load_lanes(c);
      __builtin_memcpy(c, &sum, sizeof sum);
    } else {
      for (int col = 0; col < columns; ++col) c[col] = job.accumulate ? c[col] + sum[col] : sum[col];
    }
  }
}

}  // namespace

void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  const int panel_count = (N + kLanes - 1) / kLanes;
  const int vector_end = K / kLanes * kLanes;
  // Passes only where the partial sums are few enough to park (the LM head's dgrad: M x n_embd
  // outputs, K = the vocabulary); otherwise one pass, streaming A and the panels.
  const bool passes = vector_end > 2 * kPassK && size_t(M) * N <= (size_t(1) << 22);
  std::vector<float> saved(passes ? size_t(M) * panel_count * kLanes * kLanes : 0);
  std::vector<float> panels;
  // Row blocks of A stay in cache while the panels pass by.
  constexpr int kBlockRows = 64;
  const int row_blocks = (M + kBlockRows - 1) / kBlockRows;
  int k_begin = 0;
  do {
    const int k_end = passes ? std::min(vector_end, k_begin + kPassK) : vector_end;
    const int pass_end = k_end == vector_end ? K : k_end;  // the last pass packs the tail too
    const int pass_length = pass_end - k_begin;
    panels.assign(size_t(panel_count) * pass_length * kLanes, 0.0f);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panel_count; ++p)
      for (int c = 0; c < std::min(kLanes, N - p * kLanes); ++c) {
        const float* b = B + size_t(p * kLanes + c) * K;
        float* panel = panels.data() + size_t(p) * pass_length * kLanes;
        for (int k = k_begin; k < pass_end; ++k) panel[size_t(k - k_begin) * kLanes + c] = b[k];
      }
    const PassJob job{A, panels.data(), C, passes ? saved.data() : nullptr, M, N, K, panel_count,
                      k_begin, k_end, alpha, accumulate};
#pragma omp parallel for collapse(2) schedule(static)
    for (int row_block = 0; row_block < row_blocks; ++row_block)
      for (int p = 0; p < panel_count; ++p)
        run_panel(job, p, row_block * kBlockRows, std::min(M, (row_block + 1) * kBlockRows));
    k_begin = k_end;
  } while (k_begin < vector_end);
}

void transpose(float* out, const float* in, int rows, int cols) {
  // In square tiles, so that both the rows read and the rows written stay in cache while a
  // tile is copied (a column at a time, the reads of a wide matrix - the LM head's logits'
  // gradient, 50,304 wide - each missed the cache).
  constexpr int kTile = 32;
  const int row_tiles = (rows + kTile - 1) / kTile, column_tiles = (cols + kTile - 1) / kTile;
#pragma omp parallel for collapse(2) schedule(static)
  for (int column_tile = 0; column_tile < column_tiles; ++column_tile)
    for (int row_tile = 0; row_tile < row_tiles; ++row_tile) {
      const int r0 = row_tile * kTile, c0 = column_tile * kTile;
      const int r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int c = c0; c < c1; ++c)
        for (int r = r0; r < r1; ++r) out[static_cast<size_t>(c) * rows + r] = in[static_cast<size_t>(r) * cols + c];
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
