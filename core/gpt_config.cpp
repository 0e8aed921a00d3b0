#include "core/gpt_config.h"

#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "core/input_file.h"

namespace fp8lm {

namespace {

// Keys that a GPT-2 config.json carries and fp8lm understands or may ignore silently.
// Anything else is logged at debug level and ignored.
const std::set<std::string> kKnownKeys = {
    "n_layer", "n_head", "n_embd", "n_inner", "vocab_size", "n_positions", "n_ctx",
    "layer_norm_epsilon", "activation_function", "model_type", "architectures", "tie_word_embeddings"};

int read_positive_int(const nlohmann::json& json, const char* key, const std::string& source, bool required,
                      int fallback) {
  auto it = json.find(key);
  if (it == json.end() || it->is_null()) {
    FP8LM_INPUT_CHECK(!required, source, ": missing required key \"", key, "\"");
    return fallback;
  }
  FP8LM_INPUT_CHECK(it->is_number_integer(), source, ": \"", key, "\" must be an integer, got ", it->dump());
  const int64_t value = it->get<int64_t>();
  FP8LM_INPUT_CHECK(value >= 1 && value <= (int64_t{1} << 30), source, ": \"", key,
                    "\" must be a positive integer, got ", value);
  return static_cast<int>(value);
}

}  // namespace

int64_t GptConfig::num_parameters() const {
  const int64_t C = n_embd, F = n_inner;
  const int64_t per_layer = 2 * C            // ln_1
                            + C * 3 * C + 3 * C  // attn.c_attn
                            + C * C + C          // attn.c_proj
                            + 2 * C              // ln_2
                            + C * F + F          // mlp.c_fc
                            + F * C + C;         // mlp.c_proj
  return int64_t{padded_vocab_size()} * C + int64_t{n_positions} * C + n_layer * per_layer + 2 * C;
}

int64_t GptConfig::num_parameters_unpadded() const {
  return num_parameters() - int64_t{padded_vocab_size() - vocab_size} * n_embd;
}

GptConfig parse_gpt_config(const nlohmann::json& json, const std::string& source) {
  FP8LM_INPUT_CHECK(json.is_object(), source, ": a GPT config must be a JSON object");
  GptConfig config;
  config.n_layer = read_positive_int(json, "n_layer", source, true, 0);
  config.n_head = read_positive_int(json, "n_head", source, true, 0);
  config.n_embd = read_positive_int(json, "n_embd", source, true, 0);
  config.vocab_size = read_positive_int(json, "vocab_size", source, true, 0);
  // Old GPT-2 configs name the context length n_ctx; n_positions wins when both exist.
  const int n_ctx = read_positive_int(json, "n_ctx", source, false, 0);
  config.n_positions = read_positive_int(json, "n_positions", source, n_ctx == 0, n_ctx);
  config.n_inner = read_positive_int(json, "n_inner", source, false, 4 * config.n_embd);

  if (auto it = json.find("layer_norm_epsilon"); it != json.end()) {
    FP8LM_INPUT_CHECK(it->is_number(), source, ": \"layer_norm_epsilon\" must be a number");
    const double eps = it->get<double>();
    FP8LM_INPUT_CHECK(eps > 0.0 && eps < 1.0, source, ": \"layer_norm_epsilon\" must be in (0, 1), got ", eps);
    config.layer_norm_epsilon = static_cast<float>(eps);
  }
  if (auto it = json.find("activation_function"); it != json.end() && !it->is_null()) {
    FP8LM_INPUT_CHECK(it->is_string() && (*it == "gelu_new" || *it == "gelu_pytorch_tanh"), source,
                      ": \"activation_function\" ", it->dump(),
                      " is not supported; fp8lm implements GPT-2's tanh GELU (\"gelu_new\")");
  }
  FP8LM_INPUT_CHECK(config.n_embd % config.n_head == 0, source, ": n_embd (", config.n_embd,
                    ") must be divisible by n_head (", config.n_head, ")");
  FP8LM_INPUT_CHECK(config.head_dim() % 8 == 0, source, ": head size n_embd/n_head = ", config.head_dim(),
                    " must be a multiple of 8 (FP8/BF16 tensor-core alignment)");
  FP8LM_INPUT_CHECK(config.n_embd % 16 == 0, source, ": n_embd (", config.n_embd,
                    ") must be a multiple of 16 (FP8 GEMM alignment)");
  FP8LM_INPUT_CHECK(config.n_inner % 16 == 0, source, ": n_inner (", config.n_inner,
                    ") must be a multiple of 16 (FP8 GEMM alignment)");

  for (const auto& [key, value] : json.items()) {
    if (!kKnownKeys.count(key)) spdlog::debug("{}: ignoring key \"{}\"", source, key);
  }
  return config;
}

GptConfig load_gpt_config(const std::string& path) {
  const std::string text = read_input_file(path);  // a regular file: a FIFO or directory is refused here
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
  GptConfig config = parse_gpt_config(json, path);
  config.name = std::filesystem::path(path).stem().string();
  return config;
}

nlohmann::json to_hf_json(const GptConfig& config) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"activation_function", "gelu_new"},
          {"n_layer", config.n_layer},
          {"n_head", config.n_head},
          {"n_embd", config.n_embd},
          {"n_inner", config.n_inner == 4 * config.n_embd ? nlohmann::json() : nlohmann::json(config.n_inner)},
          {"vocab_size", config.vocab_size},
          {"n_positions", config.n_positions},
          {"n_ctx", config.n_positions},
          {"layer_norm_epsilon", config.layer_norm_epsilon},
          {"tie_word_embeddings", true}};
}

}  // namespace fp8lm
