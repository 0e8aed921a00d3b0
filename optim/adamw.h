// AdamW (decoupled weight decay, bias correction) over a whole parameter slab.
//
// Parameters, gradients and the optimizer state all share one TensorLayout, so the
// optimizer walks the layout's tensors and never touches the padding between them
// (padding elements of the params slab are not real parameters and stay as they are).
//
// Per element, with t the 1-based step count and s the gradient scale (the clipping
// coefficient, see optim/grad_clip.h):
//
//     g     = grad * s
//     m     = b1 * m + (1 - b1) * g
//     v     = b2 * v + (1 - b2) * g * g
//     m_hat = m / (1 - b1^t)
//     v_hat = v / (1 - b2^t)
//     param = param - lr * (m_hat / (sqrt(v_hat) + eps) + wd * param)
//
// wd is the weight decay for tensors with TensorInfo::weight_decay (2-D weights) and 0
// for the others (biases, LayerNorm gains). The decay uses the parameter before this
// step's update, as torch.optim.AdamW does.
//
// State precision (--optimizer-state-precision):
//
//   fp32      m and v as FP32 slabs: 8 bytes of state per parameter.
//
//   fp8_fp16  the FP8-LLM / MS-AMP recipe: 3 bytes of state per parameter.
//             The params slab the caller passes is the FP32 master copy. The first
//             moment m is stored as E4M3 codes (a uint8 slab), the second moment v as
//             FP16 bits (a uint16 slab), each with ONE scale per tensor:
//
//                 stored = encode(value * scale)       (round to nearest even, saturating)
//                 value  = decode(stored) * scale_inv  (scale_inv = 1.0f / scale, in FP32)
//
//             Only the scales are state; scale_inv is derived from them (one FP32
//             division per tensor), so a checkpoint holds the codes and the scales.
//             Each step, for each tensor:
//               pass 1: dequantize m and v, apply the moment update above, and reduce
//                       amax_m = max |m| and amax_v = max v over the UPDATED moments;
//               new scales: m_scale = 448 / amax_m, v_scale = 65504 / amax_v
//                       (compute_scale() of core/scaling.h with margin 0: scale 1 when
//                       the amax is 0 or not finite, capped at FLT_MAX);
//               pass 2: recompute the same updated m and v (same inputs, same
//                       operations, so the same values), update the parameter with
//                       these FP32 values, and re-quantize m and v with the new scales.
//             The parameter update uses this step's FP32 moments before they are
//             re-quantized (MS-AMP does the same): quantization error enters the next
//             step's moments, never this step's update. Consequently the first step of
//             fp8_fp16 matches the fp32 optimizer bit for bit (both start from zeros).
//             Why per-tensor scales from the updated amax: m and v shrink and grow over
//             training, and v spans g^2 (1e-10 for g = 1e-5 sits below FP16's smallest
//             subnormal, 6e-8); mapping each tensor's amax onto the format's maximum
//             keeps its large entries at full relative precision (E4M3: 2^-4, FP16:
//             2^-11). Entries far below the amax still flush to zero: about 6 decades
//             below it for E4M3 (smallest subnormal 2^-9 vs 448) and 12 for FP16.
//             E4M3's 3-bit mantissa is what makes the run drift from fp32 (a few percent
//             of the distance travelled on the toy problem of tests/test_optim.cpp).
//
// GPU contract. The CUDA kernel must reproduce these semantics exactly: the amax is
// taken over the updated moments of this step (not the stored ones, not a history),
// the scale comes from that amax through compute_scale(), the parameter update uses the
// unquantized updated moments, and quantization rounds to nearest even and saturates
// (__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); __float2half_rn after clamping to
// 65504). It may recompute the moments in its second pass (as the CPU does) or keep
// them in scratch memory; either gives the same values. The per-element arithmetic lives
// in adamw_moments() / adamw_param() below, shared by both sides; bit-exact agreement
// additionally needs the kernel compiled without FMA contraction (--fmad=false or
// __fmul_rn/__fadd_rn), otherwise expect differences of an ulp or so.
//
// The optimizer assumes finite gradients: the caller computes the gradient norm first
// and skips the step (does not call step()) when it is not finite.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "core/fp8.h"
#include "core/scaling.h"
#include "core/tensor.h"

