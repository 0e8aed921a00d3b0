// fp8lm eval: the validation loss and perplexity of a checkpoint (either precision) or of a
// Hugging Face GPT-2 model, on token shards.
//
// Its flags are a subset of train's, with the same meaning; they are handed to train's parser
// (with --train-iters 0), so validation, precision resolution and the run set-up are train's
// own, and the evaluation is the training loop's (run_evaluation in apps/trainer.cpp). Flags
// left out default to the checkpoint's run: its precision and FP8 recipe, micro-batch size,
// sequence length and eval-iters, so `fp8lm eval --load DIR --valid-data-path ...` scores
// the batches the run's own evaluation scored.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include <CLI/CLI.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/cli.h"
#include "apps/commands.h"
#include "apps/run_setup.h"
#include "apps/trainer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/logging.h"
#include "parallel/process_groups.h"

namespace fp8lm {

namespace {

namespace fs = std::filesystem;

const char* const kHelpHint = "run `fp8lm eval --help` for its flags";

struct EvalFlag {
  const char* name;
  bool takes_value;
  const char* help;
};

// Every flag eval accepts: train's flags of the same name.
const EvalFlag kEvalFlags[] = {
    {"--load", true, "fp8lm checkpoint directory (uses `latest`) or iteration directory"},
    {"--init-from", true, "A Hugging Face GPT-2 model.safetensors (or its directory), or an fp8lm checkpoint"},
    {"--ckpt-step", true, "With --load: this iteration instead of `latest`"},
    {"--config", true, "GPT config JSON (default: the checkpoint's, or config.json beside the model)"},
    {"--valid-data-path", true, "Token shards to evaluate on (see --data-format); globs allowed"},
    {"--data-path", true, "Megatron indexed dataset(s), [WEIGHT] PREFIX ...: evaluates --split's valid part"},
    {"--split", true, "Train/valid/test weights over --data-path's documents (default 969,30,1)"},
    {"--data-format", true, "llmc or raw-uint16"},
    {"--eval-iters", true, "Batches to score (default: the checkpoint run's --eval-iters, else 100)"},
    {"--micro-batch-size", true, "Sequences per batch (default: the checkpoint run's, else 4)"},
    {"--seq-length", true, "Tokens per sequence (default: the checkpoint run's, else n_positions)"},
    {"--bf16", false, "BF16 GEMMs (default: the checkpoint run's precision; BF16 for Hugging Face models)"},
    {"--fp32", false, "FP32 GEMMs (reference mode)"},
    {"--fp8-format", true, "FP8 GEMMs: e4m3 or hybrid"},
    {"--fp8-hybrid", false, "Old spelling of --fp8-format hybrid"},
    {"--fp8-e4m3", false, "Old spelling of --fp8-format e4m3"},
    {"--fp8-recipe", true, "delayed (the checkpoint's amax history) or tensorwise (current scaling)"},
    {"--fp8-margin", true, "Scale = fp8_max / amax / 2^margin"},
    {"--fp8-interval", true, "Delayed scaling's update interval"},
    {"--fp8-amax-history-len", true, "Amax history window (delayed scaling)"},
    {"--fp8-amax-compute-algo", true, "max or most_recent"},
    {"--fp8-lm-head", false, "The tied LM-head GEMM in FP8 too"},
    {"--first-last-layers-bf16", false, "The first and last blocks' GEMMs in BF16 under FP8 (counts below)"},
    {"--num-layers-at-start-in-bf16", true, "With --first-last-layers-bf16: blocks at the start in BF16"},
    {"--num-layers-at-end-in-bf16", true, "With --first-last-layers-bf16: blocks at the end in BF16"},
    {"--device", true, "auto (CUDA if a GPU is present), cuda or cpu"},
    {"--num-threads", true, "CPU threads (0: OpenMP default)"},
    {"--log-level", true, "trace, debug, info, warn or error"},
};

// --data-path takes a list ([WEIGHT] PREFIX ...), as train's does.
bool is_list_flag(const std::string& name) { return name == "--data-path"; }

bool is_precision_choice(const std::string& name) {
  return name == "--bf16" || name == "--fp32" || name == "--fp8-format" || name == "--fp8-hybrid" ||
         name == "--fp8-e4m3";
}

// The saving run's settings (state.json's "args") as train flags, for those eval was not
// given; nothing for a Hugging Face model.
std::vector<std::string> checkpoint_defaults(const std::string& path, std::optional<int64_t> step,
                                             const std::set<std::string>& given) {
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
  add("--micro-batch-size", "micro_batch_size");
  add("--seq-length", "seq_length");
  if (!given.count("--eval-iters") && args.value("eval_iters", int64_t{0}) > 0) add("--eval-iters", "eval_iters");
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
    }
  }
  return flags;
}

