#include "apps/evaluator.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/memory_estimate.h"
#include "apps/run_setup.h"
#include "core/error.h"
#include "layers/gpt.h"
#include "layers/ops.h"
#include "parallel/mappings.h"

namespace fp8lm {

void set_forward_only_weights(Ops& ops, GptModel& model, const TensorLayout& canonical,
                              const std::vector<float>& values, int tp_rank, int tp_size) {
  FP8LM_CHECK(values.size() == canonical.total_elements(), "set_parameters: ", values.size(),
              " values for a model of ", canonical.total_elements());
  const TensorLayout& layout = model.layout();
  std::vector<float> local(layout.total_elements(), 0.0f);
  for (const TensorInfo& t : layout.tensors()) {
    const TensorInfo* source = canonical.find(t.name);
    FP8LM_CHECK(source != nullptr, "no canonical tensor ", t.name);
    copy_part_from_full(t, values.data() + source->offset, local.data() + t.offset, tp_rank, tp_size);
  }
  ops.synchronize();
  model.set_working_values(local.data());
  if (model.fp8_weight_operands().empty() || ops.activation_dtype() == DType::f32) {
    // No FP8 weights, or an FP32 working copy (the CPU's) that holds the values themselves: the
    // operands come from the working copy.
    model.refresh_weight_operands();
    ops.synchronize();
    return;
  }
  // A block's FP8 Linear weights at a time, through a staging buffer of one bucket: loading
  // holds one block's FP32 weights on the device, not the model's (27 GB at 6.7B parameters).
  size_t largest = 0;
  for (const ParameterBucket& bucket : model.buckets())
    if (bucket.linear_weights) largest = std::max(largest, bucket.end - bucket.begin);
  const std::unique_ptr<Allocation> staging = ops.allocate(largest * sizeof(float));
  const auto* staged = static_cast<const float*>(staging->data());
  model.refresh_weight_operands(model.lm_head_layer(), /*fp8_linear_weights=*/true);  // from the working copy
  for (const ParameterBucket& bucket : model.buckets()) {
    if (!bucket.linear_weights) continue;
    ops.synchronize();  // the block before has been cast from the buffer
    ops.upload(staging->data(), local.data() + bucket.begin, (bucket.end - bucket.begin) * sizeof(float));
    model.set_fp8_cast_source(staged, bucket.begin, bucket.end - bucket.begin);
    model.refresh_weight_operands(bucket.layer, /*fp8_linear_weights=*/true);
  }
  ops.synchronize();
  model.set_fp8_cast_source(nullptr);
}

SettingsTable forward_only_memory_rows(const GptModel& model, Ops& ops, const MemoryEstimate& estimate,
                                       const std::string& allocations_label, size_t allocated) {
  SettingsTable rows = model.memory_table();
  rows.push_back({"backend workspaces", format_mib(ops.workspace_bytes())});
  const bool device = ops.stream_handle() != nullptr;
  for (auto& row :
       measured_memory_rows(estimate, allocations_label, allocated, device, device ? ops.device_memory_in_use() : 0))
    rows.push_back(std::move(row));
  return rows;
}

struct Evaluator::State {
  ParallelLayout parallel;
  GptConfig config;
  bool fp8 = false;
  BatchReading reading;
  MemoryEstimate memory_estimate;  // made before anything was allocated (run_setup.cpp)
  std::unique_ptr<Ops> ops;
  std::unique_ptr<ProcessGroups> groups;  // over the backend's memory: the tensor-parallel collectives
  std::unique_ptr<ProcessGroups> host;    // over host memory (MPI): the data-parallel sums
  std::unique_ptr<TensorParallelMappings> tp;
  std::unique_ptr<GptModel> model;
  TensorLayout canonical;
  std::unique_ptr<Allocation> loss_sum;  // one float

