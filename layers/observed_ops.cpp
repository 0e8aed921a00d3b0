#include "layers/observed_ops.h"

#include <string_view>

namespace fp8lm {
namespace {

class ObservedOps final : public Ops {
 public:
  ObservedOps(std::unique_ptr<Ops> inner, std::unique_ptr<OpObserver> observer)
      : inner_(std::move(inner)), observer_(std::move(observer)) {
    observer_->attach(*inner_);
  }

  // ---- Memory: allocation and transfers are set-up, not steps' work (zero and copy are).
  DType activation_dtype() const override { return inner_->activation_dtype(); }
  size_t element_bytes(DType dtype) const override { return inner_->element_bytes(dtype); }
  std::unique_ptr<Allocation> allocate(size_t bytes) override { return inner_->allocate(bytes); }
  std::unique_ptr<HostReadback> make_readback(size_t bytes) override { return inner_->make_readback(bytes); }
  std::unique_ptr<TensorTable> make_table(const TensorLayout& layout) override { return inner_->make_table(layout); }
  std::unique_ptr<WeightCastTable> make_weight_casts(const TensorTable& table,
                                                     const std::vector<WeightOperand>& operands) override {
    return inner_->make_weight_casts(table, operands);
  }
  void zero(void* data, size_t bytes) override {
    observed({"memory", Lane::main, [] { return std::string("zero"); }, [&] { return OpCost{0, double(bytes)}; }},
             [&] { inner_->zero(data, bytes); });
  }
  void copy(void* destination, const void* source, size_t bytes) override {
    observed({"memory", Lane::main, [] { return std::string("copy"); }, [&] { return OpCost{0, 2.0 * bytes}; }},
             [&] { inner_->copy(destination, source, bytes); });
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

  // ---- FP8 scaling
  void attach_scaling(ScalingTable& table) override { inner_->attach_scaling(table); }
  void download_scaling() override { inner_->download_scaling(); }
  void upload_scaling() override { inner_->upload_scaling(); }
  void set_amax_recording(AmaxRecording recording) override {
    switched(recording == AmaxRecording::on    ? "amax_recording on"
             : recording == AmaxRecording::off ? "amax_recording off"
                                               : "amax_recording off, any GEMM plan");
    inner_->set_amax_recording(recording);
  }
  void update_scales(const StepControl* control) override {
    observed(named("scaling", "update_scales"), [&] { inner_->update_scales(control); });
  }
  void discard_current_amaxes(const StepControl* control) override {
    observed(named("scaling", "discard_current_amaxes"), [&] { inner_->discard_current_amaxes(control); });
  }
  void set_fp8_statistics(Fp8CastCounts* counts) override {
    switched(counts ? "fp8_statistics on" : "fp8_statistics off");
    inner_->set_fp8_statistics(counts);
  }

  // ---- Parallel runs and lanes
  void* stream_handle() override { return inner_->stream_handle(); }
  void set_amax_group(Communicator* group) override { inner_->set_amax_group(group); }
  float* amax_history_row() override { return inner_->amax_history_row(); }
  const float* scales() override { return inner_->scales(); }
  void* side_stream_handle() override { return inner_->side_stream_handle(); }
  std::unique_ptr<LaneEvent> make_event() override { return inner_->make_event(); }
  void record(LaneEvent& event, Lane lane) override { inner_->record(event, lane); }
  void wait(LaneEvent& event, Lane lane) override { inner_->wait(event, lane); }
  std::unique_ptr<LaneEvent> make_timing_event() override { return inner_->make_timing_event(); }
  double elapsed_ms(LaneEvent& start, LaneEvent& end) override { return inner_->elapsed_ms(start, end); }

  // ---- Slabs of the parameter layout
  void tensor_amaxes(float* amaxes, const float* values, const TensorTable& table, Lane lane) override {
    observed(per_element("optimizer", "tensor_amaxes", table, 4.0, lane),
             [&] { inner_->tensor_amaxes(amaxes, values, table, lane); });
  }
  void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                          float headroom, Lane lane) override {
    observed(named("optimizer", "scales_from_amaxes", lane),
             [&] { inner_->scales_from_amaxes(scales, scale_inv, amaxes, count, fp8_max, headroom, lane); });
  }
  void quantize_tensors(uint8_t* codes, const float* values, const TensorTable& table, const float* scales,
                        const int* scale_index, float* recorded_amax, Fp8Dtype dtype, Lane lane) override {
    observed(per_element("cast", "quantize_tensors", table, 4.0 + 1.0, lane),
             [&] { inner_->quantize_tensors(codes, values, table, scales, scale_index, recorded_amax, dtype, lane); });
  }
  void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride, const TensorTable& table,
                      const float* scale_inv, Fp8Dtype dtype, Lane lane) override {
    observed(per_element("cast", "sum_fp8_chunks", table, ranks + 4.0, lane),
             [&] { inner_->sum_fp8_chunks(out, chunks, ranks, chunk_stride, table, scale_inv, dtype, lane); });
  }
  void round_to_dtype(const Tensor& values, Lane lane) override {
    // Moves bytes only where the storage is wider than the dtype (the CPU); the GPU does nothing.
    observed({"cast", lane, [] { return std::string("round_to_dtype"); }, [] { return OpCost{}; }},
             [&] { inner_->round_to_dtype(values, lane); });
  }
  void fp8_weight_from_codes(const Tensor& operand, const uint8_t* codes) override {
    observed({"cast", Lane::main, [] { return std::string("fp8_weight_from_codes"); },
              [&] { return OpCost{0, double(operand.numel()) + written(operand)}; }},
             [&] { inner_->fp8_weight_from_codes(operand, codes); });
  }

