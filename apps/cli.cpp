#include "apps/cli.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <sched.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "apps/megatron_flags.h"
#include "core/error.h"
#include "core/gpt_config.h"
#include "core/indexed_dataset.h"

namespace fp8lm {

std::string_view to_string(DeviceKind device) {
  switch (device) {
    case DeviceKind::auto_select: return "auto";
    case DeviceKind::cuda: return "cuda";
    case DeviceKind::cpu: return "cpu";
  }
  return "?";
}

std::string_view to_string(GradReduceAlgorithm algorithm) {
  return algorithm == GradReduceAlgorithm::all_to_all ? "all-to-all" : "reduce-scatter";
}

namespace {

template <typename Enum>
Enum lookup(const std::map<std::string, Enum>& names, const std::string& value) {
  return names.at(value);  // CLI11's IsMember check ran first
}

[[noreturn]] void bad_flag(const std::string& message) {
  throw InputError(message, "run `fp8lm train --help` for every flag and its default");
}

// Shortest text that reads back as the same double ("1e+300", "inf", "0.1").
std::string format_real(double value) {
  char buffer[64];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, value);
  return error == std::errc() ? std::string(buffer, end) : std::to_string(value);
}

// An unsigned 64-bit flag value: CLI11 (like strtoull) would read "-1" as 2^64 - 1.
uint64_t parse_unsigned_flag(const std::string& flag, const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end)
    bad_flag(flag + " must be an integer in [0, 18446744073709551615] (got \"" + text + "\")");
  return value;
}

}  // namespace

std::set<int> parse_block_list(const std::string& flag, const std::string& text) {
  std::set<int> blocks;
  size_t begin = 0;
  while (begin <= text.size() && !text.empty()) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, comma - begin);
    int block = 0;
    const auto [stop, error] = std::from_chars(item.data(), item.data() + item.size(), block);
    if (item.empty() || error != std::errc() || stop != item.data() + item.size() || block < 0)
      bad_flag(flag + " takes block numbers separated by commas, such as 0,5,11 (got \"" + text + "\")");
    blocks.insert(block);
    begin = comma + 1;
  }
  return blocks;
}

std::string block_list_text(const std::set<int>& blocks) {
  std::string text;
  for (int block : blocks) {
    if (!text.empty()) text += ',';
    text += std::to_string(block);
  }
  return text;
}

std::vector<RealFlag> real_flags(const TrainOptions& o) {
  constexpr double kUnbounded = std::numeric_limits<double>::max();
  return {
      {"--lr", &o.lr, 0.0, true, 1.0, true, "AdamW steps move each weight by about lr"},
      {"--min-lr", &o.min_lr, 0.0, true, 1.0, true, nullptr},
      {"--lr-warmup-init", &o.lr_warmup_init, 0.0, true, 1.0, true, nullptr},
      {"--weight-decay", &o.weight_decay, 0.0, true, 10.0, true, nullptr},
      {"--adam-beta1", &o.adam_beta1, 0.0, true, 1.0, false, nullptr},
      {"--adam-beta2", &o.adam_beta2, 0.0, true, 1.0, false, nullptr},
      {"--adam-eps", &o.adam_eps, 0.0, false, 1.0, true, nullptr},
      {"--clip-grad", &o.clip_grad, 0.0, true, kUnbounded, true, "0 disables clipping"},
      {"--distributed-timeout-minutes", &o.distributed_timeout_minutes, 0.0, false, kMaxTimeoutMinutes, true,
       "at most a week"},
      {"--fp8-auto-precision-saturation", &o.fp8_auto_precision_saturation, 0.0, true, 1.0, true,
       "a fraction of the operand's elements; 1 never switches"},
      {"--fp8-auto-precision-underflow", &o.fp8_auto_precision_underflow, 0.0, true, 1.0, true,
       "a fraction of the operand's elements; 1 never switches"},
  };
}

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }
int max_num_threads() { return kMaxThreadsPerHardwareThread * hardware_threads(); }
int affinity_cpus() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return hardware_threads();
  return std::max(1, CPU_COUNT(&mask));
}

namespace {

void validate_real_flags(const TrainOptions& o) {
  for (const RealFlag& flag : real_flags(o)) {
    const double value = *flag.value;
    const bool above_min = flag.min_inclusive ? value >= flag.min : value > flag.min;
    const bool below_max = flag.max_inclusive ? value <= flag.max : value < flag.max;
    // NaN fails both comparisons; infinities fail the finite bound on their side.
    if (std::isfinite(value) && above_min && below_max) continue;
    bad_flag(std::string(flag.name) + " must be a finite number in " + (flag.min_inclusive ? "[" : "(") +
             format_real(flag.min) + ", " + format_real(flag.max) + (flag.max_inclusive ? "]" : ")") + " (got " +
             format_real(value) + ")" + (flag.why ? std::string(": ") + flag.why : std::string()));
  }
}

// Megatron's dtype flags, as given ("" where not).
struct PrecisionAwareOptimizerFlags {
  bool enabled = false;
  std::string main_grads, main_params, exp_avg, exp_avg_sq;
  bool state_precision_given = false;
};

// Megatron asserts that every dtype stays fp32 without --use-precision-aware-optimizer; with it,
// the dtypes map onto the state fp8lm keeps: the moments as E4M3 + FP16 (FP8-LLM's, the default)
// or FP32 + FP32, the gradients in FP32 or BF16, the master weights in FP32. A moment's dtype
// left out takes fp8lm's default for it, not Megatron's fp32.
void resolve_precision_aware_optimizer(TrainOptions& o, const PrecisionAwareOptimizerFlags& flags) {
  const std::pair<const char*, const std::string*> dtypes[] = {{"--main-grads-dtype", &flags.main_grads},
                                                               {"--main-params-dtype", &flags.main_params},
                                                               {"--exp-avg-dtype", &flags.exp_avg},
                                                               {"--exp-avg-sq-dtype", &flags.exp_avg_sq}};
  for (const auto& [flag, dtype] : dtypes)
    if (!flags.enabled && !dtype->empty() && *dtype != "fp32")
      bad_flag(std::string(flag) + " " + *dtype +
               " needs --use-precision-aware-optimizer (Megatron asserts fp32 without it)");
  if (flags.main_params == "fp16")
    bad_flag("--main-params-dtype fp16 is not supported: fp8lm keeps FP32 master weights (the FP8-LLM recipe's "
             "optimizer: FP32 master, E4M3 first moment, FP16 second moment)");
  if (flags.main_grads == "bf16") {
    if (o.given("--accumulate-allreduce-grads-in-fp32"))
      bad_flag("--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32");
    o.grad_reduce_in_bf16 = true;
  } else if (flags.main_grads == "fp32" && o.grad_reduce_in_bf16) {
    bad_flag("--main-grads-dtype fp32 contradicts --grad-reduce-in-bf16");
  }
  if (flags.exp_avg.empty() && flags.exp_avg_sq.empty()) return;
  const bool fp32_default = o.optimizer_state == OptimizerStatePrecision::fp32 && flags.state_precision_given;
  const std::string first = !flags.exp_avg.empty() ? flags.exp_avg : fp32_default ? "fp32" : "fp8";
  const std::string second = !flags.exp_avg_sq.empty() ? flags.exp_avg_sq : fp32_default ? "fp32" : "fp16";
  OptimizerStatePrecision state;
  if (first == "fp8" && second == "fp16") {
    state = OptimizerStatePrecision::fp8_fp16;
  } else if (first == "fp32" && second == "fp32") {
    state = OptimizerStatePrecision::fp32;
  } else {
    throw InputError("--exp-avg-dtype " + first + " with --exp-avg-sq-dtype " + second +
                         " is not a state fp8lm keeps: its AdamW stores the moments as E4M3 + FP16 (FP8-LLM's, "
                         "the default) or FP32 + FP32",
                     "pass --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16, or fp32 and fp32");
  }
  if (flags.state_precision_given && state != o.optimizer_state)
    bad_flag("--exp-avg-dtype " + first + " --exp-avg-sq-dtype " + second + " contradicts --optimizer-state-precision " +
             std::string(o.optimizer_state == OptimizerStatePrecision::fp32 ? "fp32" : "fp8-fp16"));
  o.optimizer_state = state;
}

// Megatron's sample-based training: --train-samples with the schedule in samples, never mixed
// with the iteration counts (megatron/training/arguments.py asserts the same).
void validate_sample_counts(const TrainOptions& o) {
  auto num = [](auto value) { return std::to_string(value); };
  if (!o.rampup_batch_size.empty()) {
    if (o.rampup_batch_size.size() != 3)
      bad_flag("--rampup-batch-size takes three numbers, START INCREMENT SAMPLES (got " +
               num(o.rampup_batch_size.size()) + ")");
    if (o.train_samples == 0)
      bad_flag("--rampup-batch-size needs --train-samples: a ramped run counts its length in sequences, as Megatron "
               "asserts");
    if (o.benchmark) bad_flag("--benchmark times steps of one size; leave out --rampup-batch-size");
  }
  if (o.train_samples == 0) {
    if (o.given("--lr-decay-samples") || o.given("--lr-warmup-samples"))
      bad_flag("--lr-decay-samples and --lr-warmup-samples count a sample-based run's schedule: they need "
               "--train-samples (or give --lr-decay-iters and --lr-warmup-iters)");
    return;
  }
  if (o.train_samples < 0) bad_flag("--train-samples must be >= 1 (got " + num(o.train_samples) + ")");
  if (o.given("--train-iters")) bad_flag("--train-samples contradicts --train-iters: give one (as Megatron asserts)");
  if (o.given("--lr-decay-iters"))
    bad_flag("--lr-decay-iters contradicts --train-samples: a sample-based run decays over --lr-decay-samples");
  if (o.given("--lr-warmup-iters"))
    bad_flag("--lr-warmup-iters contradicts --train-samples: a sample-based run warms up over --lr-warmup-samples");
  if (o.lr_decay_samples < -1) bad_flag("--lr-decay-samples must be >= 0 (got " + num(o.lr_decay_samples) + ")");
  if (o.lr_warmup_samples < 0) bad_flag("--lr-warmup-samples must be >= 0 (got " + num(o.lr_warmup_samples) + ")");
  if (o.lr_warmup_fraction && o.lr_warmup_samples != 0)
    bad_flag("--lr-warmup-fraction contradicts --lr-warmup-samples " + num(o.lr_warmup_samples) +
             ": give one (as Megatron asserts)");
  const int64_t decay = o.lr_decay_samples < 0 ? o.train_samples : o.lr_decay_samples;
  if (o.lr_decay_style != LrDecayStyle::constant && decay < o.lr_warmup_samples)
    bad_flag("--lr-decay-samples (" + num(decay) + ") must be >= --lr-warmup-samples (" + num(o.lr_warmup_samples) +
             ")");
  if (o.use_checkpoint_lr_schedule)
    bad_flag("--use-checkpoint-opt_param-scheduler takes a schedule counted in iterations; with --train-samples "
             "give the schedule's flags instead");
}

// --data-args-path: the file's whitespace-separated words, --data-path's list.
std::vector<std::string> data_list_from_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) bad_flag("--data-args-path " + path + ": cannot read the file");
  std::vector<std::string> words;
  for (std::string word; file >> word;) words.push_back(word);
  if (words.empty()) bad_flag("--data-args-path " + path + ": the file holds no dataset");
  return words;
}

