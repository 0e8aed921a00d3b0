// Runs the fp8lm binary as a user would and captures its exit code and output.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fp8lm::testing {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `command` through the shell, stdout and stderr captured together.
inline CommandResult run_command(const std::string& command_line) {
  static int counter = 0;
  const std::filesystem::path log =
      std::filesystem::temp_directory_path() / ("fp8lm_cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".log");
  const std::string command = command_line + " > " + log.string() + " 2>&1";
  const int status = std::system(command.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream file(log);
  std::stringstream text;
  text << file.rdbuf();
  result.output = text.str();
  std::filesystem::remove(log);
  return result;
}

inline CommandResult run_fp8lm(const std::string& arguments) { return run_command(std::string(FP8LM_BINARY) + " " + arguments); }

inline std::string source_path(const std::string& relative) { return std::string(FP8LM_SOURCE_DIR) + "/" + relative; }

// The training losses a run wrote to its metrics file (JSONL), in order.
inline std::vector<double> metrics_losses(const std::string& metrics_file) {
  std::vector<double> values;
  std::ifstream file(metrics_file);
  std::string line;
  while (std::getline(file, line)) {
    const auto json = nlohmann::json::parse(line);
    if (json.contains("loss")) values.push_back(json["loss"].get<double>());
  }
  return values;
}

}  // namespace fp8lm::testing
