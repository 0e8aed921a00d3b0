// CPU reference layers: gradients against central finite differences, hand-worked values,
// the write/accumulate contract of each backward, and independence from the thread count.
//
// Finite differences: the objective is sum(dout * forward(x)) with a random dout, computed
// by the FP32 forward and summed in double. Inputs are O(1) and the step is 1e-2, so the
// central difference's truncation error (~step^2 * f''' / 6, about 1e-5) and the FP32
// rounding of the forward divided by the step (about 1e-5) are both far below the tolerance
// of 1e-3 absolute + 1e-2 relative, while a wrong term in a gradient (O(0.1) or more) is not.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/exp_vectorizable.h"
#include "core/gemm.h"
#include "layers/attention.h"
#include "layers/cross_entropy.h"
#include "layers/encoder.h"
#include "layers/gelu.h"
#include "layers/layernorm.h"

namespace {

using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

constexpr float kStep = 1e-2f;
constexpr double kAbsTolerance = 1e-3;
constexpr double kRelTolerance = 1e-2;

std::vector<float> random_normal(size_t n, std::mt19937& rng, float stddev = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

double weighted_sum(const std::vector<float>& weights, const std::vector<float>& values) {
  double sum = 0.0;
  for (size_t i = 0; i < values.size(); i++) sum += static_cast<double>(weights[i]) * values[i];
  return sum;
}

// Runs body with a given OpenMP thread count, restoring the previous one even if it throws.
template <typename Body>
auto with_threads(int threads, Body body) {
  struct RestoreThreads {
    int previous = omp_get_max_threads();
    ~RestoreThreads() { omp_set_num_threads(previous); }
  } restore;
  omp_set_num_threads(threads);
  return body();
}

// d objective / d x[i] by central differences; objective() reads x, which is perturbed in
// place and restored. The step actually taken is measured after rounding to float.
// Runs on one thread: it makes thousands of tiny forward calls, where OpenMP's fork/join
// costs more than the work, and on a loaded machine a descheduled worker stalls every join
// (seconds per test instead of milliseconds).
template <typename Objective>
std::vector<double> central_difference(std::vector<float>& x, Objective objective) {
  return with_threads(1, [&] {
    std::vector<double> gradient(x.size());
    for (size_t i = 0; i < x.size(); i++) {
      const float original = x[i];
      const float plus = original + kStep;
      const float minus = original - kStep;
      x[i] = plus;
      const double objective_plus = objective();
      x[i] = minus;
      const double objective_minus = objective();
      x[i] = original;
      gradient[i] = (objective_plus - objective_minus) / (static_cast<double>(plus) - minus);
    }
    return gradient;
  });
}

// Every element within kAbsTolerance + kRelTolerance * |numeric|; reports the worst one.
void require_gradient_matches(const std::string& name, const std::vector<float>& analytic,
                              const std::vector<double>& numeric) {
  REQUIRE(analytic.size() == numeric.size());
  double worst_ratio = 0.0;
  size_t worst_index = 0;
  for (size_t i = 0; i < analytic.size(); i++) {
    const double allowed = kAbsTolerance + kRelTolerance * std::fabs(numeric[i]);
    const double ratio = std::fabs(analytic[i] - numeric[i]) / allowed;
    // A NaN is the worst there is, and stays reported once found.
    if (!std::isnan(worst_ratio) && (std::isnan(ratio) || ratio > worst_ratio)) {
      worst_ratio = ratio;
      worst_index = i;
    }
  }
  INFO(name << "[" << worst_index << "]: analytic " << analytic[worst_index] << ", numeric "
            << numeric[worst_index] << " (error / allowed = " << worst_ratio << ")");
  REQUIRE(worst_ratio <= 1.0);
}

void require_doubled(const std::string& name, const std::vector<float>& once, const std::vector<float>& twice) {
  REQUIRE(once.size() == twice.size());
  for (size_t i = 0; i < once.size(); i++) {
    INFO(name << "[" << i << "]");
    REQUIRE_THAT(twice[i], WithinRel(2.0f * once[i], 1e-6f));
  }
}

// ---------------------------------------------------------------------------------------
// encoder

struct EncoderProblem {
  int B, T, C, Vp, maxT;
  std::vector<int32_t> tokens;         // [B,T]
  std::vector<float> wte, wpe, dout;  // [Vp,C], [maxT,C], [B,T,C]
  EncoderProblem(std::mt19937& rng, int batch, int tokens_per_row, int channels, int padded_vocab, int max_tokens,
                 std::vector<int32_t> token_ids)
      : B(batch),
        T(tokens_per_row),
        C(channels),
        Vp(padded_vocab),
        maxT(max_tokens),
        tokens(std::move(token_ids)),
        wte(random_normal(size_t(Vp) * C, rng)),
        wpe(random_normal(size_t(maxT) * C, rng)),
        dout(random_normal(size_t(B) * T * C, rng)) {}
  // B=2, T=5, C=8, Vp=6, maxT=7. Token 1 occurs four times and token 3 three times (the
  // scatter-add must sum them all); token 4 never occurs.
  static EncoderProblem small(std::mt19937& rng) {
    return EncoderProblem(rng, 2, 5, 8, 6, 7, {1, 3, 1, 1, 5, 3, 0, 1, 2, 3});
  }

  std::vector<float> forward() const {
    std::vector<float> out(size_t(B) * T * C);
    fp8lm::cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return out;
  }
  void backward(std::vector<float>& dwte, std::vector<float>& dwpe) const {
    fp8lm::cpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  }
};

TEST_CASE("encoder forward adds the token row and the position row", "[layers][cpu]") {
  std::mt19937 rng(101);
  EncoderProblem p = EncoderProblem::small(rng);
  const std::vector<float> out = p.forward();
  for (int b = 0; b < p.B; b++) {
    for (int t = 0; t < p.T; t++) {
      const float* token_row = p.wte.data() + size_t(p.tokens[b * p.T + t]) * p.C;
      const float* position_row = p.wpe.data() + size_t(t) * p.C;
      for (int c = 0; c < p.C; c++) REQUIRE(out[(size_t(b) * p.T + t) * p.C + c] == token_row[c] + position_row[c]);
    }
  }
}

TEST_CASE("encoder backward matches finite differences, repeated tokens included", "[layers][cpu]") {
  std::mt19937 rng(102);
  EncoderProblem p = EncoderProblem::small(rng);
  std::vector<float> dwte(p.wte.size(), 0.0f), dwpe(p.wpe.size(), 0.0f);
  p.backward(dwte, dwpe);

  auto objective = [&] { return weighted_sum(p.dout, p.forward()); };
  require_gradient_matches("dwte", dwte, central_difference(p.wte, objective));
  require_gradient_matches("dwpe", dwpe, central_difference(p.wpe, objective));

  // Token 4 never occurs and positions >= T are unused: their rows receive nothing.
  for (int c = 0; c < p.C; c++) REQUIRE(dwte[size_t(4) * p.C + c] == 0.0f);
  for (size_t i = size_t(p.T) * p.C; i < dwpe.size(); i++) REQUIRE(dwpe[i] == 0.0f);
}

TEST_CASE("encoder backward accumulates into dwte and dwpe", "[layers][cpu]") {
  std::mt19937 rng(103);
  EncoderProblem p = EncoderProblem::small(rng);
  std::vector<float> dwte(p.wte.size(), 0.0f), dwpe(p.wpe.size(), 0.0f);
  p.backward(dwte, dwpe);
  std::vector<float> dwte_twice = dwte, dwpe_twice = dwpe;
  p.backward(dwte_twice, dwpe_twice);
  require_doubled("dwte", dwte, dwte_twice);
  require_doubled("dwpe", dwpe, dwpe_twice);
}

// ---------------------------------------------------------------------------------------
// layernorm

struct LayernormProblem {
  int N, C;
  float eps = 1e-5f;
  std::vector<float> inp, weight, bias, dout;  // [N,C], [C], [C], [N,C]
  LayernormProblem(std::mt19937& rng, int rows, int columns)
      : N(rows),
        C(columns),
        inp(random_normal(size_t(N) * C, rng, 1.0f, 0.5f)),
        weight(random_normal(size_t(C), rng, 0.3f, 1.0f)),
        bias(random_normal(size_t(C), rng, 0.3f)),
        dout(random_normal(size_t(N) * C, rng)) {}

  std::vector<float> forward(std::vector<float>* mean = nullptr, std::vector<float>* rstd = nullptr) const {
    std::vector<float> out(size_t(N) * C), row_mean(N), row_rstd(N);
    fp8lm::cpu::layernorm_forward(out.data(), row_mean.data(), row_rstd.data(), inp.data(), weight.data(),
                                  bias.data(), N, C, eps);
    if (mean) *mean = row_mean;
    if (rstd) *rstd = row_rstd;
    return out;
  }
  struct Gradients {
    std::vector<float> dinp, dweight, dbias;
  };
  // Accumulates into g.
  void backward(Gradients& g) const {
    std::vector<float> mean, rstd;
    forward(&mean, &rstd);
    fp8lm::cpu::layernorm_backward(g.dinp.data(), g.dweight.data(), g.dbias.data(), dout.data(), inp.data(),
                                   weight.data(), mean.data(), rstd.data(), N, C);
  }
  Gradients zero_gradients() const {
    return {std::vector<float>(inp.size()), std::vector<float>(C), std::vector<float>(C)};
  }
};

TEST_CASE("layernorm of [1,2,3,4] with weight 1 and bias 0", "[layers][cpu]") {
  const float inp[4] = {1, 2, 3, 4}, weight[4] = {1, 1, 1, 1}, bias[4] = {0, 0, 0, 0};
  float out[4], mean, rstd;
  // eps = 0 so the hand-worked values are exact: mean 2.5, variance 1.25.
  fp8lm::cpu::layernorm_forward(out, &mean, &rstd, inp, weight, bias, 1, 4, 0.0f);
  REQUIRE_THAT(mean, WithinRel(2.5f, 1e-6f));
  REQUIRE_THAT(rstd, WithinRel(0.8944272f, 1e-6f));  // 1/sqrt(1.25)
  const float expected[4] = {-1.3416408f, -0.4472136f, 0.4472136f, 1.3416408f};
  for (int c = 0; c < 4; c++) REQUIRE_THAT(out[c], WithinRel(expected[c], 1e-6f));

  // Weight and bias apply per column after normalising.
  const float weight2[4] = {2, 2, 2, 2}, bias2[4] = {1, 1, 1, 1};
  fp8lm::cpu::layernorm_forward(out, &mean, &rstd, inp, weight2, bias2, 1, 4, 0.0f);
  for (int c = 0; c < 4; c++) REQUIRE_THAT(out[c], WithinRel(2.0f * expected[c] + 1.0f, 1e-6f));
}

TEST_CASE("layernorm backward matches finite differences", "[layers][cpu]") {
  std::mt19937 rng(201);
  LayernormProblem p(rng, 4, 16);
  LayernormProblem::Gradients g = p.zero_gradients();
  p.backward(g);

  auto objective = [&] { return weighted_sum(p.dout, p.forward()); };
  require_gradient_matches("dinp", g.dinp, central_difference(p.inp, objective));
  require_gradient_matches("dweight", g.dweight, central_difference(p.weight, objective));
  require_gradient_matches("dbias", g.dbias, central_difference(p.bias, objective));
}

TEST_CASE("layernorm backward accumulates into dinp, dweight and dbias", "[layers][cpu]") {
  std::mt19937 rng(202);
  LayernormProblem p(rng, 5, 12);
  LayernormProblem::Gradients once = p.zero_gradients();
  p.backward(once);
  LayernormProblem::Gradients twice = once;
  p.backward(twice);
  require_doubled("dinp", once.dinp, twice.dinp);
  require_doubled("dweight", once.dweight, twice.dweight);
  require_doubled("dbias", once.dbias, twice.dbias);
}

// ---------------------------------------------------------------------------------------
// attention

struct AttentionProblem {
  int B, T, NH, HS, C;
  std::vector<float> qkv, dout;  // [B,T,3C], [B,T,C]
  AttentionProblem(std::mt19937& rng, int batch, int tokens, int heads, int head_size)
      : B(batch),
        T(tokens),
        NH(heads),
        HS(head_size),
        C(heads * head_size),
        qkv(random_normal(size_t(B) * T * 3 * C, rng)),
        dout(random_normal(size_t(B) * T * C, rng)) {}

  std::vector<float> forward(std::vector<float>* lse = nullptr) const {
    std::vector<float> out(size_t(B) * T * C), row_lse(size_t(B) * NH * T);
    fp8lm::cpu::attention_forward(out.data(), row_lse.data(), qkv.data(), nullptr, B, T, C, NH);
    if (lse) *lse = row_lse;
    return out;
  }
  // Writes into dqkv (resized to [B,T,3C], keeping whatever it held).
  void backward(std::vector<float>& dqkv) const {
    std::vector<float> lse;
    const std::vector<float> out = forward(&lse);
    dqkv.resize(qkv.size());
    fp8lm::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), nullptr, B, T, C, NH);
  }
};

