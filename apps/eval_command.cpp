// fp8lm eval: the validation loss and perplexity of a checkpoint (either precision) or of a
// Hugging Face GPT-2 model, on token shards.
//
// Its flags are a subset of train's, with the same meaning; they are handed to train's parser
// (with --train-iters 0), so validation, precision resolution and the run set-up are train's
// own, and the evaluation loop is the training loop's (run_evaluation in apps/trainer.cpp), over
// a forward-only model (apps/evaluator.h) instead of the training engine. Flags
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
#include "apps/forwarded_flags.h"
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

// Every flag eval accepts: train's flags of the same name.
std::vector<ForwardedFlag> eval_flags() {
  std::vector<ForwardedFlag> flags = kWeightsFlags;
  flags.insert(flags.end(), {
      {"--valid-data-path", true,
       "Token shards to evaluate on (see --data-format; a glob), or Megatron indexed datasets: [WEIGHT] PREFIX ..."},
      {"--data-path", true, "Megatron indexed dataset(s), [WEIGHT] PREFIX ...: evaluates --split's valid part"},
      {"--split", true, "Train/valid/test weights over --data-path's documents (default 969,30,1)"},
      {"--data-format", true, "llmc or raw-uint16"},
      {"--eod-mask-loss", false,
       "Leave the predictions made from end-of-document tokens out of the loss (Megatron's; the token is "
       "--vocab-file's <|endoftext|>, else GPT-2's 50256)"},
      {"--reset-position-ids", false, "Restart the positions after each end-of-document token (as the run trained)"},
      {"--reset-attention-mask", false, "Keep attention within each document (as the run trained)"},
      {"--hellaswag-path", true,
       "llm.c's multiple-choice eval file (HellaSwag's hellaswag_val.bin): the accuracy of the lowest mean loss"},
      {"--vocab-file", true, "GPT-2's encoder.json (its <|endoftext|> for --eod-mask-loss)"},
      {"--merge-file", true, "GPT-2's vocab.bpe, with --vocab-file"},
      {"--eval-iters", true, "Batches to score (default: the checkpoint run's --eval-iters, else 100)"},
      {"--micro-batch-size", true, "Sequences per batch (default: the checkpoint run's, else 4)"},
      {"--seq-length", true, "Tokens per sequence (default: the checkpoint run's, else n_positions)"},
      {"--tensor-model-parallel-size", true,
       "Ranks a model is split over under mpirun (default 1: every rank holds it whole, each scoring its batches)"},
  });
  flags.insert(flags.end(), kPrecisionFlags.begin(), kPrecisionFlags.end());
  flags.insert(flags.end(), kRuntimeFlags.begin(), kRuntimeFlags.end());
  return flags;
}

}  // namespace

int run_eval_command(const std::vector<std::string>& args) {
  CLI::App app{"fp8lm eval: validation loss and perplexity of a checkpoint or a Hugging Face GPT-2 model",
               "fp8lm eval"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.get_formatter()->column_width(34);
  ForwardedFlags flags(app, eval_flags());
  if (!parse_subcommand_arguments(app, args, "eval")) return kExitOk;
  flags.collect();
  const std::set<std::string>& given = flags.names_given();
  const WeightsSource weights_from = weights_source(flags, "eval");
  if (!given.count("--valid-data-path") && !given.count("--data-path") && !given.count("--hellaswag-path"))
    throw InputError("fp8lm eval: --valid-data-path, --data-path or --hellaswag-path is required (what to evaluate on)",
                     kHelpHint);

  // The checkpoint's settings first, the user's after them: a repeated flag takes its last value.
  const std::string& weights = weights_from.path;
  std::vector<std::string> train_args = checkpoint_run_flags(weights, weights_from.step, given, /*with_batch_shape=*/true);
  const std::vector<std::string> user_flags = flags.train_arguments();
  train_args.insert(train_args.end(), user_flags.begin(), user_flags.end());
  train_args.insert(train_args.end(), {"--train-iters", "0"});
  TrainOptions options;
  try {
    options = parse_train_command_line(train_args).options;
  } catch (const InputError& e) {
    throw InputError(std::string("fp8lm eval: ") + e.what(), kHelpHint);
  }
  options.command = RunCommand::eval;

  MpiSession mpi;
  const ParallelLayout layout = detect_parallel_layout(options.tensor_model_parallel_size);
  init_logging(options.log_level, layout.world_rank);
  // Checks, last, that the evaluator's estimated memory fits, before anything is allocated.
  const RunSetup setup = resolve_run_setup(options, layout);
  if (setup.use_cuda) check_ranks_fit_gpus(layout, cuda_availability().device_count);
  log_settings_table("fp8lm eval memory (forward only: weights, one block's activations, the batch's logits)",
                     memory_estimate_rows(setup.memory, setup.use_cuda));
  const bool validating = !options.data_path.empty() || !options.valid_data_blend.empty() ||
                          !options.valid_data_path.empty();
  const std::string data = !options.data_path.empty() ? "the valid split (" + options.split + ") of --data-path"
                           : !options.valid_data_blend.empty() ? "the indexed dataset(s) of --valid-data-path"
                                                                : options.valid_data_path;
  if (validating)
    spdlog::info("evaluating {} on {}: {} batches of {} x {} tokens, {}, {}", weights, data, options.eval_iters,
                 options.micro_batch_size, setup.seq_length, describe_precision(options), setup.device_description);
  if (!options.hellaswag_path.empty())
    spdlog::info("evaluating {} on the multiple-choice examples of {}: batches of {} rows of {} tokens, {}, {}",
                 weights, options.hellaswag_path, options.micro_batch_size, setup.seq_length,
                 describe_precision(options), setup.device_description);
  const EvaluationResult result = run_evaluation(setup);
  spdlog::info("memory: host peak {} (VmHWM), estimated {} before allocation",
               format_bytes(measure_host_memory().host_peak_bytes), format_bytes(setup.memory.host_bytes()));
  if (layout.world_rank != 0) return kExitOk;
  nlohmann::json line = {{"micro_batch_size", options.micro_batch_size},
                         {"seq_length", setup.seq_length},
                         {"precision", options.precision_name()},
                         {"weights", weights}};
  if (validating) {
    // exp() of a diverged model's loss overflows: the JSON line stays valid (null is not a number).
    const double perplexity = std::exp(std::min(result.loss, 700.0));
    std::printf("eval: loss %.4f | perplexity %.2f | %lld tokens (%lld batches of %d x %d, %s)\n", result.loss,
                perplexity, static_cast<long long>(result.tokens), static_cast<long long>(options.eval_iters),
                options.micro_batch_size, setup.seq_length, describe_precision(options).c_str());
    line["loss"] = result.loss;
    line["perplexity"] = perplexity;
    line["tokens"] = result.tokens;
    line["eval_iters"] = options.eval_iters;
  }
  if (result.choices) {
    std::printf("eval: hellaswag accuracy %.4f | %lld of %lld examples right (%s)\n", result.choices->accuracy(),
                static_cast<long long>(result.choices->correct), static_cast<long long>(result.choices->examples),
                describe_precision(options).c_str());
    line["hellaswag_accuracy"] = result.choices->accuracy();
    line["hellaswag_correct"] = result.choices->correct;
    line["hellaswag_examples"] = result.choices->examples;
  }
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace fp8lm
