// Linear layer: out = inp . W^T + b, with W stored [out_features, in_features]
// (PyTorch's layout; Hugging Face GPT-2's Conv1D stores the transpose, converted at
// import/export). All three GEMMs go through core/gemm.h in the run's precision.
//
// Under fp8 each Linear owns three scaling states: its input and weight (E4M3) and
// its output gradient (E5M2 under hybrid). Forward records the input and weight
// amaxes, backward the output gradient's; ScalingTable::update() turns them into the
// next scales once per optimizer step.
#pragma once

#include "core/gemm.h"
#include "core/scaling.h"

namespace fp8lm {

// ScalingTable indices of one Linear's FP8 operands.
struct LinearFp8Operands {
  int input = -1;
  int weight = -1;
  int grad_output = -1;
};

// How one Linear's GEMMs run.
struct LinearPrecision {
  GemmPrecision precision = GemmPrecision::fp32;
  ScalingTable* scaling = nullptr;  // required for fp8
  LinearFp8Operands operands;
  bool record_amax = true;  // false for evaluation passes, which must not steer training scales
};

// Registers the three operands of a Linear named `name` ("h.0.attn.c_attn") in `table`.
LinearFp8Operands register_linear_operands(ScalingTable& table, const std::string& name);

namespace cpu {

// out [M,N] = inp [M,K] . weight [N,K]^T + bias [N]   (bias may be null)
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int M, int N, int K,
                    const LinearPrecision& precision);

// dinp [M,K] = dout [M,N] . weight [N,K]          (written; may be null to skip)
// dweight [N,K] += dout^T . inp                   (accumulated)
// dbias [N] += column sums of dout                (accumulated; may be null) — from the
//              unquantized gradient, as the GPU's fused cast+dbias kernel does.
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int M, int N, int K, const LinearPrecision& precision);

}  // namespace cpu
}  // namespace fp8lm