TEST_CASE("attention backward matches finite differences in q, k and v", "[layers][cpu]") {
  std::mt19937 rng(301);
  AttentionProblem p(rng, 2, 7, 2, 8);  // T = 7: not a power of two
  std::vector<float> dqkv;
  p.backward(dqkv);

  auto objective = [&] { return weighted_sum(p.dout, p.forward()); };
  require_gradient_matches("dqkv", dqkv, central_difference(p.qkv, objective));
}

TEST_CASE("attention with one token returns v, and lse = q.k / sqrt(HS)", "[layers][cpu]") {
  std::mt19937 rng(302);
  AttentionProblem p(rng, 2, 1, 2, 8);
  std::vector<float> lse;
  const std::vector<float> out = p.forward(&lse);
  for (int b = 0; b < p.B; b++) {
    const float* row = p.qkv.data() + size_t(b) * 3 * p.C;
    for (int h = 0; h < p.NH; h++) {
      double qk = 0.0;
      for (int i = 0; i < p.HS; i++) qk += double(row[h * p.HS + i]) * row[p.C + h * p.HS + i];
      REQUIRE_THAT(lse[size_t(b) * p.NH + h], WithinAbs(qk / std::sqrt(double(p.HS)), 1e-5));
      for (int i = 0; i < p.HS; i++) REQUIRE(out[size_t(b) * p.C + h * p.HS + i] == row[2 * p.C + h * p.HS + i]);
    }
  }
}

