#include "layers/ops_cuda.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/block_scaling_cuda.h"
#include "core/cast_cuda.h"
#include "core/check_cuda.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/gemm_cuda.h"
#include "core/gemm_small_m_cuda.h"
#include "core/scaling_cuda.h"
#include "layers/attention.h"
#include "layers/cross_entropy.h"
#include "layers/encoder.h"
#include "layers/encoder_index.h"
#include "layers/gelu.h"
#include "layers/kv_cache.h"
#include "layers/layernorm.h"
#include "layers/sampling_cuda.h"
#include "optim/adamw_cuda.h"
#include "optim/grad_clip_cuda.h"
#include "optim/slab_ops.h"
#include "parallel/communicator.h"

namespace fp8lm {

void check_cuda_model_support(const GptConfig& config, bool fp32_gemms) {
  if (fp32_gemms)
    throw InputError("--fp32 is a CPU reference mode; the GPU trains in --bf16 or FP8", "drop --fp32, or pass --device cpu");
  if (config.n_embd > cuda::kLayerNormMaxC || config.n_embd % 8 != 0)
    throw InputError("n_embd " + std::to_string(config.n_embd) + " is not supported by the GPU LayerNorm (a multiple of 8, at most " +
                     std::to_string(cuda::kLayerNormMaxC) + ")");
  const int head_size = config.n_embd / config.n_head;
  if (head_size != 32 && head_size != 64 && head_size != 128)
    throw InputError("head size n_embd / n_head = " + std::to_string(head_size) +
                     " is not supported by the GPU attention (32, 64 or 128)");
}

namespace {

using bf16 = __nv_bfloat16;

class DeviceAllocation final : public Allocation {
 public:
  explicit DeviceAllocation(size_t bytes) : bytes_(bytes) {
    if (bytes) {
      CUDA_CHECK(cudaMalloc(&data_, bytes));
      // cudaMemset runs on the legacy default stream, which does not order itself with the
      // backend's non-blocking stream: wait for it, or a later upload may land first.
      CUDA_CHECK(cudaMemset(data_, 0, bytes));
      CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  ~DeviceAllocation() override {
    if (data_) cudaFree(data_);
  }
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Uploads above this size go through pinned staging in chunks of it.
constexpr size_t kLargeUploadBytes = size_t{128} << 20;

void parallel_copy(char* destination, const char* source, size_t bytes) {
  constexpr size_t kBlock = size_t{1} << 20;
  const size_t blocks = (bytes + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < blocks; ++b)
    std::memcpy(destination + b * kBlock, source + b * kBlock, std::min(kBlock, bytes - b * kBlock));
}

// Two pinned host buffers for one large upload: the host fills one while the other's copy runs.
class DoubleBufferedStaging {
 public:
  explicit DoubleBufferedStaging(size_t bytes_each) {
    for (int b = 0; b < 2; ++b) {
      CUDA_CHECK(cudaHostAlloc(&buffers_[b], bytes_each, cudaHostAllocDefault));
      CUDA_CHECK(cudaEventCreateWithFlags(&copied_[b], cudaEventDisableTiming));
    }
  }
  ~DoubleBufferedStaging() {
    for (int b = 0; b < 2; ++b) {
      cudaEventDestroy(copied_[b]);
      cudaFreeHost(buffers_[b]);
    }
  }
  DoubleBufferedStaging(const DoubleBufferedStaging&) = delete;
  DoubleBufferedStaging& operator=(const DoubleBufferedStaging&) = delete;
  // Buffer b, once the copy last recorded from it is done.
  void* wait_for_buffer(int b) {
    CUDA_CHECK(cudaEventSynchronize(copied_[b]));
    return buffers_[b];
  }
  void record_copy(int b, cudaStream_t stream) { CUDA_CHECK(cudaEventRecord(copied_[b], stream)); }

 private:
  void* buffers_[2] = {nullptr, nullptr};
  cudaEvent_t copied_[2] = {};
};

// A pinned host copy filled by an asynchronous device-to-host copy; an event says when
// it has landed.
class PinnedReadback final : public HostReadback {
 public:
  PinnedReadback(size_t bytes, cudaStream_t stream) : bytes_(bytes), stream_(stream) {
    CUDA_CHECK(cudaHostAlloc(&host_, bytes, cudaHostAllocDefault));
    std::memset(host_, 0, bytes);
    CUDA_CHECK(cudaEventCreateWithFlags(&landed_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(landed_, stream_));
  }
  ~PinnedReadback() override {
    if (landed_) cudaEventDestroy(landed_);
    if (host_) cudaFreeHost(host_);
  }
  void capture(const void* source) override {
    CUDA_CHECK(cudaMemcpyAsync(host_, source, bytes_, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaEventRecord(landed_, stream_));
  }
  bool ready() override {
    const cudaError_t state = cudaEventQuery(landed_);
    if (state == cudaErrorNotReady) return false;
    CUDA_CHECK(state);
    return true;
  }
  const void* wait() override {
    CUDA_CHECK(cudaEventSynchronize(landed_));
    return host_;
  }

 private:
  size_t bytes_;
  cudaStream_t stream_;
  void* host_ = nullptr;
  cudaEvent_t landed_ = nullptr;
};

// A layout on the device, with the scratch its norm and AdamW passes need.
class DeviceTable final : public TensorTable {
 public:
  explicit DeviceTable(const TensorLayout& layout) : layout_(layout), device_(layout) {
    norm_scratch_.allocate(std::max<size_t>(1, cuda::grad_norm_scratch_size(device_.table())));
  }
  const TensorLayout& layout() const override { return layout_; }
  const cuda::DeviceTensorTable& table() const { return device_.table(); }
  double* norm_scratch() { return norm_scratch_.data(); }
  uint32_t first_chunk(size_t tensor) const { return device_.first_chunk(tensor); }

 private:
  TensorLayout layout_;
  cuda::DeviceTensorLayout device_;
  cuda::DeviceBuffer<double> norm_scratch_;
};

class DeviceCastTable final : public WeightCastTable {
 public:
  DeviceCastTable(std::vector<WeightOperand> operands, std::vector<cuda::DeviceWeightCast> casts, int tensors)
      : WeightCastTable(std::move(operands)), device_(std::move(casts), tensors) {}
  const cuda::DeviceWeightCastTable& table() const { return device_.table(); }

 private:
  cuda::DeviceWeightCasts device_;
};

bf16* bf(const Tensor& t) { return static_cast<bf16*>(t.data); }
const bf16* cbf(const Tensor& t) { return static_cast<const bf16*>(t.data); }
float* f32(const Tensor& t) { return static_cast<float*>(t.data); }

// A parameter gradient (layers/ops.h) as the kernels take it: FP32, or BF16 under
// --grad-reduce-in-bf16. Empty stays empty.
GradientRef gradient(const Tensor& t) {
  FP8LM_CHECK(!t || t.dtype == DType::f32 || t.dtype == DType::bf16, "a parameter gradient of dtype ",
              to_string(t.dtype));
  return GradientRef(t.data, t.dtype == DType::bf16);
}
GradientView gradient_view(const Tensor& t) { return GradientView(gradient(t).data, gradient(t).bf16); }
uint8_t* u8(const Tensor& t) { return static_cast<uint8_t*>(t.data); }
int rows(const Tensor& t) { return static_cast<int>(t.rows); }
int cols(const Tensor& t) { return static_cast<int>(t.cols); }

cuda::GemmType gemm_type_of(DType dtype) {
  switch (dtype) {
    case DType::f32: return cuda::GemmType::fp32;
    case DType::bf16: return cuda::GemmType::bf16;
    case DType::e4m3: return cuda::GemmType::e4m3;
    case DType::e5m2: return cuda::GemmType::e5m2;
  }
  return cuda::GemmType::bf16;
}

class CudaOps final : public Ops {
 public:
  CudaOps(SmallMGemm small_m, GemmAlgorithmChoice gemm_algorithm, bool background_yields,
          Fp8FastAccumulation fast_accumulation)
      : gemm_(std::make_unique<cuda::GemmEngine>(small_m, gemm_algorithm)),
        fast_accumulation_(fast_accumulation) {
    int lowest = 0, highest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    const int lanes = background_yields ? highest : lowest;  // see make_cuda_ops
    CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, lanes));
    CUDA_CHECK(cudaStreamCreateWithPriority(&side_stream_, cudaStreamNonBlocking, lanes));
    CUDA_CHECK(cudaStreamCreateWithPriority(&background_stream_, cudaStreamNonBlocking, lowest));
    amax_sink_.allocate(1);
    tensor_amax_.allocate(1);
    gemm_amax_.allocate(1);
    for (cudaEvent_t& event : staging_done_) CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  ~CudaOps() override {
    cudaStreamSynchronize(stream_);
    for (cudaEvent_t event : staging_done_)
      if (event) cudaEventDestroy(event);
    if (staging_host_) cudaFreeHost(staging_host_);
    cudaStreamSynchronize(side_stream_);
    cudaStreamSynchronize(background_stream_);
    gemm_.reset();
    cudaStreamDestroy(background_stream_);
    cudaStreamDestroy(side_stream_);
    cudaStreamDestroy(stream_);
  }

  // ---- Memory
  DType activation_dtype() const override { return DType::bf16; }
  size_t element_bytes(DType dtype) const override {
    switch (dtype) {
      case DType::f32: return 4;
      case DType::bf16: return 2;
      default: return 1;
    }
  }
  std::unique_ptr<Allocation> allocate(size_t bytes) override { return std::make_unique<DeviceAllocation>(bytes); }
  std::unique_ptr<HostReadback> make_readback(size_t bytes) override {
    return std::make_unique<PinnedReadback>(bytes, stream_);
  }
  std::unique_ptr<WeightCastTable> make_weight_casts(const TensorTable& table,
                                                     const std::vector<WeightOperand>& operands) override {
    check_weight_casts(table.layout(), operands);
    std::vector<cuda::DeviceWeightCast> casts;
    for (const WeightOperand& w : operands) {
      FP8LM_CHECK(w.operand.dtype == DType::e4m3, "AdamW weight casts write E4M3 operands, not ",
                  to_string(w.operand.dtype));
      cuda::DeviceWeightCast cast;
      cast.codes = u8(w.operand);
      cast.codes_t = static_cast<uint8_t*>(w.operand.transposed);
      cast.tensor = w.tensor;
      cast.state = w.operand.scaling_state;
      cast.rows = rows(w.operand);
      cast.cols = cols(w.operand);
      casts.push_back(cast);
    }
    return std::make_unique<DeviceCastTable>(operands, std::move(casts), int(table.layout().tensors().size()));
  }
  std::unique_ptr<TensorTable> make_table(const TensorLayout& layout) override {
    return std::make_unique<DeviceTable>(layout);
  }
  void zero(void* data, size_t bytes) override { CUDA_CHECK(cudaMemsetAsync(data, 0, bytes, stream_)); }
  void copy(void* destination, const void* source, size_t bytes) override {
    CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void upload(void* destination, const void* host, size_t bytes) override {
    if (bytes <= kLargeUploadBytes) {
      CUDA_CHECK(cudaMemcpyAsync(destination, host, bytes, cudaMemcpyHostToDevice, stream_));
    } else {  // the master weights at start-up: tens of GB, faster pinned than pageable
      DoubleBufferedStaging& staging = large_upload_staging();
      for (size_t begin = 0, k = 0; begin < bytes; begin += kLargeUploadBytes, ++k) {
        const size_t count = std::min(kLargeUploadBytes, bytes - begin);
        auto* stage = static_cast<char*>(staging.wait_for_buffer(k % 2));
        parallel_copy(stage, static_cast<const char*>(host) + begin, count);
        CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(destination) + begin, stage, count, cudaMemcpyHostToDevice,
                                   stream_));
        staging.record_copy(k % 2, stream_);
      }
    }
    synchronize();
  }
  void download(void* host, const void* source, size_t bytes) override {
    CUDA_CHECK(cudaMemcpyAsync(host, source, bytes, cudaMemcpyDeviceToHost, stream_));
    synchronize();
  }
  void upload_values(const Tensor& destination, const float* host) override {
    const size_t n = size_t(destination.numel());
    if (destination.dtype == DType::f32) return upload(destination.data, host, n * sizeof(float));
    FP8LM_CHECK(destination.dtype == DType::bf16, "upload_values: FP8 tensors are cast on the device");
    // Rounded by every host thread into two pinned buffers in turn, so that rounding a chunk
    // overlaps the copy of the one before: one thread and a pageable copy took tens of seconds
    // for gpt-6.7b's 6.7 billion values.
    // A large upload (one rank's part of a bucket of the working copy at start-up comes dozens of
    // times) reuses the pinned buffers: pinning them again for each costs tens of milliseconds.
    const size_t chunk = std::min(n, kLargeUploadBytes / sizeof(uint16_t));
    std::optional<DoubleBufferedStaging> small_staging;
    if (chunk * sizeof(uint16_t) < kLargeUploadBytes / 8) small_staging.emplace(chunk * sizeof(uint16_t));
    DoubleBufferedStaging& staging = small_staging ? *small_staging : large_upload_staging();
    auto* device_bits = static_cast<uint16_t*>(destination.data);
    for (size_t begin = 0, k = 0; begin < n; begin += chunk, ++k) {
      const size_t count = std::min(chunk, n - begin);
      auto* bits = static_cast<uint16_t*>(staging.wait_for_buffer(k % 2));
#pragma omp parallel for schedule(static)
      for (size_t i = 0; i < count; ++i) bits[i] = bf16_from_float(host[begin + i]);
      CUDA_CHECK(cudaMemcpyAsync(device_bits + begin, bits, count * sizeof(uint16_t), cudaMemcpyHostToDevice, stream_));
      staging.record_copy(k % 2, stream_);
    }
    synchronize();
  }
  void synchronize() override {
    CUDA_CHECK(cudaStreamSynchronize(background_stream_));
    CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void plan_workspace(const ModelShape& shape) override {
    const int BT = shape.B * shape.T;
    const int widest = std::max({shape.local_ffn, 3 * shape.local_width, shape.C});
    size_t floats = cuda::layernorm_backward_scratch_floats(BT, shape.C);
    floats = std::max(floats, cuda::gelu_backward_scratch_floats(BT, shape.local_ffn));
    floats = std::max(floats, cuda::attention_backward_operand_scratch_floats(shape.B, shape.T, shape.local_width,
                                                                              shape.local_heads));
    floats = std::max(floats, cuda::dbias_scratch_floats(BT, widest));
    if (shape.cache_capacity > 0)
      floats = std::max(floats, cuda::attention_decode_scratch_floats(shape.B, shape.local_width, shape.local_heads,
                                                                      shape.cache_capacity));
    float_scratch_.allocate(floats);
    // BF16 staging for current scaling (a producer writes BF16, then the cast follows) and
    // the transposed FP8 input of a wgrad GEMM.
    staging_.allocate(size_t(BT) * widest);
    transposed_input_.allocate(size_t(BT) * std::max(widest, shape.C));
    token_slot_ints_ = cuda_token_slot_ints(size_t(shape.B), size_t(shape.T));
    tokens_.allocate(token_slot_ints_);
    if (staging_host_) cudaFreeHost(staging_host_);
    staging_host_ = nullptr;
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&staging_host_), kStagingSlots * token_slot_ints_ * sizeof(int32_t),
                             cudaHostAllocDefault));
  }
  size_t workspace_bytes() const override {
    return float_scratch_.bytes() + staging_.bytes() + transposed_input_.bytes() + tokens_.bytes() +
           cuda::GemmEngine::kWorkspaceBytes;
  }
  size_t device_memory_in_use() const override {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return total_bytes - free_bytes;
  }

  // ---- FP8 scaling: a device twin of the table's arrays.
  void attach_scaling(ScalingTable& table) override {
    table_ = &table;
    const int S = table.size(), L = table.config().amax_history_len;
    history_.allocate(std::max<size_t>(1, size_t(S) * L));
    scale_.allocate(std::max(1, S));
    scale_inv_.allocate(size_t(std::max(1, S)) * kScaleInvStride);
    format_max_.allocate(std::max(1, S));
    std::vector<float> maxima(std::max(1, S), 1.0f);
    for (int s = 0; s < S; ++s) maxima[s] = fp8_max(table.dtype(s));
    format_max_.upload(maxima);
    upload_scaling();
  }
  void download_scaling() override {
    const size_t S = table_->size();
    if (S == 0) return;
    download(table_->history().data(), history_.data(), table_->history().size() * sizeof(float));
    download(table_->scales().data(), scale_.data(), S * sizeof(float));
    CUDA_CHECK(cudaMemcpy2DAsync(table_->scale_invs().data(), sizeof(float), scale_inv_.data(),
                                 kScaleInvStride * sizeof(float), sizeof(float), S, cudaMemcpyDeviceToHost, stream_));
    synchronize();
  }
  void upload_scaling() override {
    const size_t S = table_->size();
    if (S == 0) return;
    upload(history_.data(), table_->history().data(), table_->history().size() * sizeof(float));
    upload(scale_.data(), table_->scales().data(), S * sizeof(float));
    CUDA_CHECK(cudaMemcpy2DAsync(scale_inv_.data(), kScaleInvStride * sizeof(float), table_->scale_invs().data(),
                                 sizeof(float), sizeof(float), S, cudaMemcpyHostToDevice, stream_));
    synchronize();
  }
  void set_amax_recording(AmaxRecording recording) override {
    recording_ = recording == AmaxRecording::on;
    gemm_amax_wanted_ = recording != AmaxRecording::off_any_plan;
  }
  void set_fp8_statistics(Fp8CastCounts* counts) override { counts_ = counts; }
  void update_scales(const StepControl* control) override {
    const Fp8RecipeConfig& recipe = table_->config();
    cuda::update_delayed_scales(history_.data(), scale_.data(), scale_inv_.data(), format_max_.data(), table_->size(),
                                recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin, stream_,
                                &control->skip, kScaleInvStride);
  }
  void discard_current_amaxes(const StepControl* control) override {
    cuda::discard_current_amaxes(history_.data(), table_->size(), table_->config().amax_history_len, stream_,
                                 &control->skip);
  }

  // ---- Parallel runs
  void* stream_handle() override { return stream_; }
  void set_amax_group(Communicator* group) override { amax_group_ = group; }
  float* amax_history_row() override { return history_.data(); }
  const float* scales() override { return scale_.data(); }

  // ---- Lanes
  class CudaLaneEvent final : public LaneEvent {
   public:
    explicit CudaLaneEvent(bool timing) {
      CUDA_CHECK(cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
    }
    ~CudaLaneEvent() override { cudaEventDestroy(event); }
    cudaEvent_t event = nullptr;
  };
  void* side_stream_handle() override { return side_stream_; }
  std::unique_ptr<LaneEvent> make_event() override { return std::make_unique<CudaLaneEvent>(/*timing=*/false); }
  std::unique_ptr<LaneEvent> make_timing_event() override { return std::make_unique<CudaLaneEvent>(/*timing=*/true); }
  double elapsed_ms(LaneEvent& start, LaneEvent& end) override {
    const cudaEvent_t end_event = static_cast<CudaLaneEvent&>(end).event;
    CUDA_CHECK(cudaEventSynchronize(end_event));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<CudaLaneEvent&>(start).event, end_event));
    return ms;
  }
  void record(LaneEvent& event, Lane lane) override {
    CUDA_CHECK(cudaEventRecord(static_cast<CudaLaneEvent&>(event).event, stream_of(lane)));
  }
  void wait(LaneEvent& event, Lane lane) override {
    CUDA_CHECK(cudaStreamWaitEvent(stream_of(lane), static_cast<CudaLaneEvent&>(event).event, 0));
  }

