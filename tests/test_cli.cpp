// The command line: Megatron flag names, precision resolution, and bad input failing
// before any work with a one-line error naming the flag (exit code 2).
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <sched.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/cli.h"
#include "apps/run_setup.h"
#include "captured_log.h"
#include "cli_testing.h"
#include "train_flags_testing.h"
#include "temp_dir.h"
#include "core/error.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr auto parse = testing::parse_train_flags;
constexpr auto parse_error = testing::train_flags_error;

const std::string kTiny = testing::source_path("configs/tiny.json");

int count_lines(const std::string& text) {
  int lines = 0;
  for (char c : text) lines += c == '\n';
  return lines;
}

}  // namespace

TEST_CASE("the four Megatron seed flags work as written", "[cli]") {
  const TrainOptions o = parse({"--fp8-hybrid", "--transformer-impl", "transformer_engine", "--fp8-amax-history-len",
                                "1024", "--fp8-amax-compute-algo", "max", "--mock-data"});
  CHECK(o.precision == GemmPrecision::fp8);
  CHECK(o.fp8.format == Fp8Format::hybrid);
  CHECK(o.fp8.amax_history_len == 1024);
  CHECK(o.fp8.amax_compute_algo == AmaxComputeAlgo::max);
  CHECK(o.transformer_impl == "transformer_engine");

  const auto run = testing::run_fp8lm("--config " + kTiny +
                                      " --mock-data --train-iters 0 --fp8-hybrid --transformer-impl transformer_engine "
                                      "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("fp8 GEMMs, format hybrid (forward e4m3, gradients e5m2)"));
  CHECK_THAT(run.output, ContainsSubstring("fp8-amax-history-len"));
}

TEST_CASE("BF16 first and last layers follow Megatron's flags: off by default, counts 1 and 1, read only with the flag",
          "[cli]") {
  const TrainOptions defaults = parse({"--mock-data", "--fp8-hybrid"});
  CHECK_FALSE(defaults.first_last_layers_bf16);
  CHECK(defaults.num_layers_at_start_in_bf16 == 1);
  CHECK(defaults.num_layers_at_end_in_bf16 == 1);
  CHECK(defaults.bf16_layers_at_start() == 0);
  CHECK(defaults.bf16_layers_at_end() == 0);
  // Counts without the flag are harmless (Megatron ignores them), negative ones too.
  const TrainOptions counts_alone = parse({"--mock-data", "--fp8-hybrid", "--num-layers-at-start-in-bf16", "-3"});
  CHECK(counts_alone.bf16_layers_at_start() == 0);
  const TrainOptions on =
      parse({"--mock-data", "--fp8-hybrid", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"});
  CHECK(on.bf16_layers_at_start() == 1);
  CHECK(on.bf16_layers_at_end() == 2);
  // Under BF16 there is no FP8 block to keep in BF16.
  CHECK(parse({"--mock-data", "--bf16", "--first-last-layers-bf16"}).bf16_layers_at_start() == 0);

  const auto run = testing::run_fp8lm("--config " + kTiny + " --mock-data --train-iters 0 --device cpu --fp8-hybrid "
                                      "--num-layers 4 --first-last-layers-bf16 --num-layers-at-end-in-bf16 2");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("first 1, last 2 (blocks 0, 2-3 in BF16)"));
  CHECK_THAT(run.output, ContainsSubstring("FP8 amax histories (12 scaling states x history 1)"));
}

TEST_CASE("precision follows Megatron", "[cli]") {
  SECTION("no FP8 flag: BF16") { CHECK(parse({"--mock-data"}).precision == GemmPrecision::bf16); }
  SECTION("--bf16 alone: BF16") { CHECK(parse({"--mock-data", "--bf16"}).precision == GemmPrecision::bf16); }
  SECTION("--bf16 with --fp8-format: FP8") {
    const TrainOptions o = parse({"--mock-data", "--bf16", "--fp8-format", "e4m3"});
    CHECK(o.precision == GemmPrecision::fp8);
    CHECK(o.fp8.format == Fp8Format::e4m3);
  }
  SECTION("FP8 defaults (Megatron-LM's): history 1, most_recent, margin 0, delayed") {
    const TrainOptions o = parse({"--mock-data", "--fp8-format", "hybrid"});
    CHECK(o.fp8.amax_history_len == 1);
    CHECK(o.fp8.amax_compute_algo == AmaxComputeAlgo::most_recent);
    CHECK(o.fp8.margin == 0);
    CHECK(o.fp8.recipe == ScalingRecipe::delayed);
  }
  SECTION("--fp8-recipe tensorwise, margin and interval") {
    const TrainOptions o = parse({"--mock-data", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                                  "--fp8-margin", "2", "--fp8-interval", "4"});
    CHECK(o.fp8.recipe == ScalingRecipe::tensorwise);
    CHECK(o.fp8.margin == 2);
    CHECK(o.fp8.interval == 4);
  }
  SECTION("the startup table says a run without FP8 flags is BF16") {
    const auto run = testing::run_fp8lm("--config " + kTiny + " --mock-data --train-iters 0");
    CHECK(run.exit_code == 0);
    CHECK_THAT(run.output, ContainsSubstring("bf16 (BF16 GEMMs; no FP8 flag given)"));
  }
}

TEST_CASE("every flag of the foundation issue parses", "[cli]") {
  const TrainOptions o =
      parse({"--config", kTiny, "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32", "--lr",
             "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "10", "--lr-decay-iters", "90", "--lr-decay-style",
             "linear", "--train-iters", "100", "--weight-decay", "0.05", "--adam-beta1", "0.8", "--adam-beta2", "0.99",
             "--adam-eps", "1e-6", "--clip-grad", "0.5", "--seed", "7", "--train-data-path", "a.bin",
             "--valid-data-path", "b.bin", "--save", "ckpt", "--load", "ckpt0", "--save-interval", "50",
             "--eval-interval", "20", "--eval-iters", "3", "--log-interval", "5", "--tensor-model-parallel-size", "1",
             "--device", "cpu", "--log-level", "debug", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"});
  CHECK(o.micro_batch_size == 2);
  CHECK(o.global_batch_size == 8);
  CHECK(o.seq_length == 32);
  CHECK(o.lr == 3e-4);
  CHECK(o.min_lr == 3e-5);
  CHECK(o.lr_warmup_iters == 10);
  CHECK(o.lr_decay_iters == 90);
  CHECK(o.lr_decay_style == LrDecayStyle::linear);
  CHECK(o.train_iters == 100);
  CHECK(o.weight_decay == 0.05);
  CHECK(o.adam_beta1 == 0.8);
  CHECK(o.adam_beta2 == 0.99);
  CHECK(o.adam_eps == 1e-6);
  CHECK(o.clip_grad == 0.5);
  CHECK(o.seed == 7);
  CHECK(o.train_data_path == "a.bin");
  CHECK(o.valid_data_path == "b.bin");
  CHECK(o.save_dir == "ckpt");
  CHECK(o.load_dir == "ckpt0");
  CHECK(o.save_interval == 50);
  CHECK(o.eval_interval == 20);
  CHECK(o.eval_iters == 3);
  CHECK(o.log_interval == 5);
  CHECK(o.device == DeviceKind::cpu);
  CHECK(o.log_level == "debug");
}

TEST_CASE("bad flags: one-line error naming the flag", "[cli]") {
  struct Case {
    std::vector<std::string> args;
    std::string names;
  };
  const std::vector<Case> cases = {
      {{"--mock-data", "--no-such-flag"}, "--no-such-flag"},
      {{"--mock-data", "--lr"}, "--lr"},
      {{"--mock-data", "--lr", "abc"}, "--lr"},
      {{"--mock-data", "--lr", "-1"}, "--lr"},
      {{"--mock-data", "--fp8-amax-history-len", "0"}, "--fp8-amax-history-len"},
      {{"--mock-data", "--fp8-amax-history-len", "65537"}, "--fp8-amax-history-len must be in [1, 65536]"},
      {{"--mock-data", "--micro-batch-size", "3", "--global-batch-size", "8"}, "--global-batch-size"},
      {{"--mock-data", "--micro-batch-size", "0"}, "--micro-batch-size"},
      {{"--mock-data", "--fp8-hybrid", "--fp8-format", "e4m3"}, "--fp8-hybrid"},
      {{"--mock-data", "--fp8-format", "e5m2"}, "--fp8-format"},
      {{"--mock-data", "--fp8-margin", "-1"}, "--fp8-margin"},
      {{"--mock-data", "--fp8-interval", "0"}, "--fp8-interval"},
      {{"--mock-data", "--fp8-amax-compute-algo", "mean"}, "--fp8-amax-compute-algo"},
      {{"--mock-data", "--adam-beta2", "1.0"}, "--adam-beta2"},
      {{"--mock-data", "--adam-eps", "0"}, "--adam-eps"},
      {{"--mock-data", "--clip-grad", "-0.1"}, "--clip-grad"},
      {{"--mock-data", "--min-lr", "1", "--lr", "0.1"}, "--min-lr"},
      {{"--mock-data", "--log-interval", "0"}, "--log-interval"},
      {{"--mock-data", "--lr-decay-style", "exponential"}, "--lr-decay-style"},
      {{"--mock-data", "--device", "tpu"}, "--device"},
      {{"--mock-data", "--save-interval", "10"}, "--save-interval"},
      {{"--mock-data", "--fp32", "--bf16"}, "--fp32"},
      {{"--mock-data", "--fp8-lm-head"}, "--fp8-lm-head"},
      {{"--mock-data", "--transformer-impl", "megatron"}, "--transformer-impl"},
      {{"--mock-data", "--fp8-hybrid", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "-1"},
       "--num-layers-at-start-in-bf16 must be >= 0 (got -1)"},
      {{"--mock-data", "--fp8-hybrid", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "-2"},
       "--num-layers-at-end-in-bf16 must be >= 0 (got -2)"},
      {{"--mock-data", "--num-layers-at-start-in-bf16", "x"}, "--num-layers-at-start-in-bf16"},
      {{"--train-iters", "5"}, "--train-data-path"},
  };
  for (const Case& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    INFO("args: " << joined);
    const std::string message = parse_error(c.args);
    CHECK_THAT(message, ContainsSubstring(c.names));
    CHECK(message.find('\n') == std::string::npos);
  }
}

TEST_CASE("the binary exits 2 with one line on bad input, before any work", "[cli]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--config " + kTiny + " --mock-data --fp8-amax-history-len 0", "--fp8-amax-history-len"},
      {"--config " + kTiny + " --mock-data --lr -0.5", "--lr"},
      {"--config " + kTiny + " --mock-data --micro-batch-size 4 --global-batch-size 10", "--global-batch-size"},
      {"--config " + kTiny + " --mock-data --fp8-hybrid --fp8-format e4m3", "--fp8-hybrid contradicts --fp8-format e4m3"},
      {"--config " + kTiny + " --mock-data --bogus", "--bogus"},
      {"--config " + kTiny + " --mock-data --seq-length", "--seq-length"},
      {"--config " + kTiny + " --mock-data --seq-length 65", "--seq-length (65) exceeds the model's n_positions (64)"},
      {"--config /nonexistent/config.json --mock-data", "/nonexistent/config.json"},
      {"--config " + kTiny + " --train-data-path /nonexistent/shard_*.bin", "/nonexistent/shard_*.bin"},
      {"--config " + kTiny + " --mock-data --metrics-file /nonexistent/dir/m.jsonl", "--metrics-file"},
      {"--config " + kTiny + " --mock-data --lr inf", "--lr must be a finite number"},
      {"--config " + kTiny + " --mock-data --lr 1e300", "--lr must be a finite number in [0, 1] (got 1e+300)"},
      {"--config " + kTiny + " --mock-data --weight-decay inf", "--weight-decay must be a finite number"},
      {"--config " + kTiny + " --mock-data --adam-eps inf", "--adam-eps must be a finite number"},
      {"--config " + kTiny + " --mock-data --seed -1", "--seed must be an integer in [0, 18446744073709551615]"},
      {"--config " + kTiny + " --mock-data --num-threads 100000", "--num-threads 100000 exceeds"},
      {"--config " + kTiny + " --mock-data --num-threads 65535", "--num-threads 65535 exceeds"},
      {"--config " + kTiny + " --mock-data --vocab-size 70000", "--vocab-size 70000 exceeds 65536"},
      {"--config " + kTiny + " --mock-data --hidden-size 536870912", "n_inner = 4 x n_embd = 2147483648"},
      {"--config " + kTiny + " --mock-data --fp8-hybrid --first-last-layers-bf16 --num-layers-at-end-in-bf16 2",
       "--num-layers-at-start-in-bf16 (1) + --num-layers-at-end-in-bf16 (2) exceed the model's 2 layers HINT: "},
      {"evaluate --config " + kTiny, "unknown subcommand 'evaluate'"},
  };
  for (const auto& [args, expected] : cases) {
    const auto run = testing::run_fp8lm(args);
    INFO("fp8lm " << args << "\n" << run.output);
    CHECK(run.exit_code == 2);
    CHECK_THAT(run.output, ContainsSubstring("fp8lm: error: "));
    CHECK_THAT(run.output, ContainsSubstring(expected));
    // Only the error line, or the table then the error: no training output.
    CHECK(run.output.find("iter ") == std::string::npos);
    const size_t error_at = run.output.find("fp8lm: error: ");
    CHECK(count_lines(run.output.substr(error_at)) == 1);
  }
}

TEST_CASE("the help lists the flags in groups with defaults", "[cli]") {
  const auto run = testing::run_fp8lm("--help");
  CHECK(run.exit_code == 0);
  for (const char* text : {"Precision", "Training", "Data", "Checkpoints", "--fp8-amax-history-len INT=1",
                           "--fp8-amax-compute-algo TEXT:{max,most_recent}=most_recent", "--lr-decay-style",
                           "cosine", "--tensor-model-parallel-size"}) {
    CHECK_THAT(run.output, ContainsSubstring(text));
  }
  CHECK(testing::run_fp8lm("train --help").exit_code == 0);
}

TEST_CASE("run set-up: model flags override the config, batch arithmetic", "[cli]") {
  TrainOptions o = parse({"--config", kTiny, "--mock-data", "--num-layers", "3", "--micro-batch-size", "2",
                          "--global-batch-size", "8", "--device", "cpu"});
  const RunSetup setup = resolve_run_setup(o);
  CHECK(setup.model.n_layer == 3);
  CHECK(setup.model.n_embd == 64);
  CHECK(setup.seq_length == 64);
  CHECK(setup.grad_accum_steps == 4);
  CHECK_THROWS_AS(resolve_run_setup(parse({"--config", kTiny, "--mock-data", "--num-attention-heads", "3"})), InputError);
}

TEST_CASE("a rank that mpirun bound to one CPU is warned, unless one thread was asked for", "[cli]") {
  cpu_set_t all;
  REQUIRE(sched_getaffinity(0, sizeof(all), &all) == 0);
  if (CPU_COUNT(&all) < 2) SKIP("this process may run on one CPU only");
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  // The process's CPUs and OMP_NUM_THREADS come back however the checks end.
  struct Restore {
    cpu_set_t cpus;
    const char* omp = std::getenv("OMP_NUM_THREADS");
    std::string saved_omp = omp ? omp : "";
    ~Restore() {
      sched_setaffinity(0, sizeof(cpus), &cpus);
      if (omp) setenv("OMP_NUM_THREADS", saved_omp.c_str(), 1);
    }
  } restore{all};
  unsetenv("OMP_NUM_THREADS");
  TrainOptions o = parse({"--config", kTiny, "--mock-data", "--device", "cpu"});
  RunSetup setup = resolve_run_setup(o);
  setup.parallel.world_size = 2;
  auto warning = [&] {
    testing::CapturedLog log;
    warn_if_bound_to_one_cpu(setup);
    return log.text();
  };
  CHECK(warning().empty());  // free to run on every CPU
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  REQUIRE(sched_setaffinity(0, sizeof(one), &one) == 0);
  CHECK(affinity_cpus() == 1);
  CHECK_THAT(warning(), ContainsSubstring("may run on 1 of") && ContainsSubstring("HINT: mpirun --bind-to none"));
  setup.options.num_threads = 1;
  CHECK(warning().empty());
  setup.options.num_threads = 0;
  setenv("OMP_NUM_THREADS", "1", 1);
  CHECK(warning().empty());
  unsetenv("OMP_NUM_THREADS");
  setup.parallel.world_size = 1;
  CHECK(warning().empty());  // a single process: nobody bound it
}

TEST_CASE("every floating-point flag must be finite and inside its range", "[cli]") {
  // Driven by the table validate_options checks, so a flag added there is covered here.
  const TrainOptions defaults;
  for (const RealFlag& flag : real_flags(defaults)) {
    for (const char* text : {"inf", "-inf", "nan", "1e300", "-1e300", "-0.001"}) {
      const double value = std::strtod(text, nullptr);
      const bool inside = std::isfinite(value) && (flag.min_inclusive ? value >= flag.min : value > flag.min) &&
                          (flag.max_inclusive ? value <= flag.max : value < flag.max);
      std::vector<std::string> args = {"--mock-data", flag.name, text};
      if (std::string(flag.name) == "--min-lr") args.insert(args.end(), {"--lr", "1"});
      INFO(flag.name << " " << text);
      const std::string message = parse_error(args);
      if (inside) {
        CHECK(message == "(no error)");
      } else {
        CHECK_THAT(message, ContainsSubstring(std::string(flag.name) + " must be a finite number in "));
      }
    }
  }
  CHECK_THAT(parse_error({"--mock-data", "--lr", "1", "--weight-decay", "1"}),
             ContainsSubstring("--lr x --weight-decay (1) must be below 1"));
}

TEST_CASE("the seed flag takes any unsigned 64-bit value and nothing else", "[cli]") {
  CHECK(parse({"--mock-data", "--seed", "18446744073709551615"}).seed == UINT64_MAX);
  CHECK(parse({"--mock-data", "--seed", "0"}).seed == 0);
  CHECK(parse({"--mock-data"}).seed == 1234);
  for (const char* bad : {"-1", "18446744073709551616", "1.5", "0x10", "seven"}) {
    INFO(bad);
    CHECK_THAT(parse_error({"--mock-data", "--seed", bad}), ContainsSubstring("--seed must be an integer in [0, "));
  }
}

TEST_CASE("the thread count flag is bounded by the machine's hardware threads", "[cli]") {
  CHECK(parse({"--mock-data", "--num-threads", std::to_string(max_num_threads())}).num_threads == max_num_threads());
  const std::string message = parse_error({"--mock-data", "--num-threads", std::to_string(max_num_threads() + 1)});
  CHECK_THAT(message, ContainsSubstring("--num-threads " + std::to_string(max_num_threads() + 1) + " exceeds 4 x"));
  CHECK_THAT(message, ContainsSubstring(std::to_string(hardware_threads()) + " hardware threads"));
}

TEST_CASE("model flags and config files share one size validation", "[cli]") {
  auto setup_error = [](std::vector<std::string> args) {
    try {
      resolve_run_setup(parse(std::move(args)));
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK_THAT(setup_error({"--config", kTiny, "--mock-data", "--hidden-size", "536870912", "--device", "cpu"}),
             ContainsSubstring("\"n_embd\" = 536870912 makes the default MLP width n_inner = 4 x n_embd = 2147483648"));
  CHECK_THAT(setup_error({"--mock-data", "--num-layers", "2", "--hidden-size", "536870912", "--num-attention-heads",
                          "4194304", "--vocab-size", "256", "--device", "cpu"}),
             ContainsSubstring("n_inner = 4 x n_embd = 2147483648"));
  CHECK_THAT(setup_error({"--config", kTiny, "--mock-data", "--micro-batch-size", "100000000", "--device", "cpu"}),
             ContainsSubstring("--micro-batch-size x --seq-length (100000000 x 64 = 6400000000 tokens) exceeds 2^31 - 1"));
}

TEST_CASE("the FP8 margin takes every value of its range, 64 included, with finite losses", "[cli][scaling]") {
  // Margin 64 puts every FP8 operand far below the format's smallest value: the GEMMs see
  // zeros, the BF16 LM head still gives a finite loss. Before, the scale rule shifted 1 by
  // 64 bits (undefined; the CPU then ignored the margin) and the GPU refused it mid-run.
  const testing::TempDir dir;
  for (const char* margin : {"63", "64"}) {
    const std::string metrics = dir.file(std::string("margin") + margin + ".jsonl");
    const auto run = testing::run_fp8lm("--config " + kTiny +
                                        " --mock-data --device cpu --train-iters 2 --seq-length 16 --log-interval 1 "
                                        "--eval-iters 0 --fp8-hybrid --fp8-margin " +
                                        std::string(margin) + " --metrics-file " + metrics);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    std::ifstream file(metrics);
    std::string line;
    int lines = 0;
    while (std::getline(file, line)) {
      const auto json = nlohmann::json::parse(line);
      if (json.contains("loss")) CHECK(std::isfinite(json["loss"].get<double>()));
      ++lines;
    }
    CHECK(lines == 2);
  }
}

// (A test name starting with "--" would reach Catch2 as a flag when ctest runs it.)
// `fp8lm sample` with FLAG VALUE: refused (exit 2) naming the flag.
static void check_sample_refuses(const std::string& flag, const std::string& value) {
  const auto sample = testing::run_fp8lm("sample --config " + kTiny +
                                         " --random-weights --random-prompt 4 --max-new-tokens 2 --device cpu " +
                                         flag + " " + value);
  INFO(sample.output);
  CHECK(sample.exit_code == 2);
  CHECK_THAT(sample.output, ContainsSubstring(flag));
}

TEST_CASE("the GEMM algorithm flag keeps the timed choice by default and the heuristic's first when asked", "[cli]") {
  CHECK(parse({"--mock-data"}).gemm_algorithm == GemmAlgorithmChoice::timed);
  CHECK(parse({"--mock-data", "--gemm-algorithm", "heuristic"}).gemm_algorithm == GemmAlgorithmChoice::heuristic);
  CHECK(parse({"--mock-data", "--gemm-algorithm", "timed"}).gemm_algorithm == GemmAlgorithmChoice::timed);
  CHECK_THAT(parse_error({"--mock-data", "--gemm-algorithm", "fastest"}), ContainsSubstring("--gemm-algorithm"));
  // The startup table says which, and sample and eval take the flag too.
  const auto run = testing::run_fp8lm("--config " + kTiny + " --mock-data --train-iters 0 --device cpu --gemm-algorithm heuristic");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("gemm-algorithm"));
  CHECK_THAT(run.output, ContainsSubstring("heuristic"));
  check_sample_refuses("--gemm-algorithm", "fastest");
}

TEST_CASE("fast accumulation in the backward: only under all, per-tensor, short sums the model does not mark", "[cli]") {
  constexpr auto all = Fp8FastAccumulation::all, forward = Fp8FastAccumulation::forward;
  constexpr int64_t layer_sum = 4 * 1600, micro_batch_tokens = 8 * 1024;
  CHECK(backward_sums_on_tensor_cores(all, false, false, layer_sum));
  CHECK(backward_sums_on_tensor_cores(all, false, false, micro_batch_tokens));
  CHECK(backward_sums_on_tensor_cores(all, false, false, kFastAccumulationMaxK));
  CHECK_FALSE(backward_sums_on_tensor_cores(forward, false, false, layer_sum));
  CHECK_FALSE(backward_sums_on_tensor_cores(all, true, false, layer_sum));        // block scaling
  CHECK_FALSE(backward_sums_on_tensor_cores(all, false, false, kFastAccumulationMaxK + 1));
  // The LM head's sums, marked, whatever their length: dgrad over gpt2's whole vocabulary or a
  // rank's slice of it under tensor parallelism (50,304 / 8 = 6,288); wgrad over the tokens.
  CHECK_FALSE(backward_sums_on_tensor_cores(all, false, true, 50304));
  CHECK_FALSE(backward_sums_on_tensor_cores(all, false, true, 50304 / 8));
  CHECK_FALSE(backward_sums_on_tensor_cores(all, false, true, micro_batch_tokens));
}

TEST_CASE("the fast-accumulation flag: forward by default, all when asked, only with per-tensor FP8, shown at start-up",
          "[cli]") {
  CHECK(parse({"--mock-data", "--fp8-hybrid"}).fp8_fast_accumulation == Fp8FastAccumulation::forward);
  CHECK(parse({"--mock-data", "--fp8-hybrid", "--fp8-fast-accumulation", "all"}).fp8_fast_accumulation ==
        Fp8FastAccumulation::all);
  CHECK(parse({"--mock-data", "--fp8-fast-accumulation", "forward"}).fp8_fast_accumulation ==
        Fp8FastAccumulation::forward);
  CHECK_THAT(parse_error({"--mock-data", "--fp8-hybrid", "--fp8-fast-accumulation", "dgrad"}),
             ContainsSubstring("--fp8-fast-accumulation"));
  CHECK_THAT(parse_error({"--mock-data", "--fp8-fast-accumulation", "all"}),
             ContainsSubstring("--fp8-fast-accumulation all needs --fp8-format"));
  CHECK_THAT(parse_error({"--mock-data", "--fp8-hybrid", "--fp8-recipe", "blockwise", "--fp8-fast-accumulation", "all"}),
             ContainsSubstring("block-scaled GEMMs always promote"));
  const auto run = testing::run_fp8lm("--config " + kTiny +
                                      " --mock-data --train-iters 0 --device cpu --fp8-hybrid --fp8-fast-accumulation all");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("fp8-fast-accumulation"));
}

TEST_CASE("the programmatic-launch flag is on by default, off when asked, and shown at start-up", "[cli][launch]") {
  CHECK(parse({"--mock-data"}).programmatic_launch);
  CHECK_FALSE(parse({"--mock-data", "--programmatic-launch", "off"}).programmatic_launch);
  CHECK(parse({"--mock-data", "--programmatic-launch", "on"}).programmatic_launch);
  CHECK_THAT(parse_error({"--mock-data", "--programmatic-launch", "yes"}), ContainsSubstring("--programmatic-launch"));
  const auto run =
      testing::run_fp8lm("--config " + kTiny + " --mock-data --train-iters 0 --device cpu --programmatic-launch off");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("programmatic-launch"));
  // sample and eval take it too (kRuntimeFlags), and refuse a bad value naming it.
  check_sample_refuses("--programmatic-launch", "maybe");
}
