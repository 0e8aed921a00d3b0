// The training engine: the model, its gradients, the optimizer and the FP8 scaling state,
// over one backend (layers/ops.h) and, in a parallel run, over the process groups of
// parallel/. The training loop (apps/trainer.cpp) drives it; every rank makes the same calls.
//
// A step must not synchronise with the host (on the GPU), so everything that reads
// results back (step_metrics, evaluate) is a separate call the loop makes only at log
// and eval intervals.
//
// Snapshots (parameters, optimizer state) are in the canonical layout (layout(): every
// tensor whole, Hugging Face names and order) on every rank, whatever the parallel layout:
// the engine gathers them from the ranks' parts and takes its part of what it is given.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "apps/batch_scorer.h"
#include "apps/fp8_statistics.h"
#include "apps/memory_estimate.h"
#include "apps/options.h"
#include "core/fp8.h"
#include "core/logging.h"
#include "core/tensor.h"
#include "layers/op_profiler.h"
#include "layers/ops.h"
#include "optim/adamw.h"
#include "parallel/process_groups.h"

namespace fp8lm {

struct RunSetup;
class GptModel;

struct BenchmarkMemory {
  size_t allocated_bytes = 0;      // every slab the engine allocated
  size_t device_used_bytes = 0;    // the device's own count (context and library pools included)
  size_t optimizer_bytes = 0;      // of allocated_bytes: the FP32 master and the optimizer state (this rank's shard)
  size_t communication_bytes = 0;  // of allocated_bytes: the data-parallel communication buffers
};

// The optimizer state in its stored precision, on the host (checkpoints).
struct OptimizerSnapshot {
  OptimizerStatePrecision precision = OptimizerStatePrecision::fp8_fp16;
  int64_t step_count = 0;             // AdamW's t: applied steps
  std::vector<uint8_t> m8;            // fp8_fp16: E4M3 codes of m * m_scale   [canonical slab]
  std::vector<uint16_t> v16;          // fp8_fp16: FP16 bits of v * v_scale    [canonical slab]
  std::vector<float> m_scales;        // fp8_fp16: [canonical tensors]
  std::vector<float> v_scales;        // fp8_fp16: [canonical tensors]
  std::vector<float> m32, v32;        // fp32 state [canonical slab]
};

// Every FP8 scaling state (amax history and scales), on the host (checkpoints).
struct ScalingSnapshot {
  std::vector<std::string> names;     // "h.0.attn.c_attn.input", ...
  std::vector<Fp8Dtype> dtypes;
  int history_len = 0;
  std::vector<float> history;         // [history_len, S], row 0 current
  std::vector<float> scale;           // [S]
  std::vector<float> scale_inv;       // [S]
  bool initialized = false;           // delayed scales learned (false: current scaling next)
};

// The model's FP8 scaling table as it is on the host now (names, dtypes, histories, scales),
// which a checkpoint's states are matched against by name; `initialized` from its first state.
ScalingSnapshot scaling_table_snapshot(GptModel& model);
// A snapshot of the same states into the model's table and the backend's copy of it.
void restore_scaling_table(Ops& ops, GptModel& model, const ScalingSnapshot& snapshot);

struct StepMetrics {
  double loss = 0.0;       // mean loss over the step's micro-batches
  double grad_norm = 0.0;  // global gradient norm before clipping
  bool skipped = false;    // non-finite loss or gradient: no update was made
};

// The run's AdamW hyperparameters (--adam-beta1, --adam-beta2, --adam-eps) at the step's
// learning rate and weight decay (learning_rate and weight_decay of the run's schedules).
AdamWHyperparams adamw_hyperparams(const TrainOptions& o, double lr, double weight_decay);

// How a new engine's parameters begin: drawn from --seed, or left for the caller, who sets
// every parameter (set_parameters, as a restore does) before any step: an
// --fp8-auto-precision switch restores into an engine that need not draw weights first.
enum class ParameterStart { seeded, set_by_caller };

// The training step, written once over the Ops interface: the CPU reference backend or
// the CUDA one (chosen by the run set-up), the model, the optimizer state and the
// device-resident step control.
class TrainingEngine : public BatchScorer {
 public:
  // `layout`: this rank's place in the run (a single process by default). Every rank of a
  // parallel run constructs its engine together (the process groups are made here).
  explicit TrainingEngine(const RunSetup& setup, const ParallelLayout& layout = {},
                          ParameterStart start = ParameterStart::seeded);
  // Over a given backend (tests wrap one to record the op sequence).
  TrainingEngine(const RunSetup& setup, const ParallelLayout& layout, std::unique_ptr<Ops> ops,
                 ParameterStart start = ParameterStart::seeded);
  ~TrainingEngine() override;
  TrainingEngine(const TrainingEngine&) = delete;
  TrainingEngine& operator=(const TrainingEngine&) = delete;

  // The canonical layout of every snapshot (make_gpt_layout).
  const TensorLayout& layout() const;
  // The host (MPI) groups: checkpoint gathers, metrics, the stop decision.
  const ProcessGroups& host_groups() const override;
  // Bytes each rank sent per communicator since the last reset (benchmarks, the volume model).
  std::vector<std::pair<std::string, CommTraffic>> traffic() const;
  void reset_traffic();
  // The device communicators a Watchdog should watch (empty on the CPU and for one rank).
  std::vector<ncclComm_t> nccl_comms() const;
  // Where a seeded engine's construction went: drawing this rank's initial values on the
  // host, and making the working copy, master weights and FP8 operands from them.
  struct StartupSeconds {
    double zero_host_values = 0;     // of draw_initial_values: the host slab's first touch
    double draw_initial_values = 0;
    double set_parameters = 0;
  };
  StartupSeconds startup_seconds() const;