TEST_CASE("attention is causal: output at t ignores q, k, v at later positions", "[layers][cpu]") {
  std::mt19937 rng(303);
  AttentionProblem p(rng, 2, 7, 2, 8);
  std::vector<float> lse_before;
  const std::vector<float> out_before = p.forward(&lse_before);

  const int last_unchanged = 3;
  for (int b = 0; b < p.B; b++)
    for (int t = last_unchanged + 1; t < p.T; t++)
      for (int j = 0; j < 3 * p.C; j++) p.qkv[(size_t(b) * p.T + t) * 3 * p.C + j] += 5.0f;
  std::vector<float> lse_after;
  const std::vector<float> out_after = p.forward(&lse_after);

  for (int b = 0; b < p.B; b++) {
    for (int t = 0; t < p.T; t++) {
      bool row_unchanged = true;
      for (int c = 0; c < p.C; c++) {
        const size_t i = (size_t(b) * p.T + t) * p.C + c;
        row_unchanged = row_unchanged && out_before[i] == out_after[i];
      }
      for (int h = 0; h < p.NH; h++) {
        const size_t i = (size_t(b) * p.NH + h) * p.T + t;
        row_unchanged = row_unchanged && lse_before[i] == lse_after[i];
      }
      INFO("b=" << b << " t=" << t);
      REQUIRE(row_unchanged == (t <= last_unchanged));
    }
  }
}

