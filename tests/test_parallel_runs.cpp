// fp8lm under mpirun on the CPU backend (MPI over host memory): every parallel layout trains
// the tiny model to the one-process run's losses, checkpoints move between layouts, and bad
// parallel input fails before any work. CI runs 2 and 4 ranks oversubscribed on 2 cores, one
// OpenMP thread per rank.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "cli_testing.h"
#include "apps/checkpointing.h"
#include "core/choice_eval.h"
#include "core/mock_data.h"
#include "temp_dir.h"
#include "train_flags_testing.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

// The tiny model, 12 steps, 4 sequences of 32 tokens per step, one per micro-batch: every
// layout sees the same micro-batches and differs only in how work and sums are split.
std::string base_args(const std::string& extra = "") {
  return "--config " + testing::source_path("configs/tiny.json") +
         " --mock-data --device cpu --seq-length 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 12"
         " --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-interval 0 --eval-iters 0 --log-level warn " +
         extra;
}

testing::CommandResult run_ranks(int ranks, const std::string& arguments) {
  return testing::run_command(std::string(FP8LM_MPIEXEC) + " -np " + std::to_string(ranks) +
                              " --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=PASSIVE " +
                              FP8LM_BINARY + " " + arguments);
}

std::vector<double> losses(const std::string& metrics_file) { return testing::metrics_losses(metrics_file); }

double largest_relative_gap(const std::vector<double>& a, const std::vector<double>& b) {
  double gap = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) gap = std::max(gap, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
  return gap;
}

}  // namespace

