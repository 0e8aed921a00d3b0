// The Ops interface: every piece of work the GPT model and its training step do, at the
// granularity of the GPU's fused kernels. The model (layers/gpt.h) and the step
// (apps/engine.h) are written once against it; two backends implement it:
//
//   CpuOps  (layers/ops_cpu.h)   plain reference loops, the readable specification. FP8 is
//                                emulated exactly: FP8 tensors hold the quantized values.
//   CudaOps (layers/ops_cuda.h)  the fused kernels and cuBLASLt, on one stream, never
//                                waiting for the host inside a step.
//
// Precision and recipe live in the operands, not in the model: an op looks at its output
// tensor's dtype (an FP8 operand with a scaling state, or the activation dtype) and at the
// scaling table's recipe to decide whether it also casts, records an amax, or first takes
// the tensor's own amax (current scaling). A GEMM operand whose dtype is the activation
// dtype is a plain view of the activation: nothing is cast.
//
// Shapes: B micro-batch, T sequence, C width, F MLP width, V vocabulary, Vs this rank's
// vocabulary slice (the whole padded vocabulary without tensor parallelism). Every
// pointer is backend memory (host for CpuOps, device for CudaOps). `=` writes, `+=`
// accumulates.
//
// Parameter gradients (dweight, dbias, dwte, dwpe, a wgrad GEMM's out) take the gradient
// slab's dtype: f32, or bf16 under --grad-reduce-in-bf16. An op sums its contribution in
// FP32 and adds it to the gradient once, so a BF16 gradient is rounded once per op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/fp8_stats.h"
#include "core/scaling.h"
#include "core/tensor.h"
#include "layers/documents.h"
#include "layers/sampling.h"
#include "optim/adamw.h"
#include "optim/step_control.h"

namespace fp8lm {

class Communicator;

// Backend memory, zero-filled at allocation, freed with the object.
class Allocation {
 public:
  virtual ~Allocation() = default;
  virtual void* data() = 0;
  virtual size_t bytes() const = 0;
};

// A copy of a small backend buffer on the host, taken in stream order: capture() never
// waits, wait() does, ready() only looks.
class HostReadback {
 public:
  virtual ~HostReadback() = default;
  virtual void capture(const void* source) = 0;
  virtual bool ready() = 0;
  virtual const void* wait() = 0;
};

// Ops recorded once and run again as recorded (Ops::record_ops): a CUDA graph on the GPU.
class RecordedOps {
 public:
  virtual ~RecordedOps() = default;
  virtual void replay() = 0;
};

// This rank's slice of the padded vocabulary: columns [begin, begin + size); real
// tokens are those below vocab_size.
struct VocabSlice {
  int begin = 0;
  int size = 0;        // Vs
  int vocab_size = 0;  // V (unpadded)
};

// Ops::cross_entropy's precondition: one rank holds the whole vocabulary, the logits' width.
inline void check_whole_vocabulary(const VocabSlice& slice, const Tensor& logits) {
  FP8LM_CHECK(slice.begin == 0 && slice.size == static_cast<int>(logits.cols) && slice.vocab_size <= slice.size,
              "cross_entropy needs the whole vocabulary: slice [", slice.begin, ", +", slice.size, ") of ",
              slice.vocab_size, " over logits of width ", logits.cols);
}

// A micro-batch's tokens in backend memory, plus what the deterministic embedding
// backward needs (GPU: the positions of each distinct token of the vocabulary slice).
struct TokenBatch {
  int B = 0, T = 0;
  const int32_t* inputs = nullptr;   // [B,T]
  const int32_t* targets = nullptr;  // [B,T]
  // Embedding-backward index (CudaOps; layers/encoder_index.h), tokens of the slice only.
  const int32_t* unique_tokens = nullptr;  // [U] slice-local ids
  const int32_t* offsets = nullptr;        // [U+1]
  const int32_t* positions = nullptr;      // [B*T]
  int num_unique = 0;
  // The micro-batch's documents (layers/documents.h), null where the run does not use them:
  // the attention's document starts (--reset-attention-mask), and the tokens' positions in
  // their documents with the rows grouped by them (--reset-position-ids).
  const int32_t* document_starts = nullptr;   // [B*T]
  const int32_t* position_ids = nullptr;      // [B*T]
  const int32_t* position_offsets = nullptr;  // [T+1]
  const int32_t* position_rows = nullptr;     // [B*T]
  // A decoding step's (load_decode_step): the position of its one token per sequence, in
  // backend memory. The ops read it there rather than the position the model passes, so a
  // step recorded once (Ops::record_ops) replays at every later position.
  const int32_t* step_position = nullptr;  // [1]

