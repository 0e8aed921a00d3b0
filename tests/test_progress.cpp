// Training's progress line: throughput (tokens/s and Megatron's model TFLOP/s per GPU), elapsed
// time and an ETA, in one line; the metrics JSONL carries them too.
#include <fstream>
#include <regex>
#include <sstream>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <nlohmann/json.hpp>

#include "cli_testing.h"
#include "core/gpt_config.h"
#include "temp_dir.h"

using namespace fp8lm;

TEST_CASE("progress lines show tokens/s, TFLOP/s per GPU, the elapsed time and the ETA", "[progress]") {
  testing::TempDir dir;
  const std::string metrics = dir.file("metrics.jsonl");
  const auto result = testing::run_fp8lm("--config " + testing::source_path("configs/tiny.json") +
                                         " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 "
                                         "--train-iters 4 --log-interval 2 --eval-interval 0 --eval-iters 0 --metrics-file " +
                                         metrics);
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  // e.g. "iter      2/4 | loss 5.5 | ... | 1234 tokens/s | 0.004 TFLOP/s/GPU | elapsed 0.1s | ETA 0.1s"
  const std::regex progress(
      R"(iter +(\d+)/4 \|[^\n]*\| \d+ tokens/s \| [0-9.]+ TFLOP/s/GPU \| elapsed [0-9.hms]+ \| ETA ([0-9.hms]+)\n)");
  int lines = 0;
  std::string last_eta;
  for (auto it = std::sregex_iterator(result.output.begin(), result.output.end(), progress);
       it != std::sregex_iterator(); ++it) {
    ++lines;
    last_eta = (*it)[2];
  }
  CHECK(lines == 3);  // iterations 1, 2 and 4
  CHECK(last_eta == "0.0s");  // nothing left after the last iteration

  std::ifstream file(metrics);
  std::string line;
  double previous = -1.0;
  int entries = 0;
  while (std::getline(file, line)) {
    const auto parsed = nlohmann::json::parse(line);
    REQUIRE(parsed.contains("elapsed_s"));
    // 6 N + 12 L T C FLOPs per token (tiny.json: N = 120,576 with its 256-row vocabulary, L = 2,
    // C = 64; T = 32) at the line's tokens/s, on one GPU.
    const double flops_per_token = 6.0 * 120576 + 12.0 * 2 * 32 * 64;
    CHECK(load_gpt_config(testing::source_path("configs/tiny.json")).training_flops_per_token(32) == flops_per_token);
    CHECK(parsed["tflops_per_gpu"].get<double>() ==
          Catch::Approx(flops_per_token * parsed["tokens_per_s"].get<double>() / 1e12).epsilon(1e-12));
    CHECK(parsed["elapsed_s"].get<double>() >= previous);
    previous = parsed["elapsed_s"].get<double>();
    ++entries;
  }
  CHECK(entries == 3);
}
