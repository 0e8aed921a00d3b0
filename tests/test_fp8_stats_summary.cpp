// scripts/fp8_stats_summary.py: the class table, the worst tensors, the per-step trend and
// --run-compare on a hand-made metrics file with known fractions; a file without statistics
// lines is named and skipped; a missing file exits 2 naming it.
#include <cstdlib>
#include <fstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "cli_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

const std::string kScript = testing::source_path("scripts/fp8_stats_summary.py");

// One statistics line as --fp8-stats-interval writes it; amax "null" is a NaN amax.
std::string stat_line(const char* name, int iter, const char* format, const char* amax, double scale_amax,
                      double saturated, double underflow, double subnormal) {
  return std::string("{\"amax\":") + amax + ",\"elements\":4096.0,\"format\":\"" + format + "\",\"fp8_stats\":\"" +
         name + "\",\"iter\":" + std::to_string(iter) + ",\"saturated\":" + std::to_string(saturated) +
         ",\"scale\":100.0,\"scale_amax\":" + std::to_string(scale_amax) + ",\"subnormal\":" +
         std::to_string(subnormal) + ",\"underflow\":" + std::to_string(underflow) + "}\n";
}

const char* kTraining = "{\"iter\":2,\"loss\":5.0,\"lr\":0.001,\"grad_norm\":1.0}\n{\"iter\":2,\"val_loss\":5.1}\n";

}  // namespace

TEST_CASE("fp8_stats_summary.py summarises FP8 statistics per class, tensor and step", "[fp8-stats]") {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) SKIP("python3 is not installed");
  testing::TempDir dir;
  {
    std::ofstream file(dir.file("a.jsonl"));
    file << kTraining << "{\"iter\":3,\"lo\n";  // a line cut short by a killed run
    // attn.c_attn.input: saturated 0, 0.4%, 0, 0.2% (mean 0.15%, max L1 @2); scale_amax/amax
    // 1, 0.5, 2, 1 (min 0.5 at L1 @2, median 1). grad_output: underflow 30%, 10%; ratios 100, 10.
    file << stat_line("h.0.attn.c_attn.input", 2, "e4m3", "4.0", 4.0, 0.0, 0.001, 0.01)
         << stat_line("h.1.attn.c_attn.input", 2, "e4m3", "4.0", 2.0, 0.004, 0.0, 0.02)
         << stat_line("h.0.attn.c_attn.grad_output", 2, "e5m2", "0.00001", 0.001, 0.0, 0.3, 0.05)
         << stat_line("lm_head.weight", 2, "e4m3", "null", 1.0, 0.0, 0.0002, 0.0)
         << stat_line("h.0.attn.c_attn.input", 4, "e4m3", "4.0", 8.0, 0.0, 0.003, 0.03)
         << stat_line("h.1.attn.c_attn.input", 4, "e4m3", "4.0", 4.0, 0.002, 0.001, 0.01)
         << stat_line("h.0.attn.c_attn.grad_output", 4, "e5m2", "0.0001", 0.001, 0.0, 0.1, 0.05);
  }
  std::ofstream(dir.file("b.jsonl")) << kTraining;

  const auto result = testing::run_command(kScript + " " + dir.file("a.jsonl") + " " + dir.file("b.jsonl") +
                                           " --top 1 --run-compare");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, ContainsSubstring("7 records, 2 report steps (2..4), 4 tensors."));
  // class table: mean, max (where) for saturated, underflow, subnormal; ratio min (where), median
  CHECK_THAT(result.output, ContainsSubstring("| attn.c_attn.input | e4m3 | 4 | 0.15% | 0.4% (L1 @2) | 0.125% | "
                                              "0.3% (L0 @4) | 1.75% | 3% (L0 @4) | 0.5 (L1 @2) | 1 |"));
  CHECK_THAT(result.output, ContainsSubstring("| attn.c_attn.grad_output | e5m2 | 2 | 0% | 0% (L0 @2) | 20% | "
                                              "30% (L0 @2) | 5% | 5% (L0 @2) | 10 (L0 @4) | 55 |"));
  CHECK_THAT(result.output, ContainsSubstring("| lm_head.weight | e4m3 | 1 | 0% | 0% (@2) | 0.02% | 0.02% (@2) | "
                                              "0% | 0% (@2) | - | - |"));
  // --top 1: the worst tensor only
  CHECK_THAT(result.output, ContainsSubstring("| h.1.attn.c_attn.input | 2 | 0.4% | 4.0 | 2 | 0.5 |"));
  CHECK_THAT(result.output, ContainsSubstring("| h.0.attn.c_attn.grad_output | 2 | 30% |"));
  CHECK_THAT(result.output, !ContainsSubstring("| h.1.attn.c_attn.input | 4 |"));
  // trend: the class mean at each report step
  CHECK_THAT(result.output, ContainsSubstring("Mean underflow per report step:\n\n| class | 2 | 4 |"));
  CHECK_THAT(result.output, ContainsSubstring("| attn.c_attn.input | 0.05% | 0.2% |"));
  CHECK_THAT(result.output, ContainsSubstring("| attn.c_attn.input | 0.2% | 0.1% |"));
  // the file without statistics, and the comparison (of the one run that has them)
  CHECK_THAT(result.output, ContainsSubstring("b.jsonl has no FP8 statistics lines"));
  CHECK_THAT(result.output, ContainsSubstring("### mean underflow by run\n\n| class | a |"));
  CHECK_THAT(result.output, ContainsSubstring("| attn.c_attn.grad_output | 20% |"));
  CHECK_THAT(result.output, ContainsSubstring("### min scale_amax/amax by run"));

  const auto absent = testing::run_command(kScript + " " + dir.file("absent.jsonl"));
  CHECK(absent.exit_code == 2);
  CHECK_THAT(absent.output, ContainsSubstring("absent.jsonl"));
}
