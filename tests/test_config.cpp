// GPT configs: Hugging Face GPT-2 keys, shipped configs, and errors naming the file.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>
#include "captured_log.h"
#include "cli_testing.h"
#include "temp_dir.h"
#include "core/error.h"
#include "core/gpt_config.h"
#include "core/json_fields.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;
using fp8lm::testing::CapturedLog;

namespace {

std::string config_error(const nlohmann::json& json) {
  try {
    parse_gpt_config(json, "test.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

const nlohmann::json kGood = {{"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}, {"vocab_size", 256}, {"n_positions", 64}};

nlohmann::json good_with(const char* key, nlohmann::json value) {
  nlohmann::json j = kGood;
  j[key] = std::move(value);
  return j;
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
  // GPT-3's 6.7B shape (32 layers, width 4096, 32 heads of 128, T = 2048) with GPT-2's
  // vocabulary: 12 C^2 + 13 C per block, the embeddings, the final LayerNorm.
  const GptConfig large = load_gpt_config(testing::source_path("configs/gpt-6.7b.json"));
  CHECK(large.n_layer == 32);
  CHECK(large.n_head == 32);
  CHECK(large.head_dim() == 128);
  CHECK(large.n_positions == 2048);
  CHECK(large.n_inner == 4 * 4096);
  CHECK(large.num_parameters_unpadded() == int64_t{6658404352});
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
  CHECK_THAT(config_error(with("n_embd", -64)), ContainsSubstring("\"n_embd\" must be an integer in [1, 1073741824], got -64"));
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

TEST_CASE("a value of the wrong type names the file and the key", "[config]") {
  CHECK(config_error(good_with("n_layer", "12")) == "test.json: \"n_layer\" must be an integer, got \"12\"");
  CHECK(config_error(good_with("n_embd", 64.5)) == "test.json: \"n_embd\" must be an integer, got 64.5");
  CHECK_THAT(config_error(good_with("n_head", nlohmann::json::array({2}))), ContainsSubstring("\"n_head\" must be an integer"));
  CHECK_THAT(config_error(good_with("layer_norm_epsilon", "1e-5")),
             ContainsSubstring("test.json: \"layer_norm_epsilon\" must be a number, got \"1e-5\""));
  CHECK_THAT(config_error(good_with("tie_word_embeddings", "yes")),
             ContainsSubstring("\"tie_word_embeddings\" must be true or false"));
  CHECK_THAT(config_error(good_with("n_inner", 1LL << 40)), ContainsSubstring("\"n_inner\" must be an integer in [1, "));
}

TEST_CASE("JsonFields: typed reads whose errors name the file and the nested key", "[config]") {
  const nlohmann::json state = {{"iteration", 4},
                                {"name", "run"},
                                {"negative", -1},
                                {"data_position", {{"epoch", "3"}, {"next_sample", 17}}},
                                {"list", {1, 2}}};
  const JsonFields fields(state, "ckpt/state.json");
  CHECK(fields.get<int64_t>("iteration") == 4);
  CHECK(fields.get<std::string>("name") == "run");
  CHECK(fields.get_or<int>("absent", 9) == 9);
  CHECK(fields.object("data_position").get<uint64_t>("next_sample") == 17);
  auto message = [](auto&& read) {
    try {
      read();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(message([&] { fields.object("data_position").get<uint64_t>("epoch"); }) ==
        "ckpt/state.json: \"data_position.epoch\" must be an integer, got \"3\"");
  CHECK(message([&] { fields.get<int64_t>("name"); }) == "ckpt/state.json: \"name\" must be an integer, got \"run\"");
  CHECK(message([&] { fields.get<uint64_t>("negative"); }) ==
        "ckpt/state.json: \"negative\" must be an integer in [0, 18446744073709551615], got -1");
  CHECK(message([&] { fields.get<int>("iteration", 5, 10); }) ==
        "ckpt/state.json: \"iteration\" must be an integer in [5, 10], got 4");
  CHECK(message([&] { fields.get<std::string>("iteration"); }) == "ckpt/state.json: \"iteration\" must be a string, got 4");
  CHECK(message([&] { fields.object("data_position").get<int>("missing"); }) ==
        "ckpt/state.json: missing required key \"data_position.missing\"");
  CHECK(message([&] { fields.object("list"); }) == "ckpt/state.json: \"list\" must be a JSON object, got [1,2]");
  CHECK(message([&] { JsonFields(nlohmann::json::array(), "x.json"); }) ==
        "x.json: the top level must be a JSON object, got []");
}

TEST_CASE("a config that is not a regular file is refused without reading it", "[config]") {
  const testing::TempDir dir;
  auto load_error = [](const std::string& path) {
    try {
      load_gpt_config(path);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(load_error(dir.path().string()) ==
        dir.path().string() + ": not a regular file (a directory)");
  // A FIFO would block the read forever: refused from its type alone.
  const std::string fifo = dir.file("config.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(load_error(fifo) == fifo + ": not a regular file (a FIFO (named pipe))");
  CHECK(load_error(dir.file("missing.json")) == dir.file("missing.json") + ": cannot open (No such file or directory)");
}

TEST_CASE("every size derived from the config is checked in 64 bits", "[config]") {
  // 4 x 2^29 wraps a 32-bit int to -2^31: refused here, naming the key (as --hidden-size is).
  nlohmann::json wide = good_with("n_embd", 1 << 29);
  wide["n_head"] = 1 << 22;
  CHECK_THAT(config_error(wide), ContainsSubstring("test.json: \"n_embd\" = 536870912 makes the default MLP width "
                                                   "n_inner = 4 x n_embd = 2147483648, above the largest supported "
                                                   "width 1073741824"));
  // An explicit n_inner is its own limit; the parameter count must fit 64 bits.
  wide["n_inner"] = 1 << 30;
  wide["n_layer"] = 1 << 30;
  wide["n_positions"] = 1 << 30;
  CHECK_THAT(config_error(wide), ContainsSubstring("parameter count of n_layer 1073741824 x n_embd 536870912 overflows"));
}

TEST_CASE("vocab_size above 65,536 is a config error naming the key", "[config]") {
  CHECK(config_error(good_with("vocab_size", 70000)) ==
        "test.json: \"vocab_size\" = 70000 exceeds 65536: tokens are stored as uint16, so the vocabulary holds at "
        "most 65,536 ids");
  CHECK(parse_gpt_config(good_with("vocab_size", 65536), "test.json").padded_vocab_size() == 65536);
}

TEST_CASE("unknown keys are warned about by name; a real Hugging Face config.json is quiet", "[config]") {
  {
    CapturedLog log;
    nlohmann::json typos = kGood;
    typos["n_layers"] = 3;
    typos["layer_norm_eps"] = 1e-6;
    parse_gpt_config(typos, "typos.json");
    CHECK_THAT(log.text(), ContainsSubstring("[warning]"));
    CHECK_THAT(log.text(), ContainsSubstring("typos.json: ignoring unknown keys \"layer_norm_eps\", \"n_layers\""));
  }
  {
    // openai-community/gpt2's config.json, with the keys newer transformers versions write.
    const nlohmann::json hf = nlohmann::json::parse(R"({
      "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
      "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
      "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
      "n_inner": null, "n_layer": 12, "n_positions": 1024, "reorder_and_upcast_attn": false, "resid_pdrop": 0.1,
      "scale_attn_by_inverse_layer_idx": false, "scale_attn_weights": true, "summary_activation": null,
      "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
      "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
      "torch_dtype": "float32", "transformers_version": "4.36.0", "use_cache": true, "vocab_size": 50257,
      "n_special": 0, "predict_special_tokens": true, "tie_word_embeddings": true, "_name_or_path": "gpt2"})");
    CapturedLog log;
    CHECK(parse_gpt_config(hf, "config.json").n_layer == 12);
    CHECK(log.text().empty());
  }
}

TEST_CASE("a Hugging Face setting that changes the model is refused, naming it", "[config]") {
  CHECK_THAT(config_error(good_with("scale_attn_by_inverse_layer_idx", true)),
             ContainsSubstring("\"scale_attn_by_inverse_layer_idx\" = true is not supported"));
  CHECK_THAT(config_error(good_with("scale_attn_weights", false)), ContainsSubstring("\"scale_attn_weights\""));
}