namespace fp8lm {

enum class OptimizerStatePrecision : uint8_t { fp32, fp8_fp16 };

std::string_view to_string(OptimizerStatePrecision precision);  // "fp32", "fp8-fp16"

// Storage formats of the fp8_fp16 moments.
inline constexpr Fp8Dtype kFirstMomentDtype = Fp8Dtype::e4m3;
// A working-offsets entry (AdamWCall::working_offsets, the kernels' working_offsets) for a
// tensor without a working value: AdamW writes none for it.
inline constexpr uint64_t kNoWorkingValue = ~uint64_t{0};

struct AdamWHyperparams {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;  // Megatron's --adam-beta2 default, as TrainOptions'
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // applied to tensors with TensorInfo::weight_decay only
};

// Everything one tensor's update needs besides its data, fixed for the whole step.
// The host computes it once per step (bias corrections in double, then rounded to
// float), so the CPU reference and the GPU kernel use the same float constants.
struct AdamWStepScalars {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;      // 0 for tensors that are not decayed
  float bias_correction1;  // 1 - beta1^t
  float bias_correction2;  // 1 - beta2^t
  float grad_scale;        // clipping coefficient, multiplies every gradient
};

// The scalars of one step from the hyperparameters and the bias corrections 1 - beta^t
// (computed in double by the caller). One definition for the host and the kernels.
FP8LM_HOST_DEVICE inline AdamWStepScalars adamw_scalars(const AdamWHyperparams& hp, bool decay, float grad_scale,
                                                        float bias_correction1, float bias_correction2) {
  AdamWStepScalars s;
  s.lr = hp.lr;
  s.beta1 = hp.beta1;
  s.beta2 = hp.beta2;
  s.eps = hp.eps;
  s.weight_decay = decay ? hp.weight_decay : 0.0f;
  s.bias_correction1 = bias_correction1;
  s.bias_correction2 = bias_correction2;
  s.grad_scale = grad_scale;
  return s;
}

// The hyperparameters' ranges (the CLI validated the user's values; this guards the code
// paths that build them): RuntimeError otherwise. Both the CPU step and the kernels call it.
void check_adamw_hyperparams(const AdamWHyperparams& hp);

// Step t (1-based) of the hyperparameters, for a tensor that is (or is not) decayed.
AdamWStepScalars adamw_step_scalars(const AdamWHyperparams& hp, int64_t t, float grad_scale,
                                    bool decay);

// Single-rounding FP32 operations: on the GPU spelled with the _rn intrinsics, which
// nvcc never contracts into an FMA, so the kernel computes exactly what the host does
// (g++ in ISO mode does not contract, and x86-64's baseline has no FMA).
namespace exact {
#if defined(__CUDA_ARCH__)
FP8LM_HOST_DEVICE inline float mul(float a, float b) { return __fmul_rn(a, b); }
FP8LM_HOST_DEVICE inline float add(float a, float b) { return __fadd_rn(a, b); }
FP8LM_HOST_DEVICE inline float sub(float a, float b) { return __fsub_rn(a, b); }
FP8LM_HOST_DEVICE inline float div(float a, float b) { return __fdiv_rn(a, b); }
FP8LM_HOST_DEVICE inline float sqrt(float a) { return __fsqrt_rn(a); }
#else
inline float mul(float a, float b) { return a * b; }
inline float add(float a, float b) { return a + b; }
inline float sub(float a, float b) { return a - b; }
inline float div(float a, float b) { return a / b; }
inline float sqrt(float a) { return std::sqrt(a); }
#endif
}  // namespace exact

// The moment update of one element (m and v in and out, FP32):
//   g = grad * s;  m = b1*m + (1-b1)*g;  v = b2*v + ((1-b2)*g)*g
FP8LM_HOST_DEVICE inline void adamw_moments(float grad, float& m, float& v, const AdamWStepScalars& s) {
  const float g = exact::mul(grad, s.grad_scale);
  m = exact::add(exact::mul(s.beta1, m), exact::mul(exact::sub(1.0f, s.beta1), g));
  v = exact::add(exact::mul(s.beta2, v), exact::mul(exact::mul(exact::sub(1.0f, s.beta2), g), g));
}

// The parameter update of one element from its updated moments; returns the new value:
//   param - lr * (m_hat / (sqrt(v_hat) + eps) + wd * param)
FP8LM_HOST_DEVICE inline float adamw_param(float param, float m, float v, const AdamWStepScalars& s) {
  const float m_hat = exact::div(m, s.bias_correction1);
  const float v_hat = exact::div(v, s.bias_correction2);
  const float update = exact::add(exact::div(m_hat, exact::add(exact::sqrt(v_hat), s.eps)),
                                  exact::mul(s.weight_decay, param));
  return exact::sub(param, exact::mul(s.lr, update));
}

// The per-tensor scale of a stored moment: maps amax onto the format's largest value
// (448 for E4M3 m, 65504 for FP16 v). 1 when amax is 0 or not finite.
FP8LM_HOST_DEVICE inline float moment_scale(float amax, float format_max) {
  return compute_scale(amax, format_max, /*margin=*/0, /*previous_scale=*/1.0f);
}

namespace cpu {

// One tensor, fp32 state. All arrays [n]; params, m, v updated in place.
void adamw_tensor_fp32(float* params, const float* grads, float* m, float* v, size_t n,
                       const AdamWStepScalars& s);

// One tensor, fp8_fp16 state, in two passes; all arrays [n]. First the updated moments'
// amaxes (running maxima into amax_m, amax_v), then the update with the new scales
// moment_scale(amax_m), moment_scale(amax_v): params, m_codes (E4M3) and v_bits (FP16) in
// place; m_scale and v_scale are read to dequantize the stored moments, then overwritten.
void adamw_moment_amax_fp8_fp16(const float* grads, const uint8_t* m_codes, const uint16_t* v_bits, size_t n,
                                float m_scale, float v_scale, const AdamWStepScalars& s, float& amax_m, float& amax_v);
void adamw_apply_fp8_fp16(float* params, const float* grads, uint8_t* m_codes, uint16_t* v_bits, size_t n,
                          float& m_scale, float& v_scale, float amax_m, float amax_v, const AdamWStepScalars& s);

}  // namespace cpu

// The state slabs of one optimizer, [layout.total_elements()] each with the layout's
// offsets (scales: [tensors]); the other precision's pointers are unused.
struct AdamWStateSlabs {
  float* m32 = nullptr;          // fp32
  float* v32 = nullptr;          // fp32
  uint8_t* m8 = nullptr;         // fp8_fp16: E4M3 codes of m * m_scale
  uint16_t* v16 = nullptr;       // fp8_fp16: FP16 bits of v * v_scale
  float* m_scales = nullptr;     // fp8_fp16
  float* v_scales = nullptr;     // fp8_fp16
};

namespace cpu {

// One step (t already counted, 1-based) over every tensor of `layout`.
void adamw_step(const TensorLayout& layout, OptimizerStatePrecision precision, float* params, const float* grads,
                const AdamWStateSlabs& state, const AdamWHyperparams& hp, int64_t t, float grad_scale);

// The same step in two halves, for state sharded across ranks (ZeRO-1), where a tensor's
// FP8/FP16 moment scales must come from the amax over every rank's part of it:
//   adamw_moment_amaxes: fp8_fp16 pass 1; amaxes [2, tensors] (m then v) += as running
//                        maxima of this rank's updated moments (nothing else written);
//   (the caller MAX-reduces amaxes across ranks)
//   adamw_apply:         the new scales from amaxes, the parameter update and the
//                        re-quantization (fp32 state: the whole update; amaxes unused).
// With one rank, the two halves are adamw_step bit for bit.
// grad_layout (optional): where each tensor's gradient sits in `grads`, when not at layout's
// offsets (ZeRO-1 reduces the gradients in place in the model's slab while the parameters
// and the state are packed in the shard); the same tensors and numels as layout.
// first_tensor, end_tensor: only tensors [first_tensor, end_tensor) (end_tensor past the last:
// to the end), for the first pass run in parts (Ops::adamw_first_pass_part).
void adamw_moment_amaxes(const TensorLayout& layout, const float* grads, const AdamWStateSlabs& state,
                         const AdamWHyperparams& hp, int64_t t, float grad_scale, float* amaxes,
                         const TensorLayout* grad_layout = nullptr, size_t first_tensor = 0,
                         size_t end_tensor = SIZE_MAX);
void adamw_apply(const TensorLayout& layout, OptimizerStatePrecision precision, float* params, const float* grads,
                 const AdamWStateSlabs& state, const AdamWHyperparams& hp, int64_t t, float grad_scale,
                 const float* amaxes, const TensorLayout* grad_layout = nullptr);

}  // namespace cpu

// The CPU reference optimizer: owns the moment state (host memory) for a layout.
class AdamW {
 public:
  // State starts at zero (all codes 0, all scales 1) and step_count() at 0.
  AdamW(const TensorLayout& layout, OptimizerStatePrecision precision);

