#include "layers/ops_cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/block_scaling.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/gemm.h"
#include "core/loss_mask.h"
#include "layers/attention.h"
#include "layers/cross_entropy.h"
#include "layers/encoder.h"
#include "layers/gelu.h"
#include "layers/kv_cache.h"
#include "layers/layernorm.h"
#include "optim/grad_clip.h"
#include "optim/slab_ops.h"
#include "parallel/communicator.h"

namespace fp8lm {
namespace {

class HostAllocation final : public Allocation {
 public:
  explicit HostAllocation(size_t bytes) : bytes_(bytes) {
    // 64-byte aligned, zero-filled: what every slab assumes.
    data_ = bytes ? std::aligned_alloc(64, (bytes + 63) / 64 * 64) : nullptr;
    FP8LM_CHECK(bytes == 0 || data_ != nullptr, "out of host memory allocating ", bytes, " bytes");
    if (data_) std::memset(data_, 0, bytes);
  }
  ~HostAllocation() override { std::free(data_); }
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class HostCopy final : public HostReadback {
 public:
  explicit HostCopy(size_t bytes) : copy_(bytes) {}
  void capture(const void* source) override { std::memcpy(copy_.data(), source, copy_.size()); }
  bool ready() override { return true; }
  const void* wait() override { return copy_.data(); }

 private:
  std::vector<char> copy_;
};

class HostTable final : public TensorTable {
 public:
  explicit HostTable(const TensorLayout& layout) : layout_(layout) {}
  const TensorLayout& layout() const override { return layout_; }

 private:
  TensorLayout layout_;
};

// The CPU's ops finish before they return: a mark's time is the wall clock at record().
struct TimingEvent final : Ops::LaneEvent {
  std::chrono::steady_clock::time_point reached;
};

float* f32(const Tensor& t) { return static_cast<float*>(t.data); }

bool same_data(const Tensor& a, const Tensor& b) { return a.data == b.data; }

// A parameter gradient after an op added its FP32 sums to it (layers/ops.h): a BF16 one is
// rounded to BF16, once, as the GPU kernels round when they add to a BF16 gradient. The
// references add each sum once (dst += sum), so this is the GPU's rounding exactly; the
// elements the op did not touch already hold BF16 values and stay as they are.
void hold_in_dtype(const Tensor& gradient) {
  if (gradient && gradient.dtype == DType::bf16) cpu::round_bf16(f32(gradient), f32(gradient), size_t(gradient.numel()));
}

// dbias [N] += column sums of in [M,N], each column summed in row order.
void add_column_sums(float* dbias, const float* in, int64_t M, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < N; ++j) {
    float sum = 0.0f;
    for (int64_t i = 0; i < M; ++i) sum += in[i * N + j];
    dbias[j] += sum;
  }
}

class CpuOps final : public Ops {
 public:
  // ---- Memory
  DType activation_dtype() const override { return DType::f32; }
  size_t element_bytes(DType) const override { return sizeof(float); }
  std::unique_ptr<Allocation> allocate(size_t bytes) override { return std::make_unique<HostAllocation>(bytes); }
  std::unique_ptr<HostReadback> make_readback(size_t bytes) override { return std::make_unique<HostCopy>(bytes); }
  std::unique_ptr<TensorTable> make_table(const TensorLayout& layout) override {
    return std::make_unique<HostTable>(layout);
  }
  std::unique_ptr<WeightCastTable> make_weight_casts(const TensorTable& table,
                                                     const std::vector<WeightOperand>& operands) override {
    check_weight_casts(table.layout(), operands);
    return std::make_unique<WeightCastTable>(operands);
  }
  void zero(void* data, size_t bytes) override { std::memset(data, 0, bytes); }
  void copy(void* destination, const void* source, size_t bytes) override { std::memmove(destination, source, bytes); }
  void upload(void* destination, const void* host, size_t bytes) override { std::memcpy(destination, host, bytes); }
  void download(void* host, const void* source, size_t bytes) override { std::memcpy(host, source, bytes); }
  void upload_values(const Tensor& destination, const float* host) override {
    store(destination, host, /*record=*/false);
  }
  void synchronize() override {}
  void plan_workspace(const ModelShape&) override {}
  size_t workspace_bytes() const override { return 0; }
  size_t device_memory_in_use() const override { return 0; }

  // ---- FP8 scaling: the table's own host arrays.
  void attach_scaling(ScalingTable& table) override { scaling_ = &table; }
  void download_scaling() override {}
  void upload_scaling() override {}
  void set_amax_recording(AmaxRecording recording) override { recording_ = recording == AmaxRecording::on; }
  void set_fp8_statistics(Fp8CastCounts* counts) override { counts_ = counts; }
  void update_scales(const StepControl* control) override {
    if (control->skip) {
      scaling_->discard_current_amaxes();
    } else {
      scaling_->update_now();
    }
  }
  void discard_current_amaxes(const StepControl* control) override {
    if (control->skip) scaling_->discard_current_amaxes();
  }

  // ---- Parallel runs
  void* stream_handle() override { return nullptr; }
  void set_amax_group(Communicator* group) override { amax_group_ = group; }
  float* amax_history_row() override { return scaling_->history().data(); }
  const float* scales() override { return scaling_->scales().data(); }

