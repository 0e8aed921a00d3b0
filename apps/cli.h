// The fp8lm command line: Megatron-LM flag names, parsed with CLI11 and validated
// before any work starts.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "apps/options.h"

namespace CLI {
class App;
}

namespace fp8lm {

struct ParsedCommandLine {
  TrainOptions options;
  bool help_requested = false;
  std::string help_text;
};

// Parses the `train` flags (argv without the program name and subcommand).
// Throws InputError with a one-line message naming the flag on any bad input.
ParsedCommandLine parse_train_command_line(const std::vector<std::string>& args);

// "0,5,11" -> {0, 5, 11} (--bf16-blocks); "" is no block. InputError naming `flag` otherwise.
std::set<int> parse_block_list(const std::string& flag, const std::string& text);
// {0, 5, 11} -> "0,5,11".
std::string block_list_text(const std::set<int>& blocks);

// Checks ranges and contradictions that do not need the model config.
void validate_options(const TrainOptions& options);

// Every floating-point flag with its range: validate_options requires each to be finite and
// inside it. A new double in TrainOptions gets a row here.
struct RealFlag {
  const char* name;
  const double* value;
  double min;
  bool min_inclusive;
  double max;
  bool max_inclusive;
  const char* why;  // appended to the error, or nullptr
};
std::vector<RealFlag> real_flags(const TrainOptions& options);

// --num-threads above this many per hardware thread is refused (libgomp crashes on tens of
// thousands, and oversubscription only slows a step down).
inline constexpr int kMaxThreadsPerHardwareThread = 4;
int hardware_threads();
int max_num_threads();
// The CPUs this process may run on (its affinity mask; mpirun narrows it when it binds ranks).
int affinity_cpus();

inline constexpr double kMaxTimeoutMinutes = 7 * 24 * 60;
inline constexpr int kMaxAmaxHistoryLen = 65536;

// A subcommand's arguments (after its name) parsed by `app`. --help prints the help and
// returns false; a parse error is an InputError naming the subcommand, with a hint to its help.
bool parse_subcommand_arguments(CLI::App& app, const std::vector<std::string>& args, const std::string& command);

}  // namespace fp8lm
