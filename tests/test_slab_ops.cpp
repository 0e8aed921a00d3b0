// CPU tests of optim/slab_ops.h: hand-worked cases for every per-tensor slab operation.
//
// Most cases use one layout of four tensors, with padding between them that must stay
// untouched (and, in inputs, holds values that would change a result if it were read):
//   a     [3]    offset 0     elements 0..2     padding 3..7
//   empty [0]    offset 8
//   b     [2,2]  offset 8     elements 8..11    padding 12..15
//   c     [2]    offset 16    elements 16..17   total 18
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/tensor.h"
#include "optim/slab_ops.h"

namespace {

using namespace fp8lm;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kFloatMax = std::numeric_limits<float>::max();
constexpr float kPaddingValue = 1000.0f;  // larger than every real value: a read of padding shows
constexpr uint8_t kPaddingCode = 0xAA;
constexpr uint32_t kQuietNaNBits = 0x7FC00000u;

TensorLayout four_tensors() {
  TensorLayout layout;
  layout.add("a", {3}, false, 8);
  layout.add("empty", {0}, false, 8);
  layout.add("b", {2, 2}, true, 8);
  layout.add("c", {2}, false, 8);
  return layout;
}

// A slab of the layout: padding holds `padding`, tensor k holds tensors[k] (sizes must match).
template <typename T>
std::vector<T> slab_of(const TensorLayout& layout, const std::vector<std::vector<T>>& tensors, T padding) {
  std::vector<T> slab(layout.total_elements(), padding);
  REQUIRE(tensors.size() == layout.tensors().size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorInfo& t = layout.tensors()[k];
    REQUIRE(tensors[k].size() == t.numel);
    for (size_t i = 0; i < t.numel; ++i) slab[t.offset + i] = tensors[k][i];
  }
  return slab;
}

bool is_padding(const TensorLayout& layout, size_t index) {
  for (const TensorInfo& t : layout.tensors())
    if (index >= t.offset && index < t.offset + t.numel) return false;
  return true;
}

}  // namespace

TEST_CASE("slab layout of the tests: offsets and padding as the comment says", "[slab]") {
  const TensorLayout layout = four_tensors();
  REQUIRE(layout.total_elements() == 18);
  CHECK(layout.tensors()[0].offset == 0);
  CHECK(layout.tensors()[1].offset == 8);
  CHECK(layout.tensors()[1].numel == 0);
  CHECK(layout.tensors()[2].offset == 8);
  CHECK(layout.tensors()[3].offset == 16);
  CHECK(is_padding(layout, 3));
  CHECK(is_padding(layout, 7));
  CHECK(is_padding(layout, 12));
  CHECK(is_padding(layout, 15));
  CHECK(!is_padding(layout, 11));
}

// ------------------------------------------------------------------------------ tensor_amaxes

TEST_CASE("tensor_amaxes: running max per tensor, NaN ignored, padding and empty tensors untouched", "[slab]") {
  const TensorLayout layout = four_tensors();
  const std::vector<float> values =
      slab_of<float>(layout, {{1.0f, -3.0f, 2.0f}, {}, {-0.5f, kNaN, 6.0f, -2.0f}, {0.25f, -0.125f}}, kPaddingValue);

  // Running max: c's previous 0.5 beats its 0.25; the empty tensor keeps its 5.
  std::vector<float> amaxes = {0.0f, 5.0f, 0.0f, 0.5f};
  cpu::tensor_amaxes(amaxes.data(), values.data(), layout);
  CHECK(amaxes == std::vector<float>{3.0f, 5.0f, 6.0f, 0.5f});

  // Twice is the same as once (a max), and the padding's 1000 never shows.
  cpu::tensor_amaxes(amaxes.data(), values.data(), layout);
  CHECK(amaxes == std::vector<float>{3.0f, 5.0f, 6.0f, 0.5f});

  SECTION("a tensor of NaNs leaves its entry; an infinity counts") {
    const std::vector<float> odd =
        slab_of<float>(layout, {{kNaN, -kNaN, kNaN}, {}, {1.0f, -kInf, 2.0f, kNaN}, {0.0f, -0.0f}}, kPaddingValue);
    std::vector<float> zeroed = {0.75f, 0.0f, 0.0f, 0.0f};
    cpu::tensor_amaxes(zeroed.data(), odd.data(), layout);
    CHECK(zeroed[0] == 0.75f);
    CHECK(zeroed[1] == 0.0f);
    CHECK(zeroed[2] == kInf);
    CHECK(zeroed[3] == 0.0f);
    CHECK(!std::signbit(zeroed[3]));
  }

  SECTION("an empty layout is a no-op, with null pointers too") {
    cpu::tensor_amaxes(nullptr, nullptr, TensorLayout{});
  }
}

