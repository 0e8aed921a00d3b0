#include "core/mock_data.h"

#include "core/random.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "core/error.h"

namespace fp8lm {
namespace {

// The mock language's shape.
//
// Entropy, roughly: every word's successor is drawn from a Zipf(1) distribution over the 64
// words (weights 1/rank), which carries about 4.86 bits. Inside a word the tokens are fixed, so
// with words of 4 tokens on average the stream carries about 4.86 / 4 = 1.2 bits = 0.84 nats
// per token. A model that has learnt the lexicon and the transitions reaches a loss near 0.84,
// against log(50257) = 10.8 (or log(256) = 5.5 for the tiny config) for a model that knows
// nothing: a clear drop that a 2-layer GPT shows in a few hundred steps. (With a small
// vocabulary some words share tokens, which makes word boundaries ambiguous for a moment and
// the floor a little higher.)
constexpr int kLexiconWords = 64;
constexpr int kMinWordTokens = 2;
constexpr int kMaxWordTokens = 6;
constexpr uint64_t kZipfScale = uint64_t{1} << 20;  // integer weights kZipfScale / rank
// The language's own seed: fixed, so the lexicon is the same for every stream seed.
constexpr uint64_t kLanguageSeed = 0x6670386C6D6F636Bull;  // "fp8lmock"

struct MockLanguage {
  std::vector<std::vector<uint16_t>> words;                 // [kLexiconWords][2..6]
  std::vector<std::vector<uint64_t>> successor_cumulative;  // [kLexiconWords][kLexiconWords]
  std::vector<std::vector<int>> successor_by_rank;          // [kLexiconWords][kLexiconWords]
};

uint64_t zipf_weight(int rank) { return kZipfScale / uint64_t(rank + 1); }

MockLanguage make_language(int vocab_size) {
  Random rng(kLanguageSeed);
  MockLanguage language;
  for (int w = 0; w < kLexiconWords; ++w) {
    const int length = kMinWordTokens + int(uniform_below(rng, kMaxWordTokens - kMinWordTokens + 1));
    std::vector<uint16_t> word(length);
    for (auto& token : word) token = uint16_t(uniform_below(rng, uint64_t(vocab_size)));
    language.words.push_back(std::move(word));
  }
  // Each word gets its own ranking of successors (a random permutation), so the chain has
  // structure to learn at every word, not one global frequency list.
  for (int w = 0; w < kLexiconWords; ++w) {
    std::vector<int> ranking(kLexiconWords);
    std::iota(ranking.begin(), ranking.end(), 0);
    for (int i = kLexiconWords - 1; i > 0; --i) std::swap(ranking[i], ranking[uniform_below(rng, uint64_t(i + 1))]);
    std::vector<uint64_t> cumulative(kLexiconWords);
    uint64_t total = 0;
    for (int rank = 0; rank < kLexiconWords; ++rank) cumulative[rank] = (total += zipf_weight(rank));
    language.successor_by_rank.push_back(std::move(ranking));
    language.successor_cumulative.push_back(std::move(cumulative));
  }
  return language;
}

}  // namespace

std::vector<uint16_t> make_mock_tokens(size_t count, int vocab_size, uint64_t seed) {
  FP8LM_CHECK(vocab_size > 0 && vocab_size <= 65536, "mock data vocab_size ", vocab_size, " (uint16 tokens)");
  const MockLanguage language = make_language(vocab_size);
  Random rng(seed);
  std::vector<uint16_t> tokens;
  tokens.reserve(count + kMaxWordTokens);
  int word = int(uniform_below(rng, kLexiconWords));
  while (tokens.size() < count) {
    const auto& spelling = language.words[word];
    tokens.insert(tokens.end(), spelling.begin(), spelling.end());
    const auto& cumulative = language.successor_cumulative[word];
    const uint64_t draw = uniform_below(rng, cumulative.back());
    const int rank = int(std::upper_bound(cumulative.begin(), cumulative.end(), draw) - cumulative.begin());
    word = language.successor_by_rank[word][rank];
  }
  tokens.resize(count);  // the last word may be cut
  return tokens;
}

double mock_tokens_entropy_estimate() {
  // Zipf(1) successor entropy over the mean word length (see the note on the language's shape).
  uint64_t total = 0;
  for (int rank = 0; rank < kLexiconWords; ++rank) total += zipf_weight(rank);
  double word_entropy = 0.0;
  for (int rank = 0; rank < kLexiconWords; ++rank) {
    const double p = double(zipf_weight(rank)) / double(total);
    word_entropy -= p * std::log(p);
  }
  return word_entropy / (0.5 * (kMinWordTokens + kMaxWordTokens));
}

MockDataLoaders make_mock_data_loaders(const DataLoaderOptions& options, size_t train_tokens, size_t valid_tokens) {
  // Four global steps of samples, and the one token past the last window.
  const size_t min_tokens =
      4 * size_t(options.micro_batch_size) * size_t(options.data_parallel_size) * size_t(options.seq_len) + 1;
  DataLoaderOptions valid_options = options;
  valid_options.seed = options.seed + 1;
  std::vector<std::vector<uint16_t>> train_stream, valid_stream;
  train_stream.push_back(make_mock_tokens(std::max(train_tokens, min_tokens), options.vocab_size, options.seed));
  valid_stream.push_back(make_mock_tokens(std::max(valid_tokens, min_tokens), options.vocab_size, valid_options.seed));
  return MockDataLoaders{DataLoader(std::move(train_stream), options),
                         DataLoader(std::move(valid_stream), valid_options)};
}

}  // namespace fp8lm
