// A Megatron-LM GPT script's flags (docs/MEGATRON.md): Megatron's defaults, the flags fp8lm
// implements with Megatron's meaning (--lr-warmup-fraction, --lr-warmup-init, --init-method-std,
// --norm-epsilon, --exit-duration-in-mins, --finetune, the tokenizer files, the precision-aware
// optimizer's dtypes, --save DIR --load DIR with --exit-on-missing-checkpoint,
// --use-checkpoint-opt_param-scheduler, sample-based training, the batch-size ramp-up, the WSD and
// inverse-square-root decays and the weight-decay ramp), the ones it accepts without
// effect, with one value, or with a warning, and the ones it refuses.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/cli.h"
#include "apps/megatron_flags.h"
#include "apps/run_setup.h"
#include "byte_vocabulary.h"
#include "cli_testing.h"
#include "train_flags_testing.h"
#include "core/error.h"
#include "core/gpt_config.h"
#include "core/tensor.h"
#include "layers/gpt.h"
#include "optim/lr_schedule.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

const std::string kTiny = testing::source_path("configs/tiny.json");

constexpr auto parse = testing::parse_train_flags;
constexpr auto parse_error = testing::train_flags_error;

bool contains(const std::vector<std::string>& lines, const std::string& text) {
  for (const std::string& line : lines)
    if (line.find(text) != std::string::npos) return true;
  return false;
}

// A short CPU run of the tiny model on mock data.
std::string tiny_run(const std::string& extra) {
  return "train --config " + kTiny +
         " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 2 --eval-interval 0 "
         "--eval-iters 0 --log-interval 1 " +
         extra;
}

// The resume tests' reference: `flags` run 4 steps uninterrupted (their losses, returned) and
// again stopped at iteration 2 with a checkpoint in dir/ckpt.
std::vector<double> whole_run_and_checkpoint(const testing::TempDir& dir, const std::string& flags) {
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 4 --metrics-file " + dir.file("whole.jsonl") + flags))
              .exit_code == 0);
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 4 --exit-interval 2 --save " + dir.file("ckpt") + flags))
              .exit_code == 0);
  std::vector<double> whole = testing::metrics_losses(dir.file("whole.jsonl"));
  REQUIRE(whole.size() == 4);
  return whole;
}

// A run resumed at iteration 2 continues the uninterrupted run bit for bit: its first two
// losses are that run's third and fourth.
void check_continues(const std::vector<double>& whole, const std::vector<double>& resumed) {
  REQUIRE(whole.size() == 4);
  REQUIRE(resumed.size() >= 2);
  CHECK(resumed[0] == whole[2]);
  CHECK(resumed[1] == whole[3]);
}

}  // namespace

TEST_CASE("a Megatron GPT pretraining script's flags run as written", "[cli][megatron]") {
  // The flags of a Megatron-LM GPT-2 pretraining script (examples/gpt3 style), on the tiny model.
  const std::string megatron =
      "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-mcore-models "
      "--transformer-impl transformer_engine --num-layers 2 --hidden-size 64 --num-attention-heads 2 "
      "--seq-length 32 --max-position-embeddings 64 --attention-dropout 0.0 --hidden-dropout 0.0 "
      "--position-embedding-type learned_absolute --normalization LayerNorm --norm-epsilon 1e-5 "
      "--init-method-std 0.02 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 6.0e-4 --min-lr 6.0e-5 "
      "--lr-decay-style cosine --lr-decay-iters 3 --lr-warmup-fraction .01 --weight-decay 0.1 --adam-beta1 0.9 "
      "--adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --bf16 --fp8-format hybrid --fp8-amax-history-len "
      "1024 --fp8-amax-compute-algo max --use-flash-attn --no-masked-softmax-fusion --no-bias-gelu-fusion "
      "--no-bias-dropout-fusion --no-gradient-accumulation-fusion --attention-softmax-in-fp32 "
      "--accumulate-allreduce-grads-in-fp32 --distributed-backend nccl --mock-data --split 949,50,1 "
      "--log-interval 1 --log-throughput --timing-log-level 0 --eval-interval 1000 --eval-iters 0 "
      "--num-workers 2 --tensorboard-dir ";
  const testing::TempDir dir;
  const auto run = testing::run_fp8lm("train --config " + kTiny + " " + megatron + dir.file("tb") +
                                      " --device cpu --metrics-file " + dir.file("m.jsonl"));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(testing::metrics_losses(dir.file("m.jsonl")).size() == 3);
  CHECK_THAT(run.output, ContainsSubstring("Megatron flag, no effect here") &&
                             ContainsSubstring("--use-flash-attn: fp8lm's attention is always fused") &&
                             ContainsSubstring("--num-workers 2: PyTorch's data-loader processes"));
  CHECK_THAT(run.output, ContainsSubstring("--tensorboard-dir " + dir.file("tb") + " is not written"));
  CHECK_THAT(run.output, ContainsSubstring("init-method-std (initializer_range)") && ContainsSubstring("0.006"));
  CHECK_THAT(run.output, ContainsSubstring("--split 949,50,1 with --mock-data: the mock stream has no documents"));
}

TEST_CASE("defaults follow Megatron: linear decay, weight decay 0.01, beta2 0.999, no warm-up", "[cli][megatron]") {
  const TrainOptions o = parse({"--mock-data"});
  CHECK(o.lr_decay_style == LrDecayStyle::linear);
  CHECK(o.weight_decay == 0.01);
  CHECK(o.adam_beta1 == 0.9);
  CHECK(o.adam_beta2 == 0.999);
  CHECK(o.adam_eps == 1e-8);
  CHECK(o.clip_grad == 1.0);
  CHECK(o.lr_warmup_iters == 0);
  CHECK(!o.lr_warmup_fraction);
  CHECK(o.lr_warmup_init == 0.0);
  CHECK(o.min_lr == 0.0);
  CHECK(o.seed == 1234);
  CHECK(o.eval_interval == 1000);
  CHECK(o.eval_iters == 100);
  CHECK(o.log_interval == 100);
  CHECK(o.fp8.amax_history_len == 1);
  CHECK(o.fp8.amax_compute_algo == AmaxComputeAlgo::most_recent);
  CHECK(GptConfig{}.initializer_range == 0.02);
  CHECK(GptConfig{}.layer_norm_epsilon == 1e-5f);
  CHECK(LrSchedule{}.style == LrDecayStyle::linear);
}

