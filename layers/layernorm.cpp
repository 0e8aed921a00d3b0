#include "layers/layernorm.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "core/error.h"

namespace fp8lm::cpu {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const float* x = inp + static_cast<size_t>(n) * C;  // [C]
    float* y = out + static_cast<size_t>(n) * C;        // [C]

    float sum = 0.0f;
    for (int c = 0; c < C; c++) sum += x[c];
    const float row_mean = sum / C;

    // Two passes (variance about the mean, not E[x^2] - mean^2): no cancellation when
    // the row has a large offset, as residual streams do.
    float squared_deviation = 0.0f;
    for (int c = 0; c < C; c++) {
      const float deviation = x[c] - row_mean;
      squared_deviation += deviation * deviation;
    }
    const float row_rstd = 1.0f / std::sqrt(squared_deviation / C + eps);

    for (int c = 0; c < C; c++) y[c] = layernorm_element(x[c], row_mean, row_rstd, weight[c], bias[c]);
    mean[n] = row_mean;
    rstd[n] = row_rstd;
  }
}

void layernorm_output(float* out, const float* inp, const float* mean, const float* rstd, const float* weight,
                      const float* bias, int N, int C) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const float* x = inp + static_cast<size_t>(n) * C;
    float* y = out + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; c++) y[c] = layernorm_element(x[c], mean[n], rstd[n], weight[c], bias[c]);
  }
}

void residual_layernorm_forward(float* out, float* residual_out, float* mean, float* rstd, const float* residual_in,
                                const float* branch, const float* branch_bias, const float* weight,
                                const float* bias, int N, int C, float eps) {
  if (branch == nullptr) {
    FP8LM_CHECK(branch_bias == nullptr, "residual_layernorm_forward: branch_bias without a branch");
    layernorm_forward(out, mean, rstd, residual_in, weight, bias, N, C, eps);
    return;
  }
  FP8LM_CHECK(residual_out != nullptr, "residual_layernorm_forward: null residual_out");
  // Bias into the branch first, then the residual: the order the GPU adds in. Without a
  // bias nothing is added (x + 0 would turn a -0 branch into +0).
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    for (int c = 0; c < C; c++) {
      const size_t i = static_cast<size_t>(n) * C + c;
      const float branch_value = branch_bias != nullptr ? branch[i] + branch_bias[c] : branch[i];
      residual_out[i] = residual_in[i] + branch_value;  // GPU: rounded to BF16 here
    }
  }
  layernorm_forward(out, mean, rstd, residual_out, weight, bias, N, C, eps);
}

// With xhat = (x - mean) * rstd and g = dout * weight, the row's input gradient is
//   dinp = rstd * (g - mean(g) - xhat * mean(g * xhat))
// (the two means are the gradient flowing through mean and through rstd).
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  // dinp: rows are independent.
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const float* x = inp + static_cast<size_t>(n) * C;    // [C]
    const float* dy = dout + static_cast<size_t>(n) * C;  // [C]
    float* dx = dinp + static_cast<size_t>(n) * C;        // [C]

    float sum_g = 0.0f;
    float sum_g_xhat = 0.0f;
    for (int c = 0; c < C; c++) {
      const float xhat = (x[c] - mean[n]) * rstd[n];
      const float g = dy[c] * weight[c];
      sum_g += g;
      sum_g_xhat += g * xhat;
    }
    const float mean_g = sum_g / C;
    const float mean_g_xhat = sum_g_xhat / C;

    for (int c = 0; c < C; c++) {
      const float xhat = (x[c] - mean[n]) * rstd[n];
      const float g = dy[c] * weight[c];
      dx[c] += rstd[n] * (g - mean_g - xhat * mean_g_xhat);
    }
  }

  // dweight, dbias: a reduction over rows. Each thread owns a block of columns and sums
  // the rows in order n = 0..N-1, so the result does not depend on the thread count.
  // The block's sums are added to the accumulators once, at the end.
  constexpr int kColumnBlock = 64;
  const int num_blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for
  for (int block = 0; block < num_blocks; block++) {
    const int c_begin = block * kColumnBlock;
    const int c_end = std::min(C, c_begin + kColumnBlock);
    float block_dweight[kColumnBlock] = {};  // [c_end - c_begin]
    float block_dbias[kColumnBlock] = {};
    for (int n = 0; n < N; n++) {
      const float* x = inp + static_cast<size_t>(n) * C;
      const float* dy = dout + static_cast<size_t>(n) * C;
      for (int c = c_begin; c < c_end; c++) {
        const float xhat = (x[c] - mean[n]) * rstd[n];
        block_dweight[c - c_begin] += dy[c] * xhat;
        block_dbias[c - c_begin] += dy[c];
      }
    }
    for (int c = c_begin; c < c_end; c++) {
      dweight[c] += block_dweight[c - c_begin];
      dbias[c] += block_dbias[c - c_begin];
    }
  }
}

}  // namespace fp8lm::cpu
