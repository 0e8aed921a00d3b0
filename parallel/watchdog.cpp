#include "parallel/watchdog.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <mpi.h>

#include "core/error.h"

namespace fp8lm {

namespace {

// ncclCommAbort can itself block (a proxy thread stuck on a dead peer); the job must end anyway.
constexpr std::chrono::seconds kCommAbortGrace{10};

}  // namespace

static_assert(std::atomic<int64_t>::is_always_lock_free, "heartbeat() must be a lock-free store");

Watchdog::Watchdog(WatchdogOptions options) : options_(std::move(options)) {
  if (!std::isfinite(options_.timeout_minutes) || options_.timeout_minutes <= 0) {
    throw InputError(detail::concat("--distributed-timeout-minutes must be a positive number of minutes (got ",
                                    options_.timeout_minutes, ")"));
  }
  FP8LM_CHECK(options_.poll_interval.count() > 0, "watchdog poll interval must be positive");
  timeout_seconds_ = options_.timeout_minutes * 60.0;
  // Asked here, on the thread that owns MPI, because the watchdog thread may not call
  // MPI_Query_thread under MPI_THREAD_FUNNELED.
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    may_call_mpi_abort_ = level == MPI_THREAD_MULTIPLE;
  }
  last_heartbeat_ns_.store(now_ns());
  thread_ = std::thread(&Watchdog::run, this);
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    stop_ = true;
  }
  stop_signal_.notify_all();
  thread_.join();
}

int64_t Watchdog::now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Watchdog::heartbeat() noexcept { last_heartbeat_ns_.store(now_ns(), std::memory_order_relaxed); }

void Watchdog::pause() noexcept { pause_depth_.fetch_add(1); }

void Watchdog::resume() noexcept {
  // The heartbeat goes first, so the thread never sees "not paused" with the old timestamp.
  if (pause_depth_.load() == 1) heartbeat();
  pause_depth_.fetch_sub(1);
}

void Watchdog::watch(ncclComm_t comm) {
  if (comm == nullptr) return;
  std::lock_guard<std::mutex> lock(comms_mutex_);
  if (std::find(comms_.begin(), comms_.end(), comm) == comms_.end()) comms_.push_back(comm);
}

void Watchdog::unwatch(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(comms_mutex_);
  comms_.erase(std::remove(comms_.begin(), comms_.end(), comm), comms_.end());
}

std::string Watchdog::nccl_async_error() {
  std::lock_guard<std::mutex> lock(comms_mutex_);
  for (ncclComm_t comm : comms_) {
    ncclResult_t async_error = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm, &async_error);
    if (asked != ncclSuccess) return std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(asked);
    if (async_error != ncclSuccess && async_error != ncclInProgress) {
      return std::string("an NCCL communicator reported an asynchronous error: ") + ncclGetErrorString(async_error) +
             " (" + ncclGetLastError(comm) + ")";
    }
  }
  return {};
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(stop_mutex_);
  while (!stop_signal_.wait_for(lock, options_.poll_interval, [this] { return stop_; })) {
    lock.unlock();
    std::string reason = nccl_async_error();
    if (reason.empty() && pause_depth_.load() == 0) {
      const double silent_seconds = static_cast<double>(now_ns() - last_heartbeat_ns_.load()) * 1e-9;
      if (silent_seconds > timeout_seconds_) {
        reason = detail::concat("no heartbeat for ", std::round(silent_seconds * 10) / 10, " s (timeout ",
                                options_.timeout_minutes, " min, --distributed-timeout-minutes): a rank hangs or died");
      }
    }
    if (!reason.empty()) {
      fire(reason);
      return;
    }
    lock.lock();
  }
}

void Watchdog::fire(const std::string& reason) {
  fired_.store(true);
  const std::string message = detail::concat("fp8lm watchdog: rank ", options_.rank, ": ", reason, "; aborting the job");
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  abort_watched_comms();
  if (options_.on_fire) {
    options_.on_fire(message);
    return;
  }
  end_job();
}

void Watchdog::abort_watched_comms() {
  std::vector<ncclComm_t> comms;
  {
    std::lock_guard<std::mutex> lock(comms_mutex_);
    comms.swap(comms_);
  }
  if (comms.empty()) return;
  // On a thread of its own, so that a blocked abort cannot keep the job alive.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread aborter([comms, done] {
    for (ncclComm_t comm : comms) ncclCommAbort(comm);
    done->store(true);
  });
  const auto deadline = std::chrono::steady_clock::now() + kCommAbortGrace;
  while (!done->load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done->load()) {
    aborter.join();
  } else {
    std::fprintf(stderr, "fp8lm watchdog: rank %d: ncclCommAbort did not return within %lld s\n", options_.rank,
                 static_cast<long long>(kCommAbortGrace.count()));
    aborter.detach();
  }
}

void Watchdog::end_job() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (may_call_mpi_abort_ && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

}  // namespace fp8lm
