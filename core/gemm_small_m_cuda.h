// The small-M GEMM: the GEMV-shaped kernel that serves GEMMs of a few rows (decoding steps,
// one row per sequence) in place of cuBLASLt. Same contract as GemmEngine::gemm
// (core/gemm_cuda.h) for the problems it takes:
//
//   D [M,N] = alpha * a_scale_inv * b_scale_inv * (A [M,K] . B [N,K]^T) + beta * C [M,N] (+ bias [N])
//
// with A and B both E4M3 codes (per-tensor scale_inv, device pointers read by the kernel, any
// alignment) or both BF16, C and bias BF16, C nullptr or another buffer than D, M in
// [1, kSmallMMaxRows], K a multiple of 16, A and B 16-byte aligned. D is BF16, or, under the
// GELU epilogue, BF16 or E4M3 (small_m_gemm_refusal says which condition a problem misses).
// M in (kSmallMMaxRows, kSmallMTensorCoreMaxRows] goes to the kernel's tensor-core form, with
// N a multiple of 16, K whole 64-byte chunks, and neither epilogue nor prologue below.
// GemmEngine::gemm decides, in one place, which GEMMs it serves; calling it with anything else
// is a RuntimeError, never a quietly different computation.
//
// The GELU epilogue (GemmArgs::gelu_input; one row, a bias, no C, no d_amax), as Ops' contract (layers/ops.h)
// and CpuOps state it, from the unrounded x = scaled product + bias:
//   gelu_input = bf16(x);   D = bf16(gelu(x)), or, for an E4M3 D, fp8(gelu(x) * *d_scale).
// The amax of an E4M3 D is not taken (cuBLASLt's SET semantics need a second pass): a caller
// that records amaxes uses another path.
//
// The LayerNorm prologue (SmallMLayerNorm, GemmEngine::gemm_after_layernorm; one row, E4M3
// operands): A is not read but
// computed by every block from the LayerNorm's input rows, in layernorm_forward_kernel's order
// (layers/layernorm.cu) - the same bits as layernorm_forward_fp8 followed by this GEMM;
// block 0 also writes the LayerNorm's outputs (A, mean, rstd, the amax), so the op stays
// "LayerNorm, then GEMM" for whoever reads them later. One launch instead of two per LayerNorm
// of a decoding step.
// Both only where they measured faster (device calls 140-141, gpt2-1558m): at one row (batch 1)
// the epilogue took 0.07-0.11 ms off a step and the prologue 0.14 ms off an FP8 step, but it
// cost a BF16 step 0.05 ms, and at eight rows the two together cost 0.4-1.2 ms (every block
// normalizes all rows before its main loop, and the epilogue's registers lower the occupancy).
//
// Why: at M = 1 cuBLASLt's FP8 kernels (tiled for large M) read the weights of gpt2-1558m at
// ~550 GB/s on an H100, its BF16 ones at ~1,170 GB/s (docs/INFERENCE.md), while a decoding
// step's GEMMs are nothing but one pass over the weights. This kernel makes that one pass:
// every warp streams rows of B with 16-byte loads, several loads in flight per lane, and
// multiplies each loaded piece by all M rows of A at once, so B is read exactly once whatever M.
// (Asking L2 for a block's rows of B before the wait for the kernel ahead - one bulk prefetch,
// so that they stream while that kernel runs - made decoding slower: device call 140.)
//
// Numerics (the tensor-core form: mma.sync's sums, whose E4M3 accumulation keeps about 14 bits
// (DeepSeek-V3's report), as cuBLASLt's fast-accumulation FP8 GEMMs of the forward do; below,
// the FP32 form): every product of two E4M3 (or two BF16) values is exact in FP32, and the sums are
// FP32; only the order of the summation differs from the CPU's cpu::gemm_nt (each lane sums its
// 16-byte pieces in K order, then the 32 lanes combine in a fixed butterfly). The epilogue adds
// beta * C, then the bias, to the FP32 result and rounds to BF16 once, as cuBLASLt's epilogue
// and CpuOps' add_epilogue do. No atomics: the result is bit-reproducible.
#pragma once

