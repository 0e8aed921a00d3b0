// The CPU backend of layers/ops.h: every fused op composed from the plain reference
// functions of layers/, core/gemm.h and optim/, in host memory. It is the readable
// specification the CUDA backend is tested against, and what CI trains with.
//
// Every dtype is stored as FP32 holding exactly the values the GPU would hold: a bf16
// tensor holds bf16-rounded values, an FP8 tensor the quantized values fp8(x * scale)
// (the GEMM multiplies by scale_inv, as cuBLASLt does). Activations are FP32 (the GPU
// keeps BF16), so the CPU is the more precise of the two everywhere but in the GEMM
// operands, which it rounds exactly as the GPU does.
#pragma once

#include <memory>

#include "layers/ops.h"

namespace fp8lm {

std::unique_ptr<Ops> make_cpu_ops();

}  // namespace fp8lm
