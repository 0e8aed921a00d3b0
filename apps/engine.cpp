// The training step, written once. Only the device work differs between backends; the
// order of that work, the clipping, the skip rule and the scale-update interval are here.
#include "apps/engine.h"

#include <algorithm>
#include <cstring>

#include "apps/run_setup.h"
#include "core/error.h"
#include "layers/gpt.h"
#include "layers/ops_cpu.h"
#include "layers/ops_cuda.h"

namespace fp8lm {

namespace {

GptPrecision precision_of(const RunSetup& setup) {
  GptPrecision precision;
  precision.gemm = setup.options.precision;
  precision.fp8_lm_head = setup.options.fp8_lm_head;
  precision.fp8 = setup.options.fp8;
  return precision;
}

// Scalars the step keeps in backend memory, so that a step never waits for the host.
struct StepScalars {
  double sum_of_squares = 0.0;  // of the gradients
  float loss_sum = 0.0f;        // this step's token losses
  float eval_loss_sum = 0.0f;
  StepControl control;
};

}  // namespace

std::unique_ptr<Ops> make_ops(const RunSetup& setup) {
  if (!setup.use_cuda) return make_cpu_ops();
  check_cuda_model_support(setup.model, setup.options.precision == GemmPrecision::fp32);
  return make_cuda_ops();
}

struct TrainingEngine::State {
  std::unique_ptr<Ops> ops;
  std::unique_ptr<GptModel> model;
  std::unique_ptr<TensorTable> table;
  OptimizerStatePrecision state_precision;
  Fp8RecipeConfig recipe;
  bool fp8 = false;
  std::unique_ptr<Allocation> m_codes, v_bits, m_scales, v_scales, m32, v32;
  std::unique_ptr<Allocation> scalars;  // one StepScalars
  std::unique_ptr<Allocation> adamw_scratch;
  std::unique_ptr<HostReadback> control_readback;
  StepControl last_seen;
  int micro_batches = 0;
  float tokens_per_micro_batch = 1.0f;

  StepScalars* device_scalars() { return static_cast<StepScalars*>(scalars->data()); }
  StepControl* control() { return &device_scalars()->control; }
  Tensor scalar_tensor(float* p) {
    Tensor t;
    t.data = p;
    t.rows = t.cols = 1;
    return t;
  }
  AdamWStateSlabs optimizer_slabs() {
    AdamWStateSlabs slabs;
    if (state_precision == OptimizerStatePrecision::fp8_fp16) {
      slabs.m8 = static_cast<uint8_t*>(m_codes->data());
      slabs.v16 = static_cast<uint16_t*>(v_bits->data());
      slabs.m_scales = static_cast<float*>(m_scales->data());
      slabs.v_scales = static_cast<float*>(v_scales->data());
    } else {
      slabs.m32 = static_cast<float*>(m32->data());
      slabs.v32 = static_cast<float*>(v32->data());
    }
    return slabs;
  }
  size_t optimizer_bytes() const {
    size_t bytes = 0;
    for (const auto* a : {&m_codes, &v_bits, &m_scales, &v_scales, &m32, &v32})
      if (*a) bytes += (*a)->bytes();
    return bytes;
  }
  StepControl read_control() {
    StepControl control;
    ops->download(&control, this->control(), sizeof control);
    return control;
  }
};

TrainingEngine::TrainingEngine(const RunSetup& setup) : TrainingEngine(setup, make_ops(setup)) {}

TrainingEngine::TrainingEngine(const RunSetup& setup, std::unique_ptr<Ops> ops) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.ops = std::move(ops);
  s.model = std::make_unique<GptModel>(setup.model, setup.options.micro_batch_size, setup.seq_length,
                                       precision_of(setup), *s.ops);
  s.table = s.ops->make_table(s.model->layout());
  s.state_precision = setup.options.optimizer_state;
  s.recipe = setup.options.fp8;
  s.fp8 = setup.options.fp8_enabled();

