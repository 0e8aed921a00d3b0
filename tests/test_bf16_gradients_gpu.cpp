// --grad-reduce-in-bf16 on the GPU: every kernel that adds to a parameter gradient, or reads
// one, also takes a BF16 gradient (core/gradient_ref.h). Two checks per kernel:
//   - against itself on an FP32 gradient that starts from the same (BF16) values: the kernels
//     sum in FP32 and add the sum once, so the BF16 result is exactly the FP32 result rounded
//     to BF16, bit for bit; the readers (the norm, AdamW) widen BF16 exactly, so their results
//     are bit-identical;
//   - against the CPU twin, which adds the same sums in FP32 and rounds the gradient once
//     (layers/ops_cpu.cpp, hold_in_dtype): within BF16 rounding (kBf16Tol), as the summation
//     orders of some kernels differ from the CPU's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cast_cuda.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "core/random.h"
#include "layers/encoder.h"
#include "layers/encoder_index.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"
#include "optim/adamw.h"
#include "optim/adamw_cuda.h"
#include "optim/grad_clip.h"
#include "optim/grad_clip_cuda.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using namespace fp8lm::testing;

namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr cudaStream_t kStream = nullptr;
constexpr double kBf16Tol = 1e-2;

std::vector<float> rounded_to_bf16(std::vector<float> values) {
  for (float& v : values) v = round_to_bf16(v);
  return values;
}

// One parameter gradient on the device, FP32 or BF16, starting from `initial` (BF16 values).
struct DeviceGradient {
  DeviceBuffer<float> fp32;
  DeviceBuffer<bf16> bf16_values;
  bool is_bf16 = false;
  DeviceGradient(const std::vector<float>& initial, bool bf16_gradient) : is_bf16(bf16_gradient) {
    if (is_bf16) {
      bf16_values = device_copy(to_bf16(initial));
    } else {
      fp32 = device_copy(initial);
    }
  }
  GradientRef ref() { return is_bf16 ? GradientRef(bf16_values.data(), true) : GradientRef(fp32.data()); }
  std::vector<float> values() const { return is_bf16 ? from_bf16(bf16_values.download()) : fp32.download(); }
};

// The BF16 run's values are the FP32 run's rounded once to BF16, every element.
void check_rounded_once(const std::vector<float>& bf16_result, const std::vector<float>& fp32_result,
                        const char* what) {
  REQUIRE(bf16_result.size() == fp32_result.size());
  size_t differing = 0;
  for (size_t i = 0; i < bf16_result.size(); ++i) differing += float_bits(bf16_result[i]) != float_bits(round_to_bf16(fp32_result[i]));
  INFO(what << ": " << differing << " of " << bf16_result.size() << " elements are not bf16(the FP32 run's)");
  CHECK(differing == 0);
}

}  // namespace