  // One optimizer step over every tensor of the layout. Increments the step count
  // first, so the first call runs with t = 1.
  //   params [layout.total_elements()]  FP32 (master) weights, updated in place
  //   grads  [layout.total_elements()]  gradients, unscaled; finite (see top of file)
  //   grad_scale                        clipping coefficient in (0, 1]; 1 = no clipping
  void step(float* params, const float* grads, const AdamWHyperparams& hp, float grad_scale = 1.0f);

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t t);  // checkpoint restore

  const TensorLayout& layout() const { return layout_; }
  OptimizerStatePrecision precision() const { return precision_; }

  // Bytes of moment state per parameter, excluding the 4-byte FP32 master weights:
  // 8 for fp32, 3 for fp8_fp16 (the per-tensor scales are negligible).
  double state_bytes_per_parameter() const;
  // Bytes actually held: the state slabs (padding included) plus the per-tensor scales.
  size_t state_bytes() const;

  // ---- Raw state, for checkpoints and for comparing against the GPU.
  // Slabs are [layout.total_elements()] with the layout's offsets; scales are
  // [layout.tensors().size()] in layout order. Accessors of the other precision's
  // slabs return empty spans.
  std::span<float> m32() { return m32_; }                // fp32: first moment
  std::span<float> v32() { return v32_; }                // fp32: second moment
  std::span<uint8_t> m8() { return m8_; }                // fp8_fp16: E4M3 codes of m * m_scale
  std::span<uint16_t> v16() { return v16_; }             // fp8_fp16: FP16 bits of v * v_scale
  std::span<float> m_scales() { return m_scales_; }      // fp8_fp16: one per tensor
  std::span<float> v_scales() { return v_scales_; }      // fp8_fp16: one per tensor
  std::span<const float> m32() const { return m32_; }
  std::span<const float> v32() const { return v32_; }
  std::span<const uint8_t> m8() const { return m8_; }
  std::span<const uint16_t> v16() const { return v16_; }
  std::span<const float> m_scales() const { return m_scales_; }
  std::span<const float> v_scales() const { return v_scales_; }

  // Element `index` of the slab (a real parameter, not padding) as FP32, dequantized
  // in fp8_fp16: for tests and diagnostics.
  float first_moment(size_t index) const;
  float second_moment(size_t index) const;

 private:
  size_t tensor_of(size_t index) const;  // the tensor holding slab element `index`

  TensorLayout layout_;
  OptimizerStatePrecision precision_;
  int64_t step_count_ = 0;
  std::vector<float> m32_, v32_;
  std::vector<uint8_t> m8_;
  std::vector<uint16_t> v16_;
  std::vector<float> m_scales_, v_scales_;
};

}  // namespace fp8lm
