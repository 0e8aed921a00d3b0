// The small-M GEMM (core/gemm_small_m_cuda.h), the kernel of decoding steps: against the CPU's
// exact FP8/BF16 emulation at the inference model's shapes and epilogues; the rule that sends
// a GEMM to it or to cuBLASLt (a CPU test: the rule is host code); the engine following that
// rule; and a decoder whose steps run it against one whose steps run cuBLASLt.
//
// The bound of the kernel test, per element, from the summation order alone. Every product of
// two E4M3 (or two BF16) values is exact in FP32, so the GPU's and the CPU's FP32 results differ
// only in the order of their additions. A sum of terms t_k computed in any order whose longest
// chain of additions is L is within L * u * sum |t_k| of the exact sum (u = 2^-24, to first
// order). The kernel's chains: one lane's share of K in order (at most K/32 + 16 terms), then 5
// butterfly levels; cpu::gemm_nt's: 8 interleaved partial sums of K/8 terms, then the 8 partials
// and a tail of at most 7. The scaling, the residual and the bias add one rounding each, on
// each side (6 more, and 2 for the second-order terms). So the two FP32 results differ by at most
//   delta = (K/32 + 21 + K/8 + 15 + 8) * u * (|scale| * sum_k |a_k b_k| + |residual| + |bias|)
// and the kernel's BF16 output must be one of the BF16 roundings of the values within delta of
// the CPU's FP32 result: between round_bf16(ref - delta) and round_bf16(ref + delta).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/dtype.h"
#include "core/fp8.h"
#include "core/gemm.h"
#include "core/gemm_cuda.h"
#include "core/gemm_small_m_cuda.h"
#include "core/gpt_config.h"
#include "core/random.h"
#include "core/scaling.h"
#include "layers/gelu.h"
#include "layers/gpt.h"
#include "layers/layernorm.h"
#include "layers/ops_cuda.h"
#include "tests/decoder_testing.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using fp8lm::cuda::DeviceBuffer;
using fp8lm::cuda::GemmArgs;
using fp8lm::cuda::GemmDesc;
using fp8lm::cuda::GemmEngine;
using fp8lm::cuda::GemmType;
using fp8lm::testing::kPoisonByte;
using fp8lm::testing::random_floats;

namespace {

// Operand values for the CPU (exact FP8 or BF16 values), bytes for the GPU, and scale_inv.
struct Operand {
  std::vector<float> values;
  std::vector<uint8_t> bytes;
  float scale_inv = 1.0f;
};

Operand make_operand(const std::vector<float>& x, GemmType type) {
  Operand operand;
  operand.values.resize(x.size());
  if (type == GemmType::e4m3) {
    const float scale = compute_scale(cpu::amax(x.data(), x.size()), fp8_max(Fp8Dtype::e4m3), 0, 1.0f);
    operand.scale_inv = 1.0f / scale;
    cpu::quantize_fp8(operand.values.data(), x.data(), x.size(), scale, Fp8Dtype::e4m3);
    operand.bytes.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) operand.bytes[i] = fp8_encode(x[i] * scale, Fp8Dtype::e4m3);
  } else {
    operand.bytes.resize(2 * x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t bits = bf16_from_float(x[i]);
      operand.values[i] = bf16_to_float(bits);
      std::memcpy(&operand.bytes[2 * i], &bits, 2);
    }
  }
  return operand;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(2 * values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = bf16_from_float(values[i]);
    std::memcpy(&bytes[2 * i], &bits, 2);
  }
  return bytes;
}

// A device buffer holding `bytes` `offset` bytes past a 256-byte-aligned allocation, the
// rest poisoned.
DeviceBuffer<uint8_t> device_bytes(const std::vector<uint8_t>& bytes, size_t offset) {
  DeviceBuffer<uint8_t> buffer(bytes.size() + offset);
  buffer.fill_bytes(kPoisonByte);
  if (!bytes.empty()) buffer.upload(bytes.data(), bytes.size(), offset);
  return buffer;
}

// What the inference model asks of a forward GEMM (layers/gpt.cpp): c_attn adds a bias,
// attn.c_proj and mlp.c_proj a bias and the residual (C != D), c_fc and the LM head nothing.
enum class Epilogue { none, bias, bias_and_residual };
const char* name_of(Epilogue e) {
  return e == Epilogue::none ? "no epilogue" : e == Epilogue::bias ? "bias" : "bias + residual";
}

struct Problem {
  int M, N, K;
  GemmType type;                            // of both operands
  std::optional<cuda::SmallMForm> form{};  // the kernel's form (none: small_m_form's)
};

