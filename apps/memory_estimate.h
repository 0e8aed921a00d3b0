// How much host and device memory a run needs, estimated from the config and the flags
// before anything is allocated, and checked against what the machine has: a run that cannot
// fit is refused at start-up, naming its largest consumers, instead of growing until the
// kernel kills it or ending in a bare std::bad_alloc.
//
// The estimate follows what the engine allocates (apps/engine.cpp: master weights, optimizer
// state, communication buffers; layers/gpt.cpp: the working copy, gradients, weight operands
// and the activation slab; the backends' workspaces; the FP8 amax histories) for this rank's
// share under tensor and data parallelism and the distributed optimizer, plus the host
// staging of initialisation and checkpoints. Every size is computed in 64 bits and saturates
// instead of wrapping, so an absurd shape compares above any real memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/logging.h"

namespace fp8lm {

struct RunSetup;

struct MemoryConsumer {
  std::string name;           // "activations (micro-batch 4 x seq-length 1024, 12 layers)"
  uint64_t host_bytes = 0;    // this rank's
  uint64_t device_bytes = 0;  // this rank's (0 on a CPU run)
  std::string remedy;         // what shrinks it ("lower --micro-batch-size or --seq-length")
  bool transient = false;     // start-up or checkpoint staging: counted at its peak, not held
  bool engine_slab = false;   // one of the engine's allocations (TrainingEngine::benchmark_memory)
};

struct MemoryEstimate {
  std::vector<MemoryConsumer> consumers;
  uint64_t host_bytes() const;    // held + the largest transient (saturating)
  uint64_t device_bytes() const;  // (saturating)
  // What the engine's slabs add up to (parameters, gradients, optimizer, activations,
  // communication buffers, workspaces), the part its benchmark_memory() reports.
  uint64_t engine_bytes(bool device) const;
};

MemoryEstimate estimate_memory(const RunSetup& setup);

// What this machine offers one run.
struct MemoryAvailability {
  uint64_t host_bytes = 0;     // MemAvailable (or a tighter cgroup limit)
  std::string host_source;     // "MemAvailable in /proc/meminfo", "cgroup memory.max"
  bool has_device = false;
  uint64_t device_free_bytes = 0;
  uint64_t device_total_bytes = 0;
};

// The host's available memory, and the free memory of CUDA device `device` when the run is on
// the GPU.
MemoryAvailability query_memory_availability(bool use_cuda, int device);

// Throws InputError when the estimate exceeds what is available: the need, what is
// available and where that number comes from, the largest consumers and a remedy.
// `ranks_on_host`: the ranks of this node, which share its host memory.
void check_memory_fits(const MemoryEstimate& estimate, const MemoryAvailability& available, int ranks_on_host);

// This process as the kernel counts it (/proc/self/status), and the device as CUDA does.
struct MeasuredMemory {
  uint64_t host_peak_bytes = 0;     // VmHWM
  uint64_t host_current_bytes = 0;  // VmRSS
};
MeasuredMemory measure_host_memory();

// "1.25 GiB", "340.0 MiB", "12 KiB", or "more than 16 EiB" for a saturated size.
std::string format_bytes(uint64_t bytes);

// Startup-table rows: the estimate per consumer and the totals.
SettingsTable memory_estimate_rows(const MemoryEstimate& estimate, bool use_cuda);

}  // namespace fp8lm
