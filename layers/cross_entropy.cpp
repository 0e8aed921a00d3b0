#include "layers/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "core/exp_vectorizable.h"
#include "core/loss_mask.h"

// Lanes is local to the AVX2 and baseline clones of each function and never crosses a call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace fp8lm::cpu {

namespace {

// The three passes over a row of logits, as separate functions so that each is compiled for
// AVX2 too and picked at load time (the results are the same bits either way).

// max over row[0, n); a NaN never wins, as with std::fmax.
__attribute__((target_clones("avx2", "default"))) float row_max(const float* row, int n) {
  float result = -INFINITY;
#pragma omp simd reduction(max : result)
  for (int v = 0; v < n; v++) result = row[v] > result ? row[v] : result;
  return result;
}

// sum of e^(row[v] - shift) over v in [0, n), in a fixed order that vectorizes: 8 interleaved
// partial sums (term v into partial v mod 8) up to the last whole 8, the partials in order from
// 0.0f, then the remaining terms in order (cpu::gemm_nt's order for a dot product). A single
// running sum would be one dependent addition per logit.
__attribute__((target_clones("avx2", "default"))) float row_sum_exp(const float* row, int n, float shift) {
  constexpr int kLanes = 8, kChunk = 32 * kLanes;
  typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
  Lanes partial{};
  float terms[kChunk];
  const int whole = n / kLanes * kLanes;
  for (int begin = 0; begin < whole; begin += kChunk) {
    const int count = std::min(kChunk, whole - begin);
#pragma omp simd
    for (int c = 0; c < count; c++) terms[c] = exp_vectorizable(row[begin + c] - shift);
    for (int c = 0; c < count; c += kLanes) {
      Lanes term;
      __builtin_memcpy(&term, terms + c, sizeof term);
      partial += term;
    }
  }
  float sum = 0.0f;
  for (int lane = 0; lane < kLanes; lane++) sum += partial[lane];
  for (int v = whole; v < n; v++) sum += exp_vectorizable(row[v] - shift);
  return sum;
}

// row[v] = (e^(row[v] - logsumexp) - [v == target]) * dloss for v in [0, n).
__attribute__((target_clones("avx2", "default"))) void row_softmax_gradient(float* row, int n, float logsumexp,
                                                                             int target, float dloss) {
#pragma omp simd
  for (int v = 0; v < n; v++) row[v] = (exp_vectorizable(row[v] - logsumexp) - (v == target ? 1.0f : 0.0f)) * dloss;
}

}  // namespace

void cross_entropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss) {
  FP8LM_CHECK(V > 0 && V <= Vp, "cross entropy needs 0 < V <= Vp, got V=", V, " Vp=", Vp);
  // Checked up front: an exception cannot leave an OpenMP loop, and a bad target would
  // otherwise read outside the row.
  for (int i = 0; i < N; i++) {
    FP8LM_CHECK(targets[i] == kMaskedTarget || (targets[i] >= 0 && targets[i] < V), "target ", targets[i], " at row ",
                i, " is outside the vocabulary [0, ", V, ")");
  }

#pragma omp parallel for
  for (int i = 0; i < N; i++) {
    float* row = logits + static_cast<size_t>(i) * Vp;  // [Vp], only [0, V) is real vocabulary

    // Max-subtracted logsumexp: every exponent is <= 0, and the sum lies in [1, V].
    const float max_logit = row_max(row, V);
    const float logsumexp = max_logit + std::log(row_sum_exp(row, V, max_logit));

    const int target = targets[i];
    const bool masked = target == kMaskedTarget;
    losses[i] = masked ? 0.0f : logsumexp - row[target];

    if (dloss == 0.0f) continue;  // forward only: the logits stay as they are
    row_softmax_gradient(row, V, logsumexp, target, masked ? 0.0f : dloss);
    for (int v = V; v < Vp; v++) row[v] = 0.0f;
  }
}