  // ---- Slabs
  void tensor_amaxes(float* amaxes, const float* values, const TensorTable& table, Lane lane) override {
    cuda::tensor_amaxes(amaxes, values, device_table(table), stream_of(lane));
  }
  void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                          float headroom, Lane lane) override {
    cuda::scales_from_amaxes(scales, scale_inv, amaxes, count, fp8_max, headroom, stream_of(lane));
  }
  void quantize_tensors(uint8_t* codes, const float* values, const TensorTable& table, const float* scales,
                        const int* scale_index, float* recorded_amax, Fp8Dtype dtype, Lane lane) override {
    // Only the FP8 weight casts (scale_index maps tensors to scaling states) are counted.
    cuda::quantize_tensors(codes, values, device_table(table), scales, scale_index, recorded_amax, dtype, stream_of(lane),
                           scale_index ? counting() : nullptr);
  }
  void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride, const TensorTable& table,
                      const float* scale_inv, Fp8Dtype dtype, Lane lane) override {
    cuda::sum_fp8_chunks(out, chunks, ranks, chunk_stride, device_table(table), scale_inv, dtype, stream_of(lane));
  }
  // Every dtype is stored in its own width here: a collective already rounded to it.
  void round_to_dtype(const Tensor&, Lane) override {}
  void fp8_weight_from_codes(const Tensor& operand, const uint8_t* codes) override {
    if (operand.data != codes) copy(operand.data, codes, size_t(operand.numel()));
    if (operand.transposed)
      cuda::transpose_fp8(static_cast<uint8_t*>(operand.transposed), u8(operand), rows(operand), cols(operand), stream_);
  }

