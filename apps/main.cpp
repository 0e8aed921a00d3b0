// fp8lm: one binary, with subcommands. `train` is the default, so
//   fp8lm --config configs/tiny.json --mock-data
// trains; `convert` exports a checkpoint for Hugging Face, `tokenize` makes token shards,
// `eval` scores a model, `sample` generates text.
#include <cstdio>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/signals.h"
#include "core/error.h"

int main(int argc, char** argv) {
  fp8lm::install_signal_handlers();  // first: a SIGTERM during start-up gets a message too
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string command = "train";
  if (!args.empty() && !args.front().empty() && args.front()[0] != '-') {
    command = args.front();
    args.erase(args.begin());
  }
  try {
    if (command == "train") return fp8lm::run_train_command(args);
    if (command == "convert") return fp8lm::run_convert_command(args);
    if (command == "tokenize") return fp8lm::run_tokenize_command(args);
    if (command == "eval") return fp8lm::run_eval_command(args);
    if (command == "sample") return fp8lm::run_sample_command(args);
    throw fp8lm::InputError("unknown subcommand '" + command + "'",
                            "subcommands: train (the default), convert, tokenize, eval, sample");
  } catch (const fp8lm::InputError& e) {
    std::fprintf(stderr, "fp8lm: error: %s\n", e.full_message().c_str());
    return fp8lm::kExitInputError;
  } catch (const fp8lm::Error& e) {
    std::fprintf(stderr, "fp8lm: error: %s\n", e.full_message().c_str());
    return fp8lm::kExitRuntimeError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8lm: error: %s\n", e.what());
    return fp8lm::kExitRuntimeError;
  }
}
