// Runs the fp8lm binary as a user would and captures its exit code and output.
#pragma once

#include <sys/resource.h>
#include <sys/wait.h>

#include <chrono>
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

// A run of the binary with its wall time and the CPU time (user + system) it used: how the
// refusal tests check that bad input is refused before any work.
struct TimedRun {
  CommandResult run;
  double seconds = 0.0;
  double cpu_seconds = 0.0;
};
inline TimedRun run_fp8lm_timed(const std::string& arguments) {
  auto children_cpu_seconds = [] {
    rusage usage{};
    ::getrusage(RUSAGE_CHILDREN, &usage);
    return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
           1e-6 * double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
  };
  const auto start = std::chrono::steady_clock::now();
  const double cpu_before = children_cpu_seconds();
  TimedRun timed;
  timed.run = run_fp8lm(arguments);
  timed.cpu_seconds = children_cpu_seconds() - cpu_before;
  timed.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return timed;
}

inline std::string source_path(const std::string& relative) { return std::string(FP8LM_SOURCE_DIR) + "/" + relative; }

// One field of every line of a run's metrics file (JSONL) that has it, in order.
inline std::vector<double> metrics_field(const std::string& metrics_file, const std::string& field) {
  std::vector<double> values;
  std::ifstream file(metrics_file);
  std::string line;
  while (std::getline(file, line)) {
    const auto json = nlohmann::json::parse(line);
    if (json.contains(field)) values.push_back(json[field].get<double>());
  }
  return values;
}

// The training losses.
inline std::vector<double> metrics_losses(const std::string& metrics_file) { return metrics_field(metrics_file, "loss"); }

}  // namespace fp8lm::testing
