// scripts/numerics_runs.sh --gpus: every run of the list exactly once, one at a time on each
// GPU (CUDA_VISIBLE_DEVICES), the GPUs taking runs from one queue; a failed run fails the
// script; --parallel above 1 (several processes on one GPU) warns. A stand-in binary records
// which GPU each run had and when, so no GPU is needed.
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "cli_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

// The stand-in for fp8lm: appends "GPU SEED START END" (nanoseconds) to runs.txt, writes one
// validation line, and fails for seed 13.
const char* kStandIn = R"(#!/usr/bin/env bash
metrics=""; seed=""
while [ $# -gt 0 ]; do case $1 in --metrics-file) metrics=$2; shift 2 ;; --seed) seed=$2; shift 2 ;; *) shift ;; esac; done
start=$(date +%s%N); sleep 0.2; end=$(date +%s%N)
echo "${CUDA_VISIBLE_DEVICES:-none} $seed $start $end" >> "$(dirname "$0")/runs.txt"
echo "{\"iter\":10,\"val_loss\":6.5}" > "$metrics"
[ "$seed" != 13 ]
)";

struct Run {
  std::string gpu;
  int seed;
  long long start, end;
};

// Writes `script` as the stand-in fp8lm in dir, and one train and one validation shard under
// dir/data; returns the stand-in's path.
std::string stand_in_fp8lm(testing::TempDir& dir, const char* script) {
  const std::string bin = dir.file("fp8lm");
  std::ofstream(bin) << script;
  REQUIRE(std::system(("chmod +x " + bin).c_str()) == 0);
  std::filesystem::create_directories(dir.file("data"));
  std::ofstream(dir.file("data/train_000000.bin")) << "x";
  std::ofstream(dir.file("data/val_000000.bin")) << "x";
  return bin;
}

}  // namespace

TEST_CASE("numerics_runs.sh --gpus: each run once, one at a time per GPU, from one queue", "[scripts]") {
  testing::TempDir dir;
  const std::string bin = stand_in_fp8lm(dir, kStandIn);
  const std::string script = testing::source_path("scripts/numerics_runs.sh");
  const std::string common = script + " --bin " + bin + " --data " + dir.file("data") + " --runs 'bf16 fp8-delayed' ";

  const int status = std::system((common + "--gpus '0 1' --seeds '1 2 3' --out " + dir.file("out") + " > " +
                                  dir.file("log.txt") + " 2>&1")
                                     .c_str());
  CHECK(WEXITSTATUS(status) == 0);
  std::vector<Run> runs;
  std::ifstream records(dir.file("runs.txt"));
  for (Run r; records >> r.gpu >> r.seed >> r.start >> r.end;) runs.push_back(r);
  REQUIRE(runs.size() == 6);  // 2 run names x 3 seeds
  std::map<std::string, int> per_gpu;
  for (const Run& r : runs) {
    CHECK((r.gpu == "0" || r.gpu == "1"));
    ++per_gpu[r.gpu];
  }
  CHECK(per_gpu.size() == 2);  // both GPUs took runs
  for (const Run& a : runs)
    for (const Run& b : runs)
      if (&a != &b && a.gpu == b.gpu) CHECK((a.end <= b.start || b.end <= a.start));  // never two at once on a GPU
  for (const char* tag : {"bf16_s1", "bf16_s2", "bf16_s3", "fp8-delayed_s1", "fp8-delayed_s2", "fp8-delayed_s3"})
    CHECK(std::ifstream(dir.file("out/") + tag + ".jsonl").good());

  // A failed run fails the script; the others still run.
  const int failed = std::system((common + "--gpus '0 1' --seeds '13 14' --out " + dir.file("failed") + " > /dev/null 2>&1").c_str());
  CHECK(WEXITSTATUS(failed) == 1);
  CHECK(std::ifstream(dir.file("failed/bf16_s14.jsonl")).good());

  // Several processes on one GPU: a warning.
  std::system((common + "--parallel 2 --seeds 1 --out " + dir.file("shared") + " > " + dir.file("shared.txt") +
               " 2>&1").c_str());
  std::stringstream shared;
  shared << std::ifstream(dir.file("shared.txt")).rdbuf();
  CHECK_THAT(shared.str(), ContainsSubstring("warning: --parallel 2 runs several processes on one GPU"));
}