TEST_CASE("attention backward writes dqkv rather than accumulating", "[layers][cpu]") {
  std::mt19937 rng(304);
  AttentionProblem p(rng, 1, 5, 2, 4);
  std::vector<float> from_zero(p.qkv.size(), 0.0f);
  p.backward(from_zero);
  std::vector<float> from_garbage(p.qkv.size(), 123.0f);
  p.backward(from_garbage);
  p.backward(from_garbage);  // a second call must not double it either
  REQUIRE(from_garbage == from_zero);
}

// ---------------------------------------------------------------------------------------
// gelu

TEST_CASE("gelu hand-worked values", "[layers][cpu]") {
  REQUIRE(fp8lm::cpu::gelu(0.0f) == 0.0f);
  REQUIRE_THAT(fp8lm::cpu::gelu(1.0f), WithinAbs(0.841192, 1e-6));
  REQUIRE_THAT(fp8lm::cpu::gelu(-1.0f), WithinAbs(-0.158808, 1e-6));
  REQUIRE_THAT(fp8lm::cpu::gelu(2.0f), WithinAbs(1.954598, 1e-6));
  REQUIRE_THAT(fp8lm::cpu::gelu_derivative(0.0f), WithinAbs(0.5, 1e-7));
  // Far out it is the identity on the right and zero on the left.
  REQUIRE_THAT(fp8lm::cpu::gelu(10.0f), WithinRel(10.0f, 1e-6f));
  REQUIRE_THAT(fp8lm::cpu::gelu(-10.0f), WithinAbs(0.0, 1e-6));
  REQUIRE_THAT(fp8lm::cpu::gelu_derivative(10.0f), WithinAbs(1.0, 1e-6));
  REQUIRE_THAT(fp8lm::cpu::gelu_derivative(-10.0f), WithinAbs(0.0, 1e-6));
}

