#include "core/fp8.h"

#include <array>
#include <cmath>

#include "core/dtype.h"

namespace fp8lm {

namespace {

struct Fp8Layout {
  int mantissa_bits;
  int exponent_bias;
  uint8_t max_code;  // largest finite magnitude code
  bool has_infinity;
};

constexpr Fp8Layout layout_of(Fp8Dtype dtype) {
  return dtype == Fp8Dtype::e4m3 ? Fp8Layout{3, 7, 0x7E, false} : Fp8Layout{2, 15, 0x7B, true};
}

constexpr uint8_t kNanCode = 0x7F;  // what CUDA's satfinite conversion writes for NaN, both formats

float decode_slow(uint8_t code, Fp8Dtype dtype) {
  const Fp8Layout layout = layout_of(dtype);
  const bool negative = code & 0x80;
  const int magnitude_code = code & 0x7F;
  const int exponent_field = magnitude_code >> layout.mantissa_bits;
  const int mantissa = magnitude_code & ((1 << layout.mantissa_bits) - 1);
  const int max_exponent_field = (1 << (7 - layout.mantissa_bits)) - 1;
  float magnitude;
  if (dtype == Fp8Dtype::e4m3 && magnitude_code == 0x7F) {
    magnitude = NAN;
  } else if (layout.has_infinity && exponent_field == max_exponent_field) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), 1 - layout.exponent_bias - layout.mantissa_bits);
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa + (1 << layout.mantissa_bits)),
                           exponent_field - layout.exponent_bias - layout.mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

using DecodeTable = std::array<float, 256>;

DecodeTable make_decode_table(Fp8Dtype dtype) {
  DecodeTable table{};
  for (int code = 0; code < 256; ++code) table[code] = decode_slow(static_cast<uint8_t>(code), dtype);
  return table;
}

const DecodeTable& decode_table(Fp8Dtype dtype) {
  static const DecodeTable e4m3 = make_decode_table(Fp8Dtype::e4m3);
  static const DecodeTable e5m2 = make_decode_table(Fp8Dtype::e5m2);
  return dtype == Fp8Dtype::e4m3 ? e4m3 : e5m2;
}

}  // namespace

std::string_view to_string(Fp8Dtype dtype) { return dtype == Fp8Dtype::e4m3 ? "e4m3" : "e5m2"; }
std::string_view to_string(Fp8Format format) { return format == Fp8Format::e4m3 ? "e4m3" : "hybrid"; }

uint8_t fp8_encode(float value, Fp8Dtype dtype) {
  const Fp8Layout layout = layout_of(dtype);
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits > 0x7F800000u) return kNanCode;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (magnitude_bits == 0x7F800000u) return sign | layout.max_code;

  // FP8 codes of one sign are contiguous and monotone in the value: a code is (biased exponent
  // << mantissa_bits) + the significand's fraction bits, as in FP32. Bit operations instead of
  // frexp/ldexp/lrint (the optimizer and the CPU casts encode every element): the results are
  // the same codes (tests/test_fp8.cpp compares them with those calls' form).
  const int min_normal_exponent = 1 - layout.exponent_bias;
  const uint32_t min_normal_bits = static_cast<uint32_t>(min_normal_exponent + 127) << 23;
  uint32_t code;
  if (magnitude_bits < min_normal_bits) {
    // Subnormal (or zero): a multiple of the quantum 2^(min_normal_exponent - mantissa_bits),
    // at most 2^mantissa_bits of them (that many is the smallest normal, code and all).
    // Scaling by a power of two is exact; adding and subtracting 2^23 rounds half to even.
    const float quanta = float_from_bits(magnitude_bits) *
                         float_from_bits(static_cast<uint32_t>(127 - min_normal_exponent + layout.mantissa_bits) << 23);
    code = static_cast<uint32_t>((quanta + 0x1p23f) - 0x1p23f);
  } else {
    // Normal: round FP32's 23 fraction bits to mantissa_bits, half to even; a fraction that
    // rounds up to the next power of two carries into the exponent field by itself.
    const int dropped = 23 - layout.mantissa_bits;
    const uint32_t half_minus_one = (1u << (dropped - 1)) - 1u;
    const uint32_t rounded = (magnitude_bits + half_minus_one + ((magnitude_bits >> dropped) & 1u)) >> dropped;
    code = rounded - (static_cast<uint32_t>(127 - layout.exponent_bias) << layout.mantissa_bits);
  }
  if (code > layout.max_code) code = layout.max_code;  // __NV_SATFINITE
  return sign | static_cast<uint8_t>(code);
}

float fp8_decode(uint8_t code, Fp8Dtype dtype) { return decode_table(dtype)[code]; }

float fp8_round(float value, Fp8Dtype dtype) { return fp8_decode(fp8_encode(value, dtype), dtype); }

}  // namespace fp8lm
