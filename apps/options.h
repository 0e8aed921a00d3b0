// Every setting of a training run, after parsing and validation. Flag names follow
// Megatron-LM, so the field next to each flag says which one sets it.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/gemm.h"
#include "core/scaling.h"
#include "core/token_data.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"

namespace fp8lm {

enum class DeviceKind : uint8_t { auto_select, cuda, cpu };

// How FP8 gradients are summed across data-parallel ranks: exchanged as codes and summed in
// FP32 on the receiving rank (deterministic, one rounding), or by NCCL's FP8 reduce-scatter
// (each partial sum rounded back to FP8).
enum class GradReduceAlgorithm : uint8_t { all_to_all, reduce_scatter };
std::string_view to_string(GradReduceAlgorithm algorithm);

std::string_view to_string(DeviceKind device);

// The command a run set-up is resolved for (not a flag): what it allocates, so what its memory
// estimate counts and which flags its remedies name. fp8lm eval builds train's engine;
// fp8lm sample builds the decoder (apps/generator.h), whose estimate needs the prompt's length.
enum class RunCommand : uint8_t { train, eval, sample };

struct ModelOverrides {  // Megatron's model-shape flags; each overrides --config
  std::optional<int> num_layers;               // --num-layers
  std::optional<int> hidden_size;              // --hidden-size
  std::optional<int> num_attention_heads;      // --num-attention-heads
  std::optional<int> ffn_hidden_size;          // --ffn-hidden-size
  std::optional<int> max_position_embeddings;  // --max-position-embeddings
  std::optional<int> vocab_size;               // --vocab-size
  std::optional<double> init_method_std;       // --init-method-std: overrides initializer_range
  std::optional<double> norm_epsilon;          // --norm-epsilon: overrides layer_norm_epsilon
  // --kv-channels: a head's width, which fp8lm's GPT (as Megatron's default) makes
  // hidden-size / num-attention-heads; any other value is refused
  std::optional<int> kv_channels;
  // --untie-embeddings-and-output-weights: the LM head gets its own weight (tie_word_embeddings false)
  bool untie_embeddings_and_output_weights = false;
};

struct TrainOptions {
  RunCommand command = RunCommand::train;  // not a flag: set by fp8lm eval and fp8lm sample

  // Model
  std::string config_path;  // --config
  ModelOverrides model;
  std::string transformer_impl = "transformer_engine";  // --transformer-impl (accepted; one implementation)

  // Precision
  GemmPrecision precision = GemmPrecision::bf16;  // --bf16 / --fp8-format / --fp32
  Fp8RecipeConfig fp8;                            // --fp8-format --fp8-recipe --fp8-margin ...
  bool fp8_lm_head = false;                       // --fp8-lm-head: the tied LM head in FP8 too
  Fp8FastAccumulation fp8_fast_accumulation = Fp8FastAccumulation::forward;  // --fp8-fast-accumulation
  // --no-fp8-weight-transpose-cache: an FP8 Linear weight keeps no transposed copy; the backward
  // writes one from the codes before each dgrad (Transformer Engine's keep_fp8_weight_transpose_cache)
  bool fp8_weight_transpose_cache = true;
  // --first-last-layers-bf16: under FP8, the first --num-layers-at-start-in-bf16 and the last
  // --num-layers-at-end-in-bf16 blocks run their four Linear GEMMs in BF16 (Megatron's flags and
  // defaults; the counts mean nothing without the flag, as in Megatron).
  bool first_last_layers_bf16 = false;
  int num_layers_at_start_in_bf16 = 1;
  int num_layers_at_end_in_bf16 = 1;
  // Activation recomputation (Megatron's flags, layers/gpt.h ActivationRecompute):
  // --recompute-granularity full with --recompute-method uniform|block and
  // --recompute-num-layers N; or --recompute-granularity selective (--recompute-activations
  // too) with --recompute-modules: core_attn (Megatron's default; a no-op here, the fused
  // attention keeps no score matrix), layernorm, mlp.
  std::string recompute_granularity;  // "", "full" or "selective"
  std::string recompute_method;       // "", "uniform" or "block"
  int recompute_num_layers = 1;
  // --recompute-modules under selective granularity (Megatron's default: core_attn).
  std::vector<std::string> recompute_modules = {"core_attn"};
  // --bf16-blocks 0,5,11: under FP8, these blocks run their four Linear GEMMs in BF16 (fp8lm's
  // own flag; Megatron has none). --fp8-auto-precision adds the blocks it switches, and
  // checkpoints record the set, so a resume, `fp8lm eval` and `fp8lm sample` use it.
  std::set<int> bf16_blocks;
  // --fp8-auto-precision (docs/NUMERICS.md): during the first --fp8-auto-precision-steps steps,
  // and at each --fp8-stats-interval report, a block one of whose FP8 operands has more than
  // the saturation fraction of its elements saturated, or more than the underflow fraction
  // flushed to zero, joins bf16_blocks for the rest of the run.
  bool fp8_auto_precision = false;
  // The defaults sit above every fraction measured in runs whose loss matched BF16's
  // (docs/NUMERICS.md: up to 0.13% saturated in the LR warm-up and 33% underflowed at
  // gpt2-1558m), so only statistics beyond those shown harmless switch a block.
  double fp8_auto_precision_saturation = 1e-2;  // --fp8-auto-precision-saturation
  double fp8_auto_precision_underflow = 0.5;    // --fp8-auto-precision-underflow
  int64_t fp8_auto_precision_steps = 20;        // --fp8-auto-precision-steps
  OptimizerStatePrecision optimizer_state = OptimizerStatePrecision::fp8_fp16;  // --optimizer-state-precision

