// GPT-2: the parameter layout (Hugging Face names) and the CPU reference model,
// forward and backward, composed from the ops in this folder.
//
//   x = wte[tokens] + wpe[positions]                            [B,T,C]
//   per block:  x = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
//               x = x + mlp.c_proj(gelu(mlp.c_fc(ln_2(x))))
//   logits = ln_f(x) . wte^T  (LM head tied to the token embedding)   [B,T,Vp]
//   loss = mean cross-entropy over the B*T targets
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/gemm.h"
#include "core/gpt_config.h"
#include "core/scaling.h"
#include "core/tensor.h"
#include "layers/linear.h"

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

// GPT-2 initialisation: N(0, 0.02) for embeddings and weights, N(0, 0.02/sqrt(2L)) for
// the residual projections (attn.c_proj, mlp.c_proj), LayerNorm weight 1, biases 0,
// padded vocabulary rows 0. Deterministic in `seed` on every platform.
void init_gpt_parameters(float* params, const TensorLayout& layout, const GptConfig& config, uint64_t seed);

// How the run's precision maps onto the model's GEMMs.
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

namespace cpu {

// The CPU reference GPT: FP32 math everywhere except where the precision mode rounds
// GEMM operands (BF16) or quantizes them (FP8). Owns its parameter, gradient and
// activation slabs and the FP8 scaling table.
class GptModel {
 public:
  GptModel(const GptConfig& config, int batch_size, int seq_length, const GptPrecision& precision);

  const GptConfig& config() const { return config_; }
  const TensorLayout& layout() const { return layout_; }
  std::vector<float>& parameters() { return params_; }
  std::vector<float>& gradients() { return grads_; }
  ScalingTable& scaling() { return scaling_; }
  int batch_size() const { return B_; }
  int seq_length() const { return T_; }

  // Forward pass over inputs/targets [B,T] (T <= seq_length); returns the mean loss.
  // With dloss != 0 it also runs backward, accumulating dloss-weighted gradients
  // (dloss = 1/(B*T*accumulation steps) for a mean over the global batch).
  float forward_backward(const int32_t* inputs, const int32_t* targets, float dloss);
  // Forward only, for evaluation: records no FP8 amaxes, so it cannot steer training.
  float evaluate(const int32_t* inputs, const int32_t* targets);

  void zero_gradients();
  // Per-token losses of the last forward [B,T].
  const float* losses() const;

 private:
  struct BlockTensors;
  struct BlockActivations;
  BlockTensors block_tensors(float* slab, int layer) const;
  BlockActivations block_activations(int layer);
  float run_forward(const int32_t* inputs, const int32_t* targets, float dloss);
  void run_backward(const int32_t* inputs);
  void set_amax_recording(bool record);

  GptConfig config_;
  int B_, T_;
  GptPrecision precision_;
  TensorLayout layout_;
  std::vector<float> params_;
  std::vector<float> grads_;
  std::vector<float> activations_;       // one slab: forward activations
  std::vector<float> grad_activations_;  // one slab: backward scratch
  ScalingTable scaling_;
  std::vector<LinearPrecision> block_linears_;  // [L*4]: c_attn, attn.c_proj, c_fc, mlp.c_proj
  LinearPrecision lm_head_;
};

}  // namespace cpu
}  // namespace fp8lm