TEST_CASE("every parallel layout matches the one-process run's losses within 2e-3", "[parallel][cpu]") {
  const testing::TempDir dir;
  for (const char* precision : {"--fp8-hybrid", "--bf16"}) {
    const std::string single = dir.file(std::string("single") + precision + ".jsonl");
    REQUIRE(testing::run_fp8lm(base_args(precision) + " --metrics-file " + single).exit_code == 0);
    const std::vector<double> fp32_reference = losses(single);
    REQUIRE(fp32_reference.size() == 12);
    const std::vector<double> reference_norms = testing::metrics_field(single, "grad_norm");
    // --grad-reduce-in-bf16 makes the gradient slab BF16 at any DP size (Megatron's BF16
    // main_grad): its layouts match the one-process run with the same flag.
    const std::string single_bf16 = dir.file(std::string("single-bf16-gradients") + precision + ".jsonl");
    REQUIRE(testing::run_fp8lm(base_args(std::string(precision) + " --grad-reduce-in-bf16") + " --metrics-file " +
                               single_bf16)
                .exit_code == 0);
    const std::vector<double> bf16_reference = losses(single_bf16);
    REQUIRE(bf16_reference.size() == 12);
    struct Layout {
      int ranks;
      const char* flags;
    };
    std::vector<Layout> layouts = {{2, "--tensor-model-parallel-size 2"},
                                   {2, ""},  // DP=2, the distributed optimizer
                                   {4, "--tensor-model-parallel-size 2"},
                                   {2, "--tensor-model-parallel-size 2 --sequence-parallel"},
                                   {2, "--grad-reduce-in-bf16"},
                                   {2, "--no-use-distributed-optimizer"},
                                   {2, "--grad-reduce-in-bf16 --overlap-grad-reduce --overlap-param-gather"},
                                   {2, "--no-use-distributed-optimizer --grad-reduce-in-bf16 --overlap-grad-reduce"},
                                   {2, "--tensor-model-parallel-size 2 --sequence-parallel --grad-reduce-in-bf16"},
                                   {4, "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce "
                                       "--overlap-param-gather"}};
    // Overlapped FP8 gradients reduce bucket by bucket during the backward: the same numbers as
    // the reduction at the end of the step, bit for bit (the run they must equal: same_as).
    std::map<size_t, size_t> same_as;
    // Activation recomputation reruns each block's forward (or its LayerNorms and MLP input
    // side), collectives included, before its backward: the same numbers as layout 3 (TP = 2
    // with sequence parallelism), bit for bit.
    layouts.push_back({2, "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full "
                          "--recompute-method uniform --recompute-num-layers 2"});
    same_as[layouts.size() - 1] = 3;
    layouts.push_back({2, "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity selective "
                          "--recompute-modules layernorm mlp"});
    same_as[layouts.size() - 1] = 3;
    if (std::string(precision) == "--fp8-hybrid") {
      layouts.push_back({2, "--fp8-grad-comm"});
      layouts.push_back({2, "--fp8-grad-comm --fp8-grad-reduce reduce-scatter"});
      layouts.push_back({2, "--fp8-param-gather"});
      layouts.push_back({2, "--fp8-param-gather --overlap-param-gather --overlap-grad-reduce"});
      layouts.push_back({4, "--tensor-model-parallel-size 2 --sequence-parallel --fp8-grad-comm --fp8-param-gather"});
      layouts.push_back({2, "--fp8-grad-comm --overlap-grad-reduce"});
      same_as[layouts.size() - 1] = layouts.size() - 6;
      layouts.push_back({2, "--fp8-grad-comm --fp8-grad-reduce reduce-scatter --overlap-grad-reduce"});
      same_as[layouts.size() - 1] = layouts.size() - 6;
      layouts.push_back({4, "--tensor-model-parallel-size 2 --sequence-parallel --fp8-grad-comm --fp8-param-gather "
                            "--overlap-grad-reduce --overlap-param-gather"});
      same_as[layouts.size() - 1] = layouts.size() - 4;
    }
    std::vector<std::vector<double>> layout_losses;
    for (const Layout& layout : layouts) {
      const std::string metrics = dir.file("run" + std::to_string(&layout - layouts.data()) + precision + ".jsonl");
      const auto run = run_ranks(layout.ranks, base_args(std::string(precision) + " " + layout.flags) +
                                                   " --metrics-file " + metrics);
      INFO(precision << ", " << layout.ranks << " ranks " << layout.flags << "\n" << run.output);
      REQUIRE(run.exit_code == 0);
      const std::vector<double> parallel = losses(metrics);
      REQUIRE(parallel.size() == 12);
      const std::vector<double>& reference =
          std::string(layout.flags).find("--grad-reduce-in-bf16") != std::string::npos ? bf16_reference
                                                                                         : fp32_reference;
      // The same initial weights and batch: only the order of the partial sums differs.
      CHECK(std::fabs(parallel[0] - reference[0]) < 1e-5 * reference[0]);
      CHECK(largest_relative_gap(parallel, reference) < 2e-3);
      // The gradient norm is the global batch's: not multiplied by the data-parallel size
      // (a sum of the ranks' gradients instead of their mean) nor counted once per
      // data-parallel rank without the distributed optimizer. Clipping hides both from the
      // losses, since AdamW does not see a constant factor; the first step's norm shows them.
      const std::vector<double> norms = testing::metrics_field(metrics, "grad_norm");
      REQUIRE(norms.size() == 12);
      CHECK(std::fabs(norms[0] - reference_norms[0]) < 2e-2 * reference_norms[0]);
      const size_t index = layout_losses.size();
      if (same_as.count(index)) CHECK(parallel == layout_losses[same_as[index]]);
      layout_losses.push_back(parallel);
    }
  }
}

