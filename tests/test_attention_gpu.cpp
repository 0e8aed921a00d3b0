// The CUDA flash attention (layers/attention.cu) against the CPU reference
// (layers/attention.cpp) on BF16-rounded random inputs.
//
// Bounds (relative L2 error ||gpu - ref|| / ||ref||, see tests/gpu_testing.h):
//   forward out  < 1e-2  (P is rounded to BF16 before P V, and out is stored as BF16)
//   forward lse  < 1e-4  (FP32 statistics; S from exact BF16 products in FP32)
//   backward dq, dk, dv (each) < 2e-2  (P and dS are rounded to BF16 for the tensor cores)
// FP8 output: codes equal casting the returned BF16 output with the same scale (exact),
// amax equals max |bf16 out| (exact, a running max). Backward is bit-reproducible, and the
// chain GPU forward -> GPU backward stays within 2e-2 of the CPU chain.
// Shapes include T that is not a multiple of any tile (the kernels tile by 16/32/64/128).
// Note: a "[gpu]" filter also selects the hidden "[.bench]" case (Catch2 runs hidden tests
// that a tag matches); "[gpu]~[.bench]" leaves it out.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <cuda_runtime.h>

#include "core/cast_cuda.h"
#include "core/check_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "layers/attention.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using fp8lm::testing::bf16_rounded;
using fp8lm::testing::device_copy;
using fp8lm::testing::from_bf16;
using fp8lm::testing::kPoisonByte;
using fp8lm::testing::random_floats;
using fp8lm::testing::relative_error;
using fp8lm::testing::to_bf16;

