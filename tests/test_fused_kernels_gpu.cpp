// The fused GPU kernels of the data path (LayerNorm, bias+GELU, embedding, cross-entropy)
// against their CPU twins in layers/*.cpp, on fresh BF16-rounded random inputs.
//
// Conventions of every test here:
// - Inputs are BF16-rounded first, so the FP32 CPU reference sees exactly what the GPU reads.
// - Written outputs (and scratch) are poisoned with 0xFF (NaN in every format) before each
//   run; accumulated (+=) outputs start from random values and the increments are checked.
// - Bounds (relative error ||gpu - cpu|| / ||cpu||):
//     kBf16Tol 1e-2    BF16 outputs: BF16 rounding is 2^-9 relative per element (~2e-3 rms);
//     kGradTol 1e-3    FP32 gradient accumulations (dweight, dbias): the CPU adds the same
//                      BF16 inputs in FP32, only the summation order and FMA contraction
//                      differ (~1e-6 expected);
//     kStatTol 1e-5    FP32 per-row statistics (mean, rstd) and losses.
// - FP8 codes must equal the CPU's fp8_encode(bf16(cpu value) * scale). A code may differ
//   only where the GPU's FP32 value lies on the other side of a BF16 rounding boundary than
//   the CPU's (they differ by a few FP32 ulps: summation order, FMA, tanhf), which happens for
//   ~1e-4 of the elements, and then changes the FP8 code only if that one-BF16-ulp step
//   crosses an FP8 rounding boundary. So: fewer than kCodeMismatchFraction = 1e-3 differ, and
//   each differing code is one FP8 step from the expected one (never NaN, so poison fails).
//   The codes must also match a host cast of the GPU's own BF16 output the same way.
// - amax within kAmaxTol = 1e-2 relative of max |bf16(cpu value)| (expected equal).
// - Determinism: two runs from the same state give bit-identical gradients.
// - Shapes are not multiples of the kernels' tiles: N=77 rows with C=64/768; M=70/80/128 with
//   F=256/200; B*T=87; Vp=384 with V=300 (and the GPT-2 vocabulary once).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cast_cuda.h"
#include "core/check_cuda.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "core/loss_mask.h"
#include "layers/cross_entropy.h"
#include "layers/encoder.h"
#include "layers/encoder_index.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using namespace fp8lm::testing;

namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr double kBf16Tol = 1e-2;
constexpr double kGradTol = 1e-3;
constexpr double kStatTol = 1e-5;
constexpr double kAmaxTol = 1e-2;
constexpr uint32_t kNanAmaxBits = 0x7fc00000u;

const cudaStream_t kStream = nullptr;  // the legacy stream: ordered with the buffers' memsets and copies

float download_scalar(const DeviceBuffer<float>& buffer) { return buffer.download().at(0); }

// [rows, cols] -> [cols, rows]
template <typename T>
std::vector<T> transposed(const std::vector<T>& values, int rows, int cols) {
  std::vector<T> out(values.size());
  for (int r = 0; r < rows; r++) {
    for (int c = 0; c < cols; c++) out[static_cast<size_t>(c) * rows + r] = values[static_cast<size_t>(r) * cols + c];
  }
  return out;
}

std::vector<float> difference(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> d(a.size());
  for (size_t i = 0; i < a.size(); i++) d[i] = a[i] - b[i];
  return d;
}

void check_amax(float got, float expected) {
  INFO("amax " << got << " expected " << expected);
  CHECK(std::fabs(got - expected) <= kAmaxTol * expected);
}

uint32_t bits_of(float x) { return float_bits(x); }

// ---- LayerNorm --------------------------------------------------------------------------

struct LayerNormInputs {
  int N, C;
  std::vector<float> inp, weight, bias;
};

LayerNormInputs layernorm_inputs(int N, int C, uint64_t seed) {
  LayerNormInputs in{N, C, {}, {}, {}};
  in.inp = bf16_rounded(random_floats(static_cast<size_t>(N) * C, seed, 1.0f, 0.5f));  // offset: a residual stream
  in.weight = bf16_rounded(random_floats(C, seed + 1, 0.1f, 1.0f));
  in.bias = bf16_rounded(random_floats(C, seed + 2, 0.1f));
  return in;
}

}  // namespace

TEST_CASE("layernorm forward (bf16 and fused fp8 cast) matches the CPU reference", "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  const float eps = 1e-5f;
  // 4096 and 8192: the 6.7B and 70B-class widths (32 chunks a lane at 8192).
  for (int C : {64, 768, 4096, 8192}) {
    CAPTURE(C);
    const LayerNormInputs in = layernorm_inputs(N, C, 100 + C);
    std::vector<float> ref(static_cast<size_t>(N) * C), ref_mean(N), ref_rstd(N);
    cpu::layernorm_forward(ref.data(), ref_mean.data(), ref_rstd.data(), in.inp.data(), in.weight.data(),
                           in.bias.data(), N, C, eps);
    const std::vector<float> ref_bf16 = bf16_rounded(ref);

    auto d_inp = device_copy(to_bf16(in.inp));
    auto d_weight = device_copy(to_bf16(in.weight));
    auto d_bias = device_copy(to_bf16(in.bias));

    auto d_out = poisoned<bf16>(ref.size());
    auto d_mean = poisoned<float>(N);
    auto d_rstd = poisoned<float>(N);
    cuda::layernorm_forward_bf16(d_out.data(), d_mean.data(), d_rstd.data(), d_inp.data(), d_weight.data(),
                                 d_bias.data(), N, C, eps, kStream);
    device_sync();
    const std::vector<float> out = from_bf16(d_out.download());
    CHECK(relative_error(out, ref) < kBf16Tol);
    CHECK(relative_error(d_mean.download(), ref_mean) < kStatTol);
    CHECK(relative_error(d_rstd.download(), ref_rstd) < kStatTol);

    for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      for (float scale : {1.0f / 16.0f, 1.0f, 100.0f}) {  // small values / plain / E4M3 saturation
        CAPTURE(to_string(dtype), scale);
        auto d_codes = poisoned<uint8_t>(ref.size());
        auto d_amax = device_scalar(0.0f);
        auto d_scale = device_scalar(scale);
        d_mean.fill_bytes(kPoisonByte);
        d_rstd.fill_bytes(kPoisonByte);
        cuda::layernorm_forward_fp8(d_codes.data(), d_amax.data(), d_scale.data(), dtype, d_mean.data(),
                                    d_rstd.data(), d_inp.data(), d_weight.data(), d_bias.data(), N, C, eps, kStream);
        device_sync();
        const std::vector<uint8_t> codes = d_codes.download();
        check_codes(codes, encode_all(ref_bf16, scale, dtype), dtype, "layernorm fp8 vs CPU");
        check_codes(codes, encode_all(out, scale, dtype), dtype, "layernorm fp8 vs cast of the GPU bf16 output");
        check_amax(download_scalar(d_amax), max_abs(ref_bf16));
        CHECK(relative_error(d_mean.download(), ref_mean) < kStatTol);
        CHECK(relative_error(d_rstd.download(), ref_rstd) < kStatTol);
      }
    }
  }
}

