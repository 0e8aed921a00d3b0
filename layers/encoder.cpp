#include "layers/encoder.h"

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

namespace fp8lm::cpu {

void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const size_t row = static_cast<size_t>(b) * T + t;
      float* out_row = out + row * C;                                       // [C]
      const float* token_row = wte + static_cast<size_t>(tokens[row]) * C;  // [C]
      const float* position_row = wpe + static_cast<size_t>(t) * C;         // [C]
      for (int c = 0; c < C; c++) out_row[c] = token_row[c] + position_row[c];
    }
  }
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C) {
  // dwpe: each position owns its row; the batch is summed in order b = 0..B-1 and then
  // added to the accumulator once.
#pragma omp parallel for
  for (int t = 0; t < T; t++) {
    for (int c = 0; c < C; c++) {
      float sum = 0.0f;
      for (int b = 0; b < B; b++) sum += dout[(static_cast<size_t>(b) * T + t) * C + c];
      dwpe[static_cast<size_t>(t) * C + c] += sum;
    }
  }

  // dwte: a token can occur many times in the batch, so parallelising over (b,t) would race
  // on its row. Group the positions by token instead (a stable sort keeps each group in
  // (b,t) order); each group is then owned by one iteration, summed in a fixed order that
  // does not depend on the thread count, and added to the accumulator once.
  const int num_rows = B * T;
  std::vector<int> rows_by_token(num_rows);  // [B*T] flat (b,t) indices, grouped by token
  std::iota(rows_by_token.begin(), rows_by_token.end(), 0);
  std::stable_sort(rows_by_token.begin(), rows_by_token.end(),
                   [tokens](int a, int b) { return tokens[a] < tokens[b]; });
  std::vector<int> group_begin;  // [num_groups + 1] offsets into rows_by_token
  for (int i = 0; i < num_rows; i++) {
    if (i == 0 || tokens[rows_by_token[i]] != tokens[rows_by_token[i - 1]]) group_begin.push_back(i);
  }
  group_begin.push_back(num_rows);
  const int num_groups = static_cast<int>(group_begin.size()) - 1;

#pragma omp parallel
  {
    std::vector<float> sum(C);  // [C] this thread's scratch row
#pragma omp for
    for (int group = 0; group < num_groups; group++) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int i = group_begin[group]; i < group_begin[group + 1]; i++) {
        const float* dout_row = dout + static_cast<size_t>(rows_by_token[i]) * C;
        for (int c = 0; c < C; c++) sum[c] += dout_row[c];
      }
      float* dwte_row = dwte + static_cast<size_t>(tokens[rows_by_token[group_begin[group]]]) * C;
      for (int c = 0; c < C; c++) dwte_row[c] += sum[c];
    }
  }
}

}  // namespace fp8lm::cpu
