// The forward-only evaluator (apps/evaluator.h) against the training engine it stands in for:
// after a few training steps, an evaluator given the engine's weights and FP8 scaling state
// scores every batch, and every row, exactly as the engine's own evaluation does. Used on the
// CPU, on the GPU and under mpirun (tensor and data parallelism).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "apps/engine.h"
#include "apps/evaluator.h"
#include "apps/run_setup.h"
#include "core/loss_mask.h"
#include "core/random.h"

namespace fp8lm::testing {

inline std::vector<int32_t> evaluator_tokens(size_t n, int vocab, uint64_t seed) {
  Random random(seed);
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(random.next_u64() % uint64_t(vocab));
  return tokens;
}

inline bool same_double_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// `training`: a train set-up (its command train); the evaluator's is the same with command
// eval. Returns the evaluator's allocations over the engine's.
inline double check_evaluator_matches_engine(const RunSetup& training, const ParallelLayout& layout = {}) {
  const int B = training.options.micro_batch_size, T = training.seq_length, V = training.model.vocab_size;
  const size_t tokens = size_t(B) * size_t(T);
  TrainingEngine engine(training, layout);
  AdamWHyperparams hp;
  hp.lr = 3e-3f;
  for (int step = 0; step < 3; ++step) {
    engine.begin_step();
    const auto x = evaluator_tokens(tokens, V, 1000 + 10 * step + layout.dp_rank);
    const auto y = evaluator_tokens(tokens, V, 1001 + 10 * step + layout.dp_rank);
    engine.forward_backward(x.data(), y.data());
    engine.end_step(hp, 1.0, step);
  }
  RunSetup evaluation = training;
  evaluation.options.command = RunCommand::eval;
  Evaluator evaluator(evaluation, layout);
  evaluator.set_scaling_state(engine.scaling_state());
  evaluator.set_parameters(engine.parameters());
  for (int batch = 0; batch < 2; ++batch) {
    INFO("batch " << batch);
    const auto x = evaluator_tokens(tokens, V, 2000 + 10 * batch + layout.dp_rank);
    auto y = evaluator_tokens(tokens, V, 2001 + 10 * batch + layout.dp_rank);
    if (training.options.eod_mask_loss)
      for (size_t i = 0; i < tokens; i += 3) y[i] = kMaskedTarget;
    const BatchLoss expected = engine.evaluate(x.data(), y.data());
    const BatchLoss got = evaluator.evaluate(x.data(), y.data());
    INFO("engine " << expected.sum << " / " << expected.tokens << ", evaluator " << got.sum << " / " << got.tokens);
    CHECK(same_double_bits(got.sum, expected.sum));
    CHECK(got.tokens == expected.tokens);
    const std::vector<BatchLoss> expected_rows = engine.row_losses(x.data(), y.data());
    const std::vector<BatchLoss> rows = evaluator.row_losses(x.data(), y.data());
    REQUIRE(rows.size() == expected_rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      CHECK(same_double_bits(rows[r].sum, expected_rows[r].sum));
      CHECK(rows[r].tokens == expected_rows[r].tokens);
    }
  }
  return double(evaluator.allocated_bytes()) / double(engine.benchmark_memory().allocated_bytes);
}

}  // namespace fp8lm::testing