#include <cstdint>
#include <optional>

#include <cuda_runtime.h>

#include "core/gemm_cuda.h"

namespace fp8lm::cuda {

// The most rows of A one launch takes. Each lane keeps rows_of_B_per_warp x M FP32 sums in
// registers; 8 covers decoding batches up to 8 (beyond, cuBLASLt's tiles start to pay off).
inline constexpr int kSmallMMaxRows = 8;
// Above kSmallMMaxRows and up to this many rows, the tensor-core form (core/gemm_small_m.cu):
// still one pass over B, the products on mma.sync (no GELU epilogue or LayerNorm prologue; N a
// multiple of 16, K whole 64-byte chunks).
inline constexpr int kSmallMTensorCoreMaxRows = 64;
// The rows up to which GemmEngine sends a GEMM here at all (small_m_form): beyond, cuBLASLt's
// kernels are the faster (measured per shape, docs/INFERENCE.md).
inline constexpr int kSmallMTensorCoreRowsE4m3 = 16;
inline constexpr int kSmallMRowsBf16 = 1;
// BF16 outputs this wide (a vocabulary: the LM head) stay here up to kSmallMMaxRows rows.
inline constexpr int kSmallMVocabularyWideN = 32768;

// The LayerNorm prologue: A [M,K] = LayerNorm(input [M,K]) as E4M3 codes (layernorm.h's
// layernorm_forward_fp8 contract, K the row width). Every block of the GEMM normalizes the row
// itself, so its cost grows with the row's width and the GEMM's blocks: it takes rows up to
// kSmallMLayerNormPrologueMaxWidth wide, measured faster than the LayerNorm kernel at 1,600
// (gpt2-1558m, device call 141) and slower at 4,096 (gpt-6.7b: 4.67 against 4.33 ms a decoding
// step, call 190).
inline constexpr int kSmallMLayerNormPrologueMaxWidth = 2048;
struct SmallMLayerNorm {
  const void* input = nullptr;   // [M,K] bf16, 16-byte aligned
  const void* weight = nullptr;  // [K] bf16, 16-byte aligned
  const void* bias = nullptr;    // [K] bf16, 16-byte aligned
  float eps = 1e-5f;
  const float* scale = nullptr;  // the cast's scale (required; A's scale_inv is GemmArgs::a_scale_inv)
  float* amax = nullptr;         // nullable: raised to max |bf16(LayerNorm)| (atomicMax on the bits)
  float* mean = nullptr;         // [M], nullable
  float* rstd = nullptr;         // [M], nullable
  // GemmArgs::A is where block 0 writes the LayerNorm's output (its codes).
};

// The kernel's two forms: FP32 sums on the CUDA cores (M <= kSmallMMaxRows; the epilogue and
// prologue above) and mma.sync on the tensor cores (M <= kSmallMTensorCoreMaxRows).
enum class SmallMForm : uint8_t { fp32_sums, tensor_cores };

// The form a problem gets when none is named: the faster one measured at its M and operand
// type where both take it (docs/INFERENCE.md), else the one that takes it; nullopt when
// neither does (then the GEMM is cuBLASLt's).
std::optional<SmallMForm> small_m_form(const GemmDesc& desc, const GemmArgs& args,
                                       const SmallMLayerNorm* layernorm = nullptr);

// nullptr when the kernel takes the problem (in `form`, or in the form small_m_form picks),
// else the condition it misses (a static string: no allocation on a decoding step's path).
// With `layernorm`, the prologue's conditions too.
const char* small_m_gemm_refusal(const GemmDesc& desc, const GemmArgs& args,
                                 const SmallMLayerNorm* layernorm = nullptr,
                                 std::optional<SmallMForm> form = std::nullopt);

// Queues the GEMM on `stream` (with the LayerNorm prologue when `layernorm` is given), in
// `form` or small_m_form's. Throws RuntimeError for a problem outside the contract above.
void gemm_small_m(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream,
                  const SmallMLayerNorm* layernorm = nullptr, std::optional<SmallMForm> form = std::nullopt);

}  // namespace fp8lm::cuda
