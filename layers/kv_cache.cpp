#include "layers/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace fp8lm::cpu {

void kv_cache_append(float* keys, float* values, const float* qkv, int B, int n, int C, int capacity, int position,
                     const float* scales) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < n; ++t) {
      const float* row = qkv + (size_t(b) * n + t) * 3 * C;
      const size_t at = (size_t(b) * capacity + position + t) * C;
      for (int c = 0; c < C; ++c) {
        const float k = row[C + c], v = row[2 * C + c];
        keys[at + c] = scales ? fp8_round(k * scales[0], Fp8Dtype::e4m3) : k;
        values[at + c] = scales ? fp8_round(v * scales[1], Fp8Dtype::e4m3) : v;
      }
    }
}

void attention_decode(float* out, const float* qkv, const float* keys, const float* values, int B, int C, int NH,
                      int capacity, int length, float k_scale_inv, float v_scale_inv) {
  const int HS = C / NH;
  const float score_scale = k_scale_inv / std::sqrt(float(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + size_t(b) * 3 * C + size_t(h) * HS;
      std::vector<float> scores(static_cast<size_t>(length));
      float max_score = -INFINITY;
      for (int s = 0; s < length; ++s) {
        const float* k = keys + (size_t(b) * capacity + s) * C + size_t(h) * HS;
        float dot = 0.0f;
        for (int d = 0; d < HS; ++d) dot += q[d] * k[d];
        scores[s] = dot * score_scale;
        max_score = std::max(max_score, scores[s]);
      }
      float sum = 0.0f;
      for (int s = 0; s < length; ++s) {
        scores[s] = std::exp(scores[s] - max_score);
        sum += scores[s];
      }
      float* o = out + size_t(b) * C + size_t(h) * HS;
      std::fill(o, o + HS, 0.0f);
      for (int s = 0; s < length; ++s) {
        const float* v = values + (size_t(b) * capacity + s) * C + size_t(h) * HS;
        const float p = scores[s] / sum;
        for (int d = 0; d < HS; ++d) o[d] += p * v[d];
      }
      for (int d = 0; d < HS; ++d) o[d] *= v_scale_inv;
    }
}

}  // namespace fp8lm::cpu
