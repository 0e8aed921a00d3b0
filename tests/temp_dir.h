// A fresh directory under the system temp dir for one test, removed with everything in
// it at scope exit.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

namespace fp8lm::testing {

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("fp8lm_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A config file in `dir` with the tiny model's keys (configs/tiny.json's shape), some replaced.
inline std::string write_tiny_config(const TempDir& dir, const std::string& name, const nlohmann::json& changes) {
  nlohmann::json config = {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}, {"vocab_size", 256}, {"n_positions", 64}};
  for (const auto& [key, value] : changes.items()) config[key] = value;
  const std::string path = dir.file(name);
  std::ofstream(path) << config.dump();
  return path;
}

}  // namespace fp8lm::testing