TEST_CASE("gelu backward matches finite differences and writes dinp", "[layers][cpu]") {
  std::mt19937 rng(401);
  const size_t N = 200;
  std::vector<float> inp = random_normal(N, rng, 2.0f), dout = random_normal(N, rng);
  std::vector<float> out(N), dinp(N, 123.0f);  // prefilled: backward must overwrite, not add
  fp8lm::cpu::gelu_forward(out.data(), inp.data(), N);
  for (size_t i = 0; i < N; i++) REQUIRE(out[i] == fp8lm::cpu::gelu(inp[i]));
  fp8lm::cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), N);

  auto objective = [&] {
    fp8lm::cpu::gelu_forward(out.data(), inp.data(), N);
    return weighted_sum(dout, out);
  };
  require_gradient_matches("dinp", dinp, central_difference(inp, objective));
}

// ---------------------------------------------------------------------------------------
// cross entropy

struct CrossEntropyProblem {
  int N = 4, V = 10, Vp = 16;
  float dloss = 0.37f;
  std::vector<int32_t> targets{3, 0, 9, 3};  // [N]
  std::vector<float> logits;                 // [N,Vp]
  explicit CrossEntropyProblem(std::mt19937& rng) : logits(random_normal(size_t(N) * Vp, rng, 2.0f)) {
    // Huge padded logits: were they part of the softmax, they would dominate it.
    for (int i = 0; i < N; i++)
      for (int v = V; v < Vp; v++) logits[size_t(i) * Vp + v] = 1e4f;
  }
  std::vector<float> losses(std::vector<float> logits_copy, float scale) const {
    std::vector<float> row_losses(N);
    fp8lm::cpu::cross_entropy_forward_backward(logits_copy.data(), row_losses.data(), targets.data(), N, V, Vp,
                                               scale);
    return row_losses;
  }
};

TEST_CASE("cross entropy of uniform logits is log(V)", "[layers][cpu]") {
  const int N = 2, V = 7, Vp = 8;
  std::vector<float> logits(size_t(N) * Vp, 3.25f);
  const std::vector<int32_t> targets{0, 6};
  std::vector<float> losses(N);
  fp8lm::cpu::cross_entropy_forward_backward(logits.data(), losses.data(), targets.data(), N, V, Vp, 1.0f);
  for (int i = 0; i < N; i++) {
    REQUIRE_THAT(losses[i], WithinRel(std::log(float(V)), 1e-6f));
    for (int v = 0; v < V; v++) {
      const float expected = 1.0f / V - (v == targets[i] ? 1.0f : 0.0f);
      REQUIRE_THAT(logits[size_t(i) * Vp + v], WithinAbs(expected, 1e-6));
    }
    REQUIRE(logits[size_t(i) * Vp + V] == 0.0f);
  }
}