TEST_CASE("BF16 gradients (--grad-reduce-in-bf16) on one process: the BF16 gradient slab trains as the FP32 one does",
          "[parallel][cpu][bf16-gradients]") {
  // The tiny model over 16 steps, FP8 hybrid and BF16 GEMMs: each gradient is rounded to BF16
  // as every op adds to it (the wgrad GEMMs, the bias, LayerNorm and embedding sums), the norm
  // and AdamW read the rounded values. Stated tolerance: every step's loss within 2e-3 of the
  // FP32-gradient run's (measured on the dev machine: 3.6e-4 FP8 hybrid, 5.3e-5 BF16), and the
  // loss falls (5.55 to 4.95 over the 16 steps, as in FP32).
  const testing::TempDir dir;
  const std::string args = "--config " + testing::source_path("configs/tiny.json") +
                           " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4"
                           " --train-iters 16 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-interval 0"
                           " --eval-iters 0 --log-level warn";
  for (const char* precision : {"--fp8-hybrid", "--bf16"}) {
    INFO(precision);
    const std::string fp32 = dir.file(std::string("fp32-gradients") + precision + ".jsonl");
    const std::string bf16 = dir.file(std::string("bf16-gradients") + precision + ".jsonl");
    REQUIRE(testing::run_fp8lm(args + " " + precision + " --metrics-file " + fp32).exit_code == 0);
    REQUIRE(testing::run_fp8lm(args + " " + precision + " --grad-reduce-in-bf16 --metrics-file " + bf16).exit_code == 0);
    const std::vector<double> reference = losses(fp32), rounded = losses(bf16);
    REQUIRE(rounded.size() == 16);
    REQUIRE(reference.size() == 16);
    // Step 1's loss comes before any update: identical.
    CHECK(rounded[0] == reference[0]);
    const double gap = largest_relative_gap(rounded, reference);
    INFO("largest relative gap " << gap);
    CHECK(gap > 0.0);  // the gradients were rounded
    CHECK(gap < 2e-3);
    CHECK(rounded.back() < 0.95 * rounded.front());
  }
}

TEST_CASE("blockwise under mpirun: tensor and data parallel runs match the one-process run",
          "[parallel][cpu][blockwise]") {
  // tiny-128 widened to n_embd 256 so that each tensor-parallel rank's widths stay multiples of
  // 128 (a rank's 128x128 weight blocks are then blocks of the whole weight, and its 1x128
  // tiles tiles of the whole activation); 2 x 64 tokens per micro-batch (whole tiles for wgrad).
  const testing::TempDir dir;
  const std::string args = "--config " + testing::source_path("configs/tiny-128.json") +
                           " --hidden-size 256 --num-attention-heads 4 --mock-data --device cpu --seq-length 64 "
                           "--micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 3e-3 --lr-warmup-iters 2 "
                           "--log-interval 1 --eval-interval 0 --eval-iters 0 --log-level warn --fp8-hybrid "
                           "--fp8-recipe blockwise --fp8-lm-head";
  REQUIRE(testing::run_fp8lm(args + " --metrics-file " + dir.file("single.jsonl")).exit_code == 0);
  const std::vector<double> reference = losses(dir.file("single.jsonl"));
  REQUIRE(reference.size() == 6);
  int run_index = 0;
  for (const char* flags : {"--tensor-model-parallel-size 2", "", "--fp8-grad-comm"}) {
    const std::string metrics = dir.file("run" + std::to_string(run_index++) + ".jsonl");
    const auto run = run_ranks(2, args + " " + flags + " --metrics-file " + metrics);
    INFO("2 ranks " << flags << "\n" << run.output);
    REQUIRE(run.exit_code == 0);
    const std::vector<double> parallel = losses(metrics);
    REQUIRE(parallel.size() == 6);
    CHECK(std::fabs(parallel[0] - reference[0]) < 1e-5 * reference[0]);
    // --fp8-grad-comm rounds the gradients to E5M2 on the way, whatever the GEMM recipe: on
    // this model its gap is 7.1e-3 under blockwise, 9.8e-3 under the delayed recipe (measured
    // on the dev machine), so its bound is 2e-2; the other layouts only reorder sums.
    CHECK(largest_relative_gap(parallel, reference) < (std::string(flags) == "--fp8-grad-comm" ? 2e-2 : 2e-3));
  }
  // n_embd 144 at tensor-parallel size 2 leaves 72 columns per rank, not a multiple of 16: refused.
  const auto refused = run_ranks(2, "--config " + testing::source_path("configs/tiny-128.json") +
                                        " --hidden-size 144 --mock-data --device cpu --seq-length 64 "
                                        "--micro-batch-size 2 --fp8-hybrid --fp8-recipe blockwise "
                                        "--tensor-model-parallel-size 2");
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, ContainsSubstring("n_embd / tensor-parallel size 2 is 72"));
}

