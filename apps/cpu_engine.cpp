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

