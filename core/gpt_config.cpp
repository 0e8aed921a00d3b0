#include "core/gpt_config.h"

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_fields.h"

namespace fp8lm {

namespace {

// Keys fp8lm reads.
const std::set<std::string, std::less<>> kModelKeys = {
    "n_layer", "n_head", "n_embd", "n_inner", "vocab_size", "n_positions", "n_ctx", "layer_norm_epsilon", "initializer_range",
    "activation_function", "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn"};

// Keys a Hugging Face GPT-2 config.json carries that do not change the model fp8lm trains
// (dropout, generation, tokenizer and bookkeeping settings). They are ignored quietly, so a
// real config.json gives no warning; any other key is reported, as it is most likely a typo
// ("n_layers", "layer_norm_eps") of a key that then silently keeps its default.
const std::set<std::string, std::less<>> kIgnoredHuggingFaceKeys = {
    "_name_or_path", "add_cross_attention", "architectures", "attn_pdrop", "bad_words_ids", "begin_suppress_tokens",
    "bos_token_id", "chunk_size_feed_forward", "cross_attention_hidden_size", "decoder_start_token_id",
    "diversity_penalty", "do_sample", "early_stopping", "embd_pdrop", "encoder_no_repeat_ngram_size", "eos_token_id",
    "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id",
    "gradient_checkpointing", "id2label", "is_decoder", "is_encoder_decoder", "label2id",
    "length_penalty", "max_length", "min_length", "model_type", "n_special", "no_repeat_ngram_size", "num_beam_groups",
    "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states", "output_past", "output_scores",
    "pad_token_id", "predict_special_tokens", "prefix", "problem_type", "pruned_heads", "remove_invalid_values",
    "repetition_penalty", "resid_pdrop", "return_dict", "return_dict_in_generate", "sep_token_id",
    "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj",
    "suppress_tokens", "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder",
    "tokenizer_class", "top_k", "top_p", "torch_dtype", "torchscript", "transformers_version", "typical_p",
    "use_bfloat16", "use_cache"};

constexpr int kMaxShapeValue = 1 << 30;

// The parameter count in 64 bits, or nullopt when it does not fit.
std::optional<int64_t> checked_parameter_count(const GptConfig& c) {
  const int64_t C = c.n_embd, F = c.n_inner;
  int64_t total = 0;
  bool overflow = false;
  auto term = [&](int64_t a, int64_t b) {
    int64_t product = 0;
    overflow |= __builtin_mul_overflow(a, b, &product);
    overflow |= __builtin_add_overflow(total, product, &total);
  };
  // One block: ln_1, c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (weights and biases).
  int64_t per_layer = 0, product = 0;
  for (const auto& [a, b] : {std::pair{2, C}, {3 * C, C}, {3, C}, {C, C}, {1, C}, {2, C}, {F, C}, {1, F}, {F, C}, {1, C}}) {
    overflow |= __builtin_mul_overflow(int64_t(a), b, &product);
    overflow |= __builtin_add_overflow(per_layer, product, &per_layer);
  }
  term(c.padded_vocab_size(), C);
  if (!c.tie_word_embeddings) term(c.padded_vocab_size(), C);  // lm_head.weight
  term(c.n_positions, C);
  term(c.n_layer, per_layer);
  term(2, C);
  if (overflow) return std::nullopt;
  return total;
}

// Settings of a Hugging Face config that change the model: fp8lm implements one choice of each.
void check_supported_variant(const JsonFields& json) {
  if (json.has("activation_function")) {
    const std::string activation = json.get<std::string>("activation_function");
    if (activation != "gelu_new" && activation != "gelu_pytorch_tanh")
      json.fail("activation_function", "\"" + activation +
                                           "\" is not supported; fp8lm implements GPT-2's tanh GELU (\"gelu_new\")");
  }
  auto require_flag = [&](const char* key, bool supported, const char* what) {
    if (json.has(key) && json.get<bool>(key) != supported)
      json.fail(key, std::string("= ") + (supported ? "false" : "true") + " is not supported; fp8lm " + what);
  };
  require_flag("scale_attn_weights", true, "scales attention scores by 1/sqrt(head size)");
  require_flag("scale_attn_by_inverse_layer_idx", false, "scales every layer's attention alike");
  require_flag("reorder_and_upcast_attn", false, "computes attention in its own (FP32-accumulating) kernels");
}

}  // namespace

int64_t GptConfig::num_parameters() const {
  const std::optional<int64_t> count = checked_parameter_count(*this);
  FP8LM_CHECK(count.has_value(), "the parameter count of a validated config overflows 64 bits");
  return *count;
}

int64_t GptConfig::num_parameters_unpadded() const {
  const int64_t vocabulary_tables = tie_word_embeddings ? 1 : 2;
  return num_parameters() - vocabulary_tables * int64_t{padded_vocab_size() - vocab_size} * n_embd;
}

GptConfig parse_gpt_config(const nlohmann::json& json_value, const std::string& source) {
  const JsonFields json(json_value, source);
  GptConfig config;
  auto shape_value = [&](const char* key) { return json.get<int>(key, 1, kMaxShapeValue); };
  config.n_layer = shape_value("n_layer");
  config.n_head = shape_value("n_head");
  config.n_embd = shape_value("n_embd");
  config.vocab_size = shape_value("vocab_size");
  // Old GPT-2 configs name the context length n_ctx; n_positions wins when both exist.
  const int n_ctx = json.get_or<int>("n_ctx", 0, 1, kMaxShapeValue);
  config.n_positions = n_ctx != 0 && !json.has("n_positions") ? n_ctx : shape_value("n_positions");
  // Hugging Face's null n_inner means 4 * n_embd: computed in 64 bits, so a wide model is
  // refused here instead of wrapping to a negative width.
  const int64_t n_inner = json.has("n_inner") ? int64_t{shape_value("n_inner")} : 4 * int64_t{config.n_embd};
  if (n_inner > kMaxShapeValue)
    json.fail("n_embd", "= " + std::to_string(config.n_embd) + " makes the default MLP width n_inner = 4 x n_embd = " +
                            std::to_string(n_inner) + ", above the largest supported width " +
                            std::to_string(kMaxShapeValue));
  config.n_inner = static_cast<int>(n_inner);
  config.layer_norm_epsilon =
      static_cast<float>(json.get_or<double>("layer_norm_epsilon", config.layer_norm_epsilon, 1e-30, 0.5));
  config.initializer_range = json.get_or<double>("initializer_range", config.initializer_range, 1e-30, 10.0);
  config.tie_word_embeddings = json.get_or<bool>("tie_word_embeddings", true);
  check_supported_variant(json);

  // Tokens are stored as uint16 (llm.c shards, the data loader): ids 0..65535.
  if (config.vocab_size > kMaxVocabSize)
    json.fail("vocab_size", "= " + std::to_string(config.vocab_size) + " exceeds " + std::to_string(kMaxVocabSize) +
                                ": tokens are stored as uint16, so the vocabulary holds at most 65,536 ids");
  FP8LM_INPUT_CHECK(config.n_embd % config.n_head == 0, source, ": n_embd (", config.n_embd,
                    ") must be divisible by n_head (", config.n_head, ")");
  FP8LM_INPUT_CHECK(config.head_dim() % 8 == 0, source, ": head size n_embd/n_head = ", config.head_dim(),
                    " must be a multiple of 8 (FP8/BF16 tensor-core alignment)");
  FP8LM_INPUT_CHECK(config.n_embd % 16 == 0, source, ": n_embd (", config.n_embd,
                    ") must be a multiple of 16 (FP8 GEMM alignment)");
  FP8LM_INPUT_CHECK(config.n_inner % 16 == 0, source, ": n_inner (", config.n_inner,
                    ") must be a multiple of 16 (FP8 GEMM alignment)");
  FP8LM_INPUT_CHECK(checked_parameter_count(config).has_value(), source, ": the parameter count of n_layer ",
                    config.n_layer, " x n_embd ", config.n_embd, " overflows 64 bits");

  if (const std::vector<std::string> unknown = unknown_config_keys(json_value); !unknown.empty()) {
    std::string list;
    for (const std::string& key : unknown) list += (list.empty() ? "\"" : ", \"") + key + "\"";
    spdlog::warn("{}: ignoring unknown key{} {} (fp8lm reads n_layer, n_head, n_embd, n_inner, vocab_size, "
                 "n_positions, layer_norm_epsilon, initializer_range; a misspelt key keeps its default)",
                 source, unknown.size() > 1 ? "s" : "", list);
  }
  return config;
}

std::vector<std::string> unknown_config_keys(const nlohmann::json& json) {
  std::vector<std::string> unknown;
  if (!json.is_object()) return unknown;
  for (const auto& [key, value] : json.items())
    if (!kModelKeys.count(key) && !kIgnoredHuggingFaceKeys.count(key)) unknown.push_back(key);
  return unknown;
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
          {"n_inner", config.n_inner == 4 * int64_t{config.n_embd} ? nlohmann::json() : nlohmann::json(config.n_inner)},
          {"vocab_size", config.vocab_size},
          {"n_positions", config.n_positions},
          {"n_ctx", config.n_positions},
          {"layer_norm_epsilon", config.layer_norm_epsilon},
          {"initializer_range", config.initializer_range},
          {"tie_word_embeddings", config.tie_word_embeddings}};
}

}  // namespace fp8lm