  // ---- Lanes: one, in program order.
  void* side_stream_handle() override { return nullptr; }
  std::unique_ptr<LaneEvent> make_event() override { return std::make_unique<LaneEvent>(); }
  void record(LaneEvent& event, Lane) override {
    if (auto* timing = dynamic_cast<TimingEvent*>(&event)) timing->reached = std::chrono::steady_clock::now();
  }
  void wait(LaneEvent&, Lane) override {}
  std::unique_ptr<LaneEvent> make_timing_event() override { return std::make_unique<TimingEvent>(); }
  double elapsed_ms(LaneEvent& start, LaneEvent& end) override {
    return std::chrono::duration<double, std::milli>(dynamic_cast<TimingEvent&>(end).reached -
                                                     dynamic_cast<TimingEvent&>(start).reached)
        .count();
  }

  // ---- Slabs
  // The CPU runs both lanes in program order: the lane arguments change nothing here.
  void tensor_amaxes(float* amaxes, const float* values, const TensorTable& table, Lane) override {
    cpu::tensor_amaxes(amaxes, values, table.layout());
  }
  void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                          float headroom, Lane) override {
    cpu::scales_from_amaxes(scales, scale_inv, amaxes, count, fp8_max, headroom);
  }
  void quantize_tensors(uint8_t* codes, const float* values, const TensorTable& table, const float* scales,
                        const int* scale_index, float* recorded_amax, Fp8Dtype dtype, Lane) override {
    // Only the FP8 weight casts (scale_index maps tensors to scaling states) are counted.
    cpu::quantize_tensors(codes, values, table.layout(), scales, scale_index, recorded_amax, dtype,
                          scale_index ? counting() : nullptr);
  }
  void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride, const TensorTable& table,
                      const float* scale_inv, Fp8Dtype dtype, Lane) override {
    cpu::sum_fp8_chunks(out, chunks, ranks, chunk_stride, table.layout(), scale_inv, dtype);
  }
  void round_to_dtype(const Tensor& values, Lane) override { hold_in_dtype(values); }
  void fp8_weight_from_codes(const Tensor& operand, const uint8_t* codes) override {
    cpu::decode_fp8(f32(operand), codes, size_t(operand.numel()), fp8_dtype_of(operand.dtype));
    if (operand.transposed)
      cpu::transpose(static_cast<float*>(operand.transposed), f32(operand), int(operand.rows), int(operand.cols));
  }

  // ---- Tokens
  TokenBatch load_batch(const int32_t* host_inputs, const int32_t* host_targets, int B, int T,
                        const VocabSlice& slice, const DocumentMasking& documents = {}) override {
    const size_t n = size_t(B) * T;
    for (size_t i = 0; i < n; ++i) {
      FP8LM_INPUT_CHECK(host_inputs[i] >= 0 && host_inputs[i] < slice.vocab_size, "input token ", host_inputs[i],
                        " is outside the vocabulary [0, ", slice.vocab_size, ")");
      FP8LM_INPUT_CHECK(host_targets[i] == kMaskedTarget || (host_targets[i] >= 0 && host_targets[i] < slice.vocab_size),
                        "target token ", host_targets[i],
                        " is outside the vocabulary [0, ", slice.vocab_size, ")");
    }
    inputs_.assign(host_inputs, host_inputs + n);
    targets_.assign(host_targets, host_targets + n);
    TokenBatch batch;
    batch.B = B;
    batch.T = T;
    batch.inputs = inputs_.data();
    batch.targets = targets_.data();
    build_document_index(host_inputs, B, T, documents, documents_);
    auto data_or_null = [](const std::vector<int32_t>& v) { return v.empty() ? nullptr : v.data(); };
    batch.document_starts = data_or_null(documents_.starts);
    batch.position_ids = data_or_null(documents_.position_ids);
    batch.position_offsets = data_or_null(documents_.position_offsets);
    batch.position_rows = data_or_null(documents_.position_rows);
    batch_slice_ = slice;
    return batch;
  }
  TokenBatch load_decode_step(const int32_t* host_tokens, int B, int position, const VocabSlice& slice) override {
    for (int b = 0; b < B; ++b)
      FP8LM_INPUT_CHECK(host_tokens[b] >= 0 && host_tokens[b] < slice.vocab_size, "input token ", host_tokens[b],
                        " is outside the vocabulary [0, ", slice.vocab_size, ")");
    // Resized only when B changes, so a recorded step keeps reading this memory.
    if (decode_step_.size() != size_t(B) + 1) decode_step_.resize(size_t(B) + 1);
    std::copy(host_tokens, host_tokens + B, decode_step_.begin());
    decode_step_[size_t(B)] = position;
    batch_slice_ = slice;
    return TokenBatch::decode_step(decode_step_.data(), B);
  }