  float* device_sum() { return static_cast<float*>(loss_sum->data()); }
};

Evaluator::Evaluator(const RunSetup& setup, const ParallelLayout& layout) : state_(std::make_unique<State>()) {
  State& s = *state_;
  const TrainOptions& o = setup.options;
  s.parallel = layout;
  s.config = setup.model;
  s.fp8 = o.fp8_enabled();
  s.reading = {.loss_mask = o.eod_mask_loss, .documents = setup.documents};
  s.memory_estimate = setup.memory;
  s.ops = make_run_ops(setup, layout.local_rank);
  s.host = std::make_unique<ProcessGroups>(ProcessGroups::create_host(layout));
  if (s.ops->stream_handle() != nullptr) {
    const auto compute = static_cast<cudaStream_t>(s.ops->stream_handle());
    s.groups = std::make_unique<ProcessGroups>(
        ProcessGroups::create_gpu(layout, NcclStreams{compute, compute, compute, compute}));
  } else {
    s.groups = std::make_unique<ProcessGroups>(ProcessGroups::create_host(layout));
  }
  Communicator* tp_group = layout.tp_size > 1 ? &s.groups->tp() : nullptr;
  s.tp = std::make_unique<TensorParallelMappings>(tp_group, o.sequence_parallel, *s.ops);
  s.ops->set_amax_group(tp_group);
  s.model = std::make_unique<GptModel>(setup.model, o.micro_batch_size, setup.seq_length,
                                       forward_only_model_precision(o, s.ops->activation_dtype()), *s.ops,
                                       ModelParallelism{s.tp.get(), 1}, ModelUse::evaluate);
  s.canonical = make_gpt_layout(setup.model);
  s.loss_sum = s.ops->allocate(sizeof(float));
}

Evaluator::~Evaluator() {
  if (!state_) return;
  // As the training engine's: a failed kernel fails this wait too, and must not end the process here.
  try {
    if (state_->ops) state_->ops->synchronize();
  } catch (const std::exception&) {
  }
  state_->groups.reset();
}

std::string Evaluator::load(const std::string& path, std::optional<int64_t> step, bool with_scaling) {
  State& s = *state_;
  InferenceWeights weights = read_inference_weights(path, step, s.canonical, s.config, s.fp8 && with_scaling,
                                                    scaling_table_snapshot(*s.model));
  if (weights.scaling) restore_scaling_table(*s.ops, *s.model, *weights.scaling);
  set_parameters(weights.params);
  if (s.fp8)
    spdlog::info("FP8 activations cast with {}", s.model->scaling().uses_current_scaling()
                                                     ? "current scaling (each tensor's own amax)"
                                                     : "the checkpoint's delayed scales");
  return weights.path;
}

void Evaluator::set_parameters(const std::vector<float>& canonical) {
  State& s = *state_;
  set_forward_only_weights(*s.ops, *s.model, s.canonical, canonical, s.parallel.tp_rank, s.parallel.tp_size);
}

void Evaluator::set_scaling_state(const ScalingSnapshot& snapshot) {
  restore_scaling_table(*state_->ops, *state_->model, snapshot);
}

BatchLoss Evaluator::evaluate(const int32_t* inputs, const int32_t* targets) {
  State& s = *state_;
  return score_batch(*s.ops, *s.model, s.device_sum(), s.host->dp(), s.reading, inputs, targets);
}

std::vector<BatchLoss> Evaluator::row_losses(const int32_t* inputs, const int32_t* targets) {
  State& s = *state_;
  return score_rows(*s.ops, *s.model, s.device_sum(), s.reading, inputs, targets);
}

const ProcessGroups& Evaluator::host_groups() const { return *state_->host; }

const TensorLayout& Evaluator::layout() const { return state_->canonical; }

size_t Evaluator::allocated_bytes() const {
  const State& s = *state_;
  return s.model->allocated_bytes() + s.ops->workspace_bytes() + s.loss_sum->bytes();
}

SettingsTable Evaluator::describe() const {
  const State& s = *state_;
  return forward_only_memory_rows(*s.model, *s.ops, s.memory_estimate, "evaluator allocations", allocated_bytes());
}

}  // namespace fp8lm
