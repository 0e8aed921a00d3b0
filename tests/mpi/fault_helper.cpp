// fp8lm_mpi_fault: a two-rank job in which rank 1 fails, for the fault tests
// (tests/mpi/run_fault_test.sh). Both ranks all-reduce one float per step; at step 3 rank 1
//   hang: stops joining the all-reduces (sleeps forever), or
//   kill: sends itself SIGKILL.
// Rank 0 runs a Watchdog with the given timeout, so in both cases it must not wait forever: the
// job has to end with a non-zero exit status.
//   usage: fp8lm_mpi_fault hang|kill [watchdog timeout in seconds, default 5]
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "core/error.h"
#include "parallel/process_groups.h"
#include "parallel/watchdog.h"

using namespace fp8lm;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "hang" && mode != "kill") {
    std::fprintf(stderr, "usage: fp8lm_mpi_fault hang|kill [watchdog timeout in seconds]\n");
    return 2;
  }
  const double timeout_seconds = argc > 2 ? std::atof(argv[2]) : 5.0;

  MpiSession mpi;
  try {
    const ParallelLayout layout = detect_parallel_layout(1);
    ProcessGroups groups = ProcessGroups::create_host(layout);
    std::optional<Watchdog> watchdog;
    if (layout.world_rank == 0) {
      WatchdogOptions options;
      options.timeout_minutes = timeout_seconds / 60.0;
      options.rank = layout.world_rank;
      watchdog.emplace(options);
    }
    for (int step = 0; step < 600; ++step) {
      if (watchdog) watchdog->heartbeat();
      if (layout.world_rank == 1 && step == 3) {
        if (mode == "hang") {
          std::printf("fault helper: rank 1 stops joining collectives at step %d\n", step);
          std::fflush(stdout);
          for (;;) ::sleep(1);
        }
        std::printf("fault helper: rank 1 kills itself at step %d\n", step);
        std::fflush(stdout);
        std::raise(SIGKILL);
      }
      float value = 1.0f;
      groups.world().all_reduce(&value, &value, 1, CommDtype::f32, ReduceOp::sum);
      std::printf("fault helper: rank %d step %d sum %g\n", layout.world_rank, step, value);
      std::fflush(stdout);
      ::usleep(100 * 1000);
    }
    std::printf("fault helper: rank %d finished without noticing the fault\n", layout.world_rank);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "fault helper: rank error: %s\n", e.full_message().c_str());
    mpi.abort_job(kExitRuntimeError);
  }
}
