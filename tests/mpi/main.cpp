// main of fp8lm_mpi_tests: every rank runs every test case, in declaration order, between
// MPI_Init_thread and MPI_Finalize. The process fails on every rank when a test failed on any.
// A Watchdog turns a deadlock (ranks out of step after a failure) into a quick abort with a
// message instead of a ctest timeout.
#include <cstdio>
#include <optional>

#include <catch2/catch_session.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
#include <mpi.h>

#include "gpu_fixture.h"
#include "parallel/watchdog.h"

namespace {

std::optional<fp8lm::Watchdog> test_watchdog;

class HeartbeatPerTest : public Catch::EventListenerBase {
 public:
  using Catch::EventListenerBase::EventListenerBase;
  void testCaseStarting(Catch::TestCaseInfo const&) override { beat(); }
  void sectionStarting(Catch::SectionInfo const&) override { beat(); }

 private:
  static void beat() {
    if (test_watchdog) test_watchdog->heartbeat();
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(HeartbeatPerTest)

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  fp8lm::WatchdogOptions watchdog_options;
  watchdog_options.timeout_minutes = 1.0;  // no single test case takes this long
  watchdog_options.rank = rank;
  test_watchdog.emplace(watchdog_options);

  const int failed = Catch::Session().run(argc, argv);

  test_watchdog.reset();
  fp8lm::testing::release_gpu_fixture();  // NCCL communicators go before MPI
  int failed_anywhere = 0;
  MPI_Allreduce(&failed, &failed_anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (failed_anywhere != 0 && failed == 0) {
    std::fprintf(stderr, "rank %d: passed here, but a test failed on another rank\n", rank);
  }
  MPI_Finalize();
  return failed_anywhere;
}