  // ---- Tokens and embedding
  TokenBatch load_batch(const int32_t* inputs, const int32_t* targets, int B, int T, const VocabSlice& slice,
                        const DocumentMasking& documents = {}) override {
    TokenBatch batch;
    observed({"tokens", Lane::main, [] { return std::string("load_batch"); },
              [&] { return OpCost{0, (5.0 + 3.0 * documents.any()) * 4.0 * B * T}; }},
             [&] { batch = inner_->load_batch(inputs, targets, B, T, slice, documents); });
    return batch;
  }
  TokenBatch load_decode_step(const int32_t* tokens, int B, int position, const VocabSlice& slice) override {
    TokenBatch batch;
    observed({"tokens", Lane::main, [] { return std::string("load_decode_step"); },
              [&] { return OpCost{0, 4.0 * (B + 1)}; }},
             [&] { batch = inner_->load_decode_step(tokens, B, position, slice); });
    return batch;
  }
  // The recorded ops are the observed ones (the sequence calls this object); the observer sees
  // them once, while they are recorded, not at each replay.
  std::unique_ptr<RecordedOps> record_ops(const std::function<void()>& ops_sequence) override {
    return inner_->record_ops(ops_sequence);
  }
  void embedding_lookup(const Tensor& out, const TokenBatch& batch, const Tensor& wte,
                        const VocabSlice& slice) override {
    observed({"embedding", Lane::main, [] { return std::string("embedding_lookup"); },
              [&] { return OpCost{0, 2.0 * bytes(out)}; }},
             [&] { inner_->embedding_lookup(out, batch, wte, slice); });
  }
  void add_position_embedding(const Tensor& out, const Tensor& token_embeddings, const Tensor& wpe, int first_row,
                              int T, const int32_t* stored_wpe_row, const int32_t* position_ids) override {
    observed({"embedding", Lane::main, [] { return std::string("add_position_embedding"); },
              [&] { return OpCost{0, bytes(out) + bytes(token_embeddings) + double(T) * wpe.cols * element_bytes(wpe.dtype)}; }},
             [&] {
               inner_->add_position_embedding(out, token_embeddings, wpe, first_row, T, stored_wpe_row, position_ids);
             });
  }
  void embedding_lookup_backward(const Tensor& dwte, const Tensor& dout, const TokenBatch& batch) override {
    observed({"embedding", Lane::main, [] { return std::string("embedding_lookup_backward"); },
              [&] { return OpCost{0, 3.0 * bytes(dout)}; }},
             [&] { inner_->embedding_lookup_backward(dwte, dout, batch); });
  }
  void position_embedding_backward(const Tensor& dwpe, const Tensor& dout, int first_row, int T,
                                   const TokenBatch& batch) override {
    observed({"embedding", Lane::main, [] { return std::string("position_embedding_backward"); },
              [&] { return OpCost{0, bytes(dout) + 2.0 * bytes(dwpe)}; }},
             [&] { inner_->position_embedding_backward(dwpe, dout, first_row, T, batch); });
  }

