// The residual add folded into the LayerNorm (cuda::residual_layernorm_forward_bf16/_fp8)
// against the two-step path it replaces and against the CPU twin.
//
// The two-step path: residual_out = bf16(residual_in + (branch + branch_bias)), computed on
// the host (two FP32 additions and one round-to-nearest-even: the same IEEE operations as the
// GPU's, so the same bits), uploaded, then cuda::layernorm_forward_bf16/_fp8 on it. The fused
// kernel must give the same bits everywhere:
//   residual_out == the host sum, out / mean / rstd / FP8 codes / amax == the two-step GPU run.
// Against the CPU (inputs BF16-rounded, conventions and bounds as tests/test_fused_kernels_gpu.cpp):
//   the CPU twin's FP32 residual_out rounds to the GPU's residual_out bit for bit;
//   cpu::layernorm_forward of that BF16 residual: out within kBf16Tol, mean/rstd within
//   kStatTol, FP8 codes as check_codes, amax within kAmaxTol;
//   the CPU twin's own out (LayerNorm of the unrounded FP32 sum) within kBf16Tol: the GPU's
//   BF16 residual stream adds one BF16 rounding (2^-9 relative) before the normalization.
// Shapes: N = 77 rows (not a multiple of the kernel's 8 rows per block); C = 64, 200 (a
// partial last chunk round), 768 and 2048 (the widest, 8 chunks per lane); with and without
// branch_bias; residual_out separate from residual_in and in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "layers/layernorm.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using namespace fp8lm::testing;

namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr double kBf16Tol = 1e-2;
constexpr double kStatTol = 1e-5;
constexpr double kAmaxTol = 1e-2;
constexpr float kEps = 1e-5f;

const cudaStream_t kStream = nullptr;  // the legacy stream: ordered with the buffers' memsets and copies

struct Inputs {
  int N, C;
  std::vector<float> residual, branch;     // [N,C], BF16-rounded
  std::vector<float> branch_bias;          // [C]
  std::vector<float> weight, bias;         // [C]
};

Inputs make_inputs(int N, int C, uint64_t seed) {
  const size_t n = static_cast<size_t>(N) * C;
  Inputs in{N, C, {}, {}, {}, {}, {}};
  in.residual = bf16_rounded(random_floats(n, seed, 1.0f, 0.5f));  // offset: a residual stream
  in.branch = bf16_rounded(random_floats(n, seed + 1, 0.5f));
  in.branch_bias = bf16_rounded(random_floats(C, seed + 2, 0.2f));
  in.weight = bf16_rounded(random_floats(C, seed + 3, 0.1f, 1.0f));
  in.bias = bf16_rounded(random_floats(C, seed + 4, 0.1f));
  return in;
}

// Step one of the two-step path: bf16(residual + (branch + branch_bias)); without a bias,
// bf16(residual + branch) (nothing added, as the kernel).
std::vector<float> host_residual_sum(const Inputs& in, bool with_bias) {
  std::vector<float> sum(in.residual.size());
  for (int r = 0; r < in.N; r++) {
    for (int c = 0; c < in.C; c++) {
      const size_t i = static_cast<size_t>(r) * in.C + c;
      const float branch = with_bias ? in.branch[i] + in.branch_bias[c] : in.branch[i];
      sum[i] = round_to_bf16(in.residual[i] + branch);
    }
  }
  return sum;
}

// What the CPU side expects for one configuration.
struct Expected {
  std::vector<float> residual;             // [N,C] BF16 values: the host sum
  std::vector<float> out, mean, rstd;      // cpu::layernorm_forward of residual
  std::vector<float> out_bf16;             // out rounded to BF16
  std::vector<float> twin_out;             // the CPU twin's out (FP32 residual)
};

Expected expected_for(const Inputs& in, bool with_bias) {
  const int N = in.N, C = in.C;
  const size_t n = static_cast<size_t>(N) * C;
  Expected e;
  e.residual = host_residual_sum(in, with_bias);

  std::vector<float> twin_residual(n), twin_mean(N), twin_rstd(N);
  e.twin_out.resize(n);
  cpu::residual_layernorm_forward(e.twin_out.data(), twin_residual.data(), twin_mean.data(), twin_rstd.data(),
                                  in.residual.data(), in.branch.data(), with_bias ? in.branch_bias.data() : nullptr,
                                  in.weight.data(), in.bias.data(), N, C, kEps);
  CHECK(bf16_rounded(twin_residual) == e.residual);  // the twin's sum is the GPU's before rounding

  e.out.resize(n);
  e.mean.resize(N);
  e.rstd.resize(N);
  cpu::layernorm_forward(e.out.data(), e.mean.data(), e.rstd.data(), e.residual.data(), in.weight.data(),
                         in.bias.data(), N, C, kEps);
  e.out_bf16 = bf16_rounded(e.out);
  return e;
}

