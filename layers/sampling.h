// Choosing the next token from the logits, as Hugging Face `transformers` `generate` does
// with do_sample: the logits divided by the temperature, then top-k (keep the k largest; 0
// keeps all), then top-p (keep the smallest set of the most likely tokens whose
// probabilities sum to at least p; 1 keeps all), then one draw from what is left,
// renormalised. Temperature 0 is greedy: the largest logit (the lowest id among ties).
// Deterministic: the same logits and the same random number give the same token.
//
// A decoding loop chooses its tokens where the logits are (Ops::choose_next_tokens): the GPU
// draws the same numbers as the host, sequence b's k-th number computed directly from the
// seed (step_uniform), and takes sample_token's choice. Its sums of probabilities run in
// another order than the host's, so a draw within rounding (1e-16 relative) of a boundary
// between two tokens may pick the other one.
#pragma once

#include <cstddef>
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

// The next token among ids [0, vocab_size) of logits (FP32, at least vocab_size values), with
// `uniform` in [0, 1) as the draw (unused when greedy).
int32_t sample_token(const float* logits, int vocab_size, const SamplingOptions& options, double uniform);
// The same with the next number of `random` (none is taken when greedy).
int32_t sample_token(const float* logits, int vocab_size, const SamplingOptions& options, Random& random);

// The uniform number with which sequence `sequence` of a generation seeded `seed` draws its
// token at decoding step `step` (0: the step of the prompt's last token): the (step + 1)-th
// number of Random(seed * kGoldenGamma + sequence + 1), without drawing the ones before it.
FP8LM_HOST_DEVICE inline double step_uniform(uint64_t seed, int sequence, int64_t step) {
  const uint64_t stream = seed * kGoldenGamma + uint64_t(sequence) + 1;
  return uniform_of(random_number_at(stream, uint64_t(step)));
}

// A decoding loop's tokens in backend memory (Ops::choose_next_tokens), allocated by its
// caller. B sequences, positions up to `rows - 1`.
struct DecodingTokens {
  int32_t* chosen = nullptr;   // [rows, B]: row p holds each sequence's token at position p; -1 once it ended
  int32_t* ended = nullptr;    // [B]: 1 once the sequence drew stop_token; zero before the first step
  int32_t* scratch = nullptr;  // decoding_token_scratch_ints(B) ints: the first zero before the first step
  int rows = 0;                // capacity + 1
  uint64_t seed = 0;           // step_uniform's
  int first_position = 0;      // the position of step 0 (the prompt's last token)
  int stop_token = -1;         // none: -1
};

// The GPU's working memory for choosing B tokens: a counter of the finished blocks (the
// kernel leaves it zero again), then a histogram of the 65,536 BF16 logit values per sequence
// (top-k, top-p; the kernel clears its own).
inline size_t decoding_token_scratch_ints(int B) { return size_t(B) * 65536 + 1; }
// The bytes of a DecodingTokens' memory in one allocation: chosen, ended, scratch.
inline size_t decoding_token_bytes(int B, int capacity) {
  return sizeof(int32_t) * (size_t(capacity + 1) * size_t(B) + size_t(B) + decoding_token_scratch_ints(B));
}
// A DecodingTokens over one allocation of decoding_token_bytes(B, capacity), in that order, so
// that ended and scratch's counter, which must be zero before the first step, are the B + 1
// ints from `ended` on. The caller sets seed, first_position and stop_token.
inline DecodingTokens decoding_tokens_in(void* memory, int B, int capacity) {
  DecodingTokens t;
  t.rows = capacity + 1;
  t.chosen = static_cast<int32_t*>(memory);
  t.ended = t.chosen + size_t(t.rows) * size_t(B);
  t.scratch = t.ended + B;
  return t;
}

}  // namespace fp8lm