  // Starts optimizer step `step` (0-based, as end_step's): clears gradients and the loss
  // accumulator. Without `step`: the step after the last end_step (0 at first).
  void begin_step(int64_t step);
  void begin_step();
  // A step of `micro_batches` forward_backward calls where the run's global batch has another
  // count (a batch of the ramp-up, --rampup-batch-size): its loss is their mean.
  void begin_step(int64_t step, int micro_batches);
  // Under --eod-mask-loss --calculate-per-token-loss: `loss_tokens` is this rank's unmasked
  // targets over the step's micro-batches (the loop reads them first), and every unmasked token
  // of the step weighs 1 / (every data-parallel rank's total, agreed on the host here).
  void begin_step(int64_t step, int micro_batches, int64_t loss_tokens);
  // One micro-batch: forward and backward. Each token's loss weighs 1 / (the step's tokens
  // over every data-parallel rank), so that the reduced gradients are those of the global
  // batch's mean loss. inputs/targets [B,T] on the host. Under --eod-mask-loss targets may be
  // kMaskedTarget (core/loss_mask.h) and, as in Megatron, a micro-batch's unmasked tokens
  // weigh 1 / (their count x micro-batches x data-parallel ranks), or with
  // --calculate-per-token-loss 1 / (the step's count over every rank); the step's loss is the
  // sum over every rank's unmasked tokens over their count.
  void forward_backward(const int32_t* inputs, const int32_t* targets);
  // Ends the step: gradient norm, clipping, and (unless the loss or gradient is not
  // finite) the AdamW update and the FP8 scale update. `step` is 0-based. Never waits
  // for the device.
  void end_step(const AdamWHyperparams& hyperparams, double clip_grad, int64_t step);

  // Metrics of the last finished step (waits for the device).
  StepMetrics step_metrics();

  // FP8 statistics (--fp8-stats-interval N; apps/fp8_statistics.h): step `step` collects
  // them when the GEMMs are FP8 and N > 0 with step + 1 (the iteration) a multiple of N, or
  // under --fp8-auto-precision when step is in its calibration window. Such a
  // step counts every FP8 cast of the operands its GEMMs multiply: the activations and
  // gradients of all its micro-batches, and the weight operands (cast at the end of the step
  // before, or, under --overlap-param-gather, in the step's forward; the first step of a run
  // casts them again, identically, to count them). Other steps run exactly as without
  // statistics: the same kernels, no extra work, no host sync.
  bool collects_fp8_statistics(int64_t step) const;
  // After end_step of a step that collected them: one record per FP8 operand that was cast,
  // in scaling-table order, counts summed and amaxes MAX-ed over every rank (so every rank
  // must call it). Waits for the device.
  std::vector<Fp8TensorStatistics> fp8_statistics();
  // Non-finite (skipped) steps so far. Never waits: on the GPU it answers from the
  // newest step whose result has reached the host, so it may lag by a step.
  struct SkipStatus {
    int64_t total = 0;
    int consecutive = 0;
  };
  SkipStatus skip_status();
  // Forward only, through the training model (apps/batch_scorer.h): the periodic evaluation.
  using BatchLoss = fp8lm::BatchLoss;
  BatchLoss evaluate(const int32_t* inputs, const int32_t* targets) override;
  std::vector<BatchLoss> row_losses(const int32_t* inputs, const int32_t* targets) override;

  // Megatron's --check-weight-hash-across-dp-replicas-interval: the CRC-32 of the parameters
  // every data-parallel replica of this rank's tensor-parallel slice holds the same (the
  // working copy, and the FP32 master where it is not sharded). Waits for the device.
  uint32_t replica_checksum();
  // Every data-parallel rank's replica_checksum, compared (a host all-gather): a RuntimeError
  // naming the ranks that differ from rank 0's and `iteration`, on every rank alike.
  void check_replicas_agree(int64_t iteration);

  // The FP32 master weights, [layout().total_elements()], copied to / from the host
  // (checkpoints, tests, initialisation from another model).
  std::vector<float> parameters();
  void set_parameters(const std::vector<float>& values);
  // The gradients (widened to FP32) of the last micro-batches before any reduction, this rank's part,
  // in the canonical layout (tests; with one rank: the step's gradients). After end_step
  // with several data-parallel ranks, the slab has been reduced in place: not meaningful.
  std::vector<float> gradients();

  // Checkpoint state. Setting it replaces the engine's state wholesale; the caller has
  // checked shapes and precisions (apps/checkpointing.cpp converts between them).
  OptimizerSnapshot optimizer_state();
  void set_optimizer_state(const OptimizerSnapshot& state);
  ScalingSnapshot scaling_state();
  void set_scaling_state(const ScalingSnapshot& state);
  // Restores the skip counter of a resumed run (the consecutive count restarts at 0).
  void set_total_skips(int64_t total);

  BenchmarkMemory benchmark_memory() const;
  // --profile-ops: the profiler observing every op (layers/op_profiler.h); nullptr without.
  OpProfiler* op_profiler();
  // Rows for the startup table: memory per tensor class, optimizer bytes per parameter.
  SettingsTable describe() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

std::unique_ptr<TrainingEngine> make_engine(const RunSetup& setup, const ParallelLayout& layout = {},
                                            ParameterStart start = ParameterStart::seeded);

// The backend a run set-up asks for (setup.use_cuda) on `device`, with the model's shape checked
// against the backend's limits first: InputError before anything is allocated.
std::unique_ptr<Ops> make_run_ops(const RunSetup& setup, int device);

}  // namespace fp8lm
