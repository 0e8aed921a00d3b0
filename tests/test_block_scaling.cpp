// FP8 block scaling on the CPU (core/block_scaling.h): the scale rule, the 1x128 and 128x128
// quantizations and their cuBLASLt scale layouts on hand-made tensors, the refusals, and the
// block-scaled GEMM against a float64 reference.
#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "core/block_scaling.h"
#include "core/error.h"
#include "core/random.h"

using namespace fp8lm;

namespace {

std::vector<float> random_values(size_t n, uint64_t seed, float std_dev = 1.0f) {
  Random random(seed);
  std::vector<float> values(n);
  for (float& v : values) v = std_dev * float(random.normal());
  return values;
}

// A sentinel the padding entries of a scale array must keep (they are never written).
constexpr float kUnwritten = -7.0f;

}  // namespace

TEST_CASE("block scale: a power of two at or below fp8_max / amax; 1 for zero, infinite or NaN tiles",
          "[block-scaling]") {
  CHECK(block_scale(448.0f, kE4M3Max, 0) == 1.0f);
  CHECK(block_scale(1.0f, kE4M3Max, 0) == 256.0f);      // 448 -> 256
  CHECK(block_scale(2.0f, kE4M3Max, 0) == 128.0f);      // 224 -> 128
  CHECK(block_scale(3.5f, kE4M3Max, 0) == 128.0f);      // 448 / 3.5 = 128 exactly
  CHECK(block_scale(3.6f, kE4M3Max, 0) == 64.0f);       // 124.4 -> 64
  CHECK(block_scale(1000.0f, kE4M3Max, 0) == 0.25f);    // 0.448 -> 0.25
  CHECK(block_scale(1.0f, kE5M2Max, 0) == 32768.0f);    // 57344 -> 32768
  CHECK(block_scale(1.0f, kE4M3Max, 1) == 128.0f);      // margin 1: 224 -> 128
  CHECK(block_scale(0.0f, kE4M3Max, 0) == 1.0f);        // an all-zero tile
  CHECK(block_scale(INFINITY, kE4M3Max, 0) == 1.0f);
  CHECK(block_scale(NAN, kE4M3Max, 0) == 1.0f);
  // A tiny amax whose scale overflows FP32: FLT_MAX, then its power of two, 2^127.
  CHECK(block_scale(1e-38f, kE4M3Max, 0) == std::ldexp(1.0f, 127));
  // The tile's amax lands at or below fp8_max, never above: nothing saturates.
  for (float amax : {0.3f, 1.7f, 5.0f, 123.456f, 4e4f})
    CHECK(amax * block_scale(amax, kE4M3Max, 0) <= kE4M3Max);
}

TEST_CASE("the scale layouts are cuBLASLt's: tiles column-major over (row, tile), blocks row-major, padded to 4",
          "[block-scaling]") {
  CHECK(round_up4(3) == 4);
  CHECK(round_up4(8) == 8);
  // X [6, 384]: 3 tiles per row; the rows of a tile column padded to 8.
  CHECK(tile_scale_count(6, 384) == 3 * 8);
  CHECK(tile_scale_index(5, 2, 6) == 2 * 8 + 5);
  // W [256, 640]: 2 x 5 blocks, each row of blocks padded to 8.
  CHECK(block_scale_count(256, 640) == 2 * 8);
  CHECK(block_scale_index(1, 4, 640) == 1 * 8 + 4);
  CHECK(scale_count(BlockScaling::none, 256, 640) == 0);
}