// Runs the kernel on one problem, for each epilogue, and checks every element against the
// bound in the header comment. D, C and the bias sit 2 bytes past an aligned address (the
// kernel reads and writes them one element at a time), B's scale_inv right after A's (a
// scaling table's contiguous scale_inv array).
// b: the weight [N,K], made once per shape (its quantization is most of the host's work), and
// d_b its bytes on the device.
void check_problem(const Problem& p, const Operand& b, DeviceBuffer<uint8_t>& d_b, uint64_t seed) {
  const size_t mk = size_t(p.M) * p.K, mn = size_t(p.M) * p.N;
  const Operand a = make_operand(random_floats(mk, seed + 1, 1.0f), p.type);
  const float scale = a.scale_inv * b.scale_inv;  // what CpuOps::gemm passes as alpha
  const std::vector<float> bias = testing::bf16_rounded(random_floats(size_t(p.N), seed + 3, 0.5f));
  const std::vector<float> residual = testing::bf16_rounded(random_floats(mn, seed + 4, 1.0f));

  // The CPU's product and, per element, sum_k |a_k b_k| (in double: exact enough for a bound).
  std::vector<float> product(mn);
  cpu::gemm_nt(product.data(), a.values.data(), b.values.data(), p.M, p.N, p.K, scale, false);
  std::vector<double> magnitude(mn, 0.0);
  for (int m = 0; m < p.M; ++m)
    for (int n = 0; n < p.N; ++n) {
      double sum = 0.0;
      const float* a_row = a.values.data() + size_t(m) * p.K;
      const float* b_row = b.values.data() + size_t(n) * p.K;
      for (int k = 0; k < p.K; ++k) sum += std::fabs(double(a_row[k]) * b_row[k]);
      magnitude[size_t(m) * p.N + n] = sum * std::fabs(double(scale));
    }
  const double u = std::ldexp(1.0, -24);
  const double chains = p.K / 32.0 + 21 + p.K / 8.0 + 15 + 8;
  // The tensor-core form sums on mma.sync, a whole k-step at a time, whose E4M3 accumulation keeps
  // about 14 bits (DeepSeek-V3's report on Hopper's FP8 GEMMs, sec. 3.3.2): an error of order
  // 2^-13 of the magnitudes, not of FP32's rounding. Its bound, for both operand types, is 2^-10
  // of sum |a_k b_k| (a fragment in the wrong place errs by order 1).
  const bool tensor_cores = p.form == cuda::SmallMForm::tensor_cores;

  const bool fp8 = p.type == GemmType::e4m3;
  const size_t offset = 2;
  DeviceBuffer<uint8_t> d_a = device_bytes(a.bytes, 0);
  DeviceBuffer<float> d_scale_inv = testing::device_copy(std::vector<float>{a.scale_inv, b.scale_inv});
  DeviceBuffer<uint8_t> d_bias = device_bytes(bf16_bytes(bias), offset);
  DeviceBuffer<uint8_t> d_residual = device_bytes(bf16_bytes(residual), offset);

  for (const Epilogue epilogue : {Epilogue::none, Epilogue::bias, Epilogue::bias_and_residual}) {
    INFO(to_string(p.type) << " M=" << p.M << " N=" << p.N << " K=" << p.K << ", " << name_of(epilogue)
                           << (tensor_cores ? ", tensor cores" : ", FP32 sums"));
    DeviceBuffer<uint8_t> d_out = device_bytes(std::vector<uint8_t>(2 * mn, kPoisonByte), offset);
    GemmDesc desc;
    desc.M = p.M;
    desc.N = p.N;
    desc.K = p.K;
    desc.a_type = desc.b_type = p.type;
    desc.d_type = GemmType::bf16;
    desc.bias_type = GemmType::bf16;
    GemmArgs args;
    args.D = d_out.data() + offset;
    args.A = d_a.data();
    args.B = d_b.data();
    args.a_scale_inv = fp8 ? d_scale_inv.data() : nullptr;
    args.b_scale_inv = fp8 ? d_scale_inv.data() + 1 : nullptr;
    if (epilogue != Epilogue::none) args.bias = d_bias.data() + offset;
    if (epilogue == Epilogue::bias_and_residual) {
      args.C = d_residual.data() + offset;
      args.beta = 1.0f;
    }
    REQUIRE(cuda::small_m_gemm_refusal(desc, args, nullptr, p.form) == nullptr);
    cuda::gemm_small_m(desc, args, nullptr, nullptr, p.form);
    testing::device_sync();
    std::vector<uint8_t> out_bytes = d_out.download();
    std::vector<float> out(mn);
    for (size_t i = 0; i < mn; ++i) {
      uint16_t bits;
      std::memcpy(&bits, &out_bytes[offset + 2 * i], 2);
      out[i] = bf16_to_float(bits);
    }

    size_t outside = 0, not_nearest = 0;
    std::vector<float> reference(mn);
    for (int m = 0; m < p.M; ++m)
      for (int n = 0; n < p.N; ++n) {
        const size_t at = size_t(m) * p.N + n;
        // CpuOps::gemm's epilogue order: the product, + residual, + bias.
        float ref = product[at];
        double scale_of_terms = magnitude[at];
        if (epilogue == Epilogue::bias_and_residual) {
          ref += residual[at];
          scale_of_terms += std::fabs(residual[at]);
        }
        if (epilogue != Epilogue::none) {
          ref += bias[size_t(n)];
          scale_of_terms += std::fabs(bias[size_t(n)]);
        }
        reference[at] = ref;
        const double delta =
            tensor_cores ? std::ldexp(magnitude[at], -10) + 16 * u * scale_of_terms : chains * u * scale_of_terms;
        const float low = round_to_bf16(float(double(ref) - delta)), high = round_to_bf16(float(double(ref) + delta));
        if (!(out[at] >= low && out[at] <= high)) {
          if (outside < 5)
            UNSCOPED_INFO("element [" << m << "," << n << "]: " << out[at] << " outside [" << low << ", " << high
                                      << "] (CPU " << ref << ", delta " << delta << ")");
          ++outside;
        }
        if (out[at] != round_to_bf16(ref)) ++not_nearest;
      }
    INFO(not_nearest << " of " << mn << " elements are not the nearest BF16 of the CPU's FP32 result (allowed "
                     << "within the bound); relative error " << testing::relative_error(out, reference));
    CHECK(outside == 0);
    // The nearest-BF16 rounding alone is within 2^-8 relative; anything of order 1 is a mistake.
    CHECK(testing::relative_error(out, reference) < std::ldexp(1.0, -8));
  }
}

GemmDesc decoding_desc(int M, int N, int K, GemmType type) {
  GemmDesc desc;
  desc.M = M;
  desc.N = N;
  desc.K = K;
  desc.a_type = desc.b_type = type;
  desc.d_type = GemmType::bf16;
  desc.bias_type = GemmType::bf16;
  return desc;
}