// The engine's allocations on rank 0 from its startup table ("engine allocations: measured /
// estimated ... 12.34 MiB / 12.40 MiB"), in MiB; -1 when absent.
double engine_allocations_mib(const std::string& output) {
  const std::string label = "engine allocations: measured / estimated";
  const size_t at = output.find(label);
  if (at == std::string::npos) return -1.0;
  const size_t number = output.find_first_of("0123456789", at + label.size());
  double value = 0.0;
  char unit[8] = {};
  if (number == std::string::npos || std::sscanf(output.c_str() + number, "%lf %7s", &value, unit) != 2) return -1.0;
  const std::string u = unit;
  return u == "KiB" ? value / 1024.0 : u == "MiB" ? value : u == "GiB" ? value * 1024.0 : -1.0;
}

TEST_CASE("per-rank memory falls with the data-parallel size: ZeRO-1 communicates in place", "[parallel][cpu][memory]") {
  // A model whose parameter slabs outweigh its activations, FP32 master and state (on the CPU
  // the one-rank master is the FP32 working copy itself, so FP32 state is what makes the
  // shard's saving show against one rank as it does on the GPU).
  const std::string args = "--config " + testing::source_path("configs/tiny.json") +
                           " --mock-data --device cpu --hidden-size 128 --num-attention-heads 4 --seq-length 32"
                           " --micro-batch-size 1 --global-batch-size 4 --train-iters 1 --eval-iters 0"
                           " --optimizer-state-precision fp32 ";
  for (const char* flavour : {"--fp32", "--bf16 --grad-reduce-in-bf16", "--fp8-hybrid --fp8-grad-comm --fp8-param-gather"}) {
    std::map<int, double> mib;
    for (int dp : {1, 2, 4}) {
      const std::string command = args + flavour;
      const auto run = dp == 1 ? testing::run_fp8lm(command) : run_ranks(dp, command);
      INFO(flavour << ", DP=" << dp << "\n" << run.output);
      REQUIRE(run.exit_code == 0);
      mib[dp] = engine_allocations_mib(run.output);
      REQUIRE(mib[dp] > 0.0);
    }
    INFO(flavour << ": " << mib[1] << " MiB at DP=1, " << mib[2] << " at DP=2, " << mib[4] << " at DP=4");
    CHECK(mib[2] < mib[1]);
    CHECK(mib[4] < mib[2]);
  }
}

TEST_CASE("BF16 first and last layers under mpirun with --fp8-param-gather: their weights travel in the working dtype",
          "[parallel][cpu]") {
  // Block 1 is FP8 (its weights gathered as FP8 codes), blocks 0 and 2 BF16 (gathered as the
  // working copy): the run matches the one-process run as every layout does.
  const testing::TempDir dir;
  const std::string args = base_args("--fp8-hybrid --num-layers 3 --first-last-layers-bf16");
  REQUIRE(testing::run_fp8lm(args + " --metrics-file " + dir.file("single.jsonl")).exit_code == 0);
  const std::vector<double> reference = losses(dir.file("single.jsonl"));
  REQUIRE(reference.size() == 12);
  for (const char* flags : {"--fp8-param-gather", "--fp8-param-gather --overlap-param-gather --overlap-grad-reduce"}) {
    const auto run = run_ranks(2, args + " " + flags + " --metrics-file " + dir.file("gather.jsonl"));
    INFO(flags << "\n" << run.output);
    REQUIRE(run.exit_code == 0);
    const std::vector<double> parallel = losses(dir.file("gather.jsonl"));
    REQUIRE(parallel.size() == 12);
    CHECK(std::fabs(parallel[0] - reference[0]) < 1e-5 * reference[0]);
    CHECK(largest_relative_gap(parallel, reference) < 2e-3);
    std::filesystem::remove(dir.file("gather.jsonl"));
  }
}

