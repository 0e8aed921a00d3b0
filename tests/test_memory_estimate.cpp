// The start-up memory estimate: it matches what the engine allocates, and a run that cannot
// fit is refused before anything is allocated, naming its largest consumers.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <fstream>
#if defined(__GLIBC__)
#include <malloc.h>  // malloc_trim
#endif

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/memory_estimate.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "core/error.h"
#include "core/gpt_config.h"
#include "parallel/process_groups.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

const std::string kTiny = testing::source_path("configs/tiny.json");
constexpr uint64_t kGiB = uint64_t{1} << 30;

TrainOptions options_from(std::vector<std::string> args) {
  args.push_back("--device");
  args.push_back("cpu");
  return parse_train_command_line(args).options;
}

RunSetup setup_from(std::vector<std::string> args) { return resolve_run_setup(options_from(std::move(args))); }

std::string refusal(const MemoryEstimate& estimate, const MemoryAvailability& available) {
  try {
    check_memory_fits(estimate, available, 1);
  } catch (const InputError& e) {
    return e.full_message();
  }
  return "(fits)";
}

MemoryAvailability host_with(uint64_t bytes) {
  MemoryAvailability available;
  available.host_bytes = bytes;
  available.host_source = "test";
  return available;
}

}  // namespace

TEST_CASE("the memory estimate matches the engine's allocations on the CPU", "[memory]") {
  // Tolerance: 2% of what the engine allocates. The estimate mirrors the slab layout, so the
  // remaining difference is the 256-byte alignment of each activation and small tables.
  const std::vector<std::vector<std::string>> variants = {
      {"--bf16"},
      {"--fp32", "--optimizer-state-precision", "fp32"},
      {"--fp8-hybrid", "--micro-batch-size", "8"},
      {"--fp8-hybrid", "--grad-reduce-in-bf16"},  // the BF16 gradient slab (FP32 storage on the CPU)
      {"--fp8-format", "e4m3", "--fp8-lm-head", "--num-layers", "3", "--seq-length", "32"},
      // The LM head's own weight in the head's bucket, and its FP8 operand.
      {"--fp8-hybrid", "--untie-embeddings-and-output-weights", "--fp8-lm-head", "--seq-length", "32"},
      // Blocks 0 and 3 BF16: their own operand dtypes, and a second gradient operand buffer.
      {"--fp8-hybrid", "--num-layers", "4", "--first-last-layers-bf16", "--seq-length", "32"},
      // Activation recomputation over BF16 and FP8 blocks: shared buffer sets for each.
      {"--fp8-hybrid", "--num-layers", "6", "--first-last-layers-bf16", "--recompute-granularity", "full",
       "--recompute-method", "uniform", "--recompute-num-layers", "2"},
      {"--fp8-hybrid", "--num-layers", "6", "--recompute-granularity", "full", "--recompute-method", "block",
       "--recompute-num-layers", "4"},
      {"--fp8-hybrid", "--num-layers", "4", "--first-last-layers-bf16", "--recompute-granularity", "selective",
       "--recompute-modules", "layernorm", "mlp"},
      {"--fp8-hybrid", "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm"},
      // Block scaling: transposed copies and FP32 tile scales for every FP8 operand (widths of 128).
      {"--fp8-hybrid", "--fp8-recipe", "blockwise", "--fp8-lm-head", "--seq-length", "32", "--config",
       testing::source_path("configs/tiny-128.json")},
  };
  for (const auto& variant : variants) {
    std::vector<std::string> args = {"--config", kTiny, "--mock-data", "--micro-batch-size", "4"};
    args.insert(args.end(), variant.begin(), variant.end());
    const RunSetup setup = setup_from(args);
    const auto engine = make_engine(setup);
    const double measured = double(engine->benchmark_memory().allocated_bytes);
    const double estimated = double(setup.memory.engine_bytes(/*device=*/false));
    INFO(variant.front() << ": measured " << measured << " estimated " << estimated);
    CHECK(std::fabs(estimated - measured) <= 0.02 * measured);
  }
}