TEST_CASE("1x128 tiles: each row's tile gets its own scale from its own amax", "[block-scaling]") {
  // in [3, 256]: row 0 tile 0 amax 2 (scale 128), tile 1 all zero; row 1 tile 0 amax 1e-5
  // (scale 2^25), tile 1 amax 3.6 (scale 64); row 2 amax 0.5 (scale 512), a NaN in tile 1.
  const int64_t rows = 3, cols = 256;
  std::vector<float> in(rows * cols, 0.0f);
  for (int c = 0; c < 128; ++c) in[c] = 2.0f * float(c - 64) / 64.0f;  // in [-2, 1.97]: amax 2
  for (int c = 0; c < 128; ++c) in[cols + c] = (c % 2 ? 1e-5f : -5e-6f);
  for (int c = 128; c < 256; ++c) in[cols + c] = 3.6f * float(c - 128) / 127.0f;
  for (int c = 0; c < 256; ++c) in[2 * cols + c] = 0.5f;
  in[2 * cols + 200] = NAN;
  std::vector<float> out(in.size()), scale_inv(tile_scale_count(rows, cols), kUnwritten);
  cpu::quantize_tiles_1x128(out.data(), scale_inv.data(), in.data(), rows, cols, Fp8Dtype::e4m3, 0);
  REQUIRE(scale_inv.size() == 2 * 4);
  CHECK(scale_inv[tile_scale_index(0, 0, rows)] == 1.0f / 128.0f);
  CHECK(scale_inv[tile_scale_index(0, 1, rows)] == 1.0f);  // all zero: scale 1
  CHECK(scale_inv[tile_scale_index(1, 0, rows)] == std::ldexp(1.0f, -25));  // 448 / 1e-5 = 4.48e7 -> 2^25
  CHECK(scale_inv[tile_scale_index(1, 1, rows)] == 1.0f / 64.0f);
  CHECK(scale_inv[tile_scale_index(2, 0, rows)] == 1.0f / 512.0f);  // 896 -> 512
  CHECK(scale_inv[tile_scale_index(2, 1, rows)] == 1.0f);           // NaN amax: scale 1
  CHECK(scale_inv[3] == kUnwritten);                                // row padding, tile 0
  CHECK(scale_inv[7] == kUnwritten);                                // row padding, tile 1
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t at = size_t(r * cols + c);
      const float scale = 1.0f / scale_inv[tile_scale_index(r, c / 128, rows)];
      if (std::isnan(in[at])) {
        CHECK(std::isnan(out[at]));
        continue;
      }
      INFO("row " << r << " column " << c);
      CHECK(out[at] == fp8_round(in[at] * scale, Fp8Dtype::e4m3));
    }
  // The small tile keeps three significant bits: 1e-5 * 2^25 = 335.5 -> 320. One scale for the
  // whole tensor (448 / 3.6) would put it among E4M3's subnormals: 1.24e-3 -> 2^-9, 57% off.
  CHECK(out[cols + 1] == 320.0f);
  const float tensor_scale = 448.0f / 3.6f;
  CHECK(fp8_round(1e-5f * tensor_scale, Fp8Dtype::e4m3) / tensor_scale > 1.5e-5f);
}

TEST_CASE("the transposed operand is quantized along the other dimension, from the high-precision values",
          "[block-scaling]") {
  // in [128, 128] with one outlier at (3, 5): row 3's tile and column 5's tile take the small
  // scale; the rest of the transpose keeps its own fine scales, so codes differ from X's transposed.
  const int64_t n = 128;
  std::vector<float> in = random_values(n * n, 3, 0.1f);
  in[3 * n + 5] = 40.0f;
  in[4 * n + 5] = 0.0013f;  // small beside the outlier of its column, ordinary in its row
  std::vector<float> out(n * n), scale_inv(tile_scale_count(n, n)), in_t(n * n), out_t(n * n),
      scale_inv_t(tile_scale_count(n, n));
  cpu::quantize_tiles_1x128(out.data(), scale_inv.data(), in.data(), n, n, Fp8Dtype::e4m3, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < n; ++c) in_t[c * n + r] = in[r * n + c];
  cpu::quantize_tiles_1x128(out_t.data(), scale_inv_t.data(), in_t.data(), n, n, Fp8Dtype::e4m3, 0);
  CHECK(scale_inv[tile_scale_index(3, 0, n)] == 1.0f / 8.0f);    // 448 / 40 = 11.2 -> 8
  CHECK(scale_inv_t[tile_scale_index(5, 0, n)] == 1.0f / 8.0f);  // column 5 of X is row 5 of X^T
  CHECK(scale_inv[tile_scale_index(4, 0, n)] < 1.0f / 8.0f);     // other rows: finer
  // Row 4, column 5: quantized with row 4's scale in X (0.0013 * 1024 = 1.33 -> 1.375, a normal
  // E4M3 value), with column 5's, the outlier's, in X^T (0.0013 * 8 = 0.0104, a subnormal: 5 x 2^-9).
  // Power-of-two scales round normal values alike; where the scale pushes a value among the
  // subnormals, the transposed copy's own tiles give another code.
  CHECK(out[4 * n + 5] * scale_inv[tile_scale_index(4, 0, n)] !=
        out_t[5 * n + 4] * scale_inv_t[tile_scale_index(5, 0, n)]);
  CHECK(out_t[5 * n + 4] == 5.0f * std::ldexp(1.0f, -9));
}