// The fused kernel's inputs on the device; residual_in is re-uploaded per run (in place
// overwrites it).
struct DeviceInputs {
  DeviceBuffer<bf16> branch, branch_bias, weight, bias;
  explicit DeviceInputs(const Inputs& in)
      : branch(device_copy(to_bf16(in.branch))),
        branch_bias(device_copy(to_bf16(in.branch_bias))),
        weight(device_copy(to_bf16(in.weight))),
        bias(device_copy(to_bf16(in.bias))) {}
};

struct Run {
  std::vector<bf16> residual_out, residual_in_after;
  std::vector<bf16> out_bf16;
  std::vector<uint8_t> out_fp8;
  std::vector<float> mean, rstd;
  float amax = 0.0f;
};

// fp8 == false: residual_layernorm_forward_bf16; otherwise _fp8 with (dtype, scale) and a
// zero amax slot.
Run run_fused(const Inputs& in, const DeviceInputs& d, bool with_bias, bool in_place, bool fp8, Fp8Dtype dtype,
              float scale) {
  const int N = in.N, C = in.C;
  const size_t n = static_cast<size_t>(N) * C;
  auto d_residual_in = device_copy(to_bf16(in.residual));
  auto d_residual_out = poisoned<bf16>(n);
  bf16* residual_out = in_place ? d_residual_in.data() : d_residual_out.data();
  const bf16* branch_bias = with_bias ? d.branch_bias.data() : nullptr;
  auto d_mean = poisoned<float>(N);
  auto d_rstd = poisoned<float>(N);
  Run run;
  if (fp8) {
    auto d_out = poisoned<uint8_t>(n);
    auto d_amax = device_scalar(0.0f);
    auto d_scale = device_scalar(scale);
    cuda::residual_layernorm_forward_fp8(d_out.data(), d_amax.data(), d_scale.data(), dtype, residual_out,
                                         d_mean.data(), d_rstd.data(), d_residual_in.data(), d.branch.data(),
                                         branch_bias, d.weight.data(), d.bias.data(), N, C, kEps, kStream);
    device_sync();
    run.out_fp8 = d_out.download();
    run.amax = d_amax.download().at(0);
  } else {
    auto d_out = poisoned<bf16>(n);
    cuda::residual_layernorm_forward_bf16(d_out.data(), residual_out, d_mean.data(), d_rstd.data(),
                                          d_residual_in.data(), d.branch.data(), branch_bias, d.weight.data(),
                                          d.bias.data(), N, C, kEps, kStream);
    device_sync();
    run.out_bf16 = d_out.download();
  }
  run.residual_out = in_place ? d_residual_in.download() : d_residual_out.download();
  run.residual_in_after = d_residual_in.download();
  run.mean = d_mean.download();
  run.rstd = d_rstd.download();
  return run;
}

// Step two of the two-step path: the plain LayerNorm launcher on the host-computed residual.
Run run_two_step(const Inputs& in, const DeviceInputs& d, const std::vector<float>& residual, bool fp8,
                 Fp8Dtype dtype, float scale) {
  const int N = in.N, C = in.C;
  const size_t n = static_cast<size_t>(N) * C;
  auto d_residual = device_copy(to_bf16(residual));
  auto d_mean = poisoned<float>(N);
  auto d_rstd = poisoned<float>(N);
  Run run;
  if (fp8) {
    auto d_out = poisoned<uint8_t>(n);
    auto d_amax = device_scalar(0.0f);
    auto d_scale = device_scalar(scale);
    cuda::layernorm_forward_fp8(d_out.data(), d_amax.data(), d_scale.data(), dtype, d_mean.data(), d_rstd.data(),
                                d_residual.data(), d.weight.data(), d.bias.data(), N, C, kEps, kStream);
    device_sync();
    run.out_fp8 = d_out.download();
    run.amax = d_amax.download().at(0);
  } else {
    auto d_out = poisoned<bf16>(n);
    cuda::layernorm_forward_bf16(d_out.data(), d_mean.data(), d_rstd.data(), d_residual.data(), d.weight.data(),
                                 d.bias.data(), N, C, kEps, kStream);
    device_sync();
    run.out_bf16 = d_out.download();
  }
  run.mean = d_mean.download();
  run.rstd = d_rstd.download();
  return run;
}

// The checks common to both output types: the residual stream and the statistics.
void check_residual_and_statistics(const Inputs& in, const Expected& e, const Run& fused, const Run& two_step,
                                   bool in_place) {
  CHECK(from_bf16(fused.residual_out) == e.residual);  // bit for bit (float ==: no NaN expected)
  if (!in_place) CHECK(same_bytes(fused.residual_in_after, to_bf16(in.residual)));  // read only
  CHECK(same_bytes(fused.mean, two_step.mean));
  CHECK(same_bytes(fused.rstd, two_step.rstd));
  CHECK(relative_error(fused.mean, e.mean) < kStatTol);
  CHECK(relative_error(fused.rstd, e.rstd) < kStatTol);
}

}  // namespace