// The GELU epilogue (c_fc in a decoding step) against the CPU's: gelu_input = bf16(x) and
// D = gelu(x) (BF16, or E4M3 with d_scale) for x = the scaled product + bias, which the kernel
// has within delta of the CPU's (the header's bound). gelu is evaluated over [x - delta,
// x + delta] (it is not monotone below -0.7518, so that point counts when inside), widened by
// the GPU's tanhf (2 ulp) and the products of its formula; the output must be a rounding of a
// value in that range.
void check_gelu_epilogue(const Problem& p, const Operand& b, DeviceBuffer<uint8_t>& d_b, uint64_t seed) {
  const size_t mk = size_t(p.M) * p.K, mn = size_t(p.M) * p.N;
  const Operand a = make_operand(random_floats(mk, seed + 1, 1.0f), p.type);
  const float scale = a.scale_inv * b.scale_inv;
  const std::vector<float> bias = testing::bf16_rounded(random_floats(size_t(p.N), seed + 3, 0.5f));
  std::vector<float> product(mn);
  cpu::gemm_nt(product.data(), a.values.data(), b.values.data(), p.M, p.N, p.K, scale, false);
  const double u = std::ldexp(1.0, -24);
  const double chains = p.K / 32.0 + 21 + p.K / 8.0 + 15 + 8;
  const bool fp8 = p.type == GemmType::e4m3;
  DeviceBuffer<uint8_t> d_a = device_bytes(a.bytes, 0);
  DeviceBuffer<float> d_scale_inv = testing::device_copy(std::vector<float>{a.scale_inv, b.scale_inv});
  DeviceBuffer<uint8_t> d_bias = device_bytes(bf16_bytes(bias), 0);
  const float d_scale = 16.0f;
  DeviceBuffer<float> d_d_scale = testing::device_scalar(d_scale);
  for (const GemmType d_type : {GemmType::bf16, GemmType::e4m3}) {
    INFO(to_string(p.type) << " M=" << p.M << " N=" << p.N << " K=" << p.K << ", GELU epilogue into "
                           << to_string(d_type));
    DeviceBuffer<uint8_t> d_out = device_bytes(std::vector<uint8_t>(2 * mn, kPoisonByte), 0);
    DeviceBuffer<uint8_t> d_pre = device_bytes(std::vector<uint8_t>(2 * mn, kPoisonByte), 0);
    GemmDesc desc = decoding_desc(p.M, p.N, p.K, p.type);
    desc.d_type = d_type;
    GemmArgs args;
    args.D = d_out.data();
    args.A = d_a.data();
    args.B = d_b.data();
    args.a_scale_inv = fp8 ? d_scale_inv.data() : nullptr;
    args.b_scale_inv = fp8 ? d_scale_inv.data() + 1 : nullptr;
    args.bias = d_bias.data();
    args.gelu_input = d_pre.data();
    if (d_type == GemmType::e4m3) args.d_scale = d_d_scale.data();
    REQUIRE(cuda::small_m_gemm_refusal(desc, args) == nullptr);
    cuda::gemm_small_m(desc, args, nullptr);
    testing::device_sync();
    const std::vector<uint8_t> out_bytes = d_out.download(), pre_bytes = d_pre.download();
    size_t outside_pre = 0, outside_out = 0;
    for (int m = 0; m < p.M; ++m)
      for (int n = 0; n < p.N; ++n) {
        const size_t at = size_t(m) * p.N + n;
        const float x = product[at] + bias[size_t(n)];
        double terms = std::fabs(double(bias[size_t(n)]));
        const float* a_row = a.values.data() + size_t(m) * p.K;
        const float* b_row = b.values.data() + size_t(n) * p.K;
        for (int k = 0; k < p.K; ++k) terms += std::fabs(double(a_row[k]) * b_row[k] * scale);
        const double delta = chains * u * terms;
        uint16_t bits;
        std::memcpy(&bits, &pre_bytes[2 * at], 2);
        const float pre = bf16_to_float(bits);
        if (!(pre >= round_to_bf16(float(x - delta)) && pre <= round_to_bf16(float(x + delta)))) ++outside_pre;

        double low = std::min(cpu::gelu(float(x - delta)), cpu::gelu(float(x + delta)));
        double high = std::max(cpu::gelu(float(x - delta)), cpu::gelu(float(x + delta)));
        if (x - delta < -0.7517916 && x + delta > -0.7517916) low = std::min(low, double(cpu::gelu(-0.7517916f)));
        const double slack = 8 * u * (std::fabs(x) + delta + 1e-3);
        low -= slack;
        high += slack;
        bool inside;
        if (d_type == GemmType::bf16) {
          std::memcpy(&bits, &out_bytes[2 * at], 2);
          const float out = bf16_to_float(bits);
          inside = out >= round_to_bf16(float(low)) && out <= round_to_bf16(float(high));
        } else {
          const float out = fp8_decode(out_bytes[at], Fp8Dtype::e4m3);
          inside = out >= fp8_decode(fp8_encode(float(low * d_scale), Fp8Dtype::e4m3), Fp8Dtype::e4m3) &&
                   out <= fp8_decode(fp8_encode(float(high * d_scale), Fp8Dtype::e4m3), Fp8Dtype::e4m3);
        }
        if (!inside) {
          if (outside_out < 5) UNSCOPED_INFO("element [" << m << "," << n << "]: x " << x << ", output outside");
          ++outside_out;
        }
      }
    CHECK(outside_pre == 0);
    CHECK(outside_out == 0);
  }
}

