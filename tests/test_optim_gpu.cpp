// GPU AdamW (optim/adamw_cuda.h), gradient norm and step control (optim/grad_clip_cuda.h)
// against the CPU reference (optim/adamw.h, optim/grad_clip.h).
//
// Bounds and why:
//   - master weights, FP32 moments, E4M3 m codes, FP16 v bits, per-tensor scales: bit-exact.
//     The kernels evaluate adamw_moments()/adamw_param() with explicitly rounded
//     intrinsics (no FMA) and IEEE division/sqrt, exactly the operations g++ emits for the
//     reference. One tolerated difference: an E4M3 zero's sign (0x00 vs 0x80), should the
//     hardware conversion of a negative underflow differ from fp8_encode; both decode to a
//     zero that no later step can tell apart. Such codes are counted and reported (WARN).
//   - BF16 copy: exactly bf16_from_float(master) for real elements; padding keeps the 0xFF
//     poison.
//   - sum of squares: relative 1e-10 vs the CPU's double sum (both accumulate in double in
//     different orders: the worst case is ~n * 2^-53 with n ~ 1e4 terms per chunk);
//     grad_norm (float) relative 1e-6; the clip coefficient relative 1e-6, and the CPU step
//     then uses the GPU's coefficient so that AdamW itself is compared bit for bit.
//   - bias corrections: bit-exact with adamw_step_scalars() (double pow on both sides,
//     rounded to float; see optim/adamw.cu for the residual risk).
//   - padding of every slab: untouched (sentinels), and NaN gradients in the padding must
//     not reach the norm.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>

#include "core/cast_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/random.h"
#include "core/tensor.h"
#include "optim/adamw.h"
#include "optim/adamw_cuda.h"
#include "optim/grad_clip.h"
#include "optim/grad_clip_cuda.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using fp8lm::cuda::DeviceBuffer;
using fp8lm::StepControl;
using fp8lm::testing::device_copy;
using fp8lm::testing::kPoisonByte;
using fp8lm::testing::same_bytes;
using fp8lm::testing::time_ms;

namespace {

void sync() { CUDA_CHECK(cudaDeviceSynchronize()); }

constexpr float kMasterPadding = 777.0f;  // sentinels in the padding of each slab
constexpr uint8_t kM8Padding = 0x5A;
constexpr uint16_t kV16Padding = 0x1234;
constexpr float kM32Padding = 555.0f;
constexpr float kV32Padding = 666.0f;
constexpr uint16_t kBf16Poison = 0xFFFF;

// Several tensors, 1-D and 2-D, none a multiple of the 256-thread block or the 8192-element
// chunk except "exact"; "odd" and "tail" sit at offsets that are not multiples of 4 (the
// scalar path); "empty" has no elements; padding between most tensors.
TensorLayout test_layout() {
  TensorLayout layout;
  layout.add("wte", {37, 29}, true);               // 1073 elements, vector path + scalar tail
  layout.add("ln.weight", {13}, false);
  layout.add("odd", {5, 3}, true, /*alignment=*/1);  // offset 1101: scalar path
  layout.add("empty", {0}, false);
  layout.add("big", {97, 211}, true);              // 20467: 3 chunks, the last one partial
  layout.add("exact", {2, 8192}, true);            // exactly 2 chunks
  layout.add("bias", {1}, false);
  layout.add("tail", {3, 7}, false, /*alignment=*/3);
  return layout;
}

// 1 for padding elements of the slab, 0 for real ones.
std::vector<uint8_t> padding_mask(const TensorLayout& layout) {
  std::vector<uint8_t> mask(layout.total_elements(), 1);
  for (const TensorInfo& t : layout.tensors())
    for (size_t i = 0; i < t.numel; ++i) mask[t.offset + i] = 0;
  return mask;
}

// Real elements N(0, std_k) with a per-tensor std cycling over 4 decades, every 17th
// element exactly 0 when `zeros`; padding = `padding`.
std::vector<float> random_slab(const TensorLayout& layout, uint64_t seed, float base_std, float padding,
                               bool zeros) {
  std::vector<float> slab(layout.total_elements(), padding);
  Random random(seed);
  static constexpr float kStd[4] = {1.0f, 1e-2f, 1e-4f, 3.0f};
  for (size_t k = 0; k < layout.tensors().size(); ++k) {
    const TensorInfo& t = layout.tensors()[k];
    for (size_t i = 0; i < t.numel; ++i) {
      const float x = base_std * kStd[k % 4] * static_cast<float>(random.normal());
      slab[t.offset + i] = (zeros && i % 17 == 5) ? 0.0f : x;
    }
  }
  return slab;
}

std::vector<float> random_params(const TensorLayout& layout, uint64_t seed) {
  return random_slab(layout, seed, 0.05f, kMasterPadding, false);
}
std::vector<float> random_grads(const TensorLayout& layout, uint64_t seed) {
  return random_slab(layout, seed, 1.0f, NAN, true);  // NaN padding: must never be read
}

AdamWHyperparams test_hyperparams() {
  return AdamWHyperparams{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
}

template <typename T>
std::vector<uint16_t> as_u16(const std::vector<T>& v) {
  static_assert(sizeof(T) == 2);
  std::vector<uint16_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * 2);
  return out;
}

// The optimizer state of one GPU "engine". `shift` > 0 offsets every slab pointer by that
// many elements, which misaligns them for vector access: every tensor takes the scalar path.
// FP8 weights the update pass writes too, with the FP8 scales fp8_scales and amaxes raised in
// amax_row (optim/adamw_cuda.h).
struct WeightCasts {
  const cuda::DeviceWeightCastTable* table = nullptr;
  const float* fp8_scales = nullptr;
  float* amax_row = nullptr;
};

struct GpuOptimizer {
  const TensorLayout& layout;
  OptimizerStatePrecision precision;
  size_t shift;
  size_t total;
  cuda::DeviceTensorLayout device_layout;
  DeviceBuffer<float> master, grads, m32, v32, m_scales, v_scales, scratch, loss;
  DeviceBuffer<__nv_bfloat16> bf16;
  DeviceBuffer<uint8_t> m8;
  DeviceBuffer<uint16_t> v16;
  DeviceBuffer<double> norm_scratch, sum;
  DeviceBuffer<StepControl> control;

