// Decoder set-ups shared by the decoding tests.
#pragma once

#include <algorithm>
#include <cstdint>

#include "layers/gpt.h"
#include "layers/ops.h"

namespace fp8lm::testing {

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