TEST_CASE("a checkpoint saved at TP=2 x DP=2 resumes at TP=1, TP=4 and exactly at TP=2 x DP=2",
          "[parallel][cpu][checkpoint]") {
  const testing::TempDir dir;
  const std::string args = base_args("--fp8-hybrid --num-attention-heads 4");
  REQUIRE(run_ranks(4, args + " --tensor-model-parallel-size 2 --metrics-file " + dir.file("straight.jsonl")).exit_code ==
          0);
  const auto save = run_ranks(4, args + " --tensor-model-parallel-size 2 --exit-interval 6 --save " + dir.file("ck"));
  INFO(save.output);
  REQUIRE(save.exit_code == 0);
  const std::vector<double> straight = losses(dir.file("straight.jsonl"));
  REQUIRE(straight.size() == 12);
  const std::vector<double> continued(straight.begin() + 6, straight.end());

  // The same layout: bit-exact.
  REQUIRE(run_ranks(4, args + " --tensor-model-parallel-size 2 --load " + dir.file("ck") + " --metrics-file " +
                           dir.file("same.jsonl"))
              .exit_code == 0);
  CHECK(losses(dir.file("same.jsonl")) == continued);
  // Other layouts: the same curve, within the equivalence bound.
  const auto one = testing::run_fp8lm(args + " --load " + dir.file("ck") + " --metrics-file " + dir.file("one.jsonl"));
  INFO(one.output);
  REQUIRE(one.exit_code == 0);
  const auto four = run_ranks(4, args + " --tensor-model-parallel-size 4 --load " + dir.file("ck") + " --metrics-file " +
                                     dir.file("four.jsonl"));
  INFO(four.output);
  REQUIRE(four.exit_code == 0);
  for (const char* file : {"one.jsonl", "four.jsonl"}) {
    const std::vector<double> resumed = losses(dir.file(file));
    INFO(file);
    REQUIRE(resumed.size() == 6);
    CHECK(largest_relative_gap(resumed, continued) < 2e-3);
  }
}

// The FP8 statistics of a parallel run: one line per operand, written by rank 0 alone, with
// every rank's counts summed. Data parallelism: the ranks' micro-batches together are the
// one-process run's step, so the activations' and gradients' element counts match it, and
// each rank casts the whole (replicated) weight. Tensor parallelism: a tensor split across the
// ranks counts once, one replicated on them counts on each (the fractions stay).
TEST_CASE("FP8 statistics under mpirun: rank 0 writes each operand once, counts summed over the ranks",
          "[parallel][cpu][fp8-stats]") {
  const testing::TempDir dir;
  const std::string args = base_args("--fp8-hybrid --fp8-stats-interval 6");
  auto statistics = [](const std::string& path) {
    std::map<std::string, nlohmann::json> at_12;  // iteration 12's line per operand
    std::ifstream file(path);
    std::string line;
    size_t lines = 0;
    while (std::getline(file, line)) {
      const auto json = nlohmann::json::parse(line);
      if (!json.contains("fp8_stats")) continue;
      ++lines;
      if (json["iter"] == 12) {
        CHECK(at_12.count(json["fp8_stats"]) == 0);  // once, from one rank
        at_12[json["fp8_stats"]] = json;
      }
    }
    CHECK(lines == 2 * at_12.size());  // iterations 6 and 12
    return at_12;
  };
  REQUIRE(testing::run_fp8lm(args + " --metrics-file " + dir.file("one.jsonl")).exit_code == 0);
  const auto one = statistics(dir.file("one.jsonl"));
  REQUIRE(one.size() == 24);

  const auto dp = run_ranks(2, args + " --metrics-file " + dir.file("dp.jsonl"));
  INFO(dp.output);
  REQUIRE(dp.exit_code == 0);
  const auto dp_stats = statistics(dir.file("dp.jsonl"));
  REQUIRE(dp_stats.size() == one.size());
  for (const auto& [name, line] : one) {
    INFO(name);
    // Every data-parallel rank casts the whole weight (replicated): it counts per rank.
    const double ranks_holding = name.ends_with(".weight") ? 2.0 : 1.0;
    CHECK(dp_stats.at(name)["elements"].get<double>() == ranks_holding * line["elements"].get<double>());
  }
  // With and without statistics, the same losses under mpirun too.
  REQUIRE(run_ranks(2, base_args("--fp8-hybrid") + " --metrics-file " + dir.file("dp_off.jsonl")).exit_code == 0);
  CHECK(losses(dir.file("dp.jsonl")) == losses(dir.file("dp_off.jsonl")));

  const auto tp = run_ranks(2, args + " --tensor-model-parallel-size 2 --metrics-file " + dir.file("tp.jsonl"));
  INFO(tp.output);
  REQUIRE(tp.exit_code == 0);
  const auto tp_stats = statistics(dir.file("tp.jsonl"));
  REQUIRE(tp_stats.size() == one.size());
  for (const char* split : {"h.0.attn.c_attn.weight", "h.1.mlp.c_fc.weight", "h.0.attn.c_proj.input",
                            "h.1.mlp.c_proj.input", "h.0.mlp.c_fc.grad_output"})
    CHECK(tp_stats.at(split)["elements"] == one.at(split)["elements"]);
  for (const char* replicated : {"h.0.attn.c_attn.input", "h.1.mlp.c_fc.input"})
    CHECK(tp_stats.at(replicated)["elements"].get<double>() == 2 * one.at(replicated)["elements"].get<double>());
}

