// Tensors: the handle every op takes, and named views into one contiguous slab.
//
// Parameters, gradients and optimizer state each live in a single allocation; a
// TensorLayout says where each named tensor sits, so the gradient slab and the parameter
// slab share offsets and the optimizer can run one pass over everything.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"

namespace fp8lm {

// What a tensor's elements are. The CUDA backend stores each in its own width; the CPU
// backend stores every dtype as FP32 holding exactly the values the GPU would hold (a
// bf16 tensor holds bf16-rounded values, an FP8 one the quantized values x * scale).
enum class DType : uint8_t { f32, bf16, e4m3, e5m2 };

std::string_view to_string(DType dtype);
constexpr bool is_fp8(DType dtype) { return dtype == DType::e4m3 || dtype == DType::e5m2; }
constexpr DType dtype_of(Fp8Dtype fp8) { return fp8 == Fp8Dtype::e4m3 ? DType::e4m3 : DType::e5m2; }
constexpr Fp8Dtype fp8_dtype_of(DType dtype) { return dtype == DType::e4m3 ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2; }

// How an FP8 GEMM operand's scales are laid out (core/block_scaling.h):
//   none           - one scale for the whole tensor, its scaling state's (delayed, tensorwise)
//   tiles_1x128    - --fp8-recipe blockwise, activations and gradients: one scale per row and
//                    128 consecutive columns (the GEMM's K); the transposed copy is quantized
//                    from the high-precision values with its own 1x128 tiles
//   blocks_128x128 - --fp8-recipe blockwise, weights: one scale per 128x128 block; the
//                    transposed copy holds the same codes, its scales the blocks transposed
enum class BlockScaling : uint8_t { none, tiles_1x128, blocks_128x128 };

// The handle every op takes (Transformer Engine's tensor, reduced to what fp8lm needs):
// where the data is, what it is, its 2-D shape, and for an FP8 GEMM operand its scaling
// state (scale, scale_inv and amax slot: core/scaling.h) and, where a GEMM needs one, a
// transposed copy. The handle owns nothing. An empty handle (data == nullptr) means
// "absent" wherever an op documents an optional tensor.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0;           // row-major [rows, cols]; a vector is [1, n]
  int64_t cols = 0;
  void* transposed = nullptr;  // [cols, rows] copy of the same values (FP8 GEMM operands)
  int scaling_state = -1;      // FP8: index into the scaling state; -1 otherwise
  // Block-scaled FP8 operands only: the scale_inv of every tile (or block) of data and of the
  // transposed copy, FP32 in backend memory, laid out as cuBLASLt reads them
  // (core/block_scaling.h; sized for the buffer's largest shape).
  BlockScaling block_scaling = BlockScaling::none;
  float* block_scale_inv = nullptr;
  float* transposed_block_scale_inv = nullptr;

  // [1,1] FP32 over one float in backend memory (a loss sum, a step's scalars).
  static Tensor scalar_f32(float* value) {
    Tensor t;
    t.data = value;
    t.rows = t.cols = 1;
    return t;
  }

  int64_t numel() const { return rows * cols; }
  explicit operator bool() const { return data != nullptr; }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  // Rows [begin, begin + count) of this tensor (same dtype; no transposed copy). A
  // block-scaled operand's scale layout depends on its whole shape: its only slice is itself.
  Tensor row_slice(int64_t begin, int64_t count, size_t element_bytes) const {
    if (block_scaling != BlockScaling::none) {
      FP8LM_CHECK(begin == 0 && count == rows, "a block-scaled FP8 operand cannot be sliced into rows [", begin, ", ",
                  begin + count, ") of ", rows);
      return *this;
    }
    Tensor view = *this;
    view.data = static_cast<char*>(data) + size_t(begin) * size_t(cols) * element_bytes;
    view.rows = count;
    view.transposed = nullptr;
    return view;
  }
};

// How a tensor is split across the ranks of a tensor-parallel group (Megatron's layout):
// replicated on every rank, split along its rows (dim 0) or columns (dim 1), or split
// along its rows within each third (the packed q | k | v of c_attn: heads split).
enum class TensorSplit : uint8_t { replicated, rows, columns, qkv_rows };

struct TensorInfo {
  std::string name;            // Hugging Face GPT-2 name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major; this rank's part under tensor parallelism
  size_t offset = 0;           // elements from the slab start
  size_t numel = 0;
  bool weight_decay = false;   // AdamW decays 2-D weights only (GPT-2 practice)
  TensorSplit split = TensorSplit::replicated;
  std::vector<int64_t> full_shape;  // the whole tensor's shape (= shape when replicated)
  // Under sequence parallelism each tensor-parallel rank sees only its rows of the
  // sequence, so this replicated tensor's gradient is partial on each rank (LayerNorm
  // gains and biases, the position embedding) and is summed across the group.
  bool partial_gradient_under_sp = false;
};

class TensorLayout {
 public:
  // Appends a tensor; its offset is aligned to `alignment` elements so that every
  // tensor starts on a 16-byte boundary in any dtype used for it.
  TensorInfo& add(std::string name, std::vector<int64_t> shape, bool weight_decay, size_t alignment = 16) {
    TensorInfo info;
    info.name = std::move(name);
    info.full_shape = shape;
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
  // Appends a tensor at a given offset (a view into another layout's slab: a shard of it).
  TensorInfo& add_at(TensorInfo info) {
    total_ = std::max(total_, info.offset + info.numel);
    tensors_.push_back(std::move(info));
    return tensors_.back();
  }
  // Pads the slab so that the next tensor, and its end, start at a multiple of `multiple`.
  void pad_to_multiple(size_t multiple) { total_ = (total_ + multiple - 1) / multiple * multiple; }
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
  // The position of `name` in tensors(), or -1.
  int index_of(const std::string& name) const {
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].name == name) return static_cast<int>(i);
    return -1;
  }

 private:
  std::vector<TensorInfo> tensors_;
  size_t total_ = 0;
};

}  // namespace fp8lm
