// Everything a run needs that is derived from the flags: the model config (file plus
// overrides), the sequence length, the batch arithmetic and the device. Resolved and
// validated before any work starts.
#pragma once

#include "apps/memory_estimate.h"
#include "apps/options.h"
#include "core/gpt_config.h"
#include "core/logging.h"
#include "layers/gpt.h"
#include "optim/batch_rampup.h"
#include "optim/lr_schedule.h"
#include "parallel/process_groups.h"

namespace fp8lm {

struct RunSetup {
  TrainOptions options;
  GptConfig model;
  int seq_length = 0;
  ParallelLayout parallel;  // this rank's place in the run
  int data_parallel_size = 1;
  int data_parallel_rank = 0;
  int grad_accum_steps = 1;   // of a global batch (after a ramp-up)
  int global_batch_size = 0;
  BatchRampup rampup;         // --rampup-batch-size (rampup.enabled()), with global_batch_size its end
  // --eod-mask-loss: the end-of-document token whose next-token targets the loss skips
  // (--vocab-file's <|endoftext|>, else GPT-2's 50256); -1 without the flag.
  int32_t loss_mask_token = -1;
  // --reset-position-ids / --reset-attention-mask, with the same end-of-document token.
  DocumentMasking documents;
  bool use_cuda = false;
  std::string device_description;
  // This rank's host and device memory, estimated before anything is allocated (for fp8lm
  // sample, by the command once it knows the prompt: estimate_decoding_memory).
  MemoryEstimate memory;
};

// Throws InputError naming the flag or file at the first problem: every check that needs the
// model config and the parallel layout (sizes that must divide each other) is here, the last
// being that the run's estimated memory fits the host (and the GPU). fp8lm sample
// (options.command) makes that last check itself, once it knows the prompt's length.
RunSetup resolve_run_setup(const TrainOptions& options, const ParallelLayout& parallel = {});

// The run's learning-rate schedule in optimizer steps. Iteration-based, Megatron's counts as
// given; sample-based (--train-samples), its counts of sequences over the global batch, so that
// step n sees the rate Megatron's sample-counted schedule gives after n global batches.
LrSchedule learning_rate_schedule(const TrainOptions& options, int global_batch_size);

// The run's weight-decay schedule in optimizer steps: --weight-decay throughout, or Megatron's
// ramp from --start-weight-decay to --end-weight-decay over the run's steps (its --train-samples
// over the global batch when sample-based, as the learning rate's).
WeightDecaySchedule weight_decay_schedule(const TrainOptions& options, int global_batch_size);

// Throws InputError when setup.memory, the estimate, does not fit this machine's host memory
// (shared by the node's ranks) or its GPU's free memory (check_memory_fits).
void check_run_memory(const RunSetup& setup);

// How the flags' precision maps onto the model's GEMMs (the training and decoding models).
GptPrecision model_precision(const TrainOptions& options);
// ... as the training engine builds its model, whose optimizer is sharded or not and whose
// working copy has `activation_dtype` (GptPrecision::fp8_linear_working_copy).
GptPrecision engine_model_precision(const TrainOptions& options, bool sharded_optimizer, DType activation_dtype);
// ... as fp8lm sample and fp8lm eval build their models, which run no optimizer: the FP8
// Linear weights are cast once from the FP32 values they are given
// (GptPrecision::fp8_linear_working_copy).
GptPrecision forward_only_model_precision(const TrainOptions& options, DType activation_dtype);
// The training model's activation recomputation from the --recompute-* flags (none unless
// --recompute-granularity full).
ActivationRecompute activation_recompute(const TrainOptions& options);

// Every setting, one row each, for the startup table.
SettingsTable settings_table(const RunSetup& setup);

// A warning when mpirun left this rank one CPU (its default binding) and nobody asked for one
// thread: the start-up's parallel host work would run serially.
void warn_if_bound_to_one_cpu(const RunSetup& setup);

}  // namespace fp8lm
