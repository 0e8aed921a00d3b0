// GPT configs: Hugging Face GPT-2 keys, shipped configs, and errors naming the file.
#include <filesystem>
#include <fstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "cli_testing.h"
#include "temp_dir.h"
#include "core/error.h"
#include "core/gpt_config.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

std::string config_error(const nlohmann::json& json) {
  try {
    parse_gpt_config(json, "test.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("shipped configs load with the GPT-2 sizes", "[config]") {
  struct Expected {
    const char* file;
    int layers, heads, width;
    int64_t parameters;  // Hugging Face's count (tied head, unpadded vocabulary)
  };
  const Expected expected[] = {{"gpt2-124m.json", 12, 12, 768, 124439808},
                               {"gpt2-350m.json", 24, 16, 1024, 354823168},
                               {"gpt2-774m.json", 36, 20, 1280, 774030080},
                               {"gpt2-1558m.json", 48, 25, 1600, 1557611200}};
  for (const Expected& e : expected) {
    const GptConfig c = load_gpt_config(testing::source_path(std::string("configs/") + e.file));
    INFO(e.file);
    CHECK(c.n_layer == e.layers);
    CHECK(c.n_head == e.heads);
    CHECK(c.n_embd == e.width);
    CHECK(c.vocab_size == 50257);
    CHECK(c.padded_vocab_size() == 50304);
    CHECK(c.n_positions == 1024);
    CHECK(c.n_inner == 4 * e.width);
    CHECK(c.num_parameters_unpadded() == e.parameters);
  }
  const GptConfig tiny = load_gpt_config(testing::source_path("configs/tiny.json"));
  CHECK(tiny.name == "tiny");
  CHECK(tiny.head_dim() == 32);
}

TEST_CASE("a Hugging Face config.json works, unknown keys ignored", "[config]") {
  const nlohmann::json hf = {{"activation_function", "gelu_new"}, {"architectures", {"GPT2LMHeadModel"}},
                             {"attn_pdrop", 0.1}, {"bos_token_id", 50256}, {"embd_pdrop", 0.1},
                             {"eos_token_id", 50256}, {"initializer_range", 0.02}, {"layer_norm_epsilon", 1e-05},
                             {"model_type", "gpt2"}, {"n_ctx", 1024}, {"n_embd", 768}, {"n_head", 12},
                             {"n_inner", nullptr}, {"n_layer", 12}, {"n_positions", 1024}, {"resid_pdrop", 0.1},
                             {"summary_type", "cls_index"}, {"task_specific_params", {{"text-generation", {{"do_sample", true}}}}},
                             {"vocab_size", 50257}};
  const GptConfig c = parse_gpt_config(hf, "config.json");
  CHECK(c.n_layer == 12);
  CHECK(c.n_inner == 3072);
  CHECK(c.layer_norm_epsilon == 1e-5f);
  // Old configs with only n_ctx.
  nlohmann::json old = hf;
  old.erase("n_positions");
  CHECK(parse_gpt_config(old, "config.json").n_positions == 1024);
  // Round trip through the exporter's JSON.
  CHECK(parse_gpt_config(to_hf_json(c), "x").num_parameters() == c.num_parameters());
}

TEST_CASE("bad configs are errors naming the file and key", "[config]") {
  const nlohmann::json good = {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}, {"vocab_size", 256}, {"n_positions", 64}};
  auto without = [&](const char* key) {
    nlohmann::json j = good;
    j.erase(key);
    return j;
  };
  auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = good;
    j[key] = value;
    return j;
  };
  CHECK_THAT(config_error(without("n_layer")), ContainsSubstring("test.json: missing required key \"n_layer\""));
  CHECK_THAT(config_error(without("vocab_size")), ContainsSubstring("\"vocab_size\""));
  CHECK_THAT(config_error(with("n_head", 3)), ContainsSubstring("n_embd (64) must be divisible by n_head (3)"));
  CHECK_THAT(config_error(with("n_embd", -64)), ContainsSubstring("\"n_embd\" must be a positive integer"));
  CHECK_THAT(config_error(with("n_layer", "twelve")), ContainsSubstring("\"n_layer\" must be an integer"));
  CHECK_THAT(config_error(with("activation_function", "relu")), ContainsSubstring("activation_function"));
  CHECK_THAT(config_error(with("layer_norm_epsilon", -1.0)), ContainsSubstring("layer_norm_epsilon"));
  CHECK_THAT(config_error(nlohmann::json::array()), ContainsSubstring("must be a JSON object"));

  const testing::TempDir dir;
  const std::string broken = dir.file("broken.json");
  std::ofstream(broken) << "{\"n_layer\": 2,";
  try {
    load_gpt_config(broken);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK_THAT(std::string(e.what()), ContainsSubstring(broken));
    CHECK_THAT(std::string(e.what()), ContainsSubstring("not valid JSON"));
  }
  CHECK_THROWS_AS(load_gpt_config(dir.file("missing.json")), InputError);
}
