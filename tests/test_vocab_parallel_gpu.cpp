// Vocabulary-parallel cross-entropy on the GPU (cuda::cross_entropy_partials and
// cuda::cross_entropy_finish), with R ranks simulated on one GPU: each rank's slice of the
// logits is its own buffer, and the all-gather of the partials is a host concatenation.
//
// Bounds (conventions as tests/test_fused_kernels_gpu.cpp: BF16-rounded inputs, poisoned
// outputs, relative error ||gpu - ref|| / ||ref||):
// - R = 1 (vocab_begin 0, Vs = Vp): losses and dlogits bit-identical to the fused
//   cuda::cross_entropy_forward_backward (same pass 1 code; the combine of one rank is exact).
// - R = 2, 4 against the CPU twins (cpu::cross_entropy_partials / _finish) on the same
//   BF16 values: partial maxima and target logits equal (a max and a copy of the same
//   values), partial sums and losses within kStatTol = 1e-5, dlogits within kBf16Tol = 1e-2,
//   padded columns exactly 0; the losses also within kStatTol of the fused GPU kernel's; every
//   rank's losses the same bits.
// - A target outside [0, V) makes that row's loss NaN; other rows keep their bits.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/device_memory_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/random.h"
#include "core/loss_mask.h"
#include "layers/cross_entropy.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using namespace fp8lm::testing;

namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr double kBf16Tol = 1e-2;
constexpr double kStatTol = 1e-5;

const cudaStream_t kStream = nullptr;  // the legacy stream: ordered with the buffers' memsets and copies

struct Inputs {
  int N, V, Vp;
  std::vector<float> logits;  // [N,Vp], BF16-rounded; padded columns hold large values
  std::vector<int32_t> targets;
};

// Targets: the first and last real columns, both sides of the slice boundaries of R = 2
// and 4 (multiples of Vp / 4) below V, then random ones.
Inputs make_inputs(int N, int V, int Vp, uint64_t seed) {
  Inputs in{N, V, Vp, bf16_rounded(random_floats(static_cast<size_t>(N) * Vp, seed, 2.0f)), {}};
  for (int i = 0; i < N; i++) {
    for (int v = V; v < Vp; v++) in.logits[static_cast<size_t>(i) * Vp + v] = 50.0f;  // must not enter the softmax
  }
  in.targets = {0, V - 1};
  for (int boundary = Vp / 4; boundary < V && static_cast<int>(in.targets.size()) + 2 <= N; boundary += Vp / 4) {
    in.targets.push_back(boundary - 1);
    in.targets.push_back(boundary);
  }
  Random random(seed + 1);
  while (static_cast<int>(in.targets.size()) < N) {
    in.targets.push_back(static_cast<int32_t>(random.next_u64() % static_cast<uint64_t>(V)));
  }
  in.targets.resize(N);
  return in;
}

// Columns [r * Vs, (r + 1) * Vs) of [N,Vp]: [N,Vs].
template <typename T>
std::vector<T> slice_columns(const std::vector<T>& matrix, int N, int Vp, int Vs, int r) {
  std::vector<T> slice(static_cast<size_t>(N) * Vs);
  for (int i = 0; i < N; i++) {
    std::memcpy(&slice[static_cast<size_t>(i) * Vs], &matrix[static_cast<size_t>(i) * Vp + static_cast<size_t>(r) * Vs],
                static_cast<size_t>(Vs) * sizeof(T));
  }
  return slice;
}

template <typename T>
void put_columns(std::vector<T>& matrix, const std::vector<T>& slice, int N, int Vp, int Vs, int r) {
  for (int i = 0; i < N; i++) {
    std::memcpy(&matrix[static_cast<size_t>(i) * Vp + static_cast<size_t>(r) * Vs], &slice[static_cast<size_t>(i) * Vs],
                static_cast<size_t>(Vs) * sizeof(T));
  }
}