  const size_t n = s.model->layout().total_elements();
  const size_t count = s.model->layout().tensors().size();
  if (s.state_precision == OptimizerStatePrecision::fp8_fp16) {
    s.m_codes = s.ops->allocate(n * sizeof(uint8_t));
    s.v_bits = s.ops->allocate(n * sizeof(uint16_t));
    s.m_scales = s.ops->allocate(count * sizeof(float));
    s.v_scales = s.ops->allocate(count * sizeof(float));
    const std::vector<float> ones(count, 1.0f);  // fresh state: codes 0, scales 1
    s.ops->upload(s.m_scales->data(), ones.data(), count * sizeof(float));
    s.ops->upload(s.v_scales->data(), ones.data(), count * sizeof(float));
  } else {
    s.m32 = s.ops->allocate(n * sizeof(float));
    s.v32 = s.ops->allocate(n * sizeof(float));
  }
  s.scalars = s.ops->allocate(sizeof(StepScalars));
  s.adamw_scratch = s.ops->allocate(adamw_scratch_floats(count) * sizeof(float));
  s.ops->set_step_control(s.control(), StepControl{});
  s.control_readback = s.ops->make_readback(sizeof(StepControl));
  s.control_readback->capture(s.control());
  s.tokens_per_micro_batch = float(setup.options.micro_batch_size) * float(setup.seq_length);

  std::vector<float> params(n, 0.0f);
  init_gpt_parameters(params.data(), s.model->layout(), setup.model, setup.options.seed);
  set_parameters(params);
}

TrainingEngine::~TrainingEngine() {
  if (state_ && state_->ops) state_->ops->synchronize();
}

const TensorLayout& TrainingEngine::layout() const { return state_->model->layout(); }
std::string_view TrainingEngine::backend() const { return state_->ops->name(); }

void TrainingEngine::begin_step() {
  State& s = *state_;
  s.model->zero_gradients();
  s.ops->zero(&s.device_scalars()->loss_sum, sizeof(float));
  s.micro_batches = 0;
}

void TrainingEngine::forward_backward(const int32_t* inputs, const int32_t* targets, float dloss) {
  State& s = *state_;
  GptModel& model = *s.model;
  const TokenBatch batch =
      s.ops->load_batch(inputs, targets, model.micro_batch_size(), model.seq_length(), model.vocab_slice());
  model.forward_backward(batch, dloss, s.scalar_tensor(&s.device_scalars()->loss_sum));
  ++s.micro_batches;
}

void TrainingEngine::end_step(const AdamWHyperparams& hyperparams, double clip_grad, int64_t step) {
  State& s = *state_;
  Ops& ops = *s.ops;
  GptModel& model = *s.model;
  StepScalars* scalars = s.device_scalars();
  ops.grad_sum_of_squares(&scalars->sum_of_squares, model.gradients(), *s.table);
  ops.finalize_step(s.control(), &scalars->sum_of_squares, &scalars->loss_sum,
                    s.tokens_per_micro_batch * float(std::max(s.micro_batches, 1)), clip_grad);
  AdamWCall update;
  update.table = s.table.get();
  update.master = model.master();
  update.working = model.working_is_master() ? nullptr : model.working();
  update.grads = model.gradients();
  update.precision = s.state_precision;
  update.state = s.optimizer_slabs();
  update.hyperparams = hyperparams;
  update.control = s.control();
  update.scratch = static_cast<float*>(s.adamw_scratch->data());
  ops.adamw_moment_amaxes(update);
  ops.adamw_apply(update);
  // The FP8 scale update: THE place scales change (core/scaling.h). A skipped step
  // discards its amaxes instead; both decide on the device (control->skip).
  if (s.fp8) {
    if (is_scale_update_step(s.recipe, step)) {
      ops.update_scales(s.control());
      model.scaling().mark_initialized();
    } else {
      ops.discard_current_amaxes(s.control());
    }
  }
  model.refresh_weight_operands();
  s.control_readback->capture(s.control());
}

