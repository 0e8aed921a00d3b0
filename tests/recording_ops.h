// An Ops that records every op the model and the step call, in order, then forwards it to
// a real backend. Tests use the log to pin the op sequence of a block (and, with the
// recording Communicator of parallel/, where each collective sits between the ops).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/ops.h"

namespace fp8lm::testing {

class RecordingOps final : public Ops {
 public:
  RecordingOps(std::unique_ptr<Ops> inner, std::vector<std::string>& log) : inner_(std::move(inner)), log_(log) {}

  DType activation_dtype() const override { return inner_->activation_dtype(); }
  size_t element_bytes(DType dtype) const override { return inner_->element_bytes(dtype); }
  std::unique_ptr<Allocation> allocate(size_t bytes) override { return inner_->allocate(bytes); }
  std::unique_ptr<HostReadback> make_readback(size_t bytes) override { return inner_->make_readback(bytes); }
  std::unique_ptr<TensorTable> make_table(const TensorLayout& layout) override { return inner_->make_table(layout); }
  void zero(void* data, size_t bytes) override {
    record("zero");
    inner_->zero(data, bytes);
  }
  void copy(void* destination, const void* source, size_t bytes) override {
    record("copy");
    inner_->copy(destination, source, bytes);
  }
  void upload(void* destination, const void* host, size_t bytes) override { inner_->upload(destination, host, bytes); }
  void download(void* host, const void* source, size_t bytes) override { inner_->download(host, source, bytes); }
  void upload_values(const Tensor& destination, const float* host) override {
    inner_->upload_values(destination, host);
  }
  void synchronize() override { inner_->synchronize(); }
  void plan_workspace(const ModelShape& shape) override { inner_->plan_workspace(shape); }
  size_t workspace_bytes() const override { return inner_->workspace_bytes(); }
  size_t device_memory_in_use() const override { return inner_->device_memory_in_use(); }

