// Choosing the next token from the logits, as Hugging Face `transformers` `generate` does
// with do_sample: the logits divided by the temperature, then top-k (keep the k largest; 0
// keeps all), then top-p (keep the smallest set of the most likely tokens whose
// probabilities sum to at least p; 1 keeps all), then one draw from what is left,
// renormalised. Temperature 0 is greedy: the largest logit (the lowest id among ties).
// Deterministic: the same logits and the same random stream give the same token.
#pragma once

#include <cstdint>

#include "core/random.h"

namespace fp8lm {

struct SamplingOptions {
  double temperature = 1.0;  // >= 0; 0 is greedy
  int top_k = 0;             // >= 0; 0 turns top-k off
  double top_p = 1.0;        // in (0, 1]
};

// Checks the options; throws InputError naming the flag (--temperature, --top-k, --top-p).
void validate_sampling_options(const SamplingOptions& options);

// The next token among ids [0, vocab_size) of logits (FP32, at least vocab_size values).
int32_t sample_token(const float* logits, int vocab_size, const SamplingOptions& options, Random& random);

}  // namespace fp8lm