  // ---- Tokens
  TokenBatch load_batch(const int32_t* host_inputs, const int32_t* host_targets, int B, int T,
                        const VocabSlice& slice, const DocumentMasking& documents = {}) override {
    const size_t BT = size_t(B) * T;
    FP8LM_CHECK(cuda_token_slot_ints(size_t(B), size_t(T)) <= token_slot_ints_,
                "load_batch: more tokens than the planned micro-batch");
    const int slot = staging_next_;
    staging_next_ = (staging_next_ + 1) % kStagingSlots;
    // Waits only if the GPU has not yet copied this slot's previous contents, i.e. the host
    // is kStagingSlots micro-batches ahead: flow control, not a per-step sync.
    CUDA_CHECK(cudaEventSynchronize(staging_done_[slot]));
    int32_t* host = staging_host_ + slot * token_slot_ints_;
    std::memcpy(host, host_inputs, BT * sizeof(int32_t));
    std::memcpy(host + BT, host_targets, BT * sizeof(int32_t));
    build_encoder_backward_index(host_inputs, B, T, index_, slice.begin, slice.begin + slice.size);
    const int unique = index_.num_unique();
    std::memcpy(host + 2 * BT, index_.unique_tokens.data(), unique * sizeof(int32_t));
    std::memcpy(host + 3 * BT, index_.offsets.data(), (unique + 1) * sizeof(int32_t));
    std::memcpy(host + 4 * BT + 1, index_.positions.data(), index_.positions.size() * sizeof(int32_t));
    // The documents' index after it: starts [BT] | position ids [BT] | offsets [T+1] | rows [BT].
    build_document_index(host_inputs, B, T, documents, documents_);
    const size_t documents_at = 5 * BT + 1;
    auto stage = [&](const std::vector<int32_t>& values, size_t at) -> const int32_t* {
      if (values.empty()) return nullptr;
      std::memcpy(host + at, values.data(), values.size() * sizeof(int32_t));
      return tokens_.data() + at;
    };
    const int32_t* document_starts = stage(documents_.starts, documents_at);
    const int32_t* position_ids = stage(documents_.position_ids, documents_at + BT);
    const int32_t* position_offsets = stage(documents_.position_offsets, documents_at + 2 * BT);
    const int32_t* position_rows = stage(documents_.position_rows, documents_at + 2 * BT + T + 1);
    const size_t staged = documents.any() ? token_slot_ints_ : documents_at;
    CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), host, staged * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(staging_done_[slot], stream_));
    TokenBatch batch;
    batch.B = B;
    batch.T = T;
    batch.inputs = tokens_.data();
    batch.targets = tokens_.data() + BT;
    batch.unique_tokens = tokens_.data() + 2 * BT;
    batch.offsets = tokens_.data() + 3 * BT;
    batch.positions = tokens_.data() + 4 * BT + 1;
    batch.num_unique = unique;
    batch.document_starts = document_starts;
    batch.position_ids = position_ids;
    batch.position_offsets = position_offsets;
    batch.position_rows = position_rows;
    return batch;
  }
  TokenBatch load_decode_step(const int32_t* host_tokens, int B, int position, const VocabSlice&) override {
    FP8LM_CHECK(size_t(B) + 1 <= token_slot_ints_, "load_decode_step: more sequences than the planned batch");
    const int slot = staging_next_;
    staging_next_ = (staging_next_ + 1) % kStagingSlots;
    CUDA_CHECK(cudaEventSynchronize(staging_done_[slot]));  // flow control, as in load_batch
    int32_t* host = staging_host_ + slot * token_slot_ints_;
    std::memcpy(host, host_tokens, size_t(B) * sizeof(int32_t));
    host[B] = position;
    CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), host, (size_t(B) + 1) * sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_));
    CUDA_CHECK(cudaEventRecord(staging_done_[slot], stream_));
    return TokenBatch::decode_step(tokens_.data(), B);
  }

  // One CUDA graph of what `ops_sequence` launches on the main stream.
  std::unique_ptr<RecordedOps> record_ops(const std::function<void()>& ops_sequence) override {
    class Graph final : public RecordedOps {
     public:
      Graph(cudaGraphExec_t exec, cudaStream_t stream) : exec_(exec), stream_(stream) {}
      ~Graph() override { cudaGraphExecDestroy(exec_); }
      void replay() override { CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

     private:
      cudaGraphExec_t exec_;
      cudaStream_t stream_;
    };
    // Thread-local: only this thread's CUDA calls are part of the capture, or can break it.
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      ops_sequence();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream_, &partial);
      if (partial) cudaGraphDestroy(partial);
      throw;
    }
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_CHECK(instantiated);
    return std::make_unique<Graph>(exec, stream_);
  }

  // ---- Embedding
  void embedding_lookup(const Tensor& out, const TokenBatch& batch, const Tensor& wte,
                        const VocabSlice& slice) override {
    cuda::embedding_lookup(f32(out), batch.inputs, cbf(wte), slice.begin, slice.size, rows(out), cols(out), stream_);
  }
  void add_position_embedding(const Tensor& out, const Tensor& token_embeddings, const Tensor& wpe, int first_row,
                              int T, const int32_t* stored_wpe_row, const int32_t* position_ids) override {
    cuda::add_position_embedding(bf(out), f32(token_embeddings), cbf(wpe), first_row, T, rows(out), cols(out), stream_,
                                 stored_wpe_row, position_ids);
  }
  void embedding_lookup_backward(const Tensor& dwte, const Tensor& dout, const TokenBatch& batch) override {
    cuda::embedding_lookup_backward(gradient(dwte), cbf(dout), batch.unique_tokens, batch.offsets, batch.positions,
                                    batch.num_unique, cols(dout), stream_);
  }
  void position_embedding_backward(const Tensor& dwpe, const Tensor& dout, int first_row, int T,
                                   const TokenBatch& batch) override {
    cuda::position_embedding_backward(gradient(dwpe), cbf(dout), first_row, T, rows(dout), cols(dout), stream_,
                                      batch.position_offsets, batch.position_rows);
  }

  // ---- LayerNorm
  void layernorm_forward(const LayerNormForward& call) override {
    const int N = rows(call.residual_in), C = cols(call.residual_in);
    const bool fused_add = static_cast<bool>(call.branch);
    const bf16* branch_bias = call.branch_bias ? cbf(call.branch_bias) : nullptr;
    // Delayed FP8 (or BF16 output): one kernel. Current scaling: BF16 first, then the cast
    // with the scale of the result's own amax. Block scaling: BF16 first, then the block cast.
    if (is_fp8(call.out.dtype) && !block_scaled(call.out) && !table_->uses_current_scaling()) {
      const int s = call.out.scaling_state;
      const Fp8Dtype dtype = fp8_dtype_of(call.out.dtype);
      if (fused_add) {
        cuda::residual_layernorm_forward_fp8(u8(call.out), amax_slot(s), scale_.data() + s, dtype,
                                             bf(call.residual_out), f32(call.mean), f32(call.rstd),
                                             cbf(call.residual_in), cbf(call.branch), branch_bias, cbf(call.weight),
                                             cbf(call.bias), N, C, call.eps, stream_, counts_of(s));
      } else {
        cuda::layernorm_forward_fp8(u8(call.out), amax_slot(s), scale_.data() + s, dtype, f32(call.mean),
                                    f32(call.rstd), cbf(call.residual_in), cbf(call.weight), cbf(call.bias), N, C,
                                    call.eps, stream_, counts_of(s));
      }
      return;
    }
    bf16* out = is_fp8(call.out.dtype) ? staging_.data() : bf(call.out);
    if (fused_add) {
      cuda::residual_layernorm_forward_bf16(out, bf(call.residual_out), f32(call.mean), f32(call.rstd),
                                            cbf(call.residual_in), cbf(call.branch), branch_bias, cbf(call.weight),
                                            cbf(call.bias), N, C, call.eps, stream_);
    } else {
      cuda::layernorm_forward_bf16(out, f32(call.mean), f32(call.rstd), cbf(call.residual_in), cbf(call.weight),
                                   cbf(call.bias), N, C, call.eps, stream_);
    }
    if (is_fp8(call.out.dtype) && block_scaled(call.out)) return cast_blockwise(call.out, out, DType::bf16);
    if (is_fp8(call.out.dtype)) quantize_current(call.out, out, Tensor{});
  }
  void layernorm_backward(const LayerNormBackward& call) override {
    cuda::layernorm_backward(bf(call.dresidual), gradient(call.dweight), gradient(call.dbias), cbf(call.dout), cbf(call.input),
                             cbf(call.weight), f32(call.mean), f32(call.rstd), rows(call.dout), cols(call.dout),
                             float_scratch_.data(), stream_);
  }
  void requantize_transposed(const Tensor& out, const Tensor& in) override {
    FP8LM_CHECK(is_fp8(out.dtype) && !block_scaled(out) && out.transposed && in.dtype == DType::bf16 &&
                    rows(out) == rows(in) && cols(out) == cols(in),
                "requantize_transposed: the output is a per-tensor FP8 operand of the BF16 input's shape with its "
                "transpose");
    // A current-scaling forward left its scale in the state's slot, as a delayed one's stays.
    cuda::cast_transpose_fp8(nullptr, static_cast<uint8_t*>(out.transposed), GradientRef{}, nullptr, cbf(in),
                             scale_.data() + out.scaling_state, fp8_dtype_of(out.dtype), rows(in), cols(in), nullptr,
                             stream_);
  }
  void layernorm_operand(const LayerNormOperand& call) override {
    const Tensor& out = call.out;
    const int N = rows(call.input), C = cols(call.input);
    FP8LM_CHECK(is_fp8(out.dtype) && !block_scaled(out) && out.transposed && rows(out) == N && cols(out) == C,
                "layernorm_operand: the output is a per-tensor FP8 operand [N,C] with its transpose");
    // A current-scaling forward left its scale in the state's slot, as a delayed one's stays.
    cuda::layernorm_operand_transposed_fp8(static_cast<uint8_t*>(out.transposed), scale_.data() + out.scaling_state,
                                           fp8_dtype_of(out.dtype), cbf(call.input), f32(call.mean), f32(call.rstd),
                                           cbf(call.weight), cbf(call.bias), N, C, stream_);
  }

  // ---- GEMM and casts
  void gemm(const GemmCall& call) override {
    if (call.gelu_input) return gemm_gelu(call);
    cuda::GemmDesc desc;
    cuda::GemmArgs args;
    args.D = call.out.data;
    desc.d_type = gemm_type_of(call.out.dtype);
    switch (call.pass) {
      case GemmPass::forward:
        forward_gemm_args(call, desc, args);
        break;
      case GemmPass::dgrad:  // D [M,K] = grad [M,N] . (weight^T [K,N])^T
        desc.M = rows(call.grad);
        desc.N = cols(call.weight);
        desc.K = cols(call.grad);
        set_operand_a(desc, args, call.grad, call.grad.data);
        if (is_fp8(call.weight.dtype)) {
          FP8LM_CHECK(call.weight.transposed != nullptr, "an FP8 weight needs its transposed copy for dgrad");
          set_operand_b(desc, args, call.weight, call.weight.transposed);
        } else {
          set_operand_b(desc, args, call.weight, call.weight.data);
          desc.b_transposed = true;  // weight [N,K] read as [K,N]^T
        }
        break;
      case GemmPass::wgrad:  // D [N,K] += (grad^T [N,M]) . (input^T [K,M])^T
        desc.M = cols(call.grad);
        desc.N = cols(call.input);
        desc.K = rows(call.grad);
        if (is_fp8(call.grad.dtype)) {
          FP8LM_CHECK(call.grad.transposed != nullptr, "an FP8 gradient needs its transposed copy for wgrad");
          set_operand_a(desc, args, call.grad, call.grad.transposed);
          const void* input_t = call.input.transposed;
          FP8LM_CHECK(input_t != nullptr || !block_scaled(call.input),
                      "a block-scaled FP8 input needs its transposed copy (quantized with its own tiles) for wgrad");
          if (input_t == nullptr) {
            cuda::transpose_fp8(transposed_input_.data(), u8(call.input), rows(call.input), cols(call.input), stream_);
            input_t = transposed_input_.data();
          }
          set_operand_b(desc, args, call.input, input_t);
        } else {
          set_operand_a(desc, args, call.grad, call.grad.data);
          set_operand_b(desc, args, call.input, call.input.data);
          desc.a_transposed = true;
          desc.b_transposed = true;
        }
        if (call.accumulate) {
          args.C = call.out.data;
          args.beta = 1.0f;
        }
        break;
    }
    // --fp8-fast-accumulation all: the backward's per-tensor FP8 GEMMs too, but for the sums
    // that must promote (core/gemm.h; the forward's are set in forward_gemm_args); a BF16 GEMM
    // ignores the field.
    if (call.pass != GemmPass::forward)
      desc.fast_accum = backward_sums_on_tensor_cores(fast_accumulation_, block_scaled(call.grad),
                                                      call.promote_partial_sums, desc.K);
    gemm_->gemm(desc, args, stream_);
  }

  // D [M,N] = input [M,K] . weight [N,K]^T (+ bias) (+ residual): a forward GemmCall as the
  // engine's descriptor and arguments (the GELU epilogue's fields aside).
  void forward_gemm_args(const GemmCall& call, cuda::GemmDesc& desc, cuda::GemmArgs& args) {
    args.D = call.out.data;
    desc.d_type = gemm_type_of(call.out.dtype);
    desc.M = rows(call.input);
    desc.N = rows(call.weight);
    desc.K = cols(call.input);
    set_operand_a(desc, args, call.input, call.input.data);
    set_operand_b(desc, args, call.weight, call.weight.data);
    // Transformer Engine: fast accumulation in forward only, and never with block scaling
    // (its Float8BlockScaling requires split accumulation; cuBLASLt refuses it).
    desc.fast_accum = !block_scaled(call.input);
    if (call.bias) {
      args.bias = call.bias.data;
      desc.bias_type = gemm_type_of(call.bias.dtype);
    }
    if (call.residual) {
      FP8LM_CHECK(call.residual.dtype == call.out.dtype && call.residual.data != call.out.data,
                  "forward GEMM residual: the output's dtype, not aliasing it");
      args.C = call.residual.data;
      args.beta = 1.0f;
    }
  }

  // ln_1 -> c_attn and ln_2 -> c_fc (ops.h): one launch of the small-M GEMM with its LayerNorm
  // prologue where it takes them (an FP8 decoding step at batch 1, rows up to
  // kSmallMLayerNormPrologueMaxWidth wide), else the two ops.
  void layernorm_to_gemm(const LayerNormToGemm& call) override {
    if (!layernorm_prologue(call)) Ops::layernorm_to_gemm(call);
  }
  // The prologue computes the LayerNorm as layernorm_forward's one-kernel FP8 form does: a plain
  // LayerNorm (no residual add) into E4M3 with its delayed scale (not current scaling, whose
  // scale needs the output's amax first; no cast statistics). The small-M kernel takes one row.
  bool layernorm_prologue(const LayerNormToGemm& call) {
    const LayerNormForward& ln = call.layernorm;
    const GemmCall& gemm_call = call.gemm;
    const int s = ln.out.scaling_state;
    if (ln.branch || rows(ln.residual_in) != 1 || !gemm_->small_m_enabled() || ln.out.dtype != DType::e4m3 ||
        block_scaled(ln.out) || table_->uses_current_scaling() || counts_of(s) != nullptr)
      return false;
    FP8LM_CHECK(gemm_call.input.data == ln.out.data && rows(gemm_call.input) == rows(ln.residual_in) &&
                    cols(gemm_call.input) == cols(ln.residual_in),
                "layernorm_to_gemm: the GEMM's input is not the LayerNorm's output");
    cuda::GemmDesc desc;
    cuda::GemmArgs args;
    if (gemm_call.gelu_input) {
      if (!small_m_gelu_args(gemm_call, desc, args)) return false;
    } else {
      forward_gemm_args(gemm_call, desc, args);
    }
    const cuda::SmallMLayerNorm prologue{.input = ln.residual_in.data,
                                         .weight = ln.weight.data,
                                         .bias = ln.bias.data,
                                         .eps = ln.eps,
                                         .scale = scale_.data() + s,
                                         .amax = amax_slot(s),
                                         .mean = ln.mean ? f32(ln.mean) : nullptr,
                                         .rstd = ln.rstd ? f32(ln.rstd) : nullptr};
    return gemm_->gemm_after_layernorm(desc, args, prologue, stream_);
  }

  void quantize(const Tensor& out, const Tensor& in, const Tensor& dbias, Lane lane) override {
    if (lane != Lane::main) {
      FP8LM_CHECK(is_fp8(out.dtype) && out.data != in.data && !dbias && !block_scaled(out) &&
                      !table_->uses_current_scaling(),
                  "quantize: off the main lane only an FP8 cast with a delayed per-tensor scale and no dbias");
      return cast(out, amax_slot(out.scaling_state), in.data, in.dtype, Tensor{}, stream_of(lane));
    }
    const int M = rows(in), N = cols(in);
    if (out.data == in.data) {
      if (dbias) cuda::column_sum(gradient(dbias), cbf(in), M, N, float_scratch_.data(), stream_);
      return;
    }
    FP8LM_CHECK(is_fp8(out.dtype), "quantize: the GPU casts to FP8 only, not to ", to_string(out.dtype));
    if (block_scaled(out)) {
      if (dbias) {
        FP8LM_CHECK(in.dtype == DType::bf16, "quantize: dbias from a BF16 gradient");
        cuda::column_sum(gradient(dbias), cbf(in), M, N, float_scratch_.data(), stream_);
      }
      return cast_blockwise(out, in.data, in.dtype);
    }
    if (table_->uses_current_scaling()) return quantize_current(out, in.data, dbias, in.dtype);
    const int s = out.scaling_state;
    cast(out, amax_slot(s), in.data, in.dtype, dbias, stream_);
  }

  void transpose_operand(const Tensor& operand) override {
    FP8LM_CHECK(is_fp8(operand.dtype) && !block_scaled(operand) && operand.transposed,
                "transpose_operand: a per-tensor FP8 operand with its transposed copy");
    cuda::transpose_fp8(static_cast<uint8_t*>(operand.transposed), u8(operand), rows(operand), cols(operand), stream_);
  }

  // ---- MLP
  // The c_fc GEMM with the GELU epilogue (ops.h). cuBLASLt's GELU_AUX_BIAS epilogue writes
  // gelu_input and the output in the GEMM itself: at gpt2-1558m's shape 0.184 ms against
  // 0.133 for the GEMM and 0.097 for the GELU kernel after it (device call 94). It needs an
  // output scale known before the GEMM: not current scaling, not block scaling. A decoding
  // step's one row goes to the small-M kernel with its own GELU epilogue, a few rows to the
  // small-M kernel and the GELU kernel after it (about 2x cuBLASLt's speed there,
  // docs/INFERENCE.md).
  void gemm_gelu(const GemmCall& call) {
    const Tensor &out = call.out, &pre = call.gelu_input;
    check_gelu_epilogue(call);
    FP8LM_CHECK(pre.dtype == DType::bf16, "GEMM with the GELU epilogue: the GPU keeps a bf16 gelu_input");
    const int M = rows(pre), F = cols(pre);
    const bool per_tensor_e4m3 = out.dtype == DType::e4m3 && !block_scaled(out) && !table_->uses_current_scaling() &&
                                 call.input.dtype == DType::e4m3 && call.weight.dtype == DType::e4m3;
    const bool bf16_out = out.dtype == DType::bf16 && !block_scaled(call.input);
    if (M <= cuda::kSmallMMaxRows) {
      cuda::GemmDesc desc;
      cuda::GemmArgs args;
      if (small_m_gelu_args(call, desc, args)) return gemm_->gemm(desc, args, stream_);
    }
    // Where the plain GEMM goes to the small-M kernel (a few decoding rows), it and the GELU
    // kernel after it cost less than cuBLASLt's slower pass over the weight; the engine's own
    // routing rule decides, so the two cannot drift apart.
    const GemmCall plain{.pass = GemmPass::forward, .out = pre, .input = call.input, .weight = call.weight};
    cuda::GemmDesc plain_desc;
    cuda::GemmArgs plain_args;
    forward_gemm_args(plain, plain_desc, plain_args);
    if (gemm_->routes_to_small_m(plain_desc, plain_args) || !(per_tensor_e4m3 || bf16_out)) {
      gemm(plain);
      return bias_gelu(out, pre, call.bias);
    }
    cuda::GemmDesc desc;
    cuda::GemmArgs args;
    desc.M = M;
    desc.N = F;
    desc.K = cols(call.input);
    desc.d_type = gemm_type_of(out.dtype);
    desc.fast_accum = true;  // a forward GEMM's (Transformer Engine's choice)
    set_operand_a(desc, args, call.input, call.input.data);
    set_operand_b(desc, args, call.weight, call.weight.data);
    args.D = out.data;
    args.bias = call.bias.data;
    desc.bias_type = gemm_type_of(call.bias.dtype);
    args.gelu_input = pre.data;
    if (!per_tensor_e4m3) return gemm_->gemm(desc, args, stream_);
    // cuBLASLt sets its amax: the running slot takes the max (the same plan whether or not
    // amaxes are recorded, so a recomputed forward gives the same bits). Decoding asks for no
    // amax: cuBLASLt zeroes the output before each call, a wait in front of every c_fc GEMM.
    const int s = out.scaling_state;
    args.d_scale = scale_.data() + s;
    if (gemm_amax_wanted_) args.d_amax = gemm_amax_.data();
    gemm_->gemm(desc, args, stream_);
    if (recording_) cuda::raise_amax(amax_slot(s), gemm_amax_.data(), stream_);
    if (Fp8CastCounts* counts = counts_of(s))
      cuda::count_gelu_fp8_cast(counts, cbf(pre), scale_.data() + s, Fp8Dtype::e4m3, M, F, stream_);
  }
  // c_fc of one row (a decoding step at batch 1) in the small-M kernel with its GELU epilogue: the
  // descriptor and arguments, or false where that kernel does not take it. An E4M3 output
  // needs its delayed scale, and no amax or statistics (amaxes not recorded), which the
  // kernel does not take.
  bool small_m_gelu_args(const GemmCall& call, cuda::GemmDesc& desc, cuda::GemmArgs& args) {
    const Tensor& out = call.out;
    if (rows(call.gelu_input) != 1 || !gemm_->small_m_enabled()) return false;
    const bool e4m3_out = out.dtype == DType::e4m3 && !block_scaled(out) && !table_->uses_current_scaling() &&
                          !recording_ && counts_of(out.scaling_state) == nullptr;
    if (!e4m3_out && out.dtype != DType::bf16) return false;
    forward_gemm_args(call, desc, args);
    args.gelu_input = call.gelu_input.data;
    if (e4m3_out) args.d_scale = scale_.data() + out.scaling_state;
    return cuda::small_m_gemm_refusal(desc, args) == nullptr;
  }
  // pre [M,F] += bias (saved for backward); out [M,F] = gelu(pre) in out's dtype: the GELU
  // epilogue's two-kernel form.
  void bias_gelu(const Tensor& out, const Tensor& pre, const Tensor& bias) {
    const int M = rows(pre), F = cols(pre);
    if (!is_fp8(out.dtype)) return cuda::bias_gelu_forward_bf16(bf(out), bf(pre), cbf(bias), M, F, stream_);
    if (block_scaled(out) || table_->uses_current_scaling()) {
      cuda::bias_gelu_forward_bf16(staging_.data(), bf(pre), cbf(bias), M, F, stream_);
      if (block_scaled(out)) return cast_blockwise(out, staging_.data(), DType::bf16);
      return quantize_current(out, staging_.data(), Tensor{});
    }
    const int s = out.scaling_state;
    cuda::bias_gelu_forward_fp8(u8(out), amax_slot(s), scale_.data() + s, fp8_dtype_of(out.dtype), bf(pre), cbf(bias),
                                M, F, stream_, counts_of(s));
  }
  void gelu_backward(const GeluBackward& call) override {
    const Tensor &dpre = call.dpre, &dbias = call.dbias, &dout = call.dout, &pre = call.pre;
    const int M = rows(pre), F = cols(pre);
    float* scratch = float_scratch_.data();
    cuda::GeluRecomputedOutput recomputed;
    if (const Tensor& out = call.recomputed_output) {
      // Only the fused FP8 kernel below rewrites the forward's output: no other path may be asked to.
      FP8LM_CHECK(is_fp8(out.dtype) && is_fp8(dpre.dtype) && !block_scaled(out) && !block_scaled(dpre) &&
                      out.transposed && rows(out) == M && cols(out) == F,
                  "gelu_backward: the recomputed output needs per-tensor FP8 operands, [M,F] with a transpose");
      recomputed = {.codes_t = static_cast<uint8_t*>(out.transposed),
                    .scale = scale_.data() + out.scaling_state,
                    .dtype = fp8_dtype_of(out.dtype)};
    }
    if (!is_fp8(dpre.dtype))
      return cuda::gelu_backward_dbias_bf16(bf(dpre), gradient(dbias), cbf(dout), cbf(pre), M, F, scratch, stream_);
    if (block_scaled(dpre) || table_->uses_current_scaling()) {
      cuda::gelu_backward_dbias_bf16(staging_.data(), gradient(dbias), cbf(dout), cbf(pre), M, F, scratch, stream_);
      if (block_scaled(dpre)) return cast_blockwise(dpre, staging_.data(), DType::bf16);
      quantize_current(dpre, staging_.data(), Tensor{});
      // The forward's quantize_current left its scale in the state's slot.
      if (recomputed.codes_t) cuda::gelu_recompute_transposed_fp8(recomputed, cbf(pre), M, F, stream_);
      return;
    }
    const int s = dpre.scaling_state;
    cuda::gelu_backward_cast_transpose_dbias_fp8(u8(dpre), static_cast<uint8_t*>(dpre.transposed), gradient(dbias),
                                                 amax_slot(s), scale_.data() + s, fp8_dtype_of(dpre.dtype), cbf(dout),
                                                 cbf(pre), M, F, scratch, stream_, counts_of(s), recomputed);
  }

  // ---- Attention
  void attention_forward(const Tensor& out, const Tensor& operand, const Tensor& lse, const Tensor& qkv,
                         const AttentionShape& shape) override {
    const bool fused_cast = operand.data != out.data && !block_scaled(operand) && !table_->uses_current_scaling();
    const int s = operand.scaling_state;
    const Fp8Dtype dtype = is_fp8(operand.dtype) ? fp8_dtype_of(operand.dtype) : Fp8Dtype::e4m3;
    cuda::attention_forward(bf(out), f32(lse), fused_cast ? u8(operand) : nullptr, fused_cast ? amax_slot(s) : nullptr,
                            fused_cast ? scale_.data() + s : nullptr, dtype, cbf(qkv), shape.document_starts, shape.B,
                            shape.T, shape.width(), shape.heads, stream_);
    // The fused cast writes exactly fp8(out * scale) of the BF16 out it keeps: a statistics
    // step counts that cast in a pass of its own, leaving the attention kernel as it is.
    if (fused_cast && counts_of(s))
      cuda::count_fp8_cast(counts_of(s), cbf(out), scale_.data() + s, dtype, size_t(out.numel()), stream_);
    if (operand.data != out.data && block_scaled(operand)) return cast_blockwise(operand, out.data, DType::bf16);
    if (operand.data != out.data && !fused_cast) quantize_current(operand, out.data, Tensor{}, DType::bf16);
  }
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttentionShape& shape) override {
    cuda::attention_backward(bf(dqkv), cbf(dout), cbf(qkv), cbf(out), f32(lse), shape.document_starts, shape.B,
                             shape.T, shape.width(), shape.heads, float_scratch_.data(), stream_);
  }
  // The wgmma kernels write the FP8 operand themselves where its scale is known before they
  // run (delayed scaling) and no cast statistics are counted; elsewhere the backward, then
  // the cast. Both give the same bits (tests/test_attention_gpu.cpp).
  void attention_backward_to_operand(const AttentionBackwardToOperand& call) override {
    const Tensor& operand = call.operand;
    const AttentionShape& shape = call.shape;
    const bool fused = operand.data != call.dqkv.data && is_fp8(operand.dtype) && !block_scaled(operand) &&
                       operand.transposed != nullptr && !table_->uses_current_scaling() &&
                       counts_of(operand.scaling_state) == nullptr &&
                       cuda::attention_backward_writes_operand(shape.B, shape.T, shape.width(), shape.heads);
    if (!fused) return Ops::attention_backward_to_operand(call);
    FP8LM_CHECK(float_scratch_.size() >=
                    cuda::attention_backward_operand_scratch_floats(shape.B, shape.T, shape.width(), shape.heads),
                "attention_backward_to_operand: the workspace was planned for a smaller shape");
    const int s = operand.scaling_state;
    cuda::attention_backward_operand({.codes = u8(operand),
                                      .codes_t = static_cast<uint8_t*>(operand.transposed),
                                      .dbias = gradient(call.dbias),
                                      .amax = amax_slot(s),
                                      .scale = scale_.data() + s,
                                      .dtype = fp8_dtype_of(operand.dtype)},
                                     cbf(call.dout), cbf(call.qkv), cbf(call.out), f32(call.lse),
                                     shape.document_starts, shape.B, shape.T, shape.width(), shape.heads,
                                     float_scratch_.data(), stream_);
  }

  // ---- Incremental decoding
  void kv_cache_append(const KvCache& cache, const Tensor& qkv, const AttentionShape& shape,
                       CachePosition position) override {
    cuda::kv_cache_append(cache.keys.data, cache.values.data, is_fp8(cache.keys.dtype), cache.scales,
                          float_scratch_.data(), cbf(qkv), shape.B, shape.T, shape.width(), cache.capacity,
                          position.value, stream_, position.stored);
  }
  void attention_decode(const Tensor& out, const Tensor& operand, const Tensor& qkv, const KvCache& cache,
                        const AttentionShape& shape, CachePosition position) override {
    // Delayed scaling while no amax is recorded (a decoding step): the attention's combining
    // kernel also writes c_proj's FP8 operand with the stored scale, one launch instead of two
    // per block and step. Current scaling needs the output's amax first, and a recorded amax
    // (or statistics) is cast_fp8's: those go through quantize().
    const bool fused_cast = operand.data != out.data && is_fp8(operand.dtype) && !block_scaled(operand) &&
                            !table_->uses_current_scaling() && !recording_;
    cuda::attention_decode(bf(out), cbf(qkv), cache.keys.data, cache.values.data, is_fp8(cache.keys.dtype),
                           cache.scales, shape.B, shape.width(), shape.heads, cache.capacity, position.value + 1,
                           float_scratch_.data(), stream_, fused_cast ? u8(operand) : nullptr,
                           fused_cast ? scale_.data() + operand.scaling_state : nullptr,
                           is_fp8(operand.dtype) ? fp8_dtype_of(operand.dtype) : Fp8Dtype::e4m3, position.stored,
                           /*append=*/true);
    if (operand.data != out.data && !fused_cast) quantize(operand, out, Tensor{}, Lane::main);
  }
  void download_values(float* host, const Tensor& source) override {
    const size_t n = size_t(source.numel());
    if (source.dtype == DType::f32) return download(host, source.data, n * sizeof(float));
    FP8LM_CHECK(source.dtype == DType::bf16, "download_values: FP8 codes need their scale");
    std::vector<uint16_t> bits(n);
    download(bits.data(), source.data, n * sizeof(uint16_t));
    for (size_t i = 0; i < n; ++i) host[i] = bf16_to_float(bits[i]);
  }

  // ---- Choosing tokens: into tokens_, the memory load_decode_step fills.
  void choose_next_tokens(const Tensor& logits, int B, const VocabSlice& slice, const SamplingOptions& rule,
                          CachePosition position, const DecodingTokens& tokens) override {
    FP8LM_CHECK(logits.dtype == DType::bf16 && slice.begin == 0 && slice.size == int(logits.cols) &&
                    int(logits.rows) >= B,
                "choose_next_tokens needs the whole vocabulary's BF16 logits of ", B, " sequences");
    FP8LM_CHECK(size_t(B) + 1 <= token_slot_ints_, "choose_next_tokens: more sequences than the planned batch");
    cuda::choose_next_tokens({.logits = static_cast<const uint16_t*>(logits.data),
                              .B = B,
                              .row_stride = slice.size,
                              .vocab_size = slice.vocab_size,
                              .rule = rule,
                              .position = position.value,
                              .stored_position = position.stored,
                              .next_inputs = tokens_.data(),
                              .next_position = tokens_.data() + B,
                              .tokens = tokens},
                             stream_);
  }

  // ---- Loss
  void cross_entropy(const Tensor& logits, const Tensor& losses, const TokenBatch& batch, const VocabSlice& slice,
                     float dloss) override {
    check_whole_vocabulary(slice, logits);
    cuda::cross_entropy_forward_backward(bf(logits), f32(losses), batch.targets, rows(logits), slice.vocab_size,
                                         slice.size, dloss, stream_);
  }
  // Under a delayed per-tensor scale the loss's own pass casts the dlogits (one read of the
  // logits, 1 byte an element written); current scaling needs their amax before the cast, and
  // a statistics step counts the cast as the cast kernel does: both take Ops' two ops.
  void cross_entropy_to_fp8(const Tensor& logits, const Tensor& losses, const TokenBatch& batch,
                            const VocabSlice& slice, float dloss, const Tensor& codes) override {
    const int s = codes.scaling_state;
    if (block_scaled(codes) || table_->uses_current_scaling() || counts_of(s) != nullptr)
      return Ops::cross_entropy_to_fp8(logits, losses, batch, slice, dloss, codes);
    FP8LM_CHECK(is_fp8(codes.dtype) && !codes.transposed && codes.rows == logits.rows && codes.cols == logits.cols,
                "cross_entropy_to_fp8: an FP8 operand of the logits' shape without its transposed copy");
    check_whole_vocabulary(slice, logits);
    cuda::cross_entropy_forward_backward(
        bf(logits), f32(losses), batch.targets, rows(logits), slice.vocab_size, slice.size, dloss,
        cuda::DlogitCodes{
            .codes = u8(codes), .scale = scale_.data() + s, .amax = amax_slot(s), .dtype = fp8_dtype_of(codes.dtype)},
        stream_);
  }
  void cross_entropy_partials(const Tensor& partials, const Tensor& logits, const TokenBatch& batch,
                              const VocabSlice& slice) override {
    cuda::cross_entropy_partials(f32(partials), cbf(logits), batch.targets, rows(logits), slice.vocab_size, slice.size,
                                 slice.begin, stream_);
  }
  void cross_entropy_finish(const Tensor& logits, const Tensor& losses, const Tensor& all_partials, int ranks,
                            const TokenBatch& batch, const VocabSlice& slice, float dloss) override {
    cuda::cross_entropy_finish(bf(logits), f32(losses), f32(all_partials), batch.targets, rows(logits),
                               slice.vocab_size, slice.size, slice.begin, ranks, dloss, stream_);
  }
  void accumulate_loss(const Tensor& loss_sum, const Tensor& losses) override {
    cuda::sum_losses(f32(loss_sum), f32(losses), int(losses.numel()), stream_);
  }

  // ---- The optimizer step
  void grad_sum_of_squares(double* sum_of_squares, const Tensor& grads, const TensorTable& table) override {
    auto& device = const_cast<DeviceTable&>(static_cast<const DeviceTable&>(table));
    cuda::grad_norm_squared(sum_of_squares, gradient_view(grads), device.table(), device.norm_scratch(), stream_);
  }
  void grad_sum_of_squares_part(const Tensor& grads, const TensorTable& table, TensorRange tensors,
                                Lane lane) override {
    auto& device = const_cast<DeviceTable&>(static_cast<const DeviceTable&>(table));
    FP8LM_CHECK(tensors.first <= tensors.end && tensors.end <= table.layout().tensors().size(),
                "grad_sum_of_squares_part: tensors [", tensors.first, ", ", tensors.end, ") outside the table");
    cuda::grad_norm_chunks(device.norm_scratch(), gradient_view(grads), device.table(),
                           device.first_chunk(tensors.first), device.first_chunk(tensors.end), stream_of(lane));
  }
  void grad_sum_of_squares_finish(double* sum_of_squares, const Tensor&, const TensorTable& table) override {
    auto& device = const_cast<DeviceTable&>(static_cast<const DeviceTable&>(table));
    cuda::grad_norm_finish(sum_of_squares, device.norm_scratch(), device.table().num_chunks, stream_);
  }
  void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum, float loss_divisor,
                     double max_grad_norm) override {
    cuda::finalize_step(control, sum_of_squares, loss_sum, loss_divisor, max_grad_norm, stream_);
  }
  void set_step_control(StepControl* control, const StepControl& value) override {
    cuda::set_step_control(control, value, stream_);
  }
  void adamw_moment_amaxes(const AdamWCall& call) override {
    if (call.precision != OptimizerStatePrecision::fp8_fp16) return;
    cuda::adamw_fp8_fp16_moment_amaxes(gradient_view(call.grads), call.state.m8, call.state.v16, call.state.m_scales,
                                       call.state.v_scales, device_table(*call.table), call.hyperparams, call.control,
                                       call.scratch, stream_, slab_offsets(call));
  }
  void adamw_first_pass_begin(const AdamWCall& call) override {
    check_first_pass(call);
    cuda::adamw_fp8_fp16_first_pass_begin(device_table(*call.table), call.scratch, stream_);
  }
  void adamw_first_pass_part(const AdamWCall& call, TensorRange tensors, Lane lane) override {
    check_first_pass(call);
    auto& device = const_cast<DeviceTable&>(static_cast<const DeviceTable&>(*call.table));
    FP8LM_CHECK(tensors.first <= tensors.end && tensors.end <= call.table->layout().tensors().size(),
                "AdamW's first pass: tensors [", tensors.first, ", ", tensors.end, ") outside the table");
    cuda::adamw_fp8_fp16_first_pass_part(gradient_view(call.grads), call.state.m8, call.state.v16,
                                         call.state.m_scales, call.state.v_scales, device.table(),
                                         device.first_chunk(tensors.first), device.first_chunk(tensors.end),
                                         call.hyperparams, call.scratch, device.norm_scratch(), stream_of(lane));
  }
  void adamw_first_pass_finish(const AdamWCall& call, double* sum_of_squares) override {
    check_first_pass(call);
    auto& device = const_cast<DeviceTable&>(static_cast<const DeviceTable&>(*call.table));
    cuda::adamw_fp8_fp16_first_pass_finish(device.table(), sum_of_squares, device.norm_scratch(), stream_);
  }
  void adamw_moment_amaxes_if_clipped(const AdamWCall& call) override {
    FP8LM_CHECK(call.precision == OptimizerStatePrecision::fp8_fp16, "fp8-fp16 state only");
    cuda::adamw_fp8_fp16_moment_amaxes_if_clipped(gradient_view(call.grads), call.state.m8, call.state.v16,
                                                  call.state.m_scales, call.state.v_scales, device_table(*call.table),
                                                  call.hyperparams, call.control, call.scratch, stream_);
  }
  void adamw_apply(const AdamWCall& call) override {
    const cuda::DeviceTensorTable& table = device_table(*call.table);
    FP8LM_CHECK(call.working != nullptr, "the GPU's working copy is BF16");
    FP8LM_CHECK(call.working_offsets == nullptr || call.slab_table == nullptr,
                "AdamW: a working copy with offsets of its own is for unsharded state");
    bf16* working = static_cast<bf16*>(call.working);
    if (call.precision == OptimizerStatePrecision::fp8_fp16) {
      const cuda::DeviceWeightCastTable* casts = nullptr;
      if (call.weight_casts) {
        FP8LM_CHECK(table_ != nullptr && !table_->uses_current_scaling() && counting() == nullptr,
                    "AdamW weight casts need delayed scaling, and no FP8 statistics step (those cast separately)");
        casts = &static_cast<const DeviceCastTable&>(*call.weight_casts).table();
      }
      cuda::adamw_fp8_fp16_apply(call.master, working, gradient_view(call.grads), call.state.m8, call.state.v16,
                                 call.state.m_scales, call.state.v_scales, table, call.hyperparams, call.control,
                                 call.scratch, stream_, slab_offsets(call), casts, casts ? scale_.data() : nullptr,
                                 casts && recording_ ? history_.data() : nullptr, call.working_offsets);
    } else {
      FP8LM_CHECK(call.weight_casts == nullptr, "AdamW weight casts are written by the fp8-fp16 update only");
      cuda::adamw_step_fp32(call.master, working, gradient_view(call.grads), call.state.m32, call.state.v32, table,
                            call.hyperparams, call.control, stream_, slab_offsets(call), call.working_offsets);
    }
  }

 private:
  static constexpr int kStagingSlots = 4;

  // kLargeUploadBytes of pinned memory twice, made at the first large upload and kept.
  DoubleBufferedStaging& large_upload_staging() {
    if (!large_upload_staging_) large_upload_staging_ = std::make_unique<DoubleBufferedStaging>(kLargeUploadBytes);
    return *large_upload_staging_;
  }
  std::unique_ptr<DoubleBufferedStaging> large_upload_staging_;

  static void check_first_pass(const AdamWCall& call) {
    FP8LM_CHECK(call.precision == OptimizerStatePrecision::fp8_fp16 && call.slab_table == nullptr,
                "AdamW's pass 1 takes the norm for fp8-fp16 state over whole tensors only");
  }
  cudaStream_t stream_of(Lane lane) const {
    return lane == Lane::side ? side_stream_ : lane == Lane::background ? background_stream_ : stream_;
  }
  // AdamW's gradient and working-copy offsets when they differ from the state's (sharded).
  static const uint64_t* slab_offsets(const AdamWCall& call) {
    if (call.slab_table == nullptr) return nullptr;
    const cuda::DeviceTensorTable& slab = device_table(*call.slab_table);
    FP8LM_CHECK(slab.count == device_table(*call.table).count, "AdamW: the slab table must hold the state's tensors");
    return slab.offsets;
  }

  static const cuda::DeviceTensorTable& device_table(const TensorTable& table) {
    return static_cast<const DeviceTable&>(table).table();
  }

  // Where a producer records its output's amax: the state's slot in this step's row of
  // the history, or a sink while evaluating.
  float* amax_slot(int state) { return recording_ ? history_.data() + state : amax_sink_.data(); }
  // Where a producer adds its cast's statistics: nullptr (the kernels without statistics)
  // unless a statistics step runs and amaxes are recorded (evaluation counts nothing).
  Fp8CastCounts* counting() const { return recording_ ? counts_ : nullptr; }
  Fp8CastCounts* counts_of(int state) const { return counting() ? counting() + state : nullptr; }

  // An operand's data (t.data or its transposed copy) and the scales that go with it: the
  // scaling state's scale_inv, or the block scales of that copy.
  void set_operand_a(cuda::GemmDesc& desc, cuda::GemmArgs& args, const Tensor& t, const void* data) {
    desc.a_type = gemm_type_of(t.dtype);
    args.A = data;
    if (is_fp8(t.dtype)) args.a_scale_inv = operand_scale_inv(t, data, desc.a_scaling);
  }
  void set_operand_b(cuda::GemmDesc& desc, cuda::GemmArgs& args, const Tensor& t, const void* data) {
    desc.b_type = gemm_type_of(t.dtype);
    args.B = data;
    if (is_fp8(t.dtype)) args.b_scale_inv = operand_scale_inv(t, data, desc.b_scaling);
  }
  const float* operand_scale_inv(const Tensor& t, const void* data, cuda::GemmScaling& scaling) {
    switch (t.block_scaling) {
      case BlockScaling::none:
        scaling = cuda::GemmScaling::tensor;
        return scale_inv_.data() + size_t(t.scaling_state) * kScaleInvStride;
      case BlockScaling::tiles_1x128: scaling = cuda::GemmScaling::tiles_1x128; break;
      case BlockScaling::blocks_128x128: scaling = cuda::GemmScaling::blocks_128x128; break;
    }
    const bool transposed = data != t.data;
    FP8LM_CHECK(!transposed || data == t.transposed, "a block-scaled operand's GEMM data is its own or its transposed copy");
    const float* scales = transposed ? t.transposed_block_scale_inv : t.block_scale_inv;
    FP8LM_CHECK(scales != nullptr, "a block-scaled FP8 operand without the scale array of its ",
                transposed ? "transposed copy" : "data");
    return scales;
  }

  static bool block_scaled(const Tensor& t) { return t.block_scaling != BlockScaling::none; }

  // A block-scaled operand (core/block_scaling.h) from `in` [M,N] (BF16 or FP32): its codes
  // and scales, and its transposed copy when it has one. No amax is recorded (no history).
  void cast_blockwise(const Tensor& out, const void* in, DType in_dtype) {
    const int M = rows(out), N = cols(out);
    const Fp8Dtype dtype = fp8_dtype_of(out.dtype);
    const int margin = table_->config().margin;
    uint8_t* transposed = static_cast<uint8_t*>(out.transposed);
    float* transposed_scales = transposed ? out.transposed_block_scale_inv : nullptr;
    FP8LM_CHECK(out.block_scale_inv && (!transposed || transposed_scales),
                "a block-scaled FP8 tensor without its scale arrays");
    FP8LM_CHECK(in_dtype == DType::bf16 || in_dtype == DType::f32, "block cast from ", to_string(in_dtype));
    auto cast_from = [&](const auto* values) {
      if (out.block_scaling == BlockScaling::tiles_1x128) {
        cuda::quantize_tiles_1x128(u8(out), out.block_scale_inv, transposed, transposed_scales, values, M, N, dtype,
                                   margin, stream_);
      } else {
        cuda::quantize_blocks_128x128(u8(out), out.block_scale_inv, transposed, transposed_scales, values, M, N,
                                      dtype, margin, stream_);
      }
    };
    if (in_dtype == DType::f32) return cast_from(static_cast<const float*>(in));
    cast_from(static_cast<const bf16*>(in));
  }

  // The FP8 cast of `in` [M,N] (BF16 or FP32) into `out` with out's stored scale, its
  // transpose when out has one, dbias when given; `amax` gets max |in|.
  void cast(const Tensor& out, float* amax, const void* in, DType in_dtype, const Tensor& dbias, cudaStream_t stream) {
    const int M = rows(out), N = cols(out), s = out.scaling_state;
    const Fp8Dtype dtype = fp8_dtype_of(out.dtype);
    uint8_t* transposed = static_cast<uint8_t*>(out.transposed);
    const GradientRef bias_grad = gradient(dbias);
    auto cast_from = [&](const auto* values) {
      if (transposed || bias_grad) {
        cuda::cast_transpose_fp8(u8(out), transposed, bias_grad, amax, values, scale_.data() + s, dtype, M, N,
                                 float_scratch_.data(), stream, counts_of(s));
      } else {
        cuda::cast_fp8(u8(out), amax, values, scale_.data() + s, dtype, size_t(M) * N, stream, counts_of(s));
      }
    };
    if (in_dtype == DType::f32) return cast_from(static_cast<const float*>(in));
    cast_from(static_cast<const bf16*>(in));
  }

  // Current scaling: `in`'s own amax sets the state's scale (and is recorded for the
  // delayed window while training), then the cast.
  void quantize_current(const Tensor& out, const void* in, const Tensor& dbias, DType in_dtype = DType::bf16) {
    const int s = out.scaling_state;
    const Fp8Dtype dtype = fp8_dtype_of(out.dtype);
    const size_t n = size_t(out.numel());
    CUDA_CHECK(cudaMemsetAsync(tensor_amax_.data(), 0, sizeof(float), stream_));
    if (in_dtype == DType::f32) {
      cuda::amax_of(tensor_amax_.data(), static_cast<const float*>(in), n, stream_);
    } else {
      cuda::amax_of(tensor_amax_.data(), static_cast<const bf16*>(in), n, stream_);
    }
    // A tensor shared by several ranks takes one scale: the amax of all their parts.
    if (amax_group_) amax_group_->all_reduce(tensor_amax_.data(), tensor_amax_.data(), 1, CommDtype::f32, ReduceOp::max);
    cuda::current_scale_and_record(scale_.data() + s, scale_inv_.data() + size_t(s) * kScaleInvStride,
                                   recording_ ? history_.data() + s : nullptr, tensor_amax_.data(), fp8_max(dtype),
                                   table_->config().margin, stream_);
    cast(out, amax_sink_.data(), in, in_dtype, dbias, stream_);
  }

  cudaStream_t stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;  // overlapped data-parallel traffic
  cudaStream_t background_stream_ = nullptr;  // the lowest priority: what the other lanes leave free
  std::unique_ptr<cuda::GemmEngine> gemm_;
  Fp8FastAccumulation fast_accumulation_ = Fp8FastAccumulation::forward;  // --fp8-fast-accumulation
  ScalingTable* table_ = nullptr;
  Communicator* amax_group_ = nullptr;
  bool recording_ = true;
  bool gemm_amax_wanted_ = true;  // AmaxRecording::off_any_plan clears it
  Fp8CastCounts* counts_ = nullptr;  // [states] device memory while a statistics step runs
  // scale_inv_ holds state s's at s * kScaleInvStride: 16 bytes apart, every one a pointer
  // cuBLASLt takes as it is (it wants 16-byte-aligned scale pointers; packed, three states in
  // four would need a copy into an aligned slot before each GEMM).
  static constexpr int kScaleInvStride = 4;
  cuda::DeviceBuffer<float> history_, scale_, scale_inv_, format_max_;
  cuda::DeviceBuffer<float> gemm_amax_;  // the GELU epilogue's amax, which cuBLASLt sets
  cuda::DeviceBuffer<float> amax_sink_;    // [1] where evaluation passes send amaxes
  cuda::DeviceBuffer<float> tensor_amax_;  // [1] current-scaling temporary
  cuda::DeviceBuffer<float> float_scratch_;
  cuda::DeviceBuffer<bf16> staging_;
  cuda::DeviceBuffer<uint8_t> transposed_input_;
  // inputs [BT] | targets [BT] | unique [BT] | offsets [BT+1] | positions [BT] | the documents (load_batch)
  cuda::DeviceBuffer<int32_t> tokens_;
  // Pinned staging for token uploads: a ring so the host can prepare the next
  // micro-batch while the GPU still copies the previous one.
  int32_t* staging_host_ = nullptr;
  size_t token_slot_ints_ = 0;
  cudaEvent_t staging_done_[kStagingSlots] = {};
  int staging_next_ = 0;
  EncoderBackwardIndex index_;
  DocumentIndex documents_;  // the last loaded batch's, staged after the tokens
};

}  // namespace

std::unique_ptr<Ops> make_cuda_ops(int device, SmallMGemm small_m, GemmAlgorithmChoice gemm_algorithm,
                                   bool background_yields, Fp8FastAccumulation fast_accumulation) {
  CUDA_CHECK(cudaSetDevice(device));
  return std::make_unique<CudaOps>(small_m, gemm_algorithm, background_yields, fast_accumulation);
}

}  // namespace fp8lm
