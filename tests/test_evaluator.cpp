// fp8lm eval's forward-only evaluator scores as the training engine's evaluation does, bit for
// bit, in every precision and recipe, at a fraction of the memory: on the CPU, and on the GPU
// (SKIPPED without one). Under mpirun: tests/mpi/test_parallel_model.cpp.
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "apps/cli.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "evaluator_testing.h"
#include "gpu_testing.h"

using namespace fp8lm;

namespace {

RunSetup training_setup(const std::string& config, const std::string& device, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--config", testing::source_path("configs/" + config), "--mock-data", "--device",
                                   device};
  args.insert(args.end(), extra.begin(), extra.end());
  return resolve_run_setup(parse_train_command_line(args).options);
}

const std::vector<std::vector<std::string>> kPrecisions = {
    {"--bf16"},
    {"--fp8-hybrid"},  // delayed scales, learned by the three steps
    {"--fp8-hybrid", "--fp8-recipe", "tensorwise"},
    {"--fp8-hybrid", "--first-last-layers-bf16"},  // two block precisions: two buffer sets
    {"--fp8-hybrid", "--fp8-lm-head"},
    {"--fp8-hybrid", "--vocab-size", "50304", "--eod-mask-loss"},  // GPT-2's <|endoftext|> in the vocabulary
};

}  // namespace

TEST_CASE("the evaluator scores every batch and row as the training engine does, bit for bit (CPU)", "[eval][evaluator]") {
  std::vector<std::vector<std::string>> variants = kPrecisions;
  variants.push_back({"--fp8-hybrid", "--fp8-recipe", "blockwise"});
  variants.push_back({"--fp8-e4m3"});
  for (std::vector<std::string> flags : variants) {
    INFO(flags.back());
    flags.insert(flags.end(), {"--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "3"});
    const double ratio = testing::check_evaluator_matches_engine(training_setup("tiny.json", "cpu", flags));
    CHECK(ratio < 0.6);
  }
}

TEST_CASE("GPU: the evaluator scores every batch and row as the training engine does, bit for bit", "[gpu][eval][evaluator]") {
  FP8LM_REQUIRE_GPU();
  for (std::vector<std::string> flags : kPrecisions) {
    INFO(flags.back());
    flags.insert(flags.end(), {"--num-layers", "4", "--seq-length", "256", "--micro-batch-size", "4"});
    const double ratio = testing::check_evaluator_matches_engine(training_setup("gpt2-124m.json", "cuda", flags));
    INFO("the evaluator holds " << ratio << " of the engine's memory");
    // Weights of 4 blocks and the 50304 x 768 embedding, against the engine's FP32 gradients,
    // master and moments (13 bytes a parameter beside the evaluator's 1-2).
    CHECK(ratio < 0.4);
  }
}
