// FP8 block scaling on the GPU (--fp8-recipe blockwise): the block casts against their CPU
// twins bit for bit, cuBLASLt's block-scaled GEMMs (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
// and _BLK128x128_32F) against the CPU reference within stated bounds, and the combinations
// the engine refuses. Every test reports SKIPPED without a GPU.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "core/block_scaling.h"
#include "core/block_scaling_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/gemm_cuda.h"
#include "tests/gemm_testing.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using fp8lm::cuda::DeviceBuffer;
using fp8lm::cuda::GemmArgs;
using fp8lm::cuda::GemmDesc;
using fp8lm::cuda::GemmEngine;
using fp8lm::cuda::GemmScaling;
using fp8lm::cuda::GemmType;
using fp8lm::testing::device_copy;
using fp8lm::testing::device_sync;
using fp8lm::testing::kPoisonByte;
using fp8lm::testing::random_floats;
using fp8lm::testing::relative_error;

namespace {

// Test input [M,N]: normal values whose magnitude changes from tile to tile (2^-20 .. 2^10),
// plus the edge cases: an all-zero 1x128 tile and an all-zero 128x128 block, a +inf (the
// scale of its tile is 1 and the value saturates), values that overflow nothing because the
// scale maps the amax onto the format's range, and negative zeros. Representable in BF16,
// so a BF16 and an FP32 input hold the same values.
std::vector<float> edge_case_input(int M, int N, uint64_t seed) {
  std::vector<float> x = random_floats(size_t(M) * N, seed);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) x[size_t(r) * N + c] *= std::ldexp(1.0f, ((r / 3 + c / 128) % 31) - 20);
  for (int c = 0; c < 128; ++c) x[size_t(1) * N + c] = 0.0f;            // row 1, tile 0: all zero
  for (int r = 128; r < 256 && r < M; ++r)
    for (int c = 128; c < 256 && c < N; ++c) x[size_t(r) * N + c] = -0.0f;  // block (1, 1): all (negative) zero
  x[size_t(2) * N + 5] = INFINITY;
  return testing::bf16_rounded(x);
}

std::vector<uint8_t> codes_of(const std::vector<float>& values, Fp8Dtype dtype) {
  std::vector<uint8_t> codes(values.size());
  for (size_t i = 0; i < values.size(); ++i) codes[i] = fp8_encode(values[i], dtype);
  return codes;
}

// The real (unpadded) entries of a scale array, in index order.
std::vector<float> real_scales(const std::vector<float>& scales, BlockScaling scaling, int rows, int cols) {
  std::vector<float> out;
  if (scaling == BlockScaling::tiles_1x128) {
    for (int t = 0; t < cols / 128; ++t)
      for (int r = 0; r < rows; ++r) out.push_back(scales[size_t(tile_scale_index(r, t, rows))]);
  } else {
    for (int rb = 0; rb < rows / 128; ++rb)
      for (int cb = 0; cb < cols / 128; ++cb) out.push_back(scales[size_t(block_scale_index(rb, cb, cols))]);
  }
  return out;
}

template <typename T>
DeviceBuffer<T> input_on_device(const std::vector<float>& x);
template <>
DeviceBuffer<float> input_on_device<float>(const std::vector<float>& x) {
  return device_copy(x);
}
template <>
DeviceBuffer<__nv_bfloat16> input_on_device<__nv_bfloat16>(const std::vector<float>& x) {
  return device_copy(testing::to_bf16(x));
}

template <typename T>
void check_tile_cast(int M, int N, Fp8Dtype dtype, bool with_transpose, int margin) {
  INFO("1x128 tiles [" << M << "," << N << "] " << to_string(dtype) << (sizeof(T) == 2 ? " from bf16" : " from fp32")
                       << (with_transpose ? " with transpose" : "") << " margin " << margin);
  const std::vector<float> x = edge_case_input(M, N, 7 + M + N);
  // CPU twin.
  std::vector<float> q(x.size()), s(size_t(tile_scale_count(M, N))), x_t(x.size()), q_t(x.size()),
      s_t(size_t(tile_scale_count(N, M)));
  cpu::quantize_tiles_1x128(q.data(), s.data(), x.data(), M, N, dtype, margin);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) x_t[size_t(c) * M + r] = x[size_t(r) * N + c];
  if (with_transpose) cpu::quantize_tiles_1x128(q_t.data(), s_t.data(), x_t.data(), N, M, dtype, margin);
  // GPU.
  DeviceBuffer<T> in = input_on_device<T>(x);
  DeviceBuffer<uint8_t> out = testing::poisoned<uint8_t>(x.size()), out_t = testing::poisoned<uint8_t>(x.size());
  DeviceBuffer<float> scales = testing::poisoned<float>(s.size()), scales_t = testing::poisoned<float>(s_t.size());
  cuda::quantize_tiles_1x128(out.data(), scales.data(), with_transpose ? out_t.data() : nullptr,
                             with_transpose ? scales_t.data() : nullptr, in.data(), M, N, dtype, margin, nullptr);
  device_sync();
  CHECK(out.download() == codes_of(q, dtype));
  CHECK(testing::same_bytes(real_scales(scales.download(), BlockScaling::tiles_1x128, M, N),
                            real_scales(s, BlockScaling::tiles_1x128, M, N)));
  if (!with_transpose) return;
  CHECK(out_t.download() == codes_of(q_t, dtype));
  CHECK(testing::same_bytes(real_scales(scales_t.download(), BlockScaling::tiles_1x128, N, M),
                            real_scales(s_t, BlockScaling::tiles_1x128, N, M)));
}

