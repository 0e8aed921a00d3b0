// An LM head with its own weight (Hugging Face's tie_word_embeddings false, Megatron's
// --untie-embeddings-and-output-weights): the config and its parameter count, the layouts,
// the model against the tied one it equals when lm_head.weight holds wte's values, the Hugging
// Face round trip, and training from the command line.
#include <cmath>
#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "cli_testing.h"
#include "core/gpt_config.h"
#include "core/safetensors.h"
#include "layers/gpt.h"
#include "layers/gpt_hf.h"
#include "layers/ops_cpu.h"
#include "layers/ops_cuda.h"
#include "tests/gpu_testing.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

GptConfig small_config(bool tied) {
  // Head size 32: the CUDA attention's smallest.
  nlohmann::json json = {{"n_layer", 2},   {"n_head", 2},        {"n_embd", 64},
                         {"n_inner", 128}, {"vocab_size", 100}, {"n_positions", 16}};
  if (!tied) json["tie_word_embeddings"] = false;
  return parse_gpt_config(json, "test.json");
}

// One model over a backend (the CPU's by default), its working copy set from `canonical`
// (make_gpt_layout's order).
struct TestModel {
  std::unique_ptr<Ops> ops;
  std::unique_ptr<GptModel> model;
  TestModel(const GptConfig& config, const std::vector<float>& canonical, int B, int T,
            const GptPrecision& precision = {.gemm = GemmPrecision::fp32},
            std::unique_ptr<Ops> backend = make_cpu_ops())
      : ops(std::move(backend)) {
    model = std::make_unique<GptModel>(config, B, T, precision, *ops);
    const TensorLayout full = make_gpt_layout(config);
    std::vector<float> local(model->layout().total_elements(), 0.0f);
    for (const TensorInfo& t : model->layout().tensors())
      std::copy_n(canonical.begin() + ptrdiff_t(full.find(t.name)->offset), t.numel,
                  local.begin() + ptrdiff_t(t.offset));
    model->set_working_values(local.data());
    model->refresh_weight_operands();
  }
  // One forward and backward: the loss sum; gradient() then reads a tensor's gradient.
  float step(const std::vector<int32_t>& x, const std::vector<int32_t>& y) {
    const std::unique_ptr<Allocation> sum = ops->allocate(sizeof(float));
    ops->zero(sum->data(), sizeof(float));
    model->zero_gradients();
    model->forward_backward(
        ops->load_batch(x.data(), y.data(), model->micro_batch_size(), model->seq_length(), model->vocab_slice()),
        0.25f, Tensor::scalar_f32(static_cast<float*>(sum->data())));
    float host = 0.0f;
    ops->download(&host, sum->data(), sizeof(float));
    return host;
  }
  std::vector<float> gradient(const std::string& name) const {
    const TensorInfo& t = *model->layout().find(name);
    std::vector<float> all(model->layout().total_elements());
    ops->download_values(all.data(), model->gradients());
    return std::vector<float>(all.begin() + ptrdiff_t(t.offset), all.begin() + ptrdiff_t(t.offset + t.numel));
  }
};

}  // namespace

TEST_CASE("tie_word_embeddings false gives the LM head its own weight: the config, its count and the layouts",
          "[untied-head]") {
  const GptConfig tied = small_config(true), untied = small_config(false);
  CHECK(tied.tie_word_embeddings);
  CHECK_FALSE(untied.tie_word_embeddings);
  const int64_t table = int64_t{tied.padded_vocab_size()} * tied.n_embd;
  CHECK(untied.num_parameters() == tied.num_parameters() + table);
  CHECK(untied.num_parameters_unpadded() == tied.num_parameters_unpadded() + int64_t{tied.vocab_size} * tied.n_embd);
  CHECK(untied.training_flops_per_token(16) == tied.training_flops_per_token(16));  // the lookup multiplies nothing
  CHECK(to_hf_json(untied)["tie_word_embeddings"] == false);
  CHECK(parse_gpt_config(to_hf_json(untied), "round trip").tie_word_embeddings == false);

  const TensorLayout canonical = make_gpt_layout(untied);
  REQUIRE(canonical.find("lm_head.weight") != nullptr);
  CHECK(canonical.tensors().back().name == "lm_head.weight");  // GPT2LMHeadModel's order: the head last
  CHECK(make_gpt_layout(tied).find("lm_head.weight") == nullptr);
  CHECK(canonical.total_elements() == make_gpt_layout(tied).total_elements() + size_t(table));
  // In a tensor-parallel rank's layout the head's rows are split as wte's, in the head's bucket.
  std::vector<ParameterBucket> buckets;
  const TensorLayout shard = make_gpt_shard_layout(untied, 2, 1, &buckets);
  const TensorInfo& head = *shard.find("lm_head.weight");
  CHECK(head.shape == std::vector<int64_t>{untied.padded_vocab_size() / 2, untied.n_embd});
  CHECK(head.split == TensorSplit::rows);
  CHECK(head.offset >= buckets.back().begin);
  CHECK(buckets.back().name == "head");
  // The initial weights: drawn as wte's (padded rows zero), and not wte's values.
  std::vector<float> values(canonical.total_elements());
  init_gpt_parameters(values.data(), canonical, untied, 3);
  const TensorInfo& wte = *canonical.find("wte.weight");
  const TensorInfo& lm_head = *canonical.find("lm_head.weight");
  double squares = 0.0;
  bool same = true, padded_zero = true;
  for (size_t i = 0; i < lm_head.numel; ++i) {
    const float v = values[lm_head.offset + i];
    if (i >= size_t(untied.vocab_size) * untied.n_embd) padded_zero = padded_zero && v == 0.0f;
    else squares += double(v) * v;
    same = same && v == values[wte.offset + i];
  }
  CHECK(padded_zero);
  CHECK_FALSE(same);
  CHECK(std::fabs(std::sqrt(squares / (double(untied.vocab_size) * untied.n_embd)) - 0.02) < 0.002);
}

