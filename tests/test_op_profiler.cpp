// --profile-ops: every op of a step is timed in its class, with FLOPs and bytes counted
// from the operands, and the binary reports the profile of the timed steps.
#include <cmath>
#include <map>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "layers/op_profiler.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

const std::string kTiny = testing::source_path("configs/tiny.json");

// The JSON line of `output` that begins with `start` (the binary prints one per report).
nlohmann::json json_line(const std::string& output, const std::string& start) {
  const size_t at = output.find(start);
  REQUIRE(at != std::string::npos);
  return nlohmann::json::parse(output.substr(at, output.find('\n', at) - at));
}

std::map<std::string, OpClassProfile> by_class(const OpProfiler& profiler) {
  std::map<std::string, OpClassProfile> rows;
  for (const OpClassProfile& row : profiler.totals()) rows[row.op_class] = row;
  return rows;
}

}  // namespace

TEST_CASE("the op profiler times every op class of a step and counts its FLOPs", "[profile]") {
  const int B = 4, T = 32;
  const RunSetup setup = resolve_run_setup(
      parse_train_command_line({"--config", kTiny, "--mock-data", "--device", "cpu", "--fp8-hybrid", "--benchmark",
                                "--profile-ops", "--micro-batch-size", std::to_string(B), "--seq-length",
                                std::to_string(T)})
          .options);
  const auto engine = make_engine(setup);
  OpProfiler* profiler = engine->op_profiler();
  REQUIRE(profiler != nullptr);
  std::vector<int32_t> tokens(size_t(B) * T);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 7 % 200);
  AdamWHyperparams hyperparams;
  hyperparams.lr = 1e-3f;
  const int steps = 3;
  for (int step = 0; step < steps; ++step) {
    engine->begin_step(step);
    engine->forward_backward(tokens.data(), tokens.data());
    engine->end_step(hyperparams, 1.0, step);
    engine->step_metrics();
    profiler->finish_step();
    if (step == 0) profiler->reset();  // the warm-up step leaves no trace
  }
  CHECK(profiler->steps() == steps - 1);
  const auto rows = by_class(*profiler);
  const GptConfig& m = setup.model;
  const double L = m.n_layer, C = m.n_embd, F = m.n_inner, BT = double(B) * T;
  const double per_step = profiler->steps();

  // The block GEMMs run in FP8, the tied LM head in BF16: 4 Linears a block, one each pass.
  for (const char* pass : {"forward", "dgrad", "wgrad"}) {
    INFO(pass);
    const OpClassProfile& fp8 = rows.at(std::string("gemm fp8 ") + pass);
    CHECK(fp8.calls == 4 * L * per_step);
    // c_attn 3C x C, c_proj C x C, c_fc F x C, mlp.c_proj C x F: 2 FLOPs per multiply-add.
    CHECK(fp8.flops == 2.0 * BT * (3 * C * C + C * C + F * C + C * F) * L * per_step);
    CHECK(fp8.ms > 0.0);
    const OpClassProfile& bf16 = rows.at(std::string("gemm bf16 ") + pass);
    CHECK(bf16.calls == per_step);
    CHECK(bf16.flops == 2.0 * BT * double(m.padded_vocab_size()) * C * per_step);
  }
  // Causal attention: Q K^T and P V over half the scores; the backward counts 2.5 times that.
  const double attention_flops = 2.0 * 2.0 * B * double(T) * T * C / 2.0 * L;
  CHECK(rows.at("attention forward").flops == attention_flops * per_step);
  CHECK(rows.at("attention backward").flops == 2.5 * attention_flops * per_step);
  CHECK(rows.at("attention forward").calls == L * per_step);
  // Every class the step runs is there, and each moved bytes.
  for (const char* op_class : {"layernorm forward", "layernorm backward", "gelu backward", "cast", "embedding", "loss",
                               "optimizer", "scaling"}) {
    INFO(op_class);
    REQUIRE(rows.count(op_class) == 1);
    CHECK(rows.at(op_class).calls > 0);
  }
  CHECK(rows.count("gelu forward") == 0);  // the GELU is c_fc's GEMM epilogue (a "gemm fp8 forward")
  CHECK(rows.at("optimizer").bytes > 0);
  CHECK(rows.at("layernorm forward").calls == (2 * L + 1) * per_step);
}