TEST_CASE("every compatibility flag is accepted, limited to its value, warned about or refused, as listed",
          "[cli][megatron]") {
  for (const MegatronFlag& flag : megatron_compatibility_flags()) {
    INFO(flag.name);
    std::vector<std::string> args = {"--mock-data", flag.name};
    switch (flag.kind) {
      case MegatronFlagKind::no_effect: {
        if (flag.takes_value) args.push_back("2");
        const TrainOptions o = parse(args);
        CHECK(contains(o.megatron_no_effect, std::string(flag.name) + (flag.takes_value ? " 2: " : ": ") + flag.why));
        CHECK(o.megatron_warnings.empty());
        break;
      }
      case MegatronFlagKind::one_value: {
        args.push_back(flag.accepted_value);
        CHECK(parse(args).megatron_no_effect.empty());
        args.back() = "7";
        CHECK_THAT(parse_error(args), ContainsSubstring(std::string(flag.name) + " 7 is not supported: " + flag.why) &&
                                          ContainsSubstring(std::string("pass ") + flag.name + " " + flag.accepted_value));
        break;
      }
      case MegatronFlagKind::not_written: {
        if (flag.takes_value) args.push_back("x");
        const TrainOptions o = parse(args);
        CHECK(contains(o.megatron_warnings, " is not written: " + std::string(flag.why)));
        CHECK(contains(o.megatron_warnings, flag.name));
        break;
      }
      case MegatronFlagKind::refused: {
        if (flag.takes_value) args.push_back("1");
        CHECK_THAT(parse_error(args), ContainsSubstring(std::string(flag.name) + " is not supported: " + flag.why));
        break;
      }
    }
  }
  // Numbers compare as numbers, words as words.
  CHECK(parse({"--mock-data", "--attention-dropout", "0.0", "--hidden-dropout", "0e0"}).megatron_no_effect.empty());
  CHECK_THAT(parse_error({"--mock-data", "--hidden-dropout", "0.1"}),
             ContainsSubstring("--hidden-dropout 0.1 is not supported: fp8lm trains without dropout"));
  CHECK_THAT(parse_error({"--mock-data", "--normalization", "layernorm"}), ContainsSubstring("not supported"));
  // A refused flag takes its value with it: the error names the flag, not the number.
  CHECK_THAT(parse_error({"--mock-data", "--num-experts", "8"}), ContainsSubstring("--num-experts is not supported"));
  CHECK_THAT(parse_error({"--mock-data", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"}),
             ContainsSubstring("--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16"));
}

TEST_CASE("an unknown flag is named, first in command-line order, with the nearest flag when one is close",
          "[cli][megatron]") {
  CHECK_THAT(parse_error({"--mock-data", "--lr-warmup-iter", "5", "--zzz"}),
             ContainsSubstring("unknown flag --lr-warmup-iter (did you mean --lr-warmup-iters?)"));
  CHECK_THAT(parse_error({"--mock-data", "--zzz-qqq-www"}), ContainsSubstring("unknown flag --zzz-qqq-www") &&
                                                               !ContainsSubstring("did you mean"));
  CHECK_THAT(parse_error({"--mock-data", "stray"}), ContainsSubstring("unexpected argument 'stray'"));
  CHECK_THAT(parse_error({"--mock-data", "--tensorboard_dir=x"}),
             ContainsSubstring("unknown flag --tensorboard_dir (did you mean --tensorboard-dir?)"));
  const auto run = testing::run_fp8lm("train --mock-data --use-mcore-model");
  CHECK(run.exit_code == 2);
  CHECK_THAT(run.output, ContainsSubstring("unknown flag --use-mcore-model (did you mean --use-mcore-models?)"));
}

TEST_CASE("the warm-up: --lr-warmup-fraction warms up over that fraction of the decay steps, from --lr-warmup-init",
          "[cli][megatron]") {
  // Megatron counts the warm-up in samples, F x decay steps x batch: a fractional step count.
  const LrSchedule fractional{.max_lr = 1.0, .min_lr = 0.0, .warmup_iters = 0.01 * 250, .decay_iters = 250,
                              .style = LrDecayStyle::linear};
  CHECK(learning_rate(0, fractional) == 1.0 / 2.5);
  CHECK(learning_rate(1, fractional) == 2.0 / 2.5);
  CHECK(learning_rate(2, fractional) == 1.0 - (3.0 - 2.5) / (250.0 - 2.5));
  const LrSchedule with_init{.max_lr = 1.0, .min_lr = 0.0, .warmup_iters = 4, .warmup_init_lr = 0.2, .decay_iters = 8};
  CHECK(learning_rate(0, with_init) == 0.2 + 0.8 * 1.0 / 4.0);
  CHECK(learning_rate(3, with_init) == 1.0);
  CHECK_THROWS_AS(learning_rate(0, LrSchedule{.max_lr = 1.0, .warmup_iters = 2, .warmup_init_lr = 2.0, .decay_iters = 4}),
                  InputError);

  CHECK(*parse({"--mock-data", "--lr-warmup-fraction", "0.25"}).lr_warmup_fraction == 0.25);
  CHECK_THAT(parse_error({"--mock-data", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"}),
             ContainsSubstring("--lr-warmup-fraction contradicts --lr-warmup-iters 3"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-warmup-fraction", "1.5"}),
             ContainsSubstring("--lr-warmup-fraction must be in [0, 1]"));
  CHECK_THAT(parse_error({"--mock-data", "--lr", "1e-4", "--lr-warmup-init", "1e-3"}),
             ContainsSubstring("--lr-warmup-init (0.001) must not exceed --lr (1e-04)"));

  // Through the trainer: half of 4 decay steps is a 2-step warm-up, from 1e-4 to 1e-3.
  const testing::TempDir dir;
  const auto run = testing::run_fp8lm(tiny_run("--train-iters 4 --lr 1e-3 --lr-warmup-init 1e-4 "
                                               "--lr-warmup-fraction 0.5 --metrics-file " + dir.file("m.jsonl")));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const std::vector<double> lr = testing::metrics_field(dir.file("m.jsonl"), "lr");
  REQUIRE(lr.size() == 4);
  CHECK(lr[0] == 1e-4 + (1e-3 - 1e-4) * 0.5);
  CHECK(lr[1] == 1e-3);
  CHECK(lr[3] == 0.0);  // linear decay to --min-lr 0, Megatron's defaults
}

// Megatron's get_lr() in samples (megatron/core/optimizer_param_scheduler.py), written out here
// as the reference: num_steps samples seen, the warm-up and decay bounds in samples.
// wsd_decay_steps and wsd_style: WSD's anneal, in samples.
double megatron_sample_counted_lr(double num_steps, double warmup_steps, double decay_steps, double max_lr,
                                  double min_lr, LrDecayStyle style, double wsd_decay_steps = 0.0,
                                  WsdDecayStyle wsd_style = WsdDecayStyle::exponential) {
  if (warmup_steps > 0 && num_steps <= warmup_steps) return max_lr * num_steps / warmup_steps;
  if (style == LrDecayStyle::constant) return max_lr;
  if (num_steps > decay_steps) return min_lr;
  if (style == LrDecayStyle::inverse_square_root)
    return std::max(min_lr, max_lr * std::sqrt(std::max(warmup_steps, 1.0)) / std::sqrt(std::max(num_steps, 1.0)));
  const double ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps);
  double coeff = style == LrDecayStyle::cosine ? 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0) : 1.0 - ratio;
  if (style == LrDecayStyle::wsd) {
    const double anneal_start = decay_steps - wsd_decay_steps;
    const double r = (num_steps - anneal_start) / wsd_decay_steps;
    coeff = num_steps <= anneal_start                    ? 1.0
            : wsd_style == WsdDecayStyle::linear         ? 1.0 - r
            : wsd_style == WsdDecayStyle::cosine         ? 0.5 * (std::cos(std::numbers::pi * r) + 1.0)
            : wsd_style == WsdDecayStyle::exponential    ? 2.0 * std::pow(0.5, r) - 1.0
                                                         : 1.0 - std::sqrt(r);
  }
  return min_lr + coeff * (max_lr - min_lr);
}

TEST_CASE("sample-based training: --train-samples, --lr-decay-samples and --lr-warmup-samples count sequences",
          "[cli][megatron]") {
  // Megatron's GPT-3 175B script: 146,484,375 samples, decay over 126,953,125, warm-up over
  // 183,105, a global batch of 1,536 (no ramp-up). Step i (0-based) runs at the rate Megatron
  // gives after i + 1 global batches (optim/lr_schedule.h's shift by one).
  TrainOptions o = parse({"--mock-data", "--train-samples", "146484375", "--lr-decay-samples", "126953125",
                          "--lr-warmup-samples", "183105", "--lr", "0.6e-4", "--min-lr", "0.6e-5", "--lr-decay-style",
                          "cosine"});
  CHECK(o.train_samples == 146484375);
  const int global_batch = 1536;
  const LrSchedule schedule = learning_rate_schedule(o, global_batch);
  CHECK(schedule.warmup_iters == Catch::Approx(183105.0 / 1536).epsilon(1e-15));
  CHECK(schedule.decay_iters == Catch::Approx(126953125.0 / 1536).epsilon(1e-15));
  for (const int64_t step : {0, 1, 118, 119, 120, 1000, 40000, 82651, 82652, 82653, 95366}) {
    INFO("step " << step);
    const double expected = megatron_sample_counted_lr(double(step + 1) * global_batch, 183105, 126953125, 0.6e-4,
                                                       0.6e-5, LrDecayStyle::cosine);
    CHECK(learning_rate(step, schedule) == Catch::Approx(expected).epsilon(1e-12).margin(1e-18));
  }
  // --lr-decay-samples defaults to --train-samples; --lr-warmup-fraction takes its fraction of that.
  o = parse({"--mock-data", "--train-samples", "1000", "--lr-warmup-fraction", "0.1"});
  CHECK(learning_rate_schedule(o, 10).decay_iters == 100.0);
  CHECK(learning_rate_schedule(o, 10).warmup_iters == Catch::Approx(10.0));

  // Megatron's assertions: one way of counting at a time.
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "8", "--train-iters", "4"}),
             ContainsSubstring("--train-samples contradicts --train-iters"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "8", "--lr-decay-iters", "3"}),
             ContainsSubstring("--lr-decay-iters contradicts --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "8", "--lr-warmup-iters", "3"}),
             ContainsSubstring("--lr-warmup-iters contradicts --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-decay-samples", "8"}), ContainsSubstring("they need --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-warmup-samples", "8"}), ContainsSubstring("they need --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "8", "--lr-warmup-samples", "2", "--lr-warmup-fraction", "0.1"}),
             ContainsSubstring("--lr-warmup-fraction contradicts --lr-warmup-samples 2"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "8", "--lr-decay-samples", "2", "--lr-warmup-samples", "4"}),
             ContainsSubstring("--lr-decay-samples (2) must be >= --lr-warmup-samples (4)"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "-3"}), ContainsSubstring("--train-samples must be >= 1"));

  // Through the trainer: 9 samples at a global batch of 2 are 4 steps; the warm-up's 3 samples
  // are 1.5 steps and the decay's 9 samples 4.5.
  const testing::TempDir dir;
  const auto run = testing::run_fp8lm(tiny_run("--train-samples 9 --lr 1e-3 --lr-warmup-samples 3 --metrics-file " +
                                               dir.file("m.jsonl")));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("4 (--train-samples 9 over the global batch)"));
  const std::vector<double> lr = testing::metrics_field(dir.file("m.jsonl"), "lr");
  REQUIRE(lr.size() == 4);
  CHECK(lr[0] == Catch::Approx(1e-3 / 1.5).epsilon(1e-15));
  CHECK(lr[1] == Catch::Approx(1e-3 * (1.0 - 0.5 / 3.0)).epsilon(1e-15));
  CHECK(lr[3] == Catch::Approx(1e-3 * (1.0 - 2.5 / 3.0)).epsilon(1e-15));
  // Fewer samples than one global batch is no run at all: refused, before any work.
  const auto too_few = testing::run_fp8lm(tiny_run("--train-samples 1"));
  CHECK(too_few.exit_code == 2);
  CHECK_THAT(too_few.output, ContainsSubstring("--train-samples (1) is less than one global batch (2 sequences)"));
  // A sample-counted schedule is not what --use-checkpoint-opt_param-scheduler takes.
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "8", "--load", dir.path().string(),
                          "--use-checkpoint-opt_param-scheduler"}),
             ContainsSubstring("--use-checkpoint-opt_param-scheduler takes a schedule counted in iterations"));
}