namespace {

// The GPU estimate of a run of `config` at micro-batch `micro_batch`, T = `seq_length`.
double gpu_estimate_gib(const char* config, int micro_batch, int tp, int dp, const std::vector<std::string>& flags,
                        int seq_length = 1024) {
  // Resolved as a small CPU run (nothing here may need the memory), then given the shape.
  std::vector<std::string> args = {"--config", kTiny, "--mock-data", "--micro-batch-size", std::to_string(micro_batch)};
  for (const std::string& flag : flags)
    if (flag != "--sequence-parallel") args.push_back(flag);
  RunSetup setup = setup_from(args);
  setup.model = load_gpt_config(testing::source_path(std::string("configs/") + config + ".json"));
  setup.seq_length = seq_length;
  setup.options.tensor_model_parallel_size = tp;
  setup.options.sequence_parallel = !flags.empty() && flags.back() == "--sequence-parallel";
  setup.parallel = make_parallel_layout(0, tp * dp, tp);
  setup.data_parallel_size = dp;
  setup.use_cuda = true;
  return double(estimate_memory(setup).engine_bytes(/*device=*/true)) / double(kGiB);
}

// What an FP8 run with per-tensor scales holds less since its blocks stopped keeping their GELU
// output (GptModel::recomputes_gelu_output), for rows measured before: the blocks' B*T x F'
// E4M3 outputs, less one such output with its transpose and mlp.c_proj's held gradient operand
// (B*T x C E5M2, with its transpose).
double recomputed_gelu_outputs_gib(const char* config, int micro_batch, int tp, int seq_length = 1024) {
  const GptConfig model = load_gpt_config(testing::source_path(std::string("configs/") + config + ".json"));
  const double rows = double(micro_batch) * seq_length, ffn = double(model.n_inner) / tp;
  return (model.n_layer * rows * ffn - 2 * rows * ffn - 2 * rows * model.n_embd) / double(kGiB);
}

// ... and what an FP8 run with an unsharded optimizer holds less since its working copy left
// out the FP8 blocks' Linear weights (GptPrecision::fp8_linear_working_copy): their BF16
// values, each block's bucket padded to 256 x dp elements, less a table of 8 bytes a tensor.
double dropped_working_copy_gib(const char* config, int tp, int dp) {
  const GptConfig model = load_gpt_config(testing::source_path(std::string("configs/") + config + ".json"));
  const double C = model.n_embd, F = model.n_inner;
  const double pad = 256.0 * dp, linear = (4 * C * C + 2 * F * C) / tp;
  return (model.n_layer * std::ceil(linear / pad) * pad * 2 - (12.0 * model.n_layer + 4) * 8) / double(kGiB);
}

bool has_flag(const std::vector<std::string>& flags, const char* flag) {
  return std::find(flags.begin(), flags.end(), flag) != flags.end();
}

}  // namespace