struct Result {
  std::vector<float> losses;       // [N] (rank 0's)
  std::vector<bf16> dlogits;       // [N,Vp] reassembled (the logits when dloss == 0)
  std::vector<float> all_partials; // [R,N,3]
};

Result run_fused(const Inputs& in, const std::vector<int32_t>& targets, float dloss) {
  auto d_logits = device_copy(to_bf16(in.logits));
  auto d_targets = device_copy(targets);
  auto d_losses = poisoned<float>(in.N);
  cuda::cross_entropy_forward_backward(d_logits.data(), d_losses.data(), d_targets.data(), in.N, in.V, in.Vp, dloss,
                                       kStream);
  device_sync();
  return Result{d_losses.download(), d_logits.download(), {}};
}

// The two halves on R simulated ranks.
Result run_parallel(const Inputs& in, const std::vector<int32_t>& targets, int R, float dloss) {
  const int N = in.N, Vs = in.Vp / R;
  REQUIRE(in.Vp % R == 0);
  const std::vector<bf16> logits = to_bf16(in.logits);
  auto d_targets = device_copy(targets);
  std::vector<DeviceBuffer<bf16>> d_slices;
  Result result;
  for (int r = 0; r < R; r++) {
    d_slices.push_back(device_copy(slice_columns(logits, N, in.Vp, Vs, r)));
    auto d_partials = poisoned<float>(static_cast<size_t>(N) * 3);
    cuda::cross_entropy_partials(d_partials.data(), d_slices[r].data(), d_targets.data(), N, in.V, Vs, r * Vs,
                                 kStream);
    device_sync();
    const std::vector<bf16> untouched = d_slices[r].download();
    CHECK(same_bytes(untouched, slice_columns(logits, N, in.Vp, Vs, r)));  // partials only read
    const std::vector<float> partials = d_partials.download();
    result.all_partials.insert(result.all_partials.end(), partials.begin(), partials.end());
  }
  auto d_all = device_copy(result.all_partials);  // the all-gather
  result.dlogits.resize(logits.size());
  for (int r = 0; r < R; r++) {
    auto d_losses = poisoned<float>(N);
    cuda::cross_entropy_finish(d_slices[r].data(), d_losses.data(), d_all.data(), d_targets.data(), N, in.V, Vs,
                               r * Vs, R, dloss, kStream);
    device_sync();
    const std::vector<float> losses = d_losses.download();
    if (r == 0) {
      result.losses = losses;
    } else {
      CHECK(same_bytes(losses, result.losses));  // every rank combines in the same order
    }
    put_columns(result.dlogits, d_slices[r].download(), N, in.Vp, Vs, r);
  }
  return result;
}

// The CPU twins on the same BF16 values (float).
struct CpuResult {
  std::vector<float> losses, dlogits, all_partials;
};

CpuResult run_cpu(const Inputs& in, int R, float dloss) {
  const int N = in.N, Vs = in.Vp / R;
  std::vector<std::vector<float>> slices;
  CpuResult result;
  for (int r = 0; r < R; r++) {
    slices.push_back(slice_columns(in.logits, N, in.Vp, Vs, r));
    std::vector<float> partials(static_cast<size_t>(N) * 3);
    cpu::cross_entropy_partials(partials.data(), slices[r].data(), in.targets.data(), N, in.V, Vs, r * Vs);
    result.all_partials.insert(result.all_partials.end(), partials.begin(), partials.end());
  }
  result.dlogits.resize(in.logits.size());
  result.losses.resize(N);
  for (int r = 0; r < R; r++) {
    cpu::cross_entropy_finish(slices[r].data(), result.losses.data(), result.all_partials.data(), in.targets.data(),
                              N, in.V, Vs, r * Vs, R, dloss);
    put_columns(result.dlogits, slices[r], N, in.Vp, Vs, r);
  }
  return result;
}