TEST_CASE("a batch-size ramp-up under mpirun: DP = 2 takes the one-process run's batches and losses",
          "[parallel][cpu]") {
  // 20 sequences, the batch ramping 2, 2, then 4 (--rampup-batch-size 2 2 4): with a
  // micro-batch of one, a DP = 2 step of 2 is one micro-batch a rank, of 4 two.
  const std::string args = "--config " + testing::source_path("configs/tiny.json") +
                           " --mock-data --device cpu --seq-length 32 --micro-batch-size 1 --global-batch-size 4"
                           " --train-samples 20 --rampup-batch-size 2 2 4 --lr 3e-3 --log-interval 1 --eval-interval 0"
                           " --eval-iters 0 --log-level warn --metrics-file ";
  const testing::TempDir dir;
  REQUIRE(testing::run_fp8lm(args + dir.file("one.jsonl")).exit_code == 0);
  const auto two = run_ranks(2, args + dir.file("two.jsonl"));
  INFO(two.output);
  REQUIRE(two.exit_code == 0);
  const std::vector<double> batches{2, 2, 4, 4, 4, 4};
  CHECK(testing::metrics_field(dir.file("one.jsonl"), "global_batch_size") == batches);
  CHECK(testing::metrics_field(dir.file("two.jsonl"), "global_batch_size") == batches);
  const std::vector<double> one_losses = losses(dir.file("one.jsonl")), two_losses = losses(dir.file("two.jsonl"));
  REQUIRE(one_losses.size() == 6);
  REQUIRE(two_losses.size() == 6);
  CHECK(largest_relative_gap(two_losses, one_losses) < 2e-3);
}