  // A decoding step's batch over backend memory holding [B] tokens, then the position.
  static TokenBatch decode_step(const int32_t* memory, int B) {
    TokenBatch batch;
    batch.B = B;
    batch.T = 1;
    batch.inputs = memory;
    batch.targets = memory;
    batch.step_position = memory + B;
    return batch;
  }
};

// Where a decoding chunk's tokens go in the cache: `value` as the host knows it (checked), and
// the same value in backend memory when the chunk is a recorded step's (TokenBatch::step_position).
struct CachePosition {
  int value = 0;
  const int32_t* stored = nullptr;
};

// A TensorLayout in the form the backend's optimizer and norm passes walk.
class TensorTable {
 public:
  virtual ~TensorTable() = default;
  virtual const TensorLayout& layout() const = 0;
};

// LayerNorm with the residual add folded in:
//   residual_out = residual_in + (branch + branch_bias)      (when branch is given)
//   out          = LayerNorm(residual_out) * weight + bias    (out's dtype: FP8 operand or activation)
// Without a branch, residual_in itself is normalized and residual_out is unused.
struct LayerNormForward {
  Tensor out;           // [N,C]
  Tensor mean, rstd;    // [N] f32, saved for backward
  Tensor residual_out;  // [N,C] activation
  Tensor residual_in;   // [N,C] activation
  Tensor branch;        // [N,C] activation, or empty: a row-parallel GEMM's reduced output, no bias
  Tensor branch_bias;   // [C], or empty
  Tensor weight, bias;  // [C]
  float eps = 1e-5f;
};

// dresidual [N,C] += d(input), dweight [C] +=, dbias [C] += from dout [N,C] and the saved
// input [N,C], weight, mean and rstd.
struct LayerNormBackward {
  Tensor dresidual;
  Tensor dweight, dbias;
  Tensor dout;
  Tensor input;
  Tensor weight;
  Tensor mean, rstd;
};

// A LayerNorm's FP8 output again, in the backward, as the wgrad input of the GEMM it fed:
//   out = fp8(bf16((input - mean) * rstd * weight + bias) * out's scale)
// from the forward's input [N,C] and statistics [N], so that the forward's codes need not be
// kept for the backward. out is a per-tensor-scaled FP8 operand [N,C] with its transposed copy:
// the same codes the forward's cast wrote (the same values with the same scale: a delayed scale
// changes only after the step, and a current one is left in its state by the forward), and no
// amax is recorded. The backend writes the form its wgrad GEMM reads: the GPU the transposed
// copy only ([C,N]), the CPU the values and their transpose.
struct LayerNormOperand {
  Tensor out;
  Tensor input;         // [N,C] activation: the LayerNorm's input as the forward normalized it
  Tensor mean, rstd;    // [N] f32, the forward's
  Tensor weight, bias;  // [C]
};

// The three GEMMs of a Linear layer, weight [N,K] (PyTorch's [out, in]):
//   forward  out [M,N]  = input [M,K] . weight [N,K]^T (+ bias [N]) (+ residual [M,N])  (=)
//            or, with gelu_input (mlp.c_fc):
//            gelu_input [M,N] = input . weight^T + bias, in the activation dtype (rounded once)
//            out [M,N]        = gelu(input . weight^T + bias) in out's dtype, from the unrounded
//                               sum (FP8: with out's scale, recording its amax)
//   dgrad    out [M,K]  = grad [M,N] . weight [N,K]                         (=)
//   wgrad    out [N,K] += grad [M,N]^T . input [M,K]   (the gradient slab's dtype: FP32, or
//                                                      BF16 under --grad-reduce-in-bf16,
//                                                      summed in FP32 and rounded once)
// FP8 operands are multiplied by their scale_inv; an FP8 weight carries its transposed
// copy for dgrad, an FP8 gradient its transpose for wgrad (Hopper's FP8 tensor cores
// take K-contiguous operands only).
enum class GemmPass : uint8_t { forward, dgrad, wgrad };
struct GemmCall {
  GemmPass pass = GemmPass::forward;
  Tensor out;
  Tensor input;   // forward, wgrad
  Tensor weight;  // forward, dgrad
  Tensor grad;    // dgrad, wgrad
  Tensor bias;    // forward only, optional
  // Forward only, optional: [M,N] of out's dtype, added in the epilogue before the one
  // rounding to out's dtype. Must not alias out.
  Tensor residual;
  // Forward only, optional: the GELU epilogue above (needs the bias; no residual). The GELU
  // backward's input, kept for it.
  Tensor gelu_input;
  // Wgrad only: false writes out (=) instead of adding to it, for the first micro-batch of a
  // step, whose weight gradients were not zeroed (GptModel::zero_gradients).
  bool accumulate = true;
  // Dgrad and wgrad: sum with FP32 promotion whatever --fp8-fast-accumulation says
  // (backward_sums_on_tensor_cores, core/gemm.h). The model sets it on the LM head's backward.
  bool promote_partial_sums = false;
};

// GemmCall::gelu_input's precondition, the same for every backend: a forward GEMM with a
// bias and no residual, gelu_input [M,N] apart from the output.
inline void check_gelu_epilogue(const GemmCall& call) {
  if (!call.gelu_input) return;
  FP8LM_CHECK(call.pass == GemmPass::forward && call.bias && !call.residual &&
                  call.gelu_input.rows == call.input.rows && call.gelu_input.cols == call.weight.rows &&
                  call.gelu_input.data != call.out.data,
              "forward GEMM with the GELU epilogue: a bias, no residual, gelu_input [M,N] apart from the output");
}

// dpre [M,F] = dout * gelu'(pre) in dpre's dtype (an FP8 gradient operand with its
// transpose, or the activation dtype); dbias [F] += its column sums.
struct GeluBackward {
  Tensor dpre;
  Tensor dbias;  // optional
  Tensor dout;   // [M,F] activation
  Tensor pre;    // [M,F] activation, bf16(c_fc's output + bias) as the forward saved it
  // Optional: gelu(pre) again, as the next GEMM's wgrad input (mlp.c_proj's), so the forward's
  // FP8 GELU output need not be kept for the backward. A per-tensor-scaled FP8 operand with its
  // transposed copy: the same codes the forward's cast wrote (the same values with the same
  // scale: a delayed scale changes only after the step, and a current one is the forward's,
  // left in the state or computed again from the same amax), and no amax recorded. The backend
  // writes the form its wgrad GEMM reads: the GPU the transposed copy only ([F,M]), the CPU
  // the values and their transpose.
  Tensor recomputed_output;
};

// Heads of this rank: qkv [B,T,3*heads*head_size] packs q | k | v. document_starts [B,T] in
// backend memory (nullable): each query's document start, its keys limited to that document
// (--reset-attention-mask; layers/attention.h).
struct AttentionShape {
  int B = 0, T = 0, heads = 0, head_size = 0;
  const int32_t* document_starts = nullptr;
  int width() const { return heads * head_size; }
};

// The attention backward and the cast of its dqkv to c_attn's output-gradient operand, as one
// op: attention_backward(dqkv, dout, qkv, out, lse, shape), then quantize(operand, dqkv, dbias).
// That pair is the definition (Ops' default). A backend may write the operand without dqkv,
// where it gives the same bits: the CUDA backend's wgmma kernels do under delayed scaling.
// dqkv's contents are then unspecified.
struct AttentionBackwardToOperand {
  Tensor operand;  // [B*T,3C'] in c_attn's gradient dtype (FP8 with its transpose), or a view of dqkv
  Tensor dbias;    // [3C'] optional: += column sums of dqkv
  Tensor dqkv;     // [B*T,3C'] activation dtype
  Tensor dout;     // [B*T,C'] activation
  Tensor qkv, out, lse;  // the forward's
  AttentionShape shape;
};

// A LayerNorm whose output is the input of the GEMM after it (ln_1 -> c_attn, ln_2 -> c_fc):
//   layernorm_forward(layernorm); gemm(gemm)      with gemm.input == layernorm.out.
// That pair is the definition (Ops' default). The CUDA backend runs both in one launch where
// the small-M GEMM takes them (an FP8 decoding step at batch 1), with the same bits.
struct LayerNormToGemm {
  LayerNormForward layernorm;
  GemmCall gemm;
};

// One layer's key/value cache for incremental decoding (layers/kv_cache.h): the keys and
// values of `capacity` positions of each of B sequences, in the activation dtype or in FP8
// E4M3 with one scale per tensor (the CPU holds the quantized values fp8(x * scale), as
// for every FP8 tensor).
struct KvCache {
  Tensor keys, values;      // [B*capacity, C'] row b*capacity + position
  float* scales = nullptr;  // [2] backend memory: the keys' and values' scales (FP8 only)
  int capacity = 0;
};

// The sizes of one rank's model, so a backend can size its workspaces once, before the
// first step ("local" = this rank's share under tensor parallelism).
struct ModelShape {
  int B = 0, T = 0;
  int C = 0;             // the residual width
  int local_width = 0;   // attention width of this rank's heads
  int local_ffn = 0;     // MLP width of this rank
  int local_heads = 0;
  int vocab_slice = 0;   // Vs
  int cache_capacity = 0;  // inference: the key/value cache's positions per sequence (0: training)
};

// A Linear weight's FP8 GEMM operand: the engine's FP8 weight gather, and the casts the
// optimizer writes in its update pass.
struct WeightOperand {
  int tensor = -1;  // index in the parameter layout
  int layer = -1;   // its block
  Tensor operand;   // FP8 [N,K] with its transposed copy [K,N]
};

// FP8 weight operands in the form a backend's AdamW update pass writes them
// (Ops::make_weight_casts, AdamWCall::weight_casts).
class WeightCastTable {
 public:
  explicit WeightCastTable(std::vector<WeightOperand> operands) : operands_(std::move(operands)) {}
  virtual ~WeightCastTable() = default;
  const std::vector<WeightOperand>& operands() const { return operands_; }
  // Elements cast (each written twice: the codes and their transpose).
  size_t elements() const {
    size_t n = 0;
    for (const WeightOperand& w : operands_) n += size_t(w.operand.numel());
    return n;
  }