std::string describe_precision(const TrainOptions& o) {
  if (!o.fp8_enabled()) return std::string(to_string(o.precision));
  return o.precision_name() + ", " + std::string(to_string(o.fp8.recipe)) + " scaling";
}

}  // namespace

int run_eval_command(const std::vector<std::string>& args) {
  CLI::App app{"fp8lm eval: validation loss and perplexity of a checkpoint or a Hugging Face GPT-2 model",
               "fp8lm eval"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.get_formatter()->column_width(34);
  std::vector<std::string> list_values;  // --data-path's, which is the only list flag
  for (const EvalFlag& flag : kEvalFlags) {
    if (is_list_flag(flag.name))
      app.add_option(flag.name, list_values, flag.help)
          ->expected(1, CLI::detail::expected_max_vector_size)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    else if (flag.takes_value)
      app.add_option(flag.name, flag.help);
    else
      app.add_flag(flag.name, flag.help);
  }
  if (!parse_subcommand_arguments(app, args, "eval")) return kExitOk;

  std::set<std::string> given;
  std::vector<std::string> user_flags;
  for (const EvalFlag& flag : kEvalFlags) {
    const CLI::Option* option = app.get_option(flag.name);
    if (option->count() == 0) continue;
    given.insert(flag.name);
    user_flags.push_back(flag.name);
    if (is_list_flag(flag.name))
      user_flags.insert(user_flags.end(), list_values.begin(), list_values.end());
    else if (flag.takes_value)
      user_flags.push_back(option->results().back());
  }
  auto value_of = [&](const char* name) {
    const CLI::Option* option = app.get_option(name);
    return option->count() ? option->results().back() : std::string();
  };
  if (!given.count("--load") && !given.count("--init-from"))
    throw InputError("fp8lm eval: --load DIR or --init-from PATH is required (the weights to evaluate)", kHelpHint);
  if (given.count("--load") && given.count("--init-from"))
    throw InputError("fp8lm eval: --load and --init-from are alternatives; give one", kHelpHint);
  if (!given.count("--valid-data-path") && !given.count("--data-path"))
    throw InputError("fp8lm eval: --valid-data-path or --data-path is required (the tokens to evaluate on)",
                     kHelpHint);

  // The checkpoint's settings first, the user's after them: a repeated flag takes its last value.
  const std::string weights = given.count("--load") ? value_of("--load") : value_of("--init-from");
  std::optional<int64_t> step;
  if (given.count("--ckpt-step") && given.count("--load")) {
    try {
      step = std::stoll(value_of("--ckpt-step"));
    } catch (const std::exception&) {
      // train's parser names the bad value below
    }
  }
  std::vector<std::string> train_args = checkpoint_defaults(weights, step, given);
  train_args.insert(train_args.end(), user_flags.begin(), user_flags.end());
  train_args.insert(train_args.end(), {"--train-iters", "0"});
  TrainOptions options;
  try {
    options = parse_train_command_line(train_args).options;
  } catch (const InputError& e) {
    throw InputError(std::string("fp8lm eval: ") + e.what(), kHelpHint);
  }

  MpiSession mpi;
  const ParallelLayout layout = detect_parallel_layout(options.tensor_model_parallel_size);
  init_logging(options.log_level, layout.world_rank);
  const RunSetup setup = resolve_run_setup(options, layout);
  if (setup.use_cuda) check_ranks_fit_gpus(layout, cuda_availability().device_count);
  const std::string data = options.data_path.empty()
                              ? options.valid_data_path
                              : "the valid split (" + options.split + ") of --data-path";
  spdlog::info("evaluating {} on {}: {} batches of {} x {} tokens, {}, {}", weights, data,
               options.eval_iters, options.micro_batch_size, setup.seq_length, describe_precision(options),
               setup.device_description);
  const EvaluationResult result = run_evaluation(setup);
  if (layout.world_rank != 0) return kExitOk;
  // exp() of a diverged model's loss overflows: the JSON line stays valid (null is not a number).
  const double perplexity = std::exp(std::min(result.loss, 700.0));
  std::printf("eval: loss %.4f | perplexity %.2f | %lld tokens (%lld batches of %d x %d, %s)\n", result.loss,
              perplexity, static_cast<long long>(result.tokens), static_cast<long long>(options.eval_iters),
              options.micro_batch_size, setup.seq_length, describe_precision(options).c_str());
  const nlohmann::json line = {{"loss", result.loss},
                               {"perplexity", perplexity},
                               {"tokens", result.tokens},
                               {"eval_iters", options.eval_iters},
                               {"micro_batch_size", options.micro_batch_size},
                               {"seq_length", setup.seq_length},
                               {"precision", options.precision_name()},
                               {"weights", weights}};
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace fp8lm