TEST_CASE("layernorm fp8 amax is a running max and shows NaN", "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77, C = 768;
  const float eps = 1e-5f;
  LayerNormInputs in = layernorm_inputs(N, C, 7);
  auto d_weight = device_copy(to_bf16(in.weight));
  auto d_bias = device_copy(to_bf16(in.bias));
  auto d_scale = device_scalar(1.0f);
  auto d_codes = poisoned<uint8_t>(static_cast<size_t>(N) * C);
  auto d_mean = poisoned<float>(N);
  auto d_rstd = poisoned<float>(N);

  // A larger amax already in the slot (an earlier micro-batch) stays.
  {
    auto d_inp = device_copy(to_bf16(in.inp));
    auto d_amax = device_scalar(1.0e6f);
    cuda::layernorm_forward_fp8(d_codes.data(), d_amax.data(), d_scale.data(), Fp8Dtype::e4m3, d_mean.data(),
                                d_rstd.data(), d_inp.data(), d_weight.data(), d_bias.data(), N, C, eps, kStream);
    device_sync();
    CHECK(download_scalar(d_amax) == 1.0e6f);
  }
  // One NaN input: its row is NaN, the amax becomes the NaN bits 0x7fc00000, and stays NaN
  // through a later clean run (NaN compares above +inf as int).
  {
    in.inp[5 * static_cast<size_t>(C) + 3] = std::numeric_limits<float>::quiet_NaN();
    auto d_inp = device_copy(to_bf16(in.inp));
    auto d_amax = device_scalar(3.0f);
    cuda::layernorm_forward_fp8(d_codes.data(), d_amax.data(), d_scale.data(), Fp8Dtype::e4m3, d_mean.data(),
                                d_rstd.data(), d_inp.data(), d_weight.data(), d_bias.data(), N, C, eps, kStream);
    device_sync();
    CHECK(bits_of(download_scalar(d_amax)) == kNanAmaxBits);
    const std::vector<uint8_t> codes = d_codes.download();
    CHECK(codes[5 * static_cast<size_t>(C) + 100] == 0x7F);  // NaN code, as fp8_encode(NaN)
    CHECK(std::isfinite(fp8_decode(codes[4 * static_cast<size_t>(C) + 3], Fp8Dtype::e4m3)));

    in.inp[5 * static_cast<size_t>(C) + 3] = 0.0f;
    auto d_clean = device_copy(to_bf16(in.inp));
    cuda::layernorm_forward_fp8(d_codes.data(), d_amax.data(), d_scale.data(), Fp8Dtype::e4m3, d_mean.data(),
                                d_rstd.data(), d_clean.data(), d_weight.data(), d_bias.data(), N, C, eps, kStream);
    device_sync();
    CHECK(bits_of(download_scalar(d_amax)) == kNanAmaxBits);
  }
}

TEST_CASE("layernorm operand for the wgrad: the forward's FP8 codes, transposed, bit for bit", "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  // The model keeps no FP8 LayerNorm output: c_attn's and c_fc's wgrad read what the backward
  // writes again from the LayerNorm's input and saved statistics, so it must be exactly what
  // the forward's cast wrote with the same scale: the fused delayed-scaling kernel (plain and
  // with the residual add), and current scaling's BF16 output cast apart. Rows and widths off
  // the 64 x 64 tile (77, 1600), on it (128, 768), and gpt-6.7b's width.
  const float eps = 1e-5f;
  for (const auto [N, C] : {std::pair{77, 64}, std::pair{128, 768}, std::pair{200, 1600}, std::pair{64, 4096}}) {
    CAPTURE(N, C);
    const size_t n = static_cast<size_t>(N) * C;
    const LayerNormInputs in = layernorm_inputs(N, C, 700 + C);
    const std::vector<float> branch = bf16_rounded(random_floats(n, 800 + C, 0.3f));
    auto d_inp = device_copy(to_bf16(in.inp));
    auto d_branch = device_copy(to_bf16(branch));
    auto d_weight = device_copy(to_bf16(in.weight));
    auto d_bias = device_copy(to_bf16(in.bias));
    for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      for (float scale : {1.0f / 16.0f, 1.0f, 100.0f}) {  // small values / plain / E4M3 saturation
        CAPTURE(to_string(dtype), scale);
        auto d_scale = device_scalar(scale);
        auto d_mean = poisoned<float>(N);
        auto d_rstd = poisoned<float>(N);
        auto recomputed = [&](const DeviceBuffer<bf16>& input) {
          auto d_codes_t = poisoned<uint8_t>(n);
          cuda::layernorm_operand_transposed_fp8(d_codes_t.data(), d_scale.data(), dtype, input.data(), d_mean.data(),
                                                 d_rstd.data(), d_weight.data(), d_bias.data(), N, C, kStream);
          device_sync();
          return d_codes_t.download();
        };
        // Delayed scaling: the fused kernel.
        auto d_codes = poisoned<uint8_t>(n);
        cuda::layernorm_forward_fp8(d_codes.data(), nullptr, d_scale.data(), dtype, d_mean.data(), d_rstd.data(),
                                    d_inp.data(), d_weight.data(), d_bias.data(), N, C, eps, kStream);
        device_sync();
        const std::vector<uint8_t> codes = d_codes.download();
        CHECK(recomputed(d_inp) == transposed(codes, N, C));
        const size_t zeros = size_t(std::count(codes.begin(), codes.end(), uint8_t{0}));
        CHECK(zeros < n / 2);  // real values, not a tile of zeros on both sides
        // The residual add folded in: recomputed from the residual stream it wrote.
        auto d_residual = poisoned<bf16>(n);
        d_codes.fill_bytes(kPoisonByte);
        cuda::residual_layernorm_forward_fp8(d_codes.data(), nullptr, d_scale.data(), dtype, d_residual.data(),
                                             d_mean.data(), d_rstd.data(), d_inp.data(), d_branch.data(), d_bias.data(),
                                             d_weight.data(), d_bias.data(), N, C, eps, kStream);
        device_sync();
        CHECK(recomputed(d_residual) == transposed(d_codes.download(), N, C));
        // Current scaling: the BF16 output, then the cast with the scale its amax gave.
        auto d_out = poisoned<bf16>(n);
        cuda::layernorm_forward_bf16(d_out.data(), d_mean.data(), d_rstd.data(), d_inp.data(), d_weight.data(),
                                     d_bias.data(), N, C, eps, kStream);
        d_codes.fill_bytes(kPoisonByte);
        cuda::cast_fp8(d_codes.data(), nullptr, d_out.data(), d_scale.data(), dtype, n, kStream);
        device_sync();
        CHECK(recomputed(d_inp) == transposed(d_codes.download(), N, C));
      }
    }
  }
}