TEST_CASE("Megatron's other schedules: --lr-decay-style WSD and inverse-square-root, --weight-decay-incr-style",
          "[cli][megatron]") {
  // WSD counted in steps, against Megatron's get_lr in samples at a global batch of 16: warm-up
  // 100 steps, decay 1,000, the last 200 an anneal.
  for (const auto& [name, wsd_style] : {std::pair{"exponential", WsdDecayStyle::exponential},
                                        std::pair{"linear", WsdDecayStyle::linear},
                                        std::pair{"cosine", WsdDecayStyle::cosine},
                                        std::pair{"minus_sqrt", WsdDecayStyle::minus_sqrt}}) {
    INFO(name);
    const TrainOptions o = parse({"--mock-data", "--train-iters", "1000", "--lr", "3e-4", "--min-lr", "3e-5",
                                  "--lr-warmup-iters", "100", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "200",
                                  "--lr-wsd-decay-style", name});
    CHECK(o.lr_wsd_decay_style == wsd_style);
    const LrSchedule schedule = learning_rate_schedule(o, 16);
    for (const int64_t step : {0, 98, 99, 100, 500, 798, 799, 800, 801, 900, 998, 999, 1200}) {
      INFO("step " << step);
      const double expected = megatron_sample_counted_lr(double(step + 1) * 16, 1600, 16000, 3e-4, 3e-5,
                                                         LrDecayStyle::wsd, 3200, wsd_style);
      CHECK(learning_rate(step, schedule) == Catch::Approx(expected).epsilon(1e-12).margin(1e-18));
    }
  }
  // Sample-based: the anneal in samples, over the global batch.
  TrainOptions o = parse({"--mock-data", "--train-samples", "16000", "--lr-warmup-samples", "1600", "--lr-decay-style",
                          "WSD", "--lr-wsd-decay-samples", "3200"});
  CHECK(learning_rate_schedule(o, 16).wsd_decay_iters == 200.0);
  CHECK(learning_rate_schedule(o, 16).wsd_style == WsdDecayStyle::exponential);  // Megatron's default
  // The inverse square root, whose warm-up Megatron clamps to one sample, not one step.
  for (const char* warmup : {"0", "50"}) {
    INFO("--lr-warmup-iters " << warmup);
    o = parse({"--mock-data", "--train-iters", "1000", "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", warmup,
               "--lr-decay-style", "inverse-square-root"});
    const LrSchedule schedule = learning_rate_schedule(o, 16);
    for (const int64_t step : {0, 1, 49, 50, 400, 999, 1000}) {
      INFO("step " << step);
      const double expected = megatron_sample_counted_lr(double(step + 1) * 16, std::stod(warmup) * 16, 16000, 1e-3,
                                                         1e-5, LrDecayStyle::inverse_square_root);
      CHECK(learning_rate(step, schedule) == Catch::Approx(expected).epsilon(1e-12));
    }
  }
  // The weight decay's ramp spans the run: --train-iters, or --train-samples over the global batch.
  o = parse({"--mock-data", "--train-iters", "100", "--weight-decay-incr-style", "cosine", "--start-weight-decay",
             "0.01", "--end-weight-decay", "0.1"});
  WeightDecaySchedule decay = weight_decay_schedule(o, 16);
  CHECK(decay.incr_iters == 100.0);
  CHECK(weight_decay(49, decay) == Catch::Approx(0.055).epsilon(1e-12));
  o = parse({"--mock-data", "--train-samples", "1000", "--weight-decay-incr-style", "linear", "--start-weight-decay",
             "0", "--end-weight-decay", "0.1"});
  CHECK(weight_decay_schedule(o, 16).incr_iters == 62.5);
  CHECK(weight_decay_schedule(parse({"--mock-data", "--weight-decay", "0.2"}), 16).end == 0.2);

  // Each flag where its style reads it, counted in the run's unit, as Megatron asserts.
  CHECK_THAT(parse_error({"--mock-data", "--lr-decay-style", "WSD"}),
             ContainsSubstring("--lr-decay-style WSD needs --lr-wsd-decay-iters >= 0"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "-3"}),
             ContainsSubstring("(got -3)"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-decay-style", "cosine", "--lr-wsd-decay-iters", "5"}),
             ContainsSubstring("--lr-wsd-decay-iters shapes the anneal of --lr-decay-style WSD, and this run decays "
                               "cosine"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-wsd-decay-style", "linear"}),
             ContainsSubstring("--lr-wsd-decay-style shapes the anneal"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "64", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"}),
             ContainsSubstring("--lr-wsd-decay-iters contradicts --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "64", "--lr-decay-style", "WSD"}),
             ContainsSubstring("needs --lr-wsd-decay-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "8"}),
             ContainsSubstring("--lr-wsd-decay-samples counts a sample-based run's anneal: it needs --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--lr-wsd-decay-style", "step"}), ContainsSubstring("--lr-wsd-decay-style"));
  CHECK_THAT(parse_error({"--mock-data", "--start-weight-decay", "0.1"}),
             ContainsSubstring("--start-weight-decay and --end-weight-decay need --weight-decay-incr-style linear or cosine"));
  CHECK_THAT(parse_error({"--mock-data", "--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"}),
             ContainsSubstring("--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"));
  CHECK_THAT(parse_error({"--mock-data", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1",
                          "--end-weight-decay", "0.01"}),
             ContainsSubstring("--end-weight-decay (0.01) must be >= --start-weight-decay (0.1)"));
  CHECK_THAT(parse_error({"--mock-data", "--weight-decay-incr-style", "cosine", "--start-weight-decay", "-1",
                          "--end-weight-decay", "0.1"}),
             ContainsSubstring("--start-weight-decay must be in [0, 10]"));
  CHECK_THAT(parse_error({"--mock-data", "--lr", "0.5", "--weight-decay-incr-style", "linear", "--start-weight-decay",
                          "0", "--end-weight-decay", "4"}),
             ContainsSubstring("--lr x --end-weight-decay (2) must be below 1"));
  CHECK(contains(parse({"--mock-data", "--weight-decay", "0.1", "--weight-decay-incr-style", "linear",
                        "--start-weight-decay", "0", "--end-weight-decay", "0.1"})
                     .megatron_warnings,
                 "--weight-decay 0.1 has no effect with --weight-decay-incr-style linear"));

  // Through the trainer, 4 steps: WSD with a linear anneal over the last 2, and the weight decay
  // rising linearly from 0 to 0.1.
  const testing::TempDir dir;
  const std::string schedule =
      " --lr 1e-3 --min-lr 1e-4 --lr-decay-style WSD --lr-wsd-decay-iters 2 --lr-wsd-decay-style linear"
      " --weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.1";
  const auto run = testing::run_fp8lm(tiny_run("--train-iters 4 --metrics-file " + dir.file("m.jsonl") + schedule));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("WSD, linear anneal over the last 2 steps") &&
                             ContainsSubstring("linear from 0 to 0.1 over 4 steps") &&
                             ContainsSubstring("| weight decay 0.05 |"));
  const std::vector<double> lr = testing::metrics_field(dir.file("m.jsonl"), "lr");
  const std::vector<double> wd = testing::metrics_field(dir.file("m.jsonl"), "weight_decay");
  REQUIRE(lr.size() == 4);
  REQUIRE(wd.size() == 4);
  CHECK(lr[0] == 1e-3);
  CHECK(lr[1] == 1e-3);
  CHECK(lr[2] == Catch::Approx(1e-4 + 0.5 * 9e-4).epsilon(1e-15));
  CHECK(lr[3] == Catch::Approx(1e-4).epsilon(1e-15));
  for (int i = 0; i < 4; ++i) CHECK(wd[size_t(i)] == Catch::Approx(0.025 * (i + 1)).epsilon(1e-15));
  // The weight decay is applied: a run whose decay ramps to 0.1 ends elsewhere than one without.
  const std::vector<double> ramped = testing::metrics_losses(dir.file("m.jsonl"));
  const auto flat = testing::run_fp8lm(tiny_run("--train-iters 4 --weight-decay 0 --lr 1e-3 --min-lr 1e-4 "
                                                "--lr-decay-style WSD --lr-wsd-decay-iters 2 --lr-wsd-decay-style linear "
                                                "--metrics-file " + dir.file("flat.jsonl")));
  REQUIRE(flat.exit_code == 0);
  const std::vector<double> unramped = testing::metrics_losses(dir.file("flat.jsonl"));
  REQUIRE(unramped.size() == 4);
  CHECK(unramped[0] == ramped[0]);  // the first step's loss comes before any update
  CHECK(unramped[3] != ramped[3]);

  // A resume that leaves out the style takes the checkpoint's WSD with its anneal, and continues
  // bit for bit; under --use-checkpoint-opt_param-scheduler the weight-decay ramp is taken too.
  const std::vector<double> whole = whole_run_and_checkpoint(dir, schedule);
  const auto resumed = testing::run_fp8lm(
      tiny_run("--train-iters 4 --lr 1e-3 --min-lr 1e-4 --weight-decay-incr-style linear --start-weight-decay 0 "
               "--end-weight-decay 0.1 --load " + dir.file("ckpt") + " --metrics-file " + dir.file("resumed.jsonl")));
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("--lr-decay-style not given: resuming with the checkpoint's WSD") &&
                                 ContainsSubstring("--lr-wsd-decay-iters not given: resuming with the checkpoint's 2") &&
                                 ContainsSubstring("--lr-wsd-decay-style not given: resuming with the checkpoint's linear"));
  check_continues(whole, testing::metrics_losses(dir.file("resumed.jsonl")));
  const auto taken = testing::run_fp8lm(tiny_run("--train-iters 4 --use-checkpoint-opt_param-scheduler --load " +
                                                 dir.file("ckpt") + " --metrics-file " + dir.file("taken.jsonl")));
  INFO(taken.output);
  REQUIRE(taken.exit_code == 0);
  CHECK_THAT(taken.output,
             ContainsSubstring("--weight-decay-incr-style linear (the checkpoint's) instead of constant"));
  check_continues(whole, testing::metrics_losses(dir.file("taken.jsonl")));
}

TEST_CASE("a batch-size ramp-up: --rampup-batch-size grows the global batch over the first samples",
          "[cli][megatron]") {
  // 20 sequences, micro-batches of one: the global batch ramps 2, 2, 3 over the first 6
  // sequences (optim/batch_rampup.h), then 3 steps of 4; the schedule runs on the sequences
  // consumed, in steps of the final 4: linear decay over 20 sequences = 5 steps.
  auto run_of = [](const std::string& extra) {
    return "train --config " + kTiny +
           " --mock-data --device cpu --seq-length 32 --micro-batch-size 1 --eval-interval 0 --eval-iters 0 "
           "--log-interval 1 --lr 1e-3 --lr-decay-style linear " +
           extra;
  };
  const std::string ramp = " --global-batch-size 4 --train-samples 20 --rampup-batch-size 2 1 6";
  const testing::TempDir dir;
  const auto run = testing::run_fp8lm(run_of("--metrics-file " + dir.file("ramp.jsonl") + ramp));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("ramp-up from 2 by 1 over 6 samples, then 4") &&
                             ContainsSubstring("| global batch 3 |") &&
                             ContainsSubstring("6 (--train-samples 20 over the ramp-up's batches, then the global batch)"));
  const std::vector<double> batch = testing::metrics_field(dir.file("ramp.jsonl"), "global_batch_size");
  const std::vector<double> lr = testing::metrics_field(dir.file("ramp.jsonl"), "lr");
  CHECK(batch == std::vector<double>{2, 2, 3, 4, 4, 4});
  const double coefficients[] = {0.9, 0.8, 0.65, 0.45, 0.25, 0.05};  // 1 - consumed / 20
  REQUIRE(lr.size() == 6);
  for (size_t i = 0; i < 6; ++i) CHECK(lr[i] == Catch::Approx(1e-3 * coefficients[i]).epsilon(1e-12));
  // Its first two steps are a run at a fixed global batch of 2, bit for bit: the same sequences,
  // the same rates, and each step's gradient the mean over its own micro-batches.
  const auto fixed = testing::run_fp8lm(
      run_of("--global-batch-size 2 --train-samples 20 --metrics-file " + dir.file("fixed.jsonl")));
  REQUIRE(fixed.exit_code == 0);
  const std::vector<double> ramped_losses = testing::metrics_losses(dir.file("ramp.jsonl"));
  const std::vector<double> fixed_losses = testing::metrics_losses(dir.file("fixed.jsonl"));
  REQUIRE(ramped_losses.size() == 6);
  REQUIRE(fixed_losses.size() == 10);
  CHECK(ramped_losses[0] == fixed_losses[0]);
  CHECK(ramped_losses[1] == fixed_losses[1]);
  CHECK(ramped_losses[2] != fixed_losses[2]);  // three sequences against two
  // Stopped inside the ramp and resumed, it continues bit for bit: the batch follows the
  // sequences consumed, which the checkpoint's data position keeps.
  REQUIRE(testing::run_fp8lm(run_of("--exit-interval 2 --save " + dir.file("ckpt") + ramp)).exit_code == 0);
  const auto resumed =
      testing::run_fp8lm(run_of("--load " + dir.file("ckpt") + " --metrics-file " + dir.file("resumed.jsonl") + ramp));
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  const std::vector<double> rest = testing::metrics_losses(dir.file("resumed.jsonl"));
  REQUIRE(rest.size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(rest[i] == ramped_losses[i + 2]);
  CHECK(testing::metrics_field(dir.file("resumed.jsonl"), "global_batch_size") == std::vector<double>{3, 4, 4, 4});

  // Refused, naming the flag: without --train-samples (Megatron asserts it), with --benchmark,
  // and a batch of the ramp that is not whole micro-batch steps.
  CHECK_THAT(parse_error({"--mock-data", "--rampup-batch-size", "2", "1", "6"}),
             ContainsSubstring("--rampup-batch-size needs --train-samples"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "20", "--rampup-batch-size", "2", "1", "6", "--benchmark"}),
             ContainsSubstring("--benchmark times steps of one size"));
  CHECK_THAT(parse_error({"--mock-data", "--train-samples", "20", "--rampup-batch-size", "2", "1"}),
             ContainsSubstring("--rampup-batch-size takes three numbers, START INCREMENT SAMPLES (got 2)"));
  const auto odd = testing::run_fp8lm("train --config " + kTiny +
                                      " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 "
                                      "--global-batch-size 4 --train-samples 20 --rampup-batch-size 2 1 6");
  CHECK(odd.exit_code == 2);
  CHECK_THAT(odd.output, ContainsSubstring("--rampup-batch-size 2 1 6: the ramp's global batch 3 is not a multiple"));
}

