// Mock data: a synthetic token stream that a tiny GPT can learn, for --mock-data runs and tests.
//
// The stream is a "language" of 64 words, each 2-6 tokens drawn from the vocabulary, spoken by a
// first-order Markov chain over words whose transitions are Zipf-skewed. The language (lexicon
// and transition table) depends only on vocab_size; the seed picks which sentence is spoken, so
// a validation stream with another seed tests the same language on text never trained on.
// Everything comes from a SplitMix64 generator and integer arithmetic: the same tokens on every
// platform.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/token_data.h"

namespace fp8lm {

// `count` tokens of the mock language, all < vocab_size (1..65536).
std::vector<uint16_t> make_mock_tokens(size_t count, int vocab_size, uint64_t seed);

// The mock language's entropy in nats per token, for comparison with the loss (the lowest loss
// a perfect model reaches is about this; log(vocab_size) is where training starts).
double mock_tokens_entropy_estimate();

inline constexpr size_t kMockTrainTokens = size_t{1} << 22;  // 4M tokens (8 MB)
inline constexpr size_t kMockValidTokens = size_t{1} << 18;  // 256K tokens

struct MockDataLoaders {
  DataLoader train;
  DataLoader valid;
};

// Loaders over mock streams: train from options.seed, validation from options.seed + 1 (stream
// and shuffle both). Each stream is grown, where needed, to hold at least 4 global micro-batch
// steps, so any batch shape works. Every data-parallel rank builds the same streams and reads
// its own part.
MockDataLoaders make_mock_data_loaders(const DataLoaderOptions& options, size_t train_tokens = kMockTrainTokens,
                                       size_t valid_tokens = kMockValidTokens);

}  // namespace fp8lm