 private:
  std::vector<WeightOperand> operands_;
};

// The checks both backends' make_weight_casts make: each operand a delayed-scaling FP8
// operand of a distinct tensor of `layout`, with the tensor's number of elements.
void check_weight_casts(const TensorLayout& layout, const std::vector<WeightOperand>& operands);

// One AdamW step over the tensors of `table` (optim/adamw.h), in two halves so that ranks
// holding parts of a tensor agree on its moment scales in between; both are no-ops when
// control->skip.
struct AdamWCall {
  const TensorTable* table = nullptr;
  float* master = nullptr;        // FP32 master weights, updated
  void* working = nullptr;        // the working copy (activation dtype), rewritten; null when it is the master
  // The gradient slab [1, elements] (f32, or bf16 under --grad-reduce-in-bf16), unscaled;
  // control->grad_scale applies the clip.
  Tensor grads;
  // Where each tensor's gradient (in `grads`) and working value (in `working`) sit, when
  // not at table's offsets: nullptr means at them. The distributed optimizer packs the
  // master and the state of this rank's pieces in its shard, while their gradients stay where
  // the in-place reduce-scatter leaves them in the model's gradient slab and their working
  // values go where the in-place all-gather reads them in the working slab. Same tensors and
  // numels as table.
  const TensorTable* slab_table = nullptr;
  // Optional [tensors] backend memory: where each tensor's working value sits in `working`
  // when the working copy leaves some tensors out (GptModel::working_offsets_on_backend: the FP8
  // Linear weights, kNoWorkingValue, which get no working value). Unsharded state only.
  const uint64_t* working_offsets = nullptr;
  OptimizerStatePrecision precision = OptimizerStatePrecision::fp8_fp16;
  AdamWStateSlabs state;
  AdamWHyperparams hyperparams;
  const StepControl* control = nullptr;
  // [adamw_scratch_floats(tensors)] backend memory; between the halves its first 2*tensors
  // floats are the moment amaxes (m then v) that the caller MAX-reduces across ranks.
  float* scratch = nullptr;
  // Optional (make_weight_casts): FP8 weight operands that adamw_apply writes from their
  // updated master values in the same pass, each exactly what quantize(operand, its FP32
  // master tensor) would write after the update: the codes with the state's scale as it is
  // now, the transposed copy, and the amax recorded. Also when control->skip, from the
  // unchanged values, as a cast after a skipped step does. So the caller updates the FP8
  // scales before the optimizer, and does not cast these operands again. The master must be
  // every tensor whole (no sharded state).
  const WeightCastTable* weight_casts = nullptr;
};

inline size_t adamw_scratch_floats(size_t tensors) { return 4 * tensors + 2; }

// What a pass does with the amaxes of its FP8 casts (Ops::set_amax_recording).
enum class AmaxRecording : uint8_t {
  // Training's passes: every cast's amax goes into the scaling state's history.
  on,
  // Evaluation and recomputed forwards: nothing recorded, so they cannot steer the training
  // scales; the GEMMs keep the plans of a recorded pass (cuBLASLt's amax output included), so a
  // recomputed forward gives the forward's bits.
  off,
  // Decoding: nothing recorded, and no pass needs another's bits, so an FP8-output GEMM may
  // drop its amax output (cuBLASLt must zero it before every call).
  off_any_plan,
};

class Ops {
 public:
  virtual ~Ops() = default;

