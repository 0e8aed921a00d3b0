// The GPT-2 model shape, read from JSON with Hugging Face GPT-2 `config.json` keys, so
// a Hugging Face model's config.json works as --config unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace fp8lm {

struct GptConfig {
  std::string name;           // file stem, for logs
  int n_layer = 0;            // transformer blocks (L)
  int n_head = 0;             // attention heads (NH)
  int n_embd = 0;             // width (C)
  int n_inner = 0;            // MLP width; Hugging Face's null means 4 * n_embd
  int vocab_size = 0;         // V: tokens the tokenizer produces
  int n_positions = 0;        // maximum sequence length (learned position table rows)
  float layer_norm_epsilon = 1e-5f;
  // Standard deviation of the initial weights (GPT-2's, and Megatron's --init-method-std); the
  // residual projections (attn.c_proj, mlp.c_proj) draw with this / sqrt(2 x n_layer).
  double initializer_range = 0.02;
  // The LM head reads the token embedding's rows (GPT-2's tie); false: it has its own
  // [Vp, C] weight, lm_head.weight (Hugging Face's tie_word_embeddings, Megatron's
  // --untie-embeddings-and-output-weights).
  bool tie_word_embeddings = true;

  // Rows of the token embedding / LM head. Padded to a multiple of 128 so the LM-head
  // GEMM tiles evenly on the tensor cores; padded rows never receive a target.
  int padded_vocab_size() const { return (vocab_size + 127) / 128 * 128; }
  int head_dim() const { return n_embd / n_head; }
  // Trainable parameters (with the padded vocabulary rows, which stay zero-gradient).
  int64_t num_parameters() const;
  // Parameters as Hugging Face counts them (vocab_size rows).
  int64_t num_parameters_unpadded() const;
  // A training step's model FLOPs per token at this sequence length: 6 N + 12 L T C (PaLM's,
  // nanoGPT's and llm.c's count: the GEMMs forward and backward, and the attention's two
  // products; recomputation not counted). N leaves out an untied model's token embedding, a
  // lookup that multiplies nothing (the tied table counts once, for the LM head's GEMM).
  double training_flops_per_token(int seq_length) const {
    const double lookup_only = tie_word_embeddings ? 0.0 : double(padded_vocab_size()) * n_embd;
    return 6.0 * (double(num_parameters()) - lookup_only) + 12.0 * n_layer * double(seq_length) * n_embd;
  }
};

// Token ids are stored as uint16 (llm.c shards, the data loader).
inline constexpr int kMaxVocabSize = 65536;

// Reads and validates a config file. Errors are InputError naming the file and the key;
// unknown keys (typos such as "n_layers") are logged as a warning naming them.
GptConfig load_gpt_config(const std::string& path);
// Validates a parsed JSON object; `source` names it in errors.
GptConfig parse_gpt_config(const nlohmann::json& json, const std::string& source);
// Keys of a config object that fp8lm neither reads nor knows as a Hugging Face GPT-2 key
// that may be ignored.
std::vector<std::string> unknown_config_keys(const nlohmann::json& json);
// The Hugging Face GPT-2 config.json for this shape (for export).
nlohmann::json to_hf_json(const GptConfig& config);

}  // namespace fp8lm
