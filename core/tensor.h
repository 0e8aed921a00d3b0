// Named views into one contiguous slab. Parameters, gradients and optimizer state
// each live in a single allocation; a TensorLayout says where each named tensor sits,
// so the gradient slab and the parameter slab share offsets and the optimizer can run
// one pass over everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fp8lm {

struct TensorInfo {
  std::string name;            // Hugging Face GPT-2 name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major
  size_t offset = 0;           // elements from the slab start
  size_t numel = 0;
  bool weight_decay = false;   // AdamW decays 2-D weights only (GPT-2 practice)
};

class TensorLayout {
 public:
  // Appends a tensor; its offset is aligned to `alignment` elements so that every
  // tensor starts on a 16-byte boundary in any dtype used for it.
  const TensorInfo& add(std::string name, std::vector<int64_t> shape, bool weight_decay, size_t alignment = 16) {
    TensorInfo info;
    info.name = std::move(name);
    info.shape = std::move(shape);
    info.numel = 1;
    for (int64_t dim : info.shape) info.numel *= static_cast<size_t>(dim);
    info.offset = (total_ + alignment - 1) / alignment * alignment;
    info.weight_decay = weight_decay;
    total_ = info.offset + info.numel;
    tensors_.push_back(std::move(info));
    return tensors_.back();
  }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  size_t total_elements() const { return total_; }  // slab size, padding included
  size_t count_parameters() const {
    size_t n = 0;
    for (const auto& t : tensors_) n += t.numel;
    return n;
  }
  const TensorInfo* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

 private:
  std::vector<TensorInfo> tensors_;
  size_t total_ = 0;
};

}  // namespace fp8lm
