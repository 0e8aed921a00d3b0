// The CUDA engine: the GPU model (layers/gpt_cuda.h), the fused AdamW with FP8/FP16
// state (optim/adamw_cuda.h) and the device-side step control (gradient norm, clipping,
// the non-finite skip and the AdamW step count), enqueued on one stream.
//
// A step never waits for the GPU. Its results travel back asynchronously into pinned
// memory; step_metrics() waits for them, skip_status() only looks.
#include <cmath>

#include <spdlog/spdlog.h>

#include "apps/engine.h"
#include "apps/run_setup.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "core/scaling_cuda.h"
#include "layers/gpt_cuda.h"
#include "optim/adamw_cuda.h"
#include "optim/grad_clip_cuda.h"

namespace fp8lm {

namespace {

std::string mib(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.1f MiB", bytes / 1048576.0);
  return text;
}

GptPrecision precision_of(const RunSetup& setup) {
  GptPrecision precision;
  precision.gemm = setup.options.precision;
  precision.fp8_lm_head = setup.options.fp8_lm_head;
  precision.fp8 = setup.options.fp8;
  return precision;
}

cudaStream_t make_stream() {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

class CudaEngine final : public TrainingEngine {
 public:
  explicit CudaEngine(const RunSetup& setup)
      : stream_(make_stream()),
        model_(setup.model, setup.options.micro_batch_size, setup.seq_length, precision_of(setup), stream_),
        state_precision_(setup.options.optimizer_state),
        recipe_(setup.options.fp8),
        tensors_(model_.layout()) {
    const size_t n = model_.layout().total_elements();
    const size_t count = model_.layout().tensors().size();
    if (state_precision_ == OptimizerStatePrecision::fp8_fp16) {
      m8_.allocate(n);
      v16_.allocate(n);
      m8_.fill_bytes(0);
      v16_.fill_bytes(0);
      m_scales_.allocate(count);
      v_scales_.allocate(count);
      m_scales_.upload(std::vector<float>(count, 1.0f));
      v_scales_.upload(std::vector<float>(count, 1.0f));
      optimizer_scratch_.allocate(std::max<size_t>(1, adamw_scratch_floats()));
    } else {
      m32_.allocate(n);
      v32_.allocate(n);
      m32_.fill_bytes(0);
      v32_.fill_bytes(0);
    }
    norm_scratch_.allocate(std::max<size_t>(1, cuda::grad_norm_scratch_size(tensors_.table())));
    sum_of_squares_.allocate(1);
    control_.allocate(1);
    cuda::set_step_control(control_.data(), cuda::StepControl{}, stream_);
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_control_), sizeof(cuda::StepControl), cudaHostAllocDefault));
    *host_control_ = cuda::StepControl{};
    CUDA_CHECK(cudaEventCreateWithFlags(&control_ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(control_ready_, stream_));

    std::vector<float> params(n, 0.0f);
    init_gpt_parameters(params.data(), model_.layout(), setup.model, setup.options.seed);
    model_.set_parameters(params);
    tokens_per_micro_batch_ = float(setup.options.micro_batch_size) * float(setup.seq_length);
  }

  ~CudaEngine() override {
    cudaStreamSynchronize(stream_);
    if (control_ready_) cudaEventDestroy(control_ready_);
    if (host_control_) cudaFreeHost(host_control_);
    // The model's buffers are freed after this body; none of that needs the stream.
    cudaStreamDestroy(stream_);
  }

  const TensorLayout& layout() const override { return model_.layout(); }

  void begin_step() override {
    model_.zero_gradients_and_loss();
    micro_batches_ = 0;
  }

  void forward_backward(const int32_t* inputs, const int32_t* targets, float dloss) override {
    model_.forward_backward(inputs, targets, dloss);
    ++micro_batches_;
  }

