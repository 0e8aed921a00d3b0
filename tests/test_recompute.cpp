// Activation recomputation (--recompute-granularity full or selective, layers/gpt.h
// ActivationRecompute): a block's backward reruns its forward (or, selectively, its
// LayerNorms and MLP input side) from what the block kept, with the same kernels and scales,
// so training is the same, bit for bit, as without it, on either backend; the activations
// shrink as the memory estimate says; the flags are checked as Megatron's are.
// Likewise the FP8 weights' transposed copies (--no-fp8-weight-transpose-cache): written
// from the codes before each dgrad instead of kept.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "core/error.h"
#include "core/random.h"
#include "gpu_testing.h"
#include "layers/gpt.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

RunSetup recompute_setup(const std::string& device, std::vector<std::string> flags) {
  std::vector<std::string> args = {"--config", testing::source_path("configs/tiny.json"), "--mock-data", "--device",
                                   device, "--num-layers", "5", "--seq-length", "32", "--micro-batch-size", "2",
                                   "--global-batch-size", "4", "--seed", "5"};
  args.insert(args.end(), flags.begin(), flags.end());
  return resolve_run_setup(parse_train_command_line(args).options);
}

std::vector<int32_t> tokens(size_t n, uint64_t seed) {
  Random random(seed);
  std::vector<int32_t> values(n);
  for (int32_t& t : values) t = int32_t(random.next_u64() % 256);
  return values;
}

struct Trained {
  std::vector<float> losses, norms, parameters;
  std::vector<Fp8TensorStatistics> statistics;  // of the last step (statistics every step)
};