  // ---- LayerNorm
  void layernorm_forward(const LayerNormForward& call) override {
    observed({"layernorm forward", Lane::main,
              [&] { return std::string(call.branch ? "residual_layernorm" : "layernorm") + " -> " + name(call.out); },
              [&] {
                return OpCost{0, bytes(call.residual_in) + bytes(call.branch) + written(call.out) +
                                     (call.branch ? bytes(call.residual_out) : 0.0) + bytes(call.mean) + bytes(call.rstd)};
              }},
             [&] { inner_->layernorm_forward(call); });
  }
  void layernorm_backward(const LayerNormBackward& call) override {
    observed({"layernorm backward", Lane::main, [] { return std::string("layernorm_backward"); },
              [&] { return OpCost{0, bytes(call.dout) + bytes(call.input) + 2.0 * bytes(call.dresidual)}; }},
             [&] { inner_->layernorm_backward(call); });
  }
  void layernorm_operand(const LayerNormOperand& call) override {
    observed({"layernorm backward", Lane::main, [&] { return "layernorm_operand -> " + name(call.out); },
              // the transposed copy only (the GPU's; the reference also writes the codes)
              [&] { return OpCost{0, bytes(call.input) + bytes(call.out)}; }},
             [&] { inner_->layernorm_operand(call); });
  }

  // ---- GEMM and casts
  void gemm(const GemmCall& call) override {
    observed({gemm_class(call), Lane::main, [&] { return gemm_line(call); }, [&] { return gemm_cost(call); }},
             [&] { inner_->gemm(call); });
  }
  void requantize_transposed(const Tensor& out, const Tensor& in) override {
    observed({"cast", Lane::main, [&] { return "requantize_transposed -> " + name(out); },
              // the transposed copy only (the GPU's; the reference also writes the codes)
              [&] { return OpCost{0, bytes(in) + bytes(out)}; }},
             [&] { inner_->requantize_transposed(out, in); });
  }
  void transpose_operand(const Tensor& operand) override {
    observed({"cast", Lane::main, [&] { return "transpose -> " + name(operand); },
              [&] { return OpCost{0, 2.0 * bytes(operand)}; }},
             [&] { inner_->transpose_operand(operand); });
  }
  void quantize(const Tensor& out, const Tensor& in, const Tensor& dbias, Lane lane) override {
    const bool view = out.data == in.data;
    observed({"cast", lane,
              [&] { return std::string(view ? "view" : "quantize") + " -> " + name(out) + (dbias ? " +dbias" : ""); },
              [&] { return OpCost{0, bytes(in) + (view ? 0.0 : written(out))}; }},
             [&] { inner_->quantize(out, in, dbias, lane); });
  }

  // ---- MLP
  void gelu_backward(const GeluBackward& call) override {
    observed({"gelu backward", Lane::main,
              [&] {
                return "gelu_backward -> " + name(call.dpre) + (call.dbias ? " +dbias" : "") +
                       (call.recomputed_output ? " +recomputed " + name(call.recomputed_output) : "");
              },
              [&] {
                // The recomputed output: its transposed copy only (the GPU's; the reference also writes the codes).
                const double recomputed = call.recomputed_output ? bytes(call.recomputed_output) : 0.0;
                return OpCost{0, bytes(call.dout) + bytes(call.pre) + written(call.dpre) + recomputed};
              }},
             [&] { inner_->gelu_backward(call); });
  }

