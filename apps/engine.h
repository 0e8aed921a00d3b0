// A training engine: the model, its gradients, the optimizer and the FP8 scaling state
// on one device. The training loop (apps/trainer.cpp) drives an engine without
// knowing whether it is the CPU reference or the CUDA implementation.
//
// The GPU engine must not synchronise with the host inside a step, so everything that
// reads results back (step_metrics, evaluate) is a separate call the loop makes only
// at log and eval intervals.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/fp8.h"
#include "core/logging.h"
#include "core/tensor.h"
#include "optim/adamw.h"

namespace fp8lm {

struct RunSetup;

struct BenchmarkMemory {
  size_t allocated_bytes = 0;    // every slab the engine allocated
  size_t device_used_bytes = 0;  // the device's own count (context and library pools included)
};

// The optimizer state in its stored precision, on the host (checkpoints).
struct OptimizerSnapshot {
  OptimizerStatePrecision precision = OptimizerStatePrecision::fp8_fp16;
  int64_t step_count = 0;             // AdamW's t: applied steps
  std::vector<uint8_t> m8;            // fp8_fp16: E4M3 codes of m * m_scale   [slab]
  std::vector<uint16_t> v16;          // fp8_fp16: FP16 bits of v * v_scale    [slab]
  std::vector<float> m_scales;        // fp8_fp16: [tensors]
  std::vector<float> v_scales;        // fp8_fp16: [tensors]
  std::vector<float> m32, v32;        // fp32 state [slab]
};

// Every FP8 scaling state (amax history and scales), on the host (checkpoints).
struct ScalingSnapshot {
  std::vector<std::string> names;     // "h.0.attn.c_attn.input", ...
  std::vector<Fp8Dtype> dtypes;
  int history_len = 0;
  std::vector<float> history;         // [S, history_len], slot 0 current
  std::vector<float> scale;           // [S]
  std::vector<float> scale_inv;       // [S]
  bool initialized = false;           // delayed scales learned (false: current scaling next)
};

struct StepMetrics {
  double loss = 0.0;       // mean loss over the step's micro-batches
  double grad_norm = 0.0;  // global gradient norm before clipping
  bool skipped = false;    // non-finite loss or gradient: no update was made
};

class TrainingEngine {
 public:
  virtual ~TrainingEngine() = default;
  virtual const TensorLayout& layout() const = 0;

  // Starts an optimizer step: clears gradients and the loss accumulator.
  virtual void begin_step() = 0;
  // One micro-batch: forward and backward, gradients accumulated with weight `dloss`
  // per token loss (1 / (B*T*accumulation steps)). inputs/targets [B,T] on the host.
  virtual void forward_backward(const int32_t* inputs, const int32_t* targets, float dloss) = 0;
  // Ends the step: gradient norm, clipping, and (unless the loss or gradient is not
  // finite) the AdamW update and the FP8 scale update. `step` is 0-based.
  virtual void end_step(const AdamWHyperparams& hyperparams, double clip_grad, int64_t step) = 0;

  // Metrics of the last finished step (may wait for the device).
  virtual StepMetrics step_metrics() = 0;
  // Non-finite (skipped) steps so far. Never waits: the GPU engine answers from the
  // newest step whose result has reached the host, so it may lag by a step.
  struct SkipStatus {
    int64_t total = 0;
    int consecutive = 0;
  };
  virtual SkipStatus skip_status() = 0;
  // Mean loss of one batch, forward only; touches no training state.
  virtual double evaluate(const int32_t* inputs, const int32_t* targets) = 0;

  // The FP32 master weights, [layout().total_elements()], copied to / from the host
  // (checkpoints, tests, initialisation from another model).
  virtual std::vector<float> parameters() = 0;
  virtual void set_parameters(const std::vector<float>& values) = 0;

  // Checkpoint state. Setting it replaces the engine's state wholesale; the caller has
  // checked shapes and precisions (apps/checkpointing.cpp converts between them).
  virtual OptimizerSnapshot optimizer_state() = 0;
  virtual void set_optimizer_state(const OptimizerSnapshot& state) = 0;
  virtual ScalingSnapshot scaling_state() = 0;
  virtual void set_scaling_state(const ScalingSnapshot& state) = 0;
  // Restores the skip counter of a resumed run (the consecutive count restarts at 0).
  virtual void set_total_skips(int64_t total) = 0;

  virtual BenchmarkMemory benchmark_memory() const = 0;

  // Rows for the startup table: memory per tensor class, optimizer bytes per parameter.
  virtual SettingsTable describe() const = 0;
};

std::unique_ptr<TrainingEngine> make_cpu_engine(const RunSetup& setup);
std::unique_ptr<TrainingEngine> make_cuda_engine(const RunSetup& setup);
// The engine for setup.use_cuda.
std::unique_ptr<TrainingEngine> make_engine(const RunSetup& setup);

}  // namespace fp8lm