// ------------------------------------------------------------------------- scales_from_amaxes

TEST_CASE("scales_from_amaxes: compute_scale with the headroom folded in; 1 for 0 and non-finite", "[slab]") {
  const std::vector<float> amaxes = {2.0f, 0.0f, kNaN, kInf, 1e-45f, kFloatMax, 448.0f};
  const int count = static_cast<int>(amaxes.size());
  std::vector<float> scales(count, -1.0f), scale_inv(count, -1.0f);

  cpu::scales_from_amaxes(scales.data(), scale_inv.data(), amaxes.data(), count, kE4M3Max, 1.0f);
  CHECK(scales == std::vector<float>{224.0f, 1.0f, 1.0f, 1.0f, kFloatMax, 448.0f / kFloatMax, 1.0f});
  for (int k = 0; k < count; ++k) CHECK(float_bits(scale_inv[k]) == float_bits(1.0f / scales[k]));

  // Two ranks: each code at most 448 / 2. FLT_MAX * 2 overflows to inf: scale 1.
  cpu::scales_from_amaxes(scales.data(), scale_inv.data(), amaxes.data(), count, kE4M3Max, 2.0f);
  CHECK(scales == std::vector<float>{112.0f, 1.0f, 1.0f, 1.0f, kFloatMax, 1.0f, 0.5f});
  CHECK(scale_inv[0] == 1.0f / 112.0f);
  CHECK(scale_inv[6] == 2.0f);

  // E5M2 and four ranks.
  cpu::scales_from_amaxes(scales.data(), scale_inv.data(), amaxes.data(), 1, kE5M2Max, 4.0f);
  CHECK(scales[0] == 7168.0f);  // 57344 / 8
  CHECK(scale_inv[0] == 1.0f / 7168.0f);

  cpu::scales_from_amaxes(nullptr, nullptr, nullptr, 0, kE4M3Max, 1.0f);  // no work
  CHECK_THROWS_AS(cpu::scales_from_amaxes(scales.data(), scale_inv.data(), amaxes.data(), count, kE4M3Max, 0.0f),
                  RuntimeError);
}

// --------------------------------------------------------------------------- quantize_tensors