  // ---- Memory ---------------------------------------------------------------------
  // The dtype of activations and of the working copy of the parameters: FP32 on the CPU
  // (the reference), BF16 on the GPU.
  virtual DType activation_dtype() const = 0;
  virtual size_t element_bytes(DType dtype) const = 0;
  virtual std::unique_ptr<Allocation> allocate(size_t bytes) = 0;
  virtual std::unique_ptr<HostReadback> make_readback(size_t bytes) = 0;
  virtual std::unique_ptr<TensorTable> make_table(const TensorLayout& layout) = 0;
  // The casts AdamWCall::weight_casts names, for the optimizer of `table`: delayed-scaling
  // FP8 operands, each [N,K] with N*K the numel of its tensor in the table.
  virtual std::unique_ptr<WeightCastTable> make_weight_casts(const TensorTable& table,
                                                             const std::vector<WeightOperand>& operands) = 0;
  virtual void zero(void* data, size_t bytes) = 0;                        // in stream order
  virtual void copy(void* destination, const void* source, size_t bytes) = 0;  // backend to backend
  virtual void upload(void* destination, const void* host, size_t bytes) = 0;  // waits for the copy
  virtual void download(void* host, const void* source, size_t bytes) = 0;     // waits for the stream
  // FP32 host values into a tensor of any dtype (rounded to it) and back.
  virtual void upload_values(const Tensor& destination, const float* host) = 0;
  virtual void synchronize() = 0;  // waits for both lanes
  // Sizes the backend's own workspaces (transposes, reductions, cuBLASLt) for the model.
  virtual void plan_workspace(const ModelShape& shape) = 0;
  virtual size_t workspace_bytes() const = 0;
  // The device's own count of memory in use (context and library pools included); 0 on the CPU.
  virtual size_t device_memory_in_use() const = 0;

