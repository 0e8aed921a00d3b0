// The GPU's token choice (layers/sampling.cu) against its specification, the host's
// sample_token with step_uniform's numbers: greedy, temperature, top-k, top-p and both, over
// rows of many ties, one dominant logit, all equal, signed zeros and a padded vocabulary; and
// what the choice writes: the next step's inputs and position, the chosen rows, the ended
// sequences. SKIPPED without a GPU.
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/random.h"
#include "layers/sampling.h"
#include "layers/sampling_cuda.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;

namespace {

constexpr int kVocab = 50257, kPadded = 50304, kRows = 6;

// [kRows, kPadded] logits rounded to BF16; the padding columns hold values larger than any
// real logit, which neither side may choose.
std::vector<float> test_logits() {
  std::vector<float> logits(size_t(kRows) * kPadded);
  Random random(17);
  auto row = [&](int r) { return logits.data() + size_t(r) * kPadded; };
  for (int i = 0; i < kVocab; ++i) {
    row(0)[i] = float(3.0 * random.normal());
    row(1)[i] = float(int(random.next_u64() % 5)) - 2.0f;  // five values: ties everywhere
    row(2)[i] = i == 777 ? 30.0f : float(random.normal());  // one token takes nearly all
    row(3)[i] = 0.5f;                                        // all equal
    row(4)[i] = float(10.0 * random.normal());
    row(5)[i] = (i % 3 == 0) ? 0.0f : (i % 3 == 1) ? -0.0f : -float(random.next_u64() % 4);  // signed zeros
  }
  for (int r = 0; r < kRows; ++r)
    for (int i = kVocab; i < kPadded; ++i) row(r)[i] = 1000.0f;
  return testing::bf16_rounded(logits);
}

struct GpuChoice {
  std::vector<int32_t> chosen, next, ended;
};

// One launch of the kernel at `position` (stored in device memory when `stored`), the first
// decoding position being `first`.
GpuChoice choose_on_gpu(const std::vector<float>& logits, const SamplingOptions& rule, uint64_t seed, int first,
                        int position, bool stored, std::vector<int32_t> ended, int stop_token, int rows) {
  std::vector<uint16_t> bits(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) bits[i] = bf16_from_float(logits[i]);
  auto d_logits = testing::device_copy(bits);
  std::vector<int32_t> step(kRows + 1, 42);  // the step memory: inputs, then the position
  step[kRows] = position;
  auto d_step = testing::device_copy(step);
  auto d_chosen = testing::device_copy(std::vector<int32_t>(size_t(rows) * kRows, -7));
  auto d_ended = testing::device_copy(ended);
  // Poisoned histograms (the kernel clears them), a zero counter.
  std::vector<int32_t> scratch(decoding_token_scratch_ints(kRows), 12345);
  scratch[0] = 0;
  auto d_scratch = testing::device_copy(scratch);
  cuda::TokenChoiceLaunch launch;
  launch.logits = d_logits.data();
  launch.B = kRows;
  launch.row_stride = kPadded;
  launch.vocab_size = kVocab;
  launch.rule = rule;
  launch.position = stored ? -1000 : position;  // a stored position is read, not this
  launch.stored_position = stored ? d_step.data() + kRows : nullptr;
  launch.next_inputs = d_step.data();
  launch.next_position = d_step.data() + kRows;
  launch.tokens = {.chosen = d_chosen.data(),
                   .ended = d_ended.data(),
                   .scratch = d_scratch.data(),
                   .rows = rows,
                   .seed = seed,
                   .first_position = first,
                   .stop_token = stop_token};
  cuda::choose_next_tokens(launch, nullptr);
  testing::device_sync();
  GpuChoice out{std::vector<int32_t>(size_t(rows) * kRows), std::vector<int32_t>(kRows + 1), ended};
  CUDA_CHECK(cudaMemcpy(out.chosen.data(), d_chosen.data(), out.chosen.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(out.next.data(), d_step.data(), out.next.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(out.ended.data(), d_ended.data(), out.ended.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(scratch.data(), d_scratch.data(), 4, cudaMemcpyDeviceToHost));
  CHECK(scratch[0] == 0);  // the counter of finished blocks is left ready for the next step
  return out;
}

}  // namespace

TEST_CASE("GPU token choice: sample_token's token for every rule, row and draw", "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  const std::vector<float> logits = test_logits();
  struct Case {
    std::string name;
    SamplingOptions rule;
  };
  const std::vector<Case> cases = {
      {"greedy", {.temperature = 0.0}},
      {"temperature 1", {.temperature = 1.0}},
      {"temperature 0.7", {.temperature = 0.7}},
      {"top-k 1", {.temperature = 1.0, .top_k = 1}},
      {"top-k 40", {.temperature = 0.9, .top_k = 40}},
      {"top-k beyond the vocabulary", {.temperature = 1.0, .top_k = kVocab + 10}},
      {"top-p 0.9", {.temperature = 1.0, .top_p = 0.9}},
      {"top-p tiny", {.temperature = 1.0, .top_p = 1e-9}},
      {"top-k 100 and top-p 0.3", {.temperature = 1.3, .top_k = 100, .top_p = 0.3}},
  };
  const int first = 5, rows = 64;
  for (const Case& c : cases) {
    for (const int position : {5, 6, 19, 40}) {
      for (const bool stored : {false, true}) {
        const uint64_t seed = 1234 + uint64_t(position);
        INFO(c.name << ", position " << position << (stored ? " (stored)" : ""));
        const GpuChoice gpu =
            choose_on_gpu(logits, c.rule, seed, first, position, stored, std::vector<int32_t>(kRows, 0), -1, rows);
        for (int b = 0; b < kRows; ++b) {
          INFO("row " << b);
          const int32_t expected = sample_token(logits.data() + size_t(b) * kPadded, kVocab, c.rule,
                                                step_uniform(seed, b, position - first));
          CHECK(gpu.chosen[size_t(position + 1) * kRows + b] == expected);
          CHECK(gpu.next[size_t(b)] == expected);
        }
        CHECK(gpu.next[kRows] == position + 1);
        // Only row position + 1 is written.
        int written = 0;
        for (int32_t v : gpu.chosen) written += v != -7;
        CHECK(written == kRows);
      }
    }
  }
}

TEST_CASE("GPU token choice: a sequence ends at the stop token and then keeps its input", "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  const std::vector<float> logits = test_logits();
  const SamplingOptions greedy{.temperature = 0.0};
  // Row 2's greedy token is 777: the stop token here. Row 4 had already ended.
  std::vector<int32_t> ended(kRows, 0);
  ended[4] = 1;
  const GpuChoice gpu = choose_on_gpu(logits, greedy, 0, 0, 3, /*stored=*/true, ended, /*stop_token=*/777, 16);
  CHECK(gpu.chosen[size_t(4) * kRows + 2] == 777);
  CHECK(gpu.ended[2] == 1);
  CHECK(gpu.chosen[size_t(4) * kRows + 4] == -1);
  CHECK(gpu.next[4] == 42);  // its input stays
  CHECK(gpu.ended[4] == 1);
  for (const int b : {0, 1, 3, 5}) CHECK(gpu.ended[size_t(b)] == 0);
  CHECK(gpu.next[kRows] == 4);
}
