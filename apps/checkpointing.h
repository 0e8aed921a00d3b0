// Checkpoints: save, resume bit-exactly, start from a Hugging Face GPT-2 model.
//
// A checkpoint is a directory DIR/iter_0000100/ holding
//   model.safetensors        FP32 master weights, Hugging Face GPT-2 names and layout
//   optimizer.safetensors    AdamW state in its stored precision: E4M3 m and FP16 v with
//                            per-tensor scales (or FP32 m and v), plus the step count
//   fp8_scaling.safetensors  every FP8 operand's amax history, scale and scale_inv (FP8 runs)
//   state.json               the manifest: iteration, consumed samples, data position, skip
//                            count, the seed, the model config, every argument, and the
//                            CRC-32 and size of each file above
//   state.json.crc32         the manifest's own CRC-32 and size ("crc32 <hex> bytes <n>")
// The rule is that at every instant DIR/latest (Megatron's text file holding the
// iteration) names a complete checkpoint: a save writes and fsyncs every file into
// DIR/.iter_0000100.tmp-<pid>, fsyncs that directory, moves it into place (an atomic
// exchange when iter_0000100 already exists, so a re-save never leaves a moment without
// it; where the file system has no RENAME_EXCHANGE the old copy moves aside first, and
// loading falls back to it), fsyncs DIR, and only then replaces `latest` the same way
// (write, fsync, rename, fsync DIR). A run holds an flock on DIR/.fp8lm.lock while it may
// save. docs/RELIABILITY.md lists the guarantees and the tests that check them.
//
// Loading checks state.json against its checksum, then every file's size and CRC-32,
// before it changes anything, and errors name the file. A checkpoint without
// state.json.crc32 (written before it existed) loads with a warning; one whose checksum is
// wrong is refused.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "apps/engine.h"
#include "apps/run_setup.h"
#include "core/token_data.h"