TEST_CASE("the GPU estimate matches the allocations measured on H100 and H200", "[memory]") {
  // docs/PERFORMANCE.md's "peak memory" column: every slab the engine allocated on the GPU
  // (TrainingEngine::benchmark_memory), T = 1024. Tolerance: 3.5% (measured: 0.0% to +2.9%).
  //
  // The rows marked "predicted" are not measured yet; the five 1558M rows measured on
  // 2026-11-25 equalled their predictions. The predictions: ZeRO-1 now reduces and
  // gathers in place, so they are what was measured with the copies (docs/PERFORMANCE.md,
  // 2026-11-23) less the buffers that went, worked out from the slab: n parameters per rank,
  // S = n/2 in the shard, the largest bucket (the embedding) E elements.
  //   gpt2-1558m: n = 1,557,696,000, E = 82,124,800; gpt2-774m: n = 774,099,456, E = 65,699,840.
  //   BF16 gradients: 4S (reduced shard) + 2S (working shard) + 2n (BF16 slab) + 2S (BF16
  //     shard) became 2E (one bucket of BF16): 1558m 42.5 - 8.55 GiB, 774m 23.3 - 4.20 GiB.
  //   FP8 gradients + weights: 4S + 2S + n (FP8 slab) + E (received) + S (FP8 shard) became
  //     2E + n (a bucket of codes and as received, the gathered codes): 1558m 40.4 - 5.00,
  //     774m 22.3 - 2.46 GiB.
  //   FP32 gradients (Megatron's default; 38.2 GiB measured): 4S + 2S became nothing: - 4.35.
  //   No distributed optimizer, BF16 gradients: 2n became 2E: 41.8 - 2.75 GiB.
  // --grad-reduce-in-bf16 then made the gradient slab itself BF16 (Megatron's BF16 main_grad),
  // reduced in place: 2n less for the slab and the bucket of BF16 staging (2E) gone, at
  // 1558m 2(n + E) = 3.05 GiB, at 774m 1.56 GiB; at one GPU 2n = 2.90 GiB (1558m).
  struct Measured {
    const char* config;
    int micro_batch, tp, dp;
    std::vector<std::string> flags;
    double gib;
  };
  // One H100, 2026-11-26 (device call 57), after FP8 blocks stopped keeping their GELU output
  // (call 56: 13.56 -> 12.67 and 38.88 -> 36.66 GiB) and the unsharded optimizer's working copy
  // left out the FP8 Linear weights.
  const std::vector<Measured> measured_since = {
      {"gpt2-124m", 32, 1, 1, {"--fp8-hybrid"}, 12.514},
      {"gpt2-1558m", 8, 1, 1, {"--fp8-hybrid"}, 33.915},
  };
  for (const Measured& m : measured_since) {
    const double estimated = gpu_estimate_gib(m.config, m.micro_batch, m.tp, m.dp, m.flags);
    INFO(m.config << " micro-batch " << m.micro_batch << ": measured " << m.gib << " GiB, estimated " << estimated);
    CHECK(std::fabs(estimated - m.gib) <= 0.01);
  }
  const std::vector<Measured> table = {
      // One H100, 2026-11-25 (the engine's "measured" row; it equalled the estimate).
      {"gpt2-124m", 32, 1, 1, {"--bf16"}, 14.81},
      {"gpt2-1558m", 8, 1, 1, {"--bf16"}, 39.06},
      // Two H100s, 2026-11-25, both overlaps on: the predictions below, measured to 0.01 GiB.
      {"gpt2-1558m", 8, 1, 1, {"--fp8-hybrid", "--grad-reduce-in-bf16"}, 35.98},
      {"gpt2-1558m", 8, 1, 2, {"--fp8-hybrid", "--grad-reduce-in-bf16"}, 30.90},
      {"gpt2-1558m", 8, 1, 2, {"--fp8-hybrid", "--fp8-grad-comm", "--fp8-param-gather"}, 35.41},
      {"gpt2-1558m", 8, 1, 2, {"--fp8-hybrid"}, 33.80},
      {"gpt2-1558m", 8, 1, 2, {"--fp8-hybrid", "--no-use-distributed-optimizer"}, 38.88},
      {"gpt2-1558m", 8, 1, 2, {"--fp8-hybrid", "--grad-reduce-in-bf16", "--no-use-distributed-optimizer"},
       41.8 - 2.75 - 3.05},  // predicted
      {"gpt2-774m", 8, 1, 1, {"--fp8-hybrid"}, 21.5},
      {"gpt2-774m", 8, 2, 1, {"--fp8-hybrid"}, 11.9},
      {"gpt2-774m", 8, 2, 1, {"--fp8-hybrid", "--sequence-parallel"}, 11.2},
      {"gpt2-774m", 8, 1, 2, {"--fp8-hybrid", "--grad-reduce-in-bf16"}, 23.3 - 4.20 - 1.56},                  // predicted
      {"gpt2-774m", 8, 1, 2, {"--fp8-hybrid", "--fp8-grad-comm", "--fp8-param-gather"}, 22.3 - 2.46},          // predicted
  };
  for (Measured m : table) {
    // Every row but the BF16 ones was measured (or predicted) while FP8 blocks kept their GELU output.
    const bool fp8 = !has_flag(m.flags, "--bf16");
    if (fp8) m.gib -= recomputed_gelu_outputs_gib(m.config, m.micro_batch, m.tp);
    if (fp8 && (m.dp == 1 || has_flag(m.flags, "--no-use-distributed-optimizer")))
      m.gib -= dropped_working_copy_gib(m.config, m.tp, m.dp);
    const double estimated = gpu_estimate_gib(m.config, m.micro_batch, m.tp, m.dp, m.flags);
    INFO(m.config << " micro-batch " << m.micro_batch << " tp " << m.tp << " dp " << m.dp << " " << m.flags.back()
                  << ": measured " << m.gib << " GiB, estimated " << estimated << " GiB");
    CHECK(std::fabs(estimated - m.gib) <= 0.035 * m.gib);
  }
}

