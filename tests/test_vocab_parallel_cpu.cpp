// CPU references of the tensor-parallel restructuring: the residual add folded into the
// LayerNorm (cpu::residual_layernorm_forward) and the vocabulary-parallel cross-entropy in two
// halves (cpu::cross_entropy_partials / cpu::cross_entropy_finish).
//
// Bounds:
// - residual_layernorm_forward is layernorm_forward on a sum computed here by hand in the same
//   order, so it must match bit for bit.
// - Vocabulary-parallel cross-entropy with R = 1 runs the same loops as
//   cross_entropy_forward_backward on the same values: bit for bit. With R = 2, 4 and 8 the
//   logsumexp is assembled from per-slice (max, sum) pairs, which rounds differently from one
//   running sum (a few FP32 ulps of lse). Losses: per row within kLossTol = 1e-6 of
//   max(|lse|, |loss|), lse = loss + target logit (relative to the quantity that carries the
//   rounding: a small loss is the difference of two larger numbers; measured: at most 1.3e-7
//   for V <= 384). For the GPT-2 vocabulary (V = 50257) the bound is kLossTolWideVocab = 2e-6
//   (measured: up to 6.7e-7): there the reference's own sequential FP32 sum of 50257 exponentials
//   is off by up to ~7e-7 of lse against a double-precision sum, while the split's shorter
//   sums are closer to it (~3e-7), so most of the difference is the reference's. dlogits =
//   exp(x - lse) - onehot inherit lse's error as a relative error: within kDlogitsTol = 1e-6 in
//   ||got - ref|| / ||ref|| over the matrix (measured: at most 1.5e-7 here), and
//   padded columns exactly 0.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/loss_mask.h"
#include "layers/cross_entropy.h"
#include "layers/layernorm.h"