TEST_CASE("quantize_tensors: hand-worked E4M3 codes through scale_index; -1 skips; padding untouched", "[slab]") {
  const TensorLayout layout = four_tensors();
  // a: 1*2 = 2 (0x40), -3*2 = -6 (0xCC), 0.53125*2 = 1.0625, the tie of 1 and 1.125 -> 1 (0x38, even)
  // b: skipped (index -1), NaN and all: codes and slot untouched
  // c: 300*2 = 600 saturates to 448 (0x7E); -0.59375*2 = -1.1875, the tie of 1.125 and 1.25 -> -1.25 (0xBA)
  const std::vector<float> values = slab_of<float>(
      layout, {{1.0f, -3.0f, 0.53125f}, {}, {kNaN, 1e6f, -1e6f, 5.0f}, {300.0f, -0.59375f}}, kPaddingValue);
  const std::vector<float> scales = {2.0f, 0.5f, 8.0f};
  const std::vector<int> scale_index = {0, 2, -1, 0};  // a and c share slot 0; slot 1 unused
  std::vector<float> recorded = {0.5f, 7.0f, 9.0f};
  std::vector<uint8_t> codes(layout.total_elements(), kPaddingCode);

  cpu::quantize_tensors(codes.data(), values.data(), layout, scales.data(), scale_index.data(), recorded.data(),
                        Fp8Dtype::e4m3);

  const std::vector<uint8_t> expected = slab_of<uint8_t>(
      layout, {{0x40, 0xCC, 0x38}, {}, {kPaddingCode, kPaddingCode, kPaddingCode, kPaddingCode}, {0x7E, 0xBA}},
      kPaddingCode);
  CHECK(codes == expected);
  // The codes are fp8_encode's (and so __nv_cvt_float_to_fp8's, satfinite).
  CHECK(fp8_encode(1.0625f, Fp8Dtype::e4m3) == 0x38);
  CHECK(fp8_encode(-1.1875f, Fp8Dtype::e4m3) == 0xBA);
  CHECK(fp8_encode(600.0f, Fp8Dtype::e4m3) == 0x7E);
  // Slot 0: max(0.5, |a|, |c|) = 300. Slot 1 is nobody's; slot 2 is the empty tensor's.
  CHECK(recorded == std::vector<float>{300.0f, 7.0f, 9.0f});

  SECTION("no scale_index, no recorded amax, E5M2: tensor k uses scales[k]") {
    std::vector<uint8_t> codes5(layout.total_elements(), kPaddingCode);
    const std::vector<float> own = {1.0f, 123.0f, 0.25f, 4.0f};
    cpu::quantize_tensors(codes5.data(), values.data(), layout, own.data(), nullptr, nullptr, Fp8Dtype::e5m2);
    // a: 1 (0x3C), -3 (0xC2), 0.53125 -> between 0.5 and 0.625, nearer 0.5 (0x38)
    // b * 0.25: NaN -> 0x7F, 250000 -> 57344 (0x7B), -250000 -> -57344 (0xFB), 1.25 (0x3D)
    // c * 4: 1200 -> between 1024 and 1280, nearer 1280 (0x65); -2.375 -> nearer -2.5 (0xC1)
    const std::vector<uint8_t> expected5 =
        slab_of<uint8_t>(layout, {{0x3C, 0xC2, 0x38}, {}, {0x7F, 0x7B, 0xFB, 0x3D}, {0x65, 0xC1}}, kPaddingCode);
    CHECK(codes5 == expected5);
    for (size_t i = 0; i < codes5.size(); ++i) {
      if (!is_padding(layout, i)) {
        const int k = i < 8 ? 0 : i < 16 ? 2 : 3;
        CHECK(codes5[i] == fp8_encode(values[i] * own[k], Fp8Dtype::e5m2));
      }
    }
  }

  SECTION("an empty layout is a no-op") {
    cpu::quantize_tensors(nullptr, nullptr, TensorLayout{}, nullptr, nullptr, nullptr, Fp8Dtype::e4m3);
  }
}

TEST_CASE("quantize_tensors: a NaN makes the recorded amax the quiet NaN, and it stays", "[slab]") {
  const TensorLayout layout = four_tensors();
  // a holds a NaN (negative, with a payload); c, later in the layout, shares its slot.
  const std::vector<float> values = slab_of<float>(
      layout, {{1.0f, float_from_bits(0xFFC00123u), 2.0f}, {}, {1.0f, 2.0f, 3.0f, 4.0f}, {300.0f, -1.0f}},
      kPaddingValue);
  const std::vector<float> scales = {1.0f, 1.0f};
  const std::vector<int> scale_index = {0, 1, 1, 0};
  std::vector<float> recorded = {0.0f, 0.0f};
  std::vector<uint8_t> codes(layout.total_elements(), kPaddingCode);
  cpu::quantize_tensors(codes.data(), values.data(), layout, scales.data(), scale_index.data(), recorded.data(),
                        Fp8Dtype::e4m3);
  CHECK(float_bits(recorded[0]) == kQuietNaNBits);  // what the GPU's atomicMax on the bits leaves
  CHECK(recorded[1] == 4.0f);
  CHECK(codes[1] == 0x7F);  // NaN encodes as 0x7F

  // A slot that is NaN already stays NaN: finite values never replace it.
  const std::vector<float> finite =
      slab_of<float>(layout, {{1.0f, 2.0f, 3.0f}, {}, {1.0f, 2.0f, 3.0f, 4.0f}, {5.0f, 6.0f}}, kPaddingValue);
  cpu::quantize_tensors(codes.data(), finite.data(), layout, scales.data(), scale_index.data(), recorded.data(),
                        Fp8Dtype::e4m3);
  CHECK(std::isnan(recorded[0]));
  CHECK(recorded[1] == 4.0f);

  // tensor_amaxes of the same values ignores the NaN.
  std::vector<float> amaxes(4, 0.0f);
  cpu::tensor_amaxes(amaxes.data(), values.data(), layout);
  CHECK(amaxes == std::vector<float>{2.0f, 0.0f, 4.0f, 300.0f});
}