TEST_CASE("multiple choice (--hellaswag-path) under mpirun: DP = 2 and TP = 2 count the one-process evaluation's right answers",
          "[parallel][cpu][choice-eval]") {
  // 13 examples (an odd count: one data-parallel rank scores one more, the other a masked
  // batch beside it), two or three completions each, from a mock stream.
  const testing::TempDir dir;
  const std::vector<uint16_t> stream = make_mock_tokens(13 * 30, 256, 77);
  std::vector<ChoiceExample> examples;
  for (int e = 0; e < 13; ++e) {
    const auto first = stream.begin() + ptrdiff_t(e) * 30;
    ChoiceExample example{.index = e, .label = e % 2, .context = {first, first + 16}, .endings = {}};
    for (int k = 0; k < 2 + e % 2; ++k) {
      std::vector<int32_t> ending(first + 16, first + 22);
      if (k != example.label) ending[k % 6] = (ending[k % 6] + 1 + k) % 256;  // one token off
      example.endings.push_back(ending);
    }
    examples.push_back(example);
  }
  write_file_durably(dir.file("choices.bin"), choice_file_bytes(examples));
  REQUIRE(testing::run_fp8lm(base_args("--micro-batch-size 4 --global-batch-size 4 --save " + dir.file("ck")))
              .exit_code == 0);
  const std::string eval = "eval --load " + dir.file("ck") + " --hellaswag-path " + dir.file("choices.bin") +
                           " --device cpu --log-level warn";
  auto correct = [](const testing::CommandResult& run) {
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    const auto at = run.output.find("\"hellaswag_correct\":");
    REQUIRE(at != std::string::npos);
    return std::stoll(run.output.substr(at + 20));
  };
  const long long one = correct(testing::run_fp8lm(eval));
  CHECK(correct(run_ranks(2, eval)) == one);
  CHECK(correct(run_ranks(2, eval + " --tensor-model-parallel-size 2")) == one);
  CHECK(one > 0);
}

TEST_CASE("the replicas' weight check (--check-weight-hash-across-dp-replicas-interval) under mpirun: DP = 2 replicas checked every 4 iterations",
          "[parallel][cpu]") {
  const auto run = run_ranks(2, base_args("--check-weight-hash-across-dp-replicas-interval 4 --log-level info"));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  // Iterations 4, 8 and 12 of 12.
  size_t checks = 0;
  for (size_t at = run.output.find("weights identical on the 2 data-parallel replicas"); at != std::string::npos;
       at = run.output.find("weights identical on the 2 data-parallel replicas", at + 1))
    ++checks;
  CHECK(checks == 3);
  CHECK_THAT(testing::train_flags_error({"--mock-data", "--check-weight-hash-across-dp-replicas-interval", "-1"}),
             Catch::Matchers::ContainsSubstring("--check-weight-hash-across-dp-replicas-interval must be >= 0"));
}

TEST_CASE("bad parallel input fails before any work, naming the flag", "[parallel][cpu][cli]") {
  struct Case {
    int ranks;
    std::string flags, expected;
  };
  const std::vector<Case> cases = {
      {2, "--tensor-model-parallel-size 2 --num-attention-heads 3 --hidden-size 48",
       "--tensor-model-parallel-size 2 does not divide the 3 attention heads"},
      {3, "--tensor-model-parallel-size 3 --hidden-size 96 --num-attention-heads 3 --ffn-hidden-size 320",
       "does not divide the MLP width 320"},
      {4, "--tensor-model-parallel-size 3", "--tensor-model-parallel-size 3"},
      {2, "--tensor-model-parallel-size 2 --sequence-parallel --seq-length 33", "--sequence-parallel needs --seq-length"},
      {1, "--sequence-parallel", "--sequence-parallel needs --tensor-model-parallel-size above 1"},
      {1, "--tensor-model-parallel-size 2", "--tensor-model-parallel-size 2 does not divide the world size 1"},
      {2, "--fp8-param-gather", "--fp8-param-gather needs --fp8-format"},
      {2, "--fp8-hybrid --fp8-recipe tensorwise --fp8-param-gather", "--fp8-param-gather needs --fp8-recipe delayed"},
  };
  for (const Case& c : cases) {
    const auto run = c.ranks == 1 ? testing::run_fp8lm(base_args(c.flags)) : run_ranks(c.ranks, base_args(c.flags));
    INFO(c.ranks << " ranks: " << c.flags << "\n" << run.output);
    CHECK(run.exit_code == 2);
    CHECK_THAT(run.output, ContainsSubstring(c.expected));
    CHECK_THAT(run.output, !ContainsSubstring("iter "));  // no step ran
  }
}