namespace {

using Catch::Matchers::WithinRel;

constexpr double kLossTol = 1e-6;
constexpr double kLossTolWideVocab = 2e-6;  // V in the tens of thousands: see the header comment
constexpr double kDlogitsTol = 1e-6;

std::vector<float> random_normal(size_t n, std::mt19937& rng, float stddev = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ||got - ref||_2 / ||ref||_2 in double.
double relative_error(const std::vector<float>& got, const std::vector<float>& ref) {
  REQUIRE(got.size() == ref.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); i++) {
    diff += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// residual + LayerNorm

TEST_CASE("residual layernorm is layernorm of residual + (branch + bias)", "[layernorm][cpu]") {
  std::mt19937 rng(701);
  const int N = 13, C = 40;
  const float eps = 1e-5f;
  const size_t n = static_cast<size_t>(N) * C;
  const std::vector<float> residual = random_normal(n, rng, 1.0f, 0.5f);
  const std::vector<float> branch = random_normal(n, rng, 0.5f);
  const std::vector<float> branch_bias = random_normal(C, rng, 0.1f);
  const std::vector<float> weight = random_normal(C, rng, 0.1f, 1.0f);
  const std::vector<float> bias = random_normal(C, rng, 0.1f);

  for (bool with_bias : {true, false}) {
    for (bool in_place : {false, true}) {
      CAPTURE(with_bias, in_place);
      // By hand: bias into the branch, then the residual.
      std::vector<float> sum(n);
      for (int r = 0; r < N; r++) {
        for (int c = 0; c < C; c++) {
          const size_t i = static_cast<size_t>(r) * C + c;
          sum[i] = residual[i] + (with_bias ? branch[i] + branch_bias[c] : branch[i]);
        }
      }
      std::vector<float> ref(n), ref_mean(N), ref_rstd(N);
      fp8lm::cpu::layernorm_forward(ref.data(), ref_mean.data(), ref_rstd.data(), sum.data(), weight.data(),
                                    bias.data(), N, C, eps);

      std::vector<float> residual_io = residual;  // residual_in, and residual_out when in place
      std::vector<float> residual_out(n, NAN);
      float* r_out = in_place ? residual_io.data() : residual_out.data();
      std::vector<float> out(n, NAN), mean(N, NAN), rstd(N, NAN);
      fp8lm::cpu::residual_layernorm_forward(out.data(), r_out, mean.data(), rstd.data(), residual_io.data(),
                                             branch.data(), with_bias ? branch_bias.data() : nullptr, weight.data(),
                                             bias.data(), N, C, eps);
      CHECK(same_bits(in_place ? residual_io : residual_out, sum));
      if (!in_place) CHECK(same_bits(residual_io, residual));  // residual_in is read only
      CHECK(same_bits(out, ref));
      CHECK(same_bits(mean, ref_mean));
      CHECK(same_bits(rstd, ref_rstd));
    }
  }
}

TEST_CASE("residual layernorm of [1,2,3,4] + [1,0,-1,0] + bias [0,0,1,0]", "[layernorm][cpu]") {
  // residual_out = [2, 2, 3, 4]: mean 2.75, variance (0.5625*2 + 0.0625 + 1.5625)/4 = 0.6875.
  const float residual[4] = {1, 2, 3, 4}, branch[4] = {1, 0, -1, 0}, branch_bias[4] = {0, 0, 1, 0};
  const float weight[4] = {1, 1, 1, 1}, bias[4] = {0, 0, 0, 0};
  float out[4], residual_out[4], mean, rstd;
  fp8lm::cpu::residual_layernorm_forward(out, residual_out, &mean, &rstd, residual, branch, branch_bias, weight,
                                         bias, 1, 4, 0.0f);
  const float expected_residual[4] = {2, 2, 3, 4};
  for (int c = 0; c < 4; c++) CHECK(residual_out[c] == expected_residual[c]);
  CHECK_THAT(mean, WithinRel(2.75f, 1e-6f));
  const float expected_rstd = 1.0f / std::sqrt(0.6875f);
  CHECK_THAT(rstd, WithinRel(expected_rstd, 1e-6f));
  for (int c = 0; c < 4; c++) CHECK_THAT(out[c], WithinRel((expected_residual[c] - 2.75f) * expected_rstd, 1e-6f));
}

TEST_CASE("residual layernorm without a branch normalizes residual_in and writes no residual",
          "[layernorm][cpu]") {
  std::mt19937 rng(702);
  const int N = 5, C = 16;
  const size_t n = static_cast<size_t>(N) * C;
  const std::vector<float> residual = random_normal(n, rng, 1.0f, 0.5f);
  const std::vector<float> weight = random_normal(C, rng, 0.1f, 1.0f);
  const std::vector<float> bias = random_normal(C, rng, 0.1f);
  std::vector<float> ref(n), ref_mean(N), ref_rstd(N);
  fp8lm::cpu::layernorm_forward(ref.data(), ref_mean.data(), ref_rstd.data(), residual.data(), weight.data(),
                                bias.data(), N, C, 1e-5f);
  std::vector<float> out(n), mean(N), rstd(N);
  fp8lm::cpu::residual_layernorm_forward(out.data(), nullptr, mean.data(), rstd.data(), residual.data(), nullptr,
                                         nullptr, weight.data(), bias.data(), N, C, 1e-5f);
  CHECK(same_bits(out, ref));
  CHECK(same_bits(mean, ref_mean));
  CHECK(same_bits(rstd, ref_rstd));

  // A bias with no branch to add it to is a caller's bug.
  CHECK_THROWS_AS(fp8lm::cpu::residual_layernorm_forward(out.data(), nullptr, mean.data(), rstd.data(),
                                                         residual.data(), nullptr, bias.data(), weight.data(),
                                                         bias.data(), N, C, 1e-5f),
                  fp8lm::RuntimeError);
}

// ---------------------------------------------------------------------------------------
// vocabulary-parallel cross-entropy

namespace {

struct VocabProblem {
  int N, V, Vp;
  float dloss;
  std::vector<float> logits;     // [N,Vp]; padded columns hold huge values that must not count
  std::vector<int32_t> targets;  // [N]
};

// Targets include the vocabulary's first and last real columns and both sides of every
// boundary between slices for R = 2, 4 and 8 (multiples of Vp / 8), as far as N allows,
// then random ones.
VocabProblem vocab_problem(int N, int V, int Vp, float dloss, uint32_t seed) {
  std::mt19937 rng(seed);
  VocabProblem p{N, V, Vp, dloss, random_normal(static_cast<size_t>(N) * Vp, rng, 2.0f), {}};
  for (int i = 0; i < N; i++) {
    for (int v = V; v < Vp; v++) p.logits[static_cast<size_t>(i) * Vp + v] = 1e4f;
  }
  p.targets = {0, V - 1};
  for (int boundary = Vp / 8; boundary < V && static_cast<int>(p.targets.size()) + 2 <= N; boundary += Vp / 8) {
    p.targets.push_back(boundary - 1);
    p.targets.push_back(boundary);
  }
  std::uniform_int_distribution<int32_t> any_target(0, V - 1);
  while (static_cast<int>(p.targets.size()) < N) p.targets.push_back(any_target(rng));
  p.targets.resize(N);
  return p;
}

// Columns [r * Vs, (r + 1) * Vs) of the [N,Vp] matrix: [N,Vs].
std::vector<float> slice_columns(const std::vector<float>& logits, int N, int Vp, int Vs, int r) {
  std::vector<float> slice(static_cast<size_t>(N) * Vs);
  for (int i = 0; i < N; i++) {
    std::copy_n(logits.begin() + static_cast<ptrdiff_t>(i) * Vp + static_cast<ptrdiff_t>(r) * Vs, Vs,
                slice.begin() + static_cast<ptrdiff_t>(i) * Vs);
  }
  return slice;
}

struct VocabResult {
  std::vector<float> losses;   // [N], rank 0's (every rank's must be the same bits)
  std::vector<float> dlogits;  // [N,Vp], the R slices put back together
};

// The two halves on R simulated ranks, with the all-gather as a concatenation.
VocabResult run_vocab_parallel(const VocabProblem& p, int R) {
  REQUIRE(p.Vp % R == 0);
  const int Vs = p.Vp / R;
  std::vector<std::vector<float>> slices(R);
  std::vector<float> all_partials;  // [R,N,3]
  for (int r = 0; r < R; r++) {
    slices[r] = slice_columns(p.logits, p.N, p.Vp, Vs, r);
    std::vector<float> partials(static_cast<size_t>(p.N) * 3, NAN);
    fp8lm::cpu::cross_entropy_partials(partials.data(), slices[r].data(), p.targets.data(), p.N, p.V, Vs, r * Vs);
    all_partials.insert(all_partials.end(), partials.begin(), partials.end());
  }
  VocabResult result{{}, std::vector<float>(static_cast<size_t>(p.N) * p.Vp, NAN)};
  for (int r = 0; r < R; r++) {
    std::vector<float> losses(p.N, NAN);
    fp8lm::cpu::cross_entropy_finish(slices[r].data(), losses.data(), all_partials.data(), p.targets.data(), p.N,
                                     p.V, Vs, r * Vs, R, p.dloss);
    if (r == 0) {
      result.losses = losses;
    } else {
      CHECK(same_bits(losses, result.losses));  // one combine order: the same bits on every rank
    }
    for (int i = 0; i < p.N; i++) {
      std::copy_n(slices[r].begin() + static_cast<ptrdiff_t>(i) * Vs, Vs,
                  result.dlogits.begin() + static_cast<ptrdiff_t>(i) * p.Vp + static_cast<ptrdiff_t>(r) * Vs);
    }
  }
  return result;
}

VocabResult run_fused(const VocabProblem& p) {
  VocabResult result{std::vector<float>(p.N), p.logits};
  fp8lm::cpu::cross_entropy_forward_backward(result.dlogits.data(), result.losses.data(), p.targets.data(), p.N, p.V,
                                             p.Vp, p.dloss);
  return result;
}

void check_against_fused(const VocabProblem& p, int R) {
  CAPTURE(p.N, p.V, p.Vp, R, p.dloss);
  const VocabResult ref = run_fused(p);
  const VocabResult got = run_vocab_parallel(p, R);
  if (R == 1) {
    CHECK(same_bits(got.losses, ref.losses));
    CHECK(same_bits(got.dlogits, ref.dlogits));
    return;
  }
  double worst_loss = 0.0;
  for (int i = 0; i < p.N; i++) {
    if (p.targets[i] == fp8lm::kMaskedTarget) {
      CHECK(got.losses[i] == 0.0f);
      continue;
    }
    // The error is a few ulps of lse = loss + target logit: measure it relative to that.
    const double lse = double(ref.losses[i]) + p.logits[static_cast<size_t>(i) * p.Vp + p.targets[i]];
    const double scale = std::max(std::fabs(lse), std::fabs(double(ref.losses[i])));
    worst_loss = std::max(worst_loss, std::fabs(double(got.losses[i]) - ref.losses[i]) / scale);
  }
  const double dlogits_error = relative_error(got.dlogits, ref.dlogits);
  INFO("worst loss error " << worst_loss << ", dlogits relative error " << dlogits_error);
  CHECK(worst_loss <= (p.V > 4096 ? kLossTolWideVocab : kLossTol));
  if (p.dloss == 0.0f) {
    CHECK(same_bits(got.dlogits, p.logits));  // forward only: untouched
  } else {
    CHECK(dlogits_error <= kDlogitsTol);
  }
  size_t nonzero_padding = 0;
  for (size_t k = 0; k < got.dlogits.size(); k++) {
    if (p.dloss != 0.0f && static_cast<int>(k % p.Vp) >= p.V && got.dlogits[k] != 0.0f) nonzero_padding++;
  }
  CHECK(nonzero_padding == 0);
}

}  // namespace

TEST_CASE("vocab-parallel cross-entropy with one rank is the fused reference, bit for bit",
          "[cross_entropy][cpu]") {
  check_against_fused(vocab_problem(37, 300, 384, 1.0f / 37, 801), 1);
  check_against_fused(vocab_problem(37, 384, 384, 0.5f, 802), 1);  // no padding
  check_against_fused(vocab_problem(37, 300, 384, 0.0f, 803), 1);  // forward only
}

TEST_CASE("vocab-parallel cross-entropy over 2 and 4 ranks matches the fused reference", "[cross_entropy][cpu]") {
  // Vp = 384 = 8 * 48: slices of 192 (R = 2) and 96 (R = 4) columns.
  for (int R : {2, 4}) {
    check_against_fused(vocab_problem(37, 300, 384, 1.0f / 37, 810 + R), R);  // last slice partly padding
    check_against_fused(vocab_problem(37, 384, 384, 0.25f, 820 + R), R);      // no padding
    check_against_fused(vocab_problem(37, 300, 384, 0.0f, 830 + R), R);       // forward only
    check_against_fused(vocab_problem(5, 50257, 50304, 0.2f, 840 + R), R);    // GPT-2 vocabulary
  }
  // A slice that is all padding: R = 4 with V = 200 leaves [288, 384) without a real column
  // (and [192, 288) with 8); R = 2 with V = 150 leaves [192, 384) without one.
  check_against_fused(vocab_problem(37, 200, 384, 1.0f / 37, 850), 4);
  check_against_fused(vocab_problem(37, 150, 384, 1.0f / 37, 851), 2);
  // The smallest slices (8 columns), the last four of them all padding.
  check_against_fused(vocab_problem(37, 27, 64, 0.5f, 852), 8);
}

TEST_CASE("masked targets (--eod-mask-loss): loss 0 and a zero gradient row, fused and over 1, 2 and 4 ranks",
          "[cross_entropy][cpu][loss-mask]") {
  for (const float dloss : {0.25f, 0.0f}) {
    CAPTURE(dloss);
    const VocabProblem plain = vocab_problem(37, 300, 384, dloss, 880);
    VocabProblem masked = plain;
    for (int i = 0; i < masked.N; i += 3) masked.targets[i] = fp8lm::kMaskedTarget;  // the first row too
    const VocabResult reference = run_fused(plain), got = run_fused(masked);
    for (int i = 0; i < masked.N; i++) {
      CAPTURE(i);
      const auto row = [&](const VocabResult& r) {
        return std::vector<float>(r.dlogits.begin() + ptrdiff_t(i) * masked.Vp,
                                  r.dlogits.begin() + ptrdiff_t(i + 1) * masked.Vp);
      };
      if (masked.targets[i] == fp8lm::kMaskedTarget) {
        CHECK(got.losses[i] == 0.0f);
        if (dloss != 0.0f) CHECK(row(got) == std::vector<float>(size_t(masked.Vp), 0.0f));
      } else {
        CHECK(same_bits({got.losses[i]}, {reference.losses[i]}));  // the other rows are as without a mask
        CHECK(same_bits(row(got), row(reference)));
      }
      if (dloss == 0.0f) CHECK(same_bits(row(got), row(reference)));  // forward only: the logits untouched
    }
    for (int R : {1, 2, 4}) check_against_fused(masked, R);
  }
}

TEST_CASE("vocab-parallel partials of a slice without real columns are (-inf, 0, 0)", "[cross_entropy][cpu]") {
  const VocabProblem p = vocab_problem(6, 40, 64, 1.0f, 860);
  const int Vs = 16;
  const std::vector<float> slice = slice_columns(p.logits, p.N, p.Vp, Vs, 3);  // columns 48..63 >= V
  std::vector<float> partials(static_cast<size_t>(p.N) * 3, NAN);
  fp8lm::cpu::cross_entropy_partials(partials.data(), slice.data(), p.targets.data(), p.N, p.V, Vs, 3 * Vs);
  for (int i = 0; i < p.N; i++) {
    CHECK(partials[3 * i] == -INFINITY);
    CHECK(partials[3 * i + 1] == 0.0f);
    CHECK(partials[3 * i + 2] == 0.0f);
  }
  // A target lying in a slice is reported by that slice only, as the logit itself.
  const std::vector<float> first = slice_columns(p.logits, p.N, p.Vp, Vs, 0);
  fp8lm::cpu::cross_entropy_partials(partials.data(), first.data(), p.targets.data(), p.N, p.V, Vs, 0);
  for (int i = 0; i < p.N; i++) {
    const int target = p.targets[i];
    CHECK(partials[3 * i + 2] == (target < Vs ? first[static_cast<size_t>(i) * Vs + target] : 0.0f));
  }
}

TEST_CASE("vocab-parallel cross-entropy rejects bad layouts and targets", "[cross_entropy][cpu]") {
  const VocabProblem p = vocab_problem(4, 40, 64, 1.0f, 870);
  std::vector<float> logits = slice_columns(p.logits, p.N, p.Vp, 32, 0);
  std::vector<float> partials(static_cast<size_t>(p.N) * 3 * 2, 0.0f), losses(p.N);
  using fp8lm::RuntimeError;
  CHECK_THROWS_AS(fp8lm::cpu::cross_entropy_partials(partials.data(), logits.data(), p.targets.data(), p.N, p.V, 32,
                                                     16),
                  RuntimeError);  // vocab_begin not a multiple of Vs
  CHECK_THROWS_AS(fp8lm::cpu::cross_entropy_finish(logits.data(), losses.data(), partials.data(), p.targets.data(),
                                                   p.N, 80, 32, 0, 2, 1.0f),
                  RuntimeError);  // V > R * Vs
  CHECK_THROWS_AS(fp8lm::cpu::cross_entropy_finish(logits.data(), losses.data(), partials.data(), p.targets.data(),
                                                   p.N, p.V, 32, 64, 2, 1.0f),
                  RuntimeError);  // rank 2 of 2
  std::vector<int32_t> bad_targets = p.targets;
  bad_targets[1] = p.V;
  CHECK_THROWS_AS(fp8lm::cpu::cross_entropy_partials(partials.data(), logits.data(), bad_targets.data(), p.N, p.V, 32,
                                                     0),
                  RuntimeError);
}
