#include "layers/attention.h"

#include <cmath>
#include <cstddef>
#include <vector>

#include "core/error.h"

// Precision: everything is FP32, including the accumulators. The softmax is computed
// max-subtracted, so every exponent is <= 0 and each row's normaliser lies in [1, T]:
// nothing overflows, and FP32 sums over one row (T terms, in order s = 0..t) are accurate
// to well below the BF16 the GPU keeps its inputs and outputs in.

namespace fp8lm {

void check_document_starts(const int32_t* document_starts, int B, int T, const char* what) {
  if (document_starts == nullptr) return;
  for (int b = 0; b < B; b++) {
    const int32_t* first = document_starts + static_cast<size_t>(b) * T;
    for (int t = 0; t < T; t++) {
      const bool whole = t == 0 ? first[0] == 0 : first[t] == first[t - 1] || first[t] == t;
      FP8LM_CHECK(whole, what, ": document_starts[", b, ",", t, "] = ", first[t],
                  " is neither the previous position's document start nor ", t, " (a row must be whole documents)");
    }
  }
}

}  // namespace fp8lm

namespace fp8lm::cpu {

namespace {

// Pointers into the packed qkv [B,T,3C] and into out/dout [B,T,C] for one (b, t, head).
struct HeadView {
  int T, C, HS;
  size_t qkv_row(int b, int t) const { return (static_cast<size_t>(b) * T + t) * 3 * C; }
  size_t out_row(int b, int t) const { return (static_cast<size_t>(b) * T + t) * C; }
  size_t q(int b, int t, int h) const { return qkv_row(b, t) + static_cast<size_t>(h) * HS; }
  size_t k(int b, int t, int h) const { return q(b, t, h) + C; }
  size_t v(int b, int t, int h) const { return q(b, t, h) + 2 * static_cast<size_t>(C); }
  size_t o(int b, int t, int h) const { return out_row(b, t) + static_cast<size_t>(h) * HS; }
};

float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
  for (int i = 0; i < n; i++) sum += a[i] * b[i];
  return sum;
}

// The first key query t of row b sees: its document's first position (0 without documents).
int first_key(const int32_t* document_starts, int b, int t, int T) {
  return document_starts == nullptr ? 0 : document_starts[static_cast<size_t>(b) * T + t];
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, const int32_t* document_starts, int B, int T, int C,
                       int NH) {
  FP8LM_CHECK(NH > 0 && C % NH == 0, "attention needs C divisible by NH, got C=", C, " NH=", NH);
  const int HS = C / NH;
  const HeadView at{T, C, HS};
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));

#pragma omp parallel
  {
    std::vector<float> scores(T);  // [T] one query row of S (only s <= t is used)
#pragma omp for collapse(3)
    for (int b = 0; b < B; b++) {
      for (int h = 0; h < NH; h++) {
        for (int t = 0; t < T; t++) {
          const float* q = qkv + at.q(b, t, h);  // [HS]

          // Causal, within the query's document: query t sees keys s = first..t.
          const int first = first_key(document_starts, b, t, T);
          float max_score = -INFINITY;
          for (int s = first; s <= t; s++) {
            scores[s] = dot(q, qkv + at.k(b, s, h), HS) * scale;
            max_score = std::fmax(max_score, scores[s]);
          }
          float normaliser = 0.0f;
          for (int s = first; s <= t; s++) {
            scores[s] = std::exp(scores[s] - max_score);  // unnormalised probability, <= 1
            normaliser += scores[s];
          }

          float* o = out + at.o(b, t, h);  // [HS]
          for (int i = 0; i < HS; i++) o[i] = 0.0f;
          for (int s = first; s <= t; s++) {
            const float p = scores[s] / normaliser;
            const float* v = qkv + at.v(b, s, h);
            for (int i = 0; i < HS; i++) o[i] += p * v[i];
          }
          lse[(static_cast<size_t>(b) * NH + h) * T + t] = max_score + std::log(normaliser);
        }
      }
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        const int32_t* document_starts, int B, int T, int C, int NH) {
  FP8LM_CHECK(NH > 0 && C % NH == 0, "attention needs C divisible by NH, got C=", C, " NH=", NH);
  const int HS = C / NH;
  const HeadView at{T, C, HS};
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));

  // dk_s and dv_s gather contributions from every query t >= s, so one (b, h) pair is the
  // unit of work: it owns its head's columns of dqkv for all t, and sums over t in order.
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      for (int t = 0; t < T; t++) {
        float* dq = dqkv + at.q(b, t, h);
        float* dk = dqkv + at.k(b, t, h);
        float* dv = dqkv + at.v(b, t, h);
        for (int i = 0; i < HS; i++) dq[i] = dk[i] = dv[i] = 0.0f;
      }

      for (int t = 0; t < T; t++) {
        const float* q = qkv + at.q(b, t, h);        // [HS]
        const float* o = out + at.o(b, t, h);        // [HS]
        const float* dout_t = dout + at.o(b, t, h);  // [HS]
        float* dq = dqkv + at.q(b, t, h);            // [HS]
        const float row_lse = lse[(static_cast<size_t>(b) * NH + h) * T + t];
        const float D = dot(dout_t, o, HS);  // = sum_s P[t,s] dP[t,s], the softmax's Jacobian term

        for (int s = first_key(document_starts, b, t, T); s <= t; s++) {
          const float* k = qkv + at.k(b, s, h);
          const float* v = qkv + at.v(b, s, h);
          const float p = std::exp(dot(q, k, HS) * scale - row_lse);  // P[t,s], recomputed
          const float dp = dot(dout_t, v, HS);
          const float ds = p * (dp - D);

          float* dk = dqkv + at.k(b, s, h);
          float* dv = dqkv + at.v(b, s, h);
          for (int i = 0; i < HS; i++) {
            dq[i] += ds * k[i] * scale;
            dk[i] += ds * q[i] * scale;
            dv[i] += p * dout_t[i];
          }
        }
      }
    }
  }
}

}  // namespace fp8lm::cpu