struct PerSplitDataLists {
  std::vector<std::string> train, valid, test;
};

// --per-split-data-args-path: Megatron's JSON object whose "train", "valid" and "test" are each a
// list of words or one string of them.
PerSplitDataLists per_split_data_lists_from_file(const std::string& path) {
  const std::string flag = "--per-split-data-args-path " + path;
  std::ifstream file(path);
  if (!file) bad_flag(flag + ": cannot read the file");
  const nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) bad_flag(flag + ": not a JSON object with \"train\", \"valid\" and \"test\" lists");
  auto list = [&](const char* key) {
    std::vector<std::string> words;
    if (!json.contains(key)) return words;
    const nlohmann::json& value = json[key];
    if (value.is_string()) {
      std::istringstream text(value.get<std::string>());
      for (std::string word; text >> word;) words.push_back(word);
    } else if (value.is_array() && std::all_of(value.begin(), value.end(), [](const auto& v) { return v.is_string(); })) {
      for (const auto& word : value) words.push_back(word.get<std::string>());
    } else if (!value.is_null()) {
      bad_flag(flag + ": \"" + key + "\" must be a list of strings or one string, not " + value.dump());
    }
    return words;
  };
  PerSplitDataLists lists{.train = list("train"), .valid = list("valid"), .test = list("test")};
  if (lists.train.empty()) bad_flag(flag + ": no \"train\" list");
  return lists;
}

// Megatron's WSD anneal and weight-decay schedule: each flag only where its style reads it, and
// the anneal counted in the run's unit (steps, or samples with --train-samples).
void validate_schedule_styles(const TrainOptions& o) {
  auto num = [](auto value) { return std::to_string(value); };
  if (o.lr_decay_style != LrDecayStyle::wsd) {
    for (const char* flag : {"--lr-wsd-decay-style", "--lr-wsd-decay-iters", "--lr-wsd-decay-samples"})
      if (o.given(flag))
        bad_flag(std::string(flag) + " shapes the anneal of --lr-decay-style WSD, and this run decays " +
                 std::string(to_string(o.lr_decay_style)));
  } else if (o.train_samples > 0) {
    if (o.given("--lr-wsd-decay-iters"))
      bad_flag("--lr-wsd-decay-iters contradicts --train-samples: a sample-based run anneals over "
               "--lr-wsd-decay-samples");
    if (o.lr_wsd_decay_samples < 0)
      bad_flag("--lr-decay-style WSD with --train-samples needs --lr-wsd-decay-samples >= 0 (the anneal's length, "
               "as Megatron asserts)" + (o.given("--lr-wsd-decay-samples") ? " (got " + num(o.lr_wsd_decay_samples) + ")"
                                                                           : std::string()));
  } else {
    if (o.given("--lr-wsd-decay-samples"))
      bad_flag("--lr-wsd-decay-samples counts a sample-based run's anneal: it needs --train-samples (or give "
               "--lr-wsd-decay-iters)");
    if (o.lr_wsd_decay_iters < 0)
      bad_flag("--lr-decay-style WSD needs --lr-wsd-decay-iters >= 0 (the anneal's length, as Megatron asserts)" +
               (o.given("--lr-wsd-decay-iters") ? " (got " + num(o.lr_wsd_decay_iters) + ")" : std::string()));
  }
  const bool ramps = o.weight_decay_incr_style != WeightDecayIncrStyle::constant;
  const std::string style(to_string(o.weight_decay_incr_style));
  if (!ramps && (o.start_weight_decay || o.end_weight_decay))
    bad_flag("--start-weight-decay and --end-weight-decay need --weight-decay-incr-style linear or cosine (constant "
             "keeps --weight-decay, as Megatron asserts)");
  if (ramps && (!o.start_weight_decay || !o.end_weight_decay))
    bad_flag("--weight-decay-incr-style " + style + " needs --start-weight-decay and --end-weight-decay");
  if (!ramps) return;
  for (const auto& [flag, value] : {std::pair{"--start-weight-decay", *o.start_weight_decay},
                                    std::pair{"--end-weight-decay", *o.end_weight_decay}})
    if (!std::isfinite(value) || value < 0.0 || value > 10.0)
      bad_flag(std::string(flag) + " must be in [0, 10] (got " + format_real(value) + ")");
  if (*o.end_weight_decay < *o.start_weight_decay)
    bad_flag("--end-weight-decay (" + format_real(*o.end_weight_decay) + ") must be >= --start-weight-decay (" +
             format_real(*o.start_weight_decay) + "), as Megatron asserts");
}

}  // namespace