// The LayerNorm prologue against the two kernels it replaces: layernorm_forward_fp8, then the
// small-M GEMM on its codes. The same bits everywhere: D (and gelu_input under the GELU
// epilogue), the codes that block 0 writes, mean, rstd and the amax.
void check_layernorm_prologue(int M, int N, int C, bool gelu, uint64_t seed) {
  INFO("M=" << M << " N=" << N << " C=" << C << (gelu ? ", GELU epilogue" : ""));
  const size_t mc = size_t(M) * C, mn = size_t(M) * N;
  // A residual stream with an offset and a spread, as a block's input has.
  std::vector<float> x = random_floats(mc, seed, 2.0f);
  for (float& v : x) v += 0.3f;
  DeviceBuffer<uint8_t> d_x = device_bytes(bf16_bytes(x), 0);
  DeviceBuffer<uint8_t> d_w = device_bytes(bf16_bytes(random_floats(size_t(C), seed + 1, 1.0f)), 0);
  DeviceBuffer<uint8_t> d_lb = device_bytes(bf16_bytes(random_floats(size_t(C), seed + 2, 0.2f)), 0);
  const Operand weight = make_operand(random_floats(size_t(N) * C, seed + 3, 0.05f), GemmType::e4m3);
  DeviceBuffer<uint8_t> d_b = device_bytes(weight.bytes, 0);
  DeviceBuffer<uint8_t> d_bias = device_bytes(bf16_bytes(random_floats(size_t(N), seed + 4, 0.5f)), 0);
  // The cast's scale, A's scale_inv (its reciprocal, 16 bytes on), B's scale_inv, D's scale.
  DeviceBuffer<float> d_scales = testing::device_copy(std::vector<float>{32.0f, 0, 0, 0, 1.0f / 32, 0, 0, 0,
                                                                         weight.scale_inv, 0, 0, 0, 8.0f});
  struct Outputs {
    std::vector<uint8_t> d, pre, codes, mean_rstd;
    std::vector<float> amax;
  };
  auto run = [&](bool fused) {
    DeviceBuffer<uint8_t> d_codes = device_bytes(std::vector<uint8_t>(mc, kPoisonByte), 0);
    DeviceBuffer<uint8_t> d_out = device_bytes(std::vector<uint8_t>(mn * (gelu ? 1 : 2), kPoisonByte), 0);
    DeviceBuffer<uint8_t> d_pre = device_bytes(std::vector<uint8_t>(2 * mn, kPoisonByte), 0);
    DeviceBuffer<uint8_t> d_stats = device_bytes(std::vector<uint8_t>(8 * size_t(M), kPoisonByte), 0);
    DeviceBuffer<float> d_amax = testing::device_copy(std::vector<float>{0.25f});
    float* mean = reinterpret_cast<float*>(d_stats.data());
    float* rstd = mean + M;
    GemmDesc desc = decoding_desc(M, N, C, GemmType::e4m3);
    GemmArgs args;
    args.D = d_out.data();
    args.A = d_codes.data();
    args.B = d_b.data();
    args.a_scale_inv = d_scales.data() + 4;
    args.b_scale_inv = d_scales.data() + 8;
    args.bias = d_bias.data();
    if (gelu) {  // c_fc: E4M3 out with its scale
      args.gelu_input = d_pre.data();
      desc.d_type = GemmType::e4m3;
      args.d_scale = d_scales.data() + 12;
    }
    const auto* input = reinterpret_cast<const __nv_bfloat16*>(d_x.data());
    const auto* ln_weight = reinterpret_cast<const __nv_bfloat16*>(d_w.data());
    const auto* ln_bias = reinterpret_cast<const __nv_bfloat16*>(d_lb.data());
    if (fused) {
      const cuda::SmallMLayerNorm prologue{.input = input, .weight = ln_weight, .bias = ln_bias, .eps = 1e-5f,
                                           .scale = d_scales.data(), .amax = d_amax.data(), .mean = mean,
                                           .rstd = rstd};
      REQUIRE(cuda::small_m_gemm_refusal(desc, args, &prologue) == nullptr);
      cuda::gemm_small_m(desc, args, nullptr, &prologue);
    } else {
      cuda::layernorm_forward_fp8(d_codes.data(), d_amax.data(), d_scales.data(), Fp8Dtype::e4m3, mean, rstd, input,
                                  ln_weight, ln_bias, M, C, 1e-5f, nullptr);
      cuda::gemm_small_m(desc, args, nullptr);
    }
    testing::device_sync();
    return Outputs{d_out.download(), d_pre.download(), d_codes.download(), d_stats.download(), d_amax.download()};
  };
  const Outputs fused = run(true), separate = run(false);
  CHECK(fused.codes == separate.codes);
  CHECK(fused.mean_rstd == separate.mean_rstd);
  CHECK(fused.amax == separate.amax);
  CHECK(fused.d == separate.d);
  if (gelu) CHECK(fused.pre == separate.pre);
}

}  // namespace

TEST_CASE("small-M GEMM's GELU epilogue matches the CPU's, into BF16 and E4M3", "[gpu][gemm]") {
  FP8LM_REQUIRE_GPU();
  uint64_t seed = 500;
  for (const GemmType type : {GemmType::e4m3, GemmType::bf16})
    for (const auto& [K, N] : {std::pair{1600, 6400}, std::pair{48, 40}}) {
      const Operand weight = make_operand(random_floats(size_t(N) * K, seed += 10, 0.05f), type);
      DeviceBuffer<uint8_t> d_weight = device_bytes(weight.bytes, 0);
      check_gelu_epilogue({1, N, K, type}, weight, d_weight, seed += 10);  // one row: small_m_gemm_refusal
    }
}