  // Batch
  int micro_batch_size = 4;     // --micro-batch-size
  int global_batch_size = 0;    // --global-batch-size; 0 = micro-batch x data-parallel size
  int seq_length = 0;           // --seq-length; 0 = the config's n_positions

  // Learning rate and optimizer
  double lr = 6e-4;                                 // --lr
  double min_lr = 0.0;                              // --min-lr
  int64_t lr_warmup_iters = 0;                      // --lr-warmup-iters
  // --lr-warmup-fraction: warm-up over this fraction of the decay steps instead (Megatron's)
  std::optional<double> lr_warmup_fraction;
  double lr_warmup_init = 0.0;                      // --lr-warmup-init: the warm-up's starting rate
  int64_t lr_decay_iters = -1;                      // --lr-decay-iters; -1 = --train-iters
  // Megatron's defaults (megatron/training/arguments.py): linear decay, weight decay 0.01,
  // beta2 0.999; GPT-2/GPT-3 recipes pass cosine, 0.1 and 0.95 (scripts/quickstart.sh does).
  LrDecayStyle lr_decay_style = LrDecayStyle::linear;  // --lr-decay-style
  int64_t train_iters = 100;                        // --train-iters
  // Megatron's sample-based training (--train-samples > 0): train_iters becomes train_samples
  // / the global batch once that is known (resolve_run_setup), and the schedule's warm-up and
  // decay are counted in samples (learning_rate_schedule, apps/run_setup.h).
  int64_t train_samples = 0;                        // --train-samples; 0 = count --train-iters
  int64_t lr_decay_samples = -1;                    // --lr-decay-samples; -1 = --train-samples
  int64_t lr_warmup_samples = 0;                    // --lr-warmup-samples
  // --rampup-batch-size START INCREMENT SAMPLES (optim/batch_rampup.h); empty: none. Needs
  // --train-samples, as in Megatron.
  std::vector<int64_t> rampup_batch_size;
  // --lr-decay-style WSD: the anneal's length, in steps or (sample-based) in samples; one is
  // required, as Megatron asserts. -1 = not given.
  int64_t lr_wsd_decay_iters = -1;                  // --lr-wsd-decay-iters
  int64_t lr_wsd_decay_samples = -1;                // --lr-wsd-decay-samples
  WsdDecayStyle lr_wsd_decay_style = WsdDecayStyle::exponential;  // --lr-wsd-decay-style
  double weight_decay = 0.01;                       // --weight-decay
  // Megatron's weight-decay schedule: constant (--weight-decay throughout), or linear / cosine
  // from --start-weight-decay to --end-weight-decay over the run (both required then).
  WeightDecayIncrStyle weight_decay_incr_style = WeightDecayIncrStyle::constant;  // --weight-decay-incr-style
  std::optional<double> start_weight_decay;         // --start-weight-decay
  std::optional<double> end_weight_decay;           // --end-weight-decay
  double adam_beta1 = 0.9;                          // --adam-beta1
  double adam_beta2 = 0.999;                        // --adam-beta2
  double adam_eps = 1e-8;                           // --adam-eps
  double clip_grad = 1.0;                           // --clip-grad; 0 = no clipping
  int max_skipped_steps = 10;                       // --max-skipped-steps: non-finite steps in a row

