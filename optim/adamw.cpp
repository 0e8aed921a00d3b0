#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace fp8lm {

std::string_view to_string(OptimizerStatePrecision precision) {
  return precision == OptimizerStatePrecision::fp32 ? "fp32" : "fp8-fp16";
}

void check_adamw_hyperparams(const AdamWHyperparams& hp) {
  FP8LM_CHECK(hp.beta1 >= 0.0f && hp.beta1 < 1.0f, "beta1=", hp.beta1);
  FP8LM_CHECK(hp.beta2 >= 0.0f && hp.beta2 < 1.0f, "beta2=", hp.beta2);
  FP8LM_CHECK(hp.eps >= 0.0f && hp.lr >= 0.0f && hp.weight_decay >= 0.0f, "eps=", hp.eps, " lr=", hp.lr,
              " weight_decay=", hp.weight_decay);
}

AdamWStepScalars adamw_step_scalars(const AdamWHyperparams& hp, int64_t t, float grad_scale,
                                    bool decay) {
  FP8LM_CHECK(t >= 1, "t=", t);
  // In double: 1 - b2^t for b2 = 0.999 and t = 1 loses half its digits in FP32 powers.
  const auto correction = [t](float beta) {
    return static_cast<float>(1.0 - std::pow(static_cast<double>(beta), static_cast<double>(t)));
  };
  return adamw_scalars(hp, decay, grad_scale, correction(hp.beta1), correction(hp.beta2));
}

namespace {

// Below this many elements a tensor is updated by one thread: the fork/join would
// cost more than the loop (biases and LayerNorm gains are 768 elements).
constexpr size_t kParallelThreshold = 1 << 14;

constexpr float kFirstMomentMax = kE4M3Max;  // m is stored as E4M3
constexpr float kSecondMomentMax = kFp16Max;  // v is stored as FP16

inline uint8_t quantize_m(float m, float scale) { return fp8_encode(m * scale, kFirstMomentDtype); }

// FP16 conversion overflows to infinity, so saturate first (v >= 0). The comparison
// keeps NaN as NaN; the GPU kernel writes the same expression.
inline uint16_t quantize_v(float v, float scale) {
  const float scaled = v * scale;
  return fp16_from_float(scaled > kSecondMomentMax ? kSecondMomentMax : scaled);
}

inline float dequantize_m(uint8_t code, float scale_inv) { return fp8_decode(code, kFirstMomentDtype) * scale_inv; }
inline float dequantize_v(uint16_t bits, float scale_inv) { return fp16_to_float(bits) * scale_inv; }

// max |x| that ignores NaN (a NaN never wins the comparison), so the result does not
// depend on the order in which threads combine. Non-finite moments only arise from
// non-finite gradients, which the caller must not pass (see adamw.h).
inline float running_max(float amax, float x) { return x > amax ? x : amax; }

}  // namespace

namespace cpu {

void adamw_tensor_fp32(float* params, const float* grads, float* m, float* v, size_t n,
                       const AdamWStepScalars& s) {
  const int64_t count = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
  for (int64_t i = 0; i < count; ++i) {
    float mi = m[i], vi = v[i];
    adamw_moments(grads[i], mi, vi, s);
    params[i] = adamw_param(params[i], mi, vi, s);
    m[i] = mi;
    v[i] = vi;
  }
}

void adamw_moment_amax_fp8_fp16(const float* grads, const uint8_t* m_codes, const uint16_t* v_bits, size_t n,
                                float m_scale, float v_scale, const AdamWStepScalars& s, float& amax_m, float& amax_v) {
  const int64_t count = static_cast<int64_t>(n);
  // The stored moments were quantized with these scales.
  const float old_m_scale_inv = 1.0f / m_scale;
  const float old_v_scale_inv = 1.0f / v_scale;
  float tensor_m = 0.0f, tensor_v = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : tensor_m, tensor_v) if (n >= kParallelThreshold)
  for (int64_t i = 0; i < count; ++i) {
    float mi = dequantize_m(m_codes[i], old_m_scale_inv);
    float vi = dequantize_v(v_bits[i], old_v_scale_inv);
    adamw_moments(grads[i], mi, vi, s);
    tensor_m = running_max(tensor_m, std::fabs(mi));
    tensor_v = running_max(tensor_v, vi);  // v >= 0
  }
  amax_m = running_max(amax_m, tensor_m);
  amax_v = running_max(amax_v, tensor_v);
}

