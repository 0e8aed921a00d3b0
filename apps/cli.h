// The fp8lm command line: Megatron-LM flag names, parsed with CLI11 and validated
// before any work starts.
#pragma once

#include <string>
#include <vector>

#include "apps/options.h"

namespace fp8lm {

struct ParsedCommandLine {
  TrainOptions options;
  bool help_requested = false;
  std::string help_text;
};

// Parses the `train` flags (argv without the program name and subcommand).
// Throws InputError with a one-line message naming the flag on any bad input.
ParsedCommandLine parse_train_command_line(const std::vector<std::string>& args);

// Checks ranges and contradictions that do not need the model config.
void validate_options(const TrainOptions& options);

}  // namespace fp8lm
