// The FP8 codec against CUDA's own host conversions (cuda_fp8.h), bit for bit.
#include <cmath>
#include <cstring>
#include <limits>

#include <catch2/catch_test_macros.hpp>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/dtype.h"
#include "core/fp8.h"
#include "core/random.h"

using namespace fp8lm;

namespace {

__nv_fp8_interpretation_t cuda_kind(Fp8Dtype dtype) { return dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2; }

uint8_t cuda_encode(float x, Fp8Dtype dtype) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, cuda_kind(dtype)));
}

float cuda_decode(uint8_t code, Fp8Dtype dtype) {
  __half_raw raw = __nv_cvt_fp8_to_halfraw(code, cuda_kind(dtype));
  __half h;
  std::memcpy(&h, &raw, sizeof h);
  return __half2float(h);
}

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return float_bits(a) == float_bits(b);  // distinguishes -0 from +0
}

const Fp8Dtype kBoth[] = {Fp8Dtype::e4m3, Fp8Dtype::e5m2};

}  // namespace

TEST_CASE("fp8 decode matches cuda_fp8.h for all 256 codes", "[fp8]") {
  for (Fp8Dtype dtype : kBoth) {
    for (int code = 0; code < 256; ++code) {
      INFO(to_string(dtype) << " code " << code);
      REQUIRE(same_float(fp8_decode(uint8_t(code), dtype), cuda_decode(uint8_t(code), dtype)));
    }
  }
}

TEST_CASE("fp8 encode of every decoded value round-trips", "[fp8]") {
  for (Fp8Dtype dtype : kBoth) {
    for (int code = 0; code < 256; ++code) {
      const float value = fp8_decode(uint8_t(code), dtype);
      INFO(to_string(dtype) << " code " << code << " value " << value);
      REQUIRE(fp8_encode(value, dtype) == cuda_encode(value, dtype));
      if (std::isfinite(value)) REQUIRE(fp8_encode(value, dtype) == code);
    }
  }
}

TEST_CASE("fp8 format constants", "[fp8]") {
  CHECK(fp8_decode(0x7E, Fp8Dtype::e4m3) == 448.0f);
  CHECK(std::isnan(fp8_decode(0x7F, Fp8Dtype::e4m3)));
  CHECK(std::isnan(fp8_decode(0xFF, Fp8Dtype::e4m3)));
  CHECK(fp8_decode(0x7B, Fp8Dtype::e5m2) == 57344.0f);
  CHECK(std::isinf(fp8_decode(0x7C, Fp8Dtype::e5m2)));
  CHECK(std::isnan(fp8_decode(0x7D, Fp8Dtype::e5m2)));
  CHECK(fp8_decode(0x01, Fp8Dtype::e4m3) == std::ldexp(1.0f, -9));   // smallest subnormal
  CHECK(fp8_decode(0x01, Fp8Dtype::e5m2) == std::ldexp(1.0f, -16));  // smallest subnormal
  CHECK(fp8_max(Fp8Dtype::e4m3) == 448.0f);
  CHECK(fp8_max(Fp8Dtype::e5m2) == 57344.0f);
}

TEST_CASE("fp8 encode edge cases match cuda_fp8.h", "[fp8]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> cases = {0.0f, -0.0f, inf, -inf, nan, -nan, 448.0f, 449.0f, 464.0f, 464.0001f, 480.0f,
                              1e30f, -1e30f, 57344.0f, 61439.0f, 61440.0f, 61441.0f, 65536.0f, 1e-30f, -1e-30f,
                              std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()};
  for (Fp8Dtype dtype : kBoth) {
    const Fp8Dtype d = dtype;
    // Subnormal steps, half steps (ties) and just beyond them.
    const int min_exp = d == Fp8Dtype::e4m3 ? -9 : -16;
    for (int k = 0; k <= 20; ++k) {
      const float q = std::ldexp(1.0f, min_exp);
      for (float v : {k * q, (k + 0.5f) * q, std::nextafter((k + 0.5f) * q, inf), std::nextafter((k + 0.5f) * q, 0.0f)}) {
        cases.push_back(v);
        cases.push_back(-v);
      }
    }
    // Ties between consecutive normal values.
    for (int code = 8; code < 0x7B; ++code) {
      const float a = fp8_decode(uint8_t(code), d), b = fp8_decode(uint8_t(code + 1), d);
      if (!std::isfinite(b)) continue;
      cases.push_back(0.5f * (a + b));
      cases.push_back(-0.5f * (a + b));
    }
  }
  for (Fp8Dtype dtype : kBoth) {
    for (float x : cases) {
      INFO(to_string(dtype) << " x = " << x);
      REQUIRE(fp8_encode(x, dtype) == cuda_encode(x, dtype));
    }
  }
  // Saturation (satfinite): past max and infinities map to +-max; NaN to 0x7F.
  CHECK(fp8_encode(1e6f, Fp8Dtype::e4m3) == 0x7E);
  CHECK(fp8_encode(-inf, Fp8Dtype::e4m3) == 0xFE);
  CHECK(fp8_encode(inf, Fp8Dtype::e5m2) == 0x7B);
  CHECK(fp8_encode(nan, Fp8Dtype::e4m3) == 0x7F);
  CHECK(fp8_encode(464.0f, Fp8Dtype::e4m3) == 0x7E);  // tie rounds to even 448
}