  void* stream_handle() override { return inner_->stream_handle(); }
  void* side_stream_handle() override { return inner_->side_stream_handle(); }
  std::unique_ptr<LaneEvent> make_event() override { return inner_->make_event(); }
  void record(LaneEvent& event, Lane lane) override { inner_->record(event, lane); }
  void wait(LaneEvent& event, Lane lane) override { inner_->wait(event, lane); }
  void set_amax_group(Communicator* group) override { inner_->set_amax_group(group); }
  float* amax_history_row() override { return inner_->amax_history_row(); }
  const float* scales() override { return inner_->scales(); }
  void tensor_amaxes(float* amaxes, const float* values, const TensorTable& table) override {
    record("tensor_amaxes");
    inner_->tensor_amaxes(amaxes, values, table);
  }
  void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                          float headroom) override {
    record("scales_from_amaxes");
    inner_->scales_from_amaxes(scales, scale_inv, amaxes, count, fp8_max, headroom);
  }
  void quantize_tensors(uint8_t* codes, const float* values, const TensorTable& table, const float* scales,
                        const int* scale_index, float* recorded_amax, Fp8Dtype dtype) override {
    record("quantize_tensors");
    inner_->quantize_tensors(codes, values, table, scales, scale_index, recorded_amax, dtype);
  }
  void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride, const TensorTable& table,
                      const float* scale_inv, Fp8Dtype dtype) override {
    record("sum_fp8_chunks");
    inner_->sum_fp8_chunks(out, chunks, ranks, chunk_stride, table, scale_inv, dtype);
  }
  void to_bf16_bits(uint16_t* out, const float* in, size_t n, Lane lane) override {
    record("to_bf16_bits");
    inner_->to_bf16_bits(out, in, n, lane);
  }
  void from_bf16_bits(float* out, const uint16_t* in, size_t n) override {
    record("from_bf16_bits");
    inner_->from_bf16_bits(out, in, n);
  }
  void fp8_weight_from_codes(const Tensor& operand, const uint8_t* codes) override {
    record("fp8_weight_from_codes");
    inner_->fp8_weight_from_codes(operand, codes);
  }
  void attach_scaling(ScalingTable& table) override { inner_->attach_scaling(table); }
  void download_scaling() override { inner_->download_scaling(); }
  void upload_scaling() override { inner_->upload_scaling(); }
  void set_amax_recording(bool record) override {
    this->record(record ? "amax_recording on" : "amax_recording off");
    inner_->set_amax_recording(record);
  }
  void update_scales(const StepControl* control) override {
    record("update_scales");
    inner_->update_scales(control);
  }
  void set_fp8_statistics(Fp8CastCounts* counts) override {
    record(counts ? "fp8_statistics on" : "fp8_statistics off");
    inner_->set_fp8_statistics(counts);
  }
  void discard_current_amaxes(const StepControl* control) override {
    record("discard_current_amaxes");
    inner_->discard_current_amaxes(control);
  }
  TokenBatch load_batch(const int32_t* inputs, const int32_t* targets, int B, int T, const VocabSlice& slice) override {
    record("load_batch");
    return inner_->load_batch(inputs, targets, B, T, slice);
  }
  void embedding_lookup(const Tensor& out, const TokenBatch& batch, const Tensor& wte,
                        const VocabSlice& slice) override {
    record("embedding_lookup");
    inner_->embedding_lookup(out, batch, wte, slice);
  }
  void add_position_embedding(const Tensor& out, const Tensor& token_embeddings, const Tensor& wpe, int first_row,
                              int T) override {
    record("add_position_embedding");
    inner_->add_position_embedding(out, token_embeddings, wpe, first_row, T);
  }
  void embedding_lookup_backward(const Tensor& dwte, const Tensor& dout, const TokenBatch& batch) override {
    record("embedding_lookup_backward");
    inner_->embedding_lookup_backward(dwte, dout, batch);
  }
  void position_embedding_backward(const Tensor& dwpe, const Tensor& dout, int first_row, int T) override {
    record("position_embedding_backward");
    inner_->position_embedding_backward(dwpe, dout, first_row, T);
  }
  void layernorm_forward(const LayerNormForward& call) override {
    record(std::string(call.branch ? "residual_layernorm" : "layernorm") + " -> " + dtype(call.out));
    inner_->layernorm_forward(call);
  }
  void layernorm_backward(const LayerNormBackward& call) override {
    record("layernorm_backward");
    inner_->layernorm_backward(call);
  }
  void gemm(const GemmCall& call) override {
    static const char* kPass[] = {"forward", "dgrad", "wgrad"};
    std::string line = std::string("gemm ") + kPass[int(call.pass)];
    if (call.pass == GemmPass::forward) line += " " + dtype(call.input) + "x" + dtype(call.weight);
    if (call.pass == GemmPass::dgrad) line += " " + dtype(call.grad) + "x" + dtype(call.weight);
    if (call.pass == GemmPass::wgrad) line += " " + dtype(call.grad) + "x" + dtype(call.input);
    if (call.bias) line += " +bias";
    if (call.residual) line += " +residual";
    record(line);
    inner_->gemm(call);
  }
  void quantize(const Tensor& out, const Tensor& in, const Tensor& dbias) override {
    record(std::string(out.data == in.data ? "view" : "quantize") + " -> " + dtype(out) + (dbias ? " +dbias" : ""));
    inner_->quantize(out, in, dbias);
  }
  void bias_gelu_forward(const Tensor& out, const Tensor& pre, const Tensor& bias) override {
    record("bias_gelu -> " + dtype(out));
    inner_->bias_gelu_forward(out, pre, bias);
  }
  void gelu_backward(const Tensor& dpre, const Tensor& dbias, const Tensor& dout, const Tensor& pre) override {
    record("gelu_backward -> " + dtype(dpre) + (dbias ? " +dbias" : ""));
    inner_->gelu_backward(dpre, dbias, dout, pre);
  }
  void attention_forward(const Tensor& out, const Tensor& operand, const Tensor& lse, const Tensor& qkv,
                         const AttentionShape& shape) override {
    record("attention -> " + dtype(operand));
    inner_->attention_forward(out, operand, lse, qkv, shape);
  }
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttentionShape& shape) override {
    record("attention_backward");
    inner_->attention_backward(dqkv, dout, qkv, out, lse, shape);
  }
  void kv_cache_append(const KvCache& cache, const Tensor& qkv, const AttentionShape& shape, int position) override {
    record("kv_cache_append -> " + dtype(cache.keys));
    inner_->kv_cache_append(cache, qkv, shape, position);
  }
  void attention_decode(const Tensor& out, const Tensor& operand, const Tensor& qkv, const KvCache& cache,
                        const AttentionShape& shape, int length) override {
    record("attention_decode -> " + dtype(operand));
    inner_->attention_decode(out, operand, qkv, cache, shape, length);
  }
  void download_values(float* host, const Tensor& source) override { inner_->download_values(host, source); }
  void cross_entropy_partials(const Tensor& partials, const Tensor& logits, const TokenBatch& batch,
                              const VocabSlice& slice) override {
    record("cross_entropy_partials");
    inner_->cross_entropy_partials(partials, logits, batch, slice);
  }
  void cross_entropy_finish(const Tensor& logits, const Tensor& losses, const Tensor& all_partials, int ranks,
                            const TokenBatch& batch, const VocabSlice& slice, float dloss) override {
    record("cross_entropy_finish");
    inner_->cross_entropy_finish(logits, losses, all_partials, ranks, batch, slice, dloss);
  }
  void accumulate_loss(const Tensor& loss_sum, const Tensor& losses) override {
    record("accumulate_loss");
    inner_->accumulate_loss(loss_sum, losses);
  }
  void grad_sum_of_squares(double* sum_of_squares, const float* grads, const TensorTable& table) override {
    record("grad_sum_of_squares");
    inner_->grad_sum_of_squares(sum_of_squares, grads, table);
  }
  void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum, float loss_divisor,
                     double max_grad_norm) override {
    record("finalize_step");
    inner_->finalize_step(control, sum_of_squares, loss_sum, loss_divisor, max_grad_norm);
  }
  void set_step_control(StepControl* control, const StepControl& value) override {
    inner_->set_step_control(control, value);
  }
  void adamw_moment_amaxes(const AdamWCall& call) override {
    record("adamw_moment_amaxes");
    inner_->adamw_moment_amaxes(call);
  }
  void adamw_apply(const AdamWCall& call) override {
    record("adamw_apply");
    inner_->adamw_apply(call);
  }

 private:
  static std::string dtype(const Tensor& t) { return std::string(to_string(t.dtype)); }
  void record(const std::string& line) { log_.push_back(line); }

  std::unique_ptr<Ops> inner_;
  std::vector<std::string>& log_;
};

}  // namespace fp8lm::testing