// ----------------------------------------------------------------------------- sum_fp8_chunks

TEST_CASE("sum_fp8_chunks: three ranks' E4M3 codes summed in FP32 and scaled; padding untouched", "[slab]") {
  const TensorLayout layout = four_tensors();
  const size_t stride = layout.total_elements() + 6;  // chunks need not be packed
  const int ranks = 3;
  // a: (1 + 0.5 + 0.25, 2 + 3 - 6, -1 + 1 + 448) * 0.5 = (0.875, -0.5, 224)
  // b: each rank 1, 1.125, 1.25, 1.375: 3 * that * 2 = (6, 6.75, 7.5, 8.25)
  // c: (2^-9 - 2^-9 + 0, 448 - 448 + 2^-9) * 1 = (0, 2^-9)
  const std::vector<std::vector<std::vector<uint8_t>>> per_rank = {
      {{0x38, 0x40, 0xB8}, {}, {0x38, 0x39, 0x3A, 0x3B}, {0x01, 0x7E}},
      {{0x30, 0x44, 0x38}, {}, {0x38, 0x39, 0x3A, 0x3B}, {0x81, 0xFE}},
      {{0x28, 0xCC, 0x7E}, {}, {0x38, 0x39, 0x3A, 0x3B}, {0x00, 0x01}},
  };
  std::vector<uint8_t> chunks(static_cast<size_t>(ranks - 1) * stride + layout.total_elements(), 0x7F);  // NaN
  for (int r = 0; r < ranks; ++r) {
    const std::vector<uint8_t> chunk = slab_of<uint8_t>(layout, per_rank[r], 0x7F);
    std::copy(chunk.begin(), chunk.end(), chunks.begin() + static_cast<std::ptrdiff_t>(r * stride));
  }
  const std::vector<float> scale_inv = {0.5f, 123.0f, 2.0f, 1.0f};
  std::vector<float> out(layout.total_elements(), -1.0f);
  cpu::sum_fp8_chunks(out.data(), chunks.data(), ranks, stride, layout, scale_inv.data(), Fp8Dtype::e4m3);
  const std::vector<float> expected = slab_of<float>(
      layout, {{0.875f, -0.5f, 224.0f}, {}, {6.0f, 6.75f, 7.5f, 8.25f}, {0.0f, 0x1p-9f}}, -1.0f);
  CHECK(out == expected);

  SECTION("one rank: its values times scale_inv") {
    std::vector<float> one(layout.total_elements(), -1.0f);
    cpu::sum_fp8_chunks(one.data(), chunks.data(), 1, 0, layout, scale_inv.data(), Fp8Dtype::e4m3);
    CHECK(one == slab_of<float>(layout, {{0.5f, 1.0f, -0.5f}, {}, {2.0f, 2.25f, 2.5f, 2.75f}, {0x1p-9f, 448.0f}},
                                -1.0f));
  }

  SECTION("preconditions") {
    CHECK_THROWS_AS(cpu::sum_fp8_chunks(out.data(), chunks.data(), 0, stride, layout, scale_inv.data(),
                                        Fp8Dtype::e4m3),
                    RuntimeError);
    CHECK_THROWS_AS(cpu::sum_fp8_chunks(out.data(), chunks.data(), 2, layout.total_elements() - 1, layout,
                                        scale_inv.data(), Fp8Dtype::e4m3),
                    RuntimeError);
  }
}

