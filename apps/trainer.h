// The training loop: data, gradient accumulation, learning-rate schedule, logging,
// JSONL metrics, evaluation and the non-finite-step guard. Device-agnostic: it drives
// a TrainingEngine.
#pragma once

#include <optional>

#include "apps/run_setup.h"

namespace fp8lm {

// A multiple-choice evaluation's count (--hellaswag-path), over every data-parallel rank.
struct ChoiceAccuracy {
  int64_t correct = 0;
  int64_t examples = 0;
  double accuracy() const { return examples > 0 ? double(correct) / double(examples) : 0.0; }
};

struct TrainingSummary {
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double first_loss = 0.0;
  double last_loss = 0.0;
  double last_val_loss = -1.0;  // < 0 when never evaluated
  std::optional<ChoiceAccuracy> last_choices;  // --hellaswag-path's last evaluation
  std::optional<double> test_loss;             // the test set's, at the end of training (when it has one)
  int stop_signal = 0;          // SIGTERM/SIGINT that ended the run early (after saving)
  std::string last_checkpoint;  // directory of the last checkpoint written
};

class Watchdog;

// Every rank of a parallel run calls it together; rank 0 logs progress, writes the metrics
// file and the checkpoints. `watchdog` (optional) hears a heartbeat after every step and
// watches the engine's NCCL communicators.
TrainingSummary run_training(const RunSetup& setup, Watchdog* watchdog = nullptr);

struct EvaluationResult {
  double loss = 0.0;   // mean token loss (nats); with validation data only
  int64_t tokens = 0;  // target tokens scored (unmasked), all ranks; 0 without validation data
  std::optional<ChoiceAccuracy> choices;  // with --hellaswag-path
};

// `fp8lm eval`: the engine training uses, loaded from --load / --init-from, scores
// --eval-iters batches of --valid-data-path with the same evaluation as training's
// (so a checkpoint reproduces the validation loss its run logged).
EvaluationResult run_evaluation(const RunSetup& setup);

}  // namespace fp8lm