  // The reference records nothing: replaying runs the ops again, which read whatever the
  // step's memory holds by then, as the GPU's graph does.
  std::unique_ptr<RecordedOps> record_ops(const std::function<void()>& ops_sequence) override {
    class Rerun final : public RecordedOps {
     public:
      explicit Rerun(std::function<void()> ops) : ops_(std::move(ops)) {}
      void replay() override { ops_(); }

     private:
      std::function<void()> ops_;
    };
    return std::make_unique<Rerun>(ops_sequence);
  }

  // ---- Embedding
  void embedding_lookup(const Tensor& out, const TokenBatch& batch, const Tensor& wte,
                        const VocabSlice& slice) override {
    cpu::embedding_lookup(f32(out), batch.inputs, f32(wte), slice.begin, slice.size, int(out.rows), int(out.cols));
  }
  void add_position_embedding(const Tensor& out, const Tensor& token_embeddings, const Tensor& wpe, int first_row,
                              int T, const int32_t* stored_wpe_row, const int32_t* position_ids) override {
    const float* rows = f32(wpe) + (stored_wpe_row ? int64_t(*stored_wpe_row) * wpe.cols : 0);
    cpu::add_position_embedding(f32(out), f32(token_embeddings), rows, first_row, T, int(out.rows), int(out.cols),
                                position_ids);
  }
  void embedding_lookup_backward(const Tensor& dwte, const Tensor& dout, const TokenBatch& batch) override {
    cpu::embedding_lookup_backward(f32(dwte), f32(dout), batch.inputs, batch_slice_.begin, batch_slice_.size,
                                   int(dout.rows), int(dout.cols));
    hold_in_dtype(dwte);
  }
  void position_embedding_backward(const Tensor& dwpe, const Tensor& dout, int first_row, int T,
                                   const TokenBatch& batch) override {
    cpu::position_embedding_backward(f32(dwpe), f32(dout), first_row, T, int(dout.rows), int(dout.cols),
                                     batch.position_ids);
    hold_in_dtype(dwpe);
  }

  // ---- LayerNorm
  void layernorm_forward(const LayerNormForward& call) override {
    const int N = int(call.residual_in.rows), C = int(call.residual_in.cols);
    std::vector<float>& normalized = scratch(size_t(N) * C);
    cpu::residual_layernorm_forward(normalized.data(), call.branch ? f32(call.residual_out) : nullptr, f32(call.mean),
                                    f32(call.rstd), f32(call.residual_in), call.branch ? f32(call.branch) : nullptr,
                                    call.branch_bias ? f32(call.branch_bias) : nullptr, f32(call.weight),
                                    f32(call.bias), N, C, call.eps);
    store(call.out, normalized.data(), recording_);
  }
  void layernorm_backward(const LayerNormBackward& call) override {
    cpu::layernorm_backward(f32(call.dresidual), f32(call.dweight), f32(call.dbias), f32(call.dout), f32(call.input),
                            f32(call.weight), f32(call.mean), f32(call.rstd), int(call.dout.rows), int(call.dout.cols));
    hold_in_dtype(call.dweight);
    hold_in_dtype(call.dbias);
  }
  void requantize_transposed(const Tensor& out, const Tensor& in) override {
    FP8LM_CHECK(is_fp8(out.dtype) && !block_scaled(out) && out.transposed && out.rows == in.rows &&
                    out.cols == in.cols,
                "requantize_transposed: the output is a per-tensor FP8 operand of the input's shape with its transpose");
    store(out, f32(in), /*record=*/false);  // the forward's codes; its amax is recorded
  }
  void layernorm_operand(const LayerNormOperand& call) override {
    const Tensor& out = call.out;
    const int N = int(call.input.rows), C = int(call.input.cols);
    FP8LM_CHECK(is_fp8(out.dtype) && !block_scaled(out) && out.transposed && out.rows == N && out.cols == C,
                "layernorm_operand: the output is a per-tensor FP8 operand [N,C] with its transpose");
    std::vector<float>& normalized = scratch(size_t(N) * C);
    cpu::layernorm_output(normalized.data(), f32(call.input), f32(call.mean), f32(call.rstd), f32(call.weight),
                          f32(call.bias), N, C);
    store(out, normalized.data(), /*record=*/false);  // the forward's codes; its amax is recorded
  }

