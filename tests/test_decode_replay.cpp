// A recorded decoding step (Ops::record_ops: a CUDA graph on the GPU) replayed at later positions
// gives exactly the logits of steps launched op by op: every op of a replayed step reads its
// tokens and its position from the memory load_decode_step fills, not from values frozen
// when the step was recorded. The same check on both backends: on the CPU, replaying runs
// the ops again, and it is their reading of the stored position that is tested.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "apps/cli.h"
#include "apps/generator.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "tests/decoder_testing.h"
#include "core/random.h"
#include "layers/gpt.h"
#include "layers/ops.h"
#include "layers/ops_cpu.h"
#include "layers/ops_cuda.h"
#include "tests/gpu_testing.h"

namespace fp8lm {
namespace {

enum class Variant { bf16, fp8_current, fp8_delayed, fp8_cache };

const char* name(Variant v) {
  switch (v) {
    case Variant::bf16: return "bf16";
    case Variant::fp8_current: return "fp8, current scaling";
    case Variant::fp8_delayed: return "fp8, delayed scales";
    case Variant::fp8_cache: return "fp8 and an fp8 cache";
  }
  return "";
}

// The prompt crosses no split of the attention over the cache (128 positions), the steps do:
// a replayed step's length, read from memory, must pick the splits its grid covers.
constexpr int kPrompt = 120;
constexpr int kSteps = 16;
constexpr int kCapacity = kPrompt + kSteps;
const GptConfig kConfig{.n_layer = 2, .n_head = 4, .n_embd = 128, .n_inner = 512, .vocab_size = 512,
                        .n_positions = 160};

// The logits [B, V] of every step after the prompt. With `replay`, the steps follow fp8lm
// sample: the first one-token step op by op, the second recorded, then replayed at each
// position; without, every step op by op through load_batch.
std::vector<std::vector<float>> decode_logits(Ops& ops, Variant variant, int B, bool replay) {
  const GemmPrecision gemm = variant == Variant::bf16 ? GemmPrecision::bf16 : GemmPrecision::fp8;
  GptModel decoder(kConfig,
                   InferenceShape{.batch = B, .max_prompt = kPrompt, .capacity = kCapacity,
                                  .fp8_kv_cache = variant == Variant::fp8_cache},
                   GptPrecision{.gemm = gemm}, ops);
  testing::set_random_weights(ops, decoder, kConfig);
  if (variant == Variant::fp8_delayed) testing::set_stored_activation_scales(ops, decoder);

  Random random(11);
  const VocabSlice slice = decoder.vocab_slice();
  std::vector<int32_t> prompt(size_t(B) * kPrompt);
  for (auto& t : prompt) t = int32_t(random.next_u64() % 512);
  decoder.forward_cached(ops.load_batch(prompt.data(), prompt.data(), B, kPrompt, slice), 0);

  std::unique_ptr<RecordedOps> recorded;
  std::vector<std::vector<float>> logits;
  for (int step = 0; step < kSteps; ++step) {
    const int position = kPrompt + step;
    std::vector<int32_t> tokens(static_cast<size_t>(B));
    for (auto& t : tokens) t = int32_t(random.next_u64() % 512);
    if (!replay) {
      decoder.forward_cached(ops.load_batch(tokens.data(), tokens.data(), B, 1, slice), position);
    } else {
      const TokenBatch batch = ops.load_decode_step(tokens.data(), B, position, slice);
      if (step == 0) {
        decoder.forward_cached(batch, position);
      } else {
        if (!recorded) recorded = ops.record_ops([&decoder, batch, position] { decoder.forward_cached(batch, position); });
        recorded->replay();
      }
    }
    logits.emplace_back(size_t(B) * slice.size);
    ops.download_values(logits.back().data(), decoder.next_token_logits());
  }
  return logits;
}

void check_replay_matches(const std::function<std::unique_ptr<Ops>()>& make_ops) {
  for (const int B : {1, 3})
    for (const Variant variant : {Variant::bf16, Variant::fp8_current, Variant::fp8_delayed, Variant::fp8_cache}) {
      INFO(name(variant) << ", batch " << B);
      std::unique_ptr<Ops> op_by_op_ops = make_ops(), replay_ops = make_ops();
      const auto op_by_op = decode_logits(*op_by_op_ops, variant, B, /*replay=*/false);
      const auto replayed = decode_logits(*replay_ops, variant, B, /*replay=*/true);
      REQUIRE(replayed.size() == op_by_op.size());
      for (size_t step = 0; step < op_by_op.size(); ++step) {
        INFO("step " << step << " (position " << kPrompt + int(step) << ")");
        CHECK(replayed[step] == op_by_op[step]);
      }
      // The steps differ from one another: a replay that reread the recorded position or
      // tokens would repeat a row.
      CHECK(replayed[1] != replayed[2]);
    }
}

// fp8lm sample's decoder (apps/generator.h) on `device`: configs/tiny-128.json, random weights.
struct Decoder {
  RunSetup setup;
  std::unique_ptr<Generator> generator;
  Decoder(const std::string& device, std::vector<std::string> flags, bool replay_steps, int batch, int capacity,
          bool fp8_cache = false) {
    std::vector<std::string> args = {"--config", testing::source_path("configs/tiny-128.json"), "--device", device,
                                     "--train-iters", "0", "--micro-batch-size", std::to_string(batch)};
    args.insert(args.end(), flags.begin(), flags.end());
    TrainOptions options = parse_train_command_line(args).options;
    options.command = RunCommand::sample;
    options.decode_graph = replay_steps;
    setup = resolve_run_setup(options);
    const GeneratorShape shape{
        .batch = batch, .max_prompt = capacity / 2, .capacity = capacity, .fp8_kv_cache = fp8_cache};
    generator = std::make_unique<Generator>(setup, shape);
    std::vector<float> values(make_gpt_layout(setup.model).total_elements());
    init_gpt_parameters(values.data(), make_gpt_layout(setup.model), setup.model, 5);
    generator->set_parameters(values);
  }
  // Greedy tokens [batch][new] of `new_tokens` steps after a fixed 20-token prompt; the last
  // step's logits stay in generator->last_logits().
  std::vector<std::vector<int32_t>> greedy(int new_tokens, bool calibrate) {
    GenerationRequest request;
    Random random(3);
    for (int i = 0; i < 20; ++i) request.prompt.push_back(int32_t(random.next_u64() % 256));
    request.max_new_tokens = new_tokens;
    request.sampling.temperature = 0.0f;
    request.calibrate_activation_scales = calibrate;
    return generator->generate(request).tokens;
  }
};

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double difference = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(difference / norm);
}

// FP8 activation scales calibrated on the prompt: the first step's logits as close to the
// unquantized model's as current scaling's, and replayed steps as op-by-op ones, bit for bit.
void check_prompt_calibration(const std::string& device, const char* unquantized) {
  Decoder reference(device, {unquantized}, /*replay_steps=*/false, 2, 48);
  reference.greedy(1, /*calibrate=*/false);
  Decoder current(device, {"--fp8-hybrid"}, false, 2, 48);
  current.greedy(1, false);
  Decoder calibrated(device, {"--fp8-hybrid"}, false, 2, 48);
  calibrated.greedy(1, true);
  const double current_error = relative_difference(current.generator->last_logits(), reference.generator->last_logits());
  const double calibrated_error =
      relative_difference(calibrated.generator->last_logits(), reference.generator->last_logits());
  INFO("current scaling " << current_error << ", prompt-calibrated " << calibrated_error);
  // FP8 GEMMs on a small random model: a few percent from the unquantized logits (CPU: 4.2%
  // and 4.5%); the prompt's scales, with their binade of headroom, cost at most a quarter more.
  CHECK(current_error < 0.08);
  CHECK(calibrated_error < 1.25 * current_error);
  CHECK(calibrated.generator->last_logits() != current.generator->last_logits());  // other scales ran

  Decoder replayed(device, {"--fp8-hybrid"}, /*replay_steps=*/true, 2, 48, /*fp8_cache=*/true);
  Decoder op_by_op(device, {"--fp8-hybrid"}, /*replay_steps=*/false, 2, 48, /*fp8_cache=*/true);
  CHECK(replayed.greedy(12, true) == op_by_op.greedy(12, true));
  CHECK(replayed.generator->last_logits() == op_by_op.generator->last_logits());
}

}  // namespace

