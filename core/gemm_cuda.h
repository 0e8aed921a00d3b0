// GPU GEMM through cuBLASLt (and, for a few rows, the small-M kernel of
// core/gemm_small_m_cuda.h): the device twin of cpu::gemm_nt (core/gemm.h).
//
//   D [M,N] = alpha * a_scale_inv * b_scale_inv * (A [M,K] . B [N,K]^T) + beta * C [M,N]
//             (+ bias [N], broadcast over the M rows)
//
// Row-major everywhere, both operands contiguous along K ("NT", the only layout Hopper's
// FP8 tensor cores take). a_scale_inv / b_scale_inv are DEVICE pointers to one float
// (the scaling table's scale_inv of the operand), read by the GEMM kernel itself, so a
// scale updated on the GPU needs no host sync. nullptr means 1.
//
// Supported (cuBLAS docs, cublasLtMatmul "Datatypes Supported" and the FP8 table):
//   A x B            D (= C type)   bias
//   bf16 x bf16      bf16           bf16
//   bf16 x bf16      fp32           fp32
//   fp8  x fp8       bf16           bf16     fp8 = e4m3 x e4m3, e5m2 x e4m3, e4m3 x e5m2
//   fp8  x fp8       fp32           bf16     (e5m2 x e5m2 has no cuBLASLt kernel)
//   e4m3 x e4m3      e4m3           bf16     D = fp8(d_scale * result); C is never read (no C)
// FP8 also needs K and N multiples of 16 and 16-byte-aligned A, B, C, D and bias pointers
// (checked: RuntimeError). cuBLASLt needs 16-byte-aligned scale_inv pointers as well (also
// checked; the small-M kernel, which cuBLASLt's rule does not bind, takes any): the CUDA
// backend keeps every scaling state's scale_inv 16 bytes apart, so none is ever copied.
//
// Block scaling (--fp8-recipe blockwise, core/block_scaling.h): with a_scaling / b_scaling
// tiles_1x128 (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) or blocks_128x128
// (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F), a_scale_inv / b_scale_inv point at the
// operand's scale array in core/block_scaling.h's layout (16-byte aligned). cuBLASLt 13 on
// Hopper takes 1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128, with FP8 operands, fast
// accumulation off, K a multiple of 16 (the last 128-wide block may be partial) and M, N
// multiples of 8;
// anything else (2D x 2D, a block mode beside a per-tensor one, fast accumulation) is a
// RuntimeError naming the combination, never a fallback.
//
// C may be nullptr (beta must be 0; C is not read), equal to D (accumulate in place, e.g.
// the wgrad GEMM adding into the FP32 gradient slab with beta = 1), or another buffer of
// D's type and shape (residual add: D = GEMM + bias + residual with beta = 1).
//
// The GELU epilogue (GemmArgs::gelu_input, cuBLASLt's GELU_AUX_BIAS; GPT-2's tanh form):
//   gelu_input [M,N] bf16 = bf16(result + bias)        (the GELU backward's input)
//   D [M,N]              = gelu(result + bias)         (FP32, then D's type: an E4M3 D is
//                                                       fp8(d_scale * gelu(...)), d_amax set
//                                                       to max |gelu(...)|)
// It needs a bf16 bias, no C, and D bf16 or e4m3 (cuBLASLt 13.1 on H100 refuses an E4M3 D
// with a GELU epilogue and no bias: device call 94). The epilogue's GELU is cuBLASLt's, not
// layers/gelu.h's: an E4M3 D equals fp8(gelu(bf16(result + bias))) in about 97% of the
// codes, and differs by one step in the rest (call 94).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string_view>

#include <cuda_runtime.h>

#include "core/fp8.h"
#include "core/gemm.h"

// cuBLASLt's handle type, declared here so this header does not pull in cublasLt.h.
struct cublasLtContext;