// Three steps of two micro-batches.
Trained train(const std::string& device, const std::vector<std::string>& flags) {
  const RunSetup setup = recompute_setup(device, flags);
  auto engine = make_engine(setup);
  AdamWHyperparams hp;
  hp.lr = 3e-3f;
  hp.weight_decay = 0.1f;
  Trained out;
  for (int step = 0; step < 3; ++step) {
    engine->begin_step(step);
    for (int micro = 0; micro < 2; ++micro) {
      const auto x = tokens(64, 10 * step + micro), y = tokens(64, 10 * step + micro + 100);
      engine->forward_backward(x.data(), y.data());
    }
    engine->end_step(hp, 1.0, step);
    const StepMetrics metrics = engine->step_metrics();
    out.losses.push_back(float(metrics.loss));
    out.norms.push_back(float(metrics.grad_norm));
    if (engine->collects_fp8_statistics(step)) out.statistics = engine->fp8_statistics();
  }
  out.parameters = engine->parameters();
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void check_recompute_changes_nothing(const std::string& device) {
  // Delayed scaling with BF16 first and last blocks (two operand dtype combinations among the
  // recomputed blocks), current scaling with statistics, block scaling, BF16.
  const std::vector<std::vector<std::string>> precisions = {
      {"--fp8-hybrid", "--first-last-layers-bf16"},
      {"--fp8-hybrid", "--fp8-recipe", "tensorwise", "--fp8-stats-interval", "1"},
      {"--fp8-hybrid", "--fp8-stats-interval", "1"},
      {"--fp8-hybrid", "--fp8-recipe", "blockwise"},
      {"--bf16"}};
  const std::vector<std::vector<std::string>> recomputes = {
      {"--recompute-granularity", "full", "--recompute-method", "uniform"},
      {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"},
      {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"},
      {"--recompute-granularity", "selective", "--recompute-modules", "layernorm"},
      {"--recompute-granularity", "selective", "--recompute-modules", "mlp"},
      {"--recompute-activations"},  // core_attn: the attention output's FP8 cast again
      {"--recompute-activations", "--recompute-modules", "core_attn", "layernorm", "mlp"}};
  for (const auto& precision : precisions) {
    const Trained plain = train(device, precision);
    for (const auto& recompute : recomputes) {
      std::vector<std::string> flags = precision;
      flags.insert(flags.end(), recompute.begin(), recompute.end());
      INFO(device << ":" << [&] {
        std::string text;
        for (const std::string& f : flags) text += " " + f;
        return text;
      }());
      const Trained recomputed = train(device, flags);
      CHECK(same_bits(recomputed.losses, plain.losses));
      CHECK(same_bits(recomputed.norms, plain.norms));
      CHECK(same_bits(recomputed.parameters, plain.parameters));
      // The reruns record no amax and count no cast: the statistics are the forward's.
      REQUIRE(recomputed.statistics.size() == plain.statistics.size());
      for (size_t k = 0; k < plain.statistics.size(); ++k) {
        CHECK(recomputed.statistics[k].elements == plain.statistics[k].elements);
        CHECK(recomputed.statistics[k].amax == plain.statistics[k].amax);
        CHECK(recomputed.statistics[k].saturated == plain.statistics[k].saturated);
      }
    }
  }
}

uint64_t estimated_activations(const RunSetup& setup) {
  for (const MemoryConsumer& consumer : setup.memory.consumers)
    if (consumer.name.rfind("activations", 0) == 0) return consumer.host_bytes;
  FAIL("no activations line in the memory estimate");
  return 0;
}

}  // namespace

TEST_CASE("activation recomputation trains bit for bit as without it (CPU backend)", "[recompute][cpu]") {
  check_recompute_changes_nothing("cpu");
}

TEST_CASE("activation recomputation trains bit for bit as without it (GPU backend)", "[recompute][gpu]") {
  FP8LM_REQUIRE_GPU();
  check_recompute_changes_nothing("cuda");
}

namespace {

// Every FP8 path that writes weight codes: AdamW's fused casts (delayed, GPU), separate casts
// (current scaling), BF16 first and last blocks beside FP8 ones, the FP8 LM head (the largest
// weight, so the shared transpose's size), and selective recomputation beside it.
void check_weight_transposes_derived_change_nothing(const std::string& device) {
  const std::vector<std::vector<std::string>> runs = {
      {"--fp8-hybrid", "--first-last-layers-bf16"},
      {"--fp8-hybrid", "--fp8-recipe", "tensorwise", "--fp8-stats-interval", "1"},
      {"--fp8-hybrid", "--fp8-lm-head", "--grad-reduce-in-bf16"},
      {"--fp8-e4m3", "--recompute-activations", "--recompute-modules", "core_attn", "layernorm", "mlp"}};
  for (const auto& kept_flags : runs) {
    std::vector<std::string> flags = kept_flags;
    flags.push_back("--no-fp8-weight-transpose-cache");
    INFO(device << ": " << kept_flags[1]);
    const Trained kept = train(device, kept_flags), derived = train(device, flags);
    CHECK(same_bits(derived.losses, kept.losses));
    CHECK(same_bits(derived.norms, kept.norms));
    CHECK(same_bits(derived.parameters, kept.parameters));
  }
}

}  // namespace

TEST_CASE("FP8 weights without transposed copies train bit for bit as with them (CPU backend)", "[recompute][cpu]") {
  check_weight_transposes_derived_change_nothing("cpu");
}

TEST_CASE("FP8 weights without transposed copies train bit for bit as with them (GPU backend)", "[recompute][gpu]") {
  FP8LM_REQUIRE_GPU();
  check_weight_transposes_derived_change_nothing("cuda");
}

TEST_CASE("FP8 weights without transposed copies: one shared copy the size of the largest, estimated and allocated",
          "[recompute][cpu]") {
  auto engine_bytes = [](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"--fp8-hybrid"});
    const RunSetup setup = recompute_setup("cpu", flags);
    auto engine = make_engine(setup);
    return std::pair{double(setup.memory.engine_bytes(/*device=*/false)),
                     double(engine->benchmark_memory().allocated_bytes)};
  };
  const auto [kept_estimate, kept] = engine_bytes({});
  const auto [derived_estimate, derived] = engine_bytes({"--no-fp8-weight-transpose-cache"});
  // Five FP8 blocks of width 64 (FP32 on the CPU): c_attn 192 x 64, attn.c_proj 64 x 64, c_fc
  // 256 x 64 and mlp.c_proj 64 x 256 lose their transposes; c_fc's size is kept once, shared.
  const double transposes = 5.0 * (192 + 64 + 256 + 256) * 64 * sizeof(float);
  const double shared = 256.0 * 64 * sizeof(float);
  CHECK(kept - derived == transposes - shared);
  CHECK(kept_estimate - derived_estimate == transposes - shared);
  // A run whose parameters do not fit is pointed at the flag while its weights keep transposes.
  auto parameters_remedy = [](std::vector<std::string> flags) {
    for (const MemoryConsumer& consumer : recompute_setup("cpu", flags).memory.consumers)
      if (consumer.name.rfind("parameters", 0) == 0) return consumer.remedy;
    FAIL("no parameters line in the memory estimate");
    return std::string();
  };
  CHECK_THAT(parameters_remedy({"--fp8-hybrid"}), ContainsSubstring("--no-fp8-weight-transpose-cache"));
  CHECK_THAT(parameters_remedy({"--fp8-hybrid", "--no-fp8-weight-transpose-cache"}),
             !ContainsSubstring("--no-fp8-weight-transpose-cache"));
  CHECK_THAT(parameters_remedy({"--bf16"}), !ContainsSubstring("--no-fp8-weight-transpose-cache"));
}