TEST_CASE("128x128 blocks: one scale per block, the transposed operand's scales are the blocks transposed",
          "[block-scaling]") {
  const int64_t rows = 256, cols = 384;
  std::vector<float> in = random_values(rows * cols, 5, 0.02f);
  // Block (0, 0) amax 1 (scale 256); block (1, 2) amax 100 (scale 4); block (0, 2) all zero.
  in[17 * cols + 3] = -1.0f;
  in[(128 + 64) * cols + 256 + 100] = 100.0f;
  for (int64_t r = 0; r < 128; ++r)
    for (int64_t c = 256; c < 384; ++c) in[r * cols + c] = 0.0f;
  std::vector<float> out(in.size()), scale_inv(block_scale_count(rows, cols), kUnwritten);
  cpu::quantize_blocks_128x128(out.data(), scale_inv.data(), in.data(), rows, cols, Fp8Dtype::e4m3, 0);
  REQUIRE(scale_inv.size() == 2 * 4);
  CHECK(scale_inv[block_scale_index(0, 0, cols)] == 1.0f / 256.0f);
  CHECK(scale_inv[block_scale_index(1, 2, cols)] == 1.0f / 4.0f);
  CHECK(scale_inv[block_scale_index(0, 2, cols)] == 1.0f);
  CHECK(scale_inv[3] == kUnwritten);  // padding of row block 0
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = 1.0f / scale_inv[block_scale_index(r / 128, c / 128, cols)];
      REQUIRE(out[r * cols + c] == fp8_round(in[r * cols + c] * scale, Fp8Dtype::e4m3));
    }
  std::vector<float> scale_inv_t(block_scale_count(cols, rows), kUnwritten);
  cpu::transpose_block_scales(scale_inv_t.data(), scale_inv.data(), rows, cols);
  REQUIRE(scale_inv_t.size() == 3 * 4);
  for (int64_t rb = 0; rb < 2; ++rb)
    for (int64_t cb = 0; cb < 3; ++cb)
      CHECK(scale_inv_t[block_scale_index(cb, rb, rows)] == scale_inv[block_scale_index(rb, cb, cols)]);
  CHECK(scale_inv_t[2] == kUnwritten);  // W^T [384, 256]: 2 blocks per row, padded to 4
}

TEST_CASE("ragged edges: a partial last tile or block is scaled from the values it holds; 16 is the unit",
          "[block-scaling]") {
  // X [2, 208]: tile 1 of each row is 80 wide. W [144, 208]: blocks of 128x128, 128x80, 16x128, 16x80.
  CHECK(scale_tiles(208) == 2);
  CHECK(scale_tile_width(1, 208) == 80);
  CHECK(tile_scale_count(2, 208) == 2 * 4);
  CHECK(block_scale_count(144, 208) == 2 * 4);
  CHECK(block_scale_index(1, 1, 208) == 1 * 4 + 1);
  std::vector<float> x(2 * 208, 0.25f);
  x[1 * 208 + 150] = 3.0f;  // row 1's partial tile: amax 3 -> scale 128
  std::vector<float> qx(x.size()), sx(size_t(tile_scale_count(2, 208)), kUnwritten);
  cpu::quantize_tiles_1x128(qx.data(), sx.data(), x.data(), 2, 208, Fp8Dtype::e4m3, 0);
  CHECK(sx[tile_scale_index(0, 1, 2)] == 1.0f / 1024.0f);  // 0.25: 1792 -> 1024
  CHECK(sx[tile_scale_index(1, 1, 2)] == 1.0f / 128.0f);
  CHECK(qx[1 * 208 + 150] == 384.0f);
  std::vector<float> w(144 * 208, 0.5f), qw(w.size()), sw(size_t(block_scale_count(144, 208)), kUnwritten);
  w[140 * 208 + 200] = -7.0f;  // block (1, 1), 16 x 80: amax 7 -> scale 64
  cpu::quantize_blocks_128x128(qw.data(), sw.data(), w.data(), 144, 208, Fp8Dtype::e4m3, 0);
  CHECK(sw[block_scale_index(0, 0, 208)] == 1.0f / 512.0f);  // 0.5: 896 -> 512
  CHECK(sw[block_scale_index(1, 1, 208)] == 1.0f / 64.0f);
  CHECK(sw[block_scale_index(1, 0, 208)] == 1.0f / 512.0f);
  CHECK(sw[2] == kUnwritten);  // row block 0's padding
  std::vector<float> sw_t(size_t(block_scale_count(208, 144)), kUnwritten);
  cpu::transpose_block_scales(sw_t.data(), sw.data(), 144, 208);
  CHECK(sw_t[block_scale_index(1, 1, 144)] == 1.0f / 64.0f);
  CHECK(sw_t[block_scale_index(1, 0, 144)] == sw[block_scale_index(0, 1, 208)]);
  // Not a multiple of 16: refused (cuBLASLt's FP8 alignment).
  std::vector<float> out(200 * 256), scales(1024);
  const std::vector<float> in(200 * 256, 1.0f);
  CHECK_THROWS_WITH(cpu::quantize_tiles_1x128(out.data(), scales.data(), in.data(), 256, 200, Fp8Dtype::e4m3, 0),
                    Catch::Matchers::ContainsSubstring("columns are not a multiple of 16"));
  CHECK_THROWS_WITH(cpu::quantize_blocks_128x128(out.data(), scales.data(), in.data(), 200, 256, Fp8Dtype::e4m3, 0),
                    Catch::Matchers::ContainsSubstring("rows are not a multiple of 16"));
  // Any row count for tiles (the layout pads it to 4); a transposed copy is a tiling of [cols, rows].
  CHECK_NOTHROW(cpu::quantize_tiles_1x128(out.data(), scales.data(), in.data(), 5, 256, Fp8Dtype::e4m3, 0));
  CHECK(block_scaling_shape_problem(BlockScaling::tiles_1x128, 7, 384, "x").empty());
  CHECK(block_scaling_shape_problem(BlockScaling::blocks_128x128, 7, 384, "w") == "w [7, 384]: its rows are not a "
                                                                                   "multiple of 16");
}

