// GPT-2 on one GPU: the same model as layers/gpt.h, composed from the CUDA kernels of
// this folder and core/ (see docs/GPU_DESIGN.md for the data path).
//
// Memory, one slab per class, allocated once:
//   master      FP32 parameters, the optimizer's copy         [layout.total_elements()]
//   params_bf16 BF16 working copy (LayerNorm, biases, embeddings, BF16 GEMMs)
//   grads       FP32 gradients; wgrad GEMMs accumulate into it (beta = 1)
//   fp8 weights E4M3 W [N,K] and W^T [K,N] of every Linear (fp8 mode)
//   activations BF16 / FP8 / FP32 slabs for one micro-batch
//   scaling     amax history [S,L], scale [S], scale_inv [S]: the device twin of ScalingTable
// The forward and backward enqueue work on one stream and never wait for the GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/device_memory.h"
#include "core/gemm_cuda.h"
#include "core/gpt_config.h"
#include "core/logging.h"
#include "core/scaling.h"
#include "core/tensor.h"
#include "layers/encoder_index.h"
#include "layers/gpt.h"

namespace fp8lm::cuda {

class GptModel {
 public:
  GptModel(const GptConfig& config, int batch_size, int seq_length, const GptPrecision& precision,
           cudaStream_t stream);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const GptConfig& config() const { return config_; }
  const TensorLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_; }
  int batch_size() const { return B_; }
  int seq_length() const { return T_; }

  float* master() { return master_.data(); }
  __nv_bfloat16* params_bf16() { return params_bf16_.data(); }
  float* grads() { return grads_.data(); }
  const ScalingTable& scaling_table() const { return scaling_table_; }
  float* scaling_history() { return history_.data(); }
  float* scaling_scale() { return scale_.data(); }
  float* scaling_scale_inv() { return scale_inv_.data(); }
  const float* scaling_format_max() const { return format_max_.data(); }

  // Uploads FP32 master weights from the host and derives the BF16 and FP8 copies.
  void set_parameters(const std::vector<float>& host_master);
  std::vector<float> parameters();  // blocks

  // Clears the gradients and the loss accumulator (start of an optimizer step).
  void zero_gradients_and_loss();
  // One micro-batch: tokens [B,T] from the host; gradients accumulate with weight dloss
  // per token loss; the per-token losses accumulate into loss_sum().
  void forward_backward(const int32_t* inputs, const int32_t* targets, float dloss);
  // Forward only: adds the micro-batch's loss sum into eval_loss_sum(); records no amax.
  void forward_eval(const int32_t* inputs, const int32_t* targets);
  float* loss_sum() { return loss_sum_.data(); }
  float* eval_loss_sum() { return eval_loss_sum_.data(); }

  // After the optimizer and the scale update: BF16 copy already written by AdamW;
  // re-cast the FP8 weights (both layouts) and record their amaxes.
  void refresh_fp8_weights();
  // True while quantization takes its scale from the tensor at hand: the tensorwise
  // recipe, or the delayed recipe before its first scale update.
  bool current_scaling() const { return current_scaling_; }
  void mark_scales_initialized();

  size_t float_scratch_size() const { return scratch_.size(); }
  float* float_scratch() { return scratch_.data(); }

  // Bytes per slab class, for the startup table.
  SettingsTable memory_table() const;
  size_t total_bytes() const;

  struct Linear;          // one Linear's slab offsets, shape and scaling states
  struct BlockActivations;

 private:
  struct Carved;
  void allocate_activations();
  BlockActivations block(int layer);
  void upload_tokens(const int32_t* inputs, const int32_t* targets);
  void forward(bool training);
  void backward();  // the loss gradient is already in the logits (fused cross-entropy)
  // Quantization glue for the current-scaling path.
  void quantize(uint8_t* out, uint8_t* out_t, float* dbias, int state, const __nv_bfloat16* in, int M, int N,
                bool record);
  float* amax_slot(int state) { return history_.data() + size_t(state) * scaling_table_.config().amax_history_len; }
  float* sink() { return amax_sink_.data(); }
  void gemm(const Linear& linear, int which, void* D, GemmType d_type, const void* A, const void* B, const void* C,
            float beta, const void* bias, int M, int N, int K, bool a_transposed, bool b_transposed);

  GptConfig config_;
  int B_, T_;
  GptPrecision precision_;
  bool fp8_;
  bool current_scaling_;
  cudaStream_t stream_;
  TensorLayout layout_;
  ScalingTable scaling_table_;
  std::vector<Linear> linears_;  // [L*4]: c_attn, attn.c_proj, c_fc, mlp.c_proj
  // Slab offsets of the non-Linear parameters, looked up once (not per step).
  struct LayerNormOffsets {
    size_t weight = 0, bias = 0;
  };
  std::vector<LayerNormOffsets> ln1_, ln2_;  // [L]
  LayerNormOffsets ln_f_;
  size_t wte_offset_ = 0, wpe_offset_ = 0;

  DeviceBuffer<float> master_;
  DeviceBuffer<__nv_bfloat16> params_bf16_;
  DeviceBuffer<float> grads_;
  DeviceBuffer<uint8_t> fp8_weights_;
  DeviceBuffer<float> history_, scale_, scale_inv_, format_max_;
  DeviceBuffer<float> amax_sink_;   // [1] where evaluation passes send amaxes
  DeviceBuffer<float> tensor_amax_; // [1] current-scaling temporary

  DeviceBuffer<__nv_bfloat16> act_bf16_;
  DeviceBuffer<uint8_t> act_fp8_;
  DeviceBuffer<float> act_f32_;
  DeviceBuffer<__nv_bfloat16> grad_bf16_;
  DeviceBuffer<uint8_t> grad_fp8_;
  DeviceBuffer<float> scratch_;
  DeviceBuffer<float> loss_sum_, eval_loss_sum_;
  DeviceBuffer<int32_t> tokens_;  // inputs [BT] | targets [BT] | unique [BT] | offsets [BT+1] | positions [BT]
  int num_unique_tokens_ = 0;

  // Pinned staging for token uploads: a ring so the host can prepare the next
  // micro-batch while the GPU still copies the previous one.
  static constexpr int kStagingSlots = 4;
  int32_t* staging_ = nullptr;
  cudaEvent_t staging_done_[kStagingSlots] = {};
  int staging_next_ = 0;
  EncoderBackwardIndex encoder_index_;

  GemmEngine gemm_engine_;
  std::unique_ptr<Carved> carved_;
};

}  // namespace fp8lm::cuda
