#include "layers/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace fp8lm {

void validate_sampling_options(const SamplingOptions& o) {
  FP8LM_INPUT_CHECK(std::isfinite(o.temperature) && o.temperature >= 0.0, "--temperature must be >= 0 (got ",
                    o.temperature, "); 0 is greedy decoding");
  FP8LM_INPUT_CHECK(o.top_k >= 0, "--top-k must be >= 0 (got ", o.top_k, "); 0 turns top-k off");
  FP8LM_INPUT_CHECK(o.top_p > 0.0 && o.top_p <= 1.0, "--top-p must be in (0, 1] (got ", o.top_p, "); 1 turns it off");
}

int32_t sample_token(const float* logits, int vocab_size, const SamplingOptions& o, Random& random) {
  return sample_token(logits, vocab_size, o, o.temperature == 0.0 ? 0.0 : random.uniform());
}

int32_t sample_token(const float* logits, int vocab_size, const SamplingOptions& o, double uniform) {
  FP8LM_CHECK(vocab_size > 0, "sample_token: empty vocabulary");
  if (o.temperature == 0.0) return int32_t(std::max_element(logits, logits + vocab_size) - logits);

  // Candidates: by descending logit (ties: lower id first) and cut to top-k when a cut
  // needs the order; in id order otherwise (a full sort per token would cost more than a
  // decoding step on the GPU).
  std::vector<int32_t> ids(static_cast<size_t>(vocab_size));
  std::iota(ids.begin(), ids.end(), 0);
  if (o.top_k > 0 || o.top_p < 1.0) {
    auto more_likely = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    const size_t keep = o.top_k > 0 ? std::min<size_t>(size_t(o.top_k), ids.size()) : ids.size();
    std::partial_sort(ids.begin(), ids.begin() + ptrdiff_t(keep), ids.end(), more_likely);
    ids.resize(keep);
  }

  // Softmax of logits / temperature over the candidates, in double.
  std::vector<double> probabilities(ids.size());
  const double max_logit = double(*std::max_element(logits, logits + vocab_size)) / o.temperature;
  double total = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    probabilities[i] = std::exp(double(logits[ids[i]]) / o.temperature - max_logit);
    total += probabilities[i];
  }
  // Top-p: the shortest prefix whose probability reaches p (the most likely token always stays).
  size_t nucleus = ids.size();
  if (o.top_p < 1.0) {
    double cumulative = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      cumulative += probabilities[i] / total;
      if (cumulative >= o.top_p) {
        nucleus = i + 1;
        break;
      }
    }
  }
  double nucleus_total = 0.0;
  for (size_t i = 0; i < nucleus; ++i) nucleus_total += probabilities[i];
  double draw = uniform * nucleus_total;
  for (size_t i = 0; i < nucleus; ++i) {
    draw -= probabilities[i];
    if (draw < 0.0) return ids[i];
  }
  return ids[nucleus - 1];  // rounding left a sliver: the least likely kept token
}

}  // namespace fp8lm
