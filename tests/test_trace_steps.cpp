// scripts/trace_steps.py: the training step from a kernel trace (scripts/kernel_trace.cpp), on a
// hand-made trace: whole steps kept, a step with lost records left out, each step's time and idle
// time, the idle time by the kernels around it, and the kernel time by kernel.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "cli_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

const std::string kScript = testing::source_path("scripts/trace_steps.py");

// Names as CUPTI reports them: fp8lm's mangled in their file's anonymous namespace, cuBLASLt's plain.
const char* kEmbedding =
    "_ZN5fp8lm4cuda43_GLOBAL__N__8bf521b8_10_encoder_cu_3b3679a723embedding_lookup_kernelEPfPKiPK13__nv_bfloat16iiim";
const char* kLayerNorm =
    "_ZN5fp8lm4cuda45_GLOBAL__N__9eaeac60_12_layernorm_cu_aaacdb8e24layernorm_forward_kernelILi7ELb1ELb0ELb0EEEvP13__n";
const char* kGemm = "nvjet_sm90_qqtst_128x160_128x5_2x1_v_bz_coopA_bias_TNT";

void kernel(std::ofstream& trace, uint64_t start_us, uint64_t end_us, const char* name) {
  constexpr uint64_t kOrigin = 1795785476446000000ull;  // a real trace's clock
  trace << kOrigin + start_us * 1000 << " " << kOrigin + end_us * 1000 << " 13 " << name << "\n";
}

// One step of 200 us from `t`: the embedding, a LayerNorm and a GEMM with gaps of 2, 1 and 67 us.
void whole_step(std::ofstream& trace, uint64_t t) {
  kernel(trace, t, t + 10, kEmbedding);
  kernel(trace, t + 12, t + 32, kLayerNorm);
  kernel(trace, t + 33, t + 133, kGemm);
}

}  // namespace

TEST_CASE("trace_steps.py: whole steps' time, idle time and kernels; steps with lost records left out",
          "[scripts]") {
  if (std::system("command -v python3 > /dev/null 2>&1") != 0) SKIP("python3 is not installed");
  testing::TempDir dir;
  {
    std::ofstream trace(dir.file("step.trace"));
    trace << "0 0 13 " << kGemm << "\n";  // a record without times: ignored
    whole_step(trace, 0);
    whole_step(trace, 200);
    kernel(trace, 400, 410, kEmbedding);  // the tracer lost this step's LayerNorm: a 6 ms gap
    kernel(trace, 6410, 6510, kGemm);
    whole_step(trace, 6600);
    kernel(trace, 6800, 6810, kEmbedding);  // the next step's start closes the last whole one
  }
  const auto result = testing::run_command(kScript + " " + dir.file("step.trace"));
  INFO(result.output);
  CHECK(result.exit_code == 0);
  CHECK_THAT(result.output, ContainsSubstring("4 steps in the trace, 3 whole (3 kernels each)"));
  CHECK_THAT(result.output, ContainsSubstring("  step     0.20 ms   idle   0.07 ms"));
  CHECK_THAT(result.output, ContainsSubstring("    0.067      1  " + std::string(kGemm) + " -> embedding_lookup_kernel"));
  CHECK_THAT(result.output, ContainsSubstring("    0.002      1  embedding_lookup_kernel -> layernorm_forward_kernel"));
  CHECK_THAT(result.output, ContainsSubstring("     0.100      1     100.0  " + std::string(kGemm)));
  CHECK_THAT(result.output, ContainsSubstring("     0.020      1      20.0  layernorm_forward_kernel"));
  CHECK_THAT(result.output, ContainsSubstring("     0.130  in all"));

  // Every step with a gap past the limit: an error naming the file.
  const auto lossy = testing::run_command(kScript + " " + dir.file("step.trace") + " --max-gap-ms 0.001");
  CHECK(lossy.exit_code != 0);
  CHECK_THAT(lossy.output, ContainsSubstring("step.trace: every step has a gap over 0.001 ms (lost records)"));
}