TEST_CASE("sum_fp8_chunks: the FP32 sum runs in rank order", "[slab]") {
  // E5M2: 2^15 (0x78), -2^15 (0xF8), 2^-16 (0x01). In FP32, 2^15 + 2^-16 rounds to 2^15,
  // so the order of the three terms decides whether 2^-16 survives.
  TensorLayout layout;
  layout.add("x", {3}, false);
  const std::vector<uint8_t> chunks = {
      0x78, 0x78, 0x01,  // rank 0
      0x01, 0xF8, 0x78,  // rank 1
      0xF8, 0x01, 0xF8,  // rank 2
  };
  const float scale_inv = 1.0f;
  std::vector<float> out(3, -1.0f);
  cpu::sum_fp8_chunks(out.data(), chunks.data(), 3, 3, layout, &scale_inv, Fp8Dtype::e5m2);
  // (2^15 + 2^-16) - 2^15 = 0;  (2^15 - 2^15) + 2^-16 = 2^-16;  (2^-16 + 2^15) - 2^15 = 0
  CHECK(out == std::vector<float>{0.0f, 0x1p-16f, 0.0f});
}

TEST_CASE("FP8 gradients of two ranks: headroom 2 keeps the sum of codes within E4M3", "[slab]") {
  TensorLayout layout;
  layout.add("g", {2}, false);
  const std::vector<std::vector<float>> grads = {{400.0f, -300.0f}, {300.0f, -400.0f}};  // true sum (700, -700)
  const int ranks = 2;

  // Every rank's amaxes, then the MAX all-reduce (here by hand): 400.
  std::vector<float> agreed(1, 0.0f);
  for (const auto& g : grads) {
    std::vector<float> amax(1, 0.0f);
    cpu::tensor_amaxes(amax.data(), g.data(), layout);
    agreed[0] = std::max(agreed[0], amax[0]);
  }
  REQUIRE(agreed[0] == 400.0f);

  auto code_sums = [&](float headroom, std::vector<float>& reduced) {
    std::vector<float> scale(1), scale_inv(1);
    cpu::scales_from_amaxes(scale.data(), scale_inv.data(), agreed.data(), 1, kE4M3Max, headroom);
    std::vector<uint8_t> chunks(2 * ranks);
    for (int r = 0; r < ranks; ++r)
      cpu::quantize_tensors(chunks.data() + 2 * r, grads[r].data(), layout, scale.data(), nullptr, nullptr,
                            Fp8Dtype::e4m3);
    std::vector<float> decoded(chunks.size());
    cpu::decode_fp8(decoded.data(), chunks.data(), chunks.size(), Fp8Dtype::e4m3);
    reduced.assign(2, 0.0f);
    cpu::sum_fp8_chunks(reduced.data(), chunks.data(), ranks, 2, layout, scale_inv.data(), Fp8Dtype::e4m3);
    return std::vector<float>{decoded[0] + decoded[2], decoded[1] + decoded[3]};
  };

  std::vector<float> reduced;
  // Without headroom: 400 * 448/400 -> 448 and 300 * 448/400 = 336 -> 320 (tie to even): the
  // sum 768 is beyond E4M3's 448, so the sum could not travel as E4M3.
  const std::vector<float> unfolded = code_sums(1.0f, reduced);
  CHECK(unfolded == std::vector<float>{768.0f, -768.0f});
  CHECK(fp8_decode(fp8_encode(unfolded[0], Fp8Dtype::e4m3), Fp8Dtype::e4m3) == kE4M3Max);  // saturates

  // Headroom 2: 400 * 448/800 = 224 and 300 * 0.56 = 168 -> 160 (tie to even): 384 <= 448.
  const std::vector<float> folded = code_sums(2.0f, reduced);
  CHECK(folded == std::vector<float>{384.0f, -384.0f});
  for (float s : folded) CHECK(std::fabs(s) <= kE4M3Max);
  // 384 / 0.56 = 685.7: the true 700 within E4M3's rounding (<= 1/16 relative per value).
  CHECK(std::fabs(reduced[0] - 700.0f) <= 700.0f / 16);
  CHECK(reduced[1] == -reduced[0]);
}

// ------------------------------------------------------------------------------ conversions