TEST_CASE("FP8 weights without transposed copies: the flag is refused without per-tensor FP8 weights",
          "[recompute][cpu][cli]") {
  auto refused = [](std::vector<std::string> flags, const std::string& message) {
    INFO(message);
    flags.push_back("--no-fp8-weight-transpose-cache");
    CHECK_THROWS_WITH(recompute_setup("cpu", flags), ContainsSubstring(message));
  };
  refused({"--bf16"}, "--no-fp8-weight-transpose-cache needs --fp8-format");
  refused({"--fp8-hybrid", "--fp8-recipe", "blockwise"},
          "a block-scaled weight's transposed copy carries its own block scales");
  const RunSetup setup = recompute_setup("cpu", {"--fp8-hybrid", "--no-fp8-weight-transpose-cache"});
  CHECK_FALSE(setup.options.fp8_weight_transpose_cache);
  CHECK_FALSE(model_precision(setup.options).fp8_weight_transpose_cache);
}

TEST_CASE("activation recomputation: what a model of 12 blocks keeps, estimated and allocated", "[recompute][cpu]") {
  // The engine allocates what the estimate says: uniform groups of 1 keep every block's input
  // and one set of block buffers, groups of 4 keep 3 inputs and 4 sets, block 6 keeps 6
  // inputs, 1 set and 6 whole blocks.
  auto activations = [](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"--num-layers", "12", "--fp8-hybrid"});
    const RunSetup setup = recompute_setup("cpu", flags);
    auto engine = make_engine(setup);
    // As tests/test_memory_estimate.cpp: within 2% (alignment and small tables).
    const double measured = double(engine->benchmark_memory().allocated_bytes);
    CHECK(std::fabs(double(setup.memory.engine_bytes(/*device=*/false)) - measured) <= 0.02 * measured);
    return estimated_activations(setup);
  };
  const uint64_t plain = activations({});
  const uint64_t every = activations({"--recompute-granularity", "full", "--recompute-method", "uniform"});
  const uint64_t groups = activations(
      {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "4"});
  const uint64_t first_six = activations(
      {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "6"});
  // With r a block's input and b the rest of its buffers: plain 12 (r + b), every 12 r + b,
  // groups 3 r + 4 b + 3 r (sets 1-3 hold the inputs of the groups' later blocks), first_six
  // 6 (r + b) + 6 r + b; all with the same rest of the model.
  REQUIRE(plain > every);
  REQUIRE((plain - every) % 11 == 0);
  const uint64_t block = (plain - every) / 11;
  const uint64_t residual = 2 * 32 * 64 * sizeof(float);  // N x C, FP32 on the CPU
  CHECK(first_six - every == 6 * block);
  CHECK(groups - every == 3 * block - 6 * residual);
  CHECK(block > 8 * residual);  // what recomputation saves dwarfs what it keeps

  // Selective: the LayerNorm outputs (two BT x C operands) and c_fc's output (BT x 4C) are
  // held once instead of once per block. An FP8 block keeps no GELU output, with `mlp` or
  // without (its GELU backward recomputes it, GptModel::recomputes_gelu_output): both hold
  // one GELU output with its transpose and mlp.c_proj's held gradient operand for all blocks.
  const uint64_t layernorm = activations({"--recompute-granularity", "selective", "--recompute-modules", "layernorm"});
  // core_attn: the attention output's FP8 cast (BT x C) held once instead of once per block.
  const uint64_t core_attn = activations({"--recompute-activations"});
  CHECK(plain - core_attn == 10 * 2 * 32 * 64 * sizeof(float));  // 12 kept, against one with its transpose
  const uint64_t mlp = activations({"--recompute-granularity", "selective", "--recompute-modules", "mlp"});
  const uint64_t both =
      activations({"--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"});
  REQUIRE(plain > layernorm);
  REQUIRE(plain > mlp);
  const uint64_t rows = 2 * 32, width = 64, ffn = 4 * width;  // B*T, C, F; FP32 on the CPU
  const uint64_t mlp_output = rows * ffn * sizeof(float);
  CHECK((plain - layernorm) % 11 == 0);
  CHECK(plain - mlp == 11 * mlp_output);
  CHECK(plain - both == (plain - layernorm) + (plain - mlp));
  CHECK(plain - mlp > plain - layernorm);  // 4 C wide twice against C wide twice
}