void check_against_cpu(const Inputs& in, int R, float dloss) {
  CAPTURE(in.N, in.V, in.Vp, R, dloss);
  const Result got = run_parallel(in, in.targets, R, dloss);
  const CpuResult ref = run_cpu(in, R, dloss);

  // Partials: maxima and target logits are exact (the same values, no arithmetic), sums close.
  std::vector<float> got_s, ref_s;
  for (size_t k = 0; k < got.all_partials.size(); k += 3) {
    CHECK(float_bits(got.all_partials[k]) == float_bits(ref.all_partials[k]));
    CHECK(float_bits(got.all_partials[k + 2]) == float_bits(ref.all_partials[k + 2]));
    got_s.push_back(got.all_partials[k + 1]);
    ref_s.push_back(ref.all_partials[k + 1]);
  }
  CHECK(relative_error(got_s, ref_s) < kStatTol);

  CHECK(relative_error(got.losses, ref.losses) < kStatTol);
  const Result fused = run_fused(in, in.targets, dloss);
  CHECK(relative_error(got.losses, fused.losses) < kStatTol);

  if (dloss == 0.0f) {
    CHECK(same_bytes(got.dlogits, to_bf16(in.logits)));  // forward only: untouched
    return;
  }
  const std::vector<float> dlogits = from_bf16(got.dlogits);
  CHECK(relative_error(dlogits, ref.dlogits) < kBf16Tol);
  size_t nonzero_padding = 0;
  for (size_t k = 0; k < dlogits.size(); k++) {
    if (static_cast<int>(k % in.Vp) >= in.V && float_bits(dlogits[k]) != 0u) nonzero_padding++;
  }
  CHECK(nonzero_padding == 0);
}

void check_one_rank_is_fused(const Inputs& in, float dloss) {
  CAPTURE(in.N, in.V, in.Vp, dloss);
  const Result fused = run_fused(in, in.targets, dloss);
  const Result one = run_parallel(in, in.targets, 1, dloss);
  CHECK(same_bytes(one.losses, fused.losses));
  CHECK(same_bytes(one.dlogits, fused.dlogits));
}

}  // namespace

TEST_CASE("vocab-parallel cross-entropy with one rank is the fused kernel, bit for bit",
          "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  SECTION("V=300 padded to 384") { check_one_rank_is_fused(make_inputs(N, 300, 384, 4000), 1.0f / N); }
  SECTION("forward only") { check_one_rank_is_fused(make_inputs(N, 300, 384, 4100), 0.0f); }
  SECTION("V == Vp") { check_one_rank_is_fused(make_inputs(N, 384, 384, 4200), 1.0f / N); }
  SECTION("GPT-2 vocabulary, 50257 padded to 50304") {
    check_one_rank_is_fused(make_inputs(4, 50257, 50304, 4300), 0.25f);
  }
}

TEST_CASE("vocab-parallel cross-entropy over 2 and 4 ranks matches the CPU twins", "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  for (int R : {2, 4}) {
    check_against_cpu(make_inputs(N, 300, 384, 4400 + R), R, 1.0f / N);  // last slice partly padding
    check_against_cpu(make_inputs(N, 384, 384, 4500 + R), R, 1.0f / N);  // no padding
    check_against_cpu(make_inputs(N, 300, 384, 4600 + R), R, 0.0f);      // forward only
    check_against_cpu(make_inputs(4, 50257, 50304, 4700 + R), R, 0.25f);  // GPT-2 vocabulary
  }
  // Whole slices of padding: R = 4, V = 200 leaves [288, 384) without a real column; R = 2,
  // V = 150 leaves [192, 384) without one.
  check_against_cpu(make_inputs(N, 200, 384, 4800), 4, 1.0f / N);
  check_against_cpu(make_inputs(N, 150, 384, 4900), 2, 1.0f / N);
}

