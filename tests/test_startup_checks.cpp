// Start-up and fault handling of the binary: signals during start-up, `ulimit -f`, unusable
// output paths and non-regular input files. Each case runs fp8lm as a user would.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "cli_testing.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using Catch::Matchers::ContainsSubstring;
using fp8lm::testing::run_fp8lm;
using fp8lm::testing::TempDir;

namespace {

const std::string kTiny = fp8lm::testing::source_path("configs/tiny.json");
const std::string kQuickRun =
    "--config " + kTiny + " --device cpu --seq-length 32 --micro-batch-size 1 --eval-interval 0 --log-interval 1 ";

std::string file_text(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// Checks the common shape of a refusal at start-up: exit 2, one error line naming `expected`,
// and no training step.
void require_refused_before_work(const fp8lm::testing::CommandResult& run, const std::string& expected) {
  INFO(run.output);
  CHECK(run.exit_code == 2);
  CHECK_THAT(run.output, ContainsSubstring("fp8lm: error: ") && ContainsSubstring(expected));
  CHECK(run.output.find("iter ") == std::string::npos);
}

}  // namespace

TEST_CASE("SIGTERM during start-up exits at once with a message", "[startup]") {
  TempDir dir;
  // A sparse 8 GiB raw shard of token 0: validating it takes seconds, and costs no disk.
  const std::string shard = dir.file("huge.bin");
  {
    const int fd = ::open(shard.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, off_t{8} << 30) == 0);
    ::close(fd);
  }
  const std::string log = dir.file("run.log");
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const std::string command = std::string("exec ") + FP8LM_BINARY + " " + kQuickRun +
                                "--data-format raw-uint16 --train-iters 1 --train-data-path " + shard + " > " + log +
                                " 2>&1";
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // The settings table's last row is logged just before the shards are opened and validated.
  const auto start = std::chrono::steady_clock::now();
  bool in_startup = false;
  while (!in_startup && std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    in_startup = file_text(log).find("| benchmark") != std::string::npos;
  }
  kill(child, SIGTERM);
  const auto signalled = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(child, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - signalled < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (done == 0) {  // still scanning: the signal was not acted on
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  const std::string output = file_text(log);
  INFO(output);
  REQUIRE(in_startup);
  REQUIRE(done == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGTERM);
  CHECK_THAT(output, ContainsSubstring("fp8lm: stopped by SIGTERM during start-up"));
  CHECK(std::chrono::steady_clock::now() - signalled < std::chrono::seconds(2));
}

TEST_CASE("a checkpoint past `ulimit -f` is a write error naming the file, not a silent SIGXFSZ", "[startup]") {
  TempDir dir;
  const std::string save = dir.file("ckpt");
  // 64 blocks (32 or 64 KiB, by the shell) hold the warnings but not the tiny model's 0.5 MB.
  const auto run = fp8lm::testing::run_command("ulimit -f 64; exec " + std::string(FP8LM_BINARY) + " " + kQuickRun +
                                               "--mock-data --train-iters 1 --log-level warn --save " + save);
  INFO(run.output);
  CHECK(run.exit_code == 1);
  CHECK_THAT(run.output, ContainsSubstring("fp8lm: error: ") && ContainsSubstring(save) &&
                             ContainsSubstring("File too large"));
}

TEST_CASE("an unusable --save is refused before any work", "[startup]") {
  TempDir dir;
  const std::string base = kQuickRun + "--mock-data --train-iters 5 --save ";

  const std::string regular = dir.file("a_file");
  std::ofstream(regular) << "not a directory";
  require_refused_before_work(run_fp8lm(base + regular), "--save " + regular + ": exists and is not a directory");

  const std::string under_file = regular + "/ckpt";
  require_refused_before_work(run_fp8lm(base + under_file), regular + " is not a directory");

  // /proc refuses new files even to root.
  require_refused_before_work(run_fp8lm(base + "/proc/fp8lm_ckpt"), "cannot create files in /proc");

  // Permission bits bind only a user without CAP_DAC_OVERRIDE.
  if (::geteuid() != 0) {
    const std::string read_only = dir.file("read_only");
    fs::create_directories(read_only);
    fs::permissions(read_only, fs::perms::owner_read | fs::perms::owner_exec);
    require_refused_before_work(run_fp8lm(base + read_only), "cannot create files in " + read_only);
    require_refused_before_work(run_fp8lm(base + read_only + "/new/deeper"), "cannot create files in " + read_only);
    fs::permissions(read_only, fs::perms::owner_all);
  }

  // A directory that does not exist yet, under a writable one, is fine. It is created at
  // start-up only for the run's lock (a second run saving there must find it), and holds
  // nothing else until the first save.
  const std::string fresh = dir.file("fresh/nested");
  const auto ok = run_fp8lm(kQuickRun + "--mock-data --train-iters 0 --save " + fresh);
  INFO(ok.output);
  CHECK(ok.exit_code == 0);
  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(fresh)) entries.push_back(entry.path().filename().string());
  CHECK(entries == std::vector<std::string>{".fp8lm.lock"});
}

TEST_CASE("an unusable --metrics-file is refused before any work", "[startup]") {
  TempDir dir;
  const std::string base = kQuickRun + "--mock-data --train-iters 5 --metrics-file ";
  require_refused_before_work(run_fp8lm(base + dir.path().string()), "--metrics-file " + dir.path().string() +
                                                                         ": cannot open for appending (Is a directory)");
  require_refused_before_work(run_fp8lm(base + dir.file("missing/m.jsonl")), "No such file or directory");
  // A FIFO nobody reads would block the open; refused instead.
  const std::string fifo = dir.file("metrics.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  require_refused_before_work(
      fp8lm::testing::run_command("timeout 20 " + std::string(FP8LM_BINARY) + " " + base + fifo),
                              "--metrics-file " + fifo);
}

TEST_CASE("a failed metrics write ends the run with an error naming the file", "[startup]") {
  if (!fs::exists("/dev/full")) SKIP("no /dev/full");
  const auto run = run_fp8lm(kQuickRun + "--mock-data --train-iters 2 --metrics-file /dev/full");
  INFO(run.output);
  CHECK(run.exit_code == 1);
  CHECK_THAT(run.output,
             ContainsSubstring("fp8lm: error: --metrics-file /dev/full: write failed (No space left on device)"));
}

TEST_CASE("FIFOs and directories as --config or data are refused at once", "[startup]") {
  TempDir dir;
  const std::string fifo = dir.file("input.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // `timeout`: the old behaviour, a blocking open, must fail the test rather than hang it.
  const std::string binary = "timeout 20 " + std::string(FP8LM_BINARY) + " ";
  auto run = [&](const std::string& arguments) { return fp8lm::testing::run_command(binary + arguments); };

  require_refused_before_work(run("--config " + fifo + " --mock-data --device cpu"),
                              fifo + ": not a regular file (a FIFO");
  require_refused_before_work(run("--config " + dir.path().string() + " --mock-data --device cpu"),
                              dir.path().string() + ": not a regular file (a directory)");
  require_refused_before_work(run(kQuickRun + "--train-iters 1 --train-data-path " + fifo),
                              fifo + ": not a regular file (a FIFO");
  require_refused_before_work(run(kQuickRun + "--mock-data --train-iters 1 --valid-data-path " + fifo),
                              fifo + ": not a regular file (a FIFO");
}
