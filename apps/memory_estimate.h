// How much host and device memory a run needs, estimated from the config and the flags
// before anything is allocated, and checked against what the machine has: a run that cannot
// fit is refused at start-up, naming its largest consumers, instead of growing until the
// kernel kills it or ending in a bare std::bad_alloc.
//
// Training (fp8lm train): the estimate follows
// what the engine allocates (apps/engine.cpp: master weights, optimizer state, communication
// buffers; layers/gpt.cpp: the working copy, gradients, weight operands and the activation
// slab; the backends' workspaces; the FP8 amax histories) for this rank's share under tensor
// and data parallelism and the distributed optimizer, plus the host staging of initialisation
// and checkpoints.
// Evaluation (fp8lm eval): what the evaluator allocates (apps/evaluator.cpp; layers/gpt.cpp's
// evaluation model): the working copy and weight operands, one set of block buffers per block
// precision, the batch's logits, the backend's workspaces, and the host staging of the weights.
// Decoding (fp8lm sample): what the generator allocates (apps/generator.cpp; layers/gpt.cpp's
// inference model): the working copy and weight operands, the key/value cache, one block's
// activations for the prompt pass shared by every block, one row of logits per sequence, the
// backend's workspaces, and the host staging of the weights.
// Every size is computed in 64 bits and saturates instead of wrapping, so an absurd shape
// compares above any real memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/logging.h"

namespace fp8lm {

struct RunSetup;
struct GeneratorShape;

struct MemoryConsumer {
  std::string name;           // "activations (micro-batch 4 x seq-length 1024, 12 layers)"
  uint64_t host_bytes = 0;    // this rank's
  uint64_t device_bytes = 0;  // this rank's (0 on a CPU run)
  std::string remedy;         // what shrinks it ("lower --micro-batch-size or --seq-length")
  bool transient = false;     // start-up or checkpoint staging: counted at its peak, not held
  // One of the engine's allocations (TrainingEngine::benchmark_memory), or the decoder's
  // (Generator::allocated_bytes).
  bool engine_slab = false;
};

struct MemoryEstimate {
  std::vector<MemoryConsumer> consumers;
  // Held + the largest transient, on the host and on the device (saturating): the peak.
  uint64_t host_bytes() const;
  uint64_t device_bytes() const;
  // What the engine's (or the decoder's) slabs add up to (parameters, gradients, optimizer,
  // activations, key/value cache, communication buffers, workspaces), the part its
  // benchmark_memory() (allocated_bytes()) reports.
  uint64_t engine_bytes(bool device) const;
};

// fp8lm train: the training engine.
MemoryEstimate estimate_memory(const RunSetup& setup);

// fp8lm eval: the evaluator (apps/evaluator.h) over setup's backend, precision, model and
// tensor-parallel layout.
MemoryEstimate estimate_evaluation_memory(const RunSetup& setup);

// fp8lm sample: the generator of `shape` over setup's backend, precision and model, with its
// weights read from --load / --init-from or drawn at random.
MemoryEstimate estimate_decoding_memory(const RunSetup& setup, const GeneratorShape& shape);

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

// Startup-table rows once everything is allocated: the measured memory beside the estimate.
// `allocations_label` names the slabs `allocated` counts ("engine allocations"); `device`:
// a GPU run, whose memory in use (cudaMemGetInfo) is `device_in_use`.
SettingsTable measured_memory_rows(const MemoryEstimate& estimate, const std::string& allocations_label,
                                   uint64_t allocated, bool device, uint64_t device_in_use);

}  // namespace fp8lm
