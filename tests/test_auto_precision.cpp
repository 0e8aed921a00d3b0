// --fp8-auto-precision and --bf16-blocks end to end on the CPU: the rule on hand-made
// statistics; thresholds that cannot trigger change no number; thresholds that must trigger
// switch the expected blocks, say so in the log and in the checkpoint; a run checkpointed
// after a switch resumes bit-exactly; `fp8lm eval` of such a checkpoint reproduces the logged
// validation loss; bad flags exit 2 naming the flag.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/fp8_statistics.h"
#include "apps/shard_writer.h"
#include "cli_testing.h"
#include "core/safetensors.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

using testing::TempDir;

const std::string kRun = "--config " + testing::source_path("configs/tiny.json") +
                         " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 "
                         "--lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-interval 0 --eval-iters 0 "
                         "--train-iters 8 --fp8-hybrid ";

testing::CommandResult run(const std::string& args) {
  auto result = testing::run_fp8lm(args);
  INFO("fp8lm " << args << "\n" << result.output);
  return result;
}

std::vector<double> losses(const std::string& metrics_file) { return testing::metrics_losses(metrics_file); }

size_t statistics_lines(const std::string& metrics_file) {
  size_t count = 0;
  std::ifstream file(metrics_file);
  std::string line;
  while (std::getline(file, line)) count += nlohmann::json::parse(line).contains("fp8_stats") ? 1 : 0;
  return count;
}

nlohmann::json state_args(const std::string& iteration_dir) {
  std::ifstream file(iteration_dir + "/state.json");
  return nlohmann::json::parse(file)["args"];
}

std::vector<std::string> scaling_names(const std::string& iteration_dir) {
  const auto scaling = SafetensorsFile::open(iteration_dir + "/fp8_scaling.safetensors");
  return nlohmann::json::parse(scaling.metadata().at("names")).get<std::vector<std::string>>();
}

std::string file_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

Fp8TensorStatistics operand(const std::string& name, double saturated, double underflow) {
  Fp8TensorStatistics s;
  s.name = name;
  s.elements = 1000;
  s.saturated = saturated;
  s.underflow = underflow;
  return s;
}

}  // namespace

TEST_CASE("the switching rule: strictly above a threshold, block operands only, one reason per block",
          "[auto-precision]") {
  const std::vector<Fp8TensorStatistics> statistics = {
      operand("h.0.attn.c_attn.input", 1e-4, 0.0),        // at the threshold: stays
      operand("h.1.attn.c_proj.weight", 0.0, 0.02),       // underflow above 0.01
      operand("h.1.mlp.c_fc.grad_output", 0.5, 0.0),      // block 1 already has its reason
      operand("h.12.mlp.c_proj.input", 2e-4, 0.5),        // saturation is checked first
      operand("lm_head.grad_output", 1.0, 1.0),           // not a block
  };
  const std::vector<BlockSwitch> switches = blocks_to_switch(statistics, {.saturation = 1e-4, .underflow = 0.01});
  REQUIRE(switches.size() == 2);
  CHECK(switches[0].block == 1);
  CHECK(switches[0].operand == "h.1.attn.c_proj.weight");
  CHECK(switches[0].measure == "underflow");
  CHECK(describe_block_switch(switches[0]) ==
        "block 1 -> BF16 GEMMs: h.1.attn.c_proj.weight underflow 2% > threshold 1%");
  CHECK(switches[1].block == 12);
  CHECK(switches[1].measure == "saturated");
  CHECK(switches[1].fraction == 2e-4);
  CHECK(blocks_to_switch(statistics, {.saturation = 1.0, .underflow = 1.0}).empty());
}