TEST_CASE("auto precision under mpirun: every rank switches the same blocks, rank 0 logs them once",
          "[parallel][cpu][auto-precision]") {
  const testing::TempDir dir;
  // A saturation threshold of 0 switches blocks 1 and 2 after the second step, whose delayed
  // scales clip weights the first update grew, from counts summed over both ranks.
  const std::string args = base_args("--fp8-hybrid --num-layers 3 --bf16-blocks 0 --log-level info --fp8-auto-precision "
                                     "--fp8-auto-precision-saturation 0 --fp8-auto-precision-steps 2");
  const auto one = testing::run_fp8lm(args + " --metrics-file " + dir.file("one.jsonl"));
  REQUIRE(one.exit_code == 0);
  const auto dp = run_ranks(2, args + " --save " + dir.file("ck") + " --metrics-file " + dir.file("dp.jsonl"));
  INFO(dp.output);
  REQUIRE(dp.exit_code == 0);
  auto occurrences = [](const std::string& text, const std::string& what) {
    size_t count = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
    return count;
  };
  CHECK(occurrences(dp.output, "fp8-auto-precision: block 1 -> BF16 GEMMs") == 1);
  CHECK(occurrences(dp.output, "fp8-auto-precision: block 2 -> BF16 GEMMs") == 1);
  CHECK(occurrences(dp.output, "fp8-auto-precision: BF16 blocks now 0,1,2") == 1);
  const auto one_losses = losses(dir.file("one.jsonl")), dp_losses = losses(dir.file("dp.jsonl"));
  REQUIRE(dp_losses.size() == 12);
  CHECK(largest_relative_gap(dp_losses, one_losses) < 2e-3);
  std::ifstream state(dir.file("ck/iter_0000012/state.json"));
  CHECK(nlohmann::json::parse(state)["args"]["bf16_blocks"] == nlohmann::json::array({0, 1, 2}));
}

TEST_CASE("a Megatron script's flags under mpirun: TP = 2 with sequence parallelism, and every rank stops at the "
          "step --exit-duration-in-mins passes",
          "[parallel][cpu][megatron]") {
  const testing::TempDir dir;
  const std::string megatron =
      "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --use-mcore-models "
      "--attention-dropout 0 --hidden-dropout 0 --distributed-backend nccl --no-gradient-accumulation-fusion "
      "--lr-warmup-iters 0 --lr-warmup-fraction 0.25 --init-method-std 0.02 --fp8-format hybrid --log-level info ";
  const auto whole = run_ranks(4, base_args(megatron + "--metrics-file " + dir.file("whole.jsonl")));
  INFO(whole.output);
  REQUIRE(whole.exit_code == 0);
  const auto reference = testing::run_fp8lm(base_args("--fp8-hybrid --lr-warmup-iters 0 --lr-warmup-fraction 0.25 --metrics-file " +
                                                      dir.file("one.jsonl")));
  REQUIRE(reference.exit_code == 0);
  REQUIRE(losses(dir.file("whole.jsonl")).size() == 12);
  CHECK(largest_relative_gap(losses(dir.file("whole.jsonl")), losses(dir.file("one.jsonl"))) < 2e-3);
  CHECK(testing::metrics_field(dir.file("whole.jsonl"), "lr") == testing::metrics_field(dir.file("one.jsonl"), "lr"));

  // A limit of 0 minutes passes during the first step on every rank's clock: all four stop after
  // it (one all-reduce decides), rank 0 saves the checkpoint, and the job exits 0.
  const auto stopped = run_ranks(4, base_args(megatron + "--exit-duration-in-mins 0 --save " + dir.file("ck") +
                                              " --metrics-file " + dir.file("stopped.jsonl")));
  INFO(stopped.output);
  REQUIRE(stopped.exit_code == 0);
  CHECK_THAT(stopped.output, ContainsSubstring("--exit-duration-in-mins 0: stopping after iteration 1"));
  CHECK(losses(dir.file("stopped.jsonl")).size() == 1);
  std::string latest;
  std::ifstream(dir.file("ck/latest")) >> latest;
  CHECK(latest == "1");
}