  // ---- FP8 scaling ----------------------------------------------------------------
  // The table whose states FP8 tensors index. CpuOps uses the table's own arrays; CudaOps
  // keeps a device twin (download_scaling / upload_scaling move it to and from the table).
  virtual void attach_scaling(ScalingTable& table) = 0;
  virtual void download_scaling() = 0;
  virtual void upload_scaling() = 0;
  // Evaluation passes must not steer the training scales: they record no amax (AmaxRecording).
  virtual void set_amax_recording(AmaxRecording recording) = 0;
  // End of a step: the delayed-scaling update (core/scaling.h), or, when control->skip,
  // only the discard of this step's amaxes.
  virtual void update_scales(const StepControl* control) = 0;
  virtual void discard_current_amaxes(const StepControl* control) = 0;
  // FP8 statistics (--fp8-stats-interval, core/fp8_stats.h). counts [states] in backend
  // memory: while set, every quantization into an FP8 operand while amaxes are recorded (the
  // producers above, quantize, and quantize_tensors through scale_index) also adds what it did
  // to counts[its state]. nullptr (the default): the casts run the kernels they run without
  // statistics, and nothing is counted.
  virtual void set_fp8_statistics(Fp8CastCounts* counts) = 0;

  // ---- Parallel runs --------------------------------------------------------------
  // The backend's stream (a cudaStream_t on the GPU, nullptr on the CPU): the device
  // communicators are created on it, so collectives run in the ops' order.
  virtual void* stream_handle() = 0;
  // Current scaling of a tensor shared by several ranks must use one amax: each such
  // quantization MAX-reduces its amax over `group` before computing the scale
  // (Transformer Engine's amax reduction group). nullptr: no reduction.
  virtual void set_amax_group(Communicator* group) = 0;
  // This step's row of the amax history [states] and the scales [states], in backend
  // memory: the step MAX-reduces the row across ranks before the scale update, and the
  // FP8 weight gather casts with the scales.
  virtual float* amax_history_row() = 0;
  virtual const float* scales() = 0;

  // ---- More lanes, for overlapped communication and work -----------------------------
  // The main lane runs the ops; the side lane's stream carries the data-parallel traffic
  // that overlaps them; the background lane's work takes only what the other two leave
  // free (on the GPU a stream of the lowest priority, below theirs where the backend was made
  // so, make_cuda_ops' background_yields: their blocks are dispatched first).
  // The CPU runs every lane in program order: every call below is a no-op there.
  enum class Lane : uint8_t { main, side, background };
  class LaneEvent {
   public:
    virtual ~LaneEvent() = default;
  };
  virtual void* side_stream_handle() = 0;  // a cudaStream_t on the GPU, nullptr on the CPU
  virtual std::unique_ptr<LaneEvent> make_event() = 0;
  // Marks everything queued on `lane` so far; what `lane` runs next waits for a mark.
  virtual void record(LaneEvent& event, Lane lane) = 0;
  virtual void wait(LaneEvent& event, Lane lane) = 0;
  // Marks that also say when their lane reached them (--profile-ops, layers/op_profiler.h):
  // elapsed_ms waits for `end` and returns the milliseconds from `start` to it (the GPU's
  // clock on CUDA, the wall clock on the CPU, whose ops finish before they return).
  virtual std::unique_ptr<LaneEvent> make_timing_event() = 0;
  virtual double elapsed_ms(LaneEvent& start, LaneEvent& end) = 0;