  // ---- GEMM and casts
  void gemm(const GemmCall& call) override {
    if (block_scaled(call.input) || block_scaled(call.weight) || block_scaled(call.grad)) return gemm_blockwise(call);
    switch (call.pass) {
      case GemmPass::forward: {
        // out [M,N] = input [M,K] . weight [N,K]^T (+ bias) (+ residual), both added to the
        // FP32 result in the GPU epilogue's order
        const int M = int(call.input.rows), K = int(call.input.cols), N = int(call.weight.rows);
        FP8LM_CHECK(call.weight.cols == K && call.out.rows == M && call.out.cols == N, "forward GEMM shapes");
        FP8LM_CHECK(!call.residual || (call.residual.rows == M && call.residual.cols == N &&
                                       call.residual.data != call.out.data),
                    "forward GEMM residual: [M,N], not aliasing the output");
        check_gelu_epilogue(call);
        cpu::gemm_nt(product_of(call), f32(call.input), f32(call.weight), M, N, K,
                     scale_inv(call.input) * scale_inv(call.weight), false);
        add_epilogue(call, M, N);
        break;
      }
      case GemmPass::dgrad: {
        // out [M,K] = grad [M,N] . weight [N,K] = grad . (weight^T [K,N])^T
        const int M = int(call.grad.rows), N = int(call.grad.cols), K = int(call.weight.cols);
        FP8LM_CHECK(call.weight.rows == N && call.out.rows == M && call.out.cols == K, "dgrad GEMM shapes");
        const float* weight_t = transposed(call.weight, transpose_a_);
        cpu::gemm_nt(f32(call.out), f32(call.grad), weight_t, M, K, N, scale_inv(call.grad) * scale_inv(call.weight),
                     false);
        break;
      }
      case GemmPass::wgrad: {
        // out [N,K] += grad^T [N,M] . (input^T [K,M])^T
        const int M = int(call.grad.rows), N = int(call.grad.cols), K = int(call.input.cols);
        FP8LM_CHECK(call.input.rows == M && call.out.rows == N && call.out.cols == K, "wgrad GEMM shapes");
        const float* grad_t = transposed(call.grad, transpose_a_);
        const float* input_t = transposed(call.input, transpose_b_);
        cpu::gemm_nt(f32(call.out), grad_t, input_t, N, K, M, scale_inv(call.grad) * scale_inv(call.input),
                     call.accumulate);
        hold_in_dtype(call.out);  // cuBLASLt's epilogue: alpha * sum + beta * out in FP32, rounded once
        break;
      }
    }
  }

  // The block-scaled GEMMs (core/block_scaling.h): each operand with its own tile or block
  // scales; the transposed copies the producers wrote serve dgrad and wgrad.
  void gemm_blockwise(const GemmCall& call) {
    auto require = [](const Tensor& t, bool transposed, const char* what) {
      FP8LM_CHECK(block_scaled(t) && (!transposed || (t.transposed && t.transposed_block_scale_inv)),
                  "block-scaled GEMM: the ", what, " is not a block-scaled FP8 operand",
                  transposed ? " with its transposed copy" : "");
    };
    switch (call.pass) {
      case GemmPass::forward: {  // out [M,N] = input [M,K] . weight [N,K]^T
        const int M = int(call.input.rows), K = int(call.input.cols), N = int(call.weight.rows);
        FP8LM_CHECK(call.weight.cols == K && call.out.rows == M && call.out.cols == N, "forward GEMM shapes");
        FP8LM_CHECK(!call.residual || (call.residual.rows == M && call.residual.cols == N &&
                                       call.residual.data != call.out.data),
                    "forward GEMM residual: [M,N], not aliasing the output");
        require(call.input, false, "input");
        require(call.weight, false, "weight");
        check_gelu_epilogue(call);
        cpu::gemm_block_scaled(product_of(call), f32(call.input), call.input.block_scale_inv, call.input.block_scaling,
                               f32(call.weight), call.weight.block_scale_inv, call.weight.block_scaling, M, N, K,
                               1.0f, false);
        add_epilogue(call, M, N);
        break;
      }
      case GemmPass::dgrad: {  // out [M,K] = grad [M,N] . (weight^T [K,N])^T
        const int M = int(call.grad.rows), N = int(call.grad.cols), K = int(call.weight.cols);
        FP8LM_CHECK(call.weight.rows == N && call.out.rows == M && call.out.cols == K, "dgrad GEMM shapes");
        require(call.grad, false, "output gradient");
        require(call.weight, true, "weight");
        cpu::gemm_block_scaled(f32(call.out), f32(call.grad), call.grad.block_scale_inv, call.grad.block_scaling,
                               static_cast<const float*>(call.weight.transposed),
                               call.weight.transposed_block_scale_inv, call.weight.block_scaling, M, K, N, 1.0f,
                               false);
        break;
      }
      case GemmPass::wgrad: {  // out [N,K] += grad^T [N,M] . (input^T [K,M])^T
        const int M = int(call.grad.rows), N = int(call.grad.cols), K = int(call.input.cols);
        FP8LM_CHECK(call.input.rows == M && call.out.rows == N && call.out.cols == K, "wgrad GEMM shapes");
        require(call.grad, true, "output gradient");
        require(call.input, true, "input");
        cpu::gemm_block_scaled(f32(call.out), static_cast<const float*>(call.grad.transposed),
                               call.grad.transposed_block_scale_inv, call.grad.block_scaling,
                               static_cast<const float*>(call.input.transposed),
                               call.input.transposed_block_scale_inv, call.input.block_scaling, N, K, M, 1.0f,
                               call.accumulate);
        hold_in_dtype(call.out);
        break;
      }
    }
  }

  void quantize(const Tensor& out, const Tensor& in, const Tensor& dbias, Lane /*ops finish before they return*/) override {
    if (dbias) {
      add_column_sums(f32(dbias), f32(in), in.rows, in.cols);
      hold_in_dtype(dbias);
    }
    if (!same_data(out, in)) store(out, f32(in), recording_);
  }
  void transpose_operand(const Tensor& operand) override {
    FP8LM_CHECK(is_fp8(operand.dtype) && !block_scaled(operand) && operand.transposed,
                "transpose_operand: a per-tensor FP8 operand with its transposed copy");
    cpu::transpose(static_cast<float*>(operand.transposed), f32(operand), int(operand.rows), int(operand.cols));
  }

