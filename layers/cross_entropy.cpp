#include "layers/cross_entropy.h"

#include <cmath>
#include <cstddef>

#include "core/error.h"

namespace fp8lm::cpu {

void cross_entropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss) {
  FP8LM_CHECK(V > 0 && V <= Vp, "cross entropy needs 0 < V <= Vp, got V=", V, " Vp=", Vp);
  // Checked up front: an exception cannot leave an OpenMP loop, and a bad target would
  // otherwise read outside the row.
  for (int i = 0; i < N; i++) {
    FP8LM_CHECK(targets[i] >= 0 && targets[i] < V, "target ", targets[i], " at row ", i,
                " is outside the vocabulary [0, ", V, ")");
  }

#pragma omp parallel for
  for (int i = 0; i < N; i++) {
    float* row = logits + static_cast<size_t>(i) * Vp;  // [Vp], only [0, V) is real vocabulary

    // Max-subtracted logsumexp: every exponent is <= 0, and the sum lies in [1, V].
    float max_logit = -INFINITY;
    for (int v = 0; v < V; v++) max_logit = std::fmax(max_logit, row[v]);
    float sum_exp = 0.0f;
    for (int v = 0; v < V; v++) sum_exp += std::exp(row[v] - max_logit);
    const float logsumexp = max_logit + std::log(sum_exp);

    const int target = targets[i];
    losses[i] = logsumexp - row[target];

    if (dloss == 0.0f) continue;  // forward only: the logits stay as they are
    for (int v = 0; v < V; v++) {
      const float probability = std::exp(row[v] - logsumexp);
      row[v] = (probability - (v == target ? 1.0f : 0.0f)) * dloss;
    }
    for (int v = V; v < Vp; v++) row[v] = 0.0f;
  }
}

}  // namespace fp8lm::cpu