  // ---- Attention
  void attention_forward(const Tensor& out, const Tensor& operand, const Tensor& lse, const Tensor& qkv,
                         const AttentionShape& shape) override {
    observed({"attention forward", Lane::main, [&] { return "attention -> " + name(operand); },
              [&] {
                return OpCost{causal_attention_flops(shape), bytes(qkv) + bytes(out) + bytes(lse) +
                                                                 (operand.data == out.data ? 0.0 : bytes(operand))};
              }},
             [&] { inner_->attention_forward(out, operand, lse, qkv, shape); });
  }
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttentionShape& shape) override {
    observed({"attention backward", Lane::main, [] { return std::string("attention_backward"); },
              [&] {
                return OpCost{2.5 * causal_attention_flops(shape),
                              bytes(dqkv) + bytes(dout) + bytes(qkv) + bytes(out) + bytes(lse)};
              }},
             [&] { inner_->attention_backward(dqkv, dout, qkv, out, lse, shape); });
  }
  // The "attention backward" class includes the cast of dqkv here: the CUDA backend fuses it.
  void attention_backward_to_operand(const AttentionBackwardToOperand& call) override {
    const bool view = call.operand.data == call.dqkv.data;
    observed({"attention backward", Lane::main,
              [&] {
                return "attention_backward -> " + name(call.operand) + (call.dbias ? " +dbias" : "");
              },
              [&] {
                return OpCost{2.5 * causal_attention_flops(call.shape),
                              (view ? bytes(call.dqkv) : written(call.operand)) + bytes(call.dout) + bytes(call.qkv) +
                                  bytes(call.out) + bytes(call.lse)};
              }},
             [&] { inner_->attention_backward_to_operand(call); });
  }

  // ---- Incremental decoding
  void kv_cache_append(const KvCache& cache, const Tensor& qkv, const AttentionShape& shape,
                       CachePosition position) override {
    observed({"kv cache", Lane::main, [&] { return "kv_cache_append -> " + name(cache.keys); },
              [&] { return OpCost{0, bytes(qkv)}; }},
             [&] { inner_->kv_cache_append(cache, qkv, shape, position); });
  }
  void attention_decode(const Tensor& out, const Tensor& operand, const Tensor& qkv, const KvCache& cache,
                        const AttentionShape& shape, CachePosition position) override {
    observed({"attention decode", Lane::main, [&] { return "attention_decode -> " + name(operand); },
              [&] {
                const int length = position.value + 1;
                const double cached = 2.0 * shape.B * double(length) * shape.width() * element_bytes(cache.keys.dtype);
                return OpCost{4.0 * shape.B * double(length) * shape.width(), cached + bytes(qkv) + bytes(out)};
              }},
             [&] { inner_->attention_decode(out, operand, qkv, cache, shape, position); });
  }
  void download_values(float* host, const Tensor& source) override { inner_->download_values(host, source); }
  void choose_next_tokens(const Tensor& logits, int B, const VocabSlice& slice, const SamplingOptions& rule,
                          CachePosition position, const DecodingTokens& tokens) override {
    observed({"sampling", Lane::main, [] { return std::string("choose_next_tokens"); },
              [&] { return OpCost{0, double(B) * slice.size * element_bytes(logits.dtype)}; }},
             [&] { inner_->choose_next_tokens(logits, B, slice, rule, position, tokens); });
  }

