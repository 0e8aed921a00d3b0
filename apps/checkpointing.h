// Checkpoints: save, resume bit-exactly, start from a Hugging Face GPT-2 model.
//
// A checkpoint is a directory DIR/iter_0000100/ holding
//   model.safetensors        FP32 master weights, Hugging Face GPT-2 names and layout
//   optimizer.safetensors    AdamW state in its stored precision: E4M3 m and FP16 v with
//                            per-tensor scales (or FP32 m and v), plus the step count
//   fp8_scaling.safetensors  every FP8 operand's amax history, scale and scale_inv (FP8 runs)
//   state.json               iteration, consumed samples, data position, skip count, the
//                            seed, the model config, every argument, and the CRC-32 and
//                            size of each file above
// It is written as DIR/.iter_0000100.tmp and renamed when complete; only then is
// DIR/latest (Megatron's text file holding the iteration) replaced, by rename too.
// Loading checks every file's size and checksum and every tensor's shape before it
// changes anything, and errors name the file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

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

// Writes DIR/iter_<iteration> atomically and points DIR/latest at it. Returns its path.
std::string save_checkpoint(const std::string& dir, const RunSetup& setup, TrainingEngine& engine,
                            const TrainingProgress& progress);

// What --load / --init-from found.
struct LoadedState {
  std::string path;               // the checkpoint directory or model file
  bool resumed = false;           // a full fp8lm checkpoint: progress is valid
  TrainingProgress progress;
};

// Loads `path` into the engine: an fp8lm checkpoint directory (DIR with `latest`, or
// DIR/iter_N itself, or --ckpt-step N), or a Hugging Face GPT-2 model (a
// model.safetensors file or a directory holding one) whose weights start a fresh run.
// Precision may differ from the saving run's: optimizer state is converted, FP8
// scaling state is kept only when the run is FP8 with the same operands and history
// length, and otherwise starts empty (the first step then uses current scaling).
LoadedState load_into_engine(const std::string& path, std::optional<int64_t> step, const RunSetup& setup,
                             TrainingEngine& engine);

// The model config stored with a checkpoint or Hugging Face directory (state.json's
// config, or config.json), for runs that give --load without --config.
std::optional<GptConfig> stored_model_config(const std::string& path, std::optional<int64_t> step);

// The checkpoint directory `path` and `step` designate (resolving DIR/latest).
std::string resolve_checkpoint_dir(const std::string& path, std::optional<int64_t> step);

}  // namespace fp8lm
