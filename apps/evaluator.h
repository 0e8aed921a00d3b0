// fp8lm eval's model: the GPT built to evaluate (layers/gpt.h, ModelUse::evaluate) over the
// run set-up's backend, precision and tensor-parallel layout, without the training engine's
// gradients, optimizer state, weight transposes or backward activations. Its losses are the
// training engine's evaluation losses bit for bit (the same forward over the same operands:
// the FP8 weights cast once from the FP32 values with the checkpoint's scales), at a fraction
// of the memory (docs/DATA.md, "Evaluation").
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "apps/batch_scorer.h"
#include "apps/engine.h"
#include "core/logging.h"
#include "parallel/process_groups.h"

namespace fp8lm {

class GptModel;
class Ops;
struct RunSetup;

class Evaluator : public BatchScorer {
 public:
  // Every rank of a parallel run constructs its evaluator together (the process groups are
  // made here). Data-parallel ranks each score their own batches; tensor-parallel ranks
  // split the model as training does.
  Evaluator(const RunSetup& setup, const ParallelLayout& layout);
  ~Evaluator() override;
  Evaluator(const Evaluator&) = delete;
  Evaluator& operator=(const Evaluator&) = delete;

  // Reads the weights of an fp8lm checkpoint or a Hugging Face GPT-2 model and, when
  // `with_scaling` (fp8lm eval --load) and the run is FP8, the checkpoint's FP8 scaling state,
  // so that its activations are cast as its run's evaluation cast them. Returns the path read.
  std::string load(const std::string& path, std::optional<int64_t> step, bool with_scaling);
  // The weights from FP32 values in the canonical layout (make_gpt_layout).
  void set_parameters(const std::vector<float>& canonical);
  // A checkpoint's FP8 scaling state (history, scales), before set_parameters: the FP8 weights
  // are cast once, with the weight scales in force then (on the GPU nothing else holds them).
  void set_scaling_state(const ScalingSnapshot& snapshot);

  BatchLoss evaluate(const int32_t* inputs, const int32_t* targets) override;
  std::vector<BatchLoss> row_losses(const int32_t* inputs, const int32_t* targets) override;
  const ProcessGroups& host_groups() const override;

  // The canonical layout the parameters are given in.
  const TensorLayout& layout() const;
  // Every allocation of the evaluator (the model's slabs, the backend's workspaces): what its
  // memory estimate (estimate_evaluation_memory) predicts.
  size_t allocated_bytes() const;
  // Rows for the log: memory per class, measured beside the start-up estimate.
  SettingsTable describe() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Shared with the decoder (apps/generator.cpp), whose model has no optimizer either.
// Sets a forward-only model's weights from FP32 values in the canonical layout: this
// tensor-parallel rank's part of each tensor into the working copy, and the FP8 weights cast
// once from the FP32 values (one rounding, as training casts them from its FP32 master), one
// block's FP32 values at a time in the backend's memory.
void set_forward_only_weights(Ops& ops, GptModel& model, const TensorLayout& canonical,
                              const std::vector<float>& values, int tp_rank, int tp_size);
// A forward-only model's memory for the log: its classes, the backend's workspaces, and
// `allocated` (labelled `allocations_label`) beside the start-up estimate.
SettingsTable forward_only_memory_rows(const GptModel& model, Ops& ops, const MemoryEstimate& estimate,
                                       const std::string& allocations_label, size_t allocated);

}  // namespace fp8lm
