// The distributed optimizer (ZeRO-1) across the ranks of one data-parallel group (TP = 1, so
// DP = 2 at 2 ranks and DP = 4 at 4): what each rank allocates, worked out from the
// parameter layout, and the overlapped gradient reduction giving the numbers of the
// reduction at the end of the step, bit for bit, with FP8 gradients too.
//
// "mpi:" cases run the CPU backend over MPI (the lanes run in program order there: these
// check the step's arithmetic and buffers; the stream discipline runs under "nccl:" on GPUs).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <mpi.h>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "core/device.h"
#include "core/random.h"
#include "engine_testing.h"
#include "layers/gpt.h"
#include "parallel/process_groups.h"

using namespace fp8lm;

namespace {

constexpr int kMicroBatch = 2, kSeq = 32, kMicroBatches = 2;

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// The tiny model over one data-parallel group of every rank, two micro-batches a step.
RunSetup data_parallel_setup(const ParallelLayout& layout, const std::string& device, std::vector<std::string> extra) {
  const int global_batch = kMicroBatch * kMicroBatches * layout.dp_size;
  std::vector<std::string> args = {"--config", std::string(FP8LM_SOURCE_DIR) + "/configs/tiny.json", "--mock-data",
                                   "--device", device, "--seq-length", std::to_string(kSeq), "--micro-batch-size",
                                   std::to_string(kMicroBatch), "--global-batch-size", std::to_string(global_batch),
                                   "--lr", "3e-3"};
  args.insert(args.end(), extra.begin(), extra.end());
  return resolve_run_setup(parse_train_command_line(args).options, layout);
}


bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Trained {
  std::vector<float> losses, grad_norms, parameters, scales, history;
  OptimizerSnapshot optimizer;
};

// Three steps of two micro-batches; each data-parallel rank reads its own tokens. With
// --overlap-param-gather AdamW also runs in two calls (the embedding's part first).
Trained train(const std::string& device, const std::vector<std::string>& flags) {
  const ParallelLayout layout = detect_parallel_layout(1);
  TrainingEngine engine(data_parallel_setup(layout, device, flags), layout);
  AdamWHyperparams hp;
  hp.lr = 3e-3f;
  hp.weight_decay = 0.1f;
  const int n = kMicroBatch * kSeq;
  Trained out;
  for (int step = 0; step < 3; ++step) {
    engine.begin_step();
    for (int micro = 0; micro < kMicroBatches; ++micro) {
      const uint64_t seed = 1000 * step + 100 * micro + layout.dp_rank;
      const auto x = testing::tiny_tokens(n, seed), y = testing::tiny_tokens(n, seed + 50);
      engine.forward_backward(x.data(), y.data());
    }
    engine.end_step(hp, 1.0, step);
    const StepMetrics metrics = engine.step_metrics();
    out.losses.push_back(float(metrics.loss));
    out.grad_norms.push_back(float(metrics.grad_norm));
  }
  out.parameters = engine.parameters();
  const ScalingSnapshot scaling = engine.scaling_state();
  out.scales = scaling.scale;
  out.history = scaling.history;
  out.optimizer = engine.optimizer_state();
  return out;
}

// `with_current_amaxes`: also this step's row of the amax history. An overlapped gather of
// FP8 codes (--fp8-param-gather) makes the weight operands as the next forward reaches them,
// not at the end of the step: between steps that row differs until then (resuming records
// them again), so it is compared only without it. An overlapped BF16 gather queues the
// casts behind it at the end of the step (on the background lane on the GPU), and the
// state read waits for them: the same row as without overlap.
void check_same(const Trained& a, const Trained& b, bool with_current_amaxes) {
  CHECK(same_bits(a.losses, b.losses));
  CHECK(same_bits(a.grad_norms, b.grad_norms));
  CHECK(same_bits(a.parameters, b.parameters));
  CHECK(same_bits(a.scales, b.scales));
  if (with_current_amaxes) CHECK(same_bits(a.history, b.history));
  CHECK(a.optimizer.m8 == b.optimizer.m8);
  CHECK(a.optimizer.v16 == b.optimizer.v16);
  CHECK(same_bits(a.optimizer.m_scales, b.optimizer.m_scales));
  CHECK(same_bits(a.optimizer.v_scales, b.optimizer.v_scales));
  CHECK(same_bits(a.optimizer.m32, b.optimizer.m32));
  CHECK(same_bits(a.optimizer.v32, b.optimizer.v32));
}

void check_overlap_changes_nothing(const std::string& device) {
  const std::vector<std::vector<std::string>> flavours = {
      {"--fp8-hybrid", "--fp8-grad-comm"},
      {"--fp8-hybrid", "--fp8-grad-comm", "--fp8-grad-reduce", "reduce-scatter"},
      {"--fp8-hybrid", "--fp8-grad-comm", "--fp8-param-gather"},
      {"--fp8-hybrid", "--grad-reduce-in-bf16"},
      {"--bf16", "--optimizer-state-precision", "fp32"},
  };
  for (const auto& flags : flavours) {
    std::string name;
    for (const std::string& flag : flags) name += flag + " ";
    INFO(name);
    const Trained at_the_end = train(device, flags);
    std::vector<std::string> overlapped = flags;
    overlapped.push_back("--overlap-grad-reduce");
    check_same(at_the_end, train(device, overlapped), /*with_current_amaxes=*/true);
    overlapped.push_back("--overlap-param-gather");
    const bool fp8_codes_gathered = std::find(flags.begin(), flags.end(), "--fp8-param-gather") != flags.end();
    check_same(at_the_end, train(device, overlapped), /*with_current_amaxes=*/!fp8_codes_gathered);
  }
}

size_t optimizer_state_bytes_per_element(const std::vector<std::string>& flags) {
  return std::find(flags.begin(), flags.end(), "fp32") != flags.end() ? 8 : 3;
}

}  // namespace

