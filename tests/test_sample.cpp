// Incremental decoding (GptModel::forward_cached, layers/kv_cache.h), the sampler
// (layers/sampling.h) and `fp8lm sample`, on the CPU.
#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/gpt_config.h"
#include "core/random.h"
#include "layers/gpt.h"
#include "layers/kv_cache.h"
#include "layers/ops_cpu.h"
#include "layers/sampling.h"
#include "cli_testing.h"
#include "temp_dir.h"
#include "tokenizer_testing.h"

namespace fp8lm {
namespace {

using Catch::Matchers::ContainsSubstring;
using testing::run_fp8lm;
using testing::TempDir;

GptConfig small_config() {
  GptConfig c;
  c.name = "sample-test";
  c.vocab_size = 96;
  c.n_positions = 32;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.n_inner = 128;
  return c;
}

std::vector<int32_t> random_tokens(size_t n, int vocab, uint64_t seed) {
  Random random(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(random.next_u64() % uint64_t(vocab));
  return t;
}

// One model on its own CPU backend, with GPT-2's initialisation from `seed` (the working
// slab is the FP32 parameters on the CPU).
struct CpuModel {
  std::unique_ptr<Ops> ops = make_cpu_ops();
  std::unique_ptr<GptModel> model;
  void init(uint64_t seed) {
    init_gpt_parameters(static_cast<float*>(model->working()), model->layout(), model->config(), seed);
    model->refresh_weight_operands();
  }
};

CpuModel training_model(const GptConfig& config, int B, int T, GemmPrecision gemm) {
  CpuModel m;
  m.model = std::make_unique<GptModel>(config, B, T, GptPrecision{.gemm = gemm}, *m.ops);
  return m;
}

CpuModel inference_model(const GptConfig& config, int B, int prompt, int capacity, GemmPrecision gemm,
                         bool fp8_kv_cache = false) {
  CpuModel m;
  m.model = std::make_unique<GptModel>(
      config, InferenceShape{.batch = B, .max_prompt = prompt, .capacity = capacity, .fp8_kv_cache = fp8_kv_cache},
      GptPrecision{.gemm = gemm}, *m.ops);
  return m;
}

// -log softmax(logits)[target] over the real vocabulary.
double token_loss(const float* logits, int vocab, int target) {
  double max_logit = logits[0];
  for (int v = 1; v < vocab; ++v) max_logit = std::max<double>(max_logit, logits[v]);
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(double(logits[v]) - max_logit);
  return std::log(sum) + max_logit - logits[target];
}

// The token losses [B*T] of sequences x [B,T] with targets y, decoded through the cache:
// the first `prompt` tokens as one pass (prompt > 1), then one token at a time. A prompt's
// positions get no logits (NaN here).
std::vector<double> cached_token_losses(CpuModel& m, const std::vector<int32_t>& x, const std::vector<int32_t>& y,
                                        int B, int T, int prompt) {
  GptModel& model = *m.model;
  const VocabSlice slice = model.vocab_slice();
  std::vector<double> losses(size_t(B) * T, NAN);
  int position = 0;
  if (prompt > 1) {
    std::vector<int32_t> chunk;
    for (int b = 0; b < B; ++b) chunk.insert(chunk.end(), x.begin() + b * T, x.begin() + b * T + prompt);
    model.forward_cached(m.ops->load_batch(chunk.data(), chunk.data(), B, prompt, slice), 0);
    position = prompt;
  }
  std::vector<float> logits(size_t(B) * slice.size);
  for (; position < T; ++position) {
    std::vector<int32_t> step(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) step[size_t(b)] = x[size_t(b) * T + position];
    model.forward_cached(m.ops->load_batch(step.data(), step.data(), B, 1, slice), position);
    m.ops->download_values(logits.data(), model.next_token_logits());
    for (int b = 0; b < B; ++b)
      losses[size_t(b) * T + position] =
          token_loss(logits.data() + size_t(b) * slice.size, slice.vocab_size, y[size_t(b) * T + position]);
  }
  return losses;
}

double training_loss_sum(CpuModel& m, const std::vector<int32_t>& x, const std::vector<int32_t>& y, int B, int T) {
  float loss_sum = 0.0f;
  Tensor loss;
  loss.data = &loss_sum;
  loss.rows = loss.cols = 1;
  m.model->forward_eval(m.ops->load_batch(x.data(), y.data(), B, T, m.model->vocab_slice()), loss);
  return loss_sum;
}

}  // namespace

TEST_CASE("decoding through the cache gives the training forward's token losses", "[sample][cpu]") {
  const GptConfig config = small_config();
  const int B = 2, T = 12;
  const auto x = random_tokens(B * T, config.vocab_size, 1), y = random_tokens(B * T, config.vocab_size, 2);
  for (const GemmPrecision gemm : {GemmPrecision::fp32, GemmPrecision::bf16}) {
    INFO(to_string(gemm));
    CpuModel reference = training_model(config, B, T, gemm);
    reference.init(7);
    const double expected = training_loss_sum(reference, x, y, B, T);

    // Token by token from position 0: every position scored, summing to the training loss.
    CpuModel decoder = inference_model(config, B, T, T, gemm);
    decoder.init(7);
    const std::vector<double> stepped = cached_token_losses(decoder, x, y, B, T, /*prompt=*/0);
    double stepped_sum = 0.0;
    for (double loss : stepped) stepped_sum += loss;
    CHECK(std::fabs(stepped_sum - expected) < 1e-4 * expected);

    // A prompt of 5 in one pass, then steps: the later positions' losses are the same.
    CpuModel prefilled = inference_model(config, B, 5, T, gemm);
    prefilled.init(7);
    const std::vector<double> after_prompt = cached_token_losses(prefilled, x, y, B, T, 5);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const size_t i = size_t(b) * T + t;
        if (t < 5) {
          CHECK(std::isnan(after_prompt[i]));
        } else {
          CHECK(std::fabs(after_prompt[i] - stepped[i]) < 1e-4);
        }
      }
  }
}

TEST_CASE("an FP8 model and an FP8 key/value cache decode close to FP32", "[sample][cpu]") {
  const GptConfig config = small_config();
  const int B = 2, T = 12;
  const auto x = random_tokens(B * T, config.vocab_size, 3), y = random_tokens(B * T, config.vocab_size, 4);
  auto loss_with = [&](GemmPrecision gemm, bool fp8_cache) {
    CpuModel m = inference_model(config, B, 4, T, gemm, fp8_cache);
    m.init(11);
    double sum = 0.0;
    int scored = 0;
    for (double loss : cached_token_losses(m, x, y, B, T, 4))
      if (!std::isnan(loss)) sum += loss, ++scored;
    return sum / scored;
  };
  const double fp32 = loss_with(GemmPrecision::fp32, false);
  const double fp32_fp8_cache = loss_with(GemmPrecision::fp32, true);
  const double fp8 = loss_with(GemmPrecision::fp8, false);
  const double fp8_fp8_cache = loss_with(GemmPrecision::fp8, true);
  CHECK(fp32_fp8_cache != fp32);  // the cache is quantized...
  CHECK(std::fabs(fp32_fp8_cache - fp32) < 0.01 * fp32);  // ...closely
  CHECK(std::fabs(fp8 - fp32) < 0.02 * fp32);
  CHECK(std::fabs(fp8_fp8_cache - fp32) < 0.02 * fp32);
}

TEST_CASE("the FP8 cache takes its scales from the first keys and values, with one binade of headroom",
          "[sample][cpu]") {
  const int B = 1, n = 2, C = 4, capacity = 4;
  // qkv rows: q | k | v, C each.
  std::vector<float> qkv = {0, 0, 0, 0, 1, -2, 0.5f, 0, 3, 0, 0, -1,   // token 0
                            0, 0, 0, 0, 0.25f, 1, 0, 0, 6, 0, 0, 0};  // token 1
  std::vector<float> keys(size_t(B) * capacity * C, -1.0f), values(keys.size(), -1.0f);
  float scales[2] = {kv_cache_scale(2.0f), kv_cache_scale(6.0f)};
  CHECK(scales[0] == 448.0f / 2.0f / 2.0f);
  CHECK(scales[1] == 448.0f / 6.0f / 2.0f);
  CHECK(kv_cache_scale(0.0f) == 1.0f);
  cpu::kv_cache_append(keys.data(), values.data(), qkv.data(), B, n, C, capacity, /*position=*/1, scales);
  CHECK(keys[0] == -1.0f);  // position 0 untouched
  CHECK(keys[4 + 1] == fp8_round(-2.0f * scales[0], Fp8Dtype::e4m3));
  CHECK(values[4] == fp8_round(3.0f * scales[1], Fp8Dtype::e4m3));
  CHECK(values[8] == fp8_round(6.0f * scales[1], Fp8Dtype::e4m3));
  CHECK(values[8] == 224.0f);  // twice the first amax would reach 448
  CHECK(keys[12] == -1.0f);    // position 3 untouched
}

TEST_CASE("attention_decode is softmax(q.k / sqrt(HS)) . v over the cached positions", "[sample][cpu]") {
  // One head of size 2, three cached positions.
  const int B = 1, C = 2, NH = 1, capacity = 4;
  const std::vector<float> qkv = {1.0f, 0.5f, 0, 0, 0, 0};
  const std::vector<float> keys = {1, 0, 0, 1, 1, 1, 9, 9}, values = {1, 2, 3, 4, 5, 6, 9, 9};
  std::vector<float> out(2);
  cpu::attention_decode(out.data(), qkv.data(), keys.data(), values.data(), B, C, NH, capacity, 3, 1.0f, 1.0f);
  const double s[3] = {1.0 / std::sqrt(2.0), 0.5 / std::sqrt(2.0), 1.5 / std::sqrt(2.0)};
  double z = 0, o0 = 0, o1 = 0;
  for (int i = 0; i < 3; ++i) {
    const double p = std::exp(s[i]);
    z += p;
    o0 += p * values[2 * i];
    o1 += p * values[2 * i + 1];
  }
  CHECK(std::fabs(out[0] - o0 / z) < 1e-6);
  CHECK(std::fabs(out[1] - o1 / z) < 1e-6);
}

TEST_CASE("sampling: greedy, top-k, top-p, temperature, deterministic in the seed", "[sample][cpu]") {
  const std::vector<float> logits = {std::log(0.2f), std::log(0.5f), std::log(0.3f), -1e30f};
  Random random(1);
  CHECK(sample_token(logits.data(), 4, {.temperature = 0.0}, random) == 1);
  for (int i = 0; i < 20; ++i) {
    CHECK(sample_token(logits.data(), 4, {.temperature = 2.0, .top_k = 1}, random) == 1);
    CHECK(sample_token(logits.data(), 4, {.temperature = 1.0, .top_p = 0.4}, random) == 1);
  }
  auto frequencies = [&](const SamplingOptions& options) {
    Random r(42);
    std::map<int, double> counts;
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) counts[sample_token(logits.data(), 4, options, r)] += 1.0 / draws;
    return counts;
  };
  const auto plain = frequencies({});
  CHECK(std::fabs(plain.at(0) - 0.2) < 0.01);
  CHECK(std::fabs(plain.at(1) - 0.5) < 0.01);
  CHECK(std::fabs(plain.at(2) - 0.3) < 0.01);
  CHECK(plain.count(3) == 0);
  const auto top2 = frequencies({.top_k = 2});  // 0.5 and 0.3, renormalised
  CHECK(top2.count(0) == 0);
  CHECK(std::fabs(top2.at(1) - 0.625) < 0.01);
  const auto nucleus = frequencies({.top_p = 0.75});  // 0.5 + 0.3 reaches 0.75
  CHECK(nucleus.count(0) == 0);
  CHECK(std::fabs(nucleus.at(2) - 0.375) < 0.01);
  const auto cold = frequencies({.temperature = 0.5});  // p^2 renormalised: 0.04, 0.25, 0.09
  CHECK(std::fabs(cold.at(1) - 0.25 / 0.38) < 0.01);