namespace {

// The untied model with lm_head.weight = wte against the tied model, both on `backend`: the same
// loss, and the untied head's and embedding's gradients summing to the tied wte's. Exact on the
// CPU; on the GPU within `tolerance` (the two sums of the tied wte in one accumulator, or two).
void check_untied_equals_tied(const std::function<std::unique_ptr<Ops>()>& backend, const GptPrecision& precision,
                              double tolerance) {
  const GptConfig tied = small_config(true), untied = small_config(false);
  const TensorLayout untied_layout = make_gpt_layout(untied);
  std::vector<float> untied_values(untied_layout.total_elements());
  init_gpt_parameters(untied_values.data(), untied_layout, untied, 5);
  const TensorInfo& wte = *untied_layout.find("wte.weight");
  const TensorInfo& lm_head = *untied_layout.find("lm_head.weight");
  std::copy_n(untied_values.begin() + ptrdiff_t(wte.offset), wte.numel,
              untied_values.begin() + ptrdiff_t(lm_head.offset));
  // The tied model's canonical values are the untied one's without the head (which comes last).
  const std::vector<float> tied_values(untied_values.begin(),
                                       untied_values.begin() + ptrdiff_t(make_gpt_layout(tied).total_elements()));

  const int B = 2, T = 16;
  std::vector<int32_t> x(B * T), y(B * T);
  for (int i = 0; i < B * T; ++i) x[size_t(i)] = (i * 7 + 3) % 100, y[size_t(i)] = (i * 11 + 5) % 100;
  TestModel tied_model(tied, tied_values, B, T, precision, backend());
  TestModel untied_model(untied, untied_values, B, T, precision, backend());
  const float tied_loss = tied_model.step(x, y), untied_loss = untied_model.step(x, y);
  INFO("loss tied " << tied_loss << ", untied " << untied_loss);
  CHECK(std::fabs(untied_loss - tied_loss) <= tolerance * std::fabs(tied_loss));

  const std::vector<float> tied_wte = tied_model.gradient("wte.weight");
  const std::vector<float> embedding = untied_model.gradient("wte.weight");
  const std::vector<float> head = untied_model.gradient("lm_head.weight");
  double diff = 0.0, norm = 0.0, head_norm = 0.0, embedding_norm = 0.0;
  for (size_t i = 0; i < tied_wte.size(); ++i) {
    diff += std::pow(double(embedding[i]) + head[i] - tied_wte[i], 2);
    norm += double(tied_wte[i]) * tied_wte[i];
    head_norm += double(head[i]) * head[i];
    embedding_norm += double(embedding[i]) * embedding[i];
  }
  INFO("wte gradient: relative difference " << std::sqrt(diff / norm));
  CHECK(std::sqrt(diff / norm) <= std::max(tolerance, 1e-6));  // the tied sum adds the two in one accumulator
  CHECK(head_norm > 0.0);
  CHECK(embedding_norm > 0.0);
  // The rest of the model's gradients are the tied model's.
  for (const char* name : {"wpe.weight", "h.0.attn.c_attn.weight", "h.1.mlp.c_proj.bias", "ln_f.weight"}) {
    const std::vector<float> a = untied_model.gradient(name), b = tied_model.gradient(name);
    double d = 0.0, n = 0.0;
    for (size_t i = 0; i < a.size(); ++i) d += std::pow(double(a[i]) - b[i], 2), n += double(b[i]) * b[i];
    INFO(name << ": relative difference " << std::sqrt(d / n));
    CHECK(std::sqrt(d / n) <= tolerance);
  }
}

}  // namespace