TEST_CASE("checkpoint retention: --save-retain-interval keeps every N-th checkpoint and the latest, as Megatron's",
          "[cli][megatron][checkpoint]") {
  const testing::TempDir dir;
  const auto run = testing::run_fp8lm(
      tiny_run("--train-iters 5 --save-interval 1 --save-retain-interval 2 --save " + dir.file("ckpt")));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  namespace fs = std::filesystem;
  auto kept = [&](int iteration) {
    char name[32];
    std::snprintf(name, sizeof name, "iter_%07d", iteration);
    return fs::exists(fs::path(dir.file("ckpt")) / name);
  };
  CHECK(!kept(1));
  CHECK(kept(2));
  CHECK(!kept(3));
  CHECK(kept(4));
  CHECK(kept(5));  // the latest, though not a multiple of 2
  CHECK_THAT(run.output, ContainsSubstring("--save-retain-interval 2 keeps every 2-th iteration and the latest"));
  // A resume from it continues, and its next save removes iteration 5.
  const auto resumed = testing::run_fp8lm(tiny_run("--train-iters 6 --save-interval 1 --save-retain-interval 2 --load " +
                                                   dir.file("ckpt") + " --save " + dir.file("ckpt")));
  REQUIRE(resumed.exit_code == 0);
  CHECK(!kept(5));
  CHECK(kept(6));
  CHECK_THAT(parse_error({"--mock-data", "--save", dir.path().string(), "--save-interval", "2", "--save-retain-interval",
                          "3"}),
             ContainsSubstring("--save-retain-interval (3) must be a multiple of --save-interval (2)"));
  CHECK_THAT(parse_error({"--mock-data", "--save-retain-interval", "4"}),
             ContainsSubstring("must be a multiple of --save-interval (0)"));
}