TEST_CASE("BF16 gradients (--grad-reduce-in-bf16): the GPU estimate's gradient slab is BF16, 2 bytes per parameter less, at any DP",
          "[memory]") {
  for (int dp : {1, 2, 4}) {
    INFO("DP=" << dp);
    const double fp32 = gpu_estimate_gib("gpt2-1558m", 8, 1, dp, {"--fp8-hybrid"});
    const double bf16 = gpu_estimate_gib("gpt2-1558m", 8, 1, dp, {"--fp8-hybrid", "--grad-reduce-in-bf16"});
    // n = 1,557,696,000 parameters (this rank's slab, padding within 256 x DP per bucket);
    // no communication buffer either way: both reduce in the gradient slab.
    const double saving = 2.0 * 1'557'696'000 / double(kGiB);
    CHECK(std::fabs((fp32 - bf16) - saving) < 0.01);
  }
  // The consumer is named for its dtype, in the start-up table and in a refusal.
  RunSetup setup = setup_from({"--config", kTiny, "--mock-data", "--grad-reduce-in-bf16"});
  setup.use_cuda = true;
  const MemoryEstimate estimate = estimate_memory(setup);
  const auto named = [&](const char* name) {
    for (const MemoryConsumer& c : estimate.consumers)
      if (c.name == name) return true;
    return false;
  };
  CHECK(named("gradients (BF16)"));
  CHECK_FALSE(named("gradients (FP32)"));
}

TEST_CASE("the GPU estimate per rank falls with the data-parallel size at gpt2-1558m", "[memory]") {
  // ZeRO-1 with in-place communication: each rank holds 1/DP of the master and the AdamW
  // state (7 bytes per parameter) and a bucket or two of buffers, so every gradient format
  // is below one GPU's memory at DP = 2, and lower still at DP = 4.
  const double one_gpu = gpu_estimate_gib("gpt2-1558m", 8, 1, 1, {"--fp8-hybrid"});
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--fp8-hybrid"}, {"--fp8-hybrid", "--grad-reduce-in-bf16"},
        {"--fp8-hybrid", "--fp8-grad-comm"}, {"--fp8-hybrid", "--fp8-grad-comm", "--fp8-param-gather"}}) {
    const double dp2 = gpu_estimate_gib("gpt2-1558m", 8, 1, 2, flags);
    const double dp4 = gpu_estimate_gib("gpt2-1558m", 8, 1, 4, flags);
    std::string name;
    for (const std::string& flag : flags) name += flag + " ";
    INFO(name << ": one GPU " << one_gpu << " GiB, DP=2 " << dp2 << " GiB, DP=4 " << dp4 << " GiB");
    // The shard's saving at DP = 2: half of 7 bytes of 1.56e9 parameters, 5.1 GiB, less the
    // buffers (at most the FP8 codes of the slab, 1.45 GiB, and two embedding buckets), and
    // less the Linear weights' BF16 working copy (2.75 GiB), which the ranks gather and one GPU
    // no longer holds (GptPrecision::fp8_linear_working_copy).
    CHECK(dp2 < one_gpu - 0.5);
    CHECK(dp4 < dp2 - 2.0);
  }
}

TEST_CASE("gpt-6.7b fits one 8-GPU node at every tensor x data layout the node issue measures", "[memory]") {
  // configs/gpt-6.7b.json at T = 2048, micro-batch 1, FP8 hybrid with sequence parallelism and
  // the distributed optimizer: 6.66e9 parameters at 14.9 bytes each, all split by TP and the
  // optimizer's 7 also by DP. Every layout fits an H100's 80 GB (DP = 8 too, at 62 GiB: each rank then
  // holds every weight and gradient); the 8-GPU run checks these per-rank figures.
  const std::vector<std::string> flags = {"--fp8-hybrid", "--sequence-parallel"};
  const double tp8 = gpu_estimate_gib("gpt-6.7b", 1, 8, 1, flags, 2048);
  const double tp4_dp2 = gpu_estimate_gib("gpt-6.7b", 1, 4, 2, flags, 2048);
  const double tp2_dp4 = gpu_estimate_gib("gpt-6.7b", 1, 2, 4, flags, 2048);
  const double dp8 = gpu_estimate_gib("gpt-6.7b", 1, 1, 8, {"--fp8-hybrid"}, 2048);
  INFO("per rank: TP=8 " << tp8 << " GiB, TP=4 x DP=2 " << tp4_dp2 << " GiB, TP=2 x DP=4 " << tp2_dp4
                         << " GiB, DP=8 " << dp8 << " GiB");
  CHECK(tp8 < tp4_dp2);
  CHECK(tp4_dp2 < tp2_dp4);
  CHECK(tp2_dp4 < 70.0);  // an H100's 80 GB less the context and NCCL's buffers
  CHECK(dp8 > tp2_dp4);   // without tensor parallelism each rank holds every weight and gradient
}