StepMetrics TrainingEngine::step_metrics() {
  State& s = *state_;
  std::memcpy(&s.last_seen, s.control_readback->wait(), sizeof(StepControl));
  StepMetrics metrics;
  metrics.loss = s.last_seen.loss;
  metrics.grad_norm = s.last_seen.grad_norm;
  metrics.skipped = s.last_seen.skip != 0;
  return metrics;
}

TrainingEngine::SkipStatus TrainingEngine::skip_status() {
  State& s = *state_;
  if (s.control_readback->ready()) std::memcpy(&s.last_seen, s.control_readback->wait(), sizeof(StepControl));
  return SkipStatus{s.last_seen.total_skips, s.last_seen.consecutive_skips};
}

double TrainingEngine::evaluate(const int32_t* inputs, const int32_t* targets) {
  State& s = *state_;
  GptModel& model = *s.model;
  float* sum = &s.device_scalars()->eval_loss_sum;
  s.ops->zero(sum, sizeof(float));
  const TokenBatch batch =
      s.ops->load_batch(inputs, targets, model.micro_batch_size(), model.seq_length(), model.vocab_slice());
  model.forward_eval(batch, s.scalar_tensor(sum));
  float host_sum = 0.0f;
  s.ops->download(&host_sum, sum, sizeof(float));
  return double(host_sum) / s.tokens_per_micro_batch;
}

std::vector<float> TrainingEngine::parameters() {
  State& s = *state_;
  std::vector<float> values(layout().total_elements());
  s.ops->download(values.data(), s.model->master(), values.size() * sizeof(float));
  return values;
}

std::vector<float> TrainingEngine::gradients() {
  State& s = *state_;
  std::vector<float> values(layout().total_elements());
  s.ops->download(values.data(), s.model->gradients(), values.size() * sizeof(float));
  return values;
}

void TrainingEngine::set_parameters(const std::vector<float>& values) {
  State& s = *state_;
  GptModel& model = *s.model;
  FP8LM_CHECK(values.size() == layout().total_elements(), "set_parameters: ", values.size(), " values for a slab of ",
              layout().total_elements());
  s.ops->synchronize();
  s.ops->upload(model.master(), values.data(), values.size() * sizeof(float));
  if (!model.working_is_master()) {
    Tensor working;
    working.data = model.working();
    working.dtype = s.ops->activation_dtype();
    working.rows = 1;
    working.cols = int64_t(values.size());
    s.ops->upload_values(working, values.data());
  }
  model.refresh_weight_operands();
  s.ops->synchronize();
}

OptimizerSnapshot TrainingEngine::optimizer_state() {
  State& s = *state_;
  s.ops->synchronize();
  OptimizerSnapshot snapshot;
  snapshot.precision = s.state_precision;
  auto read = [&](auto& vector, const std::unique_ptr<Allocation>& allocation) {
    if (!allocation) return;
    vector.resize(allocation->bytes() / sizeof(vector[0]));
    s.ops->download(vector.data(), allocation->data(), allocation->bytes());
  };
  read(snapshot.m8, s.m_codes);
  read(snapshot.v16, s.v_bits);
  read(snapshot.m_scales, s.m_scales);
  read(snapshot.v_scales, s.v_scales);
  read(snapshot.m32, s.m32);
  read(snapshot.v32, s.v32);
  snapshot.step_count = s.read_control().step_count;
  return snapshot;
}