  // Data
  uint64_t seed = 1234;              // --seed
  std::string train_data_path;       // --train-data-path (file or glob of shards)
  std::string valid_data_path;       // --valid-data-path
  std::string test_data_path;        // --test-data-path: scored once, at the end of training (Megatron's)
  // Megatron's per-split datasets: --train-data-path / --valid-data-path / --test-data-path naming
  // indexed datasets (PREFIX, or weight/prefix pairs; names_indexed_datasets), each dataset whole
  // for its split.
  std::vector<std::string> train_data_blend;
  std::vector<std::string> valid_data_blend;
  std::vector<std::string> test_data_blend;
  bool mock_data = false;            // --mock-data: a synthetic, learnable token stream
  TokenFileFormat data_format = TokenFileFormat::llmc;  // --data-format: llmc or raw-uint16
  // --data-path: Megatron indexed datasets, PREFIX or weight/prefix pairs (core/indexed_dataset.h)
  std::vector<std::string> data_path;
  std::string split = "969,30,1";    // --split: train/valid/test weights over --data-path's documents
  // --eod-mask-loss: the loss skips the prediction made from each end-of-document token (the
  // next document's first token), and means divide by the tokens that count (core/loss_mask.h)
  bool eod_mask_loss = false;
  // Megatron's document boundaries inside a sequence (layers/documents.h): positions restart
  // after each end-of-document token, and attention stays within each document.
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  // --calculate-per-token-loss (Megatron's): with the mask, every unmasked token of the step
  // weighs 1 / (the step's unmasked tokens over every rank), not 1 / (its micro-batch's) / ...
  bool calculate_per_token_loss = false;
  // --hellaswag-path: llm.c's multiple-choice eval file (core/choice_eval.h), scored at every
  // evaluation (training) and by fp8lm eval
  std::string hellaswag_path;

  // Checkpoints
  std::string save_dir;              // --save
  std::string load_dir;              // --load
  int64_t save_interval = 0;         // --save-interval; 0 = only at the end / on signal
  // --save-retain-interval N (Megatron's): a save removes the checkpoint `latest` named before it
  // unless that iteration is a multiple of N; 0 keeps every checkpoint.
  int64_t save_retain_interval = 0;
  std::optional<int64_t> ckpt_step;  // --ckpt-step: resume from this iteration, not `latest`
  std::string init_from;             // --init-from: weights only (a Hugging Face model or checkpoint)
  int64_t exit_interval = 0;         // --exit-interval: stop (and save) when iteration % N == 0
  // --check-weight-hash-across-dp-replicas-interval N (Megatron's): every N iterations the
  // data-parallel replicas' parameters are compared by CRC-32, and a difference stops the run
  int64_t check_weight_hash_interval = 0;
  // --exit-duration-in-mins: stop (and save) after the step that ends this many minutes into
  // the run, every rank at the same step (Megatron's, whole minutes)
  std::optional<int64_t> exit_duration_in_mins;
  // --finetune with --load: the checkpoint's weights only, from iteration 0 (as --init-from)
  bool finetune = false;
  // --no-save-optim: checkpoints without the optimizer state (the FP32 master weights are the
  // model file's; the AdamW moments are left out), so that they are about half the size and a
  // resume needs --no-load-optim. --no-load-optim: --load restores everything but the
  // optimizer state, which starts fresh (moments zero, AdamW's step count 0), as Megatron's.
  bool no_save_optim = false;
  bool no_load_optim = false;
  // --exit-on-missing-checkpoint: a --load that is also --save and holds no checkpoint yet is
  // an error instead of a fresh start (start_fresh_without_checkpoint, apps/checkpointing.h)
  bool exit_on_missing_checkpoint = false;
  // --use-checkpoint-opt_param-scheduler: a resume takes the checkpoint's learning-rate schedule
  // over the flags (adopt_resume_checkpoint)
  bool use_checkpoint_lr_schedule = false;

  // Evaluation and logging
  int64_t eval_interval = 1000;      // --eval-interval; 0 = never
  int64_t eval_iters = 100;          // --eval-iters
  int64_t log_interval = 100;        // --log-interval
  std::string metrics_file;          // --metrics-file (JSONL)
  int64_t fp8_stats_interval = 0;    // --fp8-stats-interval: per-tensor FP8 statistics every N steps; 0 = off
  std::string log_level = "info";    // --log-level
  // --vocab-file / --merge-file / --tokenizer-type: Megatron's tokenizer flags; fp8lm train
  // checks the files and that their vocabulary fits the model's (the data is already tokenized)
  std::string vocab_file, merge_file, tokenizer_type;
  // Megatron flags given that change nothing here ("--flag: why"), and warnings for outputs
  // fp8lm does not write (apps/megatron_flags.h): shown at start-up
  std::vector<std::string> megatron_no_effect;
  std::vector<std::string> megatron_warnings;