TEST_CASE("bf16 gradients: layernorm backward adds its FP32 column sums to a BF16 dweight and dbias, rounded once",
          "[gpu][layernorm][bf16-gradients]") {
  FP8LM_REQUIRE_GPU();
  for (const auto [N, C] : {std::pair{77, 64}, std::pair{333, 1280}, std::pair{1000, 1600}}) {
    CAPTURE(N, C);
    const size_t n = size_t(N) * C;
    const std::vector<float> inp = bf16_rounded(random_floats(n, 10 + C, 1.0f, 0.5f));
    const std::vector<float> weight = bf16_rounded(random_floats(C, 11 + C, 0.1f, 1.0f));
    const std::vector<float> bias = bf16_rounded(random_floats(C, 12 + C, 0.1f));
    const std::vector<float> dout = bf16_rounded(random_floats(n, 13 + C));
    const std::vector<float> dweight0 = bf16_rounded(random_floats(C, 14 + C));
    const std::vector<float> dbias0 = bf16_rounded(random_floats(C, 15 + C));
    std::vector<float> normalized(n), mean(N), rstd(N);
    cpu::layernorm_forward(normalized.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C,
                           1e-5f);
    std::vector<float> dinp_cpu(n, 0.0f), dweight_cpu = dweight0, dbias_cpu = dbias0;
    cpu::layernorm_backward(dinp_cpu.data(), dweight_cpu.data(), dbias_cpu.data(), dout.data(), inp.data(),
                            weight.data(), mean.data(), rstd.data(), N, C);
    auto d_inp = device_copy(to_bf16(inp));
    auto d_weight = device_copy(to_bf16(weight));
    auto d_dout = device_copy(to_bf16(dout));
    auto d_mean = device_copy(mean);
    auto d_rstd = device_copy(rstd);
    auto run = [&](bool bf16_gradient) {
      DeviceGradient dweight(dweight0, bf16_gradient), dbias(dbias0, bf16_gradient);
      auto d_dinp = device_copy(to_bf16(std::vector<float>(n, 0.0f)));
      auto d_scratch = poisoned<float>(cuda::layernorm_backward_scratch_floats(N, C));
      cuda::layernorm_backward(d_dinp.data(), dweight.ref(), dbias.ref(), d_dout.data(), d_inp.data(), d_weight.data(),
                               d_mean.data(), d_rstd.data(), N, C, d_scratch.data(), kStream);
      device_sync();
      return std::pair{dweight.values(), dbias.values()};
    };
    const auto [dweight32, dbias32] = run(false);
    const auto [dweight16, dbias16] = run(true);
    check_rounded_once(dweight16, dweight32, "dweight");
    check_rounded_once(dbias16, dbias32, "dbias");
    CHECK(relative_error(dweight16, rounded_to_bf16(dweight_cpu)) < kBf16Tol);
    CHECK(relative_error(dbias16, rounded_to_bf16(dbias_cpu)) < kBf16Tol);
  }
}

TEST_CASE("bf16 gradients: the GELU backward's and the casts' dbias add to a BF16 bias gradient, rounded once",
          "[gpu][gelu][cast][bf16-gradients]") {
  FP8LM_REQUIRE_GPU();
  const int M = 256, F = 384;
  const size_t n = size_t(M) * F;
  const std::vector<float> dout = bf16_rounded(random_floats(n, 21));
  const std::vector<float> pre = bf16_rounded(random_floats(n, 22));
  const std::vector<float> dbias0 = bf16_rounded(random_floats(F, 23));
  auto d_dout = device_copy(to_bf16(dout));
  auto d_pre = device_copy(to_bf16(pre));
  auto d_scale = device_scalar(64.0f);
  const size_t scratch_floats =
      std::max(cuda::gelu_backward_scratch_floats(M, F), cuda::dbias_scratch_floats(M, F));
  // Each producer of a bias gradient, run on an FP32 and a BF16 gradient.
  auto run = [&](const char* producer, bool bf16_gradient) {
    DeviceGradient dbias(dbias0, bf16_gradient);
    auto d_scratch = poisoned<float>(scratch_floats);
    auto d_codes = poisoned<uint8_t>(n);
    auto d_codes_t = poisoned<uint8_t>(n);
    auto d_dpre = poisoned<bf16>(n);
    auto d_amax = device_scalar(0.0f);
    const std::string name = producer;
    if (name == "gelu_backward_dbias_bf16") {
      cuda::gelu_backward_dbias_bf16(d_dpre.data(), dbias.ref(), d_dout.data(), d_pre.data(), M, F, d_scratch.data(),
                                     kStream);
    } else if (name == "gelu_backward_cast_transpose_dbias_fp8") {
      cuda::gelu_backward_cast_transpose_dbias_fp8(d_codes.data(), d_codes_t.data(), dbias.ref(), d_amax.data(),
                                                   d_scale.data(), Fp8Dtype::e5m2, d_dout.data(), d_pre.data(), M, F,
                                                   d_scratch.data(), kStream);
    } else if (name == "cast_transpose_fp8") {
      cuda::cast_transpose_fp8(d_codes.data(), d_codes_t.data(), dbias.ref(), d_amax.data(), d_dout.data(),
                               d_scale.data(), Fp8Dtype::e5m2, M, F, d_scratch.data(), kStream);
    } else {
      cuda::column_sum(dbias.ref(), d_dout.data(), M, F, d_scratch.data(), kStream);
    }
    device_sync();
    return dbias.values();
  };
  // The CPU twins: column sums in row order added once (GELU's of bf16(dout * gelu'(pre))).
  std::vector<float> gelu_gradient(n);
  cpu::gelu_backward(gelu_gradient.data(), pre.data(), dout.data(), n);
  auto column_sums_added = [&](const std::vector<float>& values) {
    std::vector<float> result = dbias0;
    for (int j = 0; j < F; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < M; ++i) sum += values[size_t(i) * F + j];
      result[j] = round_to_bf16(result[j] + sum);
    }
    return result;
  };
  const std::vector<float> gelu_reference = column_sums_added(bf16_rounded(gelu_gradient));
  const std::vector<float> cast_reference = column_sums_added(dout);
  for (const char* producer :
       {"gelu_backward_dbias_bf16", "gelu_backward_cast_transpose_dbias_fp8", "cast_transpose_fp8", "column_sum"}) {
    INFO(producer);
    const std::vector<float> fp32 = run(producer, false), bf16_result = run(producer, true);
    check_rounded_once(bf16_result, fp32, producer);
    const bool gelu = std::string(producer).rfind("gelu", 0) == 0;
    CHECK(relative_error(bf16_result, gelu ? gelu_reference : cast_reference) < kBf16Tol);
  }
}