namespace fp8lm::cuda {

enum class GemmType : uint8_t { bf16, fp32, e4m3, e5m2 };

struct SmallMLayerNorm;  // core/gemm_small_m_cuda.h

std::string_view to_string(GemmType type);
constexpr bool is_fp8(GemmType type) { return type == GemmType::e4m3 || type == GemmType::e5m2; }
constexpr size_t gemm_type_bytes(GemmType type) {
  return type == GemmType::fp32 ? 4 : type == GemmType::bf16 ? 2 : 1;
}

// How an operand's scale_inv pointer is read: one float (per-tensor scaling), or an array of
// block scales (core/block_scaling.h). Mirrors BlockScaling (core/tensor.h).
enum class GemmScaling : uint8_t { tensor, tiles_1x128, blocks_128x128 };
std::string_view to_string(GemmScaling scaling);

// What the GEMM is: shape, types and flags. Together with which optional pointers are
// present and the pointers' alignments, this is the engine's cache key.
struct GemmDesc {
  int M = 0;
  int N = 0;
  int K = 0;
  GemmType a_type = GemmType::bf16;     // A [M,K]
  GemmType b_type = GemmType::bf16;     // B [N,K]
  GemmType d_type = GemmType::bf16;     // D [M,N] and C [M,N]
  GemmType bias_type = GemmType::bf16;  // bias [N], when GemmArgs::bias is set (see the table above)
  bool fast_accum = false;              // FP8 only (CUBLASLT_MATMUL_DESC_FAST_ACCUM); ignored for BF16
  // BF16 only: the operand is stored transposed, A as [K,M] or B as [K,N] (row-major), so
  // BF16 dgrad and wgrad need no transposed copies. FP8 requires both false (Hopper's
  // FP8 tensor cores take K-contiguous operands only).
  bool a_transposed = false;
  bool b_transposed = false;
  // FP8 only: how a_scale_inv / b_scale_inv are laid out (both tensor, or both block modes).
  GemmScaling a_scaling = GemmScaling::tensor;
  GemmScaling b_scaling = GemmScaling::tensor;
};

// The pointers and scalars of one call; they may change from call to call at no cost.
struct GemmArgs {
  void* D = nullptr;                     // [M,N] d_type, written (=) or accumulated (C == D)
  const void* A = nullptr;               // [M,K] a_type
  const void* B = nullptr;               // [N,K] b_type
  const void* C = nullptr;               // [M,N] d_type: nullptr, D itself, or another buffer
  const void* bias = nullptr;            // [N] bias_type, nullptr: no bias
  const float* a_scale_inv = nullptr;    // device, [1] (or A's block scales); FP8 A only; nullptr: 1
  const float* b_scale_inv = nullptr;    // device, [1] (or B's block scales); FP8 B only; nullptr: 1
  float alpha = 1.0f;                    // host value
  float beta = 0.0f;                     // host value; must be 0 when C is nullptr
  const float* d_scale = nullptr;        // device, [1]; an FP8 D only (required): D = fp8(d_scale * result)
  float* d_amax = nullptr;               // device, [1]; an FP8 D only, optional: SET (not raised) to max |result|
  void* gelu_input = nullptr;            // [M,N] bf16; the GELU epilogue (above), nullptr: none
};

// Owns the cuBLASLt handle, one 32 MiB workspace and a cache of matmul plans (the
// descriptor, the four layouts and the heuristic's algorithm) keyed by the whole
// problem signature. A cache hit creates and destroys nothing: the per-call pointers
// (scale_inv, bias) are attributes of the cached descriptor and are set on it before
// each cublasLtMatmul (a host-side write, no allocation; cuBLASLt reads the descriptor
// when the call is made, so a later change does not affect work already queued).
//
// A GEMM of at most kSmallMMaxRows rows that the small-M kernel takes (core/gemm_small_m_cuda.h:
// a decoding step's, one row per sequence) runs there instead, unless the engine was made with
// SmallMGemm::off; GemmEngine::gemm makes that choice, in one place.
//
// Not thread-safe, and the one workspace serializes work: use one engine per stream
// (or per thread), on the device that was current when the engine was made.
class GemmEngine {
 public:
  // Hopper's recommended cuBLASLt workspace.
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  explicit GemmEngine(SmallMGemm small_m = SmallMGemm::on,
                      GemmAlgorithmChoice algorithm_choice = GemmAlgorithmChoice::timed);
  ~GemmEngine();
  GemmEngine(const GemmEngine&) = delete;
  GemmEngine& operator=(const GemmEngine&) = delete;

  // Queues the GEMM on `stream`. Throws RuntimeError (with a HINT) for an unsupported
  // combination, or when cuBLASLt has no algorithm for the shape and alignment.
  void gemm(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream);

  // The GEMM whose A is computed by the small-M kernel's LayerNorm prologue
  // (core/gemm_small_m_cuda.h): one launch for a decoding step's LayerNorm and the GEMM after
  // it. Returns false, queuing nothing, when the small-M kernel is off or refuses the problem;
  // the caller then runs the LayerNorm and gemm() itself.
  bool gemm_after_layernorm(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm& layernorm,
                            cudaStream_t stream);
  // Whether GEMMs of a few rows may go to the small-M kernel (SmallMGemm::on).
  bool small_m_enabled() const { return small_m_ == SmallMGemm::on; }
  // Whether gemm() (with `layernorm`: gemm_after_layernorm()) would send this problem to the
  // small-M kernel: the one routing rule, also for callers that choose between two ways of
  // computing something (a fused cuBLASLt epilogue, or the small-M GEMM and a kernel after it).
  bool routes_to_small_m(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm* layernorm = nullptr) const;

  // Number of cached plans (tests: repeating a call must not grow it).
  size_t cache_size() const { return plans_.size(); }
  // GEMMs served by the small-M kernel so far (tests: which path a call took).
  size_t small_m_calls() const { return small_m_calls_; }
  // Plans whose algorithm was chosen by timing, and of those, the ones that kept another
  // candidate than the heuristic's first (tests, and the record of what the choice did).
  size_t timed_plans() const { return timed_plans_; }
  size_t plans_not_first() const { return plans_not_first_; }

  struct Key {
    int M, N, K;
    GemmType a_type, b_type, d_type, bias_type;
    bool has_bias, fast_accum, has_a_scale, has_b_scale, a_transposed, b_transposed, has_d_amax, gelu;
    GemmScaling a_scaling, b_scaling;
    uint8_t c_mode;  // 0: no C, 1: C == D, 2: C is another buffer
    uint16_t align_a, align_b, align_c, align_d, align_bias, align_gelu_input;  // bytes, capped at 256
    auto operator<=>(const Key&) const = default;
  };
  struct Plan;

 private:
  Plan& plan_for(const Key& key, const GemmArgs& args, cudaStream_t stream);
  // Times the candidates on the call's operands; returns the index of the one to keep.
  int choose_by_timing(const Key& key, Plan& plan, const GemmArgs& args, const void* candidates, int count,
                       cudaStream_t stream);

  SmallMGemm small_m_;
  GemmAlgorithmChoice algorithm_choice_;
  size_t small_m_calls_ = 0;
  size_t timed_plans_ = 0;
  size_t plans_not_first_ = 0;
  cublasLtContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace fp8lm::cuda