TEST_CASE("cross entropy dlogits matches finite differences of the loss", "[layers][cpu]") {
  std::mt19937 rng(501);
  CrossEntropyProblem p(rng);
  std::vector<float> dlogits = p.logits;
  std::vector<float> losses(p.N);
  fp8lm::cpu::cross_entropy_forward_backward(dlogits.data(), losses.data(), p.targets.data(), p.N, p.V, p.Vp,
                                             p.dloss);
  REQUIRE(losses == p.losses(p.logits, 0.0f));  // the backward pass reports the same losses

  // objective = dloss * sum_i loss_i
  auto objective = [&] {
    double sum = 0.0;
    for (float loss : p.losses(p.logits, 0.0f)) sum += loss;
    return p.dloss * sum;
  };
  const std::vector<double> numeric = central_difference(p.logits, objective);
  require_gradient_matches("dlogits", dlogits, numeric);

  // Padded columns: gradient exactly zero, and the loss does not depend on them at all.
  for (int i = 0; i < p.N; i++) {
    for (int v = p.V; v < p.Vp; v++) {
      REQUIRE(dlogits[size_t(i) * p.Vp + v] == 0.0f);
      REQUIRE(numeric[size_t(i) * p.Vp + v] == 0.0);
    }
  }
}

TEST_CASE("cross entropy forward-only (dloss = 0) leaves the logits untouched", "[layers][cpu]") {
  std::mt19937 rng(502);
  CrossEntropyProblem p(rng);
  std::vector<float> logits = p.logits;
  std::vector<float> losses(p.N);
  fp8lm::cpu::cross_entropy_forward_backward(logits.data(), losses.data(), p.targets.data(), p.N, p.V, p.Vp, 0.0f);
  REQUIRE(std::memcmp(logits.data(), p.logits.data(), logits.size() * sizeof(float)) == 0);
  for (int i = 0; i < p.N; i++) {
    // Independent double-precision loss over the first V columns.
    const float* row = p.logits.data() + size_t(i) * p.Vp;
    const double max_logit = *std::max_element(row, row + p.V);
    double sum = 0.0;
    for (int v = 0; v < p.V; v++) sum += std::exp(double(row[v]) - max_logit);
    REQUIRE_THAT(losses[i], WithinAbs(max_logit + std::log(sum) - row[p.targets[i]], 1e-5));
  }
}

TEST_CASE("the loss's exponential is within 1.25 ulp of e^x over the float range, with IEEE's special values",
          "[layers][cpu]") {
  using fp8lm::cpu::exp_vectorizable;
  // Every 61st float in [-110, 89] (about 17 million values, from 0 and the smallest
  // subnormal results up to overflow), each against e^x in double. An ulp is the spacing of
  // floats at the exact result (2^-149 among the subnormals).
  double worst_ulps = 0.0;
  float worst_x = 0.0f;
  auto check = [&](float x) {
    const double exact = std::exp(double(x));
    const float result = exp_vectorizable(x);
    const float rounded = float(exact);
    const double ulp = rounded < 0x1p-126f ? 0x1p-149 : double(std::nextafter(rounded, INFINITY) - rounded);
    const double ulps = std::fabs(double(result) - exact) / ulp;
    if (ulps > worst_ulps) worst_ulps = ulps, worst_x = x;
  };
  for (uint32_t bits = 0; bits <= std::bit_cast<uint32_t>(89.0f); bits += 61) check(std::bit_cast<float>(bits));
  for (uint32_t bits = 0x80000000u; bits <= std::bit_cast<uint32_t>(-110.0f); bits += 61) check(std::bit_cast<float>(bits));
  INFO("worst at x = " << worst_x);
  REQUIRE(worst_ulps <= 1.25);
  REQUIRE(exp_vectorizable(0.0f) == 1.0f);
  REQUIRE(exp_vectorizable(-0.0f) == 1.0f);
  REQUIRE(exp_vectorizable(1.0f) == std::exp(1.0f));
  REQUIRE(exp_vectorizable(-INFINITY) == 0.0f);
  REQUIRE(exp_vectorizable(-1e30f) == 0.0f);
  REQUIRE(exp_vectorizable(INFINITY) == INFINITY);
  REQUIRE(exp_vectorizable(89.0f) == INFINITY);
  REQUIRE(exp_vectorizable(88.72f) < INFINITY);
  REQUIRE(std::isnan(exp_vectorizable(NAN)));
  REQUIRE(exp_vectorizable(-103.0f) > 0.0f);  // subnormal, not flushed
}