TEST_CASE("bf16 gradients: the embedding backward adds its FP32 row sums to BF16 dwte and dwpe, rounded once",
          "[gpu][encoder][bf16-gradients]") {
  FP8LM_REQUIRE_GPU();
  const int B = 4, T = 64, C = 768, Vp = 320, maxT = 128;
  const size_t n = size_t(B) * T * C;
  std::vector<int32_t> tokens(size_t(B) * T);
  Random random(31);
  for (int32_t& token : tokens) token = static_cast<int32_t>(random.next_u64() % 40) * 7;  // repeats
  const std::vector<float> dout = bf16_rounded(random_floats(n, 32));
  const std::vector<float> dwte0 = bf16_rounded(random_floats(size_t(Vp) * C, 33));
  const std::vector<float> dwpe0 = bf16_rounded(random_floats(size_t(maxT) * C, 34));
  std::vector<float> dwte_cpu = dwte0, dwpe_cpu = dwpe0;
  cpu::encoder_backward(dwte_cpu.data(), dwpe_cpu.data(), dout.data(), tokens.data(), B, T, C);
  const EncoderBackwardIndex index = build_encoder_backward_index(tokens.data(), B, T);
  auto d_dout = device_copy(to_bf16(dout));
  auto d_unique = device_copy(index.unique_tokens);
  auto d_offsets = device_copy(index.offsets);
  auto d_positions = device_copy(index.positions);
  auto run = [&](bool bf16_gradient) {
    DeviceGradient dwte(dwte0, bf16_gradient), dwpe(dwpe0, bf16_gradient);
    cuda::position_embedding_backward(dwpe.ref(), d_dout.data(), 0, T, B * T, C, kStream);
    cuda::embedding_lookup_backward(dwte.ref(), d_dout.data(), d_unique.data(), d_offsets.data(), d_positions.data(),
                                    index.num_unique(), C, kStream);
    device_sync();
    return std::pair{dwte.values(), dwpe.values()};
  };
  const auto [dwte32, dwpe32] = run(false);
  const auto [dwte16, dwpe16] = run(true);
  check_rounded_once(dwte16, dwte32, "dwte");
  check_rounded_once(dwpe16, dwpe32, "dwpe");
  // The CPU sums in the same order (tests/test_fused_kernels_gpu.cpp): bf16 of its FP32 result.
  CHECK(relative_error(dwte16, rounded_to_bf16(dwte_cpu)) < 1e-3);
  CHECK(relative_error(dwpe16, rounded_to_bf16(dwpe_cpu)) < 1e-3);
}

