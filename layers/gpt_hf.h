// The Hugging Face GPT-2 layout: names and tensor orientation of `transformers`'
// GPT2LMHeadModel, for importing BF16/FP16/FP32 models and exporting ours.
//
// Differences from fp8lm's own layout (layers/gpt.h):
//   - Linear weights are Conv1D in Hugging Face: [in, out]; fp8lm stores [out, in].
//   - wte has vocab_size rows there; fp8lm pads to a multiple of 128 (zero rows).
//   - names may carry a "transformer." prefix; "lm_head.weight" (never prefixed) is tied to
//     wte and absent, unless the config unties it (tie_word_embeddings false);
//     "h.N.attn.bias" / "masked_bias" are causal-mask buffers, not parameters.
#pragma once

#include <string>
#include <vector>

#include "core/gpt_config.h"
#include "core/tensor.h"

namespace fp8lm {

class SafetensorsFile;

struct HfTensor {
  std::string name;            // Hugging Face name, without prefix
  std::vector<int64_t> shape;  // Hugging Face shape
  std::vector<float> values;   // row-major in that shape
};

// fp8lm's parameter slab -> Hugging Face tensors (Conv1D weights transposed, wte
// unpadded), with fp8lm's (= Hugging Face's GPT2Model) names.
std::vector<HfTensor> to_hf_tensors(const TensorLayout& layout, const float* params, const GptConfig& config);

// Fills fp8lm's parameter slab from a Hugging Face GPT-2 safetensors file (F32, F16 or
// BF16; names with or without "transformer."). Every tensor must be present with the
// shape `config` implies; errors are InputError naming the file and tensor.
void load_hf_parameters(const SafetensorsFile& file, const TensorLayout& layout, const GptConfig& config,
                        float* params);

// True for the four Linear weights that Hugging Face stores as Conv1D ([in, out]).
bool is_hf_conv1d_weight(const std::string& name);

}  // namespace fp8lm