// The definition of cpu::gemm_nt's sums (core/gemm.cpp), term by term: 8 interleaved partial
// sums over k, the partials in order from 0.0f, then the K % 8 tail.
float ordered_dot(const float* a, const float* b, int K) {
  float partial[8] = {};
  const int vector_end = K / 8 * 8;
  for (int k = 0; k < vector_end; k += 8)
    for (int lane = 0; lane < 8; ++lane) partial[lane] += a[k + lane] * b[k + lane];
  float sum = 0.0f;
  for (float p : partial) sum += p;
  for (int k = vector_end; k < K; ++k) sum += a[k] * b[k];
  return sum;
}

TEST_CASE("cpu::gemm_nt sums every dot product in its defined order, for any shape and thread count",
          "[layers][cpu]") {
  std::mt19937 rng(701);
  struct Shape { int M, N, K; };
  // Short K (one pass), ragged N (a partly filled panel), K with a tail, and a long K that runs
  // in passes with the partial sums parked in between (the LM head's dgrad).
  const Shape shapes[] = {{1, 1, 1}, {3, 5, 7}, {4, 8, 64}, {9, 13, 67}, {65, 66, 200}, {5, 17, 4100 + 3}, {2, 9, 9000}};
  for (const Shape& shape : shapes) {
    for (const bool accumulate : {false, true}) {
      const std::vector<float> A = random_normal(size_t(shape.M) * shape.K, rng);
      const std::vector<float> B = random_normal(size_t(shape.N) * shape.K, rng);
      const std::vector<float> C0 = random_normal(size_t(shape.M) * shape.N, rng);
      const float alpha = 0.37f;
      std::vector<float> expected = C0;
      for (int i = 0; i < shape.M; ++i)
        for (int j = 0; j < shape.N; ++j) {
          const float dot = alpha * ordered_dot(&A[size_t(i) * shape.K], &B[size_t(j) * shape.K], shape.K);
          float& out = expected[size_t(i) * shape.N + j];
          out = accumulate ? out + dot : dot;
        }
      for (const int threads : {1, 2, 3}) {
        std::vector<float> C = C0;
        with_threads(threads, [&] {
          fp8lm::cpu::gemm_nt(C.data(), A.data(), B.data(), shape.M, shape.N, shape.K, alpha, accumulate);
          return 0;
        });
        INFO("M " << shape.M << " N " << shape.N << " K " << shape.K << " accumulate " << accumulate << " threads "
                  << threads);
        REQUIRE(std::memcmp(C.data(), expected.data(), C.size() * sizeof(float)) == 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// determinism: the reductions must give bit-identical results for any thread count

TEST_CASE("backward reductions do not depend on the thread count", "[layers][cpu]") {
  std::mt19937 rng(601);

  // Enough columns for several blocks, and many repeats of few tokens.
  LayernormProblem layernorm(rng, 64, 200);
  auto layernorm_gradients = [&] {
    LayernormProblem::Gradients g = layernorm.zero_gradients();
    layernorm.backward(g);
    return g;
  };
  const auto layernorm_1 = with_threads(1, layernorm_gradients);
  const auto layernorm_3 = with_threads(3, layernorm_gradients);
  REQUIRE(layernorm_1.dinp == layernorm_3.dinp);
  REQUIRE(layernorm_1.dweight == layernorm_3.dweight);
  REQUIRE(layernorm_1.dbias == layernorm_3.dbias);

  std::vector<int32_t> few_tokens(4 * 7);  // [4,7], five distinct tokens
  for (size_t i = 0; i < few_tokens.size(); i++) few_tokens[i] = int32_t((i * 7) % 5);
  EncoderProblem encoder(rng, 4, 7, 130, 5, 7, few_tokens);
  auto encoder_gradients = [&] {
    std::vector<float> dwte(size_t(encoder.Vp) * encoder.C), dwpe(size_t(encoder.maxT) * encoder.C);
    encoder.backward(dwte, dwpe);
    return std::make_pair(dwte, dwpe);
  };
  REQUIRE(with_threads(1, encoder_gradients) == with_threads(3, encoder_gradients));

  AttentionProblem attention(rng, 2, 9, 3, 4);
  auto attention_gradients = [&] {
    std::vector<float> dqkv;
    attention.backward(dqkv);
    return dqkv;
  };
  REQUIRE(with_threads(1, attention_gradients) == with_threads(3, attention_gradients));
}

}  // namespace