TEST_CASE("layernorm backward matches the CPU reference and is deterministic", "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  const float eps = 1e-5f;
  // The widths of gpt2-124m, -774m, -1558m and gpt-6.7b, and 8192; rows enough for several
  // row splits of the weight and bias gradients. 200 leaves 7 lanes of its one warp without
  // columns; at 4001 x 1600 a block's run of 16 rows ends in a lone row (the last block's).
  for (const auto [N, C] : {std::pair{77, 64}, std::pair{1000, 200}, std::pair{77, 768}, std::pair{333, 1280},
                            std::pair{1000, 1600}, std::pair{4001, 1600}, std::pair{300, 4096}, std::pair{70, 8192}}) {
    CAPTURE(N, C);
    const size_t n = static_cast<size_t>(N) * C;
    const LayerNormInputs in = layernorm_inputs(N, C, 200 + C);
    const std::vector<float> dout = bf16_rounded(random_floats(n, 300 + C));
    const std::vector<float> dinp0 = bf16_rounded(random_floats(n, 400 + C, 0.5f));
    const std::vector<float> dweight0 = random_floats(C, 500 + C);
    const std::vector<float> dbias0 = random_floats(C, 600 + C);
    std::vector<float> fwd(n), mean(N), rstd(N);
    cpu::layernorm_forward(fwd.data(), mean.data(), rstd.data(), in.inp.data(), in.weight.data(), in.bias.data(), N,
                           C, eps);
    std::vector<float> ref_dinp = dinp0, ref_dweight = dweight0, ref_dbias = dbias0;
    cpu::layernorm_backward(ref_dinp.data(), ref_dweight.data(), ref_dbias.data(), dout.data(), in.inp.data(),
                            in.weight.data(), mean.data(), rstd.data(), N, C);

    auto d_inp = device_copy(to_bf16(in.inp));
    auto d_weight = device_copy(to_bf16(in.weight));
    auto d_dout = device_copy(to_bf16(dout));
    auto d_mean = device_copy(mean);  // the CPU's statistics: this test isolates the backward
    auto d_rstd = device_copy(rstd);
    const size_t scratch_floats = cuda::layernorm_backward_scratch_floats(N, C);
    REQUIRE(scratch_floats >= 2 * static_cast<size_t>(C));

    struct Result {
      std::vector<bf16> dinp;
      std::vector<float> dweight, dbias;
    };
    auto run = [&]() {
      auto d_dinp = device_copy(to_bf16(dinp0));
      auto d_dweight = device_copy(dweight0);
      auto d_dbias = device_copy(dbias0);
      auto d_scratch = poisoned<float>(scratch_floats);
      cuda::layernorm_backward(d_dinp.data(), d_dweight.data(), d_dbias.data(), d_dout.data(), d_inp.data(),
                               d_weight.data(), d_mean.data(), d_rstd.data(), N, C, d_scratch.data(), kStream);
      device_sync();
      return Result{d_dinp.download(), d_dweight.download(), d_dbias.download()};
    };
    const Result first = run();
    const std::vector<float> dinp = from_bf16(first.dinp);
    CHECK(relative_error(dinp, ref_dinp) < kBf16Tol);
    CHECK(relative_error(difference(dinp, dinp0), difference(ref_dinp, dinp0)) < kBf16Tol);  // the increment
    CHECK(relative_error(first.dweight, ref_dweight) < kGradTol);
    CHECK(relative_error(difference(first.dweight, dweight0), difference(ref_dweight, dweight0)) < kGradTol);
    CHECK(relative_error(first.dbias, ref_dbias) < kGradTol);
    CHECK(relative_error(difference(first.dbias, dbias0), difference(ref_dbias, dbias0)) < kGradTol);

    const Result second = run();
    CHECK(same_bytes(first.dinp, second.dinp));
    CHECK(same_bytes(first.dweight, second.dweight));
    CHECK(same_bytes(first.dbias, second.dbias));
  }
}

TEST_CASE("layernorm launchers reject unsupported shapes before launching", "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  DeviceBuffer<bf16> buffer(4096);
  DeviceBuffer<float> stats(64);
  CHECK_THROWS_AS(cuda::layernorm_forward_bf16(buffer.data(), stats.data(), stats.data(), buffer.data(),
                                               buffer.data(), buffer.data(), 2, 12, 1e-5f, kStream),
                  RuntimeError);  // C % 8 != 0
  CHECK_THROWS_AS(cuda::layernorm_forward_bf16(buffer.data(), stats.data(), stats.data(), buffer.data() + 1,
                                               buffer.data(), buffer.data(), 2, 16, 1e-5f, kStream),
                  RuntimeError);  // misaligned input
  CHECK_THROWS_AS(cuda::layernorm_forward_bf16(buffer.data(), stats.data(), stats.data(), buffer.data(),
                                               buffer.data(), buffer.data(), 1, cuda::kLayerNormMaxC + 8, 1e-5f,
                                               kStream),
                  RuntimeError);  // C too wide
  device_sync();
}

// ---- GELU -------------------------------------------------------------------------------

TEST_CASE("bias + gelu forward (bf16 and fused fp8 cast) matches the CPU reference", "[gpu][gelu]") {
  FP8LM_REQUIRE_GPU();
  const int M = 70;
  for (int F : {256, 200}) {
    CAPTURE(F);
    const size_t n = static_cast<size_t>(M) * F;
    const std::vector<float> pre = bf16_rounded(random_floats(n, 700 + F, 1.5f));
    const std::vector<float> bias = bf16_rounded(random_floats(F, 800 + F, 0.5f));
    std::vector<float> ref_pre(n);  // bf16(pre + bias), what the kernel saves
    for (size_t i = 0; i < n; i++) ref_pre[i] = round_to_bf16(pre[i] + bias[i % F]);
    std::vector<float> ref(n);
    cpu::gelu_forward(ref.data(), ref_pre.data(), n);
    const std::vector<float> ref_bf16 = bf16_rounded(ref);
    auto d_bias = device_copy(to_bf16(bias));

    auto d_pre = device_copy(to_bf16(pre));
    auto d_out = poisoned<bf16>(n);
    cuda::bias_gelu_forward_bf16(d_out.data(), d_pre.data(), d_bias.data(), M, F, kStream);
    device_sync();
    const std::vector<float> out = from_bf16(d_out.download());
    CHECK(relative_error(out, ref) < kBf16Tol);
    CHECK(from_bf16(d_pre.download()) == ref_pre);  // one FP32 add and one BF16 rounding: exact

    for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      for (float scale : {1.0f / 16.0f, 100.0f}) {
        CAPTURE(to_string(dtype), scale);
        auto d_pre_fp8 = device_copy(to_bf16(pre));
        auto d_codes = poisoned<uint8_t>(n);
        auto d_amax = device_scalar(0.0f);
        auto d_scale = device_scalar(scale);
        cuda::bias_gelu_forward_fp8(d_codes.data(), d_amax.data(), d_scale.data(), dtype, d_pre_fp8.data(),
                                    d_bias.data(), M, F, kStream);
        device_sync();
        const std::vector<uint8_t> codes = d_codes.download();
        check_codes(codes, encode_all(ref_bf16, scale, dtype), dtype, "bias_gelu fp8 vs CPU");
        check_codes(codes, encode_all(out, scale, dtype), dtype, "bias_gelu fp8 vs cast of the GPU bf16 output");
        check_amax(download_scalar(d_amax), max_abs(ref_bf16));
        CHECK(from_bf16(d_pre_fp8.download()) == ref_pre);
      }
    }
  }
}

namespace {

struct GeluBackwardInputs {
  int M, F;
  std::vector<float> dout, pre, dbias0;
  std::vector<float> ref_dpre_bf16;  // bf16(dout * gelu'(pre)) from the CPU
  std::vector<float> ref_dbias;      // dbias0 + column sums of ref_dpre_bf16 (double)
};

GeluBackwardInputs gelu_backward_inputs(int M, int F, uint64_t seed) {
  GeluBackwardInputs in{M, F, {}, {}, {}, {}, {}};
  const size_t n = static_cast<size_t>(M) * F;
  in.dout = bf16_rounded(random_floats(n, seed));
  in.pre = bf16_rounded(random_floats(n, seed + 1, 1.5f));
  in.dbias0 = random_floats(F, seed + 2);
  std::vector<float> dpre(n);
  cpu::gelu_backward(dpre.data(), in.pre.data(), in.dout.data(), n);
  in.ref_dpre_bf16 = bf16_rounded(dpre);
  in.ref_dbias.resize(F);
  for (int f = 0; f < F; f++) {
    double sum = in.dbias0[f];
    for (int m = 0; m < M; m++) sum += in.ref_dpre_bf16[static_cast<size_t>(m) * F + f];
    in.ref_dbias[f] = static_cast<float>(sum);
  }
  return in;
}

}  // namespace