TEST_CASE("small-M GEMM's LayerNorm prologue gives the LayerNorm kernel's and the GEMM's bits", "[gpu][gemm]") {
  FP8LM_REQUIRE_GPU();
  // One row of E4M3 operands: where the prologue runs (small_m_gemm_refusal).
  uint64_t seed = 900;
  for (const bool gelu : {false, true}) {
    check_layernorm_prologue(1, 4800, 1600, gelu, seed += 10);  // ln_1 -> c_attn (ln_2 -> c_fc), gpt2-1558m
    check_layernorm_prologue(1, 3072, 768, gelu, seed += 10);   // gpt2-124m
    check_layernorm_prologue(1, 40, 48, gelu, seed += 10);      // fewer chunks than lanes
  }
}

TEST_CASE("small-M GEMM matches the CPU's exact FP8/BF16 emulation at decoding shapes", "[gpu][gemm]") {
  FP8LM_REQUIRE_GPU();
  // gpt2-1558m's c_attn (K 1600, N 4800), c_fc (1600, 6400) and mlp.c_proj (6400, 1600); an odd
  // N and a K that leaves most lanes without a piece.
  const int shapes[][2] = {{1600, 4800}, {6400, 1600}, {1600, 6400}, {48, 37}, {1600, 1601}};
  uint64_t seed = 100;
  for (const GemmType type : {GemmType::e4m3, GemmType::bf16})
    for (const auto& [K, N] : shapes) {
      const Operand weight = make_operand(random_floats(size_t(N) * K, seed += 10, 0.05f), type);  // weight-like
      DeviceBuffer<uint8_t> d_weight = device_bytes(weight.bytes, 0);
      using cuda::SmallMForm;
      for (const int M : {1, 2, 5, 8})
        check_problem({M, N, K, type, SmallMForm::fp32_sums}, weight, d_weight, seed += 10);
      if (N % 16 == 0 && K % 64 == 0)  // the tensor-core form: every tile count, partial tiles
        for (const int M : {1, 5, 8, 9, 16, 17, 32, 40, 64})
          check_problem({M, N, K, type, SmallMForm::tensor_cores}, weight, d_weight, seed += 10);
    }
}

