// scripts/bench_node_report.py: the node table (data-parallel efficiency against the same
// model's one-GPU row, optimizer memory, traffic) and the loss rows against the 2e-3
// tolerance, on hand-made benchmark lines and loss curves; a failed loss row exits 1.
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "cli_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

const std::string kScript = testing::source_path("scripts/bench_node_report.py");

std::string bench_line(const char* tag, int ranks, int tp, int dp, double step_ms, double optimizer_gib,
                       const std::string& peer = "fp8lm-fp8-hybrid") {
  return std::string("{\"tag\":\"") + tag + "\",\"peer\":\"" + peer + "\",\"ranks\":" + std::to_string(ranks) +
         ",\"model\":\"gpt2-1558m\",\"tp\":" +
         std::to_string(tp) + ",\"dp\":" + std::to_string(dp) + ",\"step_ms\":" + std::to_string(step_ms) +
         ",\"tok_s_per_gpu\":1000.0,\"tflops\":" + std::to_string(500.0 * ranks) + ",\"peak_gib\":30.0,\"optimizer_gib\":" +
         std::to_string(optimizer_gib) + ",\"bytes_per_step\":{\"dp_overlapped\":4673088000.0,\"world\":6952.0}}\n";
}

// A metrics file: the losses, each step with gradient norm 2 (first_norm at the first step).
void write_losses(const std::string& path, const std::vector<double>& losses, double first_norm = 2.0) {
  std::ofstream file(path);
  for (size_t i = 0; i < losses.size(); ++i)
    file << "{\"iter\":" << i + 1 << ",\"loss\":" << losses[i] << ",\"grad_norm\":" << (i == 0 ? first_norm : 2.0)
         << ",\"lr\":0.0001}\n";
}

}  // namespace

TEST_CASE("bench_node_report.py: the node table and the loss rows against the tolerance", "[scripts]") {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) SKIP("python3 is not installed");
  testing::TempDir dir;
  std::ofstream(dir.file("bench.jsonl")) << bench_line("dp1", 1, 1, 1, 150.0, 10.0) << bench_line("dp4", 4, 1, 4, 160.0, 2.5)
                                         << "not a benchmark line\n";
  const std::vector<double> one_gpu = {10.0, 9.0, 8.0, 7.0};
  write_losses(dir.file("loss-dp1.jsonl"), one_gpu);
  write_losses(dir.file("loss-tp4.jsonl"), {10.0, 9.0, 8.001, 7.0});      // 1.25e-4: ok
  write_losses(dir.file("loss-tp2dp2.jsonl"), {10.0, 9.0, 8.0, 7.0});      // identical
  write_losses(dir.file("loss-dp1-mb2.jsonl"), {10.0, 9.0, 8.0, 7.014});   // the noise floor, 2e-3: not judged
  write_losses(dir.file("resume-first.jsonl"), {10.0, 9.0});               // saved after 2 steps
  write_losses(dir.file("resume-tp4.jsonl"), {8.0, 7.007});                // 1e-3 from loss-tp2dp2's steps 3-4

  const std::string run = kScript + " " + dir.file("bench.jsonl") + " " + dir.file("");
  auto result = testing::run_command(run);
  INFO(result.output);
  CHECK(result.exit_code == 0);
  CHECK_THAT(result.output, ContainsSubstring("| dp4 | gpt2-1558m | 4 | 1 x 4 | 160.00 ms | 1,000 | 500 | 93.8% | "
                                              "30.00 GiB | 2.50 GiB | dp_overlapped 4.673 GB |"));
  CHECK_THAT(result.output, ContainsSubstring("noise floor: one GPU at micro-batch 2 (the same batches, summed in another "
                                              "order): 4/4 steps, largest relative loss gap 2.00e-03"));
  CHECK_THAT(result.output, ContainsSubstring("ok loss-tp4: 4/4 steps, largest relative loss gap to one GPU 1.25e-04, "
                                              "first gradient norm's 0.0e+00"));
  CHECK_THAT(result.output, ContainsSubstring("ok loss-tp2dp2: 4/4 steps, largest relative loss gap to one GPU 0.00e+00"));
  CHECK_THAT(result.output, ContainsSubstring("ok saved at TP=2 x DP=2 (step 2), resumed at TP=4: 2 steps, largest "
                                              "relative gap to the uninterrupted TP=2 x DP=2 run 1.00e-03"));

  // A gap over the tolerance, a run cut short, or a first gradient norm off by the
  // data-parallel size (the same losses: clipping and AdamW hide a constant factor) fails the report.
  write_losses(dir.file("loss-tp4-sp.jsonl"), {10.0, 9.03, 8.0, 7.0});  // 3.3e-3
  write_losses(dir.file("loss-tp2dp2-sp.jsonl"), {10.0, 9.0, 8.0});     // 3 of 4 steps
  result = testing::run_command(run);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.output, ContainsSubstring("FAIL loss-tp4-sp: 4/4 steps, largest relative loss gap to one GPU 3.33e-03"));
  CHECK_THAT(result.output, ContainsSubstring("FAIL loss-tp2dp2-sp: 3/4 steps"));
  write_losses(dir.file("loss-tp4-sp.jsonl"), one_gpu);
  write_losses(dir.file("loss-tp2dp2-sp.jsonl"), one_gpu, 4.0);
  result = testing::run_command(run);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.output, ContainsSubstring("ok loss-tp4-sp: 4/4 steps"));
  CHECK_THAT(result.output, ContainsSubstring("FAIL loss-tp2dp2-sp: 4/4 steps, largest relative loss gap to one GPU "
                                              "0.00e+00, first gradient norm's 1.0e+00"));
}

