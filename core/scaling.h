// FP8 scaling: where every GEMM operand's scale comes from, and where it is updated.
//
// A tensor x is stored in FP8 as q = fp8(x * scale); the GEMM multiplies by
// scale_inv = 1/scale to undo it. The scale maps the tensor's amax (max |x|) onto the
// format's largest value, less a safety margin:
//
//     scale = fp8_max / amax / 2^margin          (Transformer Engine's rule)
//
// Two recipes choose which amax:
//   delayed    - the amax of *earlier* steps: each quantization records its amax into
//                slot 0 of a history window; once per optimizer step (every
//                --fp8-interval steps) the scale is recomputed from the window's max
//                (or its newest entry) and the window rolls. No extra pass over the
//                tensor before the GEMM, which is why it is the default.
//   tensorwise - "current scaling": the amax of the tensor being quantized, now.
//   blockwise  - current scaling per block (DeepSeek-V3's recipe, Transformer Engine's
//                Float8BlockScaling): one scale per 1x128 tile of an activation or gradient
//                and per 128x128 block of a weight, from the values at hand, as powers of
//                two. The scales live with the operand (Tensor::block_scale_inv), not in
//                this table: its states only name the operands. core/block_scaling.h.
// A state that has never been updated (a fresh run, or one started from a BF16
// checkpoint) quantizes with current scaling until its first update, so step 0 never
// uses scale 1.
//
// ScalingTable holds every operand's state in three contiguous arrays, laid out as
// Transformer Engine lays them out: amax history [L, S] (L = history length, S = states)
// whose row 0 is this step's amaxes, one per operand, contiguous, so one MAX all-reduce
// of that row keeps every rank's scales identical; scale [S]; scale_inv [S]. The GPU
// holds a device twin of the three arrays and updates all of them in one kernel with no
// host sync; its scale_inv keeps each state 16 bytes apart (layers/ops_cuda.cpp,
// kScaleInvStride), the pointers cuBLASLt's FP8 GEMMs take as they are.
// THE place where scales change: ScalingTable::update() on the CPU, and the kernel in
// core/scaling.cu on the GPU (update_delayed_scales); both call compute_scale() below.
// Current scaling writes a state's scale as it quantizes (scale_for() on the CPU,
// current_scale_and_record() on the GPU).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/fp8.h"

namespace fp8lm {

enum class ScalingRecipe : uint8_t { delayed, tensorwise, blockwise };
enum class AmaxComputeAlgo : uint8_t { max, most_recent };

std::string_view to_string(ScalingRecipe recipe);
std::string_view to_string(AmaxComputeAlgo algo);

struct Fp8RecipeConfig {
  Fp8Format format = Fp8Format::hybrid;
  ScalingRecipe recipe = ScalingRecipe::delayed;
  // Megatron-LM's defaults (--fp8-amax-history-len 1, --fp8-amax-compute-algo most_recent):
  // the scale follows the last step's amax. The seed recipe's history 1024 with `max` (Transformer
  // Engine's DelayedScaling defaults) is selected by passing those flags.
  int amax_history_len = 1;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::most_recent;
  int margin = 0;
  int interval = 1;  // update the delayed scales every `interval` optimizer steps
};

// The delayed recipe recomputes its scales at the end of optimizer step `step` (0-based)
// when this holds: every --fp8-interval steps. The tensorwise and blockwise recipes never do.
inline bool is_scale_update_step(const Fp8RecipeConfig& config, int64_t step) {
  return config.recipe == ScalingRecipe::delayed && (step + 1) % config.interval == 0;
}

// --fp8-margin's range: [0, kMaxFp8Margin].
inline constexpr int kMaxFp8Margin = 64;

// The one scale rule, shared by the CPU reference and the GPU kernels.
// Keeps `previous_scale` when amax is 0 or not finite (nothing to learn from), and
// caps the scale at FLT_MAX when a tiny amax would overflow it. The margin lowers the
// format's maximum by an exact power of two before the one division (Transformer Engine's
// order): the same value as dividing the scale by 2^margin afterwards wherever that is
// exact, and defined for every margin the flag accepts (a shift of 1 by 64 is not).
FP8LM_HOST_DEVICE inline float compute_scale(float amax, float format_max, int margin,
                                             float previous_scale) {
  constexpr float kFloatMax = 3.402823466e38f;
  if (!(amax > 0.0f && amax <= kFloatMax)) return previous_scale;  // 0, negative, inf or NaN
  const float scale = ldexpf(format_max, -margin) / amax;
  return scale <= kFloatMax ? scale : kFloatMax;
}

class ScalingTable {
 public:
  explicit ScalingTable(const Fp8RecipeConfig& config);

