// Process-group layout math and validation, groups of one without MPI, the recording decorator's
// lines, and the watchdog's timing. Nothing here initializes MPI: the multi-rank tests live in
// tests/mpi/ (fp8lm_mpi_tests, run under mpirun).
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <mpi.h>

#include "gpu_testing.h"
#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/process_groups.h"
#include "parallel/recording_communicator.h"
#include "parallel/watchdog.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

struct ExpectedLayout {
  int tp_size;
  int tp_rank[8];
  int dp_rank[8];
  std::vector<std::vector<int>> tp_groups;  // world ranks, by dp_rank
  std::vector<std::vector<int>> dp_groups;  // world ranks, by tp_rank
};

// Worked out by hand from Megatron's rule: tp groups consecutive, dp groups strided.
const ExpectedLayout kWorld8[] = {
    {1,
     {0, 0, 0, 0, 0, 0, 0, 0},
     {0, 1, 2, 3, 4, 5, 6, 7},
     {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
     {{0, 1, 2, 3, 4, 5, 6, 7}}},
    {2,
     {0, 1, 0, 1, 0, 1, 0, 1},
     {0, 0, 1, 1, 2, 2, 3, 3},
     {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
     {{0, 2, 4, 6}, {1, 3, 5, 7}}},
    {4,
     {0, 1, 2, 3, 0, 1, 2, 3},
     {0, 0, 0, 0, 1, 1, 1, 1},
     {{0, 1, 2, 3}, {4, 5, 6, 7}},
     {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
    {8,
     {0, 1, 2, 3, 4, 5, 6, 7},
     {0, 0, 0, 0, 0, 0, 0, 0},
     {{0, 1, 2, 3, 4, 5, 6, 7}},
     {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
};

std::string input_error_of(int world_rank, int world_size, int tp_size) {
  try {
    make_parallel_layout(world_rank, world_size, tp_size);
  } catch (const InputError& e) {
    return e.full_message();
  }
  return "(no error)";
}

bool mpi_is_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

// Sets or unsets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

template <typename T>
std::vector<T> values(std::initializer_list<T> list) {
  return std::vector<T>(list);
}

// Waits until `condition` holds or `limit` passes; returns whether it held.
template <typename Condition>
bool wait_until(Condition condition, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A Watchdog whose firing is recorded instead of ending the process.
struct RecordedFiring {
  std::atomic<bool> fired{false};
  std::mutex mutex;
  std::string message;

  WatchdogOptions options(double timeout_seconds, int rank = 0) {
    WatchdogOptions o;
    o.timeout_minutes = timeout_seconds / 60.0;
    o.rank = rank;
    o.poll_interval = std::chrono::milliseconds(20);
    o.on_fire = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex);
      message = line;
      fired.store(true);
    };
    return o;
  }
};

}  // namespace

TEST_CASE("process_groups: tp and dp ranks of every world rank for W=8", "[process_groups]") {
  for (const ExpectedLayout& expected : kWorld8) {
    for (int world_rank = 0; world_rank < 8; ++world_rank) {
      INFO("TP " << expected.tp_size << " world rank " << world_rank);
      const ParallelLayout layout = make_parallel_layout(world_rank, 8, expected.tp_size);
      CHECK(layout.world_size == 8);
      CHECK(layout.world_rank == world_rank);
      CHECK(layout.tp_size == expected.tp_size);
      CHECK(layout.dp_size == 8 / expected.tp_size);
      CHECK(layout.tp_rank == expected.tp_rank[world_rank]);
      CHECK(layout.dp_rank == expected.dp_rank[world_rank]);
      CHECK(tensor_parallel_group_ranks(layout) == expected.tp_groups[layout.dp_rank]);
      CHECK(data_parallel_group_ranks(layout) == expected.dp_groups[layout.tp_rank]);
      // A rank sits at its own group ranks: position tp_rank of its tp group, dp_rank of its dp group.
      CHECK(tensor_parallel_group_ranks(layout)[layout.tp_rank] == world_rank);
      CHECK(data_parallel_group_ranks(layout)[layout.dp_rank] == world_rank);
    }
  }
}

TEST_CASE("process_groups: a bad tensor-parallel size is a one-line error naming the flag", "[process_groups]") {
  CHECK(input_error_of(0, 8, 0) == "--tensor-model-parallel-size must be >= 1 (got 0)");
  CHECK(input_error_of(0, 8, -2) == "--tensor-model-parallel-size must be >= 1 (got -2)");
  const std::string three = input_error_of(5, 8, 3);
  CHECK_THAT(three, ContainsSubstring("--tensor-model-parallel-size 3 does not divide the world size 8"));
  CHECK_THAT(three, ContainsSubstring("HINT: launch a multiple of 3 processes"));
  const std::string alone = input_error_of(0, 1, 2);
  CHECK_THAT(alone, ContainsSubstring("--tensor-model-parallel-size 2 does not divide the world size 1"));
  CHECK_THAT(alone, ContainsSubstring("mpirun -np 2"));
  for (const std::string& message : {three, alone}) CHECK(message.find('\n') == std::string::npos);
  CHECK_THROWS_AS(make_parallel_layout(8, 8, 1), RuntimeError);  // a rank outside the world is a bug, not input
}

TEST_CASE("process_groups: ranks on a node must not outnumber its GPUs", "[process_groups]") {
  const ParallelLayout eight_local = make_parallel_layout(3, 16, 2, /*local_rank=*/3, /*local_size=*/8);
  CHECK_NOTHROW(check_ranks_fit_gpus(eight_local, 8));
  try {
    check_ranks_fit_gpus(eight_local, 4);
    FAIL("8 ranks on 4 GPUs accepted");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()) == "8 ranks run on the node of rank 3 but it has 4 GPUs: fp8lm runs one rank per GPU");
    CHECK_THAT(e.hint(), ContainsSubstring("mpirun --npernode 4"));
  }
  CHECK_THROWS_AS(check_ranks_fit_gpus(eight_local, 0), InputError);
  CHECK_NOTHROW(check_ranks_fit_gpus(make_parallel_layout(0, 1, 1), 1));
}

TEST_CASE("process_groups: launched_by_mpi reads the launcher's environment", "[process_groups]") {
  ScopedEnv open_mpi("OMPI_COMM_WORLD_SIZE", nullptr), pmi("PMI_SIZE", nullptr), pmix("PMIX_RANK", nullptr);
  CHECK_FALSE(launched_by_mpi());
  {
    ScopedEnv set("OMPI_COMM_WORLD_SIZE", "4");
    CHECK(launched_by_mpi());
  }
  {
    ScopedEnv set("PMI_SIZE", "2");
    CHECK(launched_by_mpi());
  }
  {
    ScopedEnv set("PMIX_RANK", "0");
    CHECK(launched_by_mpi());
  }
}

TEST_CASE("process_groups: a single process builds groups of one without MPI", "[process_groups]") {
  ScopedEnv open_mpi("OMPI_COMM_WORLD_SIZE", nullptr), pmi("PMI_SIZE", nullptr), pmix("PMIX_RANK", nullptr);
  REQUIRE_FALSE(mpi_is_initialized());
  MpiSession session;
  CHECK_FALSE(session.active());
  const ParallelLayout layout = detect_parallel_layout(1);
  CHECK(layout.world_size == 1);
  CHECK(layout.local_size == 1);
  CHECK_THROWS_AS(detect_parallel_layout(2), InputError);

  ProcessGroups groups = ProcessGroups::create_host(layout);
  CHECK(groups.nccl_comms().empty());
  for (Communicator* comm : {&groups.world(), &groups.tp(), &groups.dp(), &groups.dp_background()}) {
    INFO(comm->name());
    CHECK(comm->size() == 1);
    CHECK(comm->rank() == 0);

    const std::vector<float> input = {1.5f, -2.0f, 3.25f};
    std::vector<float> out(3, 0.0f);
    comm->all_reduce(input.data(), out.data(), 3, CommDtype::f32, ReduceOp::sum);
    CHECK(out == input);
    std::vector<float> in_place = input;
    comm->all_reduce(in_place.data(), in_place.data(), 3, CommDtype::f32, ReduceOp::max);
    CHECK(in_place == input);

    const std::vector<uint16_t> bf16 = {0x3F80, 0x4000};
    std::vector<uint16_t> bf16_out(2, 0);
    comm->reduce_scatter(bf16.data(), bf16_out.data(), 2, CommDtype::bf16, ReduceOp::sum);
    CHECK(bf16_out == bf16);

    const std::vector<uint8_t> codes = {0x38, 0x7E, 0xFE};
    std::vector<uint8_t> gathered(3, 0);
    comm->all_gather(codes.data(), gathered.data(), 3, CommDtype::e4m3);
    CHECK(gathered == codes);
    std::vector<uint8_t> exchanged(3, 0);
    comm->all_to_all(codes.data(), exchanged.data(), 3, CommDtype::u8);
    CHECK(exchanged == codes);
    std::vector<double> broadcast = {7.0};
    comm->broadcast(broadcast.data(), 1, CommDtype::f64, 0);
    CHECK(broadcast == values({7.0}));
    comm->barrier();

    const CommTraffic& traffic = comm->traffic();
    CHECK(traffic.total_bytes_sent() == 0);  // a group of one sends nothing
    CHECK(traffic[Collective::all_reduce].calls == 2);
    CHECK(traffic[Collective::barrier].calls == 1);
    CHECK(traffic.total_calls() == 7);
    comm->reset_traffic();
    CHECK(comm->traffic().total_calls() == 0);
  }
  CHECK(groups.world().name() == "world");
  CHECK(groups.tp().name() == "tp");
  CHECK(groups.dp().name() == "dp");
  CHECK(groups.dp_background().name() == "dp_background");
  CHECK_FALSE(mpi_is_initialized());
}

TEST_CASE("process_groups: misuse is refused before any rank communicates", "[process_groups]") {
  ProcessGroups groups = ProcessGroups::create_host(make_parallel_layout(0, 1, 1));
  Communicator& tp = groups.tp();
  std::vector<uint8_t> bytes(16, 0);
  try {
    tp.all_reduce(bytes.data(), bytes.data(), 4, CommDtype::u8, ReduceOp::sum);
    FAIL("u8 reduced");
  } catch (const RuntimeError& e) {
    CHECK_THAT(std::string(e.what()), ContainsSubstring("tp.all_reduce: u8 is raw bytes and has no sum reduction"));
  }
  CHECK_THROWS_AS(tp.reduce_scatter(bytes.data(), bytes.data(), 4, CommDtype::u8, ReduceOp::max), RuntimeError);
  CHECK_THROWS_AS(tp.broadcast(bytes.data(), 4, CommDtype::u8, 1), RuntimeError);
  CHECK_THROWS_AS(tp.broadcast(bytes.data(), 4, CommDtype::u8, -1), RuntimeError);
  // Overlapping but not the same buffer (all_reduce), or not the allowed in-place block.
  CHECK_THROWS_AS(tp.all_reduce(bytes.data(), bytes.data() + 1, 4, CommDtype::e4m3, ReduceOp::sum), RuntimeError);
  CHECK_THROWS_AS(tp.all_gather(bytes.data() + 2, bytes.data(), 4, CommDtype::u8), RuntimeError);
  CHECK_THROWS_AS(tp.reduce_scatter(bytes.data(), bytes.data() + 1, 4, CommDtype::e5m2, ReduceOp::sum),
                  RuntimeError);
  CHECK_THROWS_AS(tp.all_to_all(bytes.data(), bytes.data() + 2, 4, CommDtype::u8), RuntimeError);
  CHECK(tp.traffic().total_calls() == 0);  // refused calls are not counted
}

TEST_CASE("process_groups: the recording decorator writes one line per call and forwards it", "[process_groups]") {
  ProcessGroups groups = ProcessGroups::create_host(make_parallel_layout(0, 1, 1));
  std::vector<std::string> log;
  RecordingCommunicator tp(groups.tp(), log), dp(groups.dp(), log);
  CHECK(tp.name() == "tp");
  std::vector<uint16_t> bf16(1024, 0x3F80), bf16_out(1024, 0);
  std::vector<uint8_t> bytes(8, 0x11), bytes_out(8, 0);
  std::vector<float> floats(4, 2.0f), floats_out(4, 0.0f);
  tp.all_reduce(bf16.data(), bf16_out.data(), 1024, CommDtype::bf16, ReduceOp::sum);
  log.push_back("op: something between");
  dp.reduce_scatter(floats.data(), floats_out.data(), 4, CommDtype::f32, ReduceOp::max);
  tp.all_gather(bytes.data(), bytes_out.data(), 8, CommDtype::e4m3);
  dp.broadcast(floats.data(), 4, CommDtype::f32, 0);
  tp.all_to_all(bytes.data(), bytes_out.data(), 8, CommDtype::u8);
  dp.barrier();
  CHECK(log == std::vector<std::string>{"tp.all_reduce bf16 x1024 sum", "op: something between",
                                        "dp.reduce_scatter f32 x4 max", "tp.all_gather e4m3 x8",
                                        "dp.broadcast f32 x4 root=0", "tp.all_to_all u8 x8", "dp.barrier"});
  CHECK(bf16_out == bf16);  // forwarded to the group of one, which copies
  CHECK(bytes_out == bytes);
  CHECK(tp.traffic().total_calls() == 3);
  CHECK(groups.tp().traffic().total_calls() == 3);
}

TEST_CASE("process_groups: NCCL groups of one copy on their streams without NCCL", "[process_groups][gpu]") {
  FP8LM_REQUIRE_GPU();
  ScopedEnv open_mpi("OMPI_COMM_WORLD_SIZE", nullptr), pmi("PMI_SIZE", nullptr), pmix("PMIX_RANK", nullptr);
  REQUIRE_FALSE(mpi_is_initialized());
  cudaStream_t streams[4];
  for (cudaStream_t& s : streams) CUDA_CHECK(cudaStreamCreate(&s));
  {
    ProcessGroups groups =
        ProcessGroups::create_gpu(make_parallel_layout(0, 1, 1), NcclStreams{streams[0], streams[1], streams[2], streams[3]});
    CHECK(groups.nccl_comms().empty());
    const std::vector<float> input = {1.0f, 2.0f, 3.0f, 4.0f};
    cuda::DeviceBuffer<float> send = testing::device_copy(input);
    cuda::DeviceBuffer<float> recv(4);
    for (Communicator* comm : {&groups.world(), &groups.tp(), &groups.dp(), &groups.dp_background()}) {
      INFO(comm->name());
      recv.fill_bytes(testing::kPoisonByte);
      CUDA_CHECK(cudaDeviceSynchronize());
      comm->all_reduce(send.data(), recv.data(), 4, CommDtype::f32, ReduceOp::sum);
      comm->barrier();  // waits for the communicator's stream
      CHECK(recv.download() == input);
      recv.fill_bytes(testing::kPoisonByte);
      CUDA_CHECK(cudaDeviceSynchronize());
      comm->all_gather(send.data(), recv.data(), 4, CommDtype::f32);
      comm->barrier();
      CHECK(recv.download() == input);
    }
  }
  for (cudaStream_t s : streams) CUDA_CHECK(cudaStreamDestroy(s));
  CHECK_FALSE(mpi_is_initialized());
}

TEST_CASE("process_groups: watchdog fires without heartbeats and names the rank", "[process_groups][watchdog]") {
  RecordedFiring firing;
  const auto start = std::chrono::steady_clock::now();
  Watchdog watchdog(firing.options(/*timeout_seconds=*/0.3, /*rank=*/3));
  REQUIRE(wait_until([&] { return firing.fired.load(); }, std::chrono::seconds(10)));
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(elapsed >= 0.3);
  CHECK(watchdog.fired());
  std::lock_guard<std::mutex> lock(firing.mutex);
  CHECK_THAT(firing.message, ContainsSubstring("fp8lm watchdog: rank 3: no heartbeat for"));
  CHECK_THAT(firing.message, ContainsSubstring("--distributed-timeout-minutes"));
  CHECK(firing.message.find('\n') == std::string::npos);
}

TEST_CASE("process_groups: watchdog stays quiet while heartbeats arrive", "[process_groups][watchdog]") {
  RecordedFiring firing;
  Watchdog watchdog(firing.options(/*timeout_seconds=*/1.0));
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(2500);
  while (std::chrono::steady_clock::now() < end) {
    watchdog.heartbeat();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK_FALSE(firing.fired.load());
}

TEST_CASE("process_groups: watchdog does not fire while paused, and resuming restarts the clock",
          "[process_groups][watchdog]") {
  RecordedFiring firing;
  Watchdog watchdog(firing.options(/*timeout_seconds=*/0.5));
  {
    Watchdog::Pause outer(watchdog);
    {
      Watchdog::Pause inner(watchdog);  // pauses nest
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(600));  // still inside `outer`
    CHECK_FALSE(firing.fired.load());
  }
  // Resuming counted as a heartbeat: no firing right away, then firing once the timeout passes.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  CHECK_FALSE(firing.fired.load());
  CHECK(wait_until([&] { return firing.fired.load(); }, std::chrono::seconds(10)));
}

TEST_CASE("process_groups: watchdog timeout must be a positive number of minutes", "[process_groups][watchdog]") {
  for (double minutes : {0.0, -1.0, std::nan("")}) {
    WatchdogOptions options;
    options.timeout_minutes = minutes;
    try {
      Watchdog watchdog(options);
      FAIL("accepted timeout " << minutes);
    } catch (const InputError& e) {
      CHECK_THAT(std::string(e.what()), ContainsSubstring("--distributed-timeout-minutes must be a positive number"));
    }
  }
  const auto start = std::chrono::steady_clock::now();
  {
    Watchdog idle(WatchdogOptions{});  // the default 10 minutes; destruction stops it promptly
    CHECK(idle.timeout_seconds() == 600.0);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
}
