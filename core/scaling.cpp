#include "core/scaling.h"

#include <algorithm>

#include "core/error.h"

namespace fp8lm {

std::string_view to_string(ScalingRecipe recipe) {
  return recipe == ScalingRecipe::delayed ? "delayed" : "tensorwise";
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
  names_.push_back(std::move(name));
  dtypes_.push_back(dtype);
  history_.resize(history_.size() + config_.amax_history_len, 0.0f);
  scale_.push_back(1.0f);
  scale_inv_.push_back(1.0f);
  initialized_.push_back(0);
  return size() - 1;
}

float ScalingTable::scale_for(int index, float tensor_amax) {
  if (!needs_tensor_amax(index)) return scale_[index];
  const float scale = compute_scale(tensor_amax, fp8_max(dtypes_[index]), config_.margin, scale_[index]);
  scale_[index] = scale;
  scale_inv_[index] = 1.0f / scale;
  return scale;
}

void ScalingTable::record_amax(int index, float amax) {
  float& slot = history_[static_cast<size_t>(index) * config_.amax_history_len];
  // NaN propagates on purpose: a non-finite amax must be visible to the update rule.
  if (!(amax <= slot)) slot = amax;
}

float window_amax(const float* history, int length, AmaxComputeAlgo algo) {
  if (algo == AmaxComputeAlgo::most_recent) return history[0];
  float amax = 0.0f;
  for (int i = 0; i < length; ++i) {
    if (std::isnan(history[i])) return history[i];  // NaN propagates, as torch.max does
    amax = std::max(amax, history[i]);
  }
  return amax;
}

void roll_history(float* history, int length) {
  std::rotate(history, history + 1, history + length);  // new[i] = old[i+1], new[last] = old[0]
  history[0] = 0.0f;
}

void ScalingTable::discard_current_amaxes() {
  for (int i = 0; i < size(); ++i) history_[static_cast<size_t>(i) * config_.amax_history_len] = 0.0f;
}

void ScalingTable::update(int64_t step) {
  if (config_.recipe != ScalingRecipe::delayed) return;
  if ((step + 1) % config_.interval != 0) return;
  const int length = config_.amax_history_len;
  for (int i = 0; i < size(); ++i) {
    float* window = history_.data() + static_cast<size_t>(i) * length;
    const float amax = window_amax(window, length, config_.amax_compute_algo);
    const float scale = compute_scale(amax, fp8_max(dtypes_[i]), config_.margin, scale_[i]);
    scale_[i] = scale;
    scale_inv_[i] = 1.0f / scale;
    initialized_[i] = 1;  // from now on the window decides, even if it held only zeros
    roll_history(window, length);
  }
}

}  // namespace fp8lm