TEST_CASE("auto precision with thresholds of 1 changes no number and switches nothing", "[auto-precision][cpu]") {
  const TempDir dir;
  REQUIRE(run(kRun + "--metrics-file " + dir.file("off.jsonl")).exit_code == 0);
  const auto on = run(kRun + "--log-level info --fp8-auto-precision --fp8-auto-precision-saturation 1 "
                             "--fp8-auto-precision-underflow 1 --fp8-auto-precision-steps 5 --metrics-file " +
                      dir.file("on.jsonl"));
  REQUIRE(on.exit_code == 0);
  CHECK_THAT(on.output, ContainsSubstring("| fp8-auto-precision"));
  CHECK(on.output.find("-> BF16 GEMMs") == std::string::npos);
  REQUIRE(losses(dir.file("off.jsonl")).size() == 8);
  CHECK(losses(dir.file("on.jsonl")) == losses(dir.file("off.jsonl")));  // to the last bit
  CHECK(statistics_lines(dir.file("on.jsonl")) == 0);  // the calibration statistics are not reported
}

TEST_CASE("auto precision switches the blocks over its thresholds, logs why, and checkpoints the set",
          "[auto-precision][cpu]") {
  const TempDir dir;
  // Three blocks, block 0 BF16 by --bf16-blocks. The first step takes current scaling, which
  // clips nothing; the second casts with the first step's scales, and the first update (lr
  // 3e-3 on GPT-2's small initial weights) has grown some weights past them: elements of
  // blocks 1 and 2 are clipped, and a saturation threshold of 0 switches both at iteration 2.
  // The LM head stays FP8 (its operands are no block's).
  const auto result = run(kRun + "--num-layers 3 --bf16-blocks 0 --fp8-lm-head --log-level info "
                                 "--fp8-auto-precision --fp8-auto-precision-saturation 0 --fp8-auto-precision-steps 2 "
                                 "--save " + dir.file("ck") + " --metrics-file " + dir.file("m.jsonl"));
  REQUIRE(result.exit_code == 0);
  CHECK(result.output.find("iter      1 | fp8-auto-precision") == std::string::npos);
  CHECK_THAT(result.output, ContainsSubstring("iter      2 | fp8-auto-precision: block 1 -> BF16 GEMMs: h.1."));
  CHECK_THAT(result.output, ContainsSubstring("iter      2 | fp8-auto-precision: block 2 -> BF16 GEMMs: h.2."));
  CHECK_THAT(result.output, ContainsSubstring("saturated "));
  CHECK_THAT(result.output, ContainsSubstring("> threshold 0%"));
  CHECK(result.output.find("block 0 -> BF16") == std::string::npos);
  CHECK_THAT(result.output, ContainsSubstring("fp8-auto-precision: BF16 blocks now 0,1,2"));
  for (double loss : losses(dir.file("m.jsonl"))) CHECK(std::isfinite(loss));
  const std::string last = dir.file("ck/iter_0000008");
  CHECK(state_args(last)["bf16_blocks"] == nlohmann::json::array({0, 1, 2}));
  for (const std::string& name : scaling_names(last)) CHECK(name.rfind("lm_head.", 0) == 0);
  CHECK(scaling_names(last).size() == 3);
}