TEST_CASE("fp8 encode matches cuda_fp8.h on 10^6 random floats per format", "[fp8]") {
  Random random(20240520);
  for (Fp8Dtype dtype : kBoth) {
    int mismatches = 0;
    for (int i = 0; i < 1000000; ++i) {
      float x;
      switch (i % 3) {
        case 0: x = float_from_bits(static_cast<uint32_t>(random.next_u64())); break;  // any bit pattern
        case 1: x = static_cast<float>(random.normal() * std::ldexp(1.0, int(random.next_u64() % 40) - 20)); break;
        default: x = static_cast<float>((random.uniform() - 0.5) * 2.0 * fp8_max(dtype) * 1.1); break;
      }
      if (fp8_encode(x, dtype) != cuda_encode(x, dtype)) ++mismatches;
    }
    INFO(to_string(dtype));
    REQUIRE(mismatches == 0);
  }
}

TEST_CASE("fp16 and bf16 host conversions match cuda_fp16.h / round to nearest even", "[fp8][dtype]") {
  Random random(7);
  for (int i = 0; i < 200000; ++i) {
    const float x = i % 2 ? float_from_bits(static_cast<uint32_t>(random.next_u64()))
                          : static_cast<float>(random.normal() * std::ldexp(1.0, int(random.next_u64() % 50) - 30));
    __half h = __float2half_rn(x);
    uint16_t cuda_bits;
    std::memcpy(&cuda_bits, &h, sizeof cuda_bits);
    const uint16_t ours = fp16_from_float(x);
    INFO("x = " << x);
    if (std::isnan(x)) {
      REQUIRE(std::isnan(fp16_to_float(ours)));
    } else {
      REQUIRE(ours == cuda_bits);
      REQUIRE(same_float(fp16_to_float(ours), __half2float(h)));
    }
  }
  CHECK(round_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 1.0f);                          // tie to even
  CHECK(round_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 1.0f + std::ldexp(1.0f, -6));  // tie to even, up
}

// The encoders are bit operations (core/fp8.cpp, core/dtype.h); their former frexp/ldexp/lrint
// form gave the same codes for all 2^32 floats (checked once when they changed, 2026-11-27).
// Here: every 257th bit pattern, both signs, every exponent and both formats, against CUDA's host
// conversions; every FP16 code decoded.
TEST_CASE("fp8 and fp16 encoders match CUDA's on every 257th float bit pattern; fp16 decodes every code",
          "[fp8][dtype]") {
  long fp8_mismatches = 0, fp16_mismatches = 0;
  for (uint64_t bits = 0; bits < (uint64_t(1) << 32); bits += 257) {
    const float x = float_from_bits(static_cast<uint32_t>(bits));
    for (Fp8Dtype dtype : kBoth) fp8_mismatches += fp8_encode(x, dtype) != cuda_encode(x, dtype);
    const __half h = __float2half_rn(x);
    uint16_t cuda_bits;
    std::memcpy(&cuda_bits, &h, sizeof cuda_bits);
    const uint16_t ours = fp16_from_float(x);
    fp16_mismatches += std::isnan(x) ? !std::isnan(fp16_to_float(ours)) : ours != cuda_bits;
  }
  CHECK(fp8_mismatches == 0);
  CHECK(fp16_mismatches == 0);
  for (uint32_t code = 0; code < 65536; ++code) {
    __half_raw raw;
    raw.x = static_cast<uint16_t>(code);
    INFO("fp16 code " << code);
    REQUIRE(same_float(fp16_to_float(static_cast<uint16_t>(code)), __half2float(__half(raw))));
  }
}