TEST_CASE("FP8 activation scales calibrated on the prompt decode as close as current scaling (CPU)",
          "[sample][cpu]") {
  check_prompt_calibration("cpu", "--fp32");
}

TEST_CASE("FP8 activation scales calibrated on the prompt, on the GPU, in replayed CUDA-graph steps",
          "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  check_prompt_calibration("cuda", "--bf16");
}

namespace {

// Stopping: each sequence's tokens end at its first stop token, the others run on, and the loop
// stops once every sequence has stopped, though the backend chose tokens ahead of the host's
// read-back (apps/generator.cpp). The same tokens, reported step by step to on_step.
void check_stop_tokens(const std::string& device, bool replay_steps) {
  const int batch = 3, new_tokens = 21;  // past two read-backs of 8 steps and a remainder
  Decoder decoder(device, {device == "cpu" ? "--fp32" : "--bf16"}, replay_steps, batch, 48);
  GenerationRequest request;
  for (int i = 0; i < 20; ++i) request.prompt.push_back(int32_t((i * 37 + 11) % 256));
  request.max_new_tokens = new_tokens;
  request.sampling = {.temperature = 1.0, .top_k = 8};  // the sequences draw differently
  request.seed = 3;
  const std::vector<std::vector<int32_t>> free = decoder.generator->generate(request).tokens;
  REQUIRE(free.size() == size_t(batch));
  // Sequence 0's token at step 4 stops it there (or at its first earlier draw of it).
  const int32_t stop = free[0][4];
  std::vector<size_t> expected_length(batch);
  for (int b = 0; b < batch; ++b) {
    const auto at = std::find(free[size_t(b)].begin(), free[size_t(b)].end(), stop);
    expected_length[size_t(b)] = at == free[size_t(b)].end() ? free[size_t(b)].size() : size_t(at - free[size_t(b)].begin()) + 1;
  }
  request.stop_token = stop;
  std::vector<std::vector<int32_t>> streamed(batch);
  request.on_step = [&](const std::vector<int32_t>& drawn) {
    for (int b = 0; b < batch; ++b)
      if (drawn[size_t(b)] >= 0) streamed[size_t(b)].push_back(drawn[size_t(b)]);
  };
  const GenerationResult stopped = decoder.generator->generate(request);
  for (int b = 0; b < batch; ++b) {
    INFO("sequence " << b);
    CHECK(stopped.tokens[size_t(b)].size() == expected_length[size_t(b)]);
    CHECK(std::equal(stopped.tokens[size_t(b)].begin(), stopped.tokens[size_t(b)].end(), free[size_t(b)].begin()));
    CHECK(streamed[size_t(b)] == stopped.tokens[size_t(b)]);
  }
  CHECK(size_t(stopped.decode_steps) == *std::max_element(expected_length.begin(), expected_length.end()));

  // Greedy: every sequence draws the same tokens and all stop at once, ending the loop early.
  request.sampling = {.temperature = 0.0};
  request.stop_token.reset();
  request.on_step = nullptr;
  const std::vector<int32_t> greedy = decoder.generator->generate(request).tokens[0];
  request.stop_token = greedy[9];
  const size_t greedy_length = size_t(std::find(greedy.begin(), greedy.end(), greedy[9]) - greedy.begin()) + 1;
  const GenerationResult all_stopped = decoder.generator->generate(request);
  CHECK(size_t(all_stopped.decode_steps) == greedy_length);
  for (int b = 0; b < batch; ++b)
    CHECK(all_stopped.tokens[size_t(b)] == std::vector<int32_t>(greedy.begin(), greedy.begin() + ptrdiff_t(greedy_length)));
}

}  // namespace

TEST_CASE("decoding stops each sequence at the stop token, and the loop once all have stopped (CPU)",
          "[sample][cpu]") {
  check_stop_tokens("cpu", /*replay_steps=*/true);
  check_stop_tokens("cpu", /*replay_steps=*/false);
}

TEST_CASE("decoding on the GPU stops each sequence at the stop token, and the loop once all have stopped",
          "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  check_stop_tokens("cuda", /*replay_steps=*/true);
  check_stop_tokens("cuda", /*replay_steps=*/false);
}

TEST_CASE("a recorded decoding step replays at every later position to op-by-op logits (CPU)", "[sample][cpu]") {
  check_replay_matches([] { return make_cpu_ops(); });
}

TEST_CASE("a decoding step recorded as a CUDA graph replays to op-by-op logits, bit for bit", "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  check_replay_matches([] { return make_cuda_ops(0); });
}

}  // namespace fp8lm