namespace {

struct Quantized {
  std::vector<float> values, scale_inv;
};

Quantized quantize(const std::vector<float>& in, int64_t rows, int64_t cols, BlockScaling scaling, Fp8Dtype dtype) {
  Quantized q{std::vector<float>(in.size()), std::vector<float>(scale_count(scaling, rows, cols))};
  if (scaling == BlockScaling::tiles_1x128) {
    cpu::quantize_tiles_1x128(q.values.data(), q.scale_inv.data(), in.data(), rows, cols, dtype, 0);
  } else {
    cpu::quantize_blocks_128x128(q.values.data(), q.scale_inv.data(), in.data(), rows, cols, dtype, 0);
  }
  return q;
}

// The dequantized value at (r, c) of a quantized [rows, cols] operand, in float64.
double dequantized(const Quantized& q, BlockScaling scaling, int64_t rows, int64_t cols, int64_t r, int64_t c) {
  const float scale_inv = scaling == BlockScaling::tiles_1x128 ? q.scale_inv[tile_scale_index(r, c / 128, rows)]
                                                               : q.scale_inv[block_scale_index(r / 128, c / 128, cols)];
  return double(q.values[size_t(r * cols + c)]) * scale_inv;
}

}  // namespace

TEST_CASE("block-scaled GEMM: within FP32 summation error of a float64 reference, in every supported pairing",
          "[block-scaling]") {
  // Stated bound, per element: |C - C_ref| <= K * 2^-23 * sum_k |a_k b_k|, the FP32
  // accumulation of K products (the FP8 products and the power-of-two rescalings are exact),
  // with C_ref the float64 sum of the dequantized products. And the quantization error of
  // each row of C, against the unquantized float64 product, under 10%: E4M3 keeps three
  // significant bits per value. With 1x128-tiled A that holds whatever the row's magnitude
  // (rows here span 2^-12 to 2^12); a 128x128 block shares one scale among 128 rows, so there
  // the rows keep one magnitude (24 binades in one block would flush the small rows to zero).
  // K = 336: two whole 128-wide blocks and one of 80; N = 272: a ragged row of weight blocks.
  const int M = 128, N = 272, K = 336;
  const std::vector<float> a_plain = random_values(size_t(M) * K, 11);
  const std::vector<float> b_in = random_values(size_t(N) * K, 12, 0.05f);
  std::vector<float> a_rows = a_plain;
  for (int i = 0; i < M; ++i)
    for (int k = 0; k < K; ++k) a_rows[size_t(i) * K + k] *= std::ldexp(1.0f, (i % 7) * 4 - 12);
  struct Pairing {
    BlockScaling a, b;
    const char* name;
  };
  for (const Pairing p : {Pairing{BlockScaling::tiles_1x128, BlockScaling::blocks_128x128, "1x128 x 128x128"},
                          Pairing{BlockScaling::tiles_1x128, BlockScaling::tiles_1x128, "1x128 x 1x128"},
                          Pairing{BlockScaling::blocks_128x128, BlockScaling::tiles_1x128, "128x128 x 1x128"}}) {
    INFO(p.name);
    const std::vector<float>& a_in = p.a == BlockScaling::tiles_1x128 ? a_rows : a_plain;
    const Quantized a = quantize(a_in, M, K, p.a, Fp8Dtype::e4m3), b = quantize(b_in, N, K, p.b, Fp8Dtype::e4m3);
    std::vector<float> C(size_t(M) * N, 1.0f);
    cpu::gemm_block_scaled(C.data(), a.values.data(), a.scale_inv.data(), p.a, b.values.data(), b.scale_inv.data(),
                           p.b, M, N, K, 1.0f, false);
    double worst_summation = 0.0, worst_row = 0.0;
    for (int i = 0; i < M; ++i) {
      double row_error = 0.0, row_norm = 0.0;
      for (int j = 0; j < N; ++j) {
        double ref = 0.0, magnitude = 0.0, exact = 0.0;
        for (int k = 0; k < K; ++k) {
          const double product = dequantized(a, p.a, M, K, i, k) * dequantized(b, p.b, N, K, j, k);
          ref += product;
          magnitude += std::fabs(product);
          exact += double(a_in[size_t(i) * K + k]) * b_in[size_t(j) * K + k];
        }
        const double c = C[size_t(i) * N + j];
        worst_summation = std::max(worst_summation, std::fabs(c - ref) / (K * std::ldexp(1.0, -23) * magnitude));
        row_error += (c - exact) * (c - exact);
        row_norm += exact * exact;
      }
      worst_row = std::max(worst_row, std::sqrt(row_error / row_norm));
    }
    INFO("worst error / summation bound " << worst_summation << ", worst row's relative quantization error "
                                          << worst_row);
    CHECK(worst_summation <= 1.0);
    CHECK(worst_row < 0.1);
  }
  // accumulate: C += the product (the wgrad GEMM adding into the FP32 gradient).
  const Quantized a = quantize(a_rows, M, K, BlockScaling::tiles_1x128, Fp8Dtype::e4m3);
  const Quantized b = quantize(b_in, N, K, BlockScaling::blocks_128x128, Fp8Dtype::e5m2);
  std::vector<float> once(size_t(M) * N), twice(size_t(M) * N);
  cpu::gemm_block_scaled(once.data(), a.values.data(), a.scale_inv.data(), BlockScaling::tiles_1x128,
                         b.values.data(), b.scale_inv.data(), BlockScaling::blocks_128x128, M, N, K, 1.0f, false);
  twice = once;
  cpu::gemm_block_scaled(twice.data(), a.values.data(), a.scale_inv.data(), BlockScaling::tiles_1x128,
                         b.values.data(), b.scale_inv.data(), BlockScaling::blocks_128x128, M, N, K, 1.0f, true);
  for (size_t i = 0; i < once.size(); ++i) REQUIRE(twice[i] == once[i] + once[i]);
}

TEST_CASE("block-scaled GEMM refuses what cuBLASLt on Hopper refuses", "[block-scaling]") {
  std::vector<float> a(256 * 256), s(1024, 1.0f), c(256 * 256);
  CHECK_THROWS_WITH(cpu::gemm_block_scaled(c.data(), a.data(), s.data(), BlockScaling::blocks_128x128, a.data(),
                                           s.data(), BlockScaling::blocks_128x128, 256, 256, 256, 1.0f, false),
                    Catch::Matchers::ContainsSubstring("128x128 x 128x128"));
  CHECK_THROWS_WITH(cpu::gemm_block_scaled(c.data(), a.data(), s.data(), BlockScaling::tiles_1x128, a.data(), s.data(),
                                           BlockScaling::none, 256, 256, 256, 1.0f, false),
                    Catch::Matchers::ContainsSubstring("both operands"));
  CHECK_THROWS_WITH(cpu::gemm_block_scaled(c.data(), a.data(), s.data(), BlockScaling::tiles_1x128, a.data(), s.data(),
                                           BlockScaling::tiles_1x128, 256, 256, 200, 1.0f, false),
                    Catch::Matchers::ContainsSubstring("not a multiple of 16"));
}