  // ---- Slabs of the parameter layout (optim/slab_ops.h) ----------------------------
  // Each runs on `lane`: the overlapped data-parallel traffic casts, scales and sums its
  // buckets on the side lane, off the backward's critical path (and the weight casts of the
  // FP8 weight gather, off the next forward's).
  virtual void tensor_amaxes(float* amaxes, const float* values, const TensorTable& table, Lane lane = Lane::main) = 0;
  virtual void scales_from_amaxes(float* scales, float* scale_inv, const float* amaxes, int count, float fp8_max,
                                  float headroom, Lane lane = Lane::main) = 0;
  virtual void quantize_tensors(uint8_t* codes, const float* values, const TensorTable& table, const float* scales,
                                const int* scale_index, float* recorded_amax, Fp8Dtype dtype,
                                Lane lane = Lane::main) = 0;
  virtual void sum_fp8_chunks(float* out, const uint8_t* chunks, int ranks, size_t chunk_stride,
                              const TensorTable& table, const float* scale_inv, Fp8Dtype dtype,
                              Lane lane = Lane::main) = 0;
  // Rounds `values` to their dtype after a collective summed them in their storage type:
  // the CPU stores BF16 as FP32 and MPI sums in FP32, so a BF16 gradient reduced there is
  // rounded here, once, as NCCL's BF16 sum of two ranks rounds it; where the storage is the
  // dtype (the GPU) the collective already rounded and nothing is done.
  virtual void round_to_dtype(const Tensor& values, Lane lane = Lane::main) = 0;
  // An FP8 weight operand [N,K] (and its transposed copy) from gathered FP8 codes [N,K].
  virtual void fp8_weight_from_codes(const Tensor& operand, const uint8_t* codes) = 0;

  // ---- Tokens ---------------------------------------------------------------------
  // With `documents` on, the batch carries the index build_document_index makes of the inputs.
  virtual TokenBatch load_batch(const int32_t* host_inputs, const int32_t* host_targets, int B, int T,
                                const VocabSlice& slice, const DocumentMasking& documents = {}) = 0;
  // One decoding step's tokens [B] (inputs only) and its position (step_position), always into
  // the same backend memory: a step recorded with one such batch replays with the next.
  virtual TokenBatch load_decode_step(const int32_t* host_tokens, int B, int position, const VocabSlice& slice) = 0;

  // ---- Recording ------------------------------------------------------------------
  // Records the main lane's ops that `ops_sequence` issues, without running them; replay()
  // runs them as recorded: the same kernels on the same memory (GPU: one CUDA graph launch;
  // CPU: `ops_sequence` again). Whatever changes between replays must live in memory the
  // ops read (load_decode_step's batch). No host sync may happen inside.
  virtual std::unique_ptr<RecordedOps> record_ops(const std::function<void()>& ops_sequence) = 0;

  // ---- Embedding ------------------------------------------------------------------
  // out [B*T,C] f32 = wte[token - slice.begin] for tokens of the slice, 0 for the others.
  virtual void embedding_lookup(const Tensor& out, const TokenBatch& batch, const Tensor& wte,
                                const VocabSlice& slice) = 0;
  // out [N,C] activation = token_embeddings [N,C] + wpe[(first_row + n) % T], the wpe rows
  // starting *stored_wpe_row rows in when that is set (a recorded decoding step's position);
  // with position_ids [B*T] (backend memory, nullable) wpe[position_ids[first_row + n]] instead.
  virtual void add_position_embedding(const Tensor& out, const Tensor& token_embeddings, const Tensor& wpe,
                                      int first_row, int T, const int32_t* stored_wpe_row,
                                      const int32_t* position_ids) = 0;
  // dwte [Vs,C] += rows of dout [B*T,C] summed per token of the slice (fixed order).
  virtual void embedding_lookup_backward(const Tensor& dwte, const Tensor& dout, const TokenBatch& batch) = 0;
  // dwpe [T,C] += dout [N,C] rows summed per position (fixed order): the row's position in its
  // sequence, or in its document where `batch` carries position ids.
  virtual void position_embedding_backward(const Tensor& dwpe, const Tensor& dout, int first_row, int T,
                                           const TokenBatch& batch) = 0;

  // ---- LayerNorm ------------------------------------------------------------------
  virtual void layernorm_forward(const LayerNormForward& call) = 0;
  virtual void layernorm_backward(const LayerNormBackward& call) = 0;
  virtual void layernorm_operand(const LayerNormOperand& call) = 0;
  virtual void layernorm_to_gemm(const LayerNormToGemm& call) {
    FP8LM_CHECK(call.gemm.input.data == call.layernorm.out.data, "layernorm_to_gemm: the GEMM's input is not the LayerNorm's output");
    layernorm_forward(call.layernorm);
    gemm(call.gemm);
  }