TEST_CASE("residual layernorm bf16 equals residual add then layernorm_forward_bf16, bit for bit",
          "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  for (int C : {64, 200, 768, 2048, 4096, 8192}) {
    const Inputs in = make_inputs(N, C, 3000 + C);
    const DeviceInputs d(in);
    for (bool with_bias : {true, false}) {
      const Expected e = expected_for(in, with_bias);
      const Run two_step = run_two_step(in, d, e.residual, false, Fp8Dtype::e4m3, 1.0f);
      for (bool in_place : {false, true}) {
        CAPTURE(C, with_bias, in_place);
        const Run fused = run_fused(in, d, with_bias, in_place, false, Fp8Dtype::e4m3, 1.0f);
        check_residual_and_statistics(in, e, fused, two_step, in_place);
        CHECK(same_bytes(fused.out_bf16, two_step.out_bf16));
        const std::vector<float> out = from_bf16(fused.out_bf16);
        CHECK(relative_error(out, e.out) < kBf16Tol);
        CHECK(relative_error(out, e.twin_out) < kBf16Tol);
      }
    }
  }
}

TEST_CASE("residual layernorm fp8 equals residual add then layernorm_forward_fp8, bit for bit",
          "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  for (int C : {64, 200, 768, 2048, 4096, 8192}) {
    const Inputs in = make_inputs(N, C, 3100 + C);
    const DeviceInputs d(in);
    for (bool with_bias : {true, false}) {
      const Expected e = expected_for(in, with_bias);
      for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
        for (float scale : {1.0f / 16.0f, 1.0f, 100.0f}) {  // small values / plain / E4M3 saturation
          const Run two_step = run_two_step(in, d, e.residual, true, dtype, scale);
          for (bool in_place : {false, true}) {
            CAPTURE(C, with_bias, in_place, to_string(dtype), scale);
            const Run fused = run_fused(in, d, with_bias, in_place, true, dtype, scale);
            check_residual_and_statistics(in, e, fused, two_step, in_place);
            CHECK(fused.out_fp8 == two_step.out_fp8);
            CHECK(float_bits(fused.amax) == float_bits(two_step.amax));
            check_codes(fused.out_fp8, encode_all(e.out_bf16, scale, dtype), dtype, "residual layernorm fp8 vs CPU");
            const float expected_amax = max_abs(e.out_bf16);
            INFO("amax " << fused.amax << " expected " << expected_amax);
            CHECK(std::fabs(fused.amax - expected_amax) <= kAmaxTol * expected_amax);
          }
        }
      }
    }
  }
}

TEST_CASE("residual layernorm launchers reject a missing branch, aliasing and misalignment", "[gpu][layernorm]") {
  FP8LM_REQUIRE_GPU();
  const int N = 2, C = 64;
  const size_t n = static_cast<size_t>(N) * C;
  DeviceBuffer<bf16> residual(n), branch(n), out(n), params(4 * C);
  DeviceBuffer<uint8_t> codes(n);
  DeviceBuffer<float> stats(2 * N), scalars(2);
  bf16* weight = params.data();
  bf16* bias = params.data() + C;
  bf16* branch_bias = params.data() + 2 * C;
  auto bf16_call = [&](bf16* o, bf16* r_out, const bf16* r_in, const bf16* b, const bf16* bb, int cols) {
    cuda::residual_layernorm_forward_bf16(o, r_out, stats.data(), stats.data() + N, r_in, b, bb, weight, bias, N,
                                          cols, kEps, kStream);
  };
  CHECK_NOTHROW(bf16_call(out.data(), residual.data(), residual.data(), branch.data(), branch_bias, C));  // in place
  CHECK_THROWS_AS(bf16_call(out.data(), residual.data(), residual.data(), nullptr, nullptr, C), RuntimeError);
  CHECK_THROWS_AS(bf16_call(out.data(), branch.data(), residual.data(), branch.data(), nullptr, C),
                  RuntimeError);  // residual_out aliases branch
  CHECK_THROWS_AS(bf16_call(residual.data(), out.data(), residual.data(), branch.data(), nullptr, C),
                  RuntimeError);  // out aliases residual_in
  CHECK_THROWS_AS(bf16_call(out.data(), residual.data(), residual.data(), branch.data(), branch_bias + 1, C),
                  RuntimeError);  // misaligned branch_bias
  CHECK_THROWS_AS(bf16_call(out.data(), residual.data(), residual.data(), branch.data(), nullptr, 12),
                  RuntimeError);  // C % 8 != 0
  CHECK_THROWS_AS(cuda::residual_layernorm_forward_fp8(codes.data(), scalars.data(), scalars.data() + 1,
                                                       Fp8Dtype::e4m3, residual.data(), stats.data(),
                                                       stats.data() + N, residual.data(), nullptr, nullptr, weight,
                                                       bias, N, C, kEps, kStream),
                  RuntimeError);  // no branch
  device_sync();
}