void validate_options(const TrainOptions& o) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) bad_flag(message);
  };
  auto num = [](auto value) { return std::to_string(value); };
  validate_real_flags(o);
  require(o.min_lr <= o.lr, "--min-lr (" + format_real(o.min_lr) + ") must not exceed --lr (" + format_real(o.lr) + ")");
  validate_schedule_styles(o);
  const bool ramps = o.weight_decay_incr_style != WeightDecayIncrStyle::constant;
  const double largest_decay = ramps ? *o.end_weight_decay : o.weight_decay;
  require(o.lr * largest_decay < 1.0, std::string(ramps ? "--lr x --end-weight-decay (" : "--lr x --weight-decay (") +
                                          format_real(o.lr * largest_decay) +
                                          ") must be below 1: each step scales the weights by 1 - lr x weight-decay");
  require(o.micro_batch_size >= 1, "--micro-batch-size must be >= 1 (got " + num(o.micro_batch_size) + ")");
  require(o.global_batch_size >= 0, "--global-batch-size must be >= 1 (got " + num(o.global_batch_size) + ")");
  require(o.global_batch_size == 0 || o.global_batch_size % o.micro_batch_size == 0,
          "--global-batch-size (" + num(o.global_batch_size) + ") must be a multiple of --micro-batch-size (" +
              num(o.micro_batch_size) + ")");
  require(o.seq_length >= 0, "--seq-length must be >= 1 (got " + num(o.seq_length) + ")");
  require(o.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0 (got " + num(o.lr_warmup_iters) + ")");
  if (o.lr_warmup_fraction) {
    const double fraction = *o.lr_warmup_fraction;
    require(std::isfinite(fraction) && fraction >= 0.0 && fraction <= 1.0,
            "--lr-warmup-fraction must be in [0, 1] (got " + format_real(fraction) + ")");
    require(o.lr_warmup_iters == 0, "--lr-warmup-fraction contradicts --lr-warmup-iters " + num(o.lr_warmup_iters) +
                                        ": give one (as Megatron asserts)");
  }
  require(o.lr_warmup_init <= o.lr, "--lr-warmup-init (" + format_real(o.lr_warmup_init) +
                                        ") must not exceed --lr (" + format_real(o.lr) + ")");
  require(o.lr_decay_iters >= -1, "--lr-decay-iters must be >= 0 (got " + num(o.lr_decay_iters) + ")");
  require(o.train_iters >= 0, "--train-iters must be >= 0 (got " + num(o.train_iters) + ")");
  validate_sample_counts(o);
  require(o.max_skipped_steps >= 1, "--max-skipped-steps must be >= 1 (got " + num(o.max_skipped_steps) + ")");
  require(o.save_interval >= 0, "--save-interval must be >= 0 (got " + num(o.save_interval) + ")");
  require(o.save_interval == 0 || !o.save_dir.empty(), "--save-interval needs --save DIR");
  require(o.save_retain_interval >= 0, "--save-retain-interval must be >= 0 (got " + num(o.save_retain_interval) + ")");
  require(o.save_retain_interval == 0 || (o.save_interval > 0 && o.save_retain_interval % o.save_interval == 0),
          "--save-retain-interval (" + num(o.save_retain_interval) + ") must be a multiple of --save-interval (" +
              num(o.save_interval) + "), as Megatron asserts");
  // --init-from takes --ckpt-step too: --load DIR --finetune becomes --init-from DIR.
  require(!o.ckpt_step || !o.load_dir.empty() || !o.init_from.empty(), "--ckpt-step needs --load DIR");
  require(o.exit_interval >= 0, "--exit-interval must be >= 0 (got " + num(o.exit_interval) + ")");
  require(o.check_weight_hash_interval >= 0, "--check-weight-hash-across-dp-replicas-interval must be >= 0 (got " +
                                                 num(o.check_weight_hash_interval) + ")");
  require(!o.exit_duration_in_mins || *o.exit_duration_in_mins >= 0,
          "--exit-duration-in-mins must be >= 0 (got " + (o.exit_duration_in_mins ? num(*o.exit_duration_in_mins) : "") +
              ")");
  require(!o.given("--accumulate-allreduce-grads-in-fp32") || !o.grad_reduce_in_bf16,
          "--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16");
  require(o.tokenizer_type.empty() || o.tokenizer_type == "GPT2BPETokenizer",
          "--tokenizer-type " + o.tokenizer_type + " is not supported; only GPT2BPETokenizer (GPT-2's byte-level BPE)");
  require(o.vocab_file.empty() == o.merge_file.empty(), "--vocab-file and --merge-file go together");
  require(!o.ckpt_step || *o.ckpt_step >= 0, "--ckpt-step must be >= 0");
  require(!o.use_checkpoint_lr_schedule || !o.load_dir.empty(),
          "--use-checkpoint-opt_param-scheduler needs --load DIR (the checkpoint whose schedule it takes)");
  require(o.load_dir.empty() || o.init_from.empty(), "--load and --init-from are alternatives; give one");
  require(o.eval_interval >= 0, "--eval-interval must be >= 0 (got " + num(o.eval_interval) + ")");
  require(o.eval_iters >= 0, "--eval-iters must be >= 0 (got " + num(o.eval_iters) + ")");
  require(o.log_interval >= 1, "--log-interval must be >= 1 (got " + num(o.log_interval) + ")");
  require(o.fp8_stats_interval >= 0, "--fp8-stats-interval must be >= 0 (got " + num(o.fp8_stats_interval) + ")");
  require(o.fp8_stats_interval == 0 || o.fp8_enabled(),
          "--fp8-stats-interval needs --fp8-format: the statistics describe the FP8 GEMM operands");
  require(o.tensor_model_parallel_size >= 1,
          "--tensor-model-parallel-size must be >= 1 (got " + num(o.tensor_model_parallel_size) + ")");
  require(o.num_threads >= 0, "--num-threads must be >= 0 (got " + num(o.num_threads) + ")");
  if (o.num_threads > max_num_threads()) {
    throw InputError("--num-threads " + num(o.num_threads) + " exceeds " + num(kMaxThreadsPerHardwareThread) +
                         " x this machine's " + num(hardware_threads()) + " hardware threads (" +
                         num(max_num_threads()) + "): more threads only add contention, and tens of thousands "
                         "exhaust the thread stacks",
                     "pass --num-threads 0 for OpenMP's default (one per hardware thread)");
  }
  require(!o.sequence_parallel || o.tensor_model_parallel_size > 1,
          "--sequence-parallel needs --tensor-model-parallel-size above 1");
  require(!(o.fp8_grad_comm && o.grad_reduce_in_bf16), "--fp8-grad-comm contradicts --grad-reduce-in-bf16");
  require(!(o.fp8_grad_comm && o.use_distributed_optimizer == std::optional<bool>(false)),
          "--fp8-grad-comm needs the distributed optimizer (it reduce-scatters FP8 codes into each rank's shard)");
  require(!o.fp8_param_gather || o.fp8_enabled(), "--fp8-param-gather needs --fp8-format (FP8 Linear weights)");
  require(!o.fp8_param_gather || o.fp8.recipe == ScalingRecipe::delayed,
          "--fp8-param-gather needs --fp8-recipe delayed: the owning rank casts each weight with the scale every "
          "rank agreed on the step before");
  // What --fp8-recipe blockwise does not serve: its operands carry per-tile scales that these
  // paths (written for one scale per tensor) do not move or count. Refused, never downgraded.
  if (o.fp8_enabled() && o.fp8.recipe == ScalingRecipe::blockwise) {
    const std::string blockwise = "--fp8-recipe blockwise";
    require(!o.sequence_parallel, "--sequence-parallel is not supported with " + blockwise +
                                      ": its FP8 all-gather moves one scale per tensor, not per-tile scales");
    require(o.fp8_stats_interval == 0, "--fp8-stats-interval is not supported with " + blockwise +
                                           ": the statistics describe one scale per tensor");
    require(!o.fp8_auto_precision, "--fp8-auto-precision is not supported with " + blockwise +
                                       ": it decides from the per-tensor FP8 statistics");
  }
  // Delayed scaling reacts to the window's maximum: a window of more than 65,536 steps is
  // longer than most runs, and the histories (states x length floats, host and GPU) grow with it.
  require(o.fp8.amax_history_len >= 1 && o.fp8.amax_history_len <= kMaxAmaxHistoryLen,
          "--fp8-amax-history-len must be in [1, " + num(kMaxAmaxHistoryLen) + "] (got " +
              num(o.fp8.amax_history_len) + ")");
  require(o.fp8.margin >= 0 && o.fp8.margin <= kMaxFp8Margin,
          "--fp8-margin must be in [0, " + num(kMaxFp8Margin) + "] (got " + num(o.fp8.margin) + ")");
  // As in Megatron, the counts are read only under --first-last-layers-bf16; their sum against
  // the model's layers is checked once the config is known (resolve_run_setup).
  if (o.first_last_layers_bf16) {
    require(o.num_layers_at_start_in_bf16 >= 0,
            "--num-layers-at-start-in-bf16 must be >= 0 (got " + num(o.num_layers_at_start_in_bf16) + ")");
    require(o.num_layers_at_end_in_bf16 >= 0,
            "--num-layers-at-end-in-bf16 must be >= 0 (got " + num(o.num_layers_at_end_in_bf16) + ")");
  }
  // Activation recomputation, as Megatron takes it; the layer count against the model in
  // resolve_run_setup.
  require(o.recompute_method.empty() || o.recompute_granularity == "full",
          "--recompute-method needs --recompute-granularity full (selective recomputation has no method)");
  require(!o.given("--recompute-num-layers") || o.recompute_granularity == "full",
          "--recompute-num-layers needs --recompute-granularity full");
  require(o.recompute_granularity != "full" || !o.recompute_method.empty(),
          "--recompute-granularity full needs --recompute-method uniform (every block, in groups of "
          "--recompute-num-layers) or block (the first --recompute-num-layers blocks)");
  require(!o.given("--recompute-modules") || o.recompute_granularity == "selective",
          "--recompute-modules needs --recompute-granularity selective (or --recompute-activations)");
  require(o.recompute_num_layers >= 1,
          "--recompute-num-layers must be >= 1 (got " + num(o.recompute_num_layers) + ")");
  // Block numbers are checked against the model's layers once the config is known (resolve_run_setup).
  require(o.bf16_blocks.empty() || o.fp8_enabled(),
          "--bf16-blocks needs --fp8-format: without FP8 GEMMs every block already runs in BF16 (or FP32)");
  require(!o.fp8_auto_precision || o.fp8_enabled(),
          "--fp8-auto-precision needs --fp8-format: it moves blocks from FP8 GEMMs to BF16 ones");
  for (const char* flag : {"--fp8-auto-precision-saturation", "--fp8-auto-precision-underflow",
                           "--fp8-auto-precision-steps"})
    require(!o.given(flag) || o.fp8_auto_precision, std::string(flag) + " needs --fp8-auto-precision");
  require(o.fp8_auto_precision_steps >= 0,
          "--fp8-auto-precision-steps must be >= 0 (got " + num(o.fp8_auto_precision_steps) + ")");
  require(o.fp8.interval >= 1, "--fp8-interval must be >= 1 (got " + num(o.fp8.interval) + ")");
  require(o.benchmark_warmup >= 0, "--benchmark-warmup must be >= 0 (got " + num(o.benchmark_warmup) + ")");
  require(!o.benchmark || o.train_iters > o.benchmark_warmup,
          "--train-iters must exceed --benchmark-warmup under --benchmark");
  // fp8lm sample times its decode steps, which wait for the device anyway.
  require(!o.profile_ops || o.benchmark || o.command == RunCommand::sample,
          "--profile-ops needs --benchmark (it times synchronised steps)");
  require(o.mock_data || o.train_iters == 0 || !o.train_data_path.empty() || !o.train_data_blend.empty() ||
              !o.data_path.empty(),
          "--train-data-path or --data-path is required (or --mock-data for a synthetic token stream)");
  if (!o.train_data_blend.empty()) {
    require(!o.mock_data, "--train-data-path contradicts --mock-data");
    parse_data_path(o.train_data_blend, "--train-data-path");
  }
  if (!o.valid_data_blend.empty()) parse_data_path(o.valid_data_blend, "--valid-data-path");
  if (!o.test_data_blend.empty()) parse_data_path(o.test_data_blend, "--test-data-path");
  if (!o.data_path.empty()) {
    require(o.train_data_path.empty() && o.valid_data_path.empty() && o.test_data_path.empty() &&
                o.train_data_blend.empty() && o.valid_data_blend.empty() && o.test_data_blend.empty(),
            "--data-path contradicts --train-data-path, --valid-data-path and --test-data-path: --data-path's --split "
            "makes the train, valid and test sets; give one or the other, as Megatron asserts");
    require(!o.mock_data, "--data-path contradicts --mock-data");
    parse_data_path(o.data_path);  // InputError naming --data-path
    const auto split = parse_split(o.split);
    require(split[0] > 0 || o.train_iters == 0, "--split " + o.split + " leaves no documents for training");
  }
  auto positive = [&](const std::optional<int>& value, const char* flag) {
    require(!value || *value >= 1, std::string(flag) + " must be >= 1 (got " + (value ? num(*value) : "") + ")");
  };
  positive(o.model.num_layers, "--num-layers");
  positive(o.model.hidden_size, "--hidden-size");
  positive(o.model.num_attention_heads, "--num-attention-heads");
  positive(o.model.ffn_hidden_size, "--ffn-hidden-size");
  positive(o.model.max_position_embeddings, "--max-position-embeddings");
  positive(o.model.vocab_size, "--vocab-size");
  positive(o.model.kv_channels, "--kv-channels");
  auto positive_real = [&](const std::optional<double>& value, const char* flag, double max) {
    require(!value || (std::isfinite(*value) && *value > 0.0 && *value <= max),
            std::string(flag) + " must be a number in (0, " + format_real(max) + "] (got " +
                (value ? format_real(*value) : "") + ")");
  };
  positive_real(o.model.init_method_std, "--init-method-std", 10.0);
  positive_real(o.model.norm_epsilon, "--norm-epsilon", 0.5);
  require(!o.model.vocab_size || *o.model.vocab_size <= kMaxVocabSize,
          "--vocab-size " + (o.model.vocab_size ? num(*o.model.vocab_size) : "") + " exceeds " + num(kMaxVocabSize) +
              ": tokens are stored as uint16, so the vocabulary holds at most 65,536 ids");
}