namespace {

struct AttnShape {
  int B, T, NH, HS;
  int C() const { return NH * HS; }
};

// T = 1 (a single key), T below/at/above the tiles, several query blocks, every head size.
const AttnShape kShapes[] = {
    {2, 77, 2, 64},  {1, 256, 3, 32}, {1, 200, 2, 128}, {1, 300, 2, 64}, {2, 130, 1, 128},
    {3, 64, 2, 32},  {1, 1, 2, 64},   {1, 17, 1, 32},   {1, 129, 1, 64},  {1, 1100, 1, 64},
};

std::string describe(const AttnShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " NH=" + std::to_string(s.NH) +
         " HS=" + std::to_string(s.HS);
}

// One third (0 = q, 1 = k, 2 = v) of a packed [B,T,3C] tensor, as [B,T,C].
std::vector<float> third(const std::vector<float>& packed, int part, int B, int T, int C) {
  std::vector<float> out(static_cast<size_t>(B) * T * C);
  for (size_t bt = 0; bt < static_cast<size_t>(B) * T; ++bt)
    for (int i = 0; i < C; ++i) out[bt * C + i] = packed[bt * 3 * C + static_cast<size_t>(part) * C + i];
  return out;
}

struct ForwardRef {
  std::vector<float> qkv, out, lse;
};

ForwardRef forward_reference(const AttnShape& s, uint64_t seed, float std_dev = 1.0f) {
  ForwardRef ref;
  const int C = s.C();
  ref.qkv = bf16_rounded(random_floats(static_cast<size_t>(s.B) * s.T * 3 * C, seed, std_dev));
  ref.out.resize(static_cast<size_t>(s.B) * s.T * C);
  ref.lse.resize(static_cast<size_t>(s.B) * s.NH * s.T);
  cpu::attention_forward(ref.out.data(), ref.lse.data(), ref.qkv.data(), s.B, s.T, C, s.NH);
  return ref;
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace

TEST_CASE("attention forward matches the CPU reference", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : kShapes) {
    INFO(describe(s));
    const int C = s.C();
    for (float std_dev : {1.0f, 3.0f}) {  // 3: peaked softmax rows (scores ~ N(0, 9))
      INFO("qkv std " << std_dev);
      const ForwardRef ref = forward_reference(s, 1234 + s.T + s.HS, std_dev);
      auto qkv = device_copy(to_bf16(ref.qkv));
      cuda::DeviceBuffer<__nv_bfloat16> out(ref.out.size());
      cuda::DeviceBuffer<float> lse(ref.lse.size());
      out.fill_bytes(kPoisonByte);
      lse.fill_bytes(kPoisonByte);
      cuda::attention_forward(out.data(), lse.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv.data(), s.B,
                              s.T, C, s.NH, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const double out_err = relative_error(from_bf16(out.download()), ref.out);
      const double lse_err = relative_error(lse.download(), ref.lse);
      INFO("out rel err " << out_err << ", lse rel err " << lse_err);
      CHECK(out_err < 1e-2);
      CHECK(lse_err < 1e-4);
    }
  }
}

TEST_CASE("attention forward fused FP8 output equals casting the BF16 output", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  struct Case {
    AttnShape shape;
    Fp8Dtype dtype;
    float scale;  // 300 with E4M3 saturates the largest outputs (|out| up to ~3)
  };
  const Case cases[] = {
      {{2, 77, 2, 64}, Fp8Dtype::e4m3, 4.0f},   {{2, 77, 2, 64}, Fp8Dtype::e4m3, 300.0f},
      {{1, 200, 2, 128}, Fp8Dtype::e5m2, 0.5f}, {{1, 256, 3, 32}, Fp8Dtype::e5m2, 1000.0f},
  };
  for (const Case& c : cases) {
    const AttnShape& s = c.shape;
    INFO(describe(s) << " dtype " << to_string(c.dtype) << " scale " << c.scale);
    const int C = s.C();
    const ForwardRef ref = forward_reference(s, 99 + s.T);
    auto qkv = device_copy(to_bf16(ref.qkv));
    const size_t n = ref.out.size();

    // Plain BF16 forward, for comparison.
    cuda::DeviceBuffer<__nv_bfloat16> out_plain(n);
    cuda::DeviceBuffer<float> lse_plain(ref.lse.size());
    out_plain.fill_bytes(kPoisonByte);
    cuda::attention_forward(out_plain.data(), lse_plain.data(), nullptr, nullptr, nullptr, c.dtype, qkv.data(), s.B,
                            s.T, C, s.NH, nullptr);

    cuda::DeviceBuffer<__nv_bfloat16> out(n);
    cuda::DeviceBuffer<float> lse(ref.lse.size());
    cuda::DeviceBuffer<uint8_t> out_fp8(n);
    auto scale = device_copy(std::vector<float>{c.scale});
    auto amax = device_copy(std::vector<float>{0.0f});
    out.fill_bytes(kPoisonByte);
    lse.fill_bytes(kPoisonByte);
    out_fp8.fill_bytes(kPoisonByte);
    cuda::attention_forward(out.data(), lse.data(), out_fp8.data(), amax.data(), scale.data(), c.dtype, qkv.data(),
                            s.B, s.T, C, s.NH, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    const std::vector<__nv_bfloat16> out_bits = out.download();
    const std::vector<__nv_bfloat16> plain_bits = out_plain.download();
    REQUIRE(std::memcmp(out_bits.data(), plain_bits.data(), n * sizeof(__nv_bfloat16)) == 0);
    const std::vector<float> out_host = from_bf16(out_bits);
    CHECK(relative_error(out_host, ref.out) < 1e-2);
    CHECK(relative_error(lse.download(), ref.lse) < 1e-4);

    const std::vector<uint8_t> codes = out_fp8.download();
    size_t mismatches = 0;
    float max_abs = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      if (codes[i] != fp8_encode(out_host[i] * c.scale, c.dtype)) ++mismatches;
      max_abs = std::fmax(max_abs, std::fabs(out_host[i]));
    }
    CHECK(mismatches == 0);
    const float amax_gpu = amax.download()[0];
    CHECK(bits_of(amax_gpu) == bits_of(max_abs));

    // amax is a running max: a larger value already there stays; no-FP8 calls update it too.
    auto big = device_copy(std::vector<float>{1.0e6f});
    cuda::attention_forward(out.data(), lse.data(), out_fp8.data(), big.data(), scale.data(), c.dtype, qkv.data(),
                            s.B, s.T, C, s.NH, nullptr);
    auto amax_only = device_copy(std::vector<float>{0.0f});
    cuda::attention_forward(out.data(), lse.data(), nullptr, amax_only.data(), nullptr, c.dtype, qkv.data(), s.B,
                            s.T, C, s.NH, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(big.download()[0] == 1.0e6f);
    CHECK(bits_of(amax_only.download()[0]) == bits_of(max_abs));
  }
}

TEST_CASE("attention backward matches the CPU reference", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : kShapes) {
    INFO(describe(s));
    const int C = s.C();
    const ForwardRef ref = forward_reference(s, 777 + s.T + s.HS);
    // Both sides get the same BF16 out and the reference's lse, so this isolates backward.
    const std::vector<float> out = bf16_rounded(ref.out);
    const std::vector<float> dout = bf16_rounded(random_floats(ref.out.size(), 4242 + s.T));
    std::vector<float> dqkv_ref(ref.qkv.size());
    cpu::attention_backward(dqkv_ref.data(), dout.data(), ref.qkv.data(), out.data(), ref.lse.data(), s.B, s.T, C,
                            s.NH);

    auto qkv_d = device_copy(to_bf16(ref.qkv));
    auto out_d = device_copy(to_bf16(out));
    auto dout_d = device_copy(to_bf16(dout));
    auto lse_d = device_copy(ref.lse);
    cuda::DeviceBuffer<__nv_bfloat16> dqkv(ref.qkv.size());
    cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
    dqkv.fill_bytes(kPoisonByte);
    scratch.fill_bytes(kPoisonByte);
    cuda::attention_backward(dqkv.data(), dout_d.data(), qkv_d.data(), out_d.data(), lse_d.data(), s.B, s.T, C, s.NH,
                             scratch.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> dqkv_gpu = from_bf16(dqkv.download());

    const double all_err = relative_error(dqkv_gpu, dqkv_ref);
    INFO("dqkv rel err " << all_err);
    CHECK(all_err < 2e-2);
    if (s.T >= 2) {  // with T = 1, dq and dk are exactly zero (one key: no softmax gradient)
      const char* names[] = {"dq", "dk", "dv"};
      for (int part = 0; part < 3; ++part) {
        const double err =
            relative_error(third(dqkv_gpu, part, s.B, s.T, C), third(dqkv_ref, part, s.B, s.T, C));
        INFO(names[part] << " rel err " << err);
        CHECK(err < 2e-2);
      }
    }
  }
}

TEST_CASE("attention backward is bit-reproducible", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : {AttnShape{2, 333, 2, 64}, AttnShape{1, 150, 2, 128}, AttnShape{1, 100, 2, 32}}) {
    INFO(describe(s));
    const int C = s.C();
    const ForwardRef ref = forward_reference(s, 5 + s.HS);
    auto qkv = device_copy(to_bf16(ref.qkv));
    const std::vector<float> dout_host = bf16_rounded(random_floats(ref.out.size(), 6));
    auto dout = device_copy(to_bf16(dout_host));
    cuda::DeviceBuffer<__nv_bfloat16> out(ref.out.size());
    cuda::DeviceBuffer<float> lse(ref.lse.size());
    // The GPU's own forward feeds backward here, as in training.
    cuda::attention_forward(out.data(), lse.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv.data(), s.B, s.T,
                            C, s.NH, nullptr);
    cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
    cuda::DeviceBuffer<__nv_bfloat16> dqkv(ref.qkv.size());
    std::vector<std::vector<__nv_bfloat16>> runs;
    for (int run = 0; run < 2; ++run) {
      dqkv.fill_bytes(kPoisonByte);
      scratch.fill_bytes(kPoisonByte);
      cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, C, s.NH,
                               scratch.data(), nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      runs.push_back(dqkv.download());
    }
    REQUIRE(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(__nv_bfloat16)) == 0);

    // End to end (GPU forward's out and lse into GPU backward) against the CPU chain.
    std::vector<float> dqkv_ref(ref.qkv.size());
    const std::vector<float> out_ref = bf16_rounded(ref.out);
    cpu::attention_backward(dqkv_ref.data(), dout_host.data(), ref.qkv.data(), out_ref.data(), ref.lse.data(), s.B,
                            s.T, C, s.NH);
    const double err = relative_error(from_bf16(runs[0]), dqkv_ref);
    INFO("end-to-end dqkv rel err " << err);
    CHECK(err < 2e-2);
  }
}

// Head size 64 runs wgmma kernels on Hopper. They compute the mma.sync kernels' products in
// the same order, so every output must be the same bits, including at ragged T and where
// several key tiles feed one query (a register hazard once broke exactly those). The wgmma dQ
// kernel computes D = rowsum(dO * O) itself, in the row-dot kernel's order: its scratch too.
TEST_CASE("attention wgmma kernels equal the mma.sync kernels bit for bit", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : {AttnShape{2, 77, 2, 64}, AttnShape{1, 130, 1, 64}, AttnShape{1, 1100, 1, 64},
                             AttnShape{3, 333, 2, 64}, AttnShape{1, 1, 2, 64}, AttnShape{2, 1024, 3, 64}}) {
    INFO(describe(s));
    const int C = s.C();
    const size_t n_qkv = static_cast<size_t>(s.B) * s.T * 3 * C;
    const size_t n_out = static_cast<size_t>(s.B) * s.T * C;
    const size_t n_lse = static_cast<size_t>(s.B) * s.NH * s.T;
    auto qkv = device_copy(to_bf16(random_floats(n_qkv, 91 + s.T, 2.0f)));
    auto dout = device_copy(to_bf16(random_floats(n_out, 92 + s.T)));
    auto scale = device_copy(std::vector<float>{4.0f});
    struct Outputs {
      std::vector<__nv_bfloat16> out, dqkv;
      std::vector<uint8_t> out_fp8;
      std::vector<float> lse, amax, D;
    };
    auto run = [&](bool wgmma) {
      cuda::DeviceBuffer<__nv_bfloat16> out(n_out), dqkv(n_qkv);
      cuda::DeviceBuffer<uint8_t> out_fp8(n_out);
      cuda::DeviceBuffer<float> lse(n_lse), scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
      auto amax = device_copy(std::vector<float>{0.0f});
      out.fill_bytes(kPoisonByte);
      dqkv.fill_bytes(kPoisonByte);
      lse.fill_bytes(kPoisonByte);
      scratch.fill_bytes(kPoisonByte);
      auto forward = wgmma ? cuda::attention_forward : cuda::attention_forward_mma_sync;
      auto backward = wgmma ? cuda::attention_backward : cuda::attention_backward_mma_sync;
      forward(out.data(), lse.data(), out_fp8.data(), amax.data(), scale.data(), Fp8Dtype::e4m3, qkv.data(), s.B, s.T,
              C, s.NH, nullptr);
      backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, C, s.NH, scratch.data(),
               nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      return Outputs{out.download(), dqkv.download(), out_fp8.download(), lse.download(), amax.download(),
                     scratch.download()};
    };
    const Outputs fast = run(true);
    const Outputs reference = run(false);
    CHECK(std::memcmp(fast.out.data(), reference.out.data(), n_out * sizeof(__nv_bfloat16)) == 0);
    CHECK(std::memcmp(fast.out_fp8.data(), reference.out_fp8.data(), n_out) == 0);
    CHECK(std::memcmp(fast.lse.data(), reference.lse.data(), n_lse * sizeof(float)) == 0);
    CHECK(bits_of(fast.amax[0]) == bits_of(reference.amax[0]));
    CHECK(std::memcmp(fast.dqkv.data(), reference.dqkv.data(), n_qkv * sizeof(__nv_bfloat16)) == 0);
    CHECK(std::memcmp(fast.D.data(), reference.D.data(), n_lse * sizeof(float)) == 0);
  }
}