void TrainingEngine::set_optimizer_state(const OptimizerSnapshot& snapshot) {
  State& s = *state_;
  FP8LM_CHECK(snapshot.precision == s.state_precision);
  s.ops->synchronize();
  auto write = [&](const auto& vector, const std::unique_ptr<Allocation>& allocation) {
    const size_t bytes = vector.size() * sizeof(vector[0]);
    FP8LM_CHECK(bytes == (allocation ? allocation->bytes() : 0), "optimizer state size ", bytes, " bytes, expected ",
                allocation ? allocation->bytes() : 0);
    if (bytes) s.ops->upload(allocation->data(), vector.data(), bytes);
  };
  write(snapshot.m8, s.m_codes);
  write(snapshot.v16, s.v_bits);
  write(snapshot.m_scales, s.m_scales);
  write(snapshot.v_scales, s.v_scales);
  write(snapshot.m32, s.m32);
  write(snapshot.v32, s.v32);
  StepControl control = s.read_control();
  control.step_count = snapshot.step_count;
  s.ops->set_step_control(s.control(), control);
  s.ops->synchronize();
}

ScalingSnapshot TrainingEngine::scaling_state() {
  State& s = *state_;
  s.ops->synchronize();
  s.ops->download_scaling();
  ScalingTable& table = s.model->scaling();
  ScalingSnapshot snapshot;
  for (int i = 0; i < table.size(); ++i) {
    snapshot.names.push_back(table.name(i));
    snapshot.dtypes.push_back(table.dtype(i));
  }
  snapshot.history_len = table.config().amax_history_len;
  snapshot.history = table.history();
  snapshot.scale = table.scales();
  snapshot.scale_inv = table.scale_invs();
  snapshot.initialized = table.size() > 0 && table.initialized(0);
  return snapshot;
}

void TrainingEngine::set_scaling_state(const ScalingSnapshot& snapshot) {
  State& s = *state_;
  ScalingTable& table = s.model->scaling();
  FP8LM_CHECK(int(snapshot.names.size()) == table.size() && snapshot.history.size() == table.history().size(),
              "scaling state of another model");
  s.ops->synchronize();
  table.history() = snapshot.history;
  table.scales() = snapshot.scale;
  table.scale_invs() = snapshot.scale_inv;
  std::fill(table.initialized_flags().begin(), table.initialized_flags().end(), snapshot.initialized ? 1 : 0);
  s.ops->upload_scaling();
  // The weight operands must be cast with the restored weight scales. Recording the
  // weight amaxes again is idempotent: the saved row 0 already holds them.
  s.model->refresh_weight_operands();
  s.ops->synchronize();
}

void TrainingEngine::set_total_skips(int64_t total) {
  State& s = *state_;
  s.ops->synchronize();
  StepControl control = s.read_control();
  control.total_skips = static_cast<int>(total);
  control.consecutive_skips = 0;
  s.ops->set_step_control(s.control(), control);
  s.ops->synchronize();
  s.last_seen = control;
}

BenchmarkMemory TrainingEngine::benchmark_memory() const {
  const State& s = *state_;
  BenchmarkMemory memory;
  memory.allocated_bytes = s.model->allocated_bytes() + s.optimizer_bytes() + s.ops->workspace_bytes();
  memory.device_used_bytes = s.ops->device_memory_in_use();
  return memory;
}

SettingsTable TrainingEngine::describe() const {
  const State& s = *state_;
  SettingsTable rows = s.model->memory_table();
  rows.push_back({"optimizer state (" + std::string(to_string(s.state_precision)) + ")", format_mib(s.optimizer_bytes())});
  rows.push_back({"optimizer state bytes / parameter",
                  s.state_precision == OptimizerStatePrecision::fp8_fp16 ? "3 (E4M3 m + FP16 v) + 4 FP32 master"
                                                                         : "8 (FP32 m + v) + 4 FP32 master"});
  rows.push_back({"backend workspaces", format_mib(s.ops->workspace_bytes())});
  rows.push_back({"estimated peak memory",
                  format_mib(s.model->allocated_bytes() + s.optimizer_bytes() + s.ops->workspace_bytes())});
  return rows;
}

std::unique_ptr<TrainingEngine> make_engine(const RunSetup& setup) { return std::make_unique<TrainingEngine>(setup); }

}  // namespace fp8lm
