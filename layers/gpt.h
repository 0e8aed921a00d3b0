// GPT-2, written once: the parameter layout (Hugging Face names) and the model's forward
// and backward over the Ops interface (layers/ops.h), so the CPU reference and the GPU
// run the same code.
//
//   x = wte[tokens] + wpe[positions]                                        [B,T,C]
//   per block:  x = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
//               x = x + mlp.c_proj(gelu(mlp.c_fc(ln_2(x))))
//   logits = ln_f(x) . wte^T  (LM head tied to the token embedding)        [B,T,Vp]
//   loss = mean cross-entropy over the B*T targets
//
// Where the residual adds happen: the two c_proj GEMMs (the row-parallel ones under
// tensor parallelism) write their output without bias; the LayerNorm that follows adds
// the residual, that output and the bias in one pass (docs/MODEL.md says why).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/gemm.h"
#include "core/gpt_config.h"
#include "core/logging.h"
#include "core/scaling.h"
#include "core/tensor.h"
#include "layers/ops.h"

namespace fp8lm {

// Every parameter tensor with its Hugging Face GPT-2 name, in one slab. Linear weights
// are [out, in] (PyTorch layout; HF's Conv1D stores [in, out]).
//   wte.weight [Vp,C]  wpe.weight [maxT,C]
//   h.{l}.ln_1.weight/bias [C]
//   h.{l}.attn.c_attn.weight [3C,C]  .bias [3C]
//   h.{l}.attn.c_proj.weight [C,C]   .bias [C]
//   h.{l}.ln_2.weight/bias [C]
//   h.{l}.mlp.c_fc.weight [F,C]      .bias [F]     (F = n_inner, 4C for GPT-2)
//   h.{l}.mlp.c_proj.weight [C,F]    .bias [C]
//   ln_f.weight/bias [C]
TensorLayout make_gpt_layout(const GptConfig& config);

// The four Linear layers of a block, in the order the forward runs them.
inline constexpr const char* kBlockLinearNames[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};

// GPT-2 initialisation: N(0, 0.02) for embeddings and weights, N(0, 0.02/sqrt(2L)) for
// the residual projections (attn.c_proj, mlp.c_proj), LayerNorm weight 1, biases 0,
// padded vocabulary rows 0. Deterministic in `seed` on every platform.
void init_gpt_parameters(float* params, const TensorLayout& layout, const GptConfig& config, uint64_t seed);

// How the run's precision maps onto the model's GEMM operands.
struct GptPrecision {
  GemmPrecision gemm = GemmPrecision::fp32;  // the transformer blocks' Linear layers
  bool fp8_lm_head = false;                  // the tied LM head in FP8 too (else BF16 under fp8)
  Fp8RecipeConfig fp8;
  // The LM head's GEMM precision: FP8 only when asked, BF16 under fp8 otherwise.
  GemmPrecision lm_head() const {
    if (gemm != GemmPrecision::fp8) return gemm;
    return fp8_lm_head ? GemmPrecision::fp8 : GemmPrecision::bf16;
  }
};

// The dtype of a GEMM's forward operands (inputs, weights) and of its output gradient.
DType forward_operand_dtype(GemmPrecision precision);
DType gradient_operand_dtype(GemmPrecision precision, Fp8Format format);

class GptModel {
 public:
  GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision, Ops& ops);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const GptConfig& config() const { return config_; }
  const GptPrecision& precision() const { return precision_; }
  const TensorLayout& layout() const { return layout_; }
  ScalingTable& scaling() { return scaling_; }
  int micro_batch_size() const { return B_; }
  int seq_length() const { return T_; }
  VocabSlice vocab_slice() const;

  // Slabs [layout().total_elements()]: the FP32 master weights (what the optimizer
  // updates), the working copy in the activation dtype (what the forward reads; the
  // master itself where the activation dtype is FP32) and the FP32 gradients.
  float* master() { return static_cast<float*>(master_->data()); }
  void* working() { return working_; }
  bool working_is_master() const { return working_ == master_->data(); }
  float* gradients() { return static_cast<float*>(gradients_->data()); }

  void zero_gradients();
  // One micro-batch: forward, loss, backward. Gradients accumulate with weight dloss per
  // token loss; the token losses accumulate into loss_sum [1] f32.
  void forward_backward(const TokenBatch& batch, float dloss, const Tensor& loss_sum);
  // Forward and loss only; the token losses accumulate into loss_sum. Records no amax.
  void forward_eval(const TokenBatch& batch, const Tensor& loss_sum);
  // Casts every weight operand that is not a view of the working copy (FP8 weights and
  // their transposes; BF16-rounded copies on the CPU) from the master weights, recording
  // the FP8 weights' amaxes. After every optimizer step and whenever the weights are set.
  void refresh_weight_operands();

  // Bytes per memory class, for the startup table and the benchmark.
  SettingsTable memory_table() const;
  size_t allocated_bytes() const;

  struct LinearParams;
  struct LayerNormParams;
  struct BlockParams;
  struct BlockActivations;

 private:
  void plan_memory();
  void forward(const TokenBatch& batch);
  void loss(const TokenBatch& batch, float dloss, const Tensor& loss_sum);
  void backward(const TokenBatch& batch);
  void block_forward(int layer);
  void block_backward(int layer);
  // The residual-stream input of block `layer`'s ln_1: the embeddings for block 0, else
  // the previous block's residual after attention (its MLP output is the branch).
  const Tensor& previous_residual(int layer) const;
  Tensor gradient_operand(const Tensor& gradient, const LinearParams& linear) const;
  Tensor gradient_operand_buffer(int64_t rows, int64_t cols, const LinearParams& linear) const;

  GptConfig config_;
  int B_, T_;
  GptPrecision precision_;
  Ops& ops_;
  TensorLayout layout_;
  ScalingTable scaling_;
  DType activation_dtype_;

  std::unique_ptr<Allocation> master_, working_copy_, gradients_, weight_operands_, activations_;
  void* working_ = nullptr;

  std::vector<BlockParams> blocks_;
  std::unique_ptr<LinearParams> lm_head_;
  std::unique_ptr<LayerNormParams> ln_f_;
  Tensor wpe_, grad_wpe_;

  std::vector<BlockActivations> saved_;
  struct Scratch;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace fp8lm