TEST_CASE("the initial weights: --init-method-std sets the initial weights' deviation, --norm-epsilon LayerNorm's epsilon",
          "[cli][megatron]") {
  const testing::TempDir dir;
  const RunSetup setup = resolve_run_setup(parse({"--config", kTiny, "--mock-data", "--device", "cpu",
                                                  "--init-method-std", "0.01", "--norm-epsilon", "1e-6"}));
  CHECK(setup.model.initializer_range == 0.01);
  CHECK(setup.model.layer_norm_epsilon == 1e-6f);
  // A config file's initializer_range (Hugging Face's key) is read, and the flag overrides it.
  const std::string config = testing::write_tiny_config(dir, "c.json", {{"initializer_range", 0.04}});
  CHECK(resolve_run_setup(parse({"--config", config, "--mock-data", "--device", "cpu"})).model.initializer_range == 0.04);
  CHECK(resolve_run_setup(parse({"--config", config, "--mock-data", "--device", "cpu", "--init-method-std", "0.01"}))
            .model.initializer_range == 0.01);
  CHECK(to_hf_json(setup.model)["initializer_range"] == 0.01);
  CHECK_THAT(parse_error({"--mock-data", "--init-method-std", "-0.02"}),
             ContainsSubstring("--init-method-std must be a number in (0, 10]"));

  // The draw is the standard normal times the deviation: halving it halves every weight exactly;
  // the residual projections draw with deviation / sqrt(2 x layers), biases and gains are constant.
  GptConfig wide = setup.model, narrow = setup.model;
  wide.initializer_range = 0.02;
  narrow.initializer_range = 0.01;
  const TensorLayout layout = make_gpt_layout(wide);
  std::vector<float> a(layout.total_elements()), b(layout.total_elements());
  init_gpt_parameters(a.data(), layout, wide, 7);
  init_gpt_parameters(b.data(), layout, narrow, 7);
  for (const TensorInfo& t : layout.tensors()) {
    INFO(t.name);
    const bool constant = t.shape.size() == 1;
    double sum_squares = 0.0;
    for (int64_t i = 0; i < t.numel; ++i) {
      const float wide_value = a[size_t(t.offset + i)], narrow_value = b[size_t(t.offset + i)];
      if (constant) {
        REQUIRE(wide_value == narrow_value);
      } else {
        REQUIRE(wide_value == 2.0f * narrow_value);
      }
      sum_squares += double(wide_value) * wide_value;
    }
    const bool residual = t.name.find("c_proj.weight") != std::string::npos;
    const int64_t drawn = t.name == "wte.weight" ? int64_t{wide.vocab_size} * wide.n_embd : t.numel;
    if (!constant && drawn > 4000) {
      const double expected = residual ? 0.02 / std::sqrt(2.0 * wide.n_layer) : 0.02;
      CHECK(std::sqrt(sum_squares / double(drawn)) == Catch::Approx(expected).epsilon(0.05));
    }
  }
}