  // Parallelism and device
  int tensor_model_parallel_size = 1;  // --tensor-model-parallel-size
  bool sequence_parallel = false;      // --sequence-parallel
  // --use-distributed-optimizer / --no-use-distributed-optimizer: ZeRO-1 (sharded master
  // weights and optimizer state); unset = on when the data-parallel size is above 1.
  std::optional<bool> use_distributed_optimizer;
  bool grad_reduce_in_bf16 = false;    // --grad-reduce-in-bf16: gradients travel in BF16 (else FP32)
  bool fp8_grad_comm = false;          // --fp8-grad-comm: gradients travel in FP8, one agreed scale per tensor
  GradReduceAlgorithm fp8_grad_reduce = GradReduceAlgorithm::all_to_all;  // --fp8-grad-reduce
  bool fp8_param_gather = false;       // --fp8-param-gather: weights gathered as FP8 codes
  bool overlap_grad_reduce = false;    // --overlap-grad-reduce
  bool overlap_param_gather = false;   // --overlap-param-gather
  double distributed_timeout_minutes = 10.0;  // --distributed-timeout-minutes
  DeviceKind device = DeviceKind::auto_select;  // --device
  int num_threads = 0;                 // --num-threads (CPU); 0 = OpenMP's default

  // Benchmark
  bool benchmark = false;              // --benchmark: time steps (synchronised), report median, MFU
  int benchmark_warmup = 5;            // --benchmark-warmup: steps left out of the timing
  bool profile_ops = false;            // --profile-ops: time every op class of the timed steps
  // fp8lm sample --small-m-gemm: decoding steps' GEMMs through the small-M kernel (on) or cuBLASLt
  SmallMGemm small_m_gemm = SmallMGemm::on;
  // --gemm-algorithm: cuBLASLt's candidates timed once per GEMM shape (default), or its heuristic's first
  GemmAlgorithmChoice gemm_algorithm = GemmAlgorithmChoice::timed;
  // --programmatic-launch: fp8lm's kernels launch with programmatic dependent launch, each
  // placed while its predecessor finishes (core/launch.cuh); off: plain stream order
  bool programmatic_launch = true;
  // --optimizer-weight-casts: AdamW's update pass also writes the FP8 Linear weights (and their
  // transposes) for the next step (fused, the default where it applies: delayed scaling, state
  // not sharded, fp8-fp16 moments), or they are cast from the master after it (separate)
  bool fused_weight_casts = true;
  // --optimizer-first-pass: where AdamW's first pass (the moments' amaxes and the gradient
  // norm, one read of the gradients and moments) runs: layer by layer beside the last
  // micro-batch's backward, each layer's part beside the next block's attention backward on
  // the low-priority background lane (backward, the default where it applies: fp8-fp16 state,
  // one rank), or at the step's end (step)
  bool first_pass_in_backward = true;
  // fp8lm sample --cuda-graph: decoding steps after the first replay one recorded step (a CUDA
  // graph on the GPU) instead of launching op by op. Off under --profile-ops, which times each op.
  bool decode_graph = true;

  // The flags the command line gave ("--fp8-amax-history-len", ...): a resumed run takes the
  // checkpoint's FP8 recipe for those it left out (adopt_resume_checkpoint, apps/checkpointing.h).
  std::set<std::string> given_flags;
  bool given(const std::string& flag) const { return given_flags.count(flag) > 0; }

  bool fp8_enabled() const { return precision == GemmPrecision::fp8; }
  // The blocks whose GEMMs run in BF16 under FP8: [0, start) and [n_layer - end, n_layer).
  int bf16_layers_at_start() const { return fp8_enabled() && first_last_layers_bf16 ? num_layers_at_start_in_bf16 : 0; }
  int bf16_layers_at_end() const { return fp8_enabled() && first_last_layers_bf16 ? num_layers_at_end_in_bf16 : 0; }
  // "fp8-hybrid", "fp8-e4m3", "bf16" or "fp32": how logs, benchmarks and checkpoints name the run.
  std::string precision_name() const {
    return fp8_enabled() ? "fp8-" + std::string(to_string(fp8.format)) : std::string(to_string(precision));
  }
};

// Whether AdamW's update pass writes the next step's FP8 Linear weights
// (--optimizer-weight-casts fused): the delayed recipe (the scale is known before the
// update), every tensor whole on this rank (sharded_state: the distributed optimizer over
// several data-parallel ranks), no FP8 weight gather, and fp8-fp16 moments.
inline bool optimizer_writes_fp8_weights(const TrainOptions& o, bool sharded_state) {
  return o.fused_weight_casts && o.fp8_enabled() && o.fp8.recipe == ScalingRecipe::delayed && !sharded_state &&
         !o.fp8_param_gather && o.optimizer_state == OptimizerStatePrecision::fp8_fp16;
}

// Whether AdamW's first pass runs layer by layer beside the backward (--optimizer-first-pass
// backward): fp8-fp16 moments (the pass the norm shares), and one rank, whose gradients are
// final once the last micro-batch's backward has passed their layer (with more ranks they
// are final only after their reduction).
inline bool optimizer_first_pass_in_backward(const TrainOptions& o, int world_size) {
  return o.first_pass_in_backward && o.optimizer_state == OptimizerStatePrecision::fp8_fp16 && world_size == 1;
}

}  // namespace fp8lm