  GpuOptimizer(const TensorLayout& layout_, OptimizerStatePrecision precision_, const std::vector<float>& params,
               size_t shift_ = 0)
      : layout(layout_), precision(precision_), shift(shift_), total(layout_.total_elements()),
        device_layout(layout_) {
    const std::vector<uint8_t> pad = padding_mask(layout);
    std::vector<float> host_master(total + shift, kMasterPadding);
    std::copy(params.begin(), params.end(), host_master.begin() + shift);
    master = device_copy(host_master);
    grads.allocate(total + shift);
    bf16.allocate(total + shift);
    bf16.fill_bytes(kPoisonByte);
    const size_t count = layout.tensors().size();
    if (precision == OptimizerStatePrecision::fp8_fp16) {
      std::vector<uint8_t> codes(total + shift, kM8Padding);
      std::vector<uint16_t> bits(total + shift, kV16Padding);
      for (size_t i = 0; i < total; ++i) {
        if (!pad[i]) codes[shift + i] = 0;  // fresh state: +0 codes, scales 1
        if (!pad[i]) bits[shift + i] = 0;
      }
      m8 = device_copy(codes);
      v16 = device_copy(bits);
      m_scales = device_copy(std::vector<float>(count, 1.0f));
      v_scales = device_copy(std::vector<float>(count, 1.0f));
      scratch.allocate(cuda::adamw_fp8_fp16_scratch_size(device_layout.table()));
    } else {
      std::vector<float> m(total + shift, kM32Padding), v(total + shift, kV32Padding);
      for (size_t i = 0; i < total; ++i) {
        if (!pad[i]) m[shift + i] = 0.0f;
        if (!pad[i]) v[shift + i] = 0.0f;
      }
      m32 = device_copy(m);
      v32 = device_copy(v);
    }
    norm_scratch.allocate(cuda::grad_norm_scratch_size(device_layout.table()));
    sum.allocate(1);
    loss.allocate(1);
    control.allocate(1);
    cuda::set_step_control(control.data(), StepControl{}, nullptr);
    sync();
  }

  const cuda::DeviceTensorTable& table() const { return device_layout.table(); }

  // The end of one training step: gradient norm, finalize_step, AdamW. No host sync
  // inside (the uploads before it are synchronous).
  // casts (fp8_fp16): the update pass also writes those FP8 weights (WeightCasts).
  // norm_in_first_pass (fp8_fp16): the norm taken in AdamW's first pass, before the decision.
  bool norm_in_first_pass = false;
  void step(const std::vector<float>& host_grads, const AdamWHyperparams& hp, double max_norm,
            float loss_sum = 5.0f, float loss_divisor = 2.0f, const WeightCasts& casts = {}) {
    REQUIRE(host_grads.size() == total);
    grads.upload(host_grads.data(), total, shift);
    loss.upload(std::vector<float>{loss_sum});
    sync();
    if (norm_in_first_pass) {
      REQUIRE(precision == OptimizerStatePrecision::fp8_fp16);
      cuda::adamw_fp8_fp16_moment_amaxes_and_norm(grads.data() + shift, m8.data() + shift, v16.data() + shift,
                                                  m_scales.data(), v_scales.data(), table(), hp, scratch.data(),
                                                  sum.data(), norm_scratch.data(), nullptr);
      cuda::finalize_step(control.data(), sum.data(), loss.data(), loss_divisor, max_norm, nullptr);
      cuda::adamw_fp8_fp16_moment_amaxes_if_clipped(grads.data() + shift, m8.data() + shift, v16.data() + shift,
                                                    m_scales.data(), v_scales.data(), table(), hp, control.data(),
                                                    scratch.data(), nullptr);
      cuda::adamw_fp8_fp16_apply(master.data() + shift, bf16.data() + shift, grads.data() + shift, m8.data() + shift,
                                 v16.data() + shift, m_scales.data(), v_scales.data(), table(), hp, control.data(),
                                 scratch.data(), nullptr);
      sync();
      return;
    }
    cuda::grad_norm_squared(sum.data(), grads.data() + shift, table(), norm_scratch.data(), nullptr);
    cuda::finalize_step(control.data(), sum.data(), loss.data(), loss_divisor, max_norm, nullptr);
    if (casts.table) {
      REQUIRE(precision == OptimizerStatePrecision::fp8_fp16);
      cuda::adamw_fp8_fp16_moment_amaxes(grads.data() + shift, m8.data() + shift, v16.data() + shift, m_scales.data(),
                                         v_scales.data(), table(), hp, control.data(), scratch.data(), nullptr);
      cuda::adamw_fp8_fp16_apply(master.data() + shift, bf16.data() + shift, grads.data() + shift, m8.data() + shift,
                                 v16.data() + shift, m_scales.data(), v_scales.data(), table(), hp, control.data(),
                                 scratch.data(), nullptr, nullptr, casts.table, casts.fp8_scales, casts.amax_row);
    } else if (precision == OptimizerStatePrecision::fp8_fp16) {
      cuda::adamw_step_fp8_fp16(master.data() + shift, bf16.data() + shift, grads.data() + shift, m8.data() + shift,
                                v16.data() + shift, m_scales.data(), v_scales.data(), table(), hp, control.data(),
                                scratch.data(), nullptr);
    } else {
      cuda::adamw_step_fp32(master.data() + shift, bf16.data() + shift, grads.data() + shift, m32.data() + shift,
                            v32.data() + shift, table(), hp, control.data(), nullptr);
    }
    sync();
  }

  template <typename T>
  std::vector<T> slab(const DeviceBuffer<T>& buffer) const {
    std::vector<T> all = buffer.download();
    return std::vector<T>(all.begin() + static_cast<ptrdiff_t>(shift), all.end());
  }
  StepControl read_control() const { return control.download()[0]; }
  double read_sum() const { return sum.download()[0]; }