template <typename T>
void check_block_cast(int M, int N, Fp8Dtype dtype, bool with_transpose) {
  INFO("128x128 blocks [" << M << "," << N << "] " << to_string(dtype) << (sizeof(T) == 2 ? " from bf16" : " from fp32")
                          << (with_transpose ? " with transpose" : ""));
  const std::vector<float> x = edge_case_input(M, N, 11 + M + N);
  std::vector<float> q(x.size()), s(size_t(block_scale_count(M, N))), s_t(size_t(block_scale_count(N, M)));
  cpu::quantize_blocks_128x128(q.data(), s.data(), x.data(), M, N, dtype, 0);
  cpu::transpose_block_scales(s_t.data(), s.data(), M, N);
  std::vector<uint8_t> codes = codes_of(q, dtype), codes_t(codes.size());
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) codes_t[size_t(c) * M + r] = codes[size_t(r) * N + c];
  DeviceBuffer<T> in = input_on_device<T>(x);
  DeviceBuffer<uint8_t> out = testing::poisoned<uint8_t>(x.size()), out_t = testing::poisoned<uint8_t>(x.size());
  DeviceBuffer<float> scales = testing::poisoned<float>(s.size()), scales_t = testing::poisoned<float>(s_t.size());
  cuda::quantize_blocks_128x128(out.data(), scales.data(), with_transpose ? out_t.data() : nullptr,
                                with_transpose ? scales_t.data() : nullptr, in.data(), M, N, dtype, 0, nullptr);
  device_sync();
  CHECK(out.download() == codes);
  CHECK(testing::same_bytes(real_scales(scales.download(), BlockScaling::blocks_128x128, M, N),
                            real_scales(s, BlockScaling::blocks_128x128, M, N)));
  if (!with_transpose) return;
  CHECK(out_t.download() == codes_t);
  CHECK(testing::same_bytes(real_scales(scales_t.download(), BlockScaling::blocks_128x128, N, M),
                            real_scales(s_t, BlockScaling::blocks_128x128, N, M)));
}

}  // namespace

TEST_CASE("GPU 1x128 block cast: codes and tile scales bit-identical to the CPU, with its own-tiled transpose",
          "[gpu][block-scaling]") {
  FP8LM_REQUIRE_GPU();
  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    check_tile_cast<__nv_bfloat16>(256, 384, dtype, true, 0);
    check_tile_cast<float>(256, 384, dtype, true, 0);
    check_tile_cast<__nv_bfloat16>(44, 256, dtype, false, 0);  // rows a multiple of 4, not of 8 or 128
    check_tile_cast<__nv_bfloat16>(1024, 768, dtype, true, 2);
    // Ragged: the last tile of a row 80 wide, of a column 64 (and a 16-column slab).
    check_tile_cast<__nv_bfloat16>(320, 336, dtype, true, 0);
    check_tile_cast<float>(48, 208, dtype, true, 0);
    check_tile_cast<__nv_bfloat16>(2048, 1600, dtype, true, 0);  // gpt2-1558m's n_embd
  }
}

TEST_CASE("GPU 128x128 block cast: codes, W^T and block scales bit-identical to the CPU", "[gpu][block-scaling]") {
  FP8LM_REQUIRE_GPU();
  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    check_block_cast<float>(256, 384, dtype, true);
    check_block_cast<__nv_bfloat16>(384, 256, dtype, true);
    check_block_cast<float>(768, 3072, dtype, false);
    // Ragged blocks: 80 and 16 rows, 80 columns; gpt2-1558m's c_attn weight [4800, 1600].
    check_block_cast<float>(208, 336, dtype, true);
    check_block_cast<__nv_bfloat16>(144, 208, dtype, true);
    check_block_cast<float>(4800, 1600, dtype, true);
  }
}