TEST_CASE("mpi: overlapped gradient reduction, FP8 included, gives the step's numbers bit for bit",
          "[mpi][parallel]") {
  check_overlap_changes_nothing("cpu");
}

TEST_CASE("nccl: overlapped gradient reduction, FP8 included, gives the step's numbers bit for bit",
          "[nccl][parallel]") {
  int gpus = cuda_availability().device_count, fewest = gpus;
  MPI_Allreduce(&gpus, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (fewest < world_size()) SKIP("needs a GPU per rank");
  check_overlap_changes_nothing("cuda");
}

TEST_CASE("mpi: ZeRO-1 holds 1/DP of the master and state, and FP8 gradients one bucket of communication buffers",
          "[mpi][parallel][memory]") {
  const ParallelLayout layout = detect_parallel_layout(1);
  const int dp = layout.dp_size;
  REQUIRE(dp == world_size());
  const std::vector<std::vector<std::string>> flavours = {
      {"--fp32", "--optimizer-state-precision", "fp32"},   // FP32 gradients: no buffer at all
      {"--bf16", "--grad-reduce-in-bf16"},                 // BF16 gradients: reduced in their slab, no buffer
      {"--fp8-hybrid", "--fp8-grad-comm"},                 // FP8 all-to-all: a bucket of codes, and as received
      {"--fp8-hybrid", "--fp8-grad-comm", "--fp8-grad-reduce", "reduce-scatter", "--fp8-param-gather"},
  };
  for (const auto& flags : flavours) {
    std::string name;
    for (const std::string& flag : flags) name += flag + " ";
    INFO(name << "at DP=" << dp);
    const RunSetup setup = data_parallel_setup(layout, "cpu", flags);
    const TrainingEngine engine(setup, layout);
    // Worked out from the layout: S = n / DP elements of master (4 bytes) and state (3 or 8
    // bytes), the FP8 state's two scales per tensor; the buffers are a bucket or two.
    std::vector<ParameterBucket> buckets;
    const TensorLayout slab = make_gpt_shard_layout(setup.model, 1, dp, &buckets);
    const size_t n = slab.total_elements(), S = n / size_t(dp), tensors = slab.tensors().size();
    size_t largest = 0;
    for (const ParameterBucket& b : buckets) largest = std::max(largest, b.end - b.begin);
    const size_t state = optimizer_state_bytes_per_element(flags);
    const BenchmarkMemory memory = engine.benchmark_memory();
    CHECK(memory.optimizer_bytes == 4 * S + state * S + (state == 3 ? 2 * 4 * tensors : 0));
    const auto has = [&](const char* flag) { return std::find(flags.begin(), flags.end(), flag) != flags.end(); };
    size_t communication = 0;
    if (has("--fp8-grad-comm")) communication = has("reduce-scatter") ? largest : 2 * largest;
    if (has("--fp8-param-gather")) communication += n;  // the slab's FP8 codes, gathered in place
    CHECK(memory.communication_bytes == communication);
    // The start-up estimate follows the same buffers, exactly, and the whole within 2%.
    uint64_t estimated_communication = 0;
    for (const MemoryConsumer& c : setup.memory.consumers)
      if (c.name.rfind("communication buffers", 0) == 0) estimated_communication = c.host_bytes;
    CHECK(estimated_communication == communication);
    const double measured = double(memory.allocated_bytes), estimated = double(setup.memory.engine_bytes(false));
    CHECK(std::fabs(estimated - measured) <= 0.02 * measured);
  }
}