TEST_CASE("a head's width (--kv-channels): hidden-size / num-attention-heads is accepted, another width refused by name",
          "[cli][megatron]") {
  auto setup_error = [](const std::string& channels) {
    try {
      resolve_run_setup(parse({"--config", kTiny, "--mock-data", "--device", "cpu", "--kv-channels", channels}));
    } catch (const InputError& e) {
      return e.full_message();
    }
    return std::string("(no error)");
  };
  CHECK(setup_error("32") == "(no error)");  // the tiny model: 64 wide, 2 heads
  CHECK_THAT(setup_error("48"), ContainsSubstring("--kv-channels 48: fp8lm's heads are hidden-size / "
                                                  "num-attention-heads = 64 / 2 wide") &&
                                    ContainsSubstring("give 32"));
  CHECK_THAT(parse_error({"--mock-data", "--kv-channels", "0"}), ContainsSubstring("--kv-channels"));
}

TEST_CASE("a time limit: --exit-duration-in-mins stops after the step that passes it, with a checkpoint", "[cli][megatron]") {
  const testing::TempDir dir;
  const auto run = testing::run_fp8lm(tiny_run("--train-iters 5 --exit-duration-in-mins 0 --save " + dir.file("ckpt") +
                                               " --metrics-file " + dir.file("m.jsonl")));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, ContainsSubstring("--exit-duration-in-mins 0: stopping after iteration 1"));
  CHECK(testing::metrics_losses(dir.file("m.jsonl")).size() == 1);
  std::string latest;
  std::ifstream(dir.file("ckpt/latest")) >> latest;
  CHECK(latest == "1");
  CHECK_THAT(parse_error({"--mock-data", "--exit-duration-in-mins", "-1"}),
             ContainsSubstring("--exit-duration-in-mins must be >= 0"));
}

TEST_CASE("fine-tuning: --load DIR --finetune starts from the checkpoint's weights alone, as --init-from DIR", "[cli][megatron]") {
  const testing::TempDir dir;
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 3 --save " + dir.file("ckpt"))).exit_code == 0);
  const auto finetune = testing::run_fp8lm(tiny_run("--train-iters 2 --load " + dir.file("ckpt") +
                                                    " --finetune --metrics-file " + dir.file("finetune.jsonl")));
  INFO(finetune.output);
  REQUIRE(finetune.exit_code == 0);
  CHECK_THAT(finetune.output, ContainsSubstring("(--load with --finetune)"));
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 2 --init-from " + dir.file("ckpt") + " --metrics-file " +
                                      dir.file("init.jsonl")))
              .exit_code == 0);
  // Iterations 1 and 2 of a new run (a resume would have continued at 4), the same losses.
  const std::vector<double> iterations = testing::metrics_field(dir.file("finetune.jsonl"), "iter");
  REQUIRE(iterations.size() == 2);
  CHECK(iterations[0] == 1.0);
  CHECK(testing::metrics_losses(dir.file("finetune.jsonl")) == testing::metrics_losses(dir.file("init.jsonl")));
  CHECK_THAT(parse_error({"--mock-data", "--finetune"}), ContainsSubstring("--finetune needs --load DIR"));
  // An earlier iteration with --ckpt-step: iteration 2 of the first run (saved every step).
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 3 --save-interval 1 --save " + dir.file("every"))).exit_code == 0);
  const auto earlier = testing::run_fp8lm(tiny_run("--train-iters 1 --load " + dir.file("every") +
                                                   " --ckpt-step 2 --finetune --log-level info"));
  INFO(earlier.output);
  CHECK(earlier.exit_code == 0);
  CHECK_THAT(earlier.output, ContainsSubstring("iter_0000002"));
}