namespace {

GemmScaling gemm_scaling(BlockScaling scaling) {
  return scaling == BlockScaling::tiles_1x128 ? GemmScaling::tiles_1x128 : GemmScaling::blocks_128x128;
}

// One block-scaled operand: codes for the GPU, exact values and scales for the CPU.
struct BlockOperand {
  std::vector<uint8_t> codes;
  std::vector<float> values, scale_inv;
};

BlockOperand block_operand(int rows, int cols, BlockScaling scaling, Fp8Dtype dtype, uint64_t seed, float std_dev) {
  std::vector<float> x = random_floats(size_t(rows) * cols, seed, std_dev);
  // Magnitudes that change from row to row (and so from tile to tile and block to block).
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) x[size_t(r) * cols + c] *= std::ldexp(1.0f, (r % 5) * 3 - 6);
  BlockOperand op;
  op.values.resize(x.size());
  op.scale_inv.assign(size_t(scale_count(scaling, rows, cols)), 1.0f);  // the padding: never read
  if (scaling == BlockScaling::tiles_1x128) {
    cpu::quantize_tiles_1x128(op.values.data(), op.scale_inv.data(), x.data(), rows, cols, dtype, 0);
  } else {
    cpu::quantize_blocks_128x128(op.values.data(), op.scale_inv.data(), x.data(), rows, cols, dtype, 0);
  }
  op.codes = codes_of(op.values, dtype);
  return op;
}

enum class CMode { none, accumulate /* C == D */, residual /* C is another buffer */ };

struct BlockGemmCase {
  const char* name;
  int M, N, K;
  BlockScaling a_scaling, b_scaling;
  Fp8Dtype a_dtype, b_dtype;
  GemmType d_type;
  bool bias;
  CMode c_mode;
  double bound;
};

// Bounds (relative_error against the CPU reference cpu::gemm_block_scaled, which rescales
// each 128-wide K block's FP32 partial sum; the FP8 products are exact, so only the
// accumulation differs, as in test_gemm_cast_gpu.cpp's per-tensor FP8 cases):
//   BF16 output: one or two BF16 roundings (<= 3.9e-3): bound 5e-3.
//   FP32 output: Hopper's FP8 tensor cores keep ~14 significant bits between promotions to
//                FP32: bound 2^-12 = 2.4e-4.
// A layout or scale mistake (a scale applied to the wrong row, tile or block) gives errors of
// order 1, since the operands' magnitudes change by 2^3 from row to row.
constexpr double kBf16OutBound = 5e-3;
constexpr double kFp32OutBound = 2.44e-4;