TEST_CASE("numerics_runs.sh --fp8-stats: statistics on the FP8 runs, not on BF16 or block scaling", "[scripts]") {
  testing::TempDir dir;
  // This stand-in records each run's metrics file and whether it was asked for statistics.
  const std::string bin = stand_in_fp8lm(dir, R"(#!/usr/bin/env bash
metrics=""; stats=none
while [ $# -gt 0 ]; do case $1 in --metrics-file) metrics=$2; shift 2 ;; --fp8-stats-interval) stats=$2; shift 2 ;; *) shift ;; esac; done
echo "$(basename "$metrics" .jsonl) $stats" >> "$(dirname "$0")/stats.txt"
echo "{\"iter\":10,\"val_loss\":6.5}" > "$metrics"
)");
  const std::string command = testing::source_path("scripts/numerics_runs.sh") + " --bin " + bin + " --data " +
                              dir.file("data") + " --runs 'bf16 fp8-delayed blockwise auto-precision' --seeds 7 " +
                              "--parallel 1 --fp8-stats 100 --out " + dir.file("out") + " > /dev/null 2>&1";
  REQUIRE(WEXITSTATUS(std::system(command.c_str())) == 0);
  std::map<std::string, std::string> stats;
  std::ifstream records(dir.file("stats.txt"));
  for (std::string tag, interval; records >> tag >> interval;) stats[tag] = interval;
  CHECK(stats == std::map<std::string, std::string>{
                     {"bf16_s7", "none"}, {"fp8-delayed_s7", "100"}, {"blockwise_s7", "none"}, {"auto-precision_s7", "100"}});
}

TEST_CASE("numerics_runs.sh: each run name passes its precision flags; an unknown name is refused", "[scripts]") {
  testing::TempDir dir;
  // This stand-in records each run's tag and its flags up to --seed (the precision flags).
  const std::string bin = stand_in_fp8lm(dir, R"(#!/usr/bin/env bash
metrics=""; flags=""; seen_seed=0
while [ $# -gt 0 ]; do
  case $1 in
    --metrics-file) metrics=$2; shift 2 ;;
    --seed) seen_seed=1; shift 2 ;;
    --config) shift 2 ;;
    *) [ $seen_seed = 0 ] && flags="$flags $1"; shift ;;
  esac
done
echo "$(basename "$metrics" .jsonl):$flags" >> "$(dirname "$0")/flags.txt"
echo "{\"iter\":10,\"val_loss\":6.5}" > "$metrics"
)");
  const std::string common = testing::source_path("scripts/numerics_runs.sh") + " --bin " + bin + " --data " +
                             dir.file("data") + " --seeds 7 --parallel 1 --out " + dir.file("out");
  REQUIRE(WEXITSTATUS(std::system((common + " --runs 'fp8-speed fp8-bf16-grads fp8-speed-bf16-grads' > /dev/null 2>&1")
                                      .c_str())) == 0);
  std::map<std::string, std::string> flags;
  std::ifstream records(dir.file("flags.txt"));
  for (std::string line; std::getline(records, line);) {
    const size_t colon = line.find(':');
    flags[line.substr(0, colon)] = line.substr(colon + 1);
  }
  CHECK(flags == std::map<std::string, std::string>{
                     {"fp8-speed_s7", " --fp8-hybrid --fp8-lm-head --fp8-fast-accumulation all"},
                     {"fp8-bf16-grads_s7", " --fp8-hybrid --grad-reduce-in-bf16"},
                     {"fp8-speed-bf16-grads_s7",
                      " --fp8-hybrid --fp8-lm-head --fp8-fast-accumulation all --grad-reduce-in-bf16"}});

  const int unknown = std::system((common + " --runs 'bf16 fp8-fastest' > " + dir.file("unknown.txt") + " 2>&1").c_str());
  CHECK(WEXITSTATUS(unknown) == 2);
  std::stringstream message;
  message << std::ifstream(dir.file("unknown.txt")).rdbuf();
  CHECK_THAT(message.str(), ContainsSubstring("unknown run name fp8-fastest"));
}