TEST_CASE("the host estimate covers the process's growth through a training step", "[memory]") {
  // Memory enough to dwarf the allocator's noise (a 32,768-row position table: about 55 MiB)
  // at little compute. VmRSS grows by about the estimate's held part; the stated tolerance
  // is 25%.
  const RunSetup setup = setup_from({"--config", kTiny, "--mock-data", "--hidden-size", "128", "--num-attention-heads",
                                     "4", "--max-position-embeddings", "32768", "--seq-length", "64",
                                     "--micro-batch-size", "4", "--fp8-hybrid"});
#if defined(__SANITIZE_ADDRESS__)
  SKIP("AddressSanitizer's shadow memory and quarantine inflate VmRSS");
#endif
  // Tests before this one in the same process leave freed pages in the allocator, which the
  // engine would reuse without growing the RSS: hand them back first.
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  const uint64_t before = measure_host_memory().host_current_bytes;
  const auto engine = make_engine(setup);
  std::vector<int32_t> tokens(size_t(4) * 64, 7);
  engine->begin_step();
  engine->forward_backward(tokens.data(), tokens.data());
  engine->end_step(AdamWHyperparams{}, 1.0, 0);
  engine->step_metrics();
  const double grown = double(measure_host_memory().host_current_bytes - before);
  uint64_t held = 0;
  for (const MemoryConsumer& c : setup.memory.consumers)
    if (!c.transient && c.name.rfind("host:", 0) != 0) held += c.host_bytes;
  INFO("RSS grew by " << grown << ", estimate of held memory " << held);
  REQUIRE(held > 32 * (uint64_t{1} << 20));
  CHECK(std::fabs(double(held) - grown) <= 0.25 * double(held));
}

TEST_CASE("a run that cannot fit is refused, naming its largest consumers and a remedy", "[memory]") {
  SECTION("activations: a huge micro-batch") {
    const RunSetup small = setup_from({"--config", kTiny, "--mock-data"});
    RunSetup huge = small;
    huge.options.micro_batch_size = 1000000;
    huge.memory = estimate_memory(huge);
    CHECK(refusal(small.memory, host_with(16 * kGiB)) == "(fits)");
    const std::string message = refusal(huge.memory, host_with(16 * kGiB));
    CHECK_THAT(message, ContainsSubstring("the run does not fit"));
    CHECK_THAT(message, ContainsSubstring("host memory"));
    CHECK_THAT(message, ContainsSubstring("largest: activations (micro-batch 1000000 x seq-length 64"));
    CHECK_THAT(message, ContainsSubstring("HINT: lower --micro-batch-size"));
  }
  SECTION("FP8 amax histories") {
    RunSetup setup = setup_from({"--config", kTiny, "--mock-data", "--fp8-hybrid"});
    setup.options.fp8.amax_history_len = 1000000000;
    setup.memory = estimate_memory(setup);
    const std::string message = refusal(setup.memory, host_with(16 * kGiB));
    CHECK_THAT(message, ContainsSubstring("largest: FP8 amax histories (24 scaling states x history 1000000000)"));
    CHECK_THAT(message, ContainsSubstring("HINT: lower --fp8-amax-history-len"));
  }
  SECTION("the optimizer state of a large model points at the distributed optimizer") {
    RunSetup setup = setup_from({"--config", kTiny, "--mock-data", "--fp32", "--optimizer-state-precision", "fp32",
                                 "--micro-batch-size", "1", "--seq-length", "8"});
    setup.model = load_gpt_config(testing::source_path("configs/gpt2-1558m.json"));
    setup.memory = estimate_memory(setup);
    const std::string message = refusal(setup.memory, host_with(8 * kGiB));
    CHECK_THAT(message, ContainsSubstring("largest: optimizer: FP32 master + AdamW state (fp32)"));
    CHECK_THAT(message, ContainsSubstring("HINT: pass --optimizer-state-precision fp8-fp16, or shard it with the "
                                          "distributed optimizer"));
  }
  SECTION("ranks of one node share its host memory") {
    const RunSetup setup = setup_from({"--config", kTiny, "--mock-data"});
    const uint64_t need = setup.memory.host_bytes();
    CHECK_NOTHROW(check_memory_fits(setup.memory, host_with(need + need / 2), 1));
    CHECK_THROWS_WITH(check_memory_fits(setup.memory, host_with(need + need / 2), 2),
                      ContainsSubstring("per rank x 2 ranks on this node"));
  }
  SECTION("the GPU's free memory") {
    RunSetup setup = setup_from({"--config", kTiny, "--mock-data"});
    setup.use_cuda = true;  // an estimate for the GPU backend; nothing runs on it
    setup.memory = estimate_memory(setup);
    MemoryAvailability available = host_with(64 * kGiB);
    available.has_device = true;
    available.device_total_bytes = 80 * kGiB;
    available.device_free_bytes = setup.memory.device_bytes() - 1;
    const std::string message = refusal(setup.memory, available);
    CHECK_THAT(message, ContainsSubstring("of GPU memory"));
    CHECK_THAT(message, ContainsSubstring("(cudaMemGetInfo)"));
    available.device_free_bytes = setup.memory.device_bytes();
    CHECK(refusal(setup.memory, available) == "(fits)");
  }
}