  // ---- Loss
  void cross_entropy(const Tensor& logits, const Tensor& losses, const TokenBatch& batch, const VocabSlice& slice,
                     float dloss) override {
    observed({"loss", Lane::main, [] { return std::string("cross_entropy"); },
              [&] { return OpCost{0, 2.0 * bytes(logits) + bytes(losses)}; }},
             [&] { inner_->cross_entropy(logits, losses, batch, slice, dloss); });
  }
  void cross_entropy_to_fp8(const Tensor& logits, const Tensor& losses, const TokenBatch& batch,
                            const VocabSlice& slice, float dloss, const Tensor& codes) override {
    observed({"loss", Lane::main, [&] { return "cross_entropy -> " + name(codes); },
              [&] { return OpCost{0, bytes(logits) + bytes(losses) + written(codes)}; }},
             [&] { inner_->cross_entropy_to_fp8(logits, losses, batch, slice, dloss, codes); });
  }
  void cross_entropy_partials(const Tensor& partials, const Tensor& logits, const TokenBatch& batch,
                              const VocabSlice& slice) override {
    observed({"loss", Lane::main, [] { return std::string("cross_entropy_partials"); },
              [&] { return OpCost{0, bytes(logits) + bytes(partials)}; }},
             [&] { inner_->cross_entropy_partials(partials, logits, batch, slice); });
  }
  void cross_entropy_finish(const Tensor& logits, const Tensor& losses, const Tensor& all_partials, int ranks,
                            const TokenBatch& batch, const VocabSlice& slice, float dloss) override {
    observed({"loss", Lane::main, [] { return std::string("cross_entropy_finish"); },
              [&] { return OpCost{0, 2.0 * bytes(logits) + bytes(all_partials) + bytes(losses)}; }},
             [&] { inner_->cross_entropy_finish(logits, losses, all_partials, ranks, batch, slice, dloss); });
  }
  void accumulate_loss(const Tensor& loss_sum, const Tensor& losses) override {
    observed({"loss", Lane::main, [] { return std::string("accumulate_loss"); },
              [&] { return OpCost{0, bytes(losses)}; }},
             [&] { inner_->accumulate_loss(loss_sum, losses); });
  }

