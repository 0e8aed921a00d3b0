#include "layers/encoder.h"

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

namespace fp8lm::cpu {

void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C) {
  embedding_lookup(out, tokens, wte, 0, INT32_MAX, B * T, C);
  add_position_embedding(out, out, wpe, 0, T, B * T, C);
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C) {
  position_embedding_backward(dwpe, dout, 0, T, B * T, C);
  embedding_lookup_backward(dwte, dout, tokens, 0, INT32_MAX, B * T, C);
}

void embedding_lookup(float* out, const int32_t* tokens, const float* wte, int vocab_begin, int vocab_count, int N,
                      int C) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    float* out_row = out + static_cast<size_t>(n) * C;  // [C]
    const int64_t local = int64_t(tokens[n]) - vocab_begin;
    if (local < 0 || local >= vocab_count) {
      std::fill(out_row, out_row + C, 0.0f);
      continue;
    }
    const float* token_row = wte + static_cast<size_t>(local) * C;  // [C]
    std::copy(token_row, token_row + C, out_row);
  }
}

void add_position_embedding(float* out, const float* token_embeddings, const float* wpe, int first_row, int T, int N,
                            int C, const int32_t* position_ids) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const int position = position_ids ? position_ids[first_row + n] : (first_row + n) % T;
    const float* position_row = wpe + static_cast<size_t>(position) * C;  // [C]
    const float* token_row = token_embeddings + static_cast<size_t>(n) * C;
    float* out_row = out + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; c++) out_row[c] = token_row[c] + position_row[c];
  }
}

void position_embedding_backward(float* dwpe, const float* dout, int first_row, int T, int N, int C,
                                 const int32_t* position_ids) {
  // Each position owns its row: its rows are summed in ascending order, then added once.
  if (position_ids != nullptr) {
    std::vector<float> sums(static_cast<size_t>(T) * C, 0.0f);  // [T,C]
    for (int n = 0; n < N; n++) {
      float* sum = sums.data() + static_cast<size_t>(position_ids[first_row + n]) * C;
      for (int c = 0; c < C; c++) sum[c] += dout[static_cast<size_t>(n) * C + c];
    }
    for (size_t i = 0; i < sums.size(); i++) dwpe[i] += sums[i];
    return;
  }
#pragma omp parallel for
  for (int t = 0; t < T; t++) {
    const int first = ((t - first_row) % T + T) % T;  // the first local row at position t
    for (int c = 0; c < C; c++) {
      float sum = 0.0f;
      for (int n = first; n < N; n += T) sum += dout[static_cast<size_t>(n) * C + c];
      dwpe[static_cast<size_t>(t) * C + c] += sum;
    }
  }
}

void embedding_lookup_backward(float* dwte, const float* dout, const int32_t* tokens, int vocab_begin,
                               int vocab_count, int N, int C) {
  // A token can occur many times in the batch, so parallelising over rows would race on
  // its row. Group the rows by token instead (a stable sort keeps each group in row
  // order); each group is then owned by one iteration, summed in a fixed order that does
  // not depend on the thread count, and added to the accumulator once.
  std::vector<int> rows_by_token;  // rows of this slice's tokens, grouped by token
  for (int n = 0; n < N; n++) {
    const int64_t local = int64_t(tokens[n]) - vocab_begin;
    if (local >= 0 && local < vocab_count) rows_by_token.push_back(n);
  }
  std::stable_sort(rows_by_token.begin(), rows_by_token.end(),
                   [tokens](int a, int b) { return tokens[a] < tokens[b]; });
  const int num_rows = static_cast<int>(rows_by_token.size());
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
      const int token = tokens[rows_by_token[group_begin[group]]];
      float* dwte_row = dwte + static_cast<size_t>(token - vocab_begin) * C;
      for (int c = 0; c < C; c++) dwte_row[c] += sum[c];
    }
  }
}

}  // namespace fp8lm::cpu