TEST_CASE("gelu backward fused with the fp8 cast, transpose and dbias matches the CPU reference", "[gpu][gelu]") {
  FP8LM_REQUIRE_GPU();
  // M=70: byte stores of the transpose; M=128: 16-byte stores; M=80: both (full tile + edge).
  // F=200: a partial column tile.
  const std::pair<int, int> shapes[] = {{70, 256}, {80, 200}, {128, 256}};
  for (const auto& [M, F] : shapes) {
    CAPTURE(M, F);
    const size_t n = static_cast<size_t>(M) * F;
    const GeluBackwardInputs in = gelu_backward_inputs(M, F, 900 + M + F);
    auto d_dout = device_copy(to_bf16(in.dout));
    auto d_pre = device_copy(to_bf16(in.pre));
    const size_t scratch_floats = cuda::gelu_backward_scratch_floats(M, F);
    REQUIRE(scratch_floats == static_cast<size_t>((M + 63) / 64) * F);

    for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      for (float scale : {1.0f / 16.0f, 100.0f}) {
        CAPTURE(to_string(dtype), scale);
        struct Result {
          std::vector<uint8_t> dpre, dpre_t;
          std::vector<float> dbias;
          float amax;
        };
        auto run = [&]() {
          auto d_dpre = poisoned<uint8_t>(n);
          auto d_dpre_t = poisoned<uint8_t>(n);
          auto d_dbias = device_copy(in.dbias0);
          auto d_amax = device_scalar(0.0f);
          auto d_scale = device_scalar(scale);
          auto d_scratch = poisoned<float>(scratch_floats);
          cuda::gelu_backward_cast_transpose_dbias_fp8(d_dpre.data(), d_dpre_t.data(), d_dbias.data(), d_amax.data(),
                                                       d_scale.data(), dtype, d_dout.data(), d_pre.data(), M, F,
                                                       d_scratch.data(), kStream);
          device_sync();
          return Result{d_dpre.download(), d_dpre_t.download(), d_dbias.download(), download_scalar(d_amax)};
        };
        const Result first = run();
        const std::vector<uint8_t> expected = encode_all(in.ref_dpre_bf16, scale, dtype);
        check_codes(first.dpre, expected, dtype, "dpre [M,F] vs CPU");
        check_codes(first.dpre_t, transposed(expected, M, F), dtype, "dpre_t [F,M] vs CPU");
        CHECK(first.dpre_t == transposed(first.dpre, M, F));  // one set of codes, two layouts
        CHECK(relative_error(first.dbias, in.ref_dbias) < kGradTol);
        CHECK(relative_error(difference(first.dbias, in.dbias0), difference(in.ref_dbias, in.dbias0)) < kGradTol);
        check_amax(first.amax, max_abs(in.ref_dpre_bf16));

        const Result second = run();
        CHECK(same_bytes(first.dbias, second.dbias));
        CHECK(first.dpre == second.dpre);
        CHECK(first.dpre_t == second.dpre_t);
        CHECK(bits_of(first.amax) == bits_of(second.amax));
      }
    }
  }
}

TEST_CASE("gelu backward's recomputed output: the forward's FP8 codes, transposed, bit for bit", "[gpu][gelu]") {
  FP8LM_REQUIRE_GPU();
  // The model keeps no FP8 GELU output under delayed scaling: mlp.c_proj's wgrad reads what the
  // GELU backward recomputes, so it must be exactly what bias_gelu_forward_fp8 wrote from the
  // same (saved) pre with the same scale. Shapes as above, and one of gpt2-124m's MLP tiles.
  const std::pair<int, int> shapes[] = {{70, 256}, {80, 200}, {128, 256}, {1024, 3072}};
  for (const auto& [M, F] : shapes) {
    CAPTURE(M, F);
    const size_t n = static_cast<size_t>(M) * F;
    const GeluBackwardInputs in = gelu_backward_inputs(M, F, 1900 + M + F);
    // Wide inputs: the GELU's flat negative tail, its curve and its linear part.
    const std::vector<float> pre_in = bf16_rounded(random_floats(n, 2900 + M, 4.0f));
    const std::vector<float> bias = bf16_rounded(random_floats(F, 3900 + F, 0.5f));
    auto d_bias = device_copy(to_bf16(bias));
    auto d_dout = device_copy(to_bf16(in.dout));
    for (float gelu_scale : {1.0f / 16.0f, 3.0f, 100.0f}) {
      CAPTURE(gelu_scale);
      auto d_pre = device_copy(to_bf16(pre_in));
      auto d_forward_codes = poisoned<uint8_t>(n);
      auto d_forward_amax = device_scalar(0.0f);
      auto d_gelu_scale = device_scalar(gelu_scale);
      cuda::bias_gelu_forward_fp8(d_forward_codes.data(), d_forward_amax.data(), d_gelu_scale.data(), Fp8Dtype::e4m3,
                                  d_pre.data(), d_bias.data(), M, F, kStream);

      auto d_dpre = poisoned<uint8_t>(n);
      auto d_dpre_t = poisoned<uint8_t>(n);
      auto d_dpre_plain = poisoned<uint8_t>(n);
      auto d_dpre_t_plain = poisoned<uint8_t>(n);
      auto d_gelu_t = poisoned<uint8_t>(n);
      auto d_dbias = device_copy(in.dbias0);
      auto d_dbias_plain = device_copy(in.dbias0);
      auto d_amax = device_scalar(0.0f);
      auto d_amax_plain = device_scalar(0.0f);
      auto d_scale = device_scalar(2.0f);
      auto d_scratch = poisoned<float>(cuda::gelu_backward_scratch_floats(M, F));
      cuda::gelu_backward_cast_transpose_dbias_fp8(
          d_dpre.data(), d_dpre_t.data(), d_dbias.data(), d_amax.data(), d_scale.data(), Fp8Dtype::e5m2, d_dout.data(),
          d_pre.data(), M, F, d_scratch.data(), kStream, nullptr,
          {.codes_t = d_gelu_t.data(), .scale = d_gelu_scale.data(), .dtype = Fp8Dtype::e4m3});
      cuda::gelu_backward_cast_transpose_dbias_fp8(d_dpre_plain.data(), d_dpre_t_plain.data(), d_dbias_plain.data(),
                                                   d_amax_plain.data(), d_scale.data(), Fp8Dtype::e5m2, d_dout.data(),
                                                   d_pre.data(), M, F, d_scratch.data(), kStream);
      device_sync();
      // The current-scaling path's kernel: the recomputed output alone.
      auto d_gelu_t_alone = poisoned<uint8_t>(n);
      cuda::gelu_recompute_transposed_fp8({.codes_t = d_gelu_t_alone.data(), .scale = d_gelu_scale.data()},
                                          d_pre.data(), M, F, kStream);
      device_sync();
      const std::vector<uint8_t> forward_codes = d_forward_codes.download();
      CHECK(d_gelu_t.download() == transposed(forward_codes, M, F));
      CHECK(d_gelu_t_alone.download() == transposed(forward_codes, M, F));
      // The gradient outputs are those of the kernel without the recomputation.
      CHECK(d_dpre.download() == d_dpre_plain.download());
      CHECK(d_dpre_t.download() == d_dpre_t_plain.download());
      CHECK(same_bytes(d_dbias.download(), d_dbias_plain.download()));
      CHECK(bits_of(download_scalar(d_amax)) == bits_of(download_scalar(d_amax_plain)));
      // Some codes are saturated or zero at these scales, most are neither: the test sees real values.
      const size_t zeros = size_t(std::count(forward_codes.begin(), forward_codes.end(), uint8_t{0}));
      CHECK(zeros < n / 2);
    }
  }
}