TEST_CASE("the tokenizer files: --vocab-file and --merge-file are checked against the model's vocabulary", "[cli][megatron]") {
  const testing::TempDir dir;
  const testing::ByteVocabulary files = testing::write_byte_vocabulary(dir);
  const std::string tokenizer = " --tokenizer-type GPT2BPETokenizer --vocab-file " + files.vocab_file +
                                " --merge-file " + files.merge_file;
  // The tiny model has 256 ids; the tokenizer 258.
  const auto too_small = testing::run_fp8lm(tiny_run("--train-iters 0" + tokenizer));
  CHECK(too_small.exit_code == 2);
  CHECK_THAT(too_small.output, ContainsSubstring("--vocab-file " + files.vocab_file + " has 258 tokens, more than "
                                                 "the model's vocab_size 256"));
  const auto fits = testing::run_fp8lm(tiny_run("--train-iters 1 --vocab-size 258 --save " + dir.file("ckpt") + tokenizer));
  INFO(fits.output);
  CHECK(fits.exit_code == 0);
  // fp8lm sample checks the same way, with the same message: the tiny checkpoint has 258 ids,
  // a model of 256 does not fit the tokenizer.
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 1 --save " + dir.file("small"))).exit_code == 0);
  const auto sample = testing::run_fp8lm("sample --device cpu --load " + dir.file("small") + " --prompt ab" +
                                         " --max-new-tokens 2 --vocab-file " + files.vocab_file + " --merge-file " +
                                         files.merge_file);
  CHECK(sample.exit_code == 2);
  CHECK_THAT(sample.output, ContainsSubstring("--vocab-file " + files.vocab_file + " has 258 tokens, more than "
                                              "the model's vocab_size 256"));
  const auto sample_fits = testing::run_fp8lm("sample --device cpu --load " + dir.file("ckpt") + " --prompt ab" +
                                              " --max-new-tokens 2 --vocab-file " + files.vocab_file + " --merge-file " +
                                              files.merge_file);
  INFO(sample_fits.output);
  CHECK(sample_fits.exit_code == 0);
  CHECK_THAT(parse_error({"--mock-data", "--vocab-file", files.vocab_file}),
             ContainsSubstring("--vocab-file and --merge-file go together"));
  CHECK_THAT(parse_error({"--mock-data", "--tokenizer-type", "Llama2Tokenizer"}),
             ContainsSubstring("--tokenizer-type Llama2Tokenizer is not supported; only GPT2BPETokenizer"));
}

TEST_CASE("a resume takes the checkpoint's decay style, weight decay and beta2 for the flags it leaves out",
          "[cli][megatron][checkpoint]") {
  // A run saved with GPT-2's recipe (before the defaults became Megatron's, that recipe was
  // fp8lm's default) continues with it when resumed without the flags: bit for bit.
  const testing::TempDir dir;
  const std::string recipe = " --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 --lr 1e-3";
  const std::vector<double> whole = whole_run_and_checkpoint(dir, recipe);
  const auto resumed = testing::run_fp8lm(tiny_run("--train-iters 4 --lr 1e-3 --load " + dir.file("ckpt") +
                                                   " --metrics-file " + dir.file("resumed.jsonl")));
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("--lr-decay-style not given: resuming with the checkpoint's cosine") &&
                                 ContainsSubstring("--weight-decay not given: resuming with the checkpoint's 0.1") &&
                                 ContainsSubstring("--adam-beta2 not given: resuming with the checkpoint's 0.95"));
  check_continues(whole, testing::metrics_losses(dir.file("resumed.jsonl")));
  // A flag given wins over the checkpoint, as every flag of a resume does.
  const auto given = testing::run_fp8lm(tiny_run("--train-iters 3 --lr 1e-3 --adam-beta2 0.99 --load " +
                                                 dir.file("ckpt")));
  CHECK(given.exit_code == 0);
  CHECK_THAT(given.output, !ContainsSubstring("--adam-beta2 not given"));
}