  // Every byte of state, for "nothing changed" and determinism checks.
  std::vector<uint8_t> state_bytes() const {
    std::vector<uint8_t> bytes;
    auto append = [&](const auto& buffer) {
      const auto host = buffer.download();
      const auto* p = reinterpret_cast<const uint8_t*>(host.data());
      bytes.insert(bytes.end(), p, p + host.size() * sizeof(host[0]));
    };
    append(master);
    append(bf16);
    if (precision == OptimizerStatePrecision::fp8_fp16) {
      append(m8);
      append(v16);
      append(m_scales);
      append(v_scales);
    } else {
      append(m32);
      append(v32);
    }
    return bytes;
  }
};

// Counts elements where `differs(i)`; remembers the first.
struct Mismatches {
  size_t count = 0;
  size_t first = std::numeric_limits<size_t>::max();
  void add(bool differs, size_t i) {
    if (!differs) return;
    if (count == 0) first = i;
    ++count;
  }
  std::string describe(const char* what) const {
    return std::string(what) + ": " + std::to_string(count) + " mismatches" +
           (count ? ", first at slab element " + std::to_string(first) : std::string());
  }
};

// Compares the GPU state with the CPU optimizer after the same steps.
void check_state(const GpuOptimizer& gpu, const AdamW& cpu, const std::vector<float>& cpu_params, int step) {
  INFO("after step " << step);
  const TensorLayout& layout = gpu.layout;
  const std::vector<uint8_t> pad = padding_mask(layout);
  const size_t total = layout.total_elements();

  const std::vector<float> master = gpu.slab(gpu.master);
  const std::vector<uint16_t> bf16 = as_u16(gpu.slab(gpu.bf16));
  Mismatches master_bits, master_padding, bf16_bits, bf16_padding;
  double max_rel = 0.0;
  for (size_t i = 0; i < total; ++i) {
    if (pad[i]) {
      master_padding.add(float_bits(master[i]) != float_bits(kMasterPadding), i);
      bf16_padding.add(bf16[i] != kBf16Poison, i);
      continue;
    }
    master_bits.add(float_bits(master[i]) != float_bits(cpu_params[i]), i);
    if (cpu_params[i] != 0.0f)
      max_rel = std::max(max_rel, std::fabs(double(master[i]) - cpu_params[i]) / std::fabs(double(cpu_params[i])));
    bf16_bits.add(bf16[i] != bf16_from_float(master[i]), i);
  }
  {
    std::ostringstream first;
    if (master_bits.count) first << "; first: gpu " << master[master_bits.first] << " cpu " << cpu_params[master_bits.first];
    INFO(master_bits.describe("master") << first.str() << "; max relative difference " << max_rel);
    CHECK(master_bits.count == 0);
    CHECK(max_rel <= 1e-6);
  }
  CHECK(master_padding.count == 0);
  CHECK(bf16_bits.count == 0);
  CHECK(bf16_padding.count == 0);

  if (gpu.precision == OptimizerStatePrecision::fp8_fp16) {
    const std::vector<uint8_t> m8 = gpu.slab(gpu.m8);
    const std::vector<uint16_t> v16 = gpu.slab(gpu.v16);
    Mismatches m_codes, zero_signs, v_bits, padding;
    for (size_t i = 0; i < total; ++i) {
      if (pad[i]) {
        padding.add(m8[i] != kM8Padding || v16[i] != kV16Padding, i);
        continue;
      }
      const uint8_t ref = cpu.m8()[i];
      const bool signed_zero_pair = (m8[i] & 0x7F) == 0 && (ref & 0x7F) == 0;
      m_codes.add(m8[i] != ref && !signed_zero_pair, i);
      zero_signs.add(m8[i] != ref && signed_zero_pair, i);
      v_bits.add(v16[i] != cpu.v16()[i], i);
    }
    {
      std::ostringstream first;
      if (m_codes.count)
        first << "; first: gpu 0x" << std::hex << int(m8[m_codes.first]) << " cpu 0x" << int(cpu.m8()[m_codes.first]);
      INFO(m_codes.describe("m codes") << first.str());
      CHECK(m_codes.count == 0);
    }
    if (zero_signs.count) WARN(zero_signs.describe("E4M3 zero sign (0x00 vs 0x80, same value)"));
    {
      INFO(v_bits.describe("v bits"));
      CHECK(v_bits.count == 0);
    }
    CHECK(padding.count == 0);
    const std::vector<float> m_scales = gpu.m_scales.download(), v_scales = gpu.v_scales.download();
    for (size_t k = 0; k < layout.tensors().size(); ++k) {
      INFO("tensor " << layout.tensors()[k].name << ": m_scale gpu " << m_scales[k] << " cpu " << cpu.m_scales()[k]
                     << ", v_scale gpu " << v_scales[k] << " cpu " << cpu.v_scales()[k]);
      CHECK(float_bits(m_scales[k]) == float_bits(cpu.m_scales()[k]));
      CHECK(float_bits(v_scales[k]) == float_bits(cpu.v_scales()[k]));
    }
  } else {
    const std::vector<float> m32 = gpu.slab(gpu.m32), v32 = gpu.slab(gpu.v32);
    Mismatches m_bits, v_bits, padding;
    for (size_t i = 0; i < total; ++i) {
      if (pad[i]) {
        padding.add(float_bits(m32[i]) != float_bits(kM32Padding) || float_bits(v32[i]) != float_bits(kV32Padding), i);
        continue;
      }
      m_bits.add(float_bits(m32[i]) != float_bits(cpu.m32()[i]), i);
      v_bits.add(float_bits(v32[i]) != float_bits(cpu.v32()[i]), i);
    }
    INFO(m_bits.describe("m") << "; " << v_bits.describe("v"));
    CHECK(m_bits.count == 0);
    CHECK(v_bits.count == 0);
    CHECK(padding.count == 0);
  }
}

// Runs `steps` steps on the GPU and the CPU from the same parameters and compares after
// each. max_norm per step: 0 (clipping off), 1e6 (no clipping), then small (clipping on).
void run_against_cpu(OptimizerStatePrecision precision, size_t shift) {
  const TensorLayout layout = test_layout();
  const AdamWHyperparams hp = test_hyperparams();
  std::vector<float> cpu_params = random_params(layout, 11);
  GpuOptimizer gpu(layout, precision, cpu_params, shift);
  AdamW cpu(layout, precision);
  const double max_norms[] = {0.0, 1e6, 1.0, 5.0, 0.3};

  for (int step = 0; step < 5; ++step) {
    INFO("step " << step << ", max_norm " << max_norms[step]);
    const std::vector<float> grads = random_grads(layout, 100 + step);
    gpu.bf16.fill_bytes(kPoisonByte);  // pure output: every real element must be rewritten
    gpu.step(grads, hp, max_norms[step]);

    const double cpu_sum = grad_sum_of_squares(grads.data(), layout);
    const double cpu_norm = std::sqrt(cpu_sum);
    const float cpu_coeff = clip_coefficient(cpu_norm, max_norms[step]);
    const double gpu_sum = gpu.read_sum();
    const StepControl c = gpu.read_control();
    INFO("sum of squares gpu " << gpu_sum << " cpu " << cpu_sum << "; grad_scale gpu " << c.grad_scale << " cpu "
                               << cpu_coeff);
    CHECK(std::fabs(gpu_sum - cpu_sum) <= 1e-10 * cpu_sum);
    CHECK(std::fabs(double(c.grad_norm) - cpu_norm) <= 1e-6 * cpu_norm);
    CHECK(std::fabs(double(c.grad_scale) - cpu_coeff) <= 1e-6 * cpu_coeff);
    if (max_norms[step] == 0.0 || max_norms[step] == 1e6) CHECK(c.grad_scale == 1.0f);
    if (max_norms[step] == 0.3) CHECK(c.grad_scale < 1.0f);  // clipping really is exercised
    CHECK(c.loss == 2.5f);
    CHECK(c.skip == 0);
    CHECK(c.consecutive_skips == 0);
    CHECK(c.total_skips == 0);
    CHECK(c.step_count == step + 1);

    // The CPU step uses the GPU's coefficient, so AdamW itself is compared bit for bit.
    cpu.step(cpu_params.data(), grads.data(), hp, c.grad_scale);
    REQUIRE(cpu.step_count() == c.step_count);
    check_state(gpu, cpu, cpu_params, step + 1);
  }
}

// The master and the optimizer state of two optimizers, byte for byte.
void check_same_state(const GpuOptimizer& a, const GpuOptimizer& b) {
  CHECK(a.master.download() == b.master.download());
  if (a.precision == OptimizerStatePrecision::fp8_fp16) {
    CHECK(a.m8.download() == b.m8.download());
    CHECK(a.v16.download() == b.v16.download());
    CHECK(a.m_scales.download() == b.m_scales.download());
    CHECK(a.v_scales.download() == b.v_scales.download());
  } else {
    CHECK(a.m32.download() == b.m32.download());
    CHECK(a.v32.download() == b.v32.download());
  }
}

// The distributed optimizer's call (apps/engine.cpp): the master and the state packed in the
// shard, the gradients and the BF16 working values at other offsets (where the in-place
// reduce-scatter leaves them and the in-place all-gather reads them). Tensor k's slab offset
// is its packed offset + (k + 1) * spread: a spread that is a multiple of 4 keeps the vector
// path, another forces the scalar one. The same numbers as the packed call, bit for bit, and
// nothing written, nor read, between the pieces (NaN gradients there).
void run_with_slab_offsets(OptimizerStatePrecision precision, size_t spread) {
  const TensorLayout layout = test_layout();
  TensorLayout slab;
  for (size_t k = 0; k < layout.tensors().size(); ++k) {
    TensorInfo t = layout.tensors()[k];
    t.offset += (k + 1) * spread;
    slab.add_at(t);
  }
  const cuda::DeviceTensorLayout slab_device(slab);
  const AdamWHyperparams hp = test_hyperparams();
  const std::vector<float> params = random_params(layout, 21);
  GpuOptimizer packed(layout, precision, params), sharded(layout, precision, params);
  DeviceBuffer<__nv_bfloat16> slab_bf16;
  slab_bf16.allocate(slab.total_elements());
  slab_bf16.fill_bytes(kPoisonByte);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    const std::vector<float> grads = random_grads(layout, 300 + step);
    packed.step(grads, hp, 1.0);
    std::vector<float> at_slab(slab.total_elements(), NAN);
    for (size_t k = 0; k < layout.tensors().size(); ++k)
      std::copy_n(grads.begin() + ptrdiff_t(layout.tensors()[k].offset), layout.tensors()[k].numel,
                  at_slab.begin() + ptrdiff_t(slab.tensors()[k].offset));
    const DeviceBuffer<float> slab_grads = device_copy(at_slab);
    // The norm and the step control as the packed optimizer had them.
    sharded.grads.upload(grads.data(), grads.size());
    sharded.loss.upload(std::vector<float>{5.0f});
    sync();
    cuda::grad_norm_squared(sharded.sum.data(), sharded.grads.data(), sharded.table(), sharded.norm_scratch.data(),
                            nullptr);
    cuda::finalize_step(sharded.control.data(), sharded.sum.data(), sharded.loss.data(), 2.0f, 1.0, nullptr);
    const uint64_t* offsets = slab_device.table().offsets;
    if (precision == OptimizerStatePrecision::fp8_fp16) {
      cuda::adamw_fp8_fp16_moment_amaxes(slab_grads.data(), sharded.m8.data(), sharded.v16.data(),
                                         sharded.m_scales.data(), sharded.v_scales.data(), sharded.table(), hp,
                                         sharded.control.data(), sharded.scratch.data(), nullptr, offsets);
      cuda::adamw_fp8_fp16_apply(sharded.master.data(), slab_bf16.data(), slab_grads.data(), sharded.m8.data(),
                                 sharded.v16.data(), sharded.m_scales.data(), sharded.v_scales.data(), sharded.table(),
                                 hp, sharded.control.data(), sharded.scratch.data(), nullptr, offsets);
    } else {
      cuda::adamw_step_fp32(sharded.master.data(), slab_bf16.data(), slab_grads.data(), sharded.m32.data(),
                            sharded.v32.data(), sharded.table(), hp, sharded.control.data(), nullptr, offsets);
    }
    sync();
    check_same_state(packed, sharded);
    // The BF16 values at the slab offsets, the packed call's; the poison everywhere else.
    const std::vector<uint16_t> expected = as_u16(packed.bf16.download()), written = as_u16(slab_bf16.download());
    std::vector<uint16_t> want(slab.total_elements(), kBf16Poison);
    for (size_t k = 0; k < layout.tensors().size(); ++k)
      std::copy_n(expected.begin() + ptrdiff_t(layout.tensors()[k].offset), layout.tensors()[k].numel,
                  want.begin() + ptrdiff_t(slab.tensors()[k].offset));
    CHECK(written == want);
  }
}