void adamw_apply_fp8_fp16(float* params, const float* grads, uint8_t* m_codes, uint16_t* v_bits, size_t n,
                          float& m_scale, float& v_scale, float amax_m, float amax_v, const AdamWStepScalars& s) {
  const int64_t count = static_cast<int64_t>(n);
  const float old_m_scale_inv = 1.0f / m_scale;
  const float old_v_scale_inv = 1.0f / v_scale;
  const float new_m_scale = moment_scale(amax_m, kFirstMomentMax);
  const float new_v_scale = moment_scale(amax_v, kSecondMomentMax);
  // The same moments as pass 1 (same inputs, same operations, so the same values), the
  // parameter update from their FP32 values, then re-quantization.
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
  for (int64_t i = 0; i < count; ++i) {
    float mi = dequantize_m(m_codes[i], old_m_scale_inv);
    float vi = dequantize_v(v_bits[i], old_v_scale_inv);
    adamw_moments(grads[i], mi, vi, s);
    params[i] = adamw_param(params[i], mi, vi, s);
    m_codes[i] = quantize_m(mi, new_m_scale);
    v_bits[i] = quantize_v(vi, new_v_scale);
  }
  m_scale = new_m_scale;
  v_scale = new_v_scale;
}

namespace {

// Where tensor k's gradient starts: at its offset in `layout`, or in `grad_layout` when given.
const float* gradient_of(const float* grads, const TensorLayout& layout, const TensorLayout* grad_layout, size_t k) {
  if (grad_layout == nullptr) return grads + layout.tensors()[k].offset;
  FP8LM_CHECK(grad_layout->tensors().size() == layout.tensors().size() &&
                  grad_layout->tensors()[k].numel == layout.tensors()[k].numel,
              "AdamW: the gradients' layout must hold the same tensors as the state's");
  return grads + grad_layout->tensors()[k].offset;
}

}  // namespace

void adamw_moment_amaxes(const TensorLayout& layout, const float* grads, const AdamWStateSlabs& state,
                         const AdamWHyperparams& hp, int64_t t, float grad_scale, float* amaxes,
                         const TensorLayout* grad_layout, size_t first_tensor, size_t end_tensor) {
  const auto& tensors = layout.tensors();
  const size_t count = tensors.size();
  FP8LM_CHECK(first_tensor <= count, "AdamW pass 1: first tensor ", first_tensor, " of ", count);
  for (size_t k = first_tensor; k < std::min(count, end_tensor); ++k) {
    const TensorInfo& info = tensors[k];
    const AdamWStepScalars s = adamw_step_scalars(hp, t, grad_scale, info.weight_decay);
    adamw_moment_amax_fp8_fp16(gradient_of(grads, layout, grad_layout, k), state.m8 + info.offset, state.v16 + info.offset, info.numel,
                               state.m_scales[k], state.v_scales[k], s, amaxes[k], amaxes[count + k]);
  }
}

