// The CPU engine: the reference model (layers/gpt.h), the reference AdamW
// (optim/adamw.h) and the FP8 scaling table, with plain host memory.
#include <cmath>

#include "apps/engine.h"
#include "apps/run_setup.h"
#include "core/error.h"
#include "layers/gpt.h"
#include "optim/grad_clip.h"

namespace fp8lm {

namespace {

std::string format_mib(size_t bytes) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return buffer;
}

class CpuEngine final : public TrainingEngine {
 public:
  explicit CpuEngine(const RunSetup& setup)
      : model_(setup.model, setup.options.micro_batch_size, setup.seq_length, precision_of(setup)),
        optimizer_(model_.layout(), setup.options.optimizer_state) {
    init_gpt_parameters(model_.parameters().data(), model_.layout(), setup.model, setup.options.seed);
  }

  const TensorLayout& layout() const override { return model_.layout(); }

  void begin_step() override {
    model_.zero_gradients();
    loss_sum_ = 0.0;
    micro_batches_ = 0;
  }

  void forward_backward(const int32_t* inputs, const int32_t* targets, float dloss) override {
    loss_sum_ += model_.forward_backward(inputs, targets, dloss);
    ++micro_batches_;
  }

  void end_step(const AdamWHyperparams& hyperparams, double clip_grad, int64_t step) override {
    metrics_.loss = loss_sum_ / std::max(micro_batches_, 1);
    metrics_.grad_norm = global_grad_norm(model_.gradients().data(), model_.layout());
    metrics_.skipped = !std::isfinite(metrics_.loss) || !std::isfinite(metrics_.grad_norm);
    if (metrics_.skipped) {
      ++skips_.consecutive;
      ++skips_.total;
      model_.scaling().discard_current_amaxes();
      return;
    }
    skips_.consecutive = 0;
    const float grad_scale = clip_coefficient(metrics_.grad_norm, clip_grad);
    optimizer_.step(model_.parameters().data(), model_.gradients().data(), hyperparams, grad_scale);
    model_.scaling().update(step);
  }

  StepMetrics step_metrics() override { return metrics_; }
  SkipStatus skip_status() override { return skips_; }

  double evaluate(const int32_t* inputs, const int32_t* targets) override { return model_.evaluate(inputs, targets); }

  std::vector<float> parameters() override { return model_.parameters(); }
  void set_parameters(const std::vector<float>& values) override {
    FP8LM_CHECK(values.size() == model_.parameters().size());
    model_.parameters() = values;
  }

  OptimizerSnapshot optimizer_state() override {
    OptimizerSnapshot state;
    state.precision = optimizer_.precision();
    state.step_count = optimizer_.step_count();
    const auto copy = [](auto span) { return std::vector<typename decltype(span)::value_type>(span.begin(), span.end()); };
    state.m8 = copy(optimizer_.m8());
    state.v16 = copy(optimizer_.v16());
    state.m_scales = copy(optimizer_.m_scales());
    state.v_scales = copy(optimizer_.v_scales());
    state.m32 = copy(optimizer_.m32());
    state.v32 = copy(optimizer_.v32());
    return state;
  }

  void set_optimizer_state(const OptimizerSnapshot& state) override {
    FP8LM_CHECK(state.precision == optimizer_.precision());
    optimizer_.set_step_count(state.step_count);
    const auto put = [](const auto& from, auto to) {
      FP8LM_CHECK(from.size() == to.size(), "optimizer state size ", from.size(), " != ", to.size());
      std::copy(from.begin(), from.end(), to.begin());
    };
    put(state.m8, optimizer_.m8());
    put(state.v16, optimizer_.v16());
    put(state.m_scales, optimizer_.m_scales());
    put(state.v_scales, optimizer_.v_scales());
    put(state.m32, optimizer_.m32());
    put(state.v32, optimizer_.v32());
  }

  ScalingSnapshot scaling_state() override {
    ScalingTable& table = model_.scaling();
    ScalingSnapshot state;
    for (int i = 0; i < table.size(); ++i) {
      state.names.push_back(table.name(i));
      state.dtypes.push_back(table.dtype(i));
    }
    state.history_len = table.config().amax_history_len;
    state.history = table.history();
    state.scale = table.scales();
    state.scale_inv = table.scale_invs();
    state.initialized = table.size() > 0 && table.initialized(0);
    return state;
  }

  void set_scaling_state(const ScalingSnapshot& state) override {
    ScalingTable& table = model_.scaling();
    FP8LM_CHECK(int(state.names.size()) == table.size() && state.history.size() == table.history().size());
    table.history() = state.history;
    table.scales() = state.scale;
    table.scale_invs() = state.scale_inv;
    std::fill(table.initialized_flags().begin(), table.initialized_flags().end(), state.initialized ? 1 : 0);
  }

  void set_total_skips(int64_t total) override {
    skips_.total = total;
    skips_.consecutive = 0;
  }

  BenchmarkMemory benchmark_memory() const override {
    BenchmarkMemory memory;
    memory.allocated_bytes = 2 * model_.layout().total_elements() * sizeof(float) + optimizer_.state_bytes();
    return memory;
  }

  SettingsTable describe() const override {
    const size_t slab = model_.layout().total_elements() * sizeof(float);
    return {
        {"parameters (FP32 master slab)", format_mib(slab)},
        {"gradients (FP32 slab)", format_mib(slab)},
        {"optimizer state", format_mib(optimizer_.state_bytes())},
        {"optimizer state bytes / parameter",
         std::to_string(optimizer_.state_bytes_per_parameter()).substr(0, 4) + " (+4 FP32 master)"},
        {"FP8 scaling states", std::to_string(const_cast<cpu::GptModel&>(model_).scaling().size())},
    };
  }

  cpu::GptModel& model() { return model_; }

 private:
  static GptPrecision precision_of(const RunSetup& setup) {
    GptPrecision precision;
    precision.gemm = setup.options.precision;
    precision.fp8_lm_head = setup.options.fp8_lm_head;
    precision.fp8 = setup.options.fp8;
    return precision;
  }

  cpu::GptModel model_;
  AdamW optimizer_;
  double loss_sum_ = 0.0;
  int micro_batches_ = 0;
  StepMetrics metrics_;
  SkipStatus skips_;
};

}  // namespace

std::unique_ptr<TrainingEngine> make_cpu_engine(const RunSetup& setup) { return std::make_unique<CpuEngine>(setup); }

}  // namespace fp8lm