// The unsharded optimizer of a model whose working copy leaves out the FP8 Linear weights
// (GptModel::working_offsets): the gradients at the table's offsets, the BF16 working values at
// offsets of their own, none for two tensors. Tensor k's working offset is its table offset +
// k * spread (a spread that is a multiple of 4 keeps the vector path). The same numbers as the
// plain call, bit for bit; nothing written for the tensors without a working value.
void run_with_working_offsets(OptimizerStatePrecision precision, size_t spread) {
  const TensorLayout layout = test_layout();
  const size_t count = layout.tensors().size();
  std::vector<uint64_t> offsets(count);
  for (size_t k = 0; k < count; ++k)
    offsets[k] = (k == 0 || k == 4) ? kNoWorkingValue : layout.tensors()[k].offset + k * spread;
  const DeviceBuffer<uint64_t> device_offsets = device_copy(offsets);
  const AdamWHyperparams hp = test_hyperparams();
  const std::vector<float> params = random_params(layout, 23);
  GpuOptimizer plain(layout, precision, params), compact(layout, precision, params);
  DeviceBuffer<__nv_bfloat16> working;
  working.allocate(layout.total_elements() + count * spread);
  working.fill_bytes(kPoisonByte);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    const std::vector<float> grads = random_grads(layout, 400 + step);
    plain.step(grads, hp, 1.0);
    compact.grads.upload(grads.data(), grads.size());
    compact.loss.upload(std::vector<float>{5.0f});
    sync();
    cuda::grad_norm_squared(compact.sum.data(), compact.grads.data(), compact.table(), compact.norm_scratch.data(),
                            nullptr);
    cuda::finalize_step(compact.control.data(), compact.sum.data(), compact.loss.data(), 2.0f, 1.0, nullptr);
    if (precision == OptimizerStatePrecision::fp8_fp16) {
      cuda::adamw_fp8_fp16_moment_amaxes(compact.grads.data(), compact.m8.data(), compact.v16.data(),
                                         compact.m_scales.data(), compact.v_scales.data(), compact.table(), hp,
                                         compact.control.data(), compact.scratch.data(), nullptr);
      cuda::adamw_fp8_fp16_apply(compact.master.data(), working.data(), compact.grads.data(), compact.m8.data(),
                                 compact.v16.data(), compact.m_scales.data(), compact.v_scales.data(), compact.table(),
                                 hp, compact.control.data(), compact.scratch.data(), nullptr, nullptr, nullptr,
                                 nullptr, nullptr, device_offsets.data());
    } else {
      cuda::adamw_step_fp32(compact.master.data(), working.data(), compact.grads.data(), compact.m32.data(),
                            compact.v32.data(), compact.table(), hp, compact.control.data(), nullptr, nullptr,
                            device_offsets.data());
    }
    sync();
    check_same_state(plain, compact);
    const std::vector<uint16_t> expected = as_u16(plain.bf16.download()), written = as_u16(working.download());
    std::vector<uint16_t> want(written.size(), kBf16Poison);
    for (size_t k = 0; k < count; ++k)
      if (offsets[k] != kNoWorkingValue)
        std::copy_n(expected.begin() + ptrdiff_t(layout.tensors()[k].offset), layout.tensors()[k].numel,
                    want.begin() + ptrdiff_t(offsets[k]));
    CHECK(written == want);
  }
}

}  // namespace

