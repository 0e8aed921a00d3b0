// Ends the whole job, within bounded time, when this rank stops making progress: a rank that
// dies or hangs must never leave the others waiting silently in a collective.
//
// A thread wakes every poll interval (~100 ms) and fires when
//   - no heartbeat() arrived within the timeout (Megatron's --distributed-timeout-minutes,
//     default 10; fractional minutes allowed, for tests), or
//   - a watched NCCL communicator reports an asynchronous error (ncclCommGetAsyncError).
// Firing prints one line to stderr naming the rank and the reason, calls ncclCommAbort on every
// watched communicator, then MPI_Abort(MPI_COMM_WORLD, 1) (std::_Exit(1) without MPI, or when MPI
// lacks MPI_THREAD_MULTIPLE; Open MPI's mpirun then ends the other ranks). It fires at most once.
//
// Construct it after MpiSession (it asks MPI for the thread level once, at construction).
//
// Arming. The timeout runs from construction: a rank stuck before its first step (in NCCL's
// set-up, say) is caught too. The training loop calls heartbeat() once per step; a loop that
// makes progress in small pieces (evaluation batches, checkpoint tensors) calls it too.
// A single long call that reports no progress and waits on no peer (loading a checkpoint file,
// compiling) goes inside a Watchdog::Pause scope instead: while paused the timeout does not
// run, NCCL errors are still polled, and resuming counts as a heartbeat. Pauses nest.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nccl.h>

namespace fp8lm {

struct WatchdogOptions {
  double timeout_minutes = 10.0;  // --distributed-timeout-minutes; > 0
  int rank = 0;                   // world rank, for the message
  std::chrono::milliseconds poll_interval{100};
  // What firing does after the message and the NCCL aborts; empty: end the job (see above).
  // Tests replace it; it runs on the watchdog thread and receives the message line.
  std::function<void(const std::string& message)> on_fire;
};

class Watchdog {
 public:
  // InputError when timeout_minutes is not a positive number (names --distributed-timeout-minutes).
  explicit Watchdog(WatchdogOptions options);
  ~Watchdog();  // stops the thread (does not fire)
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // One atomic store of a timestamp: callable from any thread.
  void heartbeat() noexcept;

  void pause() noexcept;
  void resume() noexcept;  // counts as a heartbeat when the last pause ends
  class Pause {
   public:
    explicit Pause(Watchdog& watchdog) : watchdog_(watchdog) { watchdog_.pause(); }
    ~Pause() { watchdog_.resume(); }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    Watchdog& watchdog_;
  };

  // Polls `comm` for asynchronous errors and aborts it when firing. Call unwatch() before
  // destroying a watched communicator while this Watchdog runs. After firing, the watched
  // communicators are aborted: nothing may use or destroy them (the default firing ends the
  // process; an on_fire replacement has to end it too, or leak them).
  void watch(ncclComm_t comm);
  void unwatch(ncclComm_t comm);

  bool fired() const noexcept { return fired_.load(); }
  double timeout_seconds() const { return timeout_seconds_; }

 private:
  static int64_t now_ns() noexcept;
  void run();
  void abort_watched_comms();
  [[noreturn]] void end_job();
  void fire(const std::string& reason);
  std::string nccl_async_error();  // "" when every watched communicator is healthy

  WatchdogOptions options_;
  double timeout_seconds_;
  bool may_call_mpi_abort_ = false;  // MPI is initialized with MPI_THREAD_MULTIPLE
  std::atomic<int64_t> last_heartbeat_ns_;
  std::atomic<int> pause_depth_{0};
  std::atomic<bool> fired_{false};

  std::mutex comms_mutex_;
  std::vector<ncclComm_t> comms_;

  std::mutex stop_mutex_;
  std::condition_variable stop_signal_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace fp8lm
