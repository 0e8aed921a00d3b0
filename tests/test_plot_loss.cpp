// scripts/plot_loss.sh: a PNG from two runs' metrics; without gnuplot, an error with a HINT;
// a missing metrics file or a file that is not fp8lm's metrics exits 2 naming it.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "cli_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

// A metrics file as fp8lm train writes it: log lines every 2 iterations, validation every 4.
void write_metrics(const std::string& path, double offset) {
  std::ofstream file(path);
  for (int iter = 2; iter <= 20; iter += 2) {
    file << "{\"iter\":" << iter << ",\"loss\":" << 6.0 - 0.1 * iter + offset
         << ",\"lr\":0.001,\"grad_norm\":1.0,\"tokens_per_s\":2048.0,\"ms_per_iter\":125.0,\"elapsed_s\":"
         << 0.125 * iter << ",\"skipped_steps\":0}\n";
    if (iter % 4 == 0) file << "{\"iter\":" << iter << ",\"val_loss\":" << 6.1 - 0.1 * iter + offset << "}\n";
  }
}

const std::string kScript = testing::source_path("scripts/plot_loss.sh");

}  // namespace

TEST_CASE("plot_loss.sh draws two runs, and names what is wrong", "[plot]") {
  testing::TempDir dir;
  write_metrics(dir.file("fp8.jsonl"), 0.0);
  write_metrics(dir.file("bf16.jsonl"), 0.05);

  const bool have_gnuplot = std::system("command -v gnuplot > /dev/null 2>&1") == 0;
  if (have_gnuplot) {
    const auto result = testing::run_command(kScript + " " + dir.file("fp8.jsonl") + " " + dir.file("bf16.jsonl") +
                                             " -o " + dir.file("loss.png"));
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    std::ifstream png(dir.file("loss.png"), std::ios::binary);
    char magic[8] = {};
    png.read(magic, 8);
    CHECK(std::string(magic + 1, 3) == "PNG");
    CHECK(std::filesystem::file_size(dir.file("loss.png")) > 5000);
  }

  // Without gnuplot on the PATH: exit 3 and the package to install.
  const auto missing = testing::run_command("PATH=/nonexistent /bin/bash " + kScript + " " + dir.file("fp8.jsonl") +
                                            " -o " + dir.file("x.png"));
  CHECK(missing.exit_code == 3);
  CHECK_THAT(missing.output, ContainsSubstring("HINT: apt-get install gnuplot-nox"));

  if (have_gnuplot) {
    const auto absent = testing::run_command(kScript + " " + dir.file("absent.jsonl") + " -o " + dir.file("x.png"));
    CHECK(absent.exit_code == 2);
    CHECK_THAT(absent.output, ContainsSubstring("absent.jsonl"));
    std::ofstream(dir.file("other.jsonl")) << "{\"iter\":1,\"val_loss\":2.0}\n";
    const auto other = testing::run_command(kScript + " " + dir.file("other.jsonl") + " -o " + dir.file("x.png"));
    CHECK(other.exit_code == 2);
    CHECK_THAT(other.output, ContainsSubstring("other.jsonl"));
    const auto no_runs = testing::run_command(kScript + " -o " + dir.file("x.png"));
    CHECK(no_runs.exit_code == 2);
  }
}

TEST_CASE("plot_loss.sh reads past FP8 statistics lines, and --fp8-stat draws one of them", "[plot][fp8-stats]") {
  testing::TempDir dir;
  write_metrics(dir.file("run.jsonl"), 0.0);
  {  // the lines --fp8-stats-interval adds (one has a NaN amax, written as null)
    std::ofstream file(dir.file("run.jsonl"), std::ios::app);
    for (int iter = 4; iter <= 20; iter += 4)
      for (const char* name : {"h.0.attn.c_attn.input", "h.0.attn.c_attn.grad_output"})
        file << "{\"amax\":" << (iter == 8 ? "null" : std::to_string(1.5 + iter)) << ",\"elements\":4096.0,"
             << "\"format\":\"e4m3\",\"fp8_stats\":\"" << name << "\",\"iter\":" << iter
             << ",\"saturated\":0.001,\"scale\":100.0,\"scale_amax\":4.48,\"subnormal\":0.01,\"underflow\":"
             << 0.001 * iter << "}\n";
  }
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) SKIP("gnuplot is not installed");
  const auto loss = testing::run_command(kScript + " " + dir.file("run.jsonl") + " -o " + dir.file("loss.png"));
  INFO(loss.output);
  CHECK(loss.exit_code == 0);
  CHECK(std::filesystem::file_size(dir.file("loss.png")) > 5000);

  const auto stat = testing::run_command(kScript + " " + dir.file("run.jsonl") +
                                         " --fp8-stat underflow --tensor 'grad_output$' -o " + dir.file("u.png"));
  INFO(stat.output);
  CHECK(stat.exit_code == 0);
  CHECK_THAT(stat.output, ContainsSubstring("1 FP8 operand series"));
  CHECK(std::filesystem::file_size(dir.file("u.png")) > 5000);
  const auto amax = testing::run_command(kScript + " " + dir.file("run.jsonl") + " --fp8-stat amax -o " +
                                         dir.file("a.png"));
  CHECK(amax.exit_code == 0);
  CHECK_THAT(amax.output, ContainsSubstring("2 FP8 operand series"));

  const auto bogus = testing::run_command(kScript + " " + dir.file("run.jsonl") + " --fp8-stat loss -o " +
                                          dir.file("x.png"));
  CHECK(bogus.exit_code == 2);
  CHECK_THAT(bogus.output, ContainsSubstring("--fp8-stat loss is not a statistic"));
  const auto none = testing::run_command(kScript + " " + dir.file("run.jsonl") + " --fp8-stat scale --tensor nothing -o " +
                                         dir.file("x.png"));
  CHECK(none.exit_code == 2);
  CHECK_THAT(none.output, ContainsSubstring("HINT: train with --fp8-stats-interval"));
}