namespace {

// The slice layout both halves need; an exception cannot leave an OpenMP loop, so the
// targets are checked here, up front.
void check_vocab_slice(const char* what, const int32_t* targets, int N, int V, int Vs, int vocab_begin) {
  FP8LM_CHECK(N >= 0 && V > 0 && Vs > 0, what, ": needs N >= 0, V > 0, Vs > 0, got N=", N, " V=", V, " Vs=", Vs);
  FP8LM_CHECK(vocab_begin >= 0 && vocab_begin % Vs == 0, what, ": vocab_begin must be a multiple of Vs=", Vs,
              ", got ", vocab_begin);
  for (int i = 0; i < N; i++) {
    FP8LM_CHECK(targets[i] == kMaskedTarget || (targets[i] >= 0 && targets[i] < V), what, ": target ", targets[i],
                " at row ", i, " is outside the vocabulary [0, ", V, ")");
  }
}

}  // namespace

void cross_entropy_partials(float* partials, const float* logits, const int32_t* targets, int N, int V, int Vs,
                            int vocab_begin) {
  check_vocab_slice("cross_entropy_partials", targets, N, V, Vs, vocab_begin);
  // The slice's real columns are its first `real` (global index < V); the rest is padding.
  const int real = std::clamp(V - vocab_begin, 0, Vs);

#pragma omp parallel for
  for (int i = 0; i < N; i++) {
    const float* row = logits + static_cast<size_t>(i) * Vs;  // [Vs]

    // As cross_entropy_forward_backward over the slice's real columns.
    const float max_logit = row_max(row, real);
    const float sum_exp = row_sum_exp(row, real, max_logit);

    // < real when in the slice: targets are < V (a masked target, -1, is in no slice)
    const int local_target = targets[i] == kMaskedTarget ? -1 : targets[i] - vocab_begin;
    float* out = partials + static_cast<size_t>(i) * 3;  // [3]
    out[0] = max_logit;
    out[1] = sum_exp;
    out[2] = local_target >= 0 && local_target < Vs ? row[local_target] : 0.0f;
  }
}

void cross_entropy_finish(float* logits, float* losses, const float* all_partials, const int32_t* targets, int N,
                          int V, int Vs, int vocab_begin, int R, float dloss) {
  check_vocab_slice("cross_entropy_finish", targets, N, V, Vs, vocab_begin);
  FP8LM_CHECK(R >= 1 && vocab_begin / Vs < R && static_cast<int64_t>(V) <= static_cast<int64_t>(R) * Vs,
              "cross_entropy_finish: needs R >= 1, vocab_begin < R*Vs and V <= R*Vs, got R=", R, " Vs=", Vs,
              " vocab_begin=", vocab_begin, " V=", V);

#pragma omp parallel for
  for (int i = 0; i < N; i++) {
    // all_partials[r][i] [3]
    auto partial = [&](int r) { return all_partials + (static_cast<size_t>(r) * N + i) * 3; };

    // The union of the ranks' (max, sum) pairs, in rank order: every rank gets the same bits.
    float max_logit = -INFINITY;
    for (int r = 0; r < R; r++) max_logit = std::fmax(max_logit, partial(r)[0]);
    float sum_exp = 0.0f;
    for (int r = 0; r < R; r++) {
      const float m = partial(r)[0], s = partial(r)[1];
      if (m == -INFINITY) continue;  // a slice without real columns (or only -inf logits)
      sum_exp += m == max_logit ? s : s * exp_vectorizable(m - max_logit);
    }
    const float logsumexp = max_logit + std::log(sum_exp);

    const int target = targets[i];
    const bool masked = target == kMaskedTarget;
    losses[i] = masked ? 0.0f : logsumexp - partial(target / Vs)[2];

    if (dloss == 0.0f) continue;  // forward only: the logits stay as they are
    float* row = logits + static_cast<size_t>(i) * Vs;  // [Vs]
    const int real = std::clamp(V - vocab_begin, 0, Vs);  // the rest is padding: never part of the softmax
    row_softmax_gradient(row, real, logsumexp, masked ? -1 : target - vocab_begin, masked ? 0.0f : dloss);
    for (int v = real; v < Vs; v++) row[v] = 0.0f;
  }
}

}  // namespace fp8lm::cpu