TEST_CASE("GPU AdamW with a working copy of its own layout: the same update, working values where it puts them",
          "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  const auto precision = GENERATE(OptimizerStatePrecision::fp8_fp16, OptimizerStatePrecision::fp32);
  const size_t spread = GENERATE(size_t{256}, size_t{257});  // vector path kept; scalar path forced
  INFO(to_string(precision) << ", spread " << spread);
  run_with_working_offsets(precision, spread);
}

TEST_CASE("GPU AdamW with the gradients and the BF16 copy at slab offsets: the packed call's numbers",
          "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  const auto precision = GENERATE(OptimizerStatePrecision::fp8_fp16, OptimizerStatePrecision::fp32);
  const size_t spread = GENERATE(size_t{1024}, size_t{1027});  // vector path kept; scalar path forced
  INFO(to_string(precision) << ", spread " << spread);
  run_with_slab_offsets(precision, spread);
}

TEST_CASE("GPU AdamW fp8_fp16: 5 steps bit-identical to the CPU reference", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  const size_t shift = GENERATE(size_t{0}, size_t{1});  // 1: misaligned slabs, scalar path everywhere
  INFO("slab pointer shift " << shift);
  run_against_cpu(OptimizerStatePrecision::fp8_fp16, shift);
}

TEST_CASE("GPU AdamW fp32: 5 steps bit-identical to the CPU reference", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  const size_t shift = GENERATE(size_t{0}, size_t{1});
  INFO("slab pointer shift " << shift);
  run_against_cpu(OptimizerStatePrecision::fp32, shift);
}

TEST_CASE("GPU gradient norm: CPU agreement, determinism, non-finite gradients", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  TensorLayout layout;
  layout.add("w", {1000, 1003}, true);  // 123 chunks, the last partial
  layout.add("b", {7}, false);
  layout.add("odd", {3, 5}, true, /*alignment=*/1);
  layout.add("x", {3, 8192}, true);
  const TensorInfo& last = layout.tensors().back();
  const cuda::DeviceTensorLayout device_layout(layout);
  const auto& table = device_layout.table();
  REQUIRE(table.num_chunks == 123 + 1 + 1 + 3);

  std::vector<float> grads = random_grads(layout, 7);
  DeviceBuffer<float> d_grads = device_copy(grads);
  DeviceBuffer<double> scratch(cuda::grad_norm_scratch_size(table)), sum(1);
  sum.fill_bytes(kPoisonByte);
  auto run = [&] {
    cuda::grad_norm_squared(sum.data(), d_grads.data(), table, scratch.data(), nullptr);
    sync();
    return sum.download()[0];
  };

  const double cpu = grad_sum_of_squares(grads.data(), layout);
  const double gpu = run();
  INFO("gpu " << gpu << " cpu " << cpu);
  CHECK(std::fabs(gpu - cpu) <= 1e-10 * cpu);
  CHECK(std::fabs(std::sqrt(gpu) - global_grad_norm(grads.data(), layout)) <= 1e-6 * std::sqrt(cpu));
  const double again = run();
  CHECK(std::memcmp(&gpu, &again, sizeof gpu) == 0);  // bit-reproducible

  // Non-finite real elements: NaN stays NaN, inf stays inf (squares are >= 0).
  grads[last.offset + last.numel - 1] = NAN;
  d_grads.upload(grads);
  CHECK(std::isnan(run()));
  grads[last.offset + last.numel - 1] = INFINITY;
  d_grads.upload(grads);
  const double with_inf = run();
  CHECK((std::isinf(with_inf) && with_inf > 0));

  // An empty layout: the sum is 0.
  const TensorLayout empty;
  const cuda::DeviceTensorLayout empty_device(empty);
  cuda::grad_norm_squared(sum.data(), nullptr, empty_device.table(), nullptr, nullptr);
  sync();
  CHECK(sum.download()[0] == 0.0);
}

TEST_CASE("GPU gradient norm in parts: any ranges of tensors, in any order, on any stream, give the one call's bits",
          "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  TensorLayout layout;
  layout.add("w", {1000, 1003}, true);  // 123 chunks
  layout.add("empty", {0}, true);       // a piece held by another rank: no chunk
  layout.add("b", {7}, false);
  layout.add("x", {3, 8192}, true);
  layout.add("y", {5, 4099}, true);
  const cuda::DeviceTensorLayout device_layout(layout);
  const auto& table = device_layout.table();
  std::vector<float> grads = random_grads(layout, 11);
  DeviceBuffer<float> d_grads = device_copy(grads);
  DeviceBuffer<double> scratch(cuda::grad_norm_scratch_size(table)), whole(1), parted(1);
  cuda::grad_norm_squared(whole.data(), d_grads.data(), table, scratch.data(), nullptr);
  sync();
  const double one_call = whole.download()[0];

  cudaStream_t other = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  const auto part = [&](size_t first, size_t end, cudaStream_t stream) {
    cuda::grad_norm_chunks(scratch.data(), d_grads.data(), table, device_layout.first_chunk(first),
                           device_layout.first_chunk(end), stream);
  };
  scratch.fill_bytes(kPoisonByte);
  part(3, 5, other);   // the last buckets first, as a backward reduces them
  part(1, 3, nullptr);
  part(2, 2, other);   // an empty range launches nothing
  part(0, 1, other);
  CUDA_CHECK(cudaStreamSynchronize(other));
  cuda::grad_norm_finish(parted.data(), scratch.data(), table.num_chunks, nullptr);
  sync();
  const double in_parts = parted.download()[0];
  INFO("one call " << one_call << " in parts " << in_parts);
  CHECK(std::memcmp(&one_call, &in_parts, sizeof one_call) == 0);
  CHECK_THROWS(cuda::grad_norm_chunks(scratch.data(), d_grads.data(), table, 2, table.num_chunks + 1, nullptr));
  CUDA_CHECK(cudaStreamDestroy(other));
}