// The backward's FP8 operand (head size 64, T a multiple of 64) against the cast of the BF16
// dqkv it replaces: codes, transpose, amax and bias gradient bit for bit. Both formats, an
// FP32 and a BF16 bias gradient added to (not overwritten), none, no amax, and scales that
// saturate.
TEST_CASE("attention backward writes dqkv's FP8 operand exactly as the cast of its dqkv", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  if (!cuda::attention_backward_writes_operand(1, 64, 64, 1)) SKIP("no wgmma on this GPU");
  struct Case {
    AttnShape shape;
    Fp8Dtype dtype;
    float scale;
    enum { fp32, bf16, none } dbias;
    bool amax;
  };
  for (const Case& c : {Case{{2, 128, 3, 64}, Fp8Dtype::e5m2, 4.0f, Case::fp32, true},
                        Case{{1, 1024, 2, 64}, Fp8Dtype::e5m2, 1.0f, Case::bf16, true},
                        Case{{3, 192, 1, 64}, Fp8Dtype::e4m3, 2.0f, Case::none, true},
                        Case{{1, 64, 2, 64}, Fp8Dtype::e5m2, 65536.0f, Case::fp32, false},
                        Case{{2, 256, 1, 64}, Fp8Dtype::e4m3, 4096.0f, Case::bf16, true}}) {
    const AttnShape& s = c.shape;
    INFO(describe(s) << " " << to_string(c.dtype) << " scale " << c.scale << " dbias " << int(c.dbias));
    REQUIRE(cuda::attention_backward_writes_operand(s.B, s.T, s.C(), s.NH));
    const int C = s.C(), M = s.B * s.T, N = 3 * C;
    const size_t n_qkv = size_t(M) * N, n_out = size_t(M) * C, n_lse = size_t(s.B) * s.NH * s.T;
    auto qkv = device_copy(to_bf16(random_floats(n_qkv, 41 + s.T, 2.0f)));
    auto dout = device_copy(to_bf16(random_floats(n_out, 42 + s.T)));
    cuda::DeviceBuffer<__nv_bfloat16> out(n_out), dqkv(n_qkv);
    cuda::DeviceBuffer<float> lse(n_lse);
    cuda::attention_forward(out.data(), lse.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv.data(), s.B, s.T,
                            C, s.NH, nullptr);
    const auto scale = device_copy(std::vector<float>{c.scale});
    const std::vector<float> dbias_start = random_floats(size_t(N), 43 + s.T);

    struct Result {
      std::vector<uint8_t> codes, codes_t;
      std::vector<float> amax, dbias32;
      std::vector<__nv_bfloat16> dbias16;
    };
    auto run = [&](bool fused) {
      cuda::DeviceBuffer<uint8_t> codes(n_qkv), codes_t(n_qkv);
      codes.fill_bytes(kPoisonByte);
      codes_t.fill_bytes(kPoisonByte);
      auto amax = device_copy(std::vector<float>{0.5f});
      auto dbias32 = device_copy(dbias_start);
      auto dbias16 = device_copy(to_bf16(dbias_start));
      const GradientRef dbias = c.dbias == Case::fp32   ? GradientRef(dbias32.data())
                                : c.dbias == Case::bf16 ? GradientRef(dbias16.data(), true)
                                                        : GradientRef();
      float* amax_pointer = c.amax ? amax.data() : nullptr;
      cuda::DeviceBuffer<float> scratch(std::max(cuda::attention_backward_operand_scratch_floats(s.B, s.T, C, s.NH),
                                                 cuda::dbias_scratch_floats(M, N)));
      scratch.fill_bytes(kPoisonByte);
      if (fused) {
        cuda::attention_backward_operand({.codes = codes.data(),
                                          .codes_t = codes_t.data(),
                                          .dbias = dbias,
                                          .amax = amax_pointer,
                                          .scale = scale.data(),
                                          .dtype = c.dtype},
                                         dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, C, s.NH,
                                         scratch.data(), nullptr);
      } else {
        cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, C, s.NH,
                                 scratch.data(), nullptr);
        cuda::cast_transpose_fp8(codes.data(), codes_t.data(), dbias, amax_pointer, dqkv.data(), scale.data(),
                                 c.dtype, M, N, scratch.data(), nullptr, nullptr);
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      return Result{codes.download(), codes_t.download(), amax.download(), dbias32.download(), dbias16.download()};
    };
    const Result fused = run(true);
    const Result reference = run(false);
    CHECK(std::memcmp(fused.codes.data(), reference.codes.data(), n_qkv) == 0);
    CHECK(std::memcmp(fused.codes_t.data(), reference.codes_t.data(), n_qkv) == 0);
    CHECK(bits_of(fused.amax[0]) == bits_of(reference.amax[0]));
    CHECK(std::memcmp(fused.dbias32.data(), reference.dbias32.data(), size_t(N) * sizeof(float)) == 0);
    CHECK(std::memcmp(fused.dbias16.data(), reference.dbias16.data(), size_t(N) * sizeof(__nv_bfloat16)) == 0);
    // The cases are not vacuous: the bias gradient moved, the amax was raised, and the large
    // scales saturate some codes.
    if (c.dbias == Case::fp32) CHECK(fused.dbias32 != dbias_start);
    if (c.amax) CHECK(fused.amax[0] > 0.5f);
    if (c.scale == 4096.0f) {
      const uint8_t max_code = c.dtype == Fp8Dtype::e5m2 ? 0x7B : 0x7E;
      CHECK(std::any_of(fused.codes.begin(), fused.codes.end(), [&](uint8_t q) { return (q & 0x7F) == max_code; }));
    }
  }
}