TEST_CASE("gelu backward throughput at training shapes", "[gpu][gelu][.bench]") {
  FP8LM_REQUIRE_GPU();
  // The training call: E5M2 gradient codes and their transpose, dbias, and the recomputed E4M3
  // GELU output transposed. Bytes: dout and pre read (2 + 2), three codes written (1 + 1 + 1).
  for (const auto& [M, F] : {std::pair{8192, 6400}, std::pair{32768, 3072}}) {
    const size_t n = static_cast<size_t>(M) * F;
    const std::vector<float> block = random_floats(size_t{1} << 20, 5);
    std::vector<float> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = block[i % block.size()];
    auto d_dout = device_copy(to_bf16(values));
    auto d_pre = device_copy(to_bf16(values));
    cuda::DeviceBuffer<uint8_t> dpre(n), dpre_t(n), gelu_t(n);
    cuda::DeviceBuffer<float> dbias(static_cast<size_t>(F)), scratch(cuda::gelu_backward_scratch_floats(M, F));
    auto amax = device_scalar(0.0f);
    auto scale = device_scalar(1.0f);
    auto call = [&] {
      cuda::gelu_backward_cast_transpose_dbias_fp8(
          dpre.data(), dpre_t.data(), dbias.data(), amax.data(), scale.data(), Fp8Dtype::e5m2, d_dout.data(),
          d_pre.data(), M, F, scratch.data(), kStream, nullptr,
          {.codes_t = gelu_t.data(), .scale = scale.data(), .dtype = Fp8Dtype::e4m3});
    };
    const double us = 1e3 * time_ms(call, 20);
    std::printf("gelu backward M=%d F=%d: %.1f us, %.2f TB/s\n", M, F, us, 7.0 * double(n) / (us * 1e-6) / 1e12);
  }
}

TEST_CASE("gelu backward fp8: a NaN gradient shows in the codes, dbias and amax", "[gpu][gelu]") {
  FP8LM_REQUIRE_GPU();
  const int M = 70, F = 256;
  const size_t n = static_cast<size_t>(M) * F;
  GeluBackwardInputs in = gelu_backward_inputs(M, F, 31);
  in.dout[5 * static_cast<size_t>(F) + 7] = std::numeric_limits<float>::quiet_NaN();
  auto d_dout = device_copy(to_bf16(in.dout));
  auto d_pre = device_copy(to_bf16(in.pre));
  auto d_dpre = poisoned<uint8_t>(n);
  auto d_dpre_t = poisoned<uint8_t>(n);
  auto d_dbias = device_copy(in.dbias0);
  auto d_amax = device_scalar(2.0f);
  auto d_scale = device_scalar(1.0f);
  auto d_scratch = poisoned<float>(cuda::gelu_backward_scratch_floats(M, F));
  cuda::gelu_backward_cast_transpose_dbias_fp8(d_dpre.data(), d_dpre_t.data(), d_dbias.data(), d_amax.data(),
                                               d_scale.data(), Fp8Dtype::e5m2, d_dout.data(), d_pre.data(), M, F,
                                               d_scratch.data(), kStream);
  device_sync();
  CHECK(bits_of(download_scalar(d_amax)) == kNanAmaxBits);
  CHECK(d_dpre.download()[5 * static_cast<size_t>(F) + 7] == 0x7F);
  CHECK(d_dpre_t.download()[7 * static_cast<size_t>(M) + 5] == 0x7F);
  const std::vector<float> dbias = d_dbias.download();
  CHECK(std::isnan(dbias[7]));
  CHECK(std::isfinite(dbias[8]));
}

TEST_CASE("gelu backward bf16 with dbias matches the CPU reference, in place too", "[gpu][gelu]") {
  FP8LM_REQUIRE_GPU();
  const std::pair<int, int> shapes[] = {{70, 256}, {80, 200}};
  for (const auto& [M, F] : shapes) {
    CAPTURE(M, F);
    const size_t n = static_cast<size_t>(M) * F;
    const GeluBackwardInputs in = gelu_backward_inputs(M, F, 1000 + M + F);
    auto d_pre = device_copy(to_bf16(in.pre));
    const size_t scratch_floats = cuda::gelu_backward_scratch_floats(M, F);
    std::vector<float> ref_dpre(n);
    cpu::gelu_backward(ref_dpre.data(), in.pre.data(), in.dout.data(), n);

    struct Result {
      std::vector<bf16> dpre;
      std::vector<float> dbias;
    };
    auto run = [&](bool in_place) {
      auto d_dout = device_copy(to_bf16(in.dout));
      auto d_out = poisoned<bf16>(n);
      bf16* dpre = in_place ? d_dout.data() : d_out.data();
      auto d_dbias = device_copy(in.dbias0);
      auto d_scratch = poisoned<float>(scratch_floats);
      cuda::gelu_backward_dbias_bf16(dpre, d_dbias.data(), d_dout.data(), d_pre.data(), M, F, d_scratch.data(),
                                     kStream);
      device_sync();
      return Result{in_place ? d_dout.download() : d_out.download(), d_dbias.download()};
    };
    const Result first = run(false);
    const std::vector<float> dpre = from_bf16(first.dpre);
    CHECK(relative_error(dpre, ref_dpre) < kBf16Tol);
    CHECK(relative_error(first.dbias, in.ref_dbias) < kGradTol);
    CHECK(relative_error(difference(first.dbias, in.dbias0), difference(in.ref_dbias, in.dbias0)) < kGradTol);

    const Result second = run(false);
    CHECK(same_bytes(first.dpre, second.dpre));
    CHECK(same_bytes(first.dbias, second.dbias));
    const Result in_place = run(true);
    CHECK(same_bytes(first.dpre, in_place.dpre));
    CHECK(same_bytes(first.dbias, in_place.dbias));
  }
}

// ---- Encoder ----------------------------------------------------------------------------

TEST_CASE("encoder backward index groups positions by token in ascending order", "[encoder_index]") {
  // Host only (no GPU needed): the index that makes the GPU embedding backward deterministic.
  const int B = 2, T = 5;
  const std::vector<int32_t> tokens = {7, 3, 7, 0, 3,  //
                                       3, 9, 7, 0, 0};
  const EncoderBackwardIndex index = build_encoder_backward_index(tokens.data(), B, T);
  CHECK(index.unique_tokens == std::vector<int32_t>{0, 3, 7, 9});
  CHECK(index.offsets == std::vector<int32_t>{0, 3, 6, 9, 10});
  CHECK(index.positions == std::vector<int32_t>{3, 8, 9, 1, 4, 5, 0, 2, 7, 6});
  CHECK(index.num_unique() == 4);

  EncoderBackwardIndex reused = index;  // rebuilt in place for another micro-batch
  const std::vector<int32_t> other = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  build_encoder_backward_index(other.data(), B, T, reused);
  CHECK(reused.unique_tokens == std::vector<int32_t>{1});
  CHECK(reused.offsets == std::vector<int32_t>{0, 10});
  CHECK(reused.positions == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});

  const std::vector<int32_t> negative = {0, -1};
  CHECK_THROWS_AS(build_encoder_backward_index(negative.data(), 1, 2), RuntimeError);
}

