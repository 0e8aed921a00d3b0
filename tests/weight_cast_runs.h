// Training runs that differ only in --optimizer-weight-casts (fused or separate), or in
// --optimizer-first-pass (backward or step), for the CPU and GPU tests that they agree bit
// for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "core/random.h"

namespace fp8lm::testing {

// The engine with --optimizer-weight-casts fused and separate, step by step: the same losses,
// master weights and FP8 scaling state, bit for bit. Step 2 collects FP8 statistics, so step
// 1's update leaves the casts to the separate path; --fp8-interval 2 keeps step 0 on current
// scaling, so its update does too.
inline constexpr int kWeightCastSteps = 6;

struct WeightCastRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<float> parameters;
  ScalingSnapshot scaling;
};

inline WeightCastRun run_weight_casts(const std::string& mode, const std::string& device, const std::string& config,
                               std::vector<std::string> flags, int B, int T, int vocab, int micro_batches = 1,
                               double clip = 1.0) {
  std::vector<std::string> args = {"--config", testing::source_path("configs/" + config), "--mock-data", "--device",
                                   device, "--seq-length", std::to_string(T), "--micro-batch-size", std::to_string(B),
                                   "--fp8-hybrid", "--fp8-stats-interval", "3", "--optimizer-weight-casts", mode,
                                   "--global-batch-size", std::to_string(B * micro_batches)};
  args.insert(args.end(), flags.begin(), flags.end());
  auto engine = make_engine(resolve_run_setup(parse_train_command_line(args).options));
  AdamWHyperparams hp;
  hp.lr = 3e-3f;
  hp.weight_decay = 0.1f;
  WeightCastRun run;
  for (int step = 0; step < kWeightCastSteps; ++step) {
    engine->begin_step();
    for (int micro_batch = 0; micro_batch < micro_batches; ++micro_batch) {
      std::vector<int32_t> inputs(size_t(B) * T), targets(size_t(B) * T);
      Random random(uint64_t(60 + step + 1000 * micro_batch));
      for (int32_t& t : inputs) t = int32_t(random.next_u64() % uint64_t(vocab));
      for (int32_t& t : targets) t = int32_t(random.next_u64() % uint64_t(vocab));
      engine->forward_backward(inputs.data(), targets.data());
    }
    engine->end_step(hp, clip, step);
    run.grad_norms.push_back(engine->step_metrics().grad_norm);
    run.losses.push_back(engine->step_metrics().loss);
    if (engine->collects_fp8_statistics(step)) CHECK_FALSE(engine->fp8_statistics().empty());
  }
  run.parameters = engine->parameters();
  run.scaling = engine->scaling_state();
  return run;
}

inline void check_same_run(const WeightCastRun& separate, const WeightCastRun& fused) {
  REQUIRE(separate.losses.size() == fused.losses.size());
  for (size_t i = 0; i < separate.losses.size(); ++i) {
    INFO("step " << i << ": " << separate.losses[i] << " separate, " << fused.losses[i] << " fused");
    CHECK(separate.losses[i] == fused.losses[i]);
    CHECK(separate.grad_norms[i] == fused.grad_norms[i]);
  }
  CHECK(separate.parameters == fused.parameters);
  CHECK(separate.scaling.history == fused.scaling.history);
  CHECK(separate.scaling.scale == fused.scaling.scale);
  CHECK(separate.scaling.scale_inv == fused.scaling.scale_inv);
}
}  // namespace fp8lm::testing
