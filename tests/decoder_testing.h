// Decoder set-ups shared by the decoding tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "layers/gpt.h"
#include "layers/ops.h"

namespace fp8lm::testing {

// GPT-2's initialisation from `seed` as the model's weights: into its working copy (the
// activation dtype), then its GEMM operands (the FP8 weights cast from the working copy).
inline void set_random_weights(Ops& ops, GptModel& model, const GptConfig& config, uint64_t seed = 5) {
  std::vector<float> values(model.layout().total_elements());
  init_gpt_parameters(values.data(), model.layout(), config, seed);
  Tensor working;
  working.data = model.working();
  working.dtype = ops.activation_dtype();
  working.rows = 1;
  working.cols = int64_t(values.size());
  ops.upload_values(working, values.data());
  model.refresh_weight_operands();
  ops.synchronize();
}

// Stored (delayed) scales for every activation operand of `model`, as a trained checkpoint
// brings them: `scale` = 448 / 8 suits GPT-2's initialisation, which keeps them well inside
// +-8. The weights keep the scales their casts took, and every state counts as updated, so
// the producers cast with the stored scales in their own kernels and no step takes an amax.
inline void set_stored_activation_scales(Ops& ops, GptModel& model, float scale = 56.0f) {
  ops.download_scaling();
  ScalingTable& table = model.scaling();
  for (int i = 0; i < table.size(); ++i) {
    if (!is_linear_input_state(table.name(i))) continue;
    table.scales()[size_t(i)] = scale;
    table.scale_invs()[size_t(i)] = 1.0f / scale;
  }
  std::fill(table.initialized_flags().begin(), table.initialized_flags().end(), uint8_t{1});
  ops.upload_scaling();
}

}  // namespace fp8lm::testing