TEST_CASE("the precision-aware optimizer's dtypes map onto the state fp8lm keeps, or are refused by name",
          "[cli][megatron]") {
  const std::string kSwitch = "--use-precision-aware-optimizer";
  SECTION("without a dtype flag the switch changes nothing: FP8-LLM's state, FP32 gradients") {
    for (const auto& args : {std::vector<std::string>{"--mock-data"}, {"--mock-data", kSwitch}}) {
      const TrainOptions o = parse(args);
      CHECK(o.optimizer_state == OptimizerStatePrecision::fp8_fp16);
      CHECK(!o.grad_reduce_in_bf16);
    }
  }
  SECTION("the moments: fp8 + fp16 is FP8-LLM's state, fp32 + fp32 the FP32 one") {
    CHECK(parse({"--mock-data", kSwitch, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"}).optimizer_state ==
          OptimizerStatePrecision::fp8_fp16);
    CHECK(parse({"--mock-data", kSwitch, "--exp-avg-dtype", "fp32", "--exp-avg-sq-dtype", "fp32"}).optimizer_state ==
          OptimizerStatePrecision::fp32);
    // Megatron's explicit defaults need no switch.
    CHECK(parse({"--mock-data", "--exp-avg-dtype", "fp32", "--exp-avg-sq-dtype", "fp32", "--main-grads-dtype", "fp32",
                 "--main-params-dtype", "fp32"})
              .optimizer_state == OptimizerStatePrecision::fp32);
    // One moment named: the other keeps fp8lm's default for it.
    CHECK(parse({"--mock-data", kSwitch, "--exp-avg-dtype", "fp8"}).optimizer_state ==
          OptimizerStatePrecision::fp8_fp16);
    CHECK(parse({"--mock-data", "--optimizer-state-precision", "fp32", "--exp-avg-sq-dtype", "fp32"}).optimizer_state ==
          OptimizerStatePrecision::fp32);
  }
  SECTION("the gradients: bf16 is --grad-reduce-in-bf16") {
    CHECK(parse({"--mock-data", kSwitch, "--main-grads-dtype", "bf16"}).grad_reduce_in_bf16);
    CHECK(!parse({"--mock-data", kSwitch, "--main-grads-dtype", "fp32"}).grad_reduce_in_bf16);
  }
  SECTION("what fp8lm does not keep, or a contradiction, is an error naming the flags") {
    CHECK_THAT(parse_error({"--mock-data", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"}),
               ContainsSubstring("--exp-avg-dtype fp8 needs --use-precision-aware-optimizer"));
    CHECK_THAT(parse_error({"--mock-data", "--main-grads-dtype", "bf16"}),
               ContainsSubstring("--main-grads-dtype bf16 needs --use-precision-aware-optimizer"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--main-params-dtype", "fp16"}),
               ContainsSubstring("--main-params-dtype fp16 is not supported: fp8lm keeps FP32 master weights"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"}),
               ContainsSubstring("--exp-avg-dtype bf16 with --exp-avg-sq-dtype bf16 is not a state fp8lm keeps") &&
                   ContainsSubstring("HINT: pass --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--exp-avg-dtype", "fp32"}),
               ContainsSubstring("--exp-avg-dtype fp32 with --exp-avg-sq-dtype fp16 is not a state fp8lm keeps"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16",
                            "--optimizer-state-precision", "fp32"}),
               ContainsSubstring("contradicts --optimizer-state-precision fp32"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--main-grads-dtype", "fp32", "--grad-reduce-in-bf16"}),
               ContainsSubstring("--main-grads-dtype fp32 contradicts --grad-reduce-in-bf16"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32"}),
               ContainsSubstring("--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32"));
    CHECK_THAT(parse_error({"--mock-data", kSwitch, "--exp-avg-dtype", "int8"}), ContainsSubstring("--exp-avg-dtype"));
  }
  SECTION("a run with Megatron's FP8-LLM-like flags trains, in BF16 gradients") {
    const testing::TempDir dir;
    const auto run = testing::run_fp8lm(tiny_run("--train-iters 2 --fp8-hybrid " + kSwitch +
                                                 " --main-grads-dtype bf16 --main-params-dtype fp32 --exp-avg-dtype fp8 "
                                                 "--exp-avg-sq-dtype fp16 --metrics-file " + dir.file("m.jsonl")));
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(testing::metrics_losses(dir.file("m.jsonl")).size() == 2);
    std::vector<std::string> lines;
    std::istringstream output(run.output);
    for (std::string line; std::getline(output, line);) lines.push_back(line);
    CHECK(contains(lines, "gradient communication"));
    for (const std::string& line : lines)
      if (line.find("gradient communication") != std::string::npos) CHECK_THAT(line, ContainsSubstring("bf16"));
  }
}

TEST_CASE("a job restarted until done, --save DIR --load DIR: the first run starts from iteration 0, the next resumes",
          "[cli][megatron][checkpoint]") {
  const testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const std::string job = " --save " + ckpt + " --load " + ckpt + "/ --save-interval 2 --lr 1e-3";
  // The whole run at once, for the losses a resumed job must repeat.
  REQUIRE(testing::run_fp8lm(tiny_run("--train-iters 4 --lr 1e-3 --metrics-file " + dir.file("whole.jsonl")))
              .exit_code == 0);

  // The first run: nothing in DIR yet (it does not even exist); it stops at iteration 2 as a
  // job's time limit would.
  const auto first = testing::run_fp8lm(tiny_run("--train-iters 4 --exit-interval 2 --metrics-file " +
                                                  dir.file("first.jsonl") + job));
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  CHECK_THAT(first.output, ContainsSubstring("no checkpoint there yet (it is the --save directory): training from "
                                             "iteration 0, as Megatron does"));
  // The same command again continues where it stopped, bit for bit.
  const auto second = testing::run_fp8lm(tiny_run("--train-iters 4 --metrics-file " + dir.file("second.jsonl") + job));
  INFO(second.output);
  REQUIRE(second.exit_code == 0);
  CHECK_THAT(second.output, ContainsSubstring("resumed from") && !ContainsSubstring("no checkpoint there yet"));
  const std::vector<double> whole = testing::metrics_losses(dir.file("whole.jsonl"));
  const std::vector<double> first_losses = testing::metrics_losses(dir.file("first.jsonl"));
  const std::vector<double> second_losses = testing::metrics_losses(dir.file("second.jsonl"));
  REQUIRE(first_losses.size() == 2);
  REQUIRE(second_losses.size() == 2);
  CHECK(first_losses[1] == whole[1]);
  check_continues(whole, second_losses);

  // Megatron's --exit-on-missing-checkpoint makes an empty DIR an error; so is a --load that is
  // not the --save directory (a mistyped path never starts a run afresh).
  const std::string empty = dir.file("empty");
  std::filesystem::create_directories(empty);
  const auto strict = testing::run_fp8lm(tiny_run("--train-iters 2 --save " + empty + " --load " + empty +
                                                  " --exit-on-missing-checkpoint"));
  CHECK(strict.exit_code == 2);
  CHECK_THAT(strict.output, ContainsSubstring("--load " + empty + ": no checkpoint there yet (--exit-on-missing-checkpoint)"));
  const auto elsewhere = testing::run_fp8lm(tiny_run("--train-iters 2 --save " + empty + " --load " + dir.file("typo")));
  CHECK(elsewhere.exit_code == 2);
  CHECK_THAT(elsewhere.output, ContainsSubstring(dir.file("typo") + ": no such checkpoint directory"));
}

TEST_CASE("a resume under --use-checkpoint-opt_param-scheduler takes the checkpoint's learning-rate schedule",
          "[cli][megatron][checkpoint]") {
  // Saved with one schedule; resumed with other rates, another decay style and a longer run:
  // the losses are the uninterrupted run's, bit for bit, so the schedule is the checkpoint's.
  const testing::TempDir dir;
  const std::string schedule = " --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --lr-decay-style cosine";
  const std::vector<double> whole = whole_run_and_checkpoint(dir, schedule);
  const auto resumed = testing::run_fp8lm(
      tiny_run("--train-iters 4 --lr 5e-3 --min-lr 0 --lr-decay-style linear --lr-warmup-iters 0 "
               "--use-checkpoint-opt_param-scheduler --load " + dir.file("ckpt") + " --metrics-file " +
               dir.file("resumed.jsonl")));
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output,
             ContainsSubstring("--use-checkpoint-opt_param-scheduler: --lr 0.001 (the checkpoint's) instead of 0.005") &&
                 ContainsSubstring("--lr-decay-style cosine (the checkpoint's) instead of linear"));
  const std::vector<double> rest = testing::metrics_losses(dir.file("resumed.jsonl"));
  REQUIRE(rest.size() == 2);
  check_continues(whole, rest);
  // The decay steps are the saving run's: a longer --train-iters continues the same curve.
  const auto longer = testing::run_fp8lm(tiny_run("--train-iters 6 --use-checkpoint-opt_param-scheduler --load " +
                                                  dir.file("ckpt") + " --metrics-file " + dir.file("longer.jsonl")));
  INFO(longer.output);
  REQUIRE(longer.exit_code == 0);
  CHECK_THAT(longer.output, ContainsSubstring("--lr-decay-iters 4 (the checkpoint's) instead of -1"));
  check_continues(whole, testing::metrics_losses(dir.file("longer.jsonl")));
  // Without --load there is no schedule to take.
  CHECK_THAT(parse_error({"--mock-data", "--use-checkpoint-opt_param-scheduler"}),
             ContainsSubstring("--use-checkpoint-opt_param-scheduler needs --load DIR"));
}