TEST_CASE("finalize_step: clip coefficient, skip decision, counters and step count", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  DeviceBuffer<StepControl> control(1);
  DeviceBuffer<double> sum(1);
  DeviceBuffer<float> loss(1);
  cuda::set_step_control(control.data(), StepControl{}, nullptr);

  struct Case {
    double sum;
    float loss_sum;
    float divisor;
    double max_norm;
    int skip, consecutive, total;
    long long step;
  };
  const Case cases[] = {
      {4.0, 3.0f, 2.0f, 0.0, 0, 0, 0, 1},        // norm 2, clipping off
      {4.0, 3.0f, 2.0f, 1.0, 0, 0, 0, 2},        // clipped: 1 / (2 + 1e-6)
      {0.37, 3.0f, 2.0f, 0.25, 0, 0, 0, 3},      // clipped, inexact coefficient
      {4.0, 3.0f, 2.0f, 10.0, 0, 0, 0, 4},       // below the maximum: 1
      {NAN, 3.0f, 2.0f, 1.0, 1, 1, 1, 4},        // NaN gradient
      {4.0, INFINITY, 2.0f, 1.0, 1, 2, 2, 4},    // inf loss
      {INFINITY, 3.0f, 2.0f, 1.0, 1, 3, 3, 4},   // inf gradient
      {4.0, NAN, 2.0f, 0.0, 1, 4, 4, 4},         // NaN loss, clipping off
      {1e-12, 3.0f, 2.0f, 1.0, 0, 0, 4, 5},      // finite again: the run continues at t = 5
  };
  for (const Case& k : cases) {
    INFO("sum " << k.sum << " loss_sum " << k.loss_sum << " max_norm " << k.max_norm);
    sum.upload(std::vector<double>{k.sum});
    loss.upload(std::vector<float>{k.loss_sum});
    cuda::finalize_step(control.data(), sum.data(), loss.data(), k.divisor, k.max_norm, nullptr);
    sync();
    const StepControl c = control.download()[0];
    const double norm = std::sqrt(k.sum);
    CHECK(c.skip == k.skip);
    CHECK(c.consecutive_skips == k.consecutive);
    CHECK(c.total_skips == k.total);
    CHECK(c.step_count == k.step);
    // NaN payloads may differ between host and device: compare NaN-ness, then bits.
    const float loss_value = k.loss_sum / k.divisor;
    if (std::isnan(loss_value)) {
      CHECK(std::isnan(c.loss));
    } else {
      CHECK(float_bits(c.loss) == float_bits(loss_value));
    }
    if (std::isnan(norm)) {
      CHECK(std::isnan(c.grad_norm));
    } else {
      CHECK(float_bits(c.grad_norm) == float_bits(static_cast<float>(norm)));
    }
    // Same double arithmetic as the CPU (the norm is the exact sqrt of the same double).
    CHECK(float_bits(c.grad_scale) == float_bits(clip_coefficient(norm, k.max_norm)));
  }

  // Restore (checkpoint): the counters continue from the stored values.
  StepControl restored;
  restored.step_count = 100;
  restored.total_skips = 7;
  restored.consecutive_skips = 2;
  cuda::set_step_control(control.data(), restored, nullptr);
  sum.upload(std::vector<double>{1.0});
  loss.upload(std::vector<float>{1.0f});
  cuda::finalize_step(control.data(), sum.data(), loss.data(), 1.0f, 1.0, nullptr);
  sync();
  const StepControl c = control.download()[0];
  CHECK(c.step_count == 101);
  CHECK(c.total_skips == 7);
  CHECK(c.consecutive_skips == 0);
  CHECK(c.grad_scale == clip_coefficient(1.0, 1.0));
}

TEST_CASE("GPU AdamW: a skipped step changes nothing and does not advance t", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  const OptimizerStatePrecision precision =
      GENERATE(OptimizerStatePrecision::fp8_fp16, OptimizerStatePrecision::fp32);
  INFO("precision " << to_string(precision));
  const TensorLayout layout = test_layout();
  const AdamWHyperparams hp = test_hyperparams();
  std::vector<float> cpu_params = random_params(layout, 21);
  GpuOptimizer gpu(layout, precision, cpu_params);
  AdamW cpu(layout, precision);

  for (int step = 0; step < 2; ++step) {
    const std::vector<float> grads = random_grads(layout, 200 + step);
    gpu.step(grads, hp, 1.0);
    cpu.step(cpu_params.data(), grads.data(), hp, gpu.read_control().grad_scale);
  }
  check_state(gpu, cpu, cpu_params, 2);

  // A NaN in one real gradient: skip, nothing changes (the BF16 copy included).
  const std::vector<uint8_t> before = gpu.state_bytes();
  std::vector<float> bad = random_grads(layout, 300);
  bad[layout.find("big")->offset + 1234] = NAN;
  gpu.step(bad, hp, 1.0);
  StepControl c = gpu.read_control();
  CHECK(c.skip == 1);
  CHECK(c.consecutive_skips == 1);
  CHECK(c.total_skips == 1);
  CHECK(c.step_count == 2);
  CHECK(std::isnan(c.grad_norm));
  CHECK((gpu.state_bytes() == before));

  // Finite gradients but a non-finite loss: skipped as well.
  gpu.step(random_grads(layout, 301), hp, 1.0, /*loss_sum=*/INFINITY);
  c = gpu.read_control();
  CHECK(c.skip == 1);
  CHECK(c.consecutive_skips == 2);
  CHECK(c.total_skips == 2);
  CHECK(c.step_count == 2);
  CHECK((gpu.state_bytes() == before));

  // The next finite step is t = 3 on both sides (the CPU never saw the skipped ones).
  const std::vector<float> grads = random_grads(layout, 302);
  gpu.step(grads, hp, 1.0);
  c = gpu.read_control();
  CHECK(c.skip == 0);
  CHECK(c.consecutive_skips == 0);
  CHECK(c.total_skips == 2);
  CHECK(c.step_count == 3);
  cpu.step(cpu_params.data(), grads.data(), hp, c.grad_scale);
  check_state(gpu, cpu, cpu_params, 3);
}