  void end_step(const AdamWHyperparams& hyperparams, double clip_grad, int64_t step) override {
    const cuda::DeviceTensorTable& table = tensors_.table();
    cuda::grad_norm_squared(sum_of_squares_.data(), model_.grads(), table, norm_scratch_.data(), stream_);
    cuda::finalize_step(control_.data(), sum_of_squares_.data(), model_.loss_sum(),
                        tokens_per_micro_batch_ * float(std::max(micro_batches_, 1)), clip_grad, stream_);
    if (state_precision_ == OptimizerStatePrecision::fp8_fp16) {
      cuda::adamw_step_fp8_fp16(model_.master(), model_.params_bf16(), model_.grads(), m8_.data(), v16_.data(),
                                m_scales_.data(), v_scales_.data(), table, hyperparams, control_.data(),
                                optimizer_scratch_.data(), stream_);
    } else {
      cuda::adamw_step_fp32(model_.master(), model_.params_bf16(), model_.grads(), m32_.data(), v32_.data(), table,
                            hyperparams, control_.data(), stream_);
    }
    // The FP8 scale update: THE place scales change on the GPU (core/scaling.cu). A
    // skipped step discards its amaxes instead (same kernel, guarded by control->skip).
    const int S = model_.scaling_table().size();
    if (S > 0 && recipe_.recipe == ScalingRecipe::delayed && (step + 1) % recipe_.interval == 0) {
      cuda::update_delayed_scales(model_.scaling_history(), model_.scaling_scale(), model_.scaling_scale_inv(),
                                  model_.scaling_format_max(), S, recipe_.amax_history_len,
                                  recipe_.amax_compute_algo, recipe_.margin, stream_, &control_.data()->skip);
      model_.mark_scales_initialized();
    } else if (S > 0) {
      cuda::discard_current_amaxes(model_.scaling_history(), S, recipe_.amax_history_len, stream_,
                                   &control_.data()->skip);
    }
    model_.refresh_fp8_weights();
    CUDA_CHECK(cudaMemcpyAsync(host_control_, control_.data(), sizeof(cuda::StepControl), cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaEventRecord(control_ready_, stream_));
  }

  StepMetrics step_metrics() override {
    CUDA_CHECK(cudaEventSynchronize(control_ready_));
    last_seen_ = *host_control_;
    StepMetrics metrics;
    metrics.loss = last_seen_.loss;
    metrics.grad_norm = last_seen_.grad_norm;
    metrics.skipped = last_seen_.skip != 0;
    return metrics;
  }

  SkipStatus skip_status() override {
    const cudaError_t state = cudaEventQuery(control_ready_);
    if (state == cudaSuccess) {
      last_seen_ = *host_control_;
    } else if (state != cudaErrorNotReady) {
      CUDA_CHECK(state);
    }
    return SkipStatus{last_seen_.total_skips, last_seen_.consecutive_skips};
  }

  double evaluate(const int32_t* inputs, const int32_t* targets) override {
    CUDA_CHECK(cudaMemsetAsync(model_.eval_loss_sum(), 0, sizeof(float), stream_));
    model_.forward_eval(inputs, targets);
    float sum = 0.0f;
    CUDA_CHECK(cudaMemcpyAsync(&sum, model_.eval_loss_sum(), sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return double(sum) / tokens_per_micro_batch_;
  }

  std::vector<float> parameters() override { return model_.parameters(); }
  void set_parameters(const std::vector<float>& values) override { model_.set_parameters(values); }

  OptimizerSnapshot optimizer_state() override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    OptimizerSnapshot state;
    state.precision = state_precision_;
    state.m8 = m8_.download();
    state.v16 = v16_.download();
    state.m_scales = m_scales_.download();
    state.v_scales = v_scales_.download();
    state.m32 = m32_.download();
    state.v32 = v32_.download();
    cuda::StepControl control;
    CUDA_CHECK(cudaMemcpy(&control, control_.data(), sizeof control, cudaMemcpyDeviceToHost));
    state.step_count = control.step_count;
    return state;
  }

  void set_optimizer_state(const OptimizerSnapshot& state) override {
    FP8LM_CHECK(state.precision == state_precision_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const auto put = [](const auto& from, auto& to) {
      FP8LM_CHECK(from.size() == to.size(), "optimizer state size ", from.size(), " != ", to.size());
      if (!from.empty()) to.upload(from);
    };
    put(state.m8, m8_);
    put(state.v16, v16_);
    put(state.m_scales, m_scales_);
    put(state.v_scales, v_scales_);
    put(state.m32, m32_);
    put(state.v32, v32_);
    cuda::StepControl control;
    CUDA_CHECK(cudaMemcpy(&control, control_.data(), sizeof control, cudaMemcpyDeviceToHost));
    control.step_count = state.step_count;
    cuda::set_step_control(control_.data(), control, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  ScalingSnapshot scaling_state() override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const ScalingTable& table = model_.scaling_table();
    ScalingSnapshot state;
    for (int i = 0; i < table.size(); ++i) {
      state.names.push_back(table.name(i));
      state.dtypes.push_back(table.dtype(i));
    }
    state.history_len = recipe_.amax_history_len;
    const size_t S = table.size();
    state.history.resize(S * state.history_len);
    state.scale.resize(S);
    state.scale_inv.resize(S);
    if (S > 0) {
      CUDA_CHECK(cudaMemcpy(state.history.data(), model_.scaling_history(), state.history.size() * sizeof(float),
                            cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(state.scale.data(), model_.scaling_scale(), S * sizeof(float), cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(state.scale_inv.data(), model_.scaling_scale_inv(), S * sizeof(float),
                            cudaMemcpyDeviceToHost));
    }
    state.initialized = !model_.current_scaling();
    return state;
  }

  void set_scaling_state(const ScalingSnapshot& state) override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    const size_t S = model_.scaling_table().size();
    FP8LM_CHECK(state.names.size() == S && state.history.size() == S * size_t(recipe_.amax_history_len));
    if (S > 0) {
      CUDA_CHECK(cudaMemcpy(model_.scaling_history(), state.history.data(), state.history.size() * sizeof(float),
                            cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(model_.scaling_scale(), state.scale.data(), S * sizeof(float), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(model_.scaling_scale_inv(), state.scale_inv.data(), S * sizeof(float),
                            cudaMemcpyHostToDevice));
    }
    if (state.initialized) model_.mark_scales_initialized();
    // The FP8 weight copies must be cast with the restored weight scales. Recording the
    // weight amaxes again is idempotent: the saved slot 0 already holds them.
    model_.refresh_fp8_weights();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void set_total_skips(int64_t total) override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    cuda::StepControl control;
    CUDA_CHECK(cudaMemcpy(&control, control_.data(), sizeof control, cudaMemcpyDeviceToHost));
    control.total_skips = static_cast<int>(total);
    control.consecutive_skips = 0;
    cuda::set_step_control(control_.data(), control, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    last_seen_ = control;
  }

  BenchmarkMemory benchmark_memory() const override {
    BenchmarkMemory memory;
    memory.allocated_bytes = model_.total_bytes() + m8_.bytes() + v16_.bytes() + m32_.bytes() + v32_.bytes() +
                             optimizer_scratch_.bytes() + norm_scratch_.bytes();
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) memory.device_used_bytes = total_bytes - free_bytes;
    return memory;
  }

  SettingsTable describe() const override {
    SettingsTable rows = model_.memory_table();
    const size_t state = m8_.bytes() + v16_.bytes() + m32_.bytes() + v32_.bytes() + m_scales_.bytes() * 2;
    rows.push_back({"optimizer state (" + std::string(to_string(state_precision_)) + ")", mib(state)});
    rows.push_back({"optimizer state bytes / parameter",
                    state_precision_ == OptimizerStatePrecision::fp8_fp16 ? "3 (E4M3 m + FP16 v) + 4 FP32 master"
                                                                          : "8 (FP32 m + v) + 4 FP32 master"});
    const size_t total = model_.total_bytes() + state + optimizer_scratch_.bytes() + norm_scratch_.bytes();
    rows.push_back({"estimated peak device memory", mib(total)});
    rows.push_back({"FP8 scaling states", std::to_string(model_.scaling_table().size())});
    return rows;
  }

 private:
  size_t adamw_scratch_floats() const { return cuda::adamw_fp8_fp16_scratch_size(tensors_.table()); }

  cudaStream_t stream_;
  cuda::GptModel model_;
  OptimizerStatePrecision state_precision_;
  Fp8RecipeConfig recipe_;
  cuda::DeviceTensorLayout tensors_;
  cuda::DeviceBuffer<uint8_t> m8_;
  cuda::DeviceBuffer<uint16_t> v16_;
  cuda::DeviceBuffer<float> m_scales_, v_scales_, m32_, v32_, optimizer_scratch_;
  cuda::DeviceBuffer<double> norm_scratch_, sum_of_squares_;
  cuda::DeviceBuffer<cuda::StepControl> control_;
  cuda::StepControl* host_control_ = nullptr;
  cuda::StepControl last_seen_;
  cudaEvent_t control_ready_ = nullptr;
  int micro_batches_ = 0;
  float tokens_per_micro_batch_ = 1.0f;
};

}  // namespace

std::unique_ptr<TrainingEngine> make_cuda_engine(const RunSetup& setup) {
  auto engine = std::make_unique<CudaEngine>(setup);
  return engine;
}

}  // namespace fp8lm

namespace fp8lm {
std::unique_ptr<TrainingEngine> make_engine(const RunSetup& setup) {
  return setup.use_cuda ? make_cuda_engine(setup) : make_cpu_engine(setup);
}
}  // namespace fp8lm