  // ---- GEMM and casts -------------------------------------------------------------
  virtual void gemm(const GemmCall& call) = 0;
  // An FP8 operand's codes again, for its wgrad, from the activation `in` [M,N] its forward
  // cast read: out's transposed copy [N,M] = fp8(in * out's scale)^T, the forward's codes bit
  // for bit (a delayed scale changes only after the step, and a current one is left in its
  // state by the forward), so that they need not be kept for the backward. No amax recorded;
  // per-tensor scales only. The GPU writes the transposed copy only, the CPU the values and
  // their transpose.
  virtual void requantize_transposed(const Tensor& out, const Tensor& in) = 0;
  // out [M,N] = in [M,N] in out's dtype (FP8: with out's scale, recording the amax, and
  // the transpose when out carries one); dbias [N] += column sums of in (optional).
  // When out is a view of in (same data), only dbias is computed. On another lane (a weight's
  // operand cast as soon as its gather lands, off the forward's path): an FP8 cast with a
  // delayed per-tensor scale and no dbias only.
  virtual void quantize(const Tensor& out, const Tensor& in, const Tensor& dbias, Lane lane = Lane::main) = 0;

  // operand's transposed copy [N,M] = its values [M,N] transposed: a per-tensor FP8 operand
  // whose codes are already written (the FP8 LM head's dlogits: their copy for the wgrad goes
  // into the logits' storage once the loss has read them).
  virtual void transpose_operand(const Tensor& operand) = 0;

  // ---- MLP ------------------------------------------------------------------------
  // (The GELU forward is the c_fc GEMM's epilogue: GemmCall::gelu_input.)
  virtual void gelu_backward(const GeluBackward& call) = 0;

  // ---- Attention ------------------------------------------------------------------
  // out [B*T,C'] activation (kept for backward), operand = out in the next GEMM's dtype
  // (a view of out when that is the activation dtype), lse [B,heads,T] f32.
  virtual void attention_forward(const Tensor& out, const Tensor& operand, const Tensor& lse, const Tensor& qkv,
                                 const AttentionShape& shape) = 0;
  // dqkv [B*T,3C'] = from dout [B*T,C'] and the forward's qkv, out and lse.
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, const AttentionShape& shape) = 0;
  virtual void attention_backward_to_operand(const AttentionBackwardToOperand& call) {
    attention_backward(call.dqkv, call.dout, call.qkv, call.out, call.lse, call.shape);
    quantize(call.operand, call.dqkv, call.dbias);
  }

  // ---- Incremental decoding (layers/kv_cache.h) -----------------------------------
  // Writes the keys and values of qkv [B*n,3C'] (positions [position, position + n) of each
  // sequence; shape.T = n) into the cache. An FP8 cache takes its scales at position 0,
  // from the amax of these first keys and values (kv_cache_scale()); later tokens saturate
  // beyond them.
  virtual void kv_cache_append(const KvCache& cache, const Tensor& qkv, const AttentionShape& shape,
                               CachePosition position) = 0;
  // One new token per sequence (shape.T = 1) at `position`: its key and value in qkv [B,3C'] are
  // appended at `position` (as kv_cache_append would), then its query attends to cache
  // positions [0, position], its own key and value among them. out [B,C'] activation,
  // operand = out in the next GEMM's dtype (a view of out when that is the activation dtype).
  virtual void attention_decode(const Tensor& out, const Tensor& operand, const Tensor& qkv, const KvCache& cache,
                                const AttentionShape& shape, CachePosition position) = 0;
  // A tensor's values as FP32 on the host (activation dtype or f32; waits for the stream).
  virtual void download_values(float* host, const Tensor& source) = 0;

  // ---- Choosing tokens (layers/sampling.h) ----------------------------------------
  // Each of B sequences' next token from a decoding step's logits [B, Vs] (the whole
  // vocabulary): sample_token's choice by `rule` with the number step_uniform(tokens.seed, b,
  // position - tokens.first_position), made where the logits are, so that a decoding loop
  // never waits for the host. The token becomes the next step's input in the memory
  // load_decode_step fills, whose position becomes position + 1, and row position + 1 of
  // tokens.chosen. A sequence that has ended keeps its input and records -1; one that draws
  // tokens.stop_token ends. position.stored, when set, is read instead of position.value (a
  // recorded step replays at every position).
  virtual void choose_next_tokens(const Tensor& logits, int B, const VocabSlice& slice, const SamplingOptions& rule,
                                  CachePosition position, const DecodingTokens& tokens) = 0;