TEST_CASE("attention backward's FP8 operand: shapes it cannot tile are refused", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  CHECK_FALSE(cuda::attention_backward_writes_operand(1, 100, 128, 2));  // T not a multiple of 64
  CHECK_FALSE(cuda::attention_backward_writes_operand(1, 128, 64, 2));   // head size 32
  CHECK_FALSE(cuda::attention_backward_writes_operand(1, 128, 256, 2));  // head size 128
  CHECK_THROWS_AS(cuda::attention_backward_operand({}, nullptr, nullptr, nullptr, nullptr, 1, 100, 128, 2, nullptr,
                                                   nullptr),
                  RuntimeError);
}

TEST_CASE("attention rejects unsupported head sizes with a hint", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  // HS = 96 / 2 = 48: checked before any pointer is touched.
  try {
    cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, nullptr, 1, 16, 96, 2,
                            nullptr);
    FAIL("attention_forward accepted HS = 48");
  } catch (const RuntimeError& e) {
    CHECK(!e.hint().empty());
  }
  CHECK_THROWS_AS(cuda::attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 96, 2, nullptr, nullptr),
                  RuntimeError);
  CHECK_THROWS_AS(cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, nullptr, 1,
                                          16, 256, 1, nullptr),
                  RuntimeError);  // HS = 256
}

