// LayerNorm over the last dimension, with learned weight and bias.
//   mean = sum(x)/C, rstd = 1/sqrt(sum((x-mean)^2)/C + eps), out = (x-mean)*rstd*w + b
// Saves mean and rstd per row for backward. BF16 on the GPU (FP32 statistics).
#pragma once

namespace fp8lm::cpu {

// out [N,C], mean [N], rstd [N], inp [N,C], weight [C], bias [C]
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps);

// Accumulates (+=) into dinp [N,C], dweight [C], dbias [C].
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C);

}  // namespace fp8lm::cpu