const BlockGemmCase kBlockGemmCases[] = {
    // forward: X (1x128, e4m3) . W (128x128, e4m3)^T -> bf16 + bias; and c_proj's residual (C != D)
    {"forward 1x128 x 128x128 + bias", 256, 384, 512, BlockScaling::tiles_1x128, BlockScaling::blocks_128x128,
     Fp8Dtype::e4m3, Fp8Dtype::e4m3, GemmType::bf16, true, CMode::none, kBf16OutBound},
    {"forward 1x128 x 128x128 + bias + residual", 256, 384, 512, BlockScaling::tiles_1x128,
     BlockScaling::blocks_128x128, Fp8Dtype::e4m3, Fp8Dtype::e4m3, GemmType::bf16, true, CMode::residual,
     kBf16OutBound},
    {"forward gpt2-124m c_fc", 2048, 3072, 768, BlockScaling::tiles_1x128, BlockScaling::blocks_128x128,
     Fp8Dtype::e4m3, Fp8Dtype::e4m3, GemmType::bf16, true, CMode::none, kBf16OutBound},
    // dgrad: dY (1x128, e5m2) . Wt (128x128, e4m3)^T -> bf16
    {"dgrad 1x128 e5m2 x 128x128 e4m3", 256, 512, 384, BlockScaling::tiles_1x128, BlockScaling::blocks_128x128,
     Fp8Dtype::e5m2, Fp8Dtype::e4m3, GemmType::bf16, false, CMode::none, kBf16OutBound},
    // wgrad: dYt (1x128, e5m2) . Xt (1x128, e4m3)^T accumulated into FP32 (C == D)
    {"wgrad 1x128 e5m2 x 1x128 e4m3 -> fp32 +=", 384, 512, 256, BlockScaling::tiles_1x128, BlockScaling::tiles_1x128,
     Fp8Dtype::e5m2, Fp8Dtype::e4m3, GemmType::fp32, false, CMode::accumulate, kFp32OutBound},
    {"wgrad gpt2-124m c_fc", 3072, 768, 2048, BlockScaling::tiles_1x128, BlockScaling::tiles_1x128, Fp8Dtype::e5m2,
     Fp8Dtype::e4m3, GemmType::fp32, false, CMode::accumulate, kFp32OutBound},
    // Ragged: gpt2-1558m's n_embd 1600 = 12.5 x 128 and c_attn's 4800 = 37.5 x 128, as K and
    // as N: the last K block is 64 wide, the last row of weight blocks 64 high.
    {"forward ragged (gpt2-1558m c_attn)", 256, 4800, 1600, BlockScaling::tiles_1x128, BlockScaling::blocks_128x128,
     Fp8Dtype::e4m3, Fp8Dtype::e4m3, GemmType::bf16, true, CMode::none, kBf16OutBound},
    {"dgrad ragged (gpt2-1558m c_attn)", 256, 1600, 4800, BlockScaling::tiles_1x128, BlockScaling::blocks_128x128,
     Fp8Dtype::e5m2, Fp8Dtype::e4m3, GemmType::bf16, false, CMode::none, kBf16OutBound},
    {"wgrad ragged (gpt2-1558m c_attn)", 4800, 1600, 256, BlockScaling::tiles_1x128, BlockScaling::tiles_1x128,
     Fp8Dtype::e5m2, Fp8Dtype::e4m3, GemmType::fp32, false, CMode::accumulate, kFp32OutBound},
    {"small ragged, residual", 320, 336, 208, BlockScaling::tiles_1x128, BlockScaling::blocks_128x128,
     Fp8Dtype::e4m3, Fp8Dtype::e4m3, GemmType::bf16, true, CMode::residual, kBf16OutBound},
    // 128x128 x 1x128 (the mirrored pairing cuBLASLt also takes)
    {"128x128 x 1x128 -> fp32", 256, 384, 256, BlockScaling::blocks_128x128, BlockScaling::tiles_1x128,
     Fp8Dtype::e4m3, Fp8Dtype::e4m3, GemmType::fp32, false, CMode::none, kFp32OutBound},
};

void run_block_gemm_case(GemmEngine& engine, const BlockGemmCase& c, uint64_t seed) {
  INFO(c.name << " M=" << c.M << " N=" << c.N << " K=" << c.K);
  const BlockOperand a = block_operand(c.M, c.K, c.a_scaling, c.a_dtype, seed + 1, 1.0f);
  const BlockOperand b = block_operand(c.N, c.K, c.b_scaling, c.b_dtype, seed + 2, 0.05f);
  const size_t mn = size_t(c.M) * c.N;
  const std::vector<float> bias = testing::bf16_rounded(random_floats(size_t(c.N), seed + 3, 0.5f));
  std::vector<float> c_init = random_floats(mn, seed + 4, 1.0f);
  if (c.d_type == GemmType::bf16) c_init = testing::bf16_rounded(c_init);

  // CPU reference: the block-scaled product, then + bias, then + C.
  std::vector<float> ref(mn);
  cpu::gemm_block_scaled(ref.data(), a.values.data(), a.scale_inv.data(), c.a_scaling, b.values.data(),
                         b.scale_inv.data(), c.b_scaling, c.M, c.N, c.K, 1.0f, false);
  for (int i = 0; i < c.M; ++i)
    for (int j = 0; j < c.N; ++j) {
      float& r = ref[size_t(i) * c.N + j];
      if (c.bias) r += bias[size_t(j)];
      if (c.c_mode != CMode::none) r += c_init[size_t(i) * c.N + j];
    }

  DeviceBuffer<uint8_t> d_a = device_copy(a.codes), d_b = device_copy(b.codes);
  DeviceBuffer<float> d_sa = device_copy(a.scale_inv), d_sb = device_copy(b.scale_inv);
  DeviceBuffer<uint8_t> d_bias = device_copy(testing::gemm_bytes(bias, GemmType::bf16));
  DeviceBuffer<uint8_t> d_out = c.c_mode == CMode::accumulate ? device_copy(testing::gemm_bytes(c_init, c.d_type))
                                                              : testing::poisoned<uint8_t>(mn * cuda::gemm_type_bytes(c.d_type));
  DeviceBuffer<uint8_t> d_residual;
  if (c.c_mode == CMode::residual) d_residual = device_copy(testing::gemm_bytes(c_init, c.d_type));

  GemmDesc desc;
  desc.M = c.M;
  desc.N = c.N;
  desc.K = c.K;
  desc.a_type = c.a_dtype == Fp8Dtype::e4m3 ? GemmType::e4m3 : GemmType::e5m2;
  desc.b_type = c.b_dtype == Fp8Dtype::e4m3 ? GemmType::e4m3 : GemmType::e5m2;
  desc.d_type = c.d_type;
  desc.bias_type = GemmType::bf16;
  desc.a_scaling = gemm_scaling(c.a_scaling);
  desc.b_scaling = gemm_scaling(c.b_scaling);
  GemmArgs args;
  args.D = d_out.data();
  args.A = d_a.data();
  args.B = d_b.data();
  args.C = c.c_mode == CMode::none ? nullptr : c.c_mode == CMode::accumulate ? d_out.data() : d_residual.data();
  args.beta = c.c_mode == CMode::none ? 0.0f : 1.0f;
  args.bias = c.bias ? d_bias.data() : nullptr;
  args.a_scale_inv = d_sa.data();
  args.b_scale_inv = d_sb.data();
  engine.gemm(desc, args, nullptr);
  device_sync();
  const double error = relative_error(testing::gemm_values(d_out.download(), c.d_type), ref);
  INFO("relative error " << error << " bound " << c.bound);
  CHECK(error <= c.bound);
}

}  // namespace