// The rule is host code: it runs (and is tested) without a GPU.
TEST_CASE("small-M GEMM rule: which GEMMs the kernel takes, and why not the others", "[gemm]") {
  alignas(256) static uint8_t memory[1024];
  GemmArgs args;
  args.A = memory;
  args.B = memory + 256;
  args.D = memory + 512;
  const GemmDesc fp8 = decoding_desc(1, 4800, 1600, GemmType::e4m3);
  CHECK(cuda::small_m_gemm_refusal(fp8, args) == nullptr);
  CHECK(cuda::small_m_gemm_refusal(decoding_desc(8, 37, 48, GemmType::e4m3), args) == nullptr);
  CHECK(cuda::small_m_gemm_refusal(decoding_desc(1, 37, 48, GemmType::bf16), args) == nullptr);
  GemmArgs residual = args;
  residual.C = memory + 768;
  residual.beta = 1.0f;
  residual.bias = memory + 2;  // any alignment: read one element at a time
  CHECK(cuda::small_m_gemm_refusal(fp8, residual) == nullptr);

  auto refused = [&](GemmDesc desc, GemmArgs a) { return cuda::small_m_gemm_refusal(desc, a) != nullptr; };
  auto refused_with = [&](GemmDesc desc, GemmArgs a, cuda::SmallMLayerNorm ln) {
    return cuda::small_m_gemm_refusal(desc, a, &ln) != nullptr;
  };
  // The forms: FP32 sums up to 8 rows; the tensor cores up to 64, with N a multiple of 16 and
  // K whole 64-byte chunks.
  using cuda::SmallMForm;
  auto refusal_in = [&](GemmDesc desc, GemmArgs a, SmallMForm form) {
    return cuda::small_m_gemm_refusal(desc, a, nullptr, form);
  };
  CHECK(refusal_in(decoding_desc(64, 1600, 6400, GemmType::bf16), residual, SmallMForm::tensor_cores) == nullptr);
  CHECK(refusal_in(decoding_desc(9, 1600, 6400, GemmType::bf16), args, SmallMForm::fp32_sums) != nullptr);
  CHECK(refusal_in(decoding_desc(65, 1600, 6400, GemmType::bf16), args, SmallMForm::tensor_cores) != nullptr);
  CHECK(refusal_in(decoding_desc(16, 4808, 1600, GemmType::e4m3), args, SmallMForm::tensor_cores) != nullptr);
  CHECK(refusal_in(decoding_desc(16, 4800, 1632, GemmType::e4m3), args, SmallMForm::tensor_cores) != nullptr);
  CHECK(refusal_in(decoding_desc(16, 4800, 1632, GemmType::bf16), args, SmallMForm::tensor_cores) == nullptr);
  // Which form a GEMM gets: one row the FP32 sums, two to 16 rows of E4M3 the tensor cores (the
  // FP32 sums where only they take it); BF16 one row, or up to 8 of the LM head's vocabulary-wide
  // output; wider, cuBLASLt.
  auto form_of = [&](GemmDesc desc, GemmArgs a) { return cuda::small_m_form(desc, a); };
  CHECK(form_of(decoding_desc(1, 4800, 1600, GemmType::e4m3), args) == SmallMForm::fp32_sums);
  CHECK(form_of(decoding_desc(2, 4800, 1600, GemmType::e4m3), args) == SmallMForm::tensor_cores);
  CHECK(form_of(decoding_desc(16, 4800, 1600, GemmType::e4m3), args) == SmallMForm::tensor_cores);
  CHECK(form_of(decoding_desc(4, 37, 48, GemmType::e4m3), args) == SmallMForm::fp32_sums);
  CHECK(form_of(decoding_desc(1, 4800, 1600, GemmType::bf16), args) == SmallMForm::fp32_sums);
  CHECK(!form_of(decoding_desc(2, 4800, 1600, GemmType::bf16), args));
  CHECK(form_of(decoding_desc(8, 50304, 1600, GemmType::bf16), args) == SmallMForm::fp32_sums);  // the LM head
  CHECK(!form_of(decoding_desc(9, 50304, 1600, GemmType::bf16), args));
  CHECK(!form_of(decoding_desc(17, 4800, 1600, GemmType::e4m3), args));
  CHECK(!form_of(decoding_desc(12, 37, 48, GemmType::e4m3), args));  // no form takes it
  CHECK(cuda::small_m_gemm_refusal(decoding_desc(9, 4800, 1600, GemmType::e4m3), args) == nullptr);
  CHECK(std::string(cuda::small_m_gemm_refusal(decoding_desc(17, 4800, 1600, GemmType::e4m3), args)) ==
        "more rows than the small-M kernel serves faster than cuBLASLt");
  CHECK(refused(decoding_desc(65, 4800, 1600, GemmType::e4m3), args));  // training sizes: M = B x T
  CHECK(refused(decoding_desc(1024, 4800, 1600, GemmType::e4m3), args));
  CHECK(refused(decoding_desc(1, 4800, 1604, GemmType::e4m3), args));  // K not a multiple of 16
  GemmDesc desc = fp8;
  desc.a_type = GemmType::e5m2;  // dgrad's E5M2 gradient
  CHECK(refused(desc, args));
  desc = fp8;
  desc.a_type = GemmType::bf16;  // mixed
  CHECK(refused(desc, args));
  desc = fp8;
  desc.d_type = GemmType::fp32;  // wgrad's FP32 gradient
  CHECK(refused(desc, args));
  desc = fp8;
  desc.a_scaling = cuda::GemmScaling::tiles_1x128;  // --fp8-recipe blockwise
  desc.b_scaling = cuda::GemmScaling::blocks_128x128;
  CHECK(refused(desc, args));
  desc = decoding_desc(1, 4800, 1600, GemmType::bf16);
  desc.b_transposed = true;  // BF16 dgrad reads the weight transposed
  CHECK(refused(desc, args));
  GemmArgs misaligned = args;
  misaligned.B = memory + 8;
  CHECK(refused(fp8, misaligned));
  GemmArgs in_place = args;
  in_place.C = in_place.D;
  in_place.beta = 1.0f;
  CHECK(refused(fp8, in_place));

  // The GELU epilogue (c_fc): a bias, no C, E4M3 D with its scale and no amax.
  GemmArgs gelu = args;
  gelu.bias = memory + 2;
  gelu.gelu_input = memory + 768;
  CHECK(cuda::small_m_gemm_refusal(fp8, gelu) == nullptr);
  CHECK(cuda::small_m_form(fp8, gelu) == SmallMForm::fp32_sums);  // the epilogue is the FP32 form's
  CHECK(refused(decoding_desc(2, 4800, 1600, GemmType::e4m3), gelu));  // more than one row
  CHECK(refused(decoding_desc(16, 4800, 1600, GemmType::e4m3), gelu));
  desc = fp8;
  desc.d_type = GemmType::e4m3;
  CHECK(refused(desc, gelu));  // no d_scale
  const float* some_scale = reinterpret_cast<const float*>(memory + 896);
  gelu.d_scale = some_scale;
  CHECK(cuda::small_m_gemm_refusal(desc, gelu) == nullptr);
  GemmArgs gelu_amax = gelu;
  gelu_amax.d_amax = reinterpret_cast<float*>(memory + 900);  // cuBLASLt's SET amax: not here
  CHECK(refused(desc, gelu_amax));
  GemmArgs gelu_no_bias = gelu;
  gelu_no_bias.bias = nullptr;
  CHECK(refused(desc, gelu_no_bias));
  desc.d_type = GemmType::e4m3;
  CHECK(refused(desc, args));  // an E4M3 D without the GELU epilogue

  // The LayerNorm prologue: one row of E4M3 operands, 16-byte-aligned input, weight and bias,
  // the cast's scale, and a row that fits 48 KB of shared memory, at most 2,048 wide.
  cuda::SmallMLayerNorm layernorm{.input = memory, .weight = memory + 256, .bias = memory + 512, .scale = some_scale};
  CHECK(cuda::small_m_gemm_refusal(fp8, args, &layernorm) == nullptr);
  CHECK(cuda::small_m_form(fp8, args, &layernorm) == SmallMForm::fp32_sums);
  CHECK(refused_with(decoding_desc(2, 4800, 1600, GemmType::e4m3), args, layernorm));
  CHECK(refused_with(decoding_desc(1, 4800, 1600, GemmType::bf16), args, layernorm));
  CHECK(refused_with(decoding_desc(1, 4800, 65536, GemmType::e4m3), args, layernorm));  // 64 KB
  // Wider than 2,048 the separate LayerNorm kernel is the faster (gpt-6.7b's 4,096: call 190).
  CHECK(cuda::small_m_gemm_refusal(decoding_desc(1, 16384, 2048, GemmType::e4m3), args, &layernorm) == nullptr);
  CHECK(refused_with(decoding_desc(1, 16384, 4096, GemmType::e4m3), args, layernorm));
  cuda::SmallMLayerNorm unscaled = layernorm;
  unscaled.scale = nullptr;
  CHECK(refused_with(fp8, args, unscaled));
  cuda::SmallMLayerNorm misaligned_input = layernorm;
  misaligned_input.input = memory + 2;
  CHECK(refused_with(fp8, args, misaligned_input));
}

