// A parameter gradient as the CUDA launchers take it: where it is, and whether it is FP32 or
// BF16. The model's gradient slab is FP32, or BF16 under --grad-reduce-in-bf16 (Megatron's
// BF16 main_grad: the wgrad GEMMs and every other gradient producer accumulate into it, and
// the data-parallel reduction runs on it in place). The kernels that produce a gradient sum
// in FP32 and round once, when they add their sum to a BF16 gradient; those that read one
// (the norm, AdamW) widen it to FP32. Plain C++: includable from .cpp and .cu files.
#pragma once

#include <type_traits>

namespace fp8lm {

// Pointer: void* for a gradient that is added to (GradientRef), const void* for one that is
// only read (GradientView). A float pointer converts implicitly: FP32 is the default slab.
template <typename Pointer>
struct BasicGradientRef {
  Pointer data = nullptr;
  bool bf16 = false;

  BasicGradientRef() = default;
  BasicGradientRef(Pointer gradient, bool is_bf16) : data(gradient), bf16(is_bf16) {}
  using Fp32Pointer = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const float*, float*>;
  BasicGradientRef(Fp32Pointer fp32) : data(fp32) {}  // NOLINT(google-explicit-constructor): FP32, the default
  explicit operator bool() const { return data != nullptr; }
};
using GradientRef = BasicGradientRef<void*>;
using GradientView = BasicGradientRef<const void*>;

}  // namespace fp8lm
