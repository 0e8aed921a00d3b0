#include "layers/gpt_hf.h"

#include "core/error.h"
#include "core/safetensors.h"
#include "layers/gpt.h"

namespace fp8lm {

bool is_hf_conv1d_weight(const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with("attn.c_attn.weight") || ends_with("attn.c_proj.weight") || ends_with("mlp.c_fc.weight") ||
         ends_with("mlp.c_proj.weight");
}

std::vector<HfTensor> to_hf_tensors(const TensorLayout& layout, const float* params, const GptConfig& config) {
  std::vector<HfTensor> tensors;
  for (const TensorInfo& t : layout.tensors()) {
    HfTensor hf;
    hf.name = t.name;
    const float* p = params + t.offset;
    if (is_hf_conv1d_weight(t.name)) {
      const int64_t out = t.shape[0], in = t.shape[1];
      hf.shape = {in, out};
      hf.values.resize(t.numel);
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) hf.values[i * out + o] = p[o * in + i];
    } else if (is_vocabulary_table(t.name)) {
      hf.shape = {config.vocab_size, t.shape[1]};
      hf.values.assign(p, p + size_t(config.vocab_size) * t.shape[1]);
    } else {
      hf.shape = t.shape;
      hf.values.assign(p, p + t.numel);
    }
    tensors.push_back(std::move(hf));
  }
  return tensors;
}

void load_hf_parameters(const SafetensorsFile& file, const TensorLayout& layout, const GptConfig& config,
                        float* params) {
  const std::string& path = file.path();
  for (const TensorInfo& t : layout.tensors()) {
    std::string name = t.name;
    if (!file.contains(name)) name = "transformer." + t.name;
    FP8LM_INPUT_CHECK(file.contains(name), path, ": missing tensor \"", t.name, "\" (or \"transformer.", t.name,
                      "\")");
    const SafetensorsTensorView& view = file.tensor(name);
    std::vector<int64_t> expected = t.shape;
    if (is_hf_conv1d_weight(t.name)) expected = {t.shape[1], t.shape[0]};
    if (is_vocabulary_table(t.name)) expected = {config.vocab_size, t.shape[1]};
    if (view.shape != expected) {
      auto text = [](const std::vector<int64_t>& shape) {
        std::string s = "[";
        for (size_t i = 0; i < shape.size(); ++i) {
          if (i) s += ',';
          s += std::to_string(shape[i]);
        }
        return s + "]";
      };
      throw InputError(path + ": tensor \"" + name + "\" has shape " + text(view.shape) + " but the config implies " +
                       text(expected));
    }
    const std::vector<float> values = read_as_float(view);
    float* p = params + t.offset;
    if (is_hf_conv1d_weight(t.name)) {
      const int64_t out = t.shape[0], in = t.shape[1];
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) p[o * in + i] = values[i * out + o];
    } else {
      std::copy(values.begin(), values.end(), p);
      if (is_vocabulary_table(t.name)) std::fill(p + values.size(), p + t.numel, 0.0f);  // padded rows
    }
  }
}

}  // namespace fp8lm