  Random a(9), b(9);
  for (int i = 0; i < 50; ++i) CHECK(sample_token(logits.data(), 4, {}, a) == sample_token(logits.data(), 4, {}, b));

  // A decoding loop's numbers (the GPU computes them without a stream): sequence s's stream
  // of seed 77, one number a step.
  for (int sequence = 0; sequence < 3; ++sequence) {
    Random stream(77 * 0x9E3779B97F4A7C15ull + uint64_t(sequence) + 1);
    for (int step = 0; step < 20; ++step) CHECK(step_uniform(77, sequence, step) == stream.uniform());
  }

  CHECK_THROWS_WITH(validate_sampling_options({.temperature = -1.0}), ContainsSubstring("--temperature"));
  CHECK_THROWS_WITH(validate_sampling_options({.top_k = -1}), ContainsSubstring("--top-k"));
  CHECK_THROWS_WITH(validate_sampling_options({.top_p = 0.0}), ContainsSubstring("--top-p"));
  CHECK_THROWS_WITH(validate_sampling_options({.top_p = 1.5}), ContainsSubstring("--top-p"));
  CHECK_NOTHROW(validate_sampling_options({.temperature = 0.0, .top_k = 0, .top_p = 1.0}));
}

TEST_CASE("fp8lm sample: the same seed gives the same text; bad input exits 2 naming it", "[sample][cli]") {
  TempDir dir;
  // A byte-level vocabulary (256 bytes, one merge and <|endoftext|>) and a model over it.
  const testing::SyntheticFiles tokenizer = testing::write_synthetic(dir, {"He"}, "H e\n");
  const std::string config = dir.file("config.json");
  std::ofstream(config) << R"({"model_type": "gpt2", "vocab_size": 258, "n_positions": 48, "n_layer": 2,
                              "n_head": 2, "n_embd": 32})";
  const std::string checkpoint = dir.file("ck");
  const auto trained = run_fp8lm("--config " + config + " --mock-data --device cpu --seq-length 16 --micro-batch-size 2 "
                                 "--train-iters 3 --log-level warn --save " + checkpoint);
  REQUIRE(trained.exit_code == 0);
  const std::string base = "sample --load " + checkpoint + " --device cpu --log-level warn --vocab-file " +
                           tokenizer.vocab + " --merge-file " + tokenizer.merges + " --max-new-tokens 12 ";
  auto text_of = [](const std::string& output) { return output.substr(0, output.rfind("{\"")); };

  const auto first = run_fp8lm(base + "--prompt 'Hello there' --seed 5");
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  CHECK(first.output.rfind("Hello there", 0) == 0);  // the prompt, then its continuation
  const auto line = nlohmann::json::parse(first.output.substr(first.output.rfind("{\"")));
  CHECK(line["new_tokens"] == 12);
  CHECK(line["prompt_tokens"] == 10);  // "He" is one token
  // The step cost is the steady steps' (after the two that set up), and the throughput its batch's.
  CHECK(line["steady_steps"] == 10);
  CHECK(line["tokens_per_s"].get<double>() == Catch::Approx(1000.0 / line["ms_per_step"].get<double>()));
  const auto again = run_fp8lm(base + "--prompt 'Hello there' --seed 5");
  CHECK(text_of(again.output) == text_of(first.output));
  // FP8 decoding with activation scales calibrated on the prompt.
  const auto calibrated = run_fp8lm(base + "--prompt 'Hello there' --fp8-hybrid --fp8-activation-scales prompt");
  INFO(calibrated.output);
  REQUIRE(calibrated.exit_code == 0);
  CHECK(nlohmann::json::parse(calibrated.output.substr(calibrated.output.rfind("{\"")))["fp8_activation_scales"] ==
        "prompt");
  // Steps replayed from one recorded step (the default) and launched op by op give the same text.
  const auto op_by_op = run_fp8lm(base + "--prompt 'Hello there' --seed 5 --cuda-graph off");
  CHECK(text_of(op_by_op.output) == text_of(first.output));
  CHECK(line["cuda_graph"] == "on");
  CHECK(nlohmann::json::parse(op_by_op.output.substr(op_by_op.output.rfind("{\"")))["cuda_graph"] == "off");
  const auto other = run_fp8lm(base + "--prompt 'Hello there' --seed 6");
  CHECK(text_of(other.output) != text_of(first.output));
  // Greedy decoding ignores the seed.
  const auto greedy_a = run_fp8lm(base + "--prompt 'Hello there' --temperature 0 --seed 1");
  const auto greedy_b = run_fp8lm(base + "--prompt 'Hello there' --temperature 0 --seed 2");
  REQUIRE(greedy_a.exit_code == 0);
  CHECK(text_of(greedy_a.output) == text_of(greedy_b.output));
  // FP8 GEMMs and an FP8 cache, a batch of three, nucleus sampling.
  const auto fp8 = run_fp8lm(base + "--prompt 'Hello' --fp8-hybrid --kv-cache-dtype fp8 --batch-size 3 --top-p 0.9");
  INFO(fp8.output);
  REQUIRE(fp8.exit_code == 0);
  CHECK_THAT(fp8.output, ContainsSubstring("---- sample 3 ----"));
  CHECK(nlohmann::json::parse(fp8.output.substr(fp8.output.rfind("{\"")))["new_tokens"] == 36);

  struct Case {
    std::string args, named;
  };
  for (const Case& c : std::vector<Case>{
           {"--prompt ''", "--prompt is empty"},
           {"", "exactly one of --prompt"},
           {"--prompt a --random-prompt 3", "exactly one of --prompt"},
           {"--prompt a --top-k -1", "--top-k"},
           {"--prompt a --temperature -0.5", "--temperature"},
           {"--prompt a --top-p 0", "--top-p"},
           {"--prompt a --top-p 1.5", "--top-p"},
           {"--prompt a --kv-cache-dtype fp16", "--kv-cache-dtype"},
           {"--prompt a --small-m-gemm auto", "--small-m-gemm"},
           {"--prompt a --cuda-graph yes", "--cuda-graph"},
           {"--prompt a --fp8-activation-scales always", "--fp8-activation-scales must be auto or prompt"},
           {"--prompt 'Hello there' --fp8-activation-scales prompt", "it needs an FP8 precision"},
           {"--prompt 'Hello there' --fp8-hybrid --fp8-recipe tensorwise --fp8-activation-scales prompt",
            "--fp8-recipe delayed"},
           {"--prompt H --fp8-hybrid --fp8-activation-scales prompt", "at least 2 tokens"},
           {"--prompt a --profile-ops --cuda-graph on", "--cuda-graph off"},
           {"--prompt a --max-new-tokens 0", "--max-new-tokens"},
           {"--prompt a --max-new-tokens 49", "exceed the model's context of 48"},
           {"--prompt-file " + dir.file("missing.txt"), "missing.txt"},
           {"--prompt a --no-such-flag", "--no-such-flag"},
       }) {
    INFO(c.args);
    const auto result = run_fp8lm(base + c.args);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.output, ContainsSubstring(c.named));
  }
  const auto no_weights = run_fp8lm("sample --prompt a --device cpu");
  CHECK(no_weights.exit_code == 2);
  CHECK_THAT(no_weights.output, ContainsSubstring("--load DIR or --init-from PATH is required"));
}

