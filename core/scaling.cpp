#include "core/scaling.h"

#include <algorithm>

#include "core/error.h"

namespace fp8lm {

std::string_view to_string(ScalingRecipe recipe) {
  switch (recipe) {
    case ScalingRecipe::delayed: return "delayed";
    case ScalingRecipe::tensorwise: return "tensorwise";
    case ScalingRecipe::blockwise: return "blockwise";
  }
  return "?";
}
std::string_view to_string(AmaxComputeAlgo algo) {
  return algo == AmaxComputeAlgo::max ? "max" : "most_recent";
}

ScalingTable::ScalingTable(const Fp8RecipeConfig& config) : config_(config) {
  FP8LM_CHECK(config.amax_history_len >= 1);
  FP8LM_CHECK(config.interval >= 1);
  FP8LM_CHECK(config.margin >= 0);
}

int ScalingTable::add(std::string name, Fp8Dtype dtype) {
  const int old_states = size();
  const int length = config_.amax_history_len;
  std::vector<float> history(static_cast<size_t>(length) * (old_states + 1), 0.0f);
  for (int slot = 0; slot < length; ++slot)
    for (int s = 0; s < old_states; ++s)
      history[static_cast<size_t>(slot) * (old_states + 1) + s] = history_[static_cast<size_t>(slot) * old_states + s];
  history_ = std::move(history);
  names_.push_back(std::move(name));
  dtypes_.push_back(dtype);
  scale_.push_back(1.0f);
  scale_inv_.push_back(1.0f);
  initialized_.push_back(0);
  return size() - 1;
}

void ScalingTable::mark_initialized() {
  if (config_.recipe == ScalingRecipe::delayed) std::fill(initialized_.begin(), initialized_.end(), 1);
}

float ScalingTable::scale_for(int index, float tensor_amax) {
  if (!needs_tensor_amax(index)) return scale_[index];
  const float scale = compute_scale(tensor_amax, fp8_max(dtypes_[index]), config_.margin, scale_[index]);
  scale_[index] = scale;
  scale_inv_[index] = 1.0f / scale;
  return scale;
}

void ScalingTable::record_amax(int index, float amax) {
  float& slot = history_[index];  // row 0
  // NaN propagates on purpose: a non-finite amax must be visible to the update rule.
  if (!(amax <= slot)) slot = amax;
}

float window_amax(const float* history, int length, int stride, AmaxComputeAlgo algo) {
  if (algo == AmaxComputeAlgo::most_recent) return history[0];
  float amax = 0.0f;
  for (int i = 0; i < length; ++i) {
    const float value = history[static_cast<size_t>(i) * stride];
    if (std::isnan(value)) return value;  // NaN propagates, as torch.max does
    amax = std::max(amax, value);
  }
  return amax;
}

void roll_history(float* history, int length, int stride) {
  // new[i] = old[i+1], new[last] = old[0]
  const float newest = history[0];
  for (int i = 0; i + 1 < length; ++i) history[static_cast<size_t>(i) * stride] = history[static_cast<size_t>(i + 1) * stride];
  history[static_cast<size_t>(length - 1) * stride] = newest;
  history[0] = 0.0f;
}

std::vector<float> history_from_state_major(const std::vector<float>& state_major, int num_states, int length) {
  FP8LM_CHECK(state_major.size() == static_cast<size_t>(num_states) * length);
  std::vector<float> history(state_major.size());
  for (int s = 0; s < num_states; ++s)
    for (int slot = 0; slot < length; ++slot)
      history[static_cast<size_t>(slot) * num_states + s] = state_major[static_cast<size_t>(s) * length + slot];
  return history;
}

void ScalingTable::discard_current_amaxes() { std::fill(history_.begin(), history_.begin() + size(), 0.0f); }

void ScalingTable::update(int64_t step) {
  if (is_scale_update_step(config_, step)) update_now();
}

void ScalingTable::update_now() {
  const int length = config_.amax_history_len;
  for (int i = 0; i < size(); ++i) {
    float* window = history_.data() + i;
    const float amax = window_amax(window, length, size(), config_.amax_compute_algo);
    const float scale = compute_scale(amax, fp8_max(dtypes_[i]), config_.margin, scale_[i]);
    scale_[i] = scale;
    scale_inv_[i] = 1.0f / scale;
    initialized_[i] = 1;  // from now on the window decides, even if it held only zeros
    roll_history(window, length, size());
  }
}

}  // namespace fp8lm