TEST_CASE("a run checkpointed right after a switch resumes bit-exactly; eval reproduces its logged loss",
          "[auto-precision][cpu][checkpoint]") {
  const TempDir dir;
  // A validation shard for the evaluations.
  std::vector<std::filesystem::path> written;
  ShardWriter writer(dir.path(), "val", 1 << 20, written);
  std::vector<uint16_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t((i * 7919 + i / 5) % 256);
  writer.append(tokens.data(), tokens.size());
  writer.finish();
  const std::string valid = writer.final_path(0).string();

  // No calibration window: the decision is at the statistics report of iteration 3, with a
  // long max window so that the kept LM-head states carry real history across the switch.
  const std::string args = kRun + "--fp8-lm-head --fp8-amax-history-len 4 --fp8-amax-compute-algo max "
                                  "--fp8-auto-precision --fp8-auto-precision-saturation 0 --fp8-auto-precision-steps 0 "
                                  "--fp8-stats-interval 3 --valid-data-path " + valid +
                           " --eval-interval 3 --eval-iters 2 --log-level info ";
  const auto straight = run(args + "--save " + dir.file("straight") + " --metrics-file " + dir.file("straight.jsonl"));
  REQUIRE(straight.exit_code == 0);
  CHECK_THAT(straight.output, ContainsSubstring("iter      3 | fp8-auto-precision: block "));
  CHECK(straight.output.find("iter      1 | fp8-auto-precision") == std::string::npos);
  const nlohmann::json switched = state_args(dir.file("straight/iter_0000008"))["bf16_blocks"];
  CHECK(!switched.empty());

  const auto first = run(args + "--exit-interval 3 --save " + dir.file("split") + " --metrics-file " +
                         dir.file("split.jsonl"));
  REQUIRE(first.exit_code == 0);
  CHECK(state_args(dir.file("split/iter_0000003"))["bf16_blocks"] == switched);
  const auto resumed = run(args + "--load " + dir.file("split") + " --save " + dir.file("split") +
                           " --metrics-file " + dir.file("split.jsonl"));
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("--bf16-blocks not given: resuming with the checkpoint's BF16 blocks"));
  const auto a = losses(dir.file("straight.jsonl")), b = losses(dir.file("split.jsonl"));
  REQUIRE(a.size() == 8);
  CHECK(a == b);  // to the last bit
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "fp8_scaling.safetensors"})
    CHECK(file_bytes(dir.file("straight/iter_0000008/") + file) == file_bytes(dir.file("split/iter_0000008/") + file));

  // The validation loss logged at iteration 3 (after the switch) and 6, from the checkpoints.
  std::vector<double> logged;
  std::ifstream metrics(dir.file("straight.jsonl"));
  for (std::string line; std::getline(metrics, line);) {
    const auto json = nlohmann::json::parse(line);
    if (json.contains("val_loss")) logged.push_back(json["val_loss"].get<double>());
  }
  REQUIRE(logged.size() >= 2);
  const auto eval = run("eval --load " + dir.file("split") + " --ckpt-step 3 --valid-data-path " + valid +
                        " --device cpu --log-level warn");
  REQUIRE(eval.exit_code == 0);
  std::istringstream lines(eval.output);
  double evaluated = -1.0;
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("{\"", 0) == 0 && nlohmann::json::parse(line).contains("loss"))
      evaluated = nlohmann::json::parse(line)["loss"].get<double>();
  CHECK(evaluated == logged[0]);
}

TEST_CASE("auto precision: --fp8-auto-precision and --bf16-blocks are validated before any work", "[auto-precision][cli]") {
  struct Case {
    std::string flags, expected;
  };
  const std::vector<Case> cases = {
      {"--bf16 --fp8-auto-precision", "--fp8-auto-precision needs --fp8-format"},
      {"--fp8-hybrid --fp8-auto-precision --fp8-auto-precision-saturation 2",
       "--fp8-auto-precision-saturation must be a finite number in [0, 1] (got 2)"},
      {"--fp8-hybrid --fp8-auto-precision --fp8-auto-precision-underflow nan",
       "--fp8-auto-precision-underflow must be a finite number in [0, 1]"},
      {"--fp8-hybrid --fp8-auto-precision --fp8-auto-precision-steps -1",
       "--fp8-auto-precision-steps must be >= 0 (got -1)"},
      {"--fp8-hybrid --fp8-auto-precision-underflow 0.1", "--fp8-auto-precision-underflow needs --fp8-auto-precision"},
      {"--fp8-hybrid --bf16-blocks 0,x", "--bf16-blocks takes block numbers separated by commas"},
      {"--fp8-hybrid --bf16-blocks -1", "--bf16-blocks takes block numbers"},
      {"--bf16 --bf16-blocks 0", "--bf16-blocks needs --fp8-format"},
      {"--fp8-hybrid --bf16-blocks 0,2", "--bf16-blocks names block 2 but the model has 2 blocks"},
  };
  for (const Case& c : cases) {
    const auto result = testing::run_fp8lm("--config " + testing::source_path("configs/tiny.json") +
                                           " --mock-data --device cpu --train-iters 1 " + c.flags);
    INFO(c.flags << "\n" << result.output);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.output, ContainsSubstring(c.expected));
    CHECK_THAT(result.output, ContainsSubstring("HINT"));
  }
}