TEST_CASE("fp8lm sample and eval of a checkpoint whose FP8 operands are not the flags' (its BF16 first and last "
          "layers made FP8): the stored scales where the names match, current scaling for the table",
          "[sample][eval][cli]") {
  // The checkpoint's scaling state lacks blocks 0 and 2; the models built from these flags have
  // them. Both commands match the stored states by name against the model's own table
  // (match_scaling_by_name), which must carry the table's arrays, not only its names.
  TempDir dir;
  const std::string checkpoint = dir.file("ck"), tiny = testing::source_path("configs/tiny.json");
  REQUIRE(run_fp8lm("--config " + tiny + " --mock-data --device cpu --seq-length 16 --micro-batch-size 2 --num-layers 3 "
                    "--train-iters 3 --log-level warn --fp8-hybrid --first-last-layers-bf16 --save " + checkpoint)
              .exit_code == 0);
  const std::string all_fp8 =
      " --first-last-layers-bf16 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 --device cpu ";
  const auto sampled = run_fp8lm("sample --load " + checkpoint + all_fp8 + "--random-prompt 5 --max-new-tokens 4");
  INFO(sampled.output);
  CHECK(sampled.exit_code == 0);
  CHECK_THAT(sampled.output, ContainsSubstring("FP8 activations cast with current scaling"));
  std::vector<uint16_t> tokens(600);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t((i * 37 + i / 7) % 256);
  const std::string valid = dir.file("val_000000.bin");
  {  // llm.c's shard header (magic 20240520, version 1, the token count) and uint16 tokens.
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 1;
    header[2] = int32_t(tokens.size());
    std::ofstream out(valid, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), std::streamsize(header.size() * sizeof(int32_t)));
    out.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * sizeof(uint16_t)));
  }
  const auto evaluated = run_fp8lm("eval --load " + checkpoint + all_fp8 + "--valid-data-path " + valid);
  INFO(evaluated.output);
  CHECK(evaluated.exit_code == 0);
  CHECK_THAT(evaluated.output, ContainsSubstring("FP8 activations cast with current scaling"));
}

}  // namespace fp8lm