TEST_CASE("vocab-parallel cross-entropy with masked targets (--eod-mask-loss) matches the CPU twins and the fused kernel",
          "[gpu][cross_entropy][loss-mask]") {
  FP8LM_REQUIRE_GPU();
  const int N = 77;
  Inputs in = make_inputs(N, 300, 384, 5000);
  for (int i = 0; i < N; i += 4) in.targets[i] = kMaskedTarget;
  check_one_rank_is_fused(in, 1.0f / N);
  for (int R : {2, 4}) {
    check_against_cpu(in, R, 1.0f / N);
    check_against_cpu(in, R, 0.0f);
  }
  const Result got = run_parallel(in, in.targets, 2, 1.0f / N);
  for (int i = 0; i < N; i += 4) {
    CHECK(got.losses[i] == 0.0f);
    for (int v = 0; v < in.Vp; v++) REQUIRE(float_bits(__bfloat162float(got.dlogits[size_t(i) * in.Vp + v])) == 0u);
  }
}

TEST_CASE("vocab-parallel cross-entropy: a target outside the vocabulary gives a NaN loss, other rows unaffected",
          "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 6, V = 300, Vp = 384;
  const Inputs in = make_inputs(N, V, Vp, 5000);
  std::vector<int32_t> bad_targets = in.targets;
  bad_targets[2] = V;   // a padded column: not a real token
  bad_targets[4] = -2;  // negative, and not the mask (kMaskedTarget, -1): a bad target
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    const Result clean = run_parallel(in, in.targets, R, 0.5f);
    const Result bad = run_parallel(in, bad_targets, R, 0.5f);
    for (int i = 0; i < N; i++) {
      if (i == 2 || i == 4) {
        CHECK(std::isnan(bad.losses[i]));
      } else {
        CHECK(std::isfinite(bad.losses[i]));
        CHECK(float_bits(bad.losses[i]) == float_bits(clean.losses[i]));
      }
    }
    if (R == 1) {  // the bad rows' dlogits (softmax without the one-hot) as the fused kernel's too
      const Result fused = run_fused(in, bad_targets, 0.5f);
      CHECK(same_bytes(bad.dlogits, fused.dlogits));
      for (int i = 0; i < N; i++) CHECK(std::isnan(fused.losses[i]) == std::isnan(bad.losses[i]));
    }
  }
}

TEST_CASE("vocab-parallel cross-entropy launchers reject bad layouts before launching", "[gpu][cross_entropy]") {
  FP8LM_REQUIRE_GPU();
  const int N = 2;
  DeviceBuffer<bf16> logits(static_cast<size_t>(N) * 64);
  DeviceBuffer<float> partials(static_cast<size_t>(N) * 3 * 4), losses(N);
  DeviceBuffer<int32_t> targets(N);
  CHECK_THROWS_AS(cuda::cross_entropy_partials(partials.data(), logits.data(), targets.data(), N, 100, 12, 0, kStream),
                  RuntimeError);  // Vs % 8 != 0
  CHECK_THROWS_AS(cuda::cross_entropy_partials(partials.data(), logits.data(), targets.data(), N, 100, 32, 16, kStream),
                  RuntimeError);  // vocab_begin not a multiple of Vs
  CHECK_THROWS_AS(cuda::cross_entropy_partials(partials.data(), logits.data() + 1, targets.data(), N, 100, 32, 0,
                                               kStream),
                  RuntimeError);  // misaligned logits
  CHECK_THROWS_AS(cuda::cross_entropy_finish(logits.data(), losses.data(), partials.data(), targets.data(), N, 100, 32,
                                             0, 2, 1.0f, kStream),
                  RuntimeError);  // V > R * Vs
  CHECK_THROWS_AS(cuda::cross_entropy_finish(logits.data(), losses.data(), partials.data(), targets.data(), N, 60, 32,
                                             64, 2, 1.0f, kStream),
                  RuntimeError);  // rank 2 of 2
  CHECK_THROWS_AS(cuda::cross_entropy_finish(logits.data(), losses.data(), partials.data(), targets.data(), N, 60, 32,
                                             0, 2, NAN, kStream),
                  RuntimeError);  // non-finite dloss
  device_sync();
}
