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

#include "core/logging.h"
#include "core/tensor.h"
#include "optim/adamw.h"

namespace fp8lm {

struct RunSetup;

struct BenchmarkMemory {
  size_t allocated_bytes = 0;    // every slab the engine allocated
  size_t device_used_bytes = 0;  // the device's own count (context and library pools included)
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

  virtual BenchmarkMemory benchmark_memory() const = 0;

  // Rows for the startup table: memory per tensor class, optimizer bytes per parameter.
  virtual SettingsTable describe() const = 0;
};

std::unique_ptr<TrainingEngine> make_cpu_engine(const RunSetup& setup);
std::unique_ptr<TrainingEngine> make_cuda_engine(const RunSetup& setup);
// The engine for setup.use_cuda.
std::unique_ptr<TrainingEngine> make_engine(const RunSetup& setup);

}  // namespace fp8lm