// Throughput (hidden: run with "[.bench]" or "[attention][.bench]"). Causal FLOPs: forward
// 4*B*NH*T*T*HS/2 (two GEMMs, half the matrix); backward counted as 2.5x forward (the
// usual FA convention; this backward does 3.5x the forward's work to stay deterministic).
TEST_CASE("attention throughput", "[gpu][attention][.bench]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : {AttnShape{8, 1024, 25, 64}, AttnShape{32, 1024, 12, 64}}) {
    const int C = s.C();
    const size_t n_qkv = static_cast<size_t>(s.B) * s.T * 3 * C;
    const size_t n_out = static_cast<size_t>(s.B) * s.T * C;
    // A 1M-value random block repeated: realistic data without minutes of host RNG.
    auto tiled = [](size_t n, uint64_t seed) {
      const std::vector<float> block = random_floats(size_t{1} << 20, seed);
      std::vector<float> values(n);
      for (size_t i = 0; i < n; ++i) values[i] = block[i % block.size()];
      return values;
    };
    auto qkv = device_copy(to_bf16(tiled(n_qkv, 1)));
    auto dout = device_copy(to_bf16(tiled(n_out, 2)));
    cuda::DeviceBuffer<__nv_bfloat16> out(n_out);
    cuda::DeviceBuffer<uint8_t> out_fp8(n_out);
    cuda::DeviceBuffer<float> lse(static_cast<size_t>(s.B) * s.NH * s.T);
    auto scale = device_copy(std::vector<float>{1.0f});
    auto amax = device_copy(std::vector<float>{0.0f});
    cuda::DeviceBuffer<__nv_bfloat16> dqkv(n_qkv);
    cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));

    auto forward = [&] {
      cuda::attention_forward(out.data(), lse.data(), out_fp8.data(), amax.data(), scale.data(), Fp8Dtype::e4m3,
                              qkv.data(), s.B, s.T, C, s.NH, nullptr);
    };
    auto backward = [&] {
      cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, C, s.NH,
                               scratch.data(), nullptr);
    };
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    auto time_ms = [&](auto&& fn) {
      for (int i = 0; i < 3; ++i) fn();  // warm-up
      constexpr int kIters = 20;
      CUDA_CHECK(cudaEventRecord(start));
      for (int i = 0; i < kIters; ++i) fn();
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      return static_cast<double>(ms) / kIters;
    };
    const double fwd_ms = time_ms(forward);
    const double bwd_ms = time_ms(backward);
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    const double fwd_flops = 4.0 * s.B * s.NH * static_cast<double>(s.T) * s.T * s.HS / 2.0;
    const double bwd_flops = 2.5 * fwd_flops;
    std::printf("attention %s: forward %.3f ms (%.1f TFLOP/s, with FP8 out), backward %.3f ms (%.1f TFLOP/s)\n",
                describe(s).c_str(), fwd_ms, fwd_flops / fwd_ms * 1e-9, bwd_ms, bwd_flops / bwd_ms * 1e-9);
    const std::vector<__nv_bfloat16> gradient_bits = dqkv.download();
    uint64_t hash = 1469598103934665603ull;  // FNV-1a of dqkv's bytes: equal bits across builds
    const auto* bytes = reinterpret_cast<const unsigned char*>(gradient_bits.data());
    for (size_t i = 0; i < gradient_bits.size() * sizeof(__nv_bfloat16); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    std::printf("attention %s: dqkv FNV-1a %016llx\n", describe(s).c_str(), static_cast<unsigned long long>(hash));
    const std::vector<float> dq = from_bf16(gradient_bits);
    bool finite = true;
    for (size_t i = 0; i < dq.size(); i += 997) finite = finite && std::isfinite(dq[i]);
    CHECK(finite);
  }
}
