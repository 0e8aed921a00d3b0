#include "core/logging.h"

#include <algorithm>
#include <cstdio>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace fp8lm {

std::string format_mib(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / 1048576.0);
  return text;
}

void init_logging(const std::string& level, int rank) {
  auto logger = spdlog::stderr_color_mt("fp8lm");
  logger->set_pattern(rank == 0 ? "[%H:%M:%S.%e] [%^%l%$] %v" : "[%H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  spdlog::level::level_enum parsed = spdlog::level::from_str(level);
  if (rank != 0) parsed = std::max(parsed, spdlog::level::warn);
  logger->set_level(parsed);
  spdlog::set_default_logger(logger);
}

void log_settings_table(const std::string& title, const SettingsTable& rows) {
  size_t name_width = 7, value_width = 5;
  for (const auto& [name, value] : rows) {
    name_width = std::max(name_width, name.size());
    value_width = std::max(value_width, value.size());
  }
  std::string rule(1, '+');
  rule.append(name_width + 2, '-').append(1, '+').append(value_width + 2, '-').append(1, '+');
  spdlog::info("{}", title);
  spdlog::info("{}", rule);
  spdlog::info("| {:<{}} | {:<{}} |", "setting", name_width, "value", value_width);
  spdlog::info("{}", rule);
  for (const auto& [name, value] : rows) spdlog::info("| {:<{}} | {:<{}} |", name, name_width, value, value_width);
  spdlog::info("{}", rule);
}

}  // namespace fp8lm
