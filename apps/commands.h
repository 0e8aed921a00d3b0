// The subcommands of the fp8lm binary. Each takes its arguments (after the
// subcommand name) and returns the process exit code; bad input throws InputError.
#pragma once

#include <string>
#include <vector>

namespace fp8lm {

int run_train_command(const std::vector<std::string>& args);
int run_convert_command(const std::vector<std::string>& args);
int run_tokenize_command(const std::vector<std::string>& args);
int run_eval_command(const std::vector<std::string>& args);
int run_sample_command(const std::vector<std::string>& args);

}  // namespace fp8lm