TEST_CASE("the estimate's arithmetic saturates instead of wrapping", "[memory]") {
  RunSetup setup = setup_from({"--config", kTiny, "--mock-data"});
  setup.model.n_layer = 1 << 30;
  setup.model.n_embd = 1 << 29;
  setup.model.n_inner = 1 << 30;
  setup.seq_length = 1 << 20;
  setup.options.micro_batch_size = 1 << 20;
  setup.memory = estimate_memory(setup);
  CHECK(setup.memory.host_bytes() == UINT64_MAX);
  CHECK(format_bytes(setup.memory.host_bytes()) == "more than 16 EiB");
  CHECK_THAT(refusal(setup.memory, host_with(UINT64_MAX - 1)), ContainsSubstring("more than 16 EiB"));
}

TEST_CASE("the binary refuses runs that cannot fit within a second, before allocating", "[memory][cli]") {
  const testing::TempDir dir;
  const std::string huge_model =
      testing::write_tiny_config(dir, "huge.json", {{"n_layer", 10000}, {"n_embd", 65536}, {"n_head", 512}, {"n_positions", 64}});
  const std::string long_context = testing::write_tiny_config(dir, "long.json", {{"n_positions", 1 << 30}});
  const std::string gpt2 = testing::source_path("configs/gpt2-124m.json");
  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> cases = {
      {"--config " + huge_model + " --mock-data --device cpu", "parameters (f32 working copy) 3.66 PiB"},
      {"--config " + kTiny + " --mock-data --device cpu --max-position-embeddings 1073741824 --seq-length 64",
       "parameters (f32 working copy) 256.00 GiB"},
      {"--config " + long_context + " --mock-data --device cpu --seq-length 64", "parameters (f32 working copy) 256.00 GiB"},
      {"--config " + long_context + " --mock-data --device cpu", "HINT: --seq-length defaults to the config's n_positions"},
      {"--config " + kTiny + " --mock-data --device cpu --max-position-embeddings 1073741824",
       "--micro-batch-size x --seq-length (4 x 1073741824 = 4294967296 tokens) exceeds 2^31 - 1: the kernels index a "
       "micro-batch's tokens in 32 bits HINT: --seq-length defaults to the config's n_positions (1073741824)"},
      {"--config " + gpt2 + " --mock-data --device cpu --micro-batch-size 1000000", "largest: activations"},
      {"--config " + gpt2 + " --mock-data --device cpu --fp8-hybrid --fp8-amax-history-len 1000000000",
       "--fp8-amax-history-len must be in [1, 65536] (got 1000000000)"},
  };
  for (const Case& c : cases) {
    const auto [run, seconds, cpu] = testing::run_fp8lm_timed(c.args);
    INFO("fp8lm " << c.args << "\n" << run.output << "\n" << seconds << " s, " << cpu << " s of CPU");
    CHECK(run.exit_code == 2);
    CHECK_THAT(run.output, ContainsSubstring("fp8lm: error: "));
    CHECK_THAT(run.output, ContainsSubstring(c.expected));
    CHECK(run.output.find("bad_alloc") == std::string::npos);
    // Fast: under a second of CPU time (measured: about 0.1 s), and no hang on a loaded machine.
    CHECK(cpu < 1.0);
    CHECK(seconds < 10.0);
  }
}