namespace fp8lm {

struct TrainingProgress {
  int64_t iteration = 0;          // optimizer steps finished
  DataPosition data;              // where the next step's batch begins
  uint64_t consumed_samples = 0;  // sequences read, all ranks
  int64_t skipped_steps = 0;      // non-finite steps so far
};

// Writes DIR/iter_<iteration> atomically and durably, points DIR/latest at it, and removes
// what killed saves left behind (DIR/.iter_*.tmp-* and .old-*). Returns its path.
std::string save_checkpoint(const std::string& dir, const RunSetup& setup, TrainingEngine& engine,
                            const TrainingProgress& progress);

// An exclusive lock on a --save directory for this object's lifetime: an flock on
// DIR/.fp8lm.lock, which the kernel releases however the process ends, so a killed run
// leaves no stale lock. Two runs saving into one directory would interleave their
// checkpoints; the second one is refused at start-up instead.
class SaveDirectoryLock {
 public:
  // Creates DIR if needed and locks it. InputError naming DIR and the holder's pid and host
  // when another process holds the lock.
  explicit SaveDirectoryLock(const std::string& dir);
  ~SaveDirectoryLock();
  SaveDirectoryLock(const SaveDirectoryLock&) = delete;
  SaveDirectoryLock& operator=(const SaveDirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// What a complete checkpoint's state.json says, read and checked.
struct CheckpointManifest {
  std::string dir;                  // the iteration directory
  int version = 0;
  TrainingProgress progress;
  std::optional<uint64_t> seed;     // the run's --seed (absent in hand-made manifests)
  GptConfig config;
  std::string precision;            // the saving run's, for messages
  // The saving run's FP8 settings from state.json's "args", when it trained with FP8 GEMMs: a
  // resume takes them for the flags it leaves out (adopt_resume_checkpoint).
  struct Fp8Settings {
    int amax_history_len = 0;
    AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::most_recent;
    bool first_last_layers_bf16 = false;  // absent before the flag existed: off
    int num_layers_at_start_in_bf16 = 1;
    int num_layers_at_end_in_bf16 = 1;
    std::set<int> bf16_blocks;  // --bf16-blocks with what --fp8-auto-precision switched; absent before: none
    std::optional<ScalingRecipe> recipe;  // --fp8-recipe; absent in hand-made manifests
  };
  std::optional<Fp8Settings> fp8;
  // The saving run's optimizer settings whose defaults changed to Megatron-LM's (cosine -> linear,
  // weight decay 0.1 -> 0.01, beta2 0.95 -> 0.999): a resume takes them for the flags it leaves
  // out, so that a run saved before the change continues as it began. Absent: not recorded.
  struct OptimizerSettings {
    std::optional<LrDecayStyle> lr_decay_style;
    std::optional<double> weight_decay;
    std::optional<double> adam_beta2;
    // The learning-rate schedule, for --use-checkpoint-opt_param-scheduler: the rates, the
    // warm-up and the decay steps (--lr-decay-iters resolved against the run's --train-iters).
    std::optional<double> lr, min_lr, lr_warmup_init, lr_warmup_fraction;
    std::optional<int64_t> lr_warmup_iters, lr_decay_iters;
    // WSD's anneal (adopted with a WSD style that is) and the weight-decay schedule.
    std::optional<WsdDecayStyle> lr_wsd_decay_style;
    std::optional<int64_t> lr_wsd_decay_iters, lr_wsd_decay_samples;
    std::optional<WeightDecayIncrStyle> weight_decay_incr_style;
    std::optional<double> start_weight_decay, end_weight_decay;
    // > 0: the run counted its schedule in samples (--train-samples), which
    // --use-checkpoint-opt_param-scheduler does not take.
    std::optional<int64_t> train_samples;
  };
  OptimizerSettings optimizer;
  std::vector<std::string> files;   // the data files it records (model, and optimizer unless saved without it)
  bool optimizer_saved = true;      // false: written under --no-save-optim, no optimizer file
};

// The complete fp8lm checkpoint that `path` and `step` designate (see
// resolve_checkpoint_dir): state.json checked against state.json.crc32, every field it needs
// present and well-typed, and with verify_data every recorded file's size and CRC-32
// checked. This is the one load-and-verify path of `train --load`, `--init-from` of a
// checkpoint and `convert`. InputError naming the file otherwise; a directory that is not a
// complete checkpoint (no state.json) is refused, with a hint at --init-from.
CheckpointManifest read_checkpoint(const std::string& path, std::optional<int64_t> step, bool verify_data);

// `fp8lm convert` writes model.safetensors and config.json into `to`. Into a checkpoint that
// would replace the checkpoint's own model.safetensors, so `to` may be neither a checkpoint
// directory (a --save directory holding `latest` beside iter_* directories, or an iteration
// directory holding state.json) nor inside one, nor a directory whose outputs are, through a
// link, the files of `checkpoint` (read from `load`). InputError naming --to otherwise.
void check_export_directory(const std::string& to, const std::string& load, const CheckpointManifest& checkpoint);

// What --load / --init-from found.
struct LoadedState {
  std::string path;               // the checkpoint directory or model file
  bool resumed = false;           // a full fp8lm checkpoint: progress is valid
  TrainingProgress progress;
};

// How a run uses the checkpoint it loads.
enum class CheckpointUse {
  resume,        // --load: a complete fp8lm checkpoint, nothing less; everything is restored
  weights_only,  // --init-from: a Hugging Face model or an fp8lm checkpoint; weights only
};

// Loads `path` into the engine. resume: an fp8lm checkpoint directory (DIR with `latest`,
// or DIR/iter_N itself, or --ckpt-step N), with its optimizer (unless --no-load-optim, which a
// checkpoint saved under --no-save-optim requires) and FP8 scaling state and progress. weights_only: the weights of such a checkpoint, or of a Hugging Face GPT-2 model
// (a model.safetensors file or a directory holding one); optimizer and FP8 scaling start
// fresh. Precision may differ from the saving run's: optimizer state is converted, FP8
// scaling state is kept only when the run is FP8 with the same operands and history
// length, and otherwise starts empty (the first step then uses current scaling).
LoadedState load_into_engine(const std::string& path, std::optional<int64_t> step, const RunSetup& setup,
                             TrainingEngine& engine, CheckpointUse use);

// `stored`'s scaling states laid out for `expected`'s operands (same history length): each
// operand takes the stored state of its name and format, the others start empty (history 0,
// scale 1), and the table counts as initialized only when every operand found its state.
// `matched` (optional) receives how many did.
ScalingSnapshot match_scaling_by_name(const ScalingSnapshot& stored, const ScalingSnapshot& expected,
                                      int64_t* matched = nullptr);

// The training state of an engine, on the host, as a checkpoint holds it: the master weights,
// the optimizer state, the FP8 scaling states (FP8 runs) and the skip count. Every rank takes
// it together (the snapshots gather).
struct TrainingStateSnapshot {
  std::vector<float> parameters;
  OptimizerSnapshot optimizer;
  std::optional<ScalingSnapshot> scaling;
  int64_t skipped_steps = 0;
};
TrainingStateSnapshot snapshot_training_state(TrainingEngine& engine, bool fp8);
// Restores it into a newly built engine whose precision may differ in which blocks run BF16
// (--fp8-auto-precision's switch), exactly as a resume from a checkpoint of that state would:
// the same calls in the same order, the scaling states matched by name (the switched blocks'
// states dropped, the others kept as they were).
void restore_training_state(TrainingEngine& engine, const TrainingStateSnapshot& state);

// What decoding needs of a checkpoint or Hugging Face model: the weights, and an fp8lm
// checkpoint's FP8 scaling state when `expected_scaling` (the decoding model's operands and
// history length) matches it and fp8 is on.
struct InferenceWeights {
  std::string path;                       // the checkpoint directory or model file read
  std::vector<float> params;              // [layout.total_elements()] canonical layout
  std::optional<ScalingSnapshot> scaling;
};
InferenceWeights read_inference_weights(const std::string& path, std::optional<int64_t> step,
                                        const TensorLayout& layout, const GptConfig& config, bool fp8,
                                        const ScalingSnapshot& expected_scaling);

// Megatron's idiom for a job that is restarted until it is done, `--save DIR --load DIR`: the
// first run finds no checkpoint in DIR and trains from iteration 0, as Megatron does, with a
// warning (this clears options.load_dir). Only for `fp8lm train`, only when --load is the --save
// directory, and only when that directory holds nothing of a checkpoint (no `latest`, no
// state.json, no iter_* directory); any other --load without a checkpoint stays an error (a
// mistyped path never starts a run afresh), and so does this one under
// --exit-on-missing-checkpoint (InputError naming the directory).
void start_fresh_without_checkpoint(TrainOptions& options);

// For --load, at start-up: refuses a --load that is not a complete checkpoint (state.json
// and its checksum; the data files are verified when they are read), and makes the
// checkpoint's seed the run's, with a warning naming both values when --seed differs: the
// data order continues where it stopped only with the seed that began it.
// An FP8 run resuming an FP8 checkpoint also takes the checkpoint's --fp8-amax-history-len,
// --fp8-amax-compute-algo and BF16 first and last layers for the flags it leaves out (as
// `fp8lm eval` does), so a checkpoint resumes with the recipe that wrote it whatever this
// build's defaults are; a flag given explicitly wins (load_into_engine then says what of the
// scaling state it could keep).
// Under --use-checkpoint-opt_param-scheduler (Megatron's), the learning-rate schedule is the
// checkpoint's whatever the flags say: --lr, --min-lr, --lr-warmup-iters or --lr-warmup-fraction,
// --lr-warmup-init, --lr-decay-style, and the decay steps the saving run resolved.
void adopt_resume_checkpoint(TrainOptions& options);

// The model config stored with a checkpoint or Hugging Face directory (state.json's
// config, or config.json), for runs that give --load without --config.
std::optional<GptConfig> stored_model_config(const std::string& path, std::optional<int64_t> step);

// The checkpoint directory `path` and `step` designate: DIR/iter_<step>, the directory
// DIR/latest names, or `path` itself. When `latest` names a directory that is missing
// because a save on a file system without atomic exchange was killed between its two
// renames, the previous copy (DIR/.iter_N.old-<pid>) is used, with a warning.
std::string resolve_checkpoint_dir(const std::string& path, std::optional<int64_t> step);

// Writes `text` to `path` durably: a temporary file, fsync, rename, fsync of the directory.
// `path` is the old file or the complete new one at every instant. RuntimeError naming it.
void write_file_durably(const std::string& path, const std::string& text);

}  // namespace fp8lm