TEST_CASE("BF16 conversions: ties to even, overflow to infinity, NaN stays NaN, exact round trip", "[slab]") {
  const std::vector<uint32_t> in_bits = {
      0x3F808000u,  // 1 + 2^-8: tie of 0x3F80 and 0x3F81 -> 0x3F80 (even)
      0x3F818000u,  // 1 + 3*2^-8: tie of 0x3F81 and 0x3F82 -> 0x3F82 (even)
      0x3F808001u,  // just above the tie -> 0x3F81
      0xBF808000u,  // negative tie -> 0xBF80
      0x7F7FFFFFu,  // FLT_MAX rounds up to infinity
      0x7F7F8000u,  // tie of 0x7F7F (largest BF16) and 0x7F80 (inf) -> inf (even)
      0x7F800000u,  // inf
      0x7FC00000u,  // quiet NaN
      0x00008000u,  // subnormal tie of 0x0000 and 0x0001 -> 0x0000
      0x00018000u,  // subnormal tie of 0x0001 and 0x0002 -> 0x0002
      0x80000000u,  // -0
  };
  const std::vector<uint16_t> expected = {0x3F80, 0x3F82, 0x3F81, 0xBF80, 0x7F80, 0x7F80,
                                          0x7F80, 0x7FC0, 0x0000, 0x0002, 0x8000};
  std::vector<float> in(in_bits.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = float_from_bits(in_bits[i]);

  std::vector<uint16_t> bf16(in.size(), 0xDEAD);
  cpu::convert_f32_to_bf16(bf16.data(), in.data(), in.size());
  CHECK(bf16 == expected);

  std::vector<float> back(in.size(), -1.0f);
  cpu::convert_bf16_to_f32(back.data(), bf16.data(), bf16.size());
  for (size_t i = 0; i < back.size(); ++i) CHECK(float_bits(back[i]) == static_cast<uint32_t>(bf16[i]) << 16);
  CHECK(back[1] == 1.015625f);

  // BF16 values survive the round trip unchanged.
  std::vector<uint16_t> again(back.size(), 0xDEAD);
  cpu::convert_f32_to_bf16(again.data(), back.data(), back.size());
  CHECK(again == bf16);

  cpu::convert_f32_to_bf16(nullptr, nullptr, 0);  // no work
  cpu::convert_bf16_to_f32(nullptr, nullptr, 0);
}

TEST_CASE("decode_fp8: exact values of E4M3 and E5M2 codes", "[slab]") {
  const std::vector<uint8_t> e4m3 = {0x00, 0x80, 0x01, 0x38, 0x7E, 0xFE, 0x7F, 0xFF};
  std::vector<float> out(e4m3.size(), -1.0f);
  cpu::decode_fp8(out.data(), e4m3.data(), e4m3.size(), Fp8Dtype::e4m3);
  CHECK(float_bits(out[0]) == 0u);
  CHECK(float_bits(out[1]) == 0x80000000u);  // -0
  CHECK(out[2] == 0x1p-9f);                  // smallest subnormal
  CHECK(out[3] == 1.0f);
  CHECK(out[4] == 448.0f);
  CHECK(out[5] == -448.0f);
  CHECK(std::isnan(out[6]));
  CHECK(std::isnan(out[7]));

  const std::vector<uint8_t> e5m2 = {0x01, 0x3C, 0x7B, 0x7C, 0xFC, 0x7D};
  out.assign(e5m2.size(), -1.0f);
  cpu::decode_fp8(out.data(), e5m2.data(), e5m2.size(), Fp8Dtype::e5m2);
  CHECK(out[0] == 0x1p-16f);
  CHECK(out[1] == 1.0f);
  CHECK(out[2] == 57344.0f);
  CHECK(out[3] == kInf);
  CHECK(out[4] == -kInf);
  CHECK(std::isnan(out[5]));

  // Every code: what fp8_decode says.
  std::vector<uint8_t> all(256);
  for (int c = 0; c < 256; ++c) all[c] = static_cast<uint8_t>(c);
  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    std::vector<float> values(256);
    cpu::decode_fp8(values.data(), all.data(), all.size(), dtype);
    for (int c = 0; c < 256; ++c) {
      const float ref = fp8_decode(static_cast<uint8_t>(c), dtype);
      CHECK((float_bits(values[c]) == float_bits(ref) || (std::isnan(values[c]) && std::isnan(ref))));
    }
  }
}
