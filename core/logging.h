// Logging set-up and the startup settings table. spdlog is used from .cpp files only:
// nvcc cannot compile spdlog/fmt in C++20 mode (see docs/DEVELOPING.md).
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace fp8lm {

// Configures the default logger: level name (trace|debug|info|warn|error); ranks other
// than 0 log warnings and errors only, so a multi-GPU run prints one table.
void init_logging(const std::string& level, int rank = 0);

using SettingsTable = std::vector<std::pair<std::string, std::string>>;

// "12.3 MiB": how every memory figure is printed.
std::string format_mib(size_t bytes);

// Logs every row as "| name | value |" under a title, aligned.
void log_settings_table(const std::string& title, const SettingsTable& rows);

}  // namespace fp8lm