void adamw_apply(const TensorLayout& layout, OptimizerStatePrecision precision, float* params, const float* grads,
                 const AdamWStateSlabs& state, const AdamWHyperparams& hp, int64_t t, float grad_scale,
                 const float* amaxes, const TensorLayout* grad_layout) {
  const auto& tensors = layout.tensors();
  const size_t count = tensors.size();
  for (size_t k = 0; k < count; ++k) {
    const TensorInfo& info = tensors[k];
    const AdamWStepScalars s = adamw_step_scalars(hp, t, grad_scale, info.weight_decay);
    float* p = params + info.offset;
    const float* g = gradient_of(grads, layout, grad_layout, k);
    if (precision == OptimizerStatePrecision::fp32) {
      adamw_tensor_fp32(p, g, state.m32 + info.offset, state.v32 + info.offset, info.numel, s);
    } else {
      adamw_apply_fp8_fp16(p, g, state.m8 + info.offset, state.v16 + info.offset, info.numel, state.m_scales[k],
                           state.v_scales[k], amaxes[k], amaxes[count + k], s);
    }
  }
}

void adamw_step(const TensorLayout& layout, OptimizerStatePrecision precision, float* params, const float* grads,
                const AdamWStateSlabs& state, const AdamWHyperparams& hp, int64_t t, float grad_scale) {
  std::vector<float> amaxes(2 * layout.tensors().size(), 0.0f);
  if (precision == OptimizerStatePrecision::fp8_fp16)
    adamw_moment_amaxes(layout, grads, state, hp, t, grad_scale, amaxes.data());
  adamw_apply(layout, precision, params, grads, state, hp, t, grad_scale, amaxes.data());
}

}  // namespace cpu

AdamW::AdamW(const TensorLayout& layout, OptimizerStatePrecision precision)
    : layout_(layout), precision_(precision) {
  const size_t total = layout_.total_elements();
  if (precision_ == OptimizerStatePrecision::fp32) {
    m32_.assign(total, 0.0f);
    v32_.assign(total, 0.0f);
  } else {
    m8_.assign(total, 0);   // E4M3 code 0 is +0
    v16_.assign(total, 0);  // FP16 bits 0 are +0
    m_scales_.assign(layout_.tensors().size(), 1.0f);
    v_scales_.assign(layout_.tensors().size(), 1.0f);
  }
}

void AdamW::step(float* params, const float* grads, const AdamWHyperparams& hp, float grad_scale) {
  FP8LM_CHECK(params != nullptr && grads != nullptr);
  check_adamw_hyperparams(hp);
  FP8LM_CHECK(grad_scale > 0.0f && std::isfinite(grad_scale), "grad_scale=", grad_scale);

  ++step_count_;
  const AdamWStateSlabs state{m32_.data(), v32_.data(), m8_.data(), v16_.data(), m_scales_.data(), v_scales_.data()};
  cpu::adamw_step(layout_, precision_, params, grads, state, hp, step_count_, grad_scale);
}

void AdamW::set_step_count(int64_t t) {
  FP8LM_CHECK(t >= 0, "t=", t);
  step_count_ = t;
}

double AdamW::state_bytes_per_parameter() const {
  return precision_ == OptimizerStatePrecision::fp32 ? 2.0 * sizeof(float)
                                                     : double(sizeof(uint8_t) + sizeof(uint16_t));
}

size_t AdamW::state_bytes() const {
  return (m32_.size() + v32_.size()) * sizeof(float) + m8_.size() * sizeof(uint8_t) +
         v16_.size() * sizeof(uint16_t) + (m_scales_.size() + v_scales_.size()) * sizeof(float);
}

size_t AdamW::tensor_of(size_t index) const {
  const auto& tensors = layout_.tensors();
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (index >= tensors[k].offset && index < tensors[k].offset + tensors[k].numel) return k;
  }
  FP8LM_CHECK(false, "slab element ", index, " is padding or out of range");
  return 0;
}

float AdamW::first_moment(size_t index) const {
  if (precision_ == OptimizerStatePrecision::fp32) return m32_.at(index);
  return dequantize_m(m8_[index], 1.0f / m_scales_[tensor_of(index)]);
}

float AdamW::second_moment(size_t index) const {
  if (precision_ == OptimizerStatePrecision::fp32) return v32_.at(index);
  return dequantize_v(v16_[index], 1.0f / v_scales_[tensor_of(index)]);
}

}  // namespace fp8lm