TEST_CASE("GemmEngine sends decoding GEMMs to the small-M kernel and the rest to cuBLASLt", "[gpu][gemm]") {
  FP8LM_REQUIRE_GPU();
  const int N = 64, K = 64;
  DeviceBuffer<uint8_t> a(80 * size_t(K) * 2), b(size_t(N) * K * 2), d(80 * size_t(N) * 2);
  a.fill_bytes(0);
  b.fill_bytes(0);
  DeviceBuffer<float> scale_inv = testing::device_copy(std::vector<float>(8, 1.0f));
  GemmArgs args;
  args.A = a.data();
  args.B = b.data();
  args.D = d.data();
  auto run = [&](GemmEngine& engine, int M, GemmType type) {
    GemmArgs call = args;
    if (type == GemmType::e4m3) {  // 16 bytes apart, as cuBLASLt wants them
      call.a_scale_inv = scale_inv.data();
      call.b_scale_inv = scale_inv.data() + 4;
    }
    engine.gemm(decoding_desc(M, N, K, type), call, nullptr);
    testing::device_sync();
  };
  GemmEngine engine;
  run(engine, 1, GemmType::e4m3);
  run(engine, 1, GemmType::bf16);
  run(engine, 16, GemmType::e4m3);  // the tensor-core form
  CHECK(engine.small_m_calls() == 3);
  CHECK(engine.cache_size() == 0);  // no cuBLASLt plan was made
  run(engine, 32, GemmType::e4m3);  // the shapes of cuBLASLt's own tests (M a multiple of 16 in FP8)
  run(engine, 2, GemmType::bf16);   // two rows of BF16: cuBLASLt's are the faster
  CHECK(engine.small_m_calls() == 3);
  CHECK(engine.cache_size() == 2);

  GemmEngine cublaslt_only(SmallMGemm::off);
  run(cublaslt_only, 1, GemmType::e4m3);
  CHECK(cublaslt_only.small_m_calls() == 0);
  CHECK(cublaslt_only.cache_size() == 1);
}

TEST_CASE("decoding with the small-M GEMM gives cuBLASLt's logits and greedy tokens", "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  const GptConfig config{.n_layer = 2, .n_head = 4, .n_embd = 128, .n_inner = 512, .vocab_size = 512, .n_positions = 64};
  const int T = 24;
  // FP8 twice: current scaling (the delayed recipe before its first update), and delayed scales
  // as a trained checkpoint brings them, where the producers cast with the stored scale in
  // their own kernels (attention's combining kernel among them) and cuBLASLt's c_fc GEMM writes
  // E4M3 through its GELU epilogue without an amax (AmaxRecording::off_any_plan).
  enum class Variant { bf16, fp8_current, fp8_delayed };
  for (const int B : {1, 5})
    for (const Variant variant : {Variant::bf16, Variant::fp8_current, Variant::fp8_delayed}) {
      const GemmPrecision gemm = variant == Variant::bf16 ? GemmPrecision::bf16 : GemmPrecision::fp8;
      INFO(to_string(gemm) << (variant == Variant::fp8_delayed ? " delayed" : "") << ", batch " << B);
      Random random(7);
      std::vector<int32_t> tokens(size_t(B) * T);
      for (auto& t : tokens) t = int32_t(random.next_u64() % 512);

      // Every step's logits [B, V] of a decoder on the given GEMM path, fed the same tokens.
      auto decode = [&](SmallMGemm small_m) {
        std::unique_ptr<Ops> ops = make_cuda_ops(0, small_m);
        GptModel decoder(config, InferenceShape{.batch = B, .max_prompt = 1, .capacity = T},
                         GptPrecision{.gemm = gemm}, *ops);
        testing::set_random_weights(*ops, decoder, config);
        if (variant == Variant::fp8_delayed) {
          testing::set_stored_activation_scales(*ops, decoder);
          REQUIRE(!decoder.scaling().uses_current_scaling());
        }
        const VocabSlice slice = decoder.vocab_slice();
        std::vector<std::vector<float>> logits;
        for (int t = 0; t < T; ++t) {
          std::vector<int32_t> step(static_cast<size_t>(B));
          for (int b = 0; b < B; ++b) step[size_t(b)] = tokens[size_t(b) * T + t];
          decoder.forward_cached(ops->load_batch(step.data(), step.data(), B, 1, slice), t);
          logits.emplace_back(size_t(B) * slice.size);
          ops->download_values(logits.back().data(), decoder.next_token_logits());
        }
        return std::make_pair(logits, slice);
      };
      const auto [small_m, slice] = decode(SmallMGemm::on);
      const auto [cublaslt, unused] = decode(SmallMGemm::off);

      // Each GEMM output may sit one BF16 step away where the summation orders straddle a
      // rounding boundary (the kernel test above); under FP8 such a step can also move an FP8
      // code of the next operand, or the amax that current scaling takes. Two layers carry that
      // into the logits at well under 1e-2 (BF16) and 4e-2 (FP8), relative; a wrong row, scale
      // or epilogue is of order 1.
      const double bound = variant == Variant::bf16 ? 1e-2 : 4e-2;
      int compared = 0;
      for (int t = 0; t < T; ++t) {
        INFO("step " << t);
        CHECK(testing::relative_error(small_m[size_t(t)], cublaslt[size_t(t)]) < bound);
        // Greedy tokens agree wherever the top logit leads the next by more than the two
        // paths' largest logit difference (random weights leave many near-ties).
        for (int b = 0; b < B; ++b) {
          const float* x = small_m[size_t(t)].data() + size_t(b) * slice.size;
          const float* y = cublaslt[size_t(t)].data() + size_t(b) * slice.size;
          float largest_difference = 0.0f;
          for (int v = 0; v < slice.vocab_size; ++v) largest_difference = std::max(largest_difference, std::fabs(x[v] - y[v]));
          std::vector<float> sorted(y, y + slice.vocab_size);
          std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
          if (sorted[0] - sorted[1] <= 2 * largest_difference) continue;
          ++compared;
          CHECK(std::max_element(x, x + slice.vocab_size) - x == std::max_element(y, y + slice.vocab_size) - y);
        }
      }
      INFO(compared << " of " << B * T << " greedy choices had a clear leader");
      // Identical logits are possible (in BF16 at batch 1 on an H100 every one was: both paths
      // accumulate in FP32 and round once to BF16), so which path ran is checked by the routing
      // test above, which counts cuBLASLt's plans, not here.
    }
}