// Data-parallel efficiency is against one GPU of the same model and precision: a BF16 row is not
// measured against the FP8 GPU's step.
TEST_CASE("bench_node_report.py: each precision's efficiency against its own one-GPU row", "[scripts]") {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) SKIP("python3 is not installed");
  testing::TempDir dir;
  std::ofstream(dir.file("bench.jsonl")) << bench_line("dp1", 1, 1, 1, 150.0, 10.0)
                                         << bench_line("dp1-bf16-training", 1, 1, 1, 200.0, 10.0, "fp8lm-bf16")
                                         << bench_line("dp4-fp32", 4, 1, 4, 160.0, 2.5)
                                         << bench_line("dp4-bf16-training", 4, 1, 4, 250.0, 2.5, "fp8lm-bf16");
  const auto result = testing::run_command(kScript + " " + dir.file("bench.jsonl") + " " + dir.file(""));
  INFO(result.output);
  CHECK(result.exit_code == 0);
  CHECK_THAT(result.output, ContainsSubstring("| dp4-fp32 | gpt2-1558m | 4 | 1 x 4 | 160.00 ms | 1,000 | 500 | 93.8% |"));
  CHECK_THAT(result.output,
             ContainsSubstring("| dp4-bf16-training | gpt2-1558m | 4 | 1 x 4 | 250.00 ms | 1,000 | 500 | 80.0% |"));
}

// scripts/bench_node.sh --dry-run: the gpt-6.7b rows at the anchors' global batch, by default and
// with GLOBAL_BATCH / MICRO_BATCH / STEPS / WARMUP set (the commands only: no GPU is needed).
TEST_CASE("bench_node.sh: the gpt-6.7b rows at a global batch, as the anchors are measured", "[scripts]") {
  const std::string script = testing::source_path("scripts/bench_node.sh");
  auto result = testing::run_command("bash " + script + " 4 --6.7b-only --dry-run");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  // Every layout at micro-batch 1 with one micro-batch a rank, then DP = 4 over 128 sequences.
  CHECK_THAT(result.output, ContainsSubstring("6.7b-tp2-dp2-fp8: "));
  CHECK_THAT(result.output, ContainsSubstring("--micro-batch-size 1 --train-iters 16 --benchmark-warmup 6"));
  CHECK_THAT(result.output, ContainsSubstring("6.7b-tp1-dp4-fp8-gbs128-mb2: "));
  CHECK_THAT(result.output, ContainsSubstring("6.7b-tp1-dp4-bf16-gbs128-mb2: "));
  CHECK_THAT(result.output, ContainsSubstring("-np 4 build-gpu/fp8lm --config configs/gpt-6.7b.json --mock-data --benchmark "
                                              "--micro-batch-size 2 --train-iters 6 --benchmark-warmup 2"));
  CHECK_THAT(result.output, ContainsSubstring("--global-batch-size 128 --fp8-hybrid --overlap-grad-reduce"));

  // GLOBAL_BATCH puts every gpt-6.7b row on that batch (and replaces the anchor rows); ROWS picks.
  result = testing::run_command("GLOBAL_BATCH=64 MICRO_BATCH=1 STEPS=5 WARMUP=1 ROWS='tp2-dp2-fp8-gbs' bash " + script +
                                " 4 --6.7b-only --dry-run");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, ContainsSubstring("6.7b-tp2-dp2-fp8-gbs64-mb1: "));
  CHECK_THAT(result.output, ContainsSubstring("--micro-batch-size 1 --train-iters 5 --benchmark-warmup 1"));
  CHECK_THAT(result.output, ContainsSubstring("--tensor-model-parallel-size 2 --fp8-hybrid --global-batch-size 64"));
  CHECK_THAT(result.output, !ContainsSubstring("gbs128"));
  CHECK_THAT(result.output, !ContainsSubstring("6.7b-tp4"));
}
