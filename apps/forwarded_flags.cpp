#include "apps/forwarded_flags.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "apps/checkpointing.h"
#include "core/error.h"

namespace fp8lm {

namespace {

namespace fs = std::filesystem;

// --data-path takes a list ([WEIGHT] PREFIX ...), as train's does, and so do Megatron's per-split
// --valid-data-path and --train-data-path.
bool is_list_flag(const std::string& name) {
  return name == "--data-path" || name == "--valid-data-path" || name == "--train-data-path";
}

bool is_precision_choice(const std::string& name) {
  return name == "--bf16" || name == "--fp32" || name == "--fp8-format" || name == "--fp8-hybrid" ||
         name == "--fp8-e4m3";
}

}  // namespace

const std::vector<ForwardedFlag> kWeightsFlags = {
    {"--load", true, "fp8lm checkpoint directory (uses `latest`) or iteration directory"},
    {"--init-from", true, "A Hugging Face GPT-2 model.safetensors (or its directory), or an fp8lm checkpoint"},
    {"--ckpt-step", true, "With --load: this iteration instead of `latest`"},
    {"--config", true, "GPT config JSON (default: the checkpoint's, or config.json beside the model)"},
};

const std::vector<ForwardedFlag> kRuntimeFlags = {
    {"--device", true, "auto (CUDA if a GPU is present), cuda or cpu"},
    {"--num-threads", true, "CPU threads (0: OpenMP default)"},
    {"--log-level", true, "trace, debug, info, warn or error"},
    {"--gemm-algorithm", true, "timed (cuBLASLt's candidates timed once per shape; default) or heuristic"},
    {"--programmatic-launch", true, "on (each kernel placed while the one before it finishes; default) or off"},
};

const std::vector<ForwardedFlag> kPrecisionFlags = {
    {"--bf16", false, "BF16 GEMMs (default: the checkpoint run's precision; BF16 for Hugging Face models)"},
    {"--fp32", false, "FP32 GEMMs (reference mode)"},
    {"--fp8-format", true, "FP8 GEMMs: e4m3 or hybrid"},
    {"--fp8-hybrid", false, "Old spelling of --fp8-format hybrid"},
    {"--fp8-e4m3", false, "Old spelling of --fp8-format e4m3"},
    {"--fp8-recipe", true,
     "delayed (the checkpoint's amax history), tensorwise (current scaling) or blockwise (per-tile current "
     "scaling; not for sample)"},
    {"--fp8-margin", true, "Scale = fp8_max / amax / 2^margin"},
    {"--fp8-interval", true, "Delayed scaling's update interval"},
    {"--fp8-amax-history-len", true, "Amax history window (delayed scaling)"},
    {"--fp8-amax-compute-algo", true, "max or most_recent"},
    {"--fp8-lm-head", false, "The tied LM-head GEMM in FP8 too"},
    {"--first-last-layers-bf16", false, "The first and last blocks' GEMMs in BF16 under FP8 (counts below)"},
    {"--num-layers-at-start-in-bf16", true, "With --first-last-layers-bf16: blocks at the start in BF16"},
    {"--num-layers-at-end-in-bf16", true, "With --first-last-layers-bf16: blocks at the end in BF16"},
    {"--bf16-blocks", true, "These blocks' GEMMs in BF16 under FP8, such as 0,5,11 (default: the checkpoint's)"},
};

ForwardedFlags::ForwardedFlags(CLI::App& app, std::vector<ForwardedFlag> flags) : app_(app), flags_(std::move(flags)) {
  for (const ForwardedFlag& flag : flags_) {
    if (is_list_flag(flag.name))
      app.add_option(flag.name, list_values_, flag.help)
          ->expected(1, CLI::detail::expected_max_vector_size)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    else if (flag.takes_value)
      app.add_option(flag.name, flag.help);
    else
      app.add_flag(flag.name, flag.help);
  }
}

void ForwardedFlags::collect() {
  for (const ForwardedFlag& flag : flags_)
    if (app_.get_option(flag.name)->count() > 0) given_.insert(flag.name);
}

std::string ForwardedFlags::value(const std::string& name) const {
  const CLI::Option* option = app_.get_option(name);
  return option->count() ? option->results().back() : std::string();
}

std::vector<std::string> ForwardedFlags::train_arguments() const {
  std::vector<std::string> arguments;
  for (const ForwardedFlag& flag : flags_) {
    if (!given(flag.name)) continue;
    arguments.push_back(flag.name);
    if (is_list_flag(flag.name))
      arguments.insert(arguments.end(), list_values_.begin(), list_values_.end());
    else if (flag.takes_value)
      arguments.push_back(value(flag.name));
  }
  return arguments;
}

WeightsSource weights_source(const ForwardedFlags& flags, const std::string& command) {
  const std::string hint = "run `fp8lm " + command + " --help` for its flags";
  if (!flags.given("--load") && !flags.given("--init-from"))
    throw InputError("fp8lm " + command + ": --load DIR or --init-from PATH is required (the weights to run)", hint);
  if (flags.given("--load") && flags.given("--init-from"))
    throw InputError("fp8lm " + command + ": --load and --init-from are alternatives; give one", hint);
  WeightsSource source;
  source.path = flags.given("--load") ? flags.value("--load") : flags.value("--init-from");
  if (flags.given("--ckpt-step") && flags.given("--load")) {
    try {
      source.step = std::stoll(flags.value("--ckpt-step"));
    } catch (const std::exception&) {
      // train's parser names the bad value
    }
  }
  return source;
}

std::vector<std::string> checkpoint_run_flags(const std::string& path, std::optional<int64_t> step,
                                              const std::set<std::string>& given, bool with_batch_shape) {
  const fs::path state_path = fs::path(resolve_checkpoint_dir(path, step)) / "state.json";
  if (!fs::is_regular_file(state_path)) return {};
  nlohmann::json args;
  try {
    std::ifstream file(state_path);
    args = nlohmann::json::parse(file).value("args", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    throw InputError(state_path.string() + ": not valid JSON (" + e.what() + ")");
  }
  std::vector<std::string> flags;
  auto add = [&](const char* flag, const char* key) {
    if (given.count(flag) || !args.contains(key)) return;
    const nlohmann::json& value = args[key];
    flags.push_back(flag);
    flags.push_back(value.is_string() ? value.get<std::string>() : value.dump());
  };
  if (with_batch_shape) {
    add("--micro-batch-size", "micro_batch_size");
    add("--seq-length", "seq_length");
    if (!given.count("--eval-iters") && args.value("eval_iters", int64_t{0}) > 0) add("--eval-iters", "eval_iters");
  }
  const bool precision_given =
      std::any_of(given.begin(), given.end(), [](const std::string& name) { return is_precision_choice(name); });
  if (!precision_given) {
    const std::string precision = args.value("precision", std::string("bf16"));
    if (precision == "fp32") flags.push_back("--fp32");
    if (precision == "fp8") {
      add("--fp8-format", "fp8_format");
      add("--fp8-recipe", "fp8_recipe");
      add("--fp8-margin", "fp8_margin");
      add("--fp8-interval", "fp8_interval");
      add("--fp8-amax-history-len", "fp8_amax_history_len");
      add("--fp8-amax-compute-algo", "fp8_amax_compute_algo");
      if (args.value("fp8_lm_head", false) && !given.count("--fp8-lm-head")) flags.push_back("--fp8-lm-head");
      // The BF16 blocks decide which FP8 scaling states exist: the three flags go together.
      const bool layers_given = given.count("--first-last-layers-bf16") ||
                                given.count("--num-layers-at-start-in-bf16") ||
                                given.count("--num-layers-at-end-in-bf16");
      if (args.value("first_last_layers_bf16", false) && !layers_given) {
        flags.push_back("--first-last-layers-bf16");
        add("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16");
        add("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16");
      }
      // The blocks --bf16-blocks named and --fp8-auto-precision switched in the saving run.
      const nlohmann::json blocks = args.value("bf16_blocks", nlohmann::json::array());
      if (!given.count("--bf16-blocks") && blocks.is_array() && !blocks.empty()) {
        std::string list;
        for (const nlohmann::json& block : blocks) list += (list.empty() ? "" : ",") + block.dump();
        flags.push_back("--bf16-blocks");
        flags.push_back(list);
      }
    }
  }
  return flags;
}

std::string describe_precision(const TrainOptions& o) {
  if (!o.fp8_enabled()) return std::string(to_string(o.precision));
  return o.precision_name() + ", " + std::string(to_string(o.fp8.recipe)) + " scaling";
}

}  // namespace fp8lm
