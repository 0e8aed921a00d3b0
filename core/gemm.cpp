#include "core/gemm.h"

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

void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, bool accumulate) {
  // Eight interleaved partial sums let the compiler vectorize the dot product without
  // -ffast-math while keeping one fixed summation order.
  constexpr int kLanes = 8;
#pragma omp parallel for schedule(static)
  for (int i = 0; i < M; ++i) {
    const float* a = A + static_cast<size_t>(i) * K;
    for (int j = 0; j < N; ++j) {
      const float* b = B + static_cast<size_t>(j) * K;
      float partial[kLanes] = {};
      int k = 0;
      for (; k + kLanes <= K; k += kLanes) {
        for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[k + lane] * b[k + lane];
      }
      float sum = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
      for (; k < K; ++k) sum += a[k] * b[k];
      float& c = C[static_cast<size_t>(i) * N + j];
      c = accumulate ? c + alpha * sum : alpha * sum;
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
