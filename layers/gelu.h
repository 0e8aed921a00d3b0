// GPT-2's tanh-approximated GELU ("gelu_new"):
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// On the GPU it is fused with the preceding bias add and the FP8 cast of the next
// GEMM's input; here it is the plain elementwise spec.
#pragma once

#include <cstddef>

namespace fp8lm::cpu {

float gelu(float x);
float gelu_derivative(float x);

// out [N] = gelu(inp [N])
void gelu_forward(float* out, const float* inp, size_t N);
// dinp [N] = dout [N] * gelu'(inp [N])  (written, not accumulated)
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N);

}  // namespace fp8lm::cpu
