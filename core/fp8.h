// The two FP8 formats of Hopper's tensor cores, encoded and decoded on the host.
//
//   E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa bits. Max 448. No infinities;
//         0x7F/0xFF are NaN. Used for forward tensors (activations, weights).
//   E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits. Max 57344. IEEE-like:
//         exponent 31 is infinity (mantissa 0) or NaN. Used for gradients under `hybrid`.
//
// Conversion from FP32 rounds to nearest even and saturates finite overflow and
// infinities to +-max, exactly as CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)
// and the cvt.rn.satfinite PTX instruction do. NaN encodes as 0x7F.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/host_device.h"

namespace fp8lm {

enum class Fp8Dtype : uint8_t { e4m3, e5m2 };

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

FP8LM_HOST_DEVICE constexpr float fp8_max(Fp8Dtype dtype) {
  return dtype == Fp8Dtype::e4m3 ? kE4M3Max : kE5M2Max;
}

std::string_view to_string(Fp8Dtype dtype);

// FP32 -> FP8 code (round to nearest even, saturating).
uint8_t fp8_encode(float value, Fp8Dtype dtype);
// FP8 code -> FP32 (exact: every FP8 value is an FP32 value).
float fp8_decode(uint8_t code, Fp8Dtype dtype);
// The FP8 value nearest to `value`, as FP32: decode(encode(value)).
float fp8_round(float value, Fp8Dtype dtype);

// The recipe-level format, as Megatron/Transformer Engine name it.
//   e4m3:   every tensor E4M3.
//   hybrid: forward tensors E4M3, gradient tensors E5M2 (more range, less precision).
enum class Fp8Format : uint8_t { e4m3, hybrid };

std::string_view to_string(Fp8Format format);

constexpr Fp8Dtype forward_dtype(Fp8Format) { return Fp8Dtype::e4m3; }
constexpr Fp8Dtype gradient_dtype(Fp8Format format) {
  return format == Fp8Format::hybrid ? Fp8Dtype::e5m2 : Fp8Dtype::e4m3;
}

}  // namespace fp8lm