  // ---- MLP
  void gelu_backward(const GeluBackward& call) override {
    const Tensor& pre = call.pre;
    std::vector<float>& gradient = scratch(size_t(pre.numel()));
    cpu::gelu_backward(gradient.data(), f32(pre), f32(call.dout), size_t(pre.numel()));
    if (call.dbias) {
      add_column_sums(f32(call.dbias), gradient.data(), pre.rows, pre.cols);
      hold_in_dtype(call.dbias);
    }
    store(call.dpre, gradient.data(), recording_);
    if (call.recomputed_output) {
      const Tensor& out = call.recomputed_output;
      FP8LM_CHECK(is_fp8(out.dtype) && !block_scaled(out) && out.transposed && out.rows == pre.rows &&
                      out.cols == pre.cols,
                  "gelu_backward: the recomputed output is a per-tensor FP8 operand [M,F] with its transpose");
      cpu::gelu_forward(gradient.data(), f32(pre), size_t(pre.numel()));
      store(out, gradient.data(), /*record=*/false);  // the forward's codes; its amax is recorded
    }
  }

  // ---- Attention
  void attention_forward(const Tensor& out, const Tensor& operand, const Tensor& lse, const Tensor& qkv,
                         const AttentionShape& shape) override {
    cpu::attention_forward(f32(out), f32(lse), f32(qkv), shape.document_starts, shape.B, shape.T, shape.width(),
                           shape.heads);
    if (!same_data(operand, out)) store(operand, f32(out), recording_);
  }
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttentionShape& shape) override {
    cpu::attention_backward(f32(dqkv), f32(dout), f32(qkv), f32(out), f32(lse), shape.document_starts, shape.B,
                            shape.T, shape.width(), shape.heads);
  }

  // ---- Incremental decoding
  void kv_cache_append(const KvCache& cache, const Tensor& qkv, const AttentionShape& shape,
                       CachePosition where) override {
    const int position = where.stored ? *where.stored : where.value;
    const bool fp8 = is_fp8(cache.keys.dtype);
    FP8LM_CHECK(!fp8 || cache.keys.dtype == DType::e4m3, "an FP8 key/value cache is E4M3");
    FP8LM_CHECK(position >= 0 && position + shape.T <= cache.capacity, "kv_cache_append: positions [", position, ", ",
                position + shape.T, ") outside the cache's ", cache.capacity);
    if (fp8 && position == 0) {
      // The first keys and values set the scales (layers/kv_cache.h).
      const int C = shape.width();
      float key_amax = 0.0f, value_amax = 0.0f;
      for (int64_t row = 0; row < qkv.rows; ++row)
        for (int c = 0; c < C; ++c) {
          key_amax = std::max(key_amax, std::fabs(f32(qkv)[row * 3 * C + C + c]));
          value_amax = std::max(value_amax, std::fabs(f32(qkv)[row * 3 * C + 2 * C + c]));
        }
      cache.scales[0] = kv_cache_scale(key_amax);
      cache.scales[1] = kv_cache_scale(value_amax);
    }
    cpu::kv_cache_append(f32(cache.keys), f32(cache.values), f32(qkv), shape.B, shape.T, shape.width(),
                         cache.capacity, position, fp8 ? cache.scales : nullptr);
  }
  void attention_decode(const Tensor& out, const Tensor& operand, const Tensor& qkv, const KvCache& cache,
                        const AttentionShape& shape, CachePosition where) override {
    kv_cache_append(cache, qkv, shape, where);
    const int length = (where.stored ? *where.stored : where.value) + 1;
    const bool fp8 = is_fp8(cache.keys.dtype);
    FP8LM_CHECK(length >= 1 && length <= cache.capacity, "attention_decode: length ", length, " outside [1, ",
                cache.capacity, "]");
    cpu::attention_decode(f32(out), f32(qkv), f32(cache.keys), f32(cache.values), shape.B, shape.width(), shape.heads,
                          cache.capacity, length, fp8 ? 1.0f / cache.scales[0] : 1.0f,
                          fp8 ? 1.0f / cache.scales[1] : 1.0f);
    if (!same_data(operand, out)) store(operand, f32(out), recording_);
  }
  void download_values(float* host, const Tensor& source) override {
    FP8LM_CHECK(!is_fp8(source.dtype), "download_values: FP8 values need their scale");
    std::copy(f32(source), f32(source) + source.numel(), host);
  }

  // ---- Choosing tokens: sample_token on each row, in place of the GPU's kernel.
  void choose_next_tokens(const Tensor& logits, int B, const VocabSlice& slice, const SamplingOptions& rule,
                          CachePosition position, const DecodingTokens& tokens) override {
    FP8LM_CHECK(slice.begin == 0 && slice.size == int(logits.cols) && int(logits.rows) >= B,
                "choose_next_tokens needs the whole vocabulary's logits of ", B, " sequences");
    const int at = position.stored ? *position.stored : position.value;
    FP8LM_CHECK(at >= tokens.first_position && at + 1 < tokens.rows, "choose_next_tokens: position ", at,
                " outside the decoding loop's [", tokens.first_position, ", ", tokens.rows - 1, ")");
    if (decode_step_.size() != size_t(B) + 1) decode_step_.resize(size_t(B) + 1);
    for (int b = 0; b < B; ++b) {
      int32_t& chosen = tokens.chosen[size_t(at + 1) * B + b];
      if (tokens.ended[b]) {
        chosen = -1;
        continue;
      }
      chosen = sample_token(f32(logits) + size_t(b) * slice.size, slice.vocab_size, rule,
                            step_uniform(tokens.seed, b, at - tokens.first_position));
      decode_step_[size_t(b)] = chosen;
      if (chosen == tokens.stop_token) tokens.ended[b] = 1;
    }
    decode_step_[size_t(B)] = at + 1;
  }

  // ---- Loss
  void cross_entropy(const Tensor& logits, const Tensor& losses, const TokenBatch& batch, const VocabSlice& slice,
                     float dloss) override {
    check_whole_vocabulary(slice, logits);
    cpu::cross_entropy_forward_backward(f32(logits), f32(losses), batch.targets, int(logits.rows), slice.vocab_size,
                                        slice.size, dloss);
  }
  void cross_entropy_partials(const Tensor& partials, const Tensor& logits, const TokenBatch& batch,
                              const VocabSlice& slice) override {
    cpu::cross_entropy_partials(f32(partials), f32(logits), batch.targets, int(logits.rows), slice.vocab_size,
                                slice.size, slice.begin);
  }
  void cross_entropy_finish(const Tensor& logits, const Tensor& losses, const Tensor& all_partials, int ranks,
                            const TokenBatch& batch, const VocabSlice& slice, float dloss) override {
    cpu::cross_entropy_finish(f32(logits), f32(losses), f32(all_partials), batch.targets, int(logits.rows),
                              slice.vocab_size, slice.size, slice.begin, ranks, dloss);
  }
  void accumulate_loss(const Tensor& loss_sum, const Tensor& losses) override {
    double sum = 0.0;
    const float* l = f32(losses);
    for (int64_t i = 0; i < losses.numel(); ++i) sum += l[i];
    *f32(loss_sum) += static_cast<float>(sum);
  }

  // ---- The optimizer step
  // Gradients of every dtype are FP32 storage here (BF16 ones hold BF16 values).
  void grad_sum_of_squares(double* sum_of_squares, const Tensor& grads, const TensorTable& table) override {
    *sum_of_squares = fp8lm::grad_sum_of_squares(f32(grads), table.layout());
  }
  // The parts only check their ranges; the sum is taken at the end over every tensor at once
  // (as adamw_first_pass_finish does): the CPU's ops finish before they return, so there is
  // no backward for a part to run beside.
  void grad_sum_of_squares_part(const Tensor&, const TensorTable& table, TensorRange tensors, Lane) override {
    FP8LM_CHECK(tensors.first <= tensors.end && tensors.end <= table.layout().tensors().size(),
                "grad_sum_of_squares_part: tensors [", tensors.first, ", ", tensors.end, ") outside the table");
  }
  void grad_sum_of_squares_finish(double* sum_of_squares, const Tensor& grads, const TensorTable& table) override {
    grad_sum_of_squares(sum_of_squares, grads, table);
  }
  void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum, float loss_divisor,
                     double max_grad_norm) override {
    decide_step(*control, *sum_of_squares, *loss_sum, loss_divisor, max_grad_norm);
  }
  void set_step_control(StepControl* control, const StepControl& value) override { *control = value; }
  void adamw_moment_amaxes(const AdamWCall& call) override {
    if (call.control->skip || call.precision != OptimizerStatePrecision::fp8_fp16) return;
    moment_amaxes(call, call.control->grad_scale);
  }
  // The parts' amaxes are running maxima over their tensors; the norm is taken at the end, over
  // every tensor at once (the CPU runs the parts in order anyway).
  void adamw_first_pass_begin(const AdamWCall& call) override {
    check_first_pass(call);
    std::fill(call.scratch, call.scratch + 2 * call.table->layout().tensors().size(), 0.0f);
  }
  void adamw_first_pass_part(const AdamWCall& call, TensorRange tensors, Lane) override {
    check_first_pass(call);
    const TensorLayout& layout = call.table->layout();
    FP8LM_CHECK(tensors.first <= tensors.end && tensors.end <= layout.tensors().size(),
                "AdamW's first pass: tensors [", tensors.first, ", ", tensors.end, ") outside the table");
    check_adamw_hyperparams(call.hyperparams);
    cpu::adamw_moment_amaxes(layout, f32(call.grads), call.state, call.hyperparams,
                             std::max<int64_t>(call.control->step_count, 1), /*grad_scale=*/1.0f, call.scratch,
                             nullptr, tensors.first, tensors.end);
  }
  void adamw_first_pass_finish(const AdamWCall& call, double* sum_of_squares) override {
    check_first_pass(call);
    grad_sum_of_squares(sum_of_squares, call.grads, *call.table);
  }
  void adamw_moment_amaxes_if_clipped(const AdamWCall& call) override {
    if (call.control->skip || call.control->grad_scale == 1.0f) return;
    moment_amaxes(call, call.control->grad_scale);
  }
  void adamw_apply(const AdamWCall& call) override {
    check_adamw_hyperparams(call.hyperparams);
    update_parameters(call);
    if (!call.weight_casts) return;
    // The specification of the fused casts: each operand quantized from its master tensor
    // after the update (or after a skipped one), as a separate cast would be.
    FP8LM_CHECK(call.slab_table == nullptr, "AdamW weight casts need every tensor whole (no sharded state)");
    const TensorLayout& layout = call.table->layout();
    for (const WeightOperand& w : call.weight_casts->operands()) {
      Tensor master;
      master.data = call.master + layout.tensors()[size_t(w.tensor)].offset;
      master.rows = w.operand.rows;
      master.cols = w.operand.cols;
      quantize(w.operand, master, Tensor{}, Lane::main);
    }
  }

 private:
  void update_parameters(const AdamWCall& call) {
    if (call.control->skip) return;
    const TensorLayout& layout = call.table->layout();
    cpu::adamw_apply(layout, call.precision, call.master, f32(call.grads), call.state, call.hyperparams,
                     call.control->step_count, call.control->grad_scale, call.scratch, slab_layout(call));
    if (call.working == nullptr || call.working == call.master) return;
    // A separate working copy (sharded state: this rank's values, where they will be gathered;
    // or one without the FP8 Linear weights, at its own offsets).
    FP8LM_CHECK(call.working_offsets == nullptr || call.slab_table == nullptr,
                "AdamW: a working copy with offsets of its own is for unsharded state");
    float* working = static_cast<float*>(call.working);
    const TensorLayout& working_layout = call.slab_table ? call.slab_table->layout() : layout;
    for (size_t k = 0; k < layout.tensors().size(); ++k) {
      const TensorInfo& t = layout.tensors()[k];
      const uint64_t offset = call.working_offsets ? call.working_offsets[k] : working_layout.tensors()[k].offset;
      if (offset == kNoWorkingValue) continue;
      std::copy(call.master + t.offset, call.master + t.offset + t.numel, working + offset);
    }
  }
  // Pass 1 with `grad_scale` (the bias corrections it does not use come from the step count
  // the step will have if applied).
  void moment_amaxes(const AdamWCall& call, float grad_scale) {
    check_adamw_hyperparams(call.hyperparams);
    const size_t count = call.table->layout().tensors().size();
    std::fill(call.scratch, call.scratch + 2 * count, 0.0f);
    cpu::adamw_moment_amaxes(call.table->layout(), f32(call.grads), call.state, call.hyperparams,
                             std::max<int64_t>(call.control->step_count, 1), grad_scale, call.scratch,
                             slab_layout(call));
  }
  static void check_first_pass(const AdamWCall& call) {
    FP8LM_CHECK(call.precision == OptimizerStatePrecision::fp8_fp16 && call.slab_table == nullptr,
                "AdamW's pass 1 takes the norm for fp8-fp16 state over whole tensors only");
  }
  static const TensorLayout* slab_layout(const AdamWCall& call) {
    return call.slab_table ? &call.slab_table->layout() : nullptr;
  }
  // Writes FP32 values into `out` in its dtype: FP8 with its scaling state (current
  // scaling takes the values' amax now; the amax is recorded for the delayed window when
  // `record`), and its transposed copy when it has one.
  void store(const Tensor& out, const float* values, bool record) {
    const size_t n = size_t(out.numel());
    float* destination = f32(out);
    switch (out.dtype) {
      case DType::f32:
        if (destination != values) std::copy(values, values + n, destination);
        break;
      case DType::bf16:
        cpu::round_bf16(destination, values, n);
        break;
      case DType::e4m3:
      case DType::e5m2: {
        if (block_scaled(out)) {
          store_block_scaled(out, values);
          return;
        }
        FP8LM_CHECK(out.scaling_state >= 0, "an FP8 tensor without a scaling state");
        float tensor_amax = cpu::amax(values, n);
        // A tensor shared by several ranks takes one scale: the amax of all their parts.
        if (amax_group_ && scaling_->needs_tensor_amax(out.scaling_state))
          amax_group_->all_reduce(&tensor_amax, &tensor_amax, 1, CommDtype::f32, ReduceOp::max);
        const float scale = scaling_->scale_for(out.scaling_state, tensor_amax);
        const Fp8Dtype dtype = fp8_dtype_of(out.dtype);
        cpu::quantize_fp8(destination, values, n, scale, dtype);
        if (record) scaling_->record_amax(out.scaling_state, tensor_amax);
        if (record && counting()) count_cast(counting()[out.scaling_state], values, n, scale, dtype);
        break;
      }
    }
    if (out.transposed) cpu::transpose(static_cast<float*>(out.transposed), destination, int(out.rows), int(out.cols));
  }

  // A block-scaled operand (core/block_scaling.h): its codes and tile (block) scales, and
  // its transposed copy. An activation's or gradient's transpose is quantized from the FP32
  // values with its own 1x128 tiles; a weight's holds the same codes, its blocks transposed.
  // No amax is recorded: the recipe keeps no history.
  void store_block_scaled(const Tensor& out, const float* values) {
    const int64_t rows = out.rows, cols = out.cols;
    const Fp8Dtype dtype = fp8_dtype_of(out.dtype);
    const int margin = scaling_->config().margin;
    float* transposed = static_cast<float*>(out.transposed);
    FP8LM_CHECK(out.block_scale_inv && (!transposed || out.transposed_block_scale_inv),
                "a block-scaled FP8 tensor without its scale arrays");
    if (out.block_scaling == BlockScaling::tiles_1x128) {
      cpu::quantize_tiles_1x128(f32(out), out.block_scale_inv, values, rows, cols, dtype, margin);
      if (!transposed) return;
      transpose_b_.resize(size_t(rows) * size_t(cols));
      cpu::transpose(transpose_b_.data(), values, int(rows), int(cols));
      cpu::quantize_tiles_1x128(transposed, out.transposed_block_scale_inv, transpose_b_.data(), cols, rows, dtype,
                                margin);
      return;
    }
    cpu::quantize_blocks_128x128(f32(out), out.block_scale_inv, values, rows, cols, dtype, margin);
    if (!transposed) return;
    cpu::transpose(transposed, f32(out), int(rows), int(cols));
    cpu::transpose_block_scales(out.transposed_block_scale_inv, out.block_scale_inv, rows, cols);
  }

  // The forward GEMM's epilogue: out [M,N] += residual, then + bias, in the GPU's order.
  // A forward GEMM's FP32 sum lands in out, or, under the GELU epilogue, in gelu_input.
  static float* product_of(const GemmCall& call) { return f32(call.gelu_input ? call.gelu_input : call.out); }

  // The forward GEMM's epilogue on its FP32 sum: + residual + bias, or the GELU epilogue
  // (ops.h): gelu of the unrounded sum + bias into out, the sum + bias rounded into gelu_input.
  void add_epilogue(const GemmCall& call, int M, int N) {
    if (call.gelu_input) {
      float* pre = f32(call.gelu_input);
      const float* bias = f32(call.bias);
#pragma omp parallel for schedule(static)
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) pre[size_t(i) * N + j] += bias[j];
      std::vector<float>& activated = scratch(size_t(M) * N);
      cpu::gelu_forward(activated.data(), pre, size_t(M) * N);
      store(call.gelu_input, pre, false);
      store(call.out, activated.data(), recording_);
      return;
    }
    if (!call.bias && !call.residual) return;
    const float* bias = call.bias ? f32(call.bias) : nullptr;
    const float* residual = call.residual ? f32(call.residual) : nullptr;
    float* out = f32(call.out);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) {
        const size_t at = size_t(i) * N + j;
        if (residual) out[at] += residual[at];
        if (bias) out[at] += bias[j];
      }
  }

  static bool block_scaled(const Tensor& t) { return t.block_scaling != BlockScaling::none; }

  // The statistics of casting values [n] with `scale` (the codes quantize_fp8 just wrote,
  // encoded again: the reference counts from the codes, as the GPU kernels do).
  static void count_cast(Fp8CastCounts& counts, const float* values, size_t n, float scale, Fp8Dtype dtype) {
    Fp8CastTally tally;
    for (size_t i = 0; i < n; ++i) {
      const float scaled = values[i] * scale;
      tally.add(values[i], scaled, fp8_encode(scaled, dtype), dtype);
    }
    add_tally(counts, tally, scale);
  }
  // The counts to add to, or nullptr: statistics off, or an evaluation pass.
  Fp8CastCounts* counting() const { return recording_ ? counts_ : nullptr; }

  // 1 outside FP8; the state's scale_inv for an FP8 operand (what cuBLASLt multiplies by).
  float scale_inv(const Tensor& t) const {
    return is_fp8(t.dtype) ? scaling_->scale_inv(t.scaling_state) : 1.0f;
  }

  // t's values transposed, [cols, rows]: its own transposed copy, or one made in `buffer`.
  static const float* transposed(const Tensor& t, std::vector<float>& buffer) {
    if (t.transposed) return static_cast<const float*>(t.transposed);
    buffer.resize(size_t(t.numel()));
    cpu::transpose(buffer.data(), f32(t), int(t.rows), int(t.cols));
    return buffer.data();
  }

  std::vector<float>& scratch(size_t n) {
    scratch_.resize(n);
    return scratch_;
  }

  ScalingTable* scaling_ = nullptr;
  Communicator* amax_group_ = nullptr;
  bool recording_ = true;
  Fp8CastCounts* counts_ = nullptr;  // [states] while a statistics step runs
  std::vector<int32_t> inputs_, targets_;
  DocumentIndex documents_;  // the loaded batch's
  std::vector<int32_t> decode_step_;  // load_decode_step: [B] tokens, then the position
  VocabSlice batch_slice_;
  std::vector<float> scratch_, transpose_a_, transpose_b_;
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops() { return std::make_unique<CpuOps>(); }

}  // namespace fp8lm