TEST_CASE("the floor of an op class is its FLOPs at the ceiling or its bytes at the bandwidth", "[profile]") {
  const OpFloorModel model{.fp8_gemm_flops_per_s = 1000e12,
                           .bf16_gemm_flops_per_s = 500e12,
                           .attention_flops_per_s = 400e12,
                           .bytes_per_s = 2e12,
                           .source = "test"};
  // 1e12 FLOPs at 1000 TFLOP/s: 1 ms; 1e9 bytes at 2 TB/s: 0.5 ms.
  CHECK(std::fabs(model.floor_ms({.op_class = "gemm fp8 forward", .flops = 1e12, .bytes = 1e9}) - 1.0) < 1e-12);
  CHECK(std::fabs(model.floor_ms({.op_class = "gemm bf16 wgrad", .flops = 1e12, .bytes = 1e9}) - 2.0) < 1e-12);
  CHECK(std::fabs(model.floor_ms({.op_class = "attention backward", .flops = 4e11}) - 1.0) < 1e-12);
  // Memory-bound classes: bytes only.
  CHECK(std::fabs(model.floor_ms({.op_class = "layernorm forward", .bytes = 6e9}) - 3.0) < 1e-12);
}

TEST_CASE("the binary reports the op profile of the timed steps", "[profile][cli]") {
  const auto run = testing::run_fp8lm("--config " + kTiny +
                                      " --mock-data --device cpu --train-iters 4 --benchmark --benchmark-warmup 2 "
                                      "--profile-ops --eval-interval 0 --eval-iters 0 --fp8-hybrid");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("op profile per step (2 timed)"));
  const auto line = json_line(run.output, "{\"floor_ms\"");
  CHECK(line["steps"] == 2);
  CHECK(line["op_profile"].size() >= 10);
  CHECK(double(line["ops_ms"]) > 0.0);

  const auto refused = testing::run_fp8lm("--config " + kTiny + " --mock-data --device cpu --profile-ops");
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, ContainsSubstring("--profile-ops needs --benchmark"));
}

TEST_CASE("fp8lm sample profiles its decode steps", "[profile][cli]") {
  const auto run = testing::run_fp8lm("sample --config " + kTiny +
                                      " --random-weights --random-prompt 8 --max-new-tokens 4 --temperature 0 "
                                      "--ignore-eos --device cpu --quiet --profile-ops");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("op profile per decode step (4 timed)"));
  const auto line = json_line(run.output, "{\"floor_ms\"");
  CHECK(line["step"] == "decode step");
  // A decode step: the blocks' GEMMs and attention over the cache, no backward, no prompt pass.
  std::map<std::string, double> calls;
  for (const auto& row : line["op_profile"]) calls[row["class"]] = row["calls"];
  CHECK(calls.count("attention decode") == 1);
  CHECK(calls.count("attention forward") == 0);
  CHECK(calls.count("layernorm backward") == 0);
}

TEST_CASE("the benchmark times the steps after warm-up as one window, or each step when profiling", "[profile][cli]") {
  auto benchmark_line = [](const std::string& output) { return json_line(output, "{\"B\":"); };
  const std::string run = "--config " + kTiny + " --mock-data --device cpu --train-iters 6 --benchmark "
                          "--benchmark-warmup 2 --eval-interval 0 --eval-iters 0";
  const auto window = testing::run_fp8lm(run);
  INFO(window.output);
  REQUIRE(window.exit_code == 0);
  const auto windowed = benchmark_line(window.output);
  CHECK(windowed["timing"] == "mean over the window");
  CHECK(double(windowed["step_ms"]) > 0.0);
  CHECK_THAT(window.output, ContainsSubstring("4 (mean over the window)"));
  // The optimizer's memory: E4M3 m (1 byte) and FP16 v (2) per parameter and the slab's
  // alignment padding (in FP32 the working copy is the master, counted with the model).
  const double optimizer_bytes = double(windowed["optimizer_gib"]) * 1073741824.0;
  CHECK(optimizer_bytes >= 3.0 * double(windowed["params"]));
  CHECK(optimizer_bytes <= 4.0 * double(windowed["params"]));

  const auto profiled = testing::run_fp8lm(run + " --profile-ops");
  REQUIRE(profiled.exit_code == 0);
  CHECK(benchmark_line(profiled.output)["timing"] == "median of synchronised steps");
  CHECK_THAT(profiled.output, ContainsSubstring("4 (median of synchronised steps)"));
}