TEST_CASE("GPU AdamW weight casts: the update pass writes the separate cast's codes, transposes and amaxes",
          "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  // Cast: "wte" [37,29] and "odd" [5,3] take the scalar path (29 and 3 columns, odd's offset
  // not a multiple of 4), "big" [97,211] partial tiles, "exact" [2,8192] a row of 128 tiles,
  // "tail" [3,7] stays out (updated by the chunk kernel). States 0..3 with scales that fit,
  // shrink and saturate; amax slots start at values both sides must keep or raise.
  const TensorLayout layout = test_layout();
  const size_t shift = GENERATE(size_t{0}, size_t{1});  // 1: no vectorized path anywhere
  INFO("slab shift " << shift);
  const std::vector<std::pair<const char*, int>> cast_tensors = {{"wte", 0}, {"odd", 1}, {"big", 2}, {"exact", 3}};
  const std::vector<float> fp8_scales_host = {12.5f, 0.75f, 3000.0f, 1.0f};
  const std::vector<float> amax_start = {0.0f, 0.01f, 100.0f, 0.0f};
  const AdamWHyperparams hp = test_hyperparams();
  const std::vector<float> params = random_params(layout, 41);
  GpuOptimizer separate(layout, OptimizerStatePrecision::fp8_fp16, params, shift);
  GpuOptimizer fused(layout, OptimizerStatePrecision::fp8_fp16, params, shift);
  const DeviceBuffer<float> fp8_scales = device_copy(fp8_scales_host);

  struct Operand {
    DeviceBuffer<uint8_t> codes, codes_t;
  };
  auto make_operands = [&](std::vector<Operand>& operands, std::vector<cuda::DeviceWeightCast>* casts) {
    for (const auto& [name, state] : cast_tensors) {
      const TensorInfo& t = *layout.find(name);
      Operand o;
      o.codes = device_copy(std::vector<uint8_t>(t.numel, kPoisonByte));
      o.codes_t = device_copy(std::vector<uint8_t>(t.numel, kPoisonByte));
      if (casts) {
        cuda::DeviceWeightCast w;
        w.codes = o.codes.data();
        w.codes_t = o.codes_t.data();
        w.tensor = int(&t - layout.tensors().data());
        w.state = state;
        w.rows = int(t.shape[0]);
        w.cols = int(t.shape[1]);
        casts->push_back(w);
      }
      operands.push_back(std::move(o));
    }
  };
  std::vector<Operand> separate_operands, fused_operands;
  std::vector<cuda::DeviceWeightCast> casts;
  make_operands(separate_operands, nullptr);
  make_operands(fused_operands, &casts);
  const cuda::DeviceWeightCasts cast_table(casts, int(layout.tensors().size()));

  for (int step = 0; step < 3; ++step) {
    INFO("step " << step << (step == 1 ? " (skipped: a NaN gradient)" : ""));
    std::vector<float> grads = random_grads(layout, 500 + step);
    if (step == 1) grads[layout.find("big")->offset + 17] = NAN;
    DeviceBuffer<float> separate_amax = device_copy(amax_start), fused_amax = device_copy(amax_start);
    separate.step(grads, hp, 1.0);
    for (size_t c = 0; c < cast_tensors.size(); ++c) {
      const TensorInfo& t = *layout.find(cast_tensors[c].first);
      const int state = cast_tensors[c].second;
      cuda::cast_transpose_fp8(separate_operands[c].codes.data(), separate_operands[c].codes_t.data(), GradientRef{},
                               separate_amax.data() + state, separate.master.data() + shift + t.offset,
                               fp8_scales.data() + state, Fp8Dtype::e4m3, int(t.shape[0]), int(t.shape[1]), nullptr,
                               nullptr);
    }
    fused.step(grads, hp, 1.0, 5.0f, 2.0f, {&cast_table.table(), fp8_scales.data(), fused_amax.data()});
    sync();
    CHECK(separate.read_control().skip == (step == 1 ? 1 : 0));
    CHECK((separate.state_bytes() == fused.state_bytes()));
    CHECK(same_bytes(separate_amax.download(), fused_amax.download()));
    for (size_t c = 0; c < cast_tensors.size(); ++c) {
      INFO("tensor " << cast_tensors[c].first);
      CHECK(same_bytes(separate_operands[c].codes.download(), fused_operands[c].codes.download()));
      CHECK(same_bytes(separate_operands[c].codes_t.download(), fused_operands[c].codes_t.download()));
    }
  }
  // The saturating scale did saturate (E4M3's largest code, 448).
  const std::vector<uint8_t> big_codes = fused_operands[2].codes.download();
  CHECK(std::count(big_codes.begin(), big_codes.end(), uint8_t{0x7E}) > 0);
  CHECK(separate.read_control().step_count == 2);
}

TEST_CASE("GPU AdamW's first pass with the norm: the norm kernel's sum and the decided pass's state, bit for bit",
          "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  // Clipped (max norm 1 against gradients of norm ~100), not clipped, and skipped (a NaN).
  const TensorLayout layout = test_layout();
  const size_t shift = GENERATE(size_t{0}, size_t{1});  // 1: every chunk on the scalar path
  INFO("slab shift " << shift);
  const AdamWHyperparams hp = test_hyperparams();
  const std::vector<float> params = random_params(layout, 51);
  GpuOptimizer separate(layout, OptimizerStatePrecision::fp8_fp16, params, shift);
  GpuOptimizer fused(layout, OptimizerStatePrecision::fp8_fp16, params, shift);
  fused.norm_in_first_pass = true;
  const double max_norms[] = {1.0, 1e9, 1.0, 1e9, 1.0};
  for (int step = 0; step < 5; ++step) {
    INFO("step " << step << ", max norm " << max_norms[step] << (step == 2 ? ", a NaN gradient" : ""));
    std::vector<float> grads = random_grads(layout, 600 + step);
    if (step == 2) grads[layout.find("exact")->offset + 99] = NAN;
    separate.step(grads, hp, max_norms[step]);
    fused.step(grads, hp, max_norms[step]);
    const double a = separate.read_sum(), b = fused.read_sum();
    CHECK(std::memcmp(&a, &b, sizeof a) == 0);
    const StepControl ca = separate.read_control(), cb = fused.read_control();
    CHECK(std::memcmp(&ca, &cb, sizeof ca) == 0);
    CHECK((separate.state_bytes() == fused.state_bytes()));
    if (step == 0) CHECK(ca.grad_scale < 1.0f);
    if (step == 1) CHECK(ca.grad_scale == 1.0f);
    if (step == 2) CHECK(ca.skip == 1);
  }
}

TEST_CASE("GPU AdamW fp8_fp16 is bit-reproducible", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  TensorLayout layout;  // many chunks per tensor: many blocks race on each tensor's amax
  layout.add("w", {1000, 1003}, true);
  layout.add("b", {1003}, false);
  layout.add("v", {4097, 129}, true);
  const AdamWHyperparams hp = test_hyperparams();
  const std::vector<float> params = random_params(layout, 31);
  GpuOptimizer a(layout, OptimizerStatePrecision::fp8_fp16, params);
  GpuOptimizer b(layout, OptimizerStatePrecision::fp8_fp16, params);
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> grads = random_grads(layout, 400 + step);
    a.step(grads, hp, 1.0);
    b.step(grads, hp, 1.0);
    const StepControl ca = a.read_control(), cb = b.read_control();
    CHECK(std::memcmp(&ca, &cb, sizeof ca) == 0);
    const double sa = a.read_sum(), sb = b.read_sum();
    CHECK(std::memcmp(&sa, &sb, sizeof sa) == 0);
  }
  CHECK((a.state_bytes() == b.state_bytes()));
}

