#include "layers/gelu.h"

#include <cmath>

namespace fp8lm::cpu {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kCubicCoefficient = 0.044715f;
}  // namespace

float gelu(float x) {
  const float u = kSqrt2OverPi * (x + kCubicCoefficient * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(u));
}

// d/dx [0.5 x (1 + tanh u)] = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx,
// with du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
float gelu_derivative(float x) {
  const float u = kSqrt2OverPi * (x + kCubicCoefficient * x * x * x);
  const float tanh_u = std::tanh(u);
  const float du_dx = kSqrt2OverPi * (1.0f + 3.0f * kCubicCoefficient * x * x);
  return 0.5f * (1.0f + tanh_u) + 0.5f * x * (1.0f - tanh_u * tanh_u) * du_dx;
}

void gelu_forward(float* out, const float* inp, size_t N) {
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) out[i] = gelu(inp[i]);
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N) {
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) dinp[i] = dout[i] * gelu_derivative(inp[i]);
}

}  // namespace fp8lm::cpu
