// The CUDA backend of layers/ops.h: the fused kernels of layers/, core/ and optim/ and
// cuBLASLt GEMMs, all enqueued on one stream. A step never waits for the host: scales,
// amaxes, the clip coefficient and the skip decision stay on the device.
//
// Plain C++ header (no kernels), usable from .cpp files compiled by g++.
#pragma once

#include <cstddef>
#include <memory>

#include "core/gemm.h"
#include "core/gpt_config.h"
#include "layers/ops.h"

namespace fp8lm {

// On CUDA device `device` (this rank's local rank in a parallel run). small_m: whether GEMMs of
// a few rows (decoding steps) run the small-M kernel or cuBLASLt (core/gemm_cuda.h).
// background_yields: the main and side lanes' streams get the highest priority, so that the
// background lane's blocks take only what theirs leave free (the default priority is already
// the lowest); otherwise every lane has the default priority. Only where the background lane
// carries work beside the main lane's (AdamW's first pass on one rank): two data-parallel
// H100s measured 0.2% slower steps with the priorities raised (device call 106).
// fast_accumulation: which per-tensor FP8 GEMMs skip FP32 promotion (core/gemm.h).
std::unique_ptr<Ops> make_cuda_ops(int device = 0, SmallMGemm small_m = SmallMGemm::on,
                                   GemmAlgorithmChoice gemm_algorithm = GemmAlgorithmChoice::timed,
                                   bool background_yields = false,
                                   Fp8FastAccumulation fast_accumulation = Fp8FastAccumulation::forward);

// The int32 values one micro-batch of B x T tokens stages to the device: inputs, targets, the
// embedding backward's index (unique tokens, offsets, rows) and the documents' index
// (layers/documents.h: starts, position ids, position offsets, rows by position).
inline size_t cuda_token_slot_ints(size_t B, size_t T) { return 8 * B * T + T + 2; }

// Refuses (InputError, before anything is allocated) a model the kernels cannot run: the
// LayerNorm width limit, the attention head sizes, and --fp32 (a CPU reference mode).
void check_cuda_model_support(const GptConfig& config, bool fp32_gemms);

}  // namespace fp8lm
