// Residual connection: out = a + b. Its backward is the identity into both branches,
// which the model expresses by accumulating one gradient buffer.
#pragma once

#include <cstddef>

namespace fp8lm::cpu {

// out [N] = a [N] + b [N]
void residual_forward(float* out, const float* a, const float* b, size_t N);

}  // namespace fp8lm::cpu