TEST_CASE("activation recomputation flags are checked as Megatron's are, before any work", "[recompute][cpu][cli]") {
  auto refused = [](std::vector<std::string> flags, const std::string& message) {
    INFO(message);
    CHECK_THROWS_WITH(recompute_setup("cpu", flags), ContainsSubstring(message));
  };
  refused({"--recompute-method", "uniform"}, "--recompute-method needs --recompute-granularity full");
  refused({"--recompute-activations", "--recompute-method", "block"}, "--recompute-method needs");
  refused({"--recompute-granularity", "full"}, "--recompute-granularity full needs --recompute-method");
  refused({"--recompute-num-layers", "2"}, "--recompute-num-layers needs --recompute-granularity full");
  refused({"--recompute-modules", "mlp"}, "--recompute-modules needs --recompute-granularity selective");
  refused({"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-modules", "mlp"},
          "--recompute-modules needs --recompute-granularity selective");
  refused({"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"},
          "--recompute-num-layers must be >= 1");
  refused({"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "6"},
          "--recompute-num-layers 6 exceeds the model's 5 layers");
  CHECK_THROWS_WITH(recompute_setup("cpu", {"--recompute-activations", "--recompute-modules", "moe"}),
                    ContainsSubstring("--recompute-modules"));
  // Selective recomputation of Megatron's default module, core attention: the fused attention
  // keeps no score matrix, so what it recomputes here is the attention output's FP8 cast
  // (GptModel::recomputes_attention_operand); no block reruns its forward.
  auto described = [](const RunSetup& setup) {
    for (const auto& [name, value] : settings_table(setup))
      if (name == "recompute (activations)") return value;
    return std::string();
  };
  const RunSetup selective = recompute_setup("cpu", {"--recompute-activations"});
  CHECK(described(selective).rfind("selective: every block's backward recomputes the attention output's FP8 cast", 0) ==
        0);
  const ActivationRecompute core_attn = activation_recompute(selective.options);
  CHECK(core_attn.method == ActivationRecompute::Method::none);
  CHECK(core_attn.attention_output);
  CHECK_FALSE(core_attn.selective());
  const RunSetup modules = recompute_setup("cpu", {"--recompute-granularity", "selective", "--recompute-modules", "mlp"});
  CHECK(described(modules) == "selective: every block's backward recomputes c_fc's and the GELU's outputs");
  CHECK(activation_recompute(modules.options).mlp);
  CHECK_FALSE(activation_recompute(modules.options).layernorm);
}

TEST_CASE("GptPrecision counts the BF16 blocks of a range, as the estimate of recomputed blocks needs", "[recompute][cpu]") {
  // 10 blocks under FP8: 0-1 and 9 in BF16 by the ranges, 4 and 9 by the set (9 counted once).
  GptPrecision precision;
  precision.gemm = GemmPrecision::fp8;
  precision.bf16_layers_at_start = 2;
  precision.bf16_layers_at_end = 1;
  precision.bf16_blocks = {4, 9};
  const int n = 10;
  auto by_loop = [&](int begin, int end) {
    int64_t count = 0;
    for (int l = begin; l < end; ++l) count += precision.runs_block_in_bf16(l, n) ? 1 : 0;
    return count;
  };
  for (int begin = 0; begin <= n; ++begin)
    for (int end = begin; end <= n; ++end) {
      INFO("[" << begin << ", " << end << ")");
      CHECK(precision.bf16_block_count_in(begin, end, n) == by_loop(begin, end));
    }
  CHECK(precision.bf16_block_count(n) == 4);
  // Ranges that overlap (start + end > n) count each block once.
  precision.bf16_layers_at_start = 8;
  precision.bf16_layers_at_end = 5;
  CHECK(precision.bf16_block_count(n) == by_loop(0, n));
  CHECK(precision.bf16_block_count_in(3, 7, n) == by_loop(3, 7));
}