  // Registers one GEMM operand (e.g. "h.0.attn.c_attn.input") and returns its index.
  // Registration happens before training; it re-lays the history for the new column.
  int add(std::string name, Fp8Dtype dtype);

  int size() const { return static_cast<int>(names_.size()); }
  const Fp8RecipeConfig& config() const { return config_; }
  const std::string& name(int index) const { return names_[index]; }
  Fp8Dtype dtype(int index) const { return dtypes_[index]; }
  float scale(int index) const { return scale_[index]; }
  float scale_inv(int index) const { return scale_inv_[index]; }
  // True once the state has a scale learned from recorded amaxes (delayed recipe).
  bool initialized(int index) const { return initialized_[index] != 0; }
  // True while quantization must take its scale from the tensor at hand: the tensorwise
  // recipe, or the delayed recipe before its first update (all states learn together).
  bool uses_current_scaling() const { return size() > 0 && needs_tensor_amax(0); }
  // The delayed recipe's first update has been issued (the GPU engine cannot wait to see
  // it applied); from now on quantization uses the stored scales.
  void mark_initialized();

  // The scale to quantize operand `index` with, given the amax of the tensor at hand.
  // Delayed recipe, initialized state: the stored scale (tensor_amax is not needed).
  // Otherwise (tensorwise, or not yet initialized): current scaling from tensor_amax,
  // which is also stored as the state's scale.
  float scale_for(int index, float tensor_amax);
  bool needs_tensor_amax(int index) const {
    return config_.recipe == ScalingRecipe::tensorwise || !initialized(index);
  }

  // Records one quantization's amax into this step's row (running max, so micro-batches
  // of one step share a slot).
  void record_amax(int index, float amax);

  // A skipped step (non-finite loss or gradient) must not leave its amaxes behind.
  void discard_current_amaxes();

  // End of optimizer step `step` (0-based): on interval boundaries, recompute every
  // delayed scale from its history window and roll the window. No-op for tensorwise.
  void update(int64_t step);
  // The same without the interval gate: the update itself.
  void update_now();

  // The amax recorded for state `index` `slot` steps ago (slot 0: this step).
  float amax_at(int index, int slot) const { return history_[static_cast<size_t>(slot) * size() + index]; }

  // Raw contiguous arrays: history is [amax_history_len][size()], row 0 current.
  std::vector<float>& history() { return history_; }
  const std::vector<float>& history() const { return history_; }
  std::vector<float>& scales() { return scale_; }
  std::vector<float>& scale_invs() { return scale_inv_; }
  std::vector<uint8_t>& initialized_flags() { return initialized_; }

 private:
  Fp8RecipeConfig config_;
  std::vector<std::string> names_;
  std::vector<Fp8Dtype> dtypes_;
  std::vector<float> history_;
  std::vector<float> scale_;
  std::vector<float> scale_inv_;
  std::vector<uint8_t> initialized_;
};

// One state's window: `length` amaxes, `stride` floats apart (the number of states in
// an [L, S] history), slot 0 the newest.
float window_amax(const float* history, int length, int stride, AmaxComputeAlgo algo);

// Rolls one state's window by one: the newest entry moves to the back, the oldest drops
// out, and slot 0 is cleared for the next step (Transformer Engine's roll along dim 0).
void roll_history(float* history, int length, int stride);

// Converts a history stored [S, L] (fp8lm checkpoints before version 2) to [L, S].
std::vector<float> history_from_state_major(const std::vector<float>& state_major, int num_states, int length);

}  // namespace fp8lm