TEST_CASE("the startup table shows the estimate, and the measured memory beside it", "[memory][cli]") {
  const auto run = testing::run_fp8lm("--config " + kTiny + " --mock-data --device cpu --train-iters 1 --eval-iters 0");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("memory estimate: activations (micro-batch 4 x seq-length 64, 2 layers)"));
  CHECK_THAT(run.output, ContainsSubstring("memory estimate: host total (per rank)"));
  CHECK_THAT(run.output, ContainsSubstring("engine allocations: measured / estimated"));
  CHECK_THAT(run.output, ContainsSubstring("host memory: resident now, peak (VmRSS, VmHWM) / estimated"));
  // "memory: host peak 172.73 MiB (VmHWM), estimated 172.86 MiB before allocation": the
  // whole process's peak within 25% of the estimate (measured: within 1%).
  const size_t at = run.output.find("memory: host peak ");
  REQUIRE(at != std::string::npos);
  double peak = 0, estimate = 0;
  char peak_unit[8] = {}, estimate_unit[8] = {};
  REQUIRE(std::sscanf(run.output.c_str() + at, "memory: host peak %lf %7s (VmHWM), estimated %lf %7s", &peak, peak_unit,
                      &estimate, estimate_unit) == 4);
  CHECK(std::string(peak_unit) == "MiB");
  CHECK(std::string(estimate_unit) == "MiB");
  CHECK(std::fabs(peak - estimate) <= 0.25 * estimate);
}

TEST_CASE("activation recomputation: the GPU estimate at gpt2-1558m, micro-batch 8, against issue 14's 25.7 GiB", "[memory][recompute]") {
  // Every block keeping only its input (uniform groups of 1) keeps 48 inputs of 8,192 x
  // 1,600 BF16 and one block's other buffers instead of 48: 47 x 0.257 GiB = 12.1 GiB less
  // (36.66 -> 24.57 GiB; 21.67 with BF16 gradients). A block's other buffers were 0.306 GiB
  // (measured 2026-11-25: 38.88 -> 24.50) before FP8 blocks stopped keeping their GELU output
  // (8,192 x 6,400 E4M3, 0.049 GiB; GptModel::recomputes_gelu_output).
  const std::vector<std::string> every_block = {"--recompute-granularity", "full", "--recompute-method", "uniform"};
  auto with = [](std::vector<std::string> flags, const std::vector<std::string>& more) {
    flags.insert(flags.end(), more.begin(), more.end());
    return flags;
  };
  const double plain = gpu_estimate_gib("gpt2-1558m", 8, 1, 1, {"--fp8-hybrid"});
  const double recomputed = gpu_estimate_gib("gpt2-1558m", 8, 1, 1, with({"--fp8-hybrid"}, every_block));
  const double bf16_gradients =
      gpu_estimate_gib("gpt2-1558m", 8, 1, 1, with({"--fp8-hybrid", "--grad-reduce-in-bf16"}, every_block));
  // Selective (layernorm and mlp): per block and token, ln_1, ln_2 (1 byte each per channel
  // in FP8) and c_fc's output (8: BF16, 4C) held once instead of 48 times, 47 x 10 bytes per
  // channel. Neither keeps a GELU output per block (the GELU backward recomputes it): both
  // hold one with its transpose and mlp.c_proj's held gradient operand for all blocks. So
  // 47 x 10 = 470 bytes per channel, 8,192 x 1,600 x 470 B = 5.74 GiB less.
  const std::vector<std::string> selective = {"--recompute-granularity", "selective", "--recompute-modules",
                                              "layernorm", "mlp"};
  const double selective_fp8 = gpu_estimate_gib("gpt2-1558m", 8, 1, 1, with({"--fp8-hybrid"}, selective));
  const double selective_bf16_gradients =
      gpu_estimate_gib("gpt2-1558m", 8, 1, 1, with({"--fp8-hybrid", "--grad-reduce-in-bf16"}, selective));
  INFO("plain " << plain << " GiB, recomputed " << recomputed << " GiB, with BF16 gradients " << bf16_gradients
                << "; selective " << selective_fp8 << ", with BF16 gradients " << selective_bf16_gradients);
  CHECK(plain - recomputed > 12.0);
  CHECK(bf16_gradients < 25.7);
  CHECK(std::fabs((plain - selective_fp8) - 470.0 * 8192 * 1600 / double(kGiB)) < 0.05);
}