  // ---- The optimizer step
  void grad_sum_of_squares(double* sum_of_squares, const Tensor& grads, const TensorTable& table) override {
    observed(per_element("optimizer", "grad_sum_of_squares", table, double(element_bytes(grads.dtype))),
             [&] { inner_->grad_sum_of_squares(sum_of_squares, grads, table); });
  }
  void grad_sum_of_squares_part(const Tensor& grads, const TensorTable& table, TensorRange tensors,
                                Lane lane) override {
    const TensorLayout& layout = table.layout();
    double elements = 0.0;
    for (size_t k = tensors.first; k < tensors.end && k < layout.tensors().size(); ++k)
      elements += double(layout.tensors()[k].numel);
    observed({"optimizer", lane,
              [&] {
                return "grad_sum_of_squares, tensors " + std::to_string(tensors.first) + ".." +
                       std::to_string(tensors.end);
              },
              [&] { return OpCost{0, elements * double(element_bytes(grads.dtype))}; }},
             [&] { inner_->grad_sum_of_squares_part(grads, table, tensors, lane); });
  }
  void grad_sum_of_squares_finish(double* sum_of_squares, const Tensor& grads, const TensorTable& table) override {
    observed(named("optimizer", "grad_sum_of_squares finish"),
             [&] { inner_->grad_sum_of_squares_finish(sum_of_squares, grads, table); });
  }
  void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum, float loss_divisor,
                     double max_grad_norm) override {
    observed(named("optimizer", "finalize_step"),
             [&] { inner_->finalize_step(control, sum_of_squares, loss_sum, loss_divisor, max_grad_norm); });
  }
  void set_step_control(StepControl* control, const StepControl& value) override {
    inner_->set_step_control(control, value);
  }
  void adamw_moment_amaxes(const AdamWCall& call) override {
    // Reads the gradient and both moments.
    observed(per_element("optimizer", "adamw_moment_amaxes", *call.table, gradient_bytes(call) + moment_bytes(call)),
             [&] { inner_->adamw_moment_amaxes(call); });
  }
  void adamw_first_pass_begin(const AdamWCall& call) override {
    observed(named("optimizer", "adamw first pass begin"), [&] { inner_->adamw_first_pass_begin(call); });
  }
  void adamw_first_pass_part(const AdamWCall& call, TensorRange tensors, Lane lane) override {
    // Reads the gradient and both moments once: the norm's read and pass 1's.
    const TensorLayout& layout = call.table->layout();
    const bool whole = tensors.first == 0 && tensors.end == layout.tensors().size();
    double elements = 0.0;
    for (size_t k = tensors.first; k < tensors.end && k < layout.tensors().size(); ++k)
      elements += double(layout.tensors()[k].numel);
    const double bytes = elements * (gradient_bytes(call) + moment_bytes(call));
    observed({"optimizer", lane,
              [&] {
                return whole ? std::string("adamw_moment_amaxes + norm")
                             : "adamw_moment_amaxes + norm, tensors " + std::to_string(tensors.first) + ".." +
                                   std::to_string(tensors.end);
              },
              [&] { return OpCost{0, bytes}; }},
             [&] { inner_->adamw_first_pass_part(call, tensors, lane); });
  }
  void adamw_first_pass_finish(const AdamWCall& call, double* sum_of_squares) override {
    observed(named("optimizer", "adamw first pass finish"),
             [&] { inner_->adamw_first_pass_finish(call, sum_of_squares); });
  }
  void adamw_moment_amaxes_if_clipped(const AdamWCall& call) override {
    // Nothing unless the step clips (then pass 1 again); the profile counts no bytes.
    observed(named("optimizer", "adamw_moment_amaxes if clipped"), [&] { inner_->adamw_moment_amaxes_if_clipped(call); });
  }
  void adamw_apply(const AdamWCall& call) override {
    // Reads the gradient; reads and writes the master weight and both moments; writes the
    // working copy, and the FP8 weights and their transposes it casts (one byte each).
    const double working = call.working ? double(element_bytes(activation_dtype())) : 0.0;
    const PerElement update = per_element("optimizer", "adamw_apply", *call.table,
                                          gradient_bytes(call) + 2.0 * (4.0 + moment_bytes(call)) + working);
    const size_t casts = call.weight_casts ? call.weight_casts->operands().size() : 0;
    const double cast_bytes = call.weight_casts ? 2.0 * double(call.weight_casts->elements()) : 0.0;
    observed({update.op_class, update.lane,
              [&] { return casts ? "adamw_apply + " + std::to_string(casts) + " FP8 weights" : std::string("adamw_apply"); },
              [&] { return OpCost{0, update.elements * update.bytes_per_element + cast_bytes}; }},
             [&] { inner_->adamw_apply(call); });
  }

 private:
  // An event whose cost is `bytes_per_element` over every element of `table`.
  struct PerElement {
    const char* op_class;
    const char* op_name;
    double elements;
    double bytes_per_element;
    Lane lane = Lane::main;
  };

  void observed(const OpEvent& event, FunctionRef<void()> work) {
    observer_->before(event);
    work();
    observer_->after(event);
  }
  void observed(const PerElement& op, FunctionRef<void()> work) {
    observed({op.op_class, op.lane, [&] { return std::string(op.op_name); },
              [&] { return OpCost{0, op.elements * op.bytes_per_element}; }},
             work);
  }
  // A switch: reported to the observer, but no work to time.
  void switched(const char* line) {
    // Named, because an event keeps references to its callables only.
    const auto describe = [&] { return std::string(line); };
    const auto cost = [] { return OpCost{}; };
    const OpEvent event{nullptr, Lane::main, describe, cost};
    observer_->before(event);
    observer_->after(event);
  }
  static PerElement named(const char* op_class, const char* op_name, Lane lane = Lane::main) {
    return {op_class, op_name, 0.0, 0.0, lane};
  }
  // Over the table's tensors, not its extent: a table of this rank's pieces at their slab
  // positions (the distributed optimizer's) spans the whole slab but covers a shard of it.
  static PerElement per_element(const char* op_class, const char* op_name, const TensorTable& table,
                                double bytes_per_element, Lane lane = Lane::main) {
    return {op_class, op_name, double(table.layout().count_parameters()), bytes_per_element, lane};
  }

  double bytes(const Tensor& t) const { return t ? double(t.numel()) * double(element_bytes(t.dtype)) : 0.0; }
  // An output, with its transposed copy when it carries one.
  double written(const Tensor& t) const { return bytes(t) * (t.transposed ? 2.0 : 1.0); }
  static std::string name(const Tensor& t) { return std::string(to_string(t.dtype)); }
  // The gradient slab's bytes per element: FP32, or BF16 under --grad-reduce-in-bf16.
  double gradient_bytes(const AdamWCall& call) const { return double(element_bytes(call.grads.dtype)); }
  static double moment_bytes(const AdamWCall& call) {
    return call.precision == OptimizerStatePrecision::fp8_fp16 ? 1.0 + 2.0 : 4.0 + 4.0;
  }
  // Q K^T and P V over the causal half of the [T, T] scores, per head.
  static double causal_attention_flops(const AttentionShape& shape) {
    return 2.0 * 2.0 * shape.B * shape.heads * double(shape.T) * shape.T * shape.head_size / 2.0;
  }

  static const Tensor& first_operand(const GemmCall& call) {
    return call.pass == GemmPass::forward ? call.input : call.grad;
  }
  static const char* gemm_class(const GemmCall& call) {
    static constexpr const char* kClasses[3][3] = {
        {"gemm fp8 forward", "gemm fp8 dgrad", "gemm fp8 wgrad"},
        {"gemm bf16 forward", "gemm bf16 dgrad", "gemm bf16 wgrad"},
        {"gemm fp32 forward", "gemm fp32 dgrad", "gemm fp32 wgrad"}};
    const DType dtype = first_operand(call).dtype;
    const int precision = is_fp8(dtype) ? 0 : dtype == DType::bf16 ? 1 : 2;
    return kClasses[precision][int(call.pass)];
  }
  static std::string gemm_line(const GemmCall& call) {
    static const char* kPass[] = {"forward", "dgrad", "wgrad"};
    std::string line = std::string("gemm ") + kPass[int(call.pass)];
    if (call.pass == GemmPass::forward) line += " " + name(call.input) + "x" + name(call.weight);
    if (call.pass == GemmPass::dgrad) line += " " + name(call.grad) + "x" + name(call.weight);
    if (call.pass == GemmPass::wgrad) line += " " + name(call.grad) + "x" + name(call.input);
    if (call.bias) line += " +bias";
    if (call.residual) line += " +residual";
    if (call.gelu_input) line += " +gelu -> " + name(call.out);
    if (call.promote_partial_sums) line += " promoted";
    return line;
  }
  OpCost gemm_cost(const GemmCall& call) const {
    // out [rows, cols] is the product of an inner dimension K.
    const Tensor& a = first_operand(call);
    const double inner = call.pass == GemmPass::forward ? double(call.input.cols)
                         : call.pass == GemmPass::dgrad ? double(call.grad.cols)
                                                        : double(call.grad.rows);
    const double b_bytes = call.pass == GemmPass::wgrad ? bytes(call.input) : bytes(call.weight);
    const double out_bytes = (call.pass == GemmPass::wgrad && call.accumulate ? 2.0 : 1.0) * bytes(call.out);
    return OpCost{2.0 * double(call.out.rows) * double(call.out.cols) * inner,
                  bytes(a) + b_bytes + out_bytes + bytes(call.bias) + bytes(call.residual) + bytes(call.gelu_input)};
  }

  std::unique_ptr<Ops> inner_;
  std::unique_ptr<OpObserver> observer_;
};

}  // namespace

std::unique_ptr<Ops> make_observed_ops(std::unique_ptr<Ops> inner, std::unique_ptr<OpObserver> observer) {
  return std::make_unique<ObservedOps>(std::move(inner), std::move(observer));
}

}  // namespace fp8lm