TEST_CASE("an untied head holding wte's values computes the tied model's loss, and its two gradients sum to the "
          "tied wte's",
          "[untied-head]") {
  check_untied_equals_tied([] { return make_cpu_ops(); }, GptPrecision{.gemm = GemmPrecision::fp32}, 0.0);
}

TEST_CASE("on the GPU too, an untied head holding wte's values is the tied model, in BF16, FP8 and with the FP8 "
          "LM head",
          "[gpu][untied-head]") {
  FP8LM_REQUIRE_GPU();
  for (const GptPrecision& precision : {GptPrecision{.gemm = GemmPrecision::bf16},
                                        GptPrecision{.gemm = GemmPrecision::fp8},
                                        GptPrecision{.gemm = GemmPrecision::fp8, .fp8_lm_head = true}}) {
    INFO(to_string(precision.gemm) << (precision.fp8_lm_head ? " with the FP8 LM head" : ""));
    check_untied_equals_tied([] { return make_cuda_ops(0); }, precision, 1e-5);
  }
}

TEST_CASE("fp8lm trains an untied head from the command line, and exports and imports it through Hugging Face's "
          "lm_head.weight",
          "[untied-head]") {
  testing::TempDir dir;
  const std::string tiny = testing::source_path("configs/tiny.json"), ck = dir.file("ck"), hf = dir.file("hf");
  auto run = [](const std::string& args) {
    auto result = testing::run_fp8lm(args);
    INFO("fp8lm " << args << "\n" << result.output);
    return result;
  };
  const std::string common = "--config " + tiny + " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 "
                             "--lr 3e-3 --log-interval 1 --eval-iters 0 --fp8-hybrid --train-iters 6";
  const std::string train = common + " --untie-embeddings-and-output-weights";
  const auto trained = run(train + " --save " + ck + " --save-interval 4 --exit-interval 4");
  REQUIRE(trained.exit_code == 0);
  CHECK_THAT(trained.output, ContainsSubstring("its own weight (--untie-embeddings-and-output-weights)"));
  // Resumed at step 4, it trains as the straight run does, to the last bit.
  const auto resumed = run(train + " --load " + ck + " --metrics-file " + dir.file("b.jsonl"));
  REQUIRE(resumed.exit_code == 0);
  const auto straight = run(train + " --metrics-file " + dir.file("c.jsonl"));
  REQUIRE(straight.exit_code == 0);
  const std::vector<double> resumed_losses = testing::metrics_losses(dir.file("b.jsonl"));
  const std::vector<double> straight_losses = testing::metrics_losses(dir.file("c.jsonl"));
  REQUIRE(resumed_losses.size() == 2);
  REQUIRE(straight_losses.size() == 6);
  CHECK(resumed_losses[0] == straight_losses[4]);
  CHECK(resumed_losses[1] == straight_losses[5]);
  // A tied config cannot resume it: refused before any work, naming the flag.
  const auto tied = run(common + " --load " + ck);
  CHECK(tied.exit_code == 2);
  CHECK_THAT(tied.output, ContainsSubstring("the checkpoint's LM head is untied to the token embedding and this run's "
                                            "config is tied"));
  CHECK_THAT(tied.output, ContainsSubstring("add --untie-embeddings-and-output-weights"));

  // Hugging Face: config.json says so, and lm_head.weight stands beside transformer.wte.weight.
  const auto exported = run("convert --load " + ck + " --to " + hf + " --dtype fp32");
  REQUIRE(exported.exit_code == 0);
  std::ifstream config_file(hf + "/config.json");
  CHECK(nlohmann::json::parse(config_file)["tie_word_embeddings"] == false);
  const SafetensorsFile model = SafetensorsFile::open(hf + "/model.safetensors");
  CHECK(model.contains("lm_head.weight"));
  CHECK(model.contains("transformer.wte.weight"));
  // And back: the export reads as the checkpoint's own weights, the head's included.
  const GptConfig config = load_gpt_config(hf + "/config.json");
  CHECK_FALSE(config.tie_word_embeddings);
  const TensorLayout layout = make_gpt_layout(config);
  std::vector<float> exported_values(layout.total_elements()), saved_values(layout.total_elements());
  load_hf_parameters(model, layout, config, exported_values.data());
  std::string saved;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(ck))
    if (entry.path().filename() == "model.safetensors") saved = entry.path().string();
  REQUIRE_FALSE(saved.empty());
  load_hf_parameters(SafetensorsFile::open(saved), layout, config, saved_values.data());
  CHECK(exported_values == saved_values);
  const TensorInfo& lm_head = *layout.find("lm_head.weight");
  const TensorInfo& wte = *layout.find("wte.weight");
  CHECK_FALSE(std::equal(exported_values.begin() + ptrdiff_t(lm_head.offset),
                         exported_values.begin() + ptrdiff_t(lm_head.offset + lm_head.numel),
                         exported_values.begin() + ptrdiff_t(wte.offset)));
}