  // ---- Loss (cross-entropy, layers/cross_entropy.h) -------------------------------
  // One rank holds the whole vocabulary (slice.begin 0, slice.size the padded Vp): losses [N]
  // =, and when dloss != 0 the logits [N,Vp] become (softmax - onehot) * dloss in place.
  // The same bits as cross_entropy_partials and cross_entropy_finish with one rank, in one
  // pass over the logits instead of two.
  virtual void cross_entropy(const Tensor& logits, const Tensor& losses, const TokenBatch& batch,
                             const VocabSlice& slice, float dloss) = 0;
  // cross_entropy with dloss != 0 and the dlogits cast to `codes` [N,Vp], a per-tensor FP8
  // operand given without its transposed copy: quantize(codes, dlogits), its amax recorded.
  // Afterwards the logits hold the dlogits or the logits (the GPU, under a delayed scale,
  // casts in the loss's own pass and leaves them: layers/cross_entropy.h).
  virtual void cross_entropy_to_fp8(const Tensor& logits, const Tensor& losses, const TokenBatch& batch,
                                    const VocabSlice& slice, float dloss, const Tensor& codes) {
    FP8LM_CHECK(dloss != 0.0f && is_fp8(codes.dtype) && !codes.transposed && codes.rows == logits.rows &&
                    codes.cols == logits.cols,
                "cross_entropy_to_fp8: dloss != 0 and an FP8 operand of the logits' shape without its transposed copy");
    cross_entropy(logits, losses, batch, slice, dloss);
    quantize(codes, logits, Tensor{});
  }
  // Vocabulary-parallel, in two halves around an all-gather of the partials:
  // partials [N,3] f32: this slice's row max, sum of exp(x - max) and target logit (or 0).
  virtual void cross_entropy_partials(const Tensor& partials, const Tensor& logits, const TokenBatch& batch,
                                      const VocabSlice& slice) = 0;
  // Combines all_partials [ranks,N,3] in rank order: losses [N] =; when dloss != 0 the
  // logits [N,Vs] become (softmax - onehot) * dloss in place.
  virtual void cross_entropy_finish(const Tensor& logits, const Tensor& losses, const Tensor& all_partials,
                                    int ranks, const TokenBatch& batch, const VocabSlice& slice, float dloss) = 0;
  // loss_sum [1] f32 += sum of losses [N] (fixed order).
  virtual void accumulate_loss(const Tensor& loss_sum, const Tensor& losses) = 0;

  // ---- The optimizer step ---------------------------------------------------------
  // *sum_of_squares [1] f64 = sum of grads^2 over the table's tensors (deterministic); grads
  // the gradient slab [1, elements], f32 or bf16.
  virtual void grad_sum_of_squares(double* sum_of_squares, const Tensor& grads, const TensorTable& table) = 0;
  // The same in parts, for gradients that become final bucket by bucket (reduced across
  // data-parallel ranks beside the backward): _part once for each range of the table's
  // tensors, on `lane`, once that range is final; _finish on the main lane after it has waited
  // for every part. Bit for bit grad_sum_of_squares, whatever the ranges and their order.
  struct TensorRange {
    size_t first = 0, end = 0;  // tensors [first, end) of the table
  };
  virtual void grad_sum_of_squares_part(const Tensor& grads, const TensorTable& table, TensorRange tensors,
                                        Lane lane) = 0;
  virtual void grad_sum_of_squares_finish(double* sum_of_squares, const Tensor& grads, const TensorTable& table) = 0;
  // control = decide_step(...) (optim/step_control.h), in stream order.
  virtual void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum,
                             float loss_divisor, double max_grad_norm) = 0;
  virtual void set_step_control(StepControl* control, const StepControl& value) = 0;
  // fp8_fp16 state: pass 1, the updated moments' amaxes into call.scratch. fp32: nothing.
  virtual void adamw_moment_amaxes(const AdamWCall& call) = 0;
  // fp8_fp16 state, where call.table is also the norm's table: pass 1 before finalize_step, in
  // the same read of the gradients as their norm: the amaxes as if the clip coefficient were
  // 1, and *sum_of_squares = grad_sum_of_squares(call.grads, *call.table), bit for bit. After
  // finalize_step, adamw_moment_amaxes_if_clipped redoes the amaxes when the coefficient is not
  // 1 (decided in stream order; nothing runs otherwise). Together: adamw_moment_amaxes's amaxes.
  void adamw_moment_amaxes_and_norm(const AdamWCall& call, double* sum_of_squares) {
    adamw_first_pass_begin(call);
    adamw_first_pass_part(call, {.first = 0, .end = call.table->layout().tensors().size()}, Lane::main);
    adamw_first_pass_finish(call, sum_of_squares);
  }
  // The same in parts, for gradients that become final layer by layer in the backward (one
  // rank, its last micro-batch): _begin (main lane) before any part; _part once for each range
  // of call.table's tensors, on `lane`, once that range's gradients are final; _finish on the
  // main lane after it has waited for every part. Bit for bit adamw_moment_amaxes_and_norm,
  // whatever the ranges and their order.
  virtual void adamw_first_pass_begin(const AdamWCall& call) = 0;
  virtual void adamw_first_pass_part(const AdamWCall& call, TensorRange tensors, Lane lane) = 0;
  virtual void adamw_first_pass_finish(const AdamWCall& call, double* sum_of_squares) = 0;
  virtual void adamw_moment_amaxes_if_clipped(const AdamWCall& call) = 0;
  // The update: new moment scales from the (agreed) amaxes, parameters, moments, and the
  // working copy.
  virtual void adamw_apply(const AdamWCall& call) = 0;
};

}  // namespace fp8lm