TEST_CASE("cuBLASLt block-scaled GEMMs match the CPU reference in forward, dgrad and wgrad", "[gpu][block-scaling]") {
  FP8LM_REQUIRE_GPU();
  GemmEngine engine;
  uint64_t seed = 100;
  for (const BlockGemmCase& c : kBlockGemmCases) run_block_gemm_case(engine, c, seed += 10);
  // The plans are cached by their scale modes too: the same shapes with per-tensor scales
  // are another plan, and repeating a block-scaled call makes none.
  const size_t plans = engine.cache_size();
  run_block_gemm_case(engine, kBlockGemmCases[0], 7);
  CHECK(engine.cache_size() == plans);
}

TEST_CASE("cuBLASLt block scaling: unsupported combinations are errors naming them, never a fallback",
          "[gpu][block-scaling]") {
  FP8LM_REQUIRE_GPU();
  GemmEngine engine;
  const int M = 256, N = 256, K = 256;
  DeviceBuffer<uint8_t> a(size_t(M) * K), b(size_t(N) * K);
  DeviceBuffer<float> scales(4096), out(size_t(M) * N);
  a.fill_bytes(0);
  b.fill_bytes(0);
  scales.fill_bytes(0);
  auto attempt = [&](GemmScaling sa, GemmScaling sb, bool fast_accum, int k, const float* a_scales) {
    GemmDesc desc;
    desc.M = M;
    desc.N = N;
    desc.K = k;
    desc.a_type = desc.b_type = GemmType::e4m3;
    desc.d_type = GemmType::fp32;
    desc.a_scaling = sa;
    desc.b_scaling = sb;
    desc.fast_accum = fast_accum;
    GemmArgs args;
    args.D = out.data();
    args.A = a.data();
    args.B = b.data();
    args.a_scale_inv = a_scales;
    args.b_scale_inv = scales.data();
    engine.gemm(desc, args, nullptr);
  };
  using Catch::Matchers::ContainsSubstring;
  CHECK_THROWS_WITH(attempt(GemmScaling::blocks_128x128, GemmScaling::blocks_128x128, false, K, scales.data()),
                    ContainsSubstring("not supported on Hopper"));
  CHECK_THROWS_WITH(attempt(GemmScaling::tiles_1x128, GemmScaling::blocks_128x128, true, K, scales.data()),
                    ContainsSubstring("fast accumulation"));
  CHECK_THROWS_WITH(attempt(GemmScaling::tiles_1x128, GemmScaling::tensor, false, K, scales.data()),
                    ContainsSubstring("block-scaled partner"));
  CHECK_THROWS_WITH(attempt(GemmScaling::tiles_1x128, GemmScaling::blocks_128x128, false, 200, scales.data()),
                    ContainsSubstring("multiple of 16"));
  CHECK_THROWS_WITH(attempt(GemmScaling::tiles_1x128, GemmScaling::blocks_128x128, false, K, scales.data() + 1),
                    ContainsSubstring("16-byte aligned"));
  // And the supported pairing runs (zeros in, zeros out).
  CHECK_NOTHROW(attempt(GemmScaling::tiles_1x128, GemmScaling::blocks_128x128, false, K, scales.data()));
  device_sync();
}