TEST_CASE("encoder forward and deterministic backward match the CPU reference", "[gpu][encoder]") {
  FP8LM_REQUIRE_GPU();
  const int B = 3, T = 29, maxT = 32, Vp = 384;
  for (int C : {64, 768, 4096}) {
    CAPTURE(C);
    const size_t n = static_cast<size_t>(B) * T * C;
    // Tokens from a small range so that most repeat (the case the index exists for).
    std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
    Random random(1100 + C);
    for (int32_t& token : tokens) token = static_cast<int32_t>(random.next_u64() % 40) * 7;  // < 300 <= Vp
    const std::vector<float> wte = bf16_rounded(random_floats(static_cast<size_t>(Vp) * C, 1200 + C, 0.5f));
    const std::vector<float> wpe = bf16_rounded(random_floats(static_cast<size_t>(maxT) * C, 1300 + C, 0.5f));
    auto d_tokens = device_copy(tokens);
    auto d_wte = device_copy(to_bf16(wte));
    auto d_wpe = device_copy(to_bf16(wpe));

    // Forward: one FP32 add and one BF16 rounding, exactly as bf16(cpu).
    std::vector<float> ref(n);
    cpu::encoder_forward(ref.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    auto d_out = poisoned<bf16>(n);
    auto d_token_embeddings = poisoned<float>(n);
    cuda::embedding_lookup(d_token_embeddings.data(), d_tokens.data(), d_wte.data(), 0, Vp, B * T, C, kStream);
    cuda::add_position_embedding(d_out.data(), d_token_embeddings.data(), d_wpe.data(), 0, T, B * T, C, kStream);
    device_sync();
    const std::vector<float> out = from_bf16(d_out.download());
    CHECK(relative_error(out, ref) < kBf16Tol);
    CHECK(out == bf16_rounded(ref));

    // Backward: the same summation order as the CPU, so equal (bound 1e-6; bit-equal expected).
    const std::vector<float> dout = bf16_rounded(random_floats(n, 1400 + C));
    const std::vector<float> dwte0 = random_floats(static_cast<size_t>(Vp) * C, 1500 + C);
    const std::vector<float> dwpe0 = random_floats(static_cast<size_t>(maxT) * C, 1600 + C);
    std::vector<float> ref_dwte = dwte0, ref_dwpe = dwpe0;
    cpu::encoder_backward(ref_dwte.data(), ref_dwpe.data(), dout.data(), tokens.data(), B, T, C);

    const EncoderBackwardIndex index = build_encoder_backward_index(tokens.data(), B, T);
    REQUIRE(index.num_unique() < B * T);  // repeats present
    auto d_dout = device_copy(to_bf16(dout));
    auto d_unique = device_copy(index.unique_tokens);
    auto d_offsets = device_copy(index.offsets);
    auto d_positions = device_copy(index.positions);
    auto run = [&]() {
      auto d_dwte = device_copy(dwte0);
      auto d_dwpe = device_copy(dwpe0);
      cuda::position_embedding_backward(d_dwpe.data(), d_dout.data(), 0, T, B * T, C, kStream);
      cuda::embedding_lookup_backward(d_dwte.data(), d_dout.data(), d_unique.data(), d_offsets.data(),
                                      d_positions.data(), index.num_unique(), C, kStream);
      device_sync();
      return std::make_pair(d_dwte.download(), d_dwpe.download());
    };
    const auto [dwte, dwpe] = run();
    size_t differing = 0;
    for (size_t i = 0; i < dwte.size(); i++) differing += dwte[i] != ref_dwte[i];
    for (size_t i = 0; i < dwpe.size(); i++) differing += dwpe[i] != ref_dwpe[i];
    INFO(differing << " gradient elements differ from the CPU's bits (0 expected: same order)");
    CHECK(relative_error(dwte, ref_dwte) < 1e-6);
    CHECK(relative_error(dwpe, ref_dwpe) < 1e-6);
    CHECK(relative_error(difference(dwte, dwte0), difference(ref_dwte, dwte0)) < 1e-6);
    CHECK(relative_error(difference(dwpe, dwpe0), difference(ref_dwpe, dwpe0)) < 1e-6);
    // Rows of tokens that do not occur, and positions >= T, are untouched.
    CHECK(std::equal(dwte.begin() + static_cast<size_t>(300) * C, dwte.end(), dwte0.begin() + static_cast<size_t>(300) * C));
    CHECK(std::equal(dwpe.begin() + static_cast<size_t>(T) * C, dwpe.end(), dwpe0.begin() + static_cast<size_t>(T) * C));
    const auto [dwte2, dwpe2] = run();
    CHECK(same_bytes(dwte, dwte2));
    CHECK(same_bytes(dwpe, dwpe2));
  }
}

TEST_CASE("vocabulary-parallel embedding pieces: a slice of the table and a slice of the rows", "[gpu][encoder]") {
  FP8LM_REQUIRE_GPU();
  // Rank 1 of 3 over the vocabulary (rows [128, 256) of Vp = 384) and rows [40, 70) of the
  // B*T rows (sequence parallelism), against the CPU twins bit for bit.
  const int B = 3, T = 29, C = 64, Vp = 384, begin = 128, count = 128, first_row = 40, N = 30;
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
  Random random(77);
  for (int32_t& token : tokens) token = static_cast<int32_t>(random.next_u64() % Vp);
  const std::vector<float> wte = bf16_rounded(random_floats(static_cast<size_t>(count) * C, 78, 0.5f));
  const std::vector<float> wpe = bf16_rounded(random_floats(static_cast<size_t>(T) * C, 79, 0.5f));
  auto d_tokens = device_copy(tokens);
  auto d_wte = device_copy(to_bf16(wte));
  auto d_wpe = device_copy(to_bf16(wpe));
  const size_t all = tokens.size() * C;

  std::vector<float> ref_lookup(all);
  cpu::embedding_lookup(ref_lookup.data(), tokens.data(), wte.data(), begin, count, B * T, C);
  auto d_lookup = poisoned<float>(all);
  cuda::embedding_lookup(d_lookup.data(), d_tokens.data(), d_wte.data(), begin, count, B * T, C, kStream);
  device_sync();
  CHECK(same_bytes(d_lookup.download(), ref_lookup));

  std::vector<float> ref_rows(static_cast<size_t>(N) * C);
  cpu::add_position_embedding(ref_rows.data(), ref_lookup.data() + size_t(first_row) * C, wpe.data(), first_row, T, N,
                              C);
  auto d_rows = poisoned<bf16>(static_cast<size_t>(N) * C);
  cuda::add_position_embedding(d_rows.data(), d_lookup.data() + size_t(first_row) * C, d_wpe.data(), first_row, T, N,
                               C, kStream);
  device_sync();
  CHECK(from_bf16(d_rows.download()) == bf16_rounded(ref_rows));

  const std::vector<float> dout = bf16_rounded(random_floats(all, 80));
  std::vector<float> ref_dwte(static_cast<size_t>(count) * C, 0.0f), ref_dwpe(static_cast<size_t>(T) * C, 0.0f);
  cpu::embedding_lookup_backward(ref_dwte.data(), dout.data(), tokens.data(), begin, count, B * T, C);
  cpu::position_embedding_backward(ref_dwpe.data(), dout.data() + size_t(first_row) * C, first_row, T, N, C);
  EncoderBackwardIndex index;
  build_encoder_backward_index(tokens.data(), B, T, index, begin, begin + count);
  auto d_dout = device_copy(to_bf16(dout));
  auto d_unique = device_copy(index.unique_tokens);
  auto d_offsets = device_copy(index.offsets);
  auto d_positions = device_copy(index.positions.empty() ? std::vector<int32_t>{0} : index.positions);
  auto d_dwte = device_copy(std::vector<float>(ref_dwte.size(), 0.0f));
  auto d_dwpe = device_copy(std::vector<float>(ref_dwpe.size(), 0.0f));
  cuda::embedding_lookup_backward(d_dwte.data(), d_dout.data(), d_unique.data(), d_offsets.data(), d_positions.data(),
                                  index.num_unique(), C, kStream);
  cuda::position_embedding_backward(d_dwpe.data(), d_dout.data() + size_t(first_row) * C, first_row, T, N, C,
                                    kStream);
  device_sync();
  CHECK(same_bytes(d_dwte.download(), ref_dwte));
  CHECK(same_bytes(d_dwpe.download(), ref_dwpe));
}

// ---- Cross-entropy ----------------------------------------------------------------------

namespace {

struct CrossEntropyInputs {
  int N, V, Vp;
  std::vector<float> logits;  // [N,Vp], bf16-rounded; padded columns hold large values
  std::vector<int32_t> targets;
};

CrossEntropyInputs cross_entropy_inputs(int N, int V, int Vp, uint64_t seed) {
  CrossEntropyInputs in{N, V, Vp, bf16_rounded(random_floats(static_cast<size_t>(N) * Vp, seed, 2.0f)), {}};
  for (int i = 0; i < N; i++) {
    for (int v = V; v < Vp; v++) in.logits[static_cast<size_t>(i) * Vp + v] = 50.0f;  // must not enter the softmax
  }
  Random random(seed + 1);
  in.targets.resize(N);
  for (int32_t& target : in.targets) target = static_cast<int32_t>(random.next_u64() % static_cast<uint64_t>(V));
  return in;
}

void check_cross_entropy(const CrossEntropyInputs& in, float dloss) {
  const size_t n = static_cast<size_t>(in.N) * in.Vp;
  std::vector<float> ref_logits = in.logits, ref_losses(in.N);
  cpu::cross_entropy_forward_backward(ref_logits.data(), ref_losses.data(), in.targets.data(), in.N, in.V, in.Vp,
                                      dloss);
  const std::vector<bf16> logits_bf16 = to_bf16(in.logits);
  auto d_logits = device_copy(logits_bf16);
  auto d_targets = device_copy(in.targets);
  auto d_losses = poisoned<float>(in.N);
  cuda::cross_entropy_forward_backward(d_logits.data(), d_losses.data(), d_targets.data(), in.N, in.V, in.Vp, dloss,
                                       kStream);
  device_sync();
  CHECK(relative_error(d_losses.download(), ref_losses) < kStatTol);
  const std::vector<bf16> got = d_logits.download();
  if (dloss == 0.0f) {
    CHECK(same_bytes(got, logits_bf16));  // forward only: untouched
    return;
  }
  const std::vector<float> dlogits = from_bf16(got);
  CHECK(relative_error(dlogits, ref_logits) < kBf16Tol);
  size_t nonzero_padding = 0;
  for (size_t i = 0; i < n; i++) {
    if (static_cast<int>(i % in.Vp) >= in.V && bits_of(dlogits[i]) != 0u) nonzero_padding++;
  }
  CHECK(nonzero_padding == 0);
}

}  // namespace

TEST_CASE("fused cross-entropy matches the CPU reference", "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  SECTION("forward + backward, V=300 padded to 384") { check_cross_entropy(cross_entropy_inputs(N, 300, 384, 1700), 1.0f / N); }
  SECTION("forward only leaves the logits untouched") { check_cross_entropy(cross_entropy_inputs(N, 300, 384, 1800), 0.0f); }
  SECTION("GPT-2 vocabulary, 50257 padded to 50304") {
    check_cross_entropy(cross_entropy_inputs(4, 50257, 50304, 1900), 0.25f);
  }
  SECTION("V == Vp") { check_cross_entropy(cross_entropy_inputs(N, 384, 384, 2000), 1.0f / N); }
  SECTION("a wider vocabulary, 60,000 padded to 60,032") {
    check_cross_entropy(cross_entropy_inputs(4, 60000, 60032, 2050), 0.25f);
  }
  SECTION("masked targets (--eod-mask-loss): loss 0, a zero gradient row") {
    for (const auto& [V, Vp] : {std::pair{300, 384}, std::pair{50257, 50304}}) {
      CrossEntropyInputs in = cross_entropy_inputs(N, V, Vp, 2060);
      for (int i = 0; i < N; i += 3) in.targets[i] = kMaskedTarget;
      check_cross_entropy(in, 1.0f / N);
      check_cross_entropy(in, 0.0f);
      auto d_logits = device_copy(to_bf16(in.logits));
      auto d_targets = device_copy(in.targets);
      auto d_losses = poisoned<float>(N);
      cuda::cross_entropy_forward_backward(d_logits.data(), d_losses.data(), d_targets.data(), N, V, Vp, 1.0f / N,
                                           kStream);
      device_sync();
      const std::vector<float> losses = d_losses.download(), dlogits = from_bf16(d_logits.download());
      for (int i = 0; i < N; i += 3) {
        CHECK(losses[i] == 0.0f);
        size_t nonzero = 0;
        for (int v = 0; v < Vp; v++) nonzero += bits_of(dlogits[size_t(i) * Vp + v]) != 0u;
        CHECK(nonzero == 0);
      }
    }
  }
}

TEST_CASE("cross-entropy to FP8 dlogits: the BF16 dlogits' cast, bit for bit, in the loss's pass", "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  // The FP8 LM head's gradient operand under a delayed scale: the loss kernel casts its own
  // BF16-rounded dlogits. Against the two kernels it replaces (BF16 dlogits, then cast_fp8 of
  // them): the same codes, the same amax bits, the same losses, and the logits left as they are.
  struct Case {
    const char* what;
    int N, V, Vp;
    Fp8Dtype dtype;
    float scale, dloss;
  };
  SECTION("against the BF16 dlogits and their cast") {
    for (const Case& c : {Case{"V=300 padded to 384, E5M2", 77, 300, 384, Fp8Dtype::e5m2, 1024.0f, 1.0f / 77},
                          Case{"GPT-2's vocabulary (staged rows), E5M2", 6, 50257, 50304, Fp8Dtype::e5m2, 65536.0f, 0.25f},
                          Case{"a wider vocabulary (rows read twice), E4M3", 5, 60000, 60032, Fp8Dtype::e4m3, 4096.0f, 0.2f},
                          Case{"a scale that saturates, E4M3", 33, 384, 384, Fp8Dtype::e4m3, 1e6f, 1.0f / 33}}) {
      INFO(c.what);
      CrossEntropyInputs in = cross_entropy_inputs(c.N, c.V, c.Vp, 2300 + uint64_t(c.N));
      for (int i = 0; i < c.N; i += 4) in.targets[i] = kMaskedTarget;
      const size_t n = static_cast<size_t>(c.N) * c.Vp;
      const std::vector<bf16> logits_bf16 = to_bf16(in.logits);
      auto d_targets = device_copy(in.targets);
      auto d_scale = device_scalar(c.scale);

      // The two kernels: BF16 dlogits in place, then their cast (the amax a running max, from
      // below the dlogits' largest magnitude, about dloss).
      auto d_dlogits = device_copy(logits_bf16);
      auto d_ref_losses = poisoned<float>(c.N);
      auto d_ref_codes = poisoned<uint8_t>(n);
      auto d_ref_amax = device_scalar(1e-6f);
      cuda::cross_entropy_forward_backward(d_dlogits.data(), d_ref_losses.data(), d_targets.data(), c.N, c.V, c.Vp,
                                           c.dloss, kStream);
      cuda::cast_fp8(d_ref_codes.data(), d_ref_amax.data(), d_dlogits.data(), d_scale.data(), c.dtype, n, kStream);

      // One kernel.
      auto d_logits = device_copy(logits_bf16);
      auto d_losses = poisoned<float>(c.N);
      auto d_codes = poisoned<uint8_t>(n);
      auto d_amax = device_scalar(1e-6f);
      cuda::cross_entropy_forward_backward(
          d_logits.data(), d_losses.data(), d_targets.data(), c.N, c.V, c.Vp, c.dloss,
          cuda::DlogitCodes{.codes = d_codes.data(), .scale = d_scale.data(), .amax = d_amax.data(), .dtype = c.dtype},
          kStream);
      device_sync();

      CHECK(same_bytes(d_codes.download(), d_ref_codes.download()));
      CHECK(bits_of(download_scalar(d_amax)) == bits_of(download_scalar(d_ref_amax)));
      CHECK(download_scalar(d_amax) > 1e-6f);
      CHECK(same_bytes(d_losses.download(), d_ref_losses.download()));
      CHECK(same_bytes(d_logits.download(), logits_bf16));
      // A masked row's codes are zeros; so are the padded columns'.
      const std::vector<uint8_t> codes = d_codes.download();
      size_t nonzero = 0;
      for (int i = 0; i < c.N; i++)
        for (int v = 0; v < c.Vp; v++)
          if ((i % 4 == 0 || v >= c.V) && codes[size_t(i) * c.Vp + v] != 0) nonzero++;
      CHECK(nonzero == 0);
    }
  }
  SECTION("a NaN logit shows as a NaN amax, as the cast's") {
    const int N = 3, V = 300, Vp = 384;
    CrossEntropyInputs in = cross_entropy_inputs(N, V, Vp, 2400);
    in.logits[Vp + 17] = NAN;
    auto d_logits = device_copy(to_bf16(in.logits));
    auto d_targets = device_copy(in.targets);
    auto d_losses = poisoned<float>(N);
    auto d_codes = poisoned<uint8_t>(size_t(N) * Vp);
    auto d_scale = device_scalar(256.0f);
    auto d_amax = device_scalar(0.0f);
    cuda::cross_entropy_forward_backward(
        d_logits.data(), d_losses.data(), d_targets.data(), N, V, Vp, 1.0f / N,
        cuda::DlogitCodes{.codes = d_codes.data(), .scale = d_scale.data(), .amax = d_amax.data()}, kStream);
    device_sync();
    CHECK(bits_of(download_scalar(d_amax)) == kNanAmaxBits);
    CHECK(std::isnan(d_losses.download()[1]));
  }
  SECTION("a forward-only loss is refused: it writes no dlogits") {
    auto d_logits = device_copy(to_bf16(std::vector<float>(384, 0.0f)));
    auto d_targets = device_copy(std::vector<int32_t>{1});
    auto d_losses = poisoned<float>(1);
    auto d_codes = poisoned<uint8_t>(384);
    auto d_scale = device_scalar(1.0f);
    auto d_amax = device_scalar(0.0f);
    CHECK_THROWS_WITH(
        cuda::cross_entropy_forward_backward(
            d_logits.data(), d_losses.data(), d_targets.data(), 1, 300, 384, 0.0f,
            cuda::DlogitCodes{.codes = d_codes.data(), .scale = d_scale.data(), .amax = d_amax.data()}, kStream),
        Catch::Matchers::ContainsSubstring("dloss != 0"));
  }
}

TEST_CASE("cross-entropy: a target outside the vocabulary gives a NaN loss, other rows unaffected",
          "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 4, V = 300, Vp = 384;
  CrossEntropyInputs in = cross_entropy_inputs(N, V, Vp, 2100);
  std::vector<float> ref_logits = in.logits, ref_losses(N);
  cpu::cross_entropy_forward_backward(ref_logits.data(), ref_losses.data(), in.targets.data(), N, V, Vp, 0.0f);
  in.targets[2] = V;  // a padded column: not a real token
  auto d_logits = device_copy(to_bf16(in.logits));
  auto d_targets = device_copy(in.targets);
  auto d_losses = poisoned<float>(N);
  cuda::cross_entropy_forward_backward(d_logits.data(), d_losses.data(), d_targets.data(), N, V, Vp, 0.5f, kStream);
  device_sync();
  const std::vector<float> losses = d_losses.download();
  CHECK(std::isnan(losses[2]));
  for (int i : {0, 1, 3}) CHECK(std::fabs(losses[i] - ref_losses[i]) <= kStatTol * std::fabs(ref_losses[i]));
}

TEST_CASE("cross-entropy: a NaN logit gives a NaN loss, -inf logits take no part", "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 3, V = 300, Vp = 384;
  CrossEntropyInputs in = cross_entropy_inputs(N, V, Vp, 2150);
  auto at = [&](int row, int col) -> float& { return in.logits[static_cast<size_t>(row) * Vp + col]; };
  at(0, 5) = NAN;  // among finite logits
  for (int row : {1, 2}) {
    for (int v = 0; v < V; v++) at(row, v) = -INFINITY;
  }
  for (int v : {3, 100, 299}) at(1, v) = 0.5f * static_cast<float>(v % 7);  // a few finite logits among -inf ones
  in.targets[1] = 100;
  at(2, 7) = NAN;  // the only value that is not -inf: the chunk's max passes it over, the sum must not
  std::vector<float> ref_logits = in.logits, ref_losses(N);
  cpu::cross_entropy_forward_backward(ref_logits.data(), ref_losses.data(), in.targets.data(), N, V, Vp, 0.0f);
  auto d_logits = device_copy(to_bf16(in.logits));
  auto d_targets = device_copy(in.targets);
  auto d_losses = poisoned<float>(N);
  cuda::cross_entropy_forward_backward(d_logits.data(), d_losses.data(), d_targets.data(), N, V, Vp, 0.0f, kStream);
  device_sync();
  const std::vector<float> losses = d_losses.download();
  CHECK(std::isnan(losses[0]));
  REQUIRE(std::isfinite(ref_losses[1]));
  CHECK(std::fabs(losses[1] - ref_losses[1]) <= kStatTol * std::fabs(ref_losses[1]));
  CHECK(std::isnan(losses[2]));
}

TEST_CASE("sum_losses adds a deterministic sum to the device total", "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  for (int N : {77, 5000}) {
    CAPTURE(N);
    const std::vector<float> losses = random_floats(N, 2200 + N, 1.0f, 5.0f);
    double expected = 1.5;
    for (float loss : losses) expected += loss;
    auto d_losses = device_copy(losses);
    auto run = [&]() {
      auto d_total = device_scalar(1.5f);
      cuda::sum_losses(d_total.data(), d_losses.data(), N, kStream);
      device_sync();
      return download_scalar(d_total);
    };
    const float first = run();
    CHECK(std::fabs(first - expected) <= kStatTol * std::fabs(expected));
    CHECK(bits_of(first) == bits_of(run()));
  }
}