TEST_CASE("bf16 gradients: the norm and AdamW read a BF16 gradient slab as the same values in FP32, bit for bit",
          "[gpu][optim][bf16-gradients]") {
  FP8LM_REQUIRE_GPU();
  // Tensors with odd sizes and offsets: the vector and the scalar paths both run.
  TensorLayout layout;
  layout.add("a", {3, 1000}, true);
  layout.add("b", {77}, false, 1);
  layout.add("c", {40000}, true);
  const size_t total = layout.total_elements(), count = layout.tensors().size();
  const cuda::DeviceTensorLayout device_layout(layout);
  const cuda::DeviceTensorTable& table = device_layout.table();
  const std::vector<float> grads = bf16_rounded(random_floats(total, 41, 0.01f));
  const std::vector<float> params = random_floats(total, 42, 0.02f);
  auto d_grads32 = device_copy(grads);
  auto d_grads16 = device_copy(to_bf16(grads));
  const GradientView fp32_view(d_grads32.data()), bf16_view(d_grads16.data(), true);

  // The norm: the same doubles.
  DeviceBuffer<double> scratch(cuda::grad_norm_scratch_size(table)), sum32(1), sum16(1);
  cuda::grad_norm_squared(sum32.data(), fp32_view, table, scratch.data(), kStream);
  cuda::grad_norm_squared(sum16.data(), bf16_view, table, scratch.data(), kStream);
  device_sync();
  const double norm32 = sum32.download()[0], norm16 = sum16.download()[0];
  CHECK(std::memcmp(&norm32, &norm16, sizeof(double)) == 0);
  CHECK(std::fabs(norm16 - grad_sum_of_squares(grads.data(), layout)) <= 1e-12 * norm16);

  AdamWHyperparams hp;
  hp.lr = 1e-3f;
  StepControl control_value;
  control_value.step_count = 1;
  control_value.grad_scale = 0.5f;
  for (const OptimizerStatePrecision precision : {OptimizerStatePrecision::fp8_fp16, OptimizerStatePrecision::fp32}) {
    INFO(to_string(precision));
    struct Result {
      std::vector<float> master;
      std::vector<bf16> working;
      std::vector<uint8_t> m8;
      std::vector<uint16_t> v16;
      std::vector<float> m32, v32;
    };
    auto run = [&](GradientView view) {
      auto master = device_copy(params);
      auto working = poisoned<bf16>(total);
      DeviceBuffer<StepControl> control(1);
      cuda::set_step_control(control.data(), control_value, kStream);
      Result result;
      if (precision == OptimizerStatePrecision::fp8_fp16) {
        auto m8 = device_copy(std::vector<uint8_t>(total, 0));
        auto v16 = device_copy(std::vector<uint16_t>(total, 0));
        auto m_scales = device_copy(std::vector<float>(count, 1.0f));
        auto v_scales = device_copy(std::vector<float>(count, 1.0f));
        DeviceBuffer<float> adamw_scratch(cuda::adamw_fp8_fp16_scratch_size(table));
        cuda::adamw_step_fp8_fp16(master.data(), working.data(), view, m8.data(), v16.data(), m_scales.data(),
                                  v_scales.data(), table, hp, control.data(), adamw_scratch.data(), kStream);
        device_sync();
        result.m8 = m8.download();
        result.v16 = v16.download();
      } else {
        auto m32 = device_copy(std::vector<float>(total, 0.0f));
        auto v32 = device_copy(std::vector<float>(total, 0.0f));
        cuda::adamw_step_fp32(master.data(), working.data(), view, m32.data(), v32.data(), table, hp, control.data(),
                              kStream);
        device_sync();
        result.m32 = m32.download();
        result.v32 = v32.download();
      }
      result.master = master.download();
      result.working = working.download();
      return result;
    };
    const Result a = run(fp32_view), b = run(bf16_view);
    CHECK(same_bytes(a.master, b.master));
    CHECK(same_bytes(a.working, b.working));
    CHECK(a.m8 == b.m8);
    CHECK(a.v16 == b.v16);
    CHECK(same_bytes(a.m32, b.m32));
    CHECK(same_bytes(a.v32, b.v32));
  }
}