// Weight bandwidth (hidden: run with "[.bench]" or "[gemm][.bench]"): each GEMM of a gpt2-1558m
// decoding step, its LM head, and four of gpt-6.7b's, on the small-M kernel and on cuBLASLt, at
// M = 1 to 8 (the FP32 form) and 1 to 64 (the tensor-core form).
// Back-to-back calls cycle through copies of the weight that together exceed the 50 MB L2, so
// every call reads its weight from HBM, as a decoding step does (1.47 GB of E4M3 weights). The
// scale_inv pointers sit 16 bytes apart, as in the CUDA backend's scaling state. GB/s counts
// the weight's bytes only.
TEST_CASE("small-M GEMM weight bandwidth against cuBLASLt", "[gpu][gemm][.bench]") {
  FP8LM_REQUIRE_GPU();
  struct Shape {
    const char* name;
    int K, N;
    GemmType type;
  };
  const Shape shapes[] = {{"c_attn", 1600, 4800, GemmType::e4m3},     {"attn.c_proj", 1600, 1600, GemmType::e4m3},
                          {"c_fc", 1600, 6400, GemmType::e4m3},       {"mlp.c_proj", 6400, 1600, GemmType::e4m3},
                          {"c_attn bf16", 1600, 4800, GemmType::bf16}, {"c_fc bf16", 1600, 6400, GemmType::bf16},
                          {"mlp.c_proj bf16", 6400, 1600, GemmType::bf16}, {"lm_head bf16", 1600, 50304, GemmType::bf16},
                          // gpt-6.7b's (width 4096): 4 to 10 times the bytes a GEMM
                          {"6.7b c_attn", 4096, 12288, GemmType::e4m3},     {"6.7b c_fc", 4096, 16384, GemmType::e4m3},
                          {"6.7b mlp.c_proj", 16384, 4096, GemmType::e4m3}, {"6.7b c_fc bf16", 4096, 16384, GemmType::bf16}};
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (const Shape& shape : shapes) {
    const size_t element = cuda::gemm_type_bytes(shape.type);
    const size_t weight_bytes = size_t(shape.N) * shape.K * element;
    const int copies = int(std::max<size_t>(2, (size_t{256} << 20) / weight_bytes));
    DeviceBuffer<uint8_t> weights(weight_bytes * size_t(copies));
    weights.fill_bytes(0x3C);  // finite in both formats: 1.5 in E4M3, 0.0115 in BF16 (0x3C3C)
    const int max_m = 64;
    DeviceBuffer<uint8_t> a(size_t(max_m) * shape.K * element), d(size_t(max_m) * shape.N * 2);
    a.fill_bytes(0x3C);
    DeviceBuffer<float> scale_inv = testing::device_copy(std::vector<float>(8, 1.0f));
    for (const int M : {1, 2, 4, 8, 16, 32, 64}) {
      const GemmDesc desc = decoding_desc(M, shape.N, shape.K, shape.type);
      // The FP32 form, the tensor-core form (each where it takes the problem), and cuBLASLt.
      enum Path { fp32_sums, tensor_cores, cublaslt };
      double us[3] = {0.0, 0.0, 0.0};
      GemmEngine cublaslt_engine(SmallMGemm::off);
      for (const Path path : {fp32_sums, tensor_cores, cublaslt}) {
        const std::optional<cuda::SmallMForm> form =
            path == fp32_sums ? std::optional(cuda::SmallMForm::fp32_sums)
            : path == tensor_cores ? std::optional(cuda::SmallMForm::tensor_cores) : std::nullopt;
        int next = 0;
        auto call = [&] {
          GemmArgs args;
          args.A = a.data();
          args.B = weights.data() + size_t(next) * weight_bytes;
          args.D = d.data();
          if (shape.type == GemmType::e4m3) {
            args.a_scale_inv = scale_inv.data();
            args.b_scale_inv = scale_inv.data() + 4;
          }
          next = (next + 1) % copies;
          if (form) return cuda::gemm_small_m(desc, args, nullptr, nullptr, form);
          cublaslt_engine.gemm(desc, args, nullptr);
        };
        if (form) {
          GemmArgs probe;
          probe.A = a.data();
          probe.B = weights.data();
          probe.D = d.data();
          if (cuda::small_m_gemm_refusal(desc, probe, nullptr, form) != nullptr) continue;
        }
        for (int i = 0; i < copies; ++i) call();  // warm-up: plans, first touch
        constexpr int kCalls = 200;
        CUDA_CHECK(cudaEventRecord(start));
        for (int i = 0; i < kCalls; ++i) call();
        CUDA_CHECK(cudaEventRecord(stop));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        us[path] = 1e3 * double(ms) / kCalls;
      }
      auto column = [&](double t) {
        char text[48];
        if (t == 0.0) return std::string("      -                 ");
        std::snprintf(text, sizeof text, "%7.2f us %6.0f GB/s", t, double(weight_bytes) / (t * 1e3));
        return std::string(text);
      };
      std::printf("%-16s %s M=%-2d K=%d N=%d: FP32 sums %s | tensor cores %s | cuBLASLt %s\n", shape.name,
                  std::string(cuda::to_string(shape.type)).c_str(), M, shape.K, shape.N, column(us[0]).c_str(),
                  column(us[1]).c_str(), column(us[2]).c_str());
    }
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
}