TEST_CASE("GPU bias corrections match adamw_step_scalars bit for bit", "[gpu][optim]") {
  FP8LM_REQUIRE_GPU();
  std::vector<long long> steps;
  for (long long t = 1; t <= 4096; ++t) steps.push_back(t);
  for (long long t : {10000LL, 12345LL, 100000LL, 999999LL, 10000000LL, 2147483648LL}) steps.push_back(t);
  const int n = static_cast<int>(steps.size());
  DeviceBuffer<long long> d_steps = device_copy(steps);
  DeviceBuffer<float> out(2 * steps.size());
  const float betas[][2] = {{0.9f, 0.95f}, {0.9f, 0.999f}, {0.8f, 0.98f}, {0.0f, 0.5f}, {0.99f, 0.9999f}};
  for (const auto& beta : betas) {
    INFO("beta1 " << beta[0] << " beta2 " << beta[1]);
    out.fill_bytes(kPoisonByte);
    cuda::adamw_bias_corrections(out.data(), d_steps.data(), n, beta[0], beta[1], nullptr);
    sync();
    const std::vector<float> gpu = out.download();
    const AdamWHyperparams hp{.lr = 0.0f, .beta1 = beta[0], .beta2 = beta[1], .eps = 0.0f, .weight_decay = 0.0f};
    Mismatches bc1, bc2;
    for (int i = 0; i < n; ++i) {
      const AdamWStepScalars s = adamw_step_scalars(hp, steps[i], 1.0f, false);
      bc1.add(float_bits(gpu[2 * i]) != float_bits(s.bias_correction1), i);
      bc2.add(float_bits(gpu[2 * i + 1]) != float_bits(s.bias_correction2), i);
    }
    INFO(bc1.describe("1 - beta1^t (index into steps)") << "; " << bc2.describe("1 - beta2^t"));
    CHECK(bc1.count == 0);
    CHECK(bc2.count == 0);
  }
}

namespace {

// GPT-2 XL's parameter layout (d = 1600, 48 layers, vocabulary 50257): 1.56e9 parameters.
TensorLayout gpt2_xl_layout() {
  constexpr int64_t C = 1600, L = 48, V = 50257, T = 1024;
  TensorLayout layout;
  layout.add("wte", {V, C}, true);
  layout.add("wpe", {T, C}, true);
  for (int64_t l = 0; l < L; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    layout.add(h + "ln_1.weight", {C}, false);
    layout.add(h + "ln_1.bias", {C}, false);
    layout.add(h + "attn.c_attn.weight", {C, 3 * C}, true);
    layout.add(h + "attn.c_attn.bias", {3 * C}, false);
    layout.add(h + "attn.c_proj.weight", {C, C}, true);
    layout.add(h + "attn.c_proj.bias", {C}, false);
    layout.add(h + "ln_2.weight", {C}, false);
    layout.add(h + "ln_2.bias", {C}, false);
    layout.add(h + "mlp.c_fc.weight", {C, 4 * C}, true);
    layout.add(h + "mlp.c_fc.bias", {4 * C}, false);
    layout.add(h + "mlp.c_proj.weight", {4 * C, C}, true);
    layout.add(h + "mlp.c_proj.bias", {C}, false);
  }
  layout.add("ln_f.weight", {C}, false);
  layout.add("ln_f.bias", {C}, false);
  return layout;
}

bool first_elements_finite(const float* device, size_t n) {
  std::vector<float> host(n);
  CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (float x : host)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace

// Throughput (hidden: run with "[.bench]" or "[optim][.bench]"). Bytes per parameter
// actually moved: fp8_fp16 27 (pass 1 reads 7, pass 2 reads 11 and writes 9), fp32 30,
// gradient norm 4. Needs ~29 GB of GPU memory.
TEST_CASE("GPU AdamW throughput on 1.5e9 parameters", "[gpu][optim][.bench]") {
  FP8LM_REQUIRE_GPU();
  const TensorLayout layout = gpt2_xl_layout();
  const size_t total = layout.total_elements();
  const double n = static_cast<double>(layout.count_parameters());
  const cuda::DeviceTensorLayout device_layout(layout);
  const auto& table = device_layout.table();
  const size_t count = layout.tensors().size();

  DeviceBuffer<float> master(total), grads(total);
  DeviceBuffer<__nv_bfloat16> bf16(total);
  master.fill_bytes(0x3C);  // 0.0115 everywhere
  grads.fill_bytes(0x3B);   // 0.00286 everywhere
  bf16.fill_bytes(0);
  DeviceBuffer<StepControl> control(1);
  StepControl value;
  value.step_count = 1;  // t = 1, no clipping, not skipped
  cuda::set_step_control(control.data(), value, nullptr);
  const AdamWHyperparams hp = test_hyperparams();
  constexpr int kIterations = 10;

  DeviceBuffer<double> norm_scratch(cuda::grad_norm_scratch_size(table)), sum(1);
  const double norm_ms = time_ms(
      [&] { cuda::grad_norm_squared(sum.data(), grads.data(), table, norm_scratch.data(), nullptr); }, kIterations);
  std::printf("grad_norm_squared: %.0f parameters, %zu tensors: %.3f ms, %.0f GB/s (4 B/param)\n", n, count, norm_ms,
              4.0 * n / norm_ms * 1e-6);

  {
    DeviceBuffer<uint8_t> m8(total);
    DeviceBuffer<uint16_t> v16(total);
    m8.fill_bytes(0);
    v16.fill_bytes(0);
    DeviceBuffer<float> m_scales = device_copy(std::vector<float>(count, 1.0f));
    DeviceBuffer<float> v_scales = device_copy(std::vector<float>(count, 1.0f));
    DeviceBuffer<float> scratch(cuda::adamw_fp8_fp16_scratch_size(table));
    const double ms = time_ms(
        [&] {
          cuda::adamw_step_fp8_fp16(master.data(), bf16.data(), grads.data(), m8.data(), v16.data(), m_scales.data(),
                                    v_scales.data(), table, hp, control.data(), scratch.data(), nullptr);
        },
        kIterations);
    std::printf("adamw_step_fp8_fp16: %.0f parameters: %.3f ms, %.0f GB/s (27 B/param moved)\n", n, ms,
                27.0 * n / ms * 1e-6);
    CHECK(first_elements_finite(master.data(), 4096));
  }
  {
    DeviceBuffer<float> m(total), v(total);
    m.fill_bytes(0);
    v.fill_bytes(0);
    const double ms = time_ms(
        [&] {
          cuda::adamw_step_fp32(master.data(), bf16.data(), grads.data(), m.data(), v.data(), table, hp,
                                control.data(), nullptr);
        },
        kIterations);
    std::printf("adamw_step_fp32:     %.0f parameters: %.3f ms, %.0f GB/s (30 B/param moved)\n", n, ms,
                30.0 * n / ms * 1e-6);
    CHECK(first_elements_finite(master.data(), 4096));
  }
}