ParsedCommandLine parse_train_command_line(const std::vector<std::string>& args) {
  ParsedCommandLine parsed;
  TrainOptions& o = parsed.options;

  CLI::App app{"fp8lm train: pretrain a GPT model with FP8 GEMMs", "fp8lm train"};
  // As with argparse (Megatron), a repeated flag takes its last value, so scripts can
  // append overrides.
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.get_formatter()->column_width(40);

  // ---- Model
  const char* model = "Model";
  app.add_option("--config", o.config_path, "GPT config JSON (Hugging Face GPT-2 config.json keys)")->group(model);
  app.add_option("--num-layers", o.model.num_layers, "Override n_layer")->group(model);
  app.add_option("--hidden-size", o.model.hidden_size, "Override n_embd")->group(model);
  app.add_option("--num-attention-heads", o.model.num_attention_heads, "Override n_head")->group(model);
  app.add_option("--ffn-hidden-size", o.model.ffn_hidden_size, "Override n_inner (MLP width)")->group(model);
  app.add_option("--max-position-embeddings", o.model.max_position_embeddings, "Override n_positions")->group(model);
  app.add_option("--vocab-size", o.model.vocab_size, "Override vocab_size")->group(model);
  app.add_option("--kv-channels", o.model.kv_channels,
                 "A head's width: only hidden-size / num-attention-heads (Megatron's default), checked")
      ->group(model);
  app.add_option("--init-method-std", o.model.init_method_std,
                 "Standard deviation of the initial weights (the residual projections': this / sqrt(2 x layers)); "
                 "overrides initializer_range (default 0.02)")
      ->group(model);
  app.add_option("--norm-epsilon", o.model.norm_epsilon, "Override layer_norm_epsilon (default 1e-5)")->group(model);
  app.add_flag("--untie-embeddings-and-output-weights", o.model.untie_embeddings_and_output_weights,
               "Give the LM head its own weight, lm_head.weight, instead of the token embedding's (the config's "
               "tie_word_embeddings false)")
      ->group(model);
  app.add_option("--transformer-impl", o.transformer_impl,
                 "Accepted for Megatron compatibility; fp8lm has one implementation")
      ->check(CLI::IsMember({"transformer_engine", "local"}))
      ->group(model);

  // ---- Precision
  const char* precision = "Precision";
  bool bf16 = false, fp32 = false, fp8_hybrid = false, fp8_e4m3 = false;
  std::string fp8_format, fp8_recipe = "delayed", amax_algo(to_string(o.fp8.amax_compute_algo)),
      state_precision = "fp8-fp16";
  app.add_flag("--bf16", bf16, "BF16 mixed precision (the default without an FP8 flag)")->group(precision);
  app.add_flag("--fp32", fp32, "FP32 GEMMs (a reference mode, for debugging)")->group(precision);
  app.add_option("--fp8-format", fp8_format, "FP8 GEMMs: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients)")
      ->check(CLI::IsMember({"e4m3", "hybrid"}))
      ->group(precision);
  app.add_flag("--fp8-hybrid", fp8_hybrid, "Old spelling of --fp8-format hybrid")->group(precision);
  app.add_flag("--fp8-e4m3", fp8_e4m3, "Old spelling of --fp8-format e4m3")->group(precision);
  app.add_option("--fp8-recipe", fp8_recipe,
                 "FP8 scaling: delayed (amax history), tensorwise (current, per tensor) or blockwise (current, per "
                 "1x128 tile of activations and gradients and 128x128 block of weights)")
      ->check(CLI::IsMember({"delayed", "tensorwise", "blockwise"}))
      ->group(precision);
  app.add_option("--fp8-margin", o.fp8.margin, "Scale = fp8_max / amax / 2^margin")->group(precision);
  app.add_option("--fp8-interval", o.fp8.interval, "Update delayed scales every N steps")->group(precision);
  app.add_option("--fp8-amax-history-len", o.fp8.amax_history_len, "Amax history window (delayed scaling), 1 to 65536")
      ->group(precision);
  app.add_option("--fp8-amax-compute-algo", amax_algo, "Amax of the window: max or most_recent")
      ->check(CLI::IsMember({"max", "most_recent"}))
      ->group(precision);
  app.add_flag("--fp8-lm-head", o.fp8_lm_head, "Run the tied LM-head GEMMs in FP8 too (default BF16)")
      ->group(precision);
  std::string fast_accumulation = "forward";
  app.add_option("--fp8-fast-accumulation", fast_accumulation,
                 "Which FP8 GEMMs sum on the tensor cores alone, without FP32 promotion: forward (Transformer "
                 "Engine's default) or all (the layers' dgrad and wgrad too, not the LM head's: faster, less "
                 "precise sums)")
      ->check(CLI::IsMember({"forward", "all"}))
      ->group(precision);
  app.add_flag_callback(
         "--no-fp8-weight-transpose-cache", [&o] { o.fp8_weight_transpose_cache = false; },
         "Keep no transposed copy of the FP8 Linear weights: the backward writes each from the weight's codes "
         "before its dgrad GEMM (1 byte a weight less, one transpose a dgrad more; per-tensor recipes)")
      ->group(precision);
  app.add_flag("--first-last-layers-bf16", o.first_last_layers_bf16,
               "Under FP8, run the first and last blocks' Linear GEMMs in BF16 (counts below)")
      ->group(precision);
  app.add_option("--num-layers-at-start-in-bf16", o.num_layers_at_start_in_bf16,
                 "With --first-last-layers-bf16: how many blocks at the start run in BF16")
      ->group(precision);
  app.add_option("--num-layers-at-end-in-bf16", o.num_layers_at_end_in_bf16,
                 "With --first-last-layers-bf16: how many blocks at the end run in BF16")
      ->group(precision);
  std::string bf16_blocks;
  app.add_option("--bf16-blocks", bf16_blocks,
                 "Under FP8, run these blocks' Linear GEMMs in BF16: block numbers from 0, comma-separated (0,5,11)")
      ->group(precision);
  app.add_flag("--fp8-auto-precision", o.fp8_auto_precision,
               "Under FP8, switch a block to BF16 GEMMs for good when an FP8 operand of it saturates or underflows "
               "beyond the thresholds below (checked every step of the calibration window, then at each "
               "--fp8-stats-interval)")
      ->group(precision);
  app.add_option("--fp8-auto-precision-saturation", o.fp8_auto_precision_saturation,
                 "With --fp8-auto-precision: switch above this fraction of an operand's elements saturated")
      ->group(precision);
  app.add_option("--fp8-auto-precision-underflow", o.fp8_auto_precision_underflow,
                 "With --fp8-auto-precision: switch above this fraction of an operand's elements flushed to zero")
      ->group(precision);
  app.add_option("--fp8-auto-precision-steps", o.fp8_auto_precision_steps,
                 "With --fp8-auto-precision: the calibration window, the first N steps, checked every step")
      ->group(precision);
  app.add_option("--optimizer-state-precision", state_precision,
                 "AdamW moments: fp8-fp16 (E4M3 m, FP16 v, FP8-LLM) or fp32")
      ->check(CLI::IsMember({"fp8-fp16", "fp32"}))
      ->group(precision);
  // Megatron's precision-aware optimizer (Transformer Engine's FusedAdam): the dtypes of the main
  // gradients, the master weights and the two moments, resolved onto fp8lm's own choices below.
  bool precision_aware_optimizer = false;
  std::string main_grads_dtype, main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype;
  app.add_flag("--use-precision-aware-optimizer", precision_aware_optimizer,
               "Megatron's switch for the four dtype flags below (fp8lm's AdamW is always precision-aware)")
      ->group(precision);
  app.add_option("--main-grads-dtype", main_grads_dtype, "Gradients: fp32 (default) or bf16 (= --grad-reduce-in-bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->group(precision);
  app.add_option("--main-params-dtype", main_params_dtype, "Master weights: fp32 (fp8lm keeps FP32 master weights)")
      ->check(CLI::IsMember({"fp32", "fp16"}))
      ->group(precision);
  app.add_option("--exp-avg-dtype", exp_avg_dtype,
                 "First moment: fp8 (E4M3, with --exp-avg-sq-dtype fp16) or fp32 (with fp32)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16", "fp8"}))
      ->group(precision);
  app.add_option("--exp-avg-sq-dtype", exp_avg_sq_dtype,
                 "Second moment: fp16 (with --exp-avg-dtype fp8) or fp32 (with fp32)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16", "fp8"}))
      ->group(precision);
  std::string weight_casts = "fused";
  app.add_option("--optimizer-weight-casts", weight_casts,
                 "fused: AdamW's update pass also writes the next step's FP8 Linear weights and their transposes "
                 "(delayed scaling, fp8-fp16 state, no distributed optimizer; default); separate: cast from the "
                 "master weights after the update")
      ->check(CLI::IsMember({"fused", "separate"}))
      ->group(precision);
  std::string first_pass = "backward";
  app.add_option("--optimizer-first-pass", first_pass,
                 "backward: AdamW's first pass (the moments' amaxes and the gradient norm) runs layer by layer "
                 "beside the last micro-batch's backward, each part beside the next attention backward "
                 "(fp8-fp16 state on one rank; default); step: at the step's end")
      ->check(CLI::IsMember({"backward", "step"}))
      ->group(precision);

  // ---- Batch and schedule
  const char* training = "Training";
  app.add_option("--micro-batch-size", o.micro_batch_size, "Sequences per GPU per forward/backward")->group(training);
  app.add_option("--recompute-granularity", o.recompute_granularity,
                 "Activation recomputation: full (a recomputed block keeps only its input; its backward reruns "
                 "its forward) or selective (--recompute-modules)")
      ->check(CLI::IsMember({"full", "selective"}))
      ->group(training);
  app.add_flag_callback(
         "--recompute-activations", [&o] { o.recompute_granularity = "selective"; },
         "Megatron's shorthand for --recompute-granularity selective")
      ->group(training);
  app.add_option("--recompute-modules", o.recompute_modules,
                 "With --recompute-granularity selective: what each block's backward recomputes: core_attn "
                 "(default; the fused attention keeps no score matrix: an FP8 block's attention output cast again), "
                 "layernorm (the LayerNorm outputs; an FP8 block's codes written again), mlp (c_fc's and the "
                 "GELU's outputs, one c_fc GEMM more)")
      ->check(CLI::IsMember({"core_attn", "layernorm", "mlp"}))
      ->group(training);
  app.add_option("--recompute-method", o.recompute_method,
                 "With --recompute-granularity full: uniform (every block, in groups of --recompute-num-layers "
                 "whose first block keeps its input) or block (the first --recompute-num-layers blocks)")
      ->check(CLI::IsMember({"uniform", "block"}))
      ->group(training);
  app.add_option("--recompute-num-layers", o.recompute_num_layers,
                 "With --recompute-granularity full: the group size (uniform) or the blocks recomputed (block); "
                 "default 1")
      ->group(training);
  app.add_option("--global-batch-size", o.global_batch_size,
                 "Sequences per optimizer step (0: micro-batch x data-parallel size)")
      ->group(training);
  app.add_option("--seq-length", o.seq_length, "Tokens per sequence (0: the config's n_positions)")->group(training);
  app.add_option("--train-iters", o.train_iters, "Optimizer steps")->group(training);
  app.add_option("--lr", o.lr, "Peak learning rate")->group(training);
  app.add_option("--min-lr", o.min_lr, "Learning rate at the end of decay")->group(training);
  app.add_option("--lr-warmup-iters", o.lr_warmup_iters, "Linear warm-up steps")->group(training);
  app.add_option("--lr-warmup-fraction", o.lr_warmup_fraction,
                 "Linear warm-up over this fraction of the decay steps (instead of --lr-warmup-iters)")
      ->group(training);
  app.add_option("--lr-warmup-init", o.lr_warmup_init, "Learning rate the warm-up starts from")->group(training);
  app.add_option("--lr-decay-iters", o.lr_decay_iters, "Decay steps (-1: --train-iters)")->group(training);
  app.add_option("--train-samples", o.train_samples,
                 "Sequences to train on, instead of --train-iters: that many global batches, rounded down")
      ->group(training);
  app.add_option("--lr-decay-samples", o.lr_decay_samples,
                 "With --train-samples: the decay over this many sequences (-1: --train-samples)")
      ->group(training);
  app.add_option("--lr-warmup-samples", o.lr_warmup_samples, "With --train-samples: linear warm-up over this many sequences")
      ->group(training);
  app.add_option("--rampup-batch-size", o.rampup_batch_size,
                 "START INCREMENT SAMPLES, with --train-samples: the global batch grows from START by INCREMENT over "
                 "the first SAMPLES sequences, then stays at --global-batch-size")
      ->expected(3)
      ->group(training);
  std::string decay_style(to_string(o.lr_decay_style));
  app.add_option("--lr-decay-style", decay_style,
                 "cosine, linear (Megatron's default), constant, inverse-square-root, or WSD (warm-up, stable, "
                 "then an anneal over the last --lr-wsd-decay-iters of the decay)")
      ->check(CLI::IsMember({"cosine", "linear", "constant", "inverse-square-root", "WSD"}))
      ->group(training);
  std::string wsd_style(to_string(o.lr_wsd_decay_style));
  app.add_option("--lr-wsd-decay-style", wsd_style,
                 "WSD's anneal: exponential (Megatron's default), linear, cosine or minus_sqrt")
      ->check(CLI::IsMember({"exponential", "linear", "cosine", "minus_sqrt"}))
      ->group(training);
  app.add_option("--lr-wsd-decay-iters", o.lr_wsd_decay_iters, "WSD: the anneal's steps, the last of the decay's")
      ->group(training);
  app.add_option("--lr-wsd-decay-samples", o.lr_wsd_decay_samples,
                 "WSD with --train-samples: the anneal's sequences, the last of the decay's")
      ->group(training);
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay (2-D weights only)")->group(training);
  std::string weight_decay_style(to_string(o.weight_decay_incr_style));
  app.add_option("--weight-decay-incr-style", weight_decay_style,
                 "constant (--weight-decay throughout; Megatron's default), or linear or cosine from "
                 "--start-weight-decay to --end-weight-decay over the run")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}))
      ->group(training);
  app.add_option("--start-weight-decay", o.start_weight_decay,
                 "With --weight-decay-incr-style linear|cosine: the weight decay the ramp starts from")
      ->group(training);
  app.add_option("--end-weight-decay", o.end_weight_decay,
                 "With --weight-decay-incr-style linear|cosine: the weight decay at the run's end")
      ->group(training);
  app.add_option("--adam-beta1", o.adam_beta1, "AdamW beta1")->group(training);
  app.add_option("--adam-beta2", o.adam_beta2, "AdamW beta2")->group(training);
  app.add_option("--adam-eps", o.adam_eps, "AdamW epsilon")->group(training);
  app.add_option("--clip-grad", o.clip_grad, "Clip to this global gradient norm (0: off)")->group(training);
  app.add_option("--max-skipped-steps", o.max_skipped_steps,
                 "Stop after this many non-finite steps in a row")
      ->group(training);
  std::string seed_text = std::to_string(o.seed);
  app.add_option("--seed", seed_text, "Seed for initialisation and data order (0 to 2^64 - 1)")->group(training);

  // ---- Data
  const char* data = "Data";
  // Each occurrence's values apart: a repeated flag keeps its last list, as every other flag.
  std::vector<std::vector<std::string>> train_data_values, valid_data_values, test_data_values;
  app.add_option("--train-data-path", train_data_values,
                 "Token shards (see --data-format; a glob), or Megatron indexed datasets used whole for training: "
                 "PREFIX, or weight/prefix pairs 0.3 PREFIX_A 0.7 PREFIX_B")
      ->expected(1, CLI::detail::expected_max_vector_size)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(data);
  app.add_option("--valid-data-path", valid_data_values,
                 "Validation token shards (a glob), or Megatron indexed datasets used whole for validation")
      ->expected(1, CLI::detail::expected_max_vector_size)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(data);
  app.add_option("--test-data-path", test_data_values,
                 "Test token shards (a glob), or Megatron indexed datasets used whole: --eval-iters batches scored "
                 "once, at the end of training")
      ->expected(1, CLI::detail::expected_max_vector_size)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(data);
  app.add_flag("--mock-data", o.mock_data, "Synthetic learnable token stream instead of files")->group(data);
  app.add_option("--data-path", o.data_path,
                 "Megatron indexed dataset(s) (PREFIX.bin/.idx): PREFIX, or a weighted blend 0.3 PREFIX_A 0.7 PREFIX_B")
      ->expected(1, CLI::detail::expected_max_vector_size)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(data);
  app.add_option("--split", o.split, "Train/valid/test weights over --data-path's documents")->group(data);
  app.add_flag("--eod-mask-loss", o.eod_mask_loss,
               "Leave the prediction made from each end-of-document token (the next document's first token) out of "
               "the loss and its mean, as Megatron (the token: --vocab-file's <|endoftext|>, else GPT-2's 50256)")
      ->group(data);
  app.add_flag("--reset-position-ids", o.reset_position_ids,
               "Restart the position ids after each end-of-document token, so each document's first token takes "
               "position 0, as Megatron (the token as for --eod-mask-loss)")
      ->group(data);
  app.add_flag("--reset-attention-mask", o.reset_attention_mask,
               "Keep attention within each document: tokens after an end-of-document token do not attend to "
               "those before it, as Megatron")
      ->group(data);
  app.add_option("--hellaswag-path", o.hellaswag_path,
                 "llm.c's multiple-choice eval file (HellaSwag's hellaswag_val.bin from llm.c's dev/data/hellaswag.py): "
                 "its accuracy is logged at every evaluation")
      ->group(data);
  app.add_flag("--calculate-per-token-loss", o.calculate_per_token_loss,
               "With --eod-mask-loss, one mean over the step's unmasked tokens (Megatron's), not each micro-batch's "
               "mean; without the mask every micro-batch counts the same tokens and nothing changes")
      ->group(data);
  std::string data_args_path, per_split_data_args_path;
  app.add_option("--data-args-path", data_args_path, "A file holding --data-path's list (for long blends)")
      ->group(data);
  app.add_option("--per-split-data-args-path", per_split_data_args_path,
                 "A JSON file of Megatron's per-split lists: \"train\", \"valid\" and \"test\" (as --train-data-path, "
                 "--valid-data-path and --test-data-path)")
      ->group(data);
  std::string data_format = "llmc";
  app.add_option("--vocab-file", o.vocab_file,
                 "GPT-2's encoder.json: checked to fit the model's vocabulary (the data is tokenized already)")
      ->group(data);
  app.add_option("--merge-file", o.merge_file, "GPT-2's vocab.bpe, with --vocab-file")->group(data);
  app.add_option("--tokenizer-type", o.tokenizer_type, "Only GPT2BPETokenizer (Megatron's name)")->group(data);
  app.add_option("--data-format", data_format,
                 "Shard format: llmc (llm.c .bin: header with magic 20240520, then uint16 tokens) or raw-uint16 "
                 "(nanoGPT: uint16 tokens only)")
      ->check(CLI::IsMember({"llmc", "raw-uint16"}))
      ->group(data);

  // ---- Checkpoints
  const char* checkpoints = "Checkpoints";
  app.add_option("--save", o.save_dir, "Checkpoint directory to write")->group(checkpoints);
  app.add_option("--load", o.load_dir,
                 "Checkpoint directory to resume from (the --save directory without a checkpoint yet: from iteration 0)")
      ->group(checkpoints);
  app.add_flag("--exit-on-missing-checkpoint", o.exit_on_missing_checkpoint,
               "With --load: an error, not a fresh start, when --load holds no checkpoint yet")
      ->group(checkpoints);
  app.add_flag("--use-checkpoint-opt_param-scheduler", o.use_checkpoint_lr_schedule,
               "With --load: the checkpoint's learning-rate schedule (rates, warm-up, decay style and steps) over "
               "the flags")
      ->group(checkpoints);
  app.add_option("--save-interval", o.save_interval, "Save every N steps (0: only at the end and on SIGTERM)")
      ->group(checkpoints);
  app.add_option("--save-retain-interval", o.save_retain_interval,
                 "Keep the checkpoints of every N-th iteration and the latest: a save removes the one before it "
                 "otherwise (0: keep all)")
      ->group(checkpoints);
  app.add_option("--check-weight-hash-across-dp-replicas-interval", o.check_weight_hash_interval,
                 "Every N iterations compare the data-parallel replicas' parameters (CRC-32); a difference stops the "
                 "run naming the ranks (0: never)")
      ->group(checkpoints);
  app.add_option("--exit-interval", o.exit_interval,
                 "Stop (saving a checkpoint with --save) once the iteration is a multiple of N; 0: off")
      ->group(checkpoints);
  app.add_option("--exit-duration-in-mins", o.exit_duration_in_mins,
                 "Stop (saving a checkpoint with --save) after the step that ends this many minutes into the run")
      ->group(checkpoints);
  app.add_option("--ckpt-step", o.ckpt_step, "With --load: resume from this iteration instead of `latest`")
      ->group(checkpoints);
  app.add_flag("--no-save-optim", o.no_save_optim,
               "Checkpoints without the AdamW moments (about half the bytes); resuming from one needs --no-load-optim")
      ->group(checkpoints);
  app.add_flag("--no-load-optim", o.no_load_optim,
               "With --load: restore the weights, FP8 scaling state and progress, and start the optimizer fresh")
      ->group(checkpoints);
  app.add_flag("--finetune", o.finetune,
               "With --load: start from the checkpoint's weights only, at iteration 0 with a fresh optimizer "
               "(as --init-from)")
      ->group(checkpoints);
  app.add_option("--init-from", o.init_from,
                 "Start from these weights only: a Hugging Face GPT-2 model.safetensors (or its directory) "
                 "or an fp8lm checkpoint")
      ->group(checkpoints);

  // ---- Evaluation and logging
  const char* logging = "Logging and evaluation";
  app.add_option("--eval-interval", o.eval_interval, "Validation every N steps (0: never)")->group(logging);
  app.add_option("--eval-iters", o.eval_iters, "Validation batches per evaluation")->group(logging);
  app.add_option("--log-interval", o.log_interval, "Log every N steps")->group(logging);
  app.add_option("--metrics-file", o.metrics_file, "Append one JSON line per log interval here")->group(logging);
  app.add_option("--fp8-stats-interval", o.fp8_stats_interval,
                 "Every N steps, per FP8 operand: amax, scale, saturated/underflow/subnormal fractions, into the "
                 "metrics file and a log summary (0: off)")
      ->group(logging);
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn or error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}))
      ->group(logging);

  // ---- Parallelism and device
  const char* system = "Parallelism and device";
  app.add_option("--tensor-model-parallel-size", o.tensor_model_parallel_size,
                 "Tensor-parallel group size (consecutive ranks); the data-parallel size is the rest of the world")
      ->group(system);
  app.add_flag("--sequence-parallel", o.sequence_parallel,
               "Split LayerNorm, residual and dropout regions along the sequence across tensor-parallel ranks")
      ->group(system);
  bool distributed_optimizer = false, no_distributed_optimizer = false;
  app.add_flag("--use-distributed-optimizer", distributed_optimizer,
               "Shard FP32 master weights and optimizer state across data-parallel ranks (ZeRO-1; the default when "
               "the data-parallel size is above 1)")
      ->group(system);
  app.add_flag("--no-use-distributed-optimizer", no_distributed_optimizer,
               "Keep the whole optimizer state on every data-parallel rank (all-reduce the gradients)")
      ->group(system);
  app.add_flag("--grad-reduce-in-bf16", o.grad_reduce_in_bf16, "Keep the gradients in BF16 (Megatron's BF16 main_grad, at any data-parallel "
               "size): accumulated and reduced across data-parallel ranks in BF16, 2 bytes per parameter")
      ->group(system);
  app.add_flag("--fp8-grad-comm", o.fp8_grad_comm,
               "Reduce gradients in FP8 with one agreed scale per tensor (FP8-LM's automatic scaling)")
      ->group(system);
  std::string fp8_grad_reduce = "all-to-all";
  app.add_option("--fp8-grad-reduce", fp8_grad_reduce,
                 "FP8 gradient reduction: all-to-all (exchange codes, sum in FP32) or reduce-scatter (NCCL's FP8 sums)")
      ->check(CLI::IsMember({"all-to-all", "reduce-scatter"}))
      ->group(system);
  app.add_flag("--fp8-param-gather", o.fp8_param_gather,
               "All-gather the Linear weights as FP8 codes cast by their owning rank, instead of BF16")
      ->group(system);
  app.add_flag("--overlap-grad-reduce", o.overlap_grad_reduce,
               "Reduce each bucket's gradients while the backward pass continues")
      ->group(system);
  app.add_flag("--overlap-param-gather", o.overlap_param_gather,
               "Gather each bucket's weights while the next forward pass runs")
      ->group(system);
  app.add_option("--distributed-timeout-minutes", o.distributed_timeout_minutes,
                 "End the job when a rank makes no progress for this long")
      ->group(system);
  std::string device = "auto";
  std::string gemm_algorithm = "timed";
  std::string programmatic_launch = "on";
  app.add_option("--device", device, "auto (CUDA if a GPU is present), cuda or cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))
      ->group(system);
  app.add_option("--num-threads", o.num_threads, "CPU threads (0: OpenMP default; at most 4 per hardware thread)")
      ->group(system);
  app.add_flag("--benchmark", o.benchmark,
               "Time every step (synchronised) and report the median step, tokens/s, MFU and peak memory")
      ->group(system);
  app.add_option("--benchmark-warmup", o.benchmark_warmup, "Steps left out of the benchmark timing")->group(system);
  app.add_option("--gemm-algorithm", gemm_algorithm,
                 "timed: cuBLASLt's candidate algorithms timed once per GEMM shape, the fastest with the heuristic's "
                 "bits kept (default); heuristic: the heuristic's first")
      ->check(CLI::IsMember({"timed", "heuristic"}))
      ->group(system);
  app.add_option("--programmatic-launch", programmatic_launch,
                 "on: each fp8lm kernel is placed on the GPU while the one before it finishes, and waits for it "
                 "there (programmatic dependent launch; default); off: plain stream order. The same bits either way")
      ->check(CLI::IsMember({"on", "off"}))
      ->group(system);
  app.add_flag("--profile-ops", o.profile_ops,
               "With --benchmark: time every op class of the timed steps (GEMMs by precision and pass, LayerNorm, "
               "attention, GELU, casts, loss, optimizer) against its floor")
      ->group(system);

  MegatronFlagValues megatron;
  add_megatron_compatibility_flags(app, megatron);
  // Unknown arguments are reported here, the first in command-line order, with the nearest flag.
  app.allow_extras();

  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 consumes from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    parsed.help_requested = true;
    parsed.help_text = app.help();
    return parsed;
  } catch (const CLI::ParseError& e) {
    bad_flag(e.what());
  }
  if (const std::vector<std::string> extras = app.remaining(); !extras.empty()) {
    std::vector<std::string> known;
    for (const CLI::Option* option : app.get_options())
      for (const std::string& name : option->get_lnames()) known.push_back("--" + name);
    bad_flag(unknown_flag_message(extras.front(), known));
  }
  o.megatron_no_effect = check_megatron_compatibility_flags(megatron, o.megatron_warnings);

  o.seed = parse_unsigned_flag("--seed", seed_text);
  o.bf16_blocks = parse_block_list("--bf16-blocks", bf16_blocks);
  for (const CLI::Option* option : app.get_options())
    if (option->count() > 0) o.given_flags.insert(option->get_name());

  // Precision resolution follows Megatron: an FP8 format turns FP8 GEMMs on (with or
  // without --bf16); otherwise BF16.
  if (fp8_hybrid && fp8_e4m3) bad_flag("--fp8-hybrid contradicts --fp8-e4m3");
  if (fp8_hybrid && !fp8_format.empty() && fp8_format != "hybrid")
    bad_flag("--fp8-hybrid contradicts --fp8-format " + fp8_format);
  if (fp8_e4m3 && !fp8_format.empty() && fp8_format != "e4m3")
    bad_flag("--fp8-e4m3 contradicts --fp8-format " + fp8_format);
  if (fp8_hybrid) fp8_format = "hybrid";
  if (fp8_e4m3) fp8_format = "e4m3";
  if (fp32 && (bf16 || !fp8_format.empty())) bad_flag("--fp32 contradicts --bf16 and --fp8-format");
  if (!fp8_format.empty()) {
    o.precision = GemmPrecision::fp8;
    o.fp8.format = fp8_format == "hybrid" ? Fp8Format::hybrid : Fp8Format::e4m3;
  } else {
    o.precision = fp32 ? GemmPrecision::fp32 : GemmPrecision::bf16;
  }
  if (o.fp8_lm_head && !o.fp8_enabled()) bad_flag("--fp8-lm-head needs --fp8-format");
  o.fp8_fast_accumulation = fast_accumulation == "all" ? Fp8FastAccumulation::all : Fp8FastAccumulation::forward;
  if (o.fp8_fast_accumulation == Fp8FastAccumulation::all && !o.fp8_enabled())
    bad_flag("--fp8-fast-accumulation all needs --fp8-format");
  o.fp8.recipe = lookup<ScalingRecipe>({{"delayed", ScalingRecipe::delayed},
                                        {"tensorwise", ScalingRecipe::tensorwise},
                                        {"blockwise", ScalingRecipe::blockwise}},
                                       fp8_recipe);
  o.fp8.amax_compute_algo = amax_algo == "max" ? AmaxComputeAlgo::max : AmaxComputeAlgo::most_recent;
  if (!o.fp8_weight_transpose_cache && !o.fp8_enabled())
    bad_flag("--no-fp8-weight-transpose-cache needs --fp8-format: only FP8 weights keep a transposed copy");
  if (!o.fp8_weight_transpose_cache && o.fp8.recipe == ScalingRecipe::blockwise)
    bad_flag("--no-fp8-weight-transpose-cache: a block-scaled weight's transposed copy carries its own block scales "
             "(use --fp8-recipe delayed or tensorwise)");
  if (o.fp8_fast_accumulation == Fp8FastAccumulation::all && o.fp8.recipe == ScalingRecipe::blockwise)
    bad_flag("--fp8-fast-accumulation all: block-scaled GEMMs always promote their sums (cuBLASLt refuses fast "
             "accumulation with block scaling)");
  o.optimizer_state =
      state_precision == "fp32" ? OptimizerStatePrecision::fp32 : OptimizerStatePrecision::fp8_fp16;
  resolve_precision_aware_optimizer(o, {.enabled = precision_aware_optimizer,
                                        .main_grads = main_grads_dtype,
                                        .main_params = main_params_dtype,
                                        .exp_avg = exp_avg_dtype,
                                        .exp_avg_sq = exp_avg_sq_dtype,
                                        .state_precision_given = app.count("--optimizer-state-precision") > 0});
  o.fused_weight_casts = weight_casts == "fused";
  o.first_pass_in_backward = first_pass == "backward";
  // Megatron's lists in files, for blends too long for a command line.
  if (!data_args_path.empty()) {
    if (!o.data_path.empty()) bad_flag("--data-args-path contradicts --data-path: give the list once");
    o.data_path = data_list_from_file(data_args_path);
  }
  if (!per_split_data_args_path.empty()) {
    if (!train_data_values.empty() || !valid_data_values.empty() || !test_data_values.empty())
      bad_flag("--per-split-data-args-path contradicts --train-data-path, --valid-data-path and --test-data-path: "
               "give the lists once");
    const PerSplitDataLists lists = per_split_data_lists_from_file(per_split_data_args_path);
    o.train_data_blend = lists.train;
    o.valid_data_blend = lists.valid;
    o.test_data_blend = lists.test;
  }
  // Megatron's per-split paths name indexed datasets; one other value is fp8lm's llm.c shard glob.
  for (auto [values, flag, glob, blend] :
       {std::tuple{&train_data_values, "--train-data-path", &o.train_data_path, &o.train_data_blend},
        std::tuple{&valid_data_values, "--valid-data-path", &o.valid_data_path, &o.valid_data_blend},
        std::tuple{&test_data_values, "--test-data-path", &o.test_data_path, &o.test_data_blend}}) {
    if (values->empty()) continue;
    const std::vector<std::string>& last = values->back();
    if (names_indexed_datasets(last))
      *blend = last;
    else if (last.size() == 1)
      *glob = last.front();
    else
      bad_flag(std::string(flag) + " takes one llm.c shard glob (quote it) or Megatron's indexed datasets, PREFIX "
               "or weight/prefix pairs; got " + std::to_string(last.size()) + " values, the first '" + last.front() +
               "' not a weight");
  }
  o.lr_decay_style = lookup<LrDecayStyle>({{"cosine", LrDecayStyle::cosine},
                                           {"linear", LrDecayStyle::linear},
                                           {"constant", LrDecayStyle::constant},
                                           {"inverse-square-root", LrDecayStyle::inverse_square_root},
                                           {"WSD", LrDecayStyle::wsd}},
                                          decay_style);
  o.lr_wsd_decay_style = lookup<WsdDecayStyle>({{"exponential", WsdDecayStyle::exponential},
                                              {"linear", WsdDecayStyle::linear},
                                              {"cosine", WsdDecayStyle::cosine},
                                              {"minus_sqrt", WsdDecayStyle::minus_sqrt}},
                                             wsd_style);
  o.weight_decay_incr_style = lookup<WeightDecayIncrStyle>({{"constant", WeightDecayIncrStyle::constant},
                                                          {"linear", WeightDecayIncrStyle::linear},
                                                          {"cosine", WeightDecayIncrStyle::cosine}},
                                                         weight_decay_style);
  if (o.weight_decay_incr_style != WeightDecayIncrStyle::constant && app.count("--weight-decay") > 0)
    o.megatron_warnings.push_back("--weight-decay " + format_real(o.weight_decay) + " has no effect with "
                                  "--weight-decay-incr-style " + weight_decay_style +
                                  ": the decay runs from --start-weight-decay to --end-weight-decay, as in Megatron");
  if (distributed_optimizer && no_distributed_optimizer)
    bad_flag("--use-distributed-optimizer contradicts --no-use-distributed-optimizer");
  if (distributed_optimizer) o.use_distributed_optimizer = true;
  if (no_distributed_optimizer) o.use_distributed_optimizer = false;
  o.fp8_grad_reduce = fp8_grad_reduce == "all-to-all" ? GradReduceAlgorithm::all_to_all : GradReduceAlgorithm::reduce_scatter;
  o.data_format = data_format == "raw-uint16" ? TokenFileFormat::raw_uint16 : TokenFileFormat::llmc;
  if (app.count("--split") > 0 && o.data_path.empty()) {
    // Megatron scripts swap --data-path for --mock-data and keep their --split.
    if (!o.mock_data) bad_flag("--split needs --data-path (it splits its documents)");
    o.megatron_no_effect.push_back("--split " + o.split + " with --mock-data: the mock stream has no documents to split");
  }
  if (o.calculate_per_token_loss && !o.eod_mask_loss)
    o.megatron_no_effect.push_back("--calculate-per-token-loss: without a loss mask every micro-batch has the same "
                                   "number of tokens, so fp8lm's mean over the global batch's tokens is the per-token loss");
  if (app.count("--data-format") > 0 && !o.data_path.empty())
    bad_flag("--data-format names the llm.c shard format; --data-path's indexed datasets name their dtype in PREFIX.idx");
  o.device = lookup<DeviceKind>(
      {{"auto", DeviceKind::auto_select}, {"cuda", DeviceKind::cuda}, {"cpu", DeviceKind::cpu}}, device);
  o.gemm_algorithm = gemm_algorithm == "heuristic" ? GemmAlgorithmChoice::heuristic : GemmAlgorithmChoice::timed;
  o.programmatic_launch = programmatic_launch == "on";
  validate_options(o);
  if (o.finetune && o.load_dir.empty())
    bad_flag("--finetune needs --load DIR (the checkpoint whose weights it starts from)");
  if (o.finetune) {  // Megatron's --load DIR --finetune: what --init-from DIR does
    o.init_from = o.load_dir;
    o.load_dir.clear();
  }
  return parsed;
}

bool parse_subcommand_arguments(CLI::App& app, const std::vector<std::string>& args, const std::string& command) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 consumes from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return false;
  } catch (const CLI::ParseError& e) {
    throw InputError("fp8lm " + command + ": " + e.what(), "run `fp8lm " + command + " --help` for its flags");
  }
  return true;
}

}  // namespace fp8lm
