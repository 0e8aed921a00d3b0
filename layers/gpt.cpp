#include "layers/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/block_scaling.h"
#include "core/error.h"
#include "core/random.h"
#include "parallel/mappings.h"

namespace fp8lm {

TensorLayout make_gpt_layout(const GptConfig& cfg) {
  const int64_t C = cfg.n_embd, F = cfg.n_inner;
  TensorLayout layout;
  layout.add("wte.weight", {cfg.padded_vocab_size(), C}, true);
  layout.add("wpe.weight", {cfg.n_positions, C}, true);
  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    layout.add(h + "ln_1.weight", {C}, false);
    layout.add(h + "ln_1.bias", {C}, false);
    layout.add(h + "attn.c_attn.weight", {3 * C, C}, true);
    layout.add(h + "attn.c_attn.bias", {3 * C}, false);
    layout.add(h + "attn.c_proj.weight", {C, C}, true);
    layout.add(h + "attn.c_proj.bias", {C}, false);
    layout.add(h + "ln_2.weight", {C}, false);
    layout.add(h + "ln_2.bias", {C}, false);
    layout.add(h + "mlp.c_fc.weight", {F, C}, true);
    layout.add(h + "mlp.c_fc.bias", {F}, false);
    layout.add(h + "mlp.c_proj.weight", {C, F}, true);
    layout.add(h + "mlp.c_proj.bias", {C}, false);
  }
  layout.add("ln_f.weight", {C}, false);
  layout.add("ln_f.bias", {C}, false);
  if (!cfg.tie_word_embeddings) layout.add("lm_head.weight", {cfg.padded_vocab_size(), C}, true);
  return layout;
}

namespace {
constexpr std::string_view kInputStateSuffix = ".input";
}  // namespace

bool is_linear_input_state(const std::string& state_name) {
  return state_name.size() >= kInputStateSuffix.size() &&
         state_name.compare(state_name.size() - kInputStateSuffix.size(), kInputStateSuffix.size(),
                            kInputStateSuffix) == 0;
}

namespace {

// How one tensor of the canonical layout has its initial values drawn: a constant for biases
// and LayerNorm gains, else N(0, std_dev) below `filled` and 0 after it (the padded
// vocabulary rows never see a token).
struct TensorDraw {
  enum class Kind { constant, normal } kind = Kind::normal;
  float constant = 0.0f;
  double std_dev = 0.0;
  size_t filled = 0;
  uint64_t key = 0;  // the tensor's streams: (seed, index in the canonical layout)
};

TensorDraw tensor_draw(const TensorInfo& t, size_t index, const GptConfig& cfg, uint64_t seed) {
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  TensorDraw draw;
  if (ends_with(t.name, ".bias") || t.shape.size() == 1) {
    draw.kind = TensorDraw::Kind::constant;
    draw.constant = ends_with(t.name, ".bias") ? 0.0f : 1.0f;  // LayerNorm gains: 1
    return draw;
  }
  const double residual_std = cfg.initializer_range / std::sqrt(2.0 * cfg.n_layer);
  draw.std_dev = ends_with(t.name, "c_proj.weight") ? residual_std : cfg.initializer_range;
  draw.filled = is_vocabulary_table(t.name) ? size_t(cfg.vocab_size) * cfg.n_embd : t.numel;
  draw.key = seed * kGoldenGamma + index * 0xD1B54A32D192ED03ull;
  return draw;
}

// Canonical elements [begin, begin + count) of a tensor into out[0, count). Each run of
// kInitStreamElements elements has its own SplitMix64 stream, Random(key + run): after one
// number skipped (to decorrelate neighbouring keys), element j of the run is
// Random::normal() of numbers 2j + 2 and 2j + 3. SplitMix64 is a counter, so those numbers
// are computed directly (hash64): a rank draws only the elements it holds, threads split
// the work anywhere, and the values are those of drawing each run in order.
void draw_elements(const TensorDraw& draw, size_t begin, size_t count, float* out) {
  if (draw.kind == TensorDraw::Kind::constant) {
    std::fill(out, out + count, draw.constant);
    return;
  }
  for (size_t k = 0; k < count; ++k) {
    const size_t i = begin + k;
    if (i >= draw.filled) {
      out[k] = 0.0f;
      continue;
    }
    const uint64_t stream = draw.key + i / kInitStreamElements;
    const uint64_t j = i % kInitStreamElements;
    double u1 = uniform_of(random_number_at(stream, 2 * j + 1));
    // Random::normal() draws again after a 0 (p = 2^-53), which shifts the rest of a run;
    // here the smallest positive uniform stands in, so only that element differs.
    if (u1 <= 0.0) u1 = 0x1.0p-53;
    const double u2 = uniform_of(random_number_at(stream, 2 * j + 2));
    out[k] = static_cast<float>(normal_of(u1, u2) * draw.std_dev);
  }
}

// (destination offset, canonical element, count) pieces of at most 64K elements, drawn in parallel.
struct DrawPiece {
  size_t destination, element, count;
};

void draw_pieces(const TensorDraw& draw, const std::vector<DrawPiece>& pieces, float* destination) {
#pragma omp parallel for schedule(dynamic, 16)
  for (size_t k = 0; k < pieces.size(); ++k)
    draw_elements(draw, pieces[k].element, pieces[k].count, destination + pieces[k].destination);
}

void add_pieces(std::vector<DrawPiece>& pieces, size_t destination, size_t element, size_t count) {
  constexpr size_t kPiece = size_t{1} << 16;
  for (size_t done = 0; done < count; done += kPiece)
    pieces.push_back({destination + done, element + done, std::min(kPiece, count - done)});
}

}  // namespace

void init_gpt_tensor(float* values, const TensorInfo& tensor, size_t index, const GptConfig& config, uint64_t seed) {
  std::vector<DrawPiece> pieces;
  add_pieces(pieces, 0, 0, tensor.numel);
  draw_pieces(tensor_draw(tensor, index, config, seed), pieces, values);
}

void init_gpt_tensor_part(float* part_values, const TensorInfo& tensor, size_t index, const GptConfig& config,
                          uint64_t seed, const TensorInfo& part, int tp_rank, int tp_size) {
  init_gpt_tensor_part_range(part_values, tensor, index, config, seed, part, tp_rank, tp_size, 0, size_t(part.numel));
}

void init_gpt_tensor_part_range(float* values, const TensorInfo& tensor, size_t index, const GptConfig& config,
                                uint64_t seed, const TensorInfo& part, int tp_rank, int tp_size, size_t begin,
                                size_t end) {
  FP8LM_CHECK(begin <= end && end <= size_t(part.numel), "init_gpt_tensor_part_range: [", begin, ", ", end,
              ") of ", part.numel, " elements of ", tensor.name);
  std::vector<DrawPiece> pieces;
  detail::for_each_part_run(part, tp_rank, tp_size, [&](size_t part_index, size_t full_index, size_t count) {
    const size_t first = std::max(part_index, begin), last = std::min(part_index + count, end);
    if (first < last) add_pieces(pieces, first - begin, full_index + (first - part_index), last - first);
  });
  draw_pieces(tensor_draw(tensor, index, config, seed), pieces, values);
}

void init_gpt_parameters(float* params, const TensorLayout& layout, const GptConfig& cfg, uint64_t seed) {
  const auto& tensors = layout.tensors();
  for (size_t index = 0; index < tensors.size(); ++index)
    init_gpt_tensor(params + tensors[index].offset, tensors[index], index, cfg, seed);
}

TensorLayout make_gpt_shard_layout(const GptConfig& cfg, int tp, int dp, std::vector<ParameterBucket>* buckets) {
  FP8LM_CHECK(tp >= 1 && dp >= 1, "parallel sizes tp=", tp, " dp=", dp);
  const int64_t C = cfg.n_embd, F = cfg.n_inner, Vp = cfg.padded_vocab_size();
  TensorLayout layout;
  auto add = [&](const std::string& name, std::vector<int64_t> full_shape, TensorSplit split, bool decay,
                 bool partial_under_sp = false) {
    std::vector<int64_t> shape = full_shape;
    if (split == TensorSplit::rows || split == TensorSplit::qkv_rows) shape[0] /= tp;
    if (split == TensorSplit::columns) shape[1] /= tp;
    TensorInfo& info = layout.add(name, shape, decay);
    info.full_shape = std::move(full_shape);
    info.split = split;
    info.partial_gradient_under_sp = partial_under_sp;
  };
  std::vector<ParameterBucket> list;
  auto bucket = [&](const std::string& name, bool linear_weights, int layer, auto&& add_tensors) {
    layout.pad_to_multiple(kBucketAlignment);
    ParameterBucket b;
    b.name = name;
    b.begin = layout.total_elements();
    b.linear_weights = linear_weights;
    b.layer = layer;
    add_tensors();
    layout.pad_to_multiple(kBucketAlignment * dp);
    b.end = layout.total_elements();
    list.push_back(b);
  };
  bucket("embedding", false, -1, [&] {
    add("wte.weight", {Vp, C}, TensorSplit::rows, true);
    add("wpe.weight", {cfg.n_positions, C}, TensorSplit::replicated, true, true);
  });
  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    bucket(h + "weights", true, l, [&] {
      add(h + "attn.c_attn.weight", {3 * C, C}, TensorSplit::qkv_rows, true);
      add(h + "attn.c_proj.weight", {C, C}, TensorSplit::columns, true);
      add(h + "mlp.c_fc.weight", {F, C}, TensorSplit::rows, true);
      add(h + "mlp.c_proj.weight", {C, F}, TensorSplit::columns, true);
    });
    // The LayerNorm parameters first and together: under sequence parallelism their
    // partial gradients are summed across the group as one range.
    bucket(h + "others", false, l, [&] {
      add(h + "ln_1.weight", {C}, TensorSplit::replicated, false, true);
      add(h + "ln_1.bias", {C}, TensorSplit::replicated, false, true);
      add(h + "ln_2.weight", {C}, TensorSplit::replicated, false, true);
      add(h + "ln_2.bias", {C}, TensorSplit::replicated, false, true);
      add(h + "attn.c_attn.bias", {3 * C}, TensorSplit::qkv_rows, false);
      add(h + "attn.c_proj.bias", {C}, TensorSplit::replicated, false);
      add(h + "mlp.c_fc.bias", {F}, TensorSplit::rows, false);
      add(h + "mlp.c_proj.bias", {C}, TensorSplit::replicated, false);
    });
  }
  // An untied LM head's weight travels with ln_f: its gradient is complete when the head's
  // backward is, before the blocks'.
  bucket("head", false, cfg.n_layer, [&] {
    add("ln_f.weight", {C}, TensorSplit::replicated, false, true);
    add("ln_f.bias", {C}, TensorSplit::replicated, false, true);
    if (!cfg.tie_word_embeddings) add("lm_head.weight", {Vp, C}, TensorSplit::rows, true);
  });
  if (buckets) *buckets = std::move(list);
  return layout;
}

namespace detail {

size_t full_index_of_part_element(const TensorInfo& info, size_t i, int tp_rank, int tp_size) {
  if (info.split == TensorSplit::replicated || tp_size == 1) return i;
  // 1-D tensors are one row of columns: [1, n] for the column logic, [n, 1] for the row logic.
  const bool matrix = info.full_shape.size() == 2;
  const size_t part_cols = matrix ? size_t(info.shape[1]) : 1;
  const size_t full_cols = matrix ? size_t(info.full_shape[1]) : 1;
  const size_t row = i / part_cols, col = i % part_cols;
  switch (info.split) {
    case TensorSplit::rows: {
      const size_t part_rows = size_t(info.shape[0]);
      return (size_t(tp_rank) * part_rows + row) * full_cols + col;
    }
    case TensorSplit::columns:
      return row * full_cols + size_t(tp_rank) * part_cols + col;
    case TensorSplit::qkv_rows: {
      // Rows are q | k | v, each [width]: this rank holds rows [rank*width/tp, +width/tp) of each.
      const size_t width = size_t(info.full_shape[0]) / 3, part_width = width / size_t(tp_size);
      const size_t third = row / part_width, within = row % part_width;
      return (third * width + size_t(tp_rank) * part_width + within) * full_cols + col;
    }
    case TensorSplit::replicated: break;
  }
  return i;
}

}  // namespace detail

DType forward_operand_dtype(GemmPrecision precision) {
  switch (precision) {
    case GemmPrecision::fp32: return DType::f32;
    case GemmPrecision::bf16: return DType::bf16;
    case GemmPrecision::fp8: return DType::e4m3;
  }
  return DType::f32;
}

std::string blockwise_shape_problem(const GptConfig& config, int micro_batch_size, int seq_length,
                                    const GptPrecision& precision, int tensor_parallel_size) {
  if (precision.gemm != GemmPrecision::fp8 || precision.fp8.recipe != ScalingRecipe::blockwise) return "";
  const int64_t tp = tensor_parallel_size;
  std::vector<std::pair<std::string, int64_t>> dimensions;
  if (precision.bf16_block_count(config.n_layer) < config.n_layer) {
    const std::string per_rank = tp > 1 ? " / tensor-parallel size " + std::to_string(tp) : "";
    dimensions = {{"n_embd", config.n_embd}, {"n_inner (MLP width)" + per_rank, config.n_inner / tp}};
    if (tp > 1) dimensions.push_back({"n_embd" + per_rank, config.n_embd / tp});
  }
  if (precision.lm_head() == GemmPrecision::fp8)
    dimensions.push_back({"the padded vocabulary" + std::string(tp > 1 ? " / tensor-parallel size" : "") +
                              " (--fp8-lm-head)",
                          config.padded_vocab_size() / tp});
  if (!dimensions.empty())
    dimensions.push_back({"--micro-batch-size x --seq-length (" + std::to_string(micro_batch_size) + " x " +
                              std::to_string(seq_length) + ")",
                          int64_t(micro_batch_size) * seq_length});
  for (const auto& [what, value] : dimensions)
    if (value % kBlockAlignment != 0)
      return "--fp8-recipe blockwise needs every FP8 GEMM dimension to be a multiple of 16 (cuBLASLt's FP8 "
             "alignment; a ragged last 1x128 tile or 128x128 block is fine): " +
             what + " is " + std::to_string(value);
  return "";
}

DType gradient_operand_dtype(GemmPrecision precision, Fp8Format format) {
  return precision == GemmPrecision::fp8 ? dtype_of(gradient_dtype(format)) : forward_operand_dtype(precision);
}

// One Linear layer: its parameters, gradients, GEMM operands and FP8 scaling states.
struct GptModel::LinearParams {
  int tensor = -1;          // the weight's index in the layout
  Tensor weight;            // [N,K] working copy (this rank's part)
  Tensor bias;              // [N] working copy; empty for the tied LM head
  Tensor weight_operand;    // [N,K] what the GEMMs read: a cast copy, or a view of `weight`
  Tensor grad_weight;       // [N,K] the gradient dtype (GptPrecision::gradients)
  Tensor grad_bias;         // [N]
  DType input_dtype = DType::f32;  // the forward input operand
  DType grad_dtype = DType::f32;   // the output-gradient operand
  int input_state = -1;            // FP8 scaling states (the weight's is weight_operand's)
  int grad_state = -1;
  bool owns_operand = false;       // weight_operand is refreshed from `weight`
};

struct GptModel::LayerNormParams {
  Tensor weight, bias;            // [C] working copy
  Tensor grad_weight, grad_bias;  // [C] the gradient dtype
};

struct GptModel::BlockParams {
  LayerNormParams ln1, ln2;
  LinearParams qkv, proj, fc, fc2;  // attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
};

// What one block's forward saves for its backward. N = the rows of the residual stream this
// rank keeps (B*T, or B*T/tp under sequence parallelism); C' and F' this rank's attention
// and MLP widths.
struct GptModel::BlockActivations {
  Tensor residual;       // [N,C] the block's input: the residual stream after the fused add
  Tensor ln1;            // [BT,C] c_attn's input operand (this rank's rows, then gathered;
                         // Scratch::layernorm_operand's data when the backward recomputes it)
  Tensor ln1_mean, ln1_rstd;  // [N]
  Tensor qkv;            // [BT,3C']
  Tensor atty;           // [BT,C'] attention output (this rank's heads)
  Tensor atty_operand;   // [BT,C'] c_proj's input operand (a view of atty when not cast;
                         // Scratch::attention_operand's data when the backward casts it again)
  Tensor lse;            // [B*NH',T]
  Tensor residual_mid;   // [N,C] residual + attention branch
  Tensor ln2;            // [BT,C] c_fc's input operand
  Tensor ln2_mean, ln2_rstd;  // [N]
  Tensor fc_pre;         // [BT,F'] c_fc output + bias, GELU's input
  Tensor gelu;           // [BT,F'] mlp.c_proj's input operand (Scratch::gelu_operand's data when
                         // the backward recomputes it)
};

// Buffers shared by every block, and the head's.
struct GptModel::Scratch {
  Tensor token_embeddings;   // [BT,C] f32: this vocabulary slice's wte rows, zeros for others
  Tensor token_rows;         // [N,C] f32: summed across the tensor-parallel group
  Tensor encoded;            // [N,C] block 0's residual input
  Tensor branch;             // [BT,C] a c_proj GEMM's output, partial under tensor parallelism
  Tensor branch_rows;        // [N,C] ... summed, waiting for the fused add
  Tensor residual_final;     // [N,C] ln_f's input
  Tensor lnf;                // [BT,C] the LM head's input operand
  Tensor lnf_mean, lnf_rstd; // [N]
  Tensor logits;             // [BT,Vs]; dlogits in place after the loss
  Tensor logits_grad;        // [BT,Vs] the LM head's gradient operand (a view of logits when not cast)
  // A per-tensor FP8 logits_grad: the loss writes its codes, and its transposed copy (the
  // wgrad's) takes the logits' storage, read by then: 1 byte an element less than a copy apart.
  bool dlogit_codes_apart = false;
  Tensor losses;             // [BT]
  Tensor ce_partials;        // [BT,3]
  Tensor ce_all;             // [tp,BT,3] every rank's partials (ce_partials itself with one rank)
  Tensor dresidual;          // [N,C] gradient of the residual stream
  Tensor dresidual_full;     // [BT,C] ... of all rows (dresidual itself without sequence parallelism)
  Tensor dln;                // [BT,C] gradient into a LayerNorm output, partial under tensor parallelism
  Tensor dln_rows;           // [N,C] ... summed (dln itself without sequence parallelism)
  Tensor datty;              // [BT,C']
  Tensor dqkv;               // [BT,3C']
  Tensor dgelu;              // [BT,F'] gradient of the GELU output
  // [BT,max(F',3C',C)] gradient operand storage, one per dtype the blocks' gradient operands
  // take (FP8 with its transpose, BF16, or the activation dtype); two when some blocks run
  // BF16 GEMMs under FP8 (--first-last-layers-bf16).
  std::vector<Tensor> grad_operands;
  // Blocks whose backward recomputes the GELU output (GptModel::recomputes_gelu_output): [BT,F']
  // mlp.c_proj's FP8 input, which every such block's forward writes and its GEMM reads at
  // once, with the transposed copy [F',BT] the GELU backward rewrites for its wgrad; and
  // mlp.c_proj's output-gradient operand [BT,C] (FP8 with its transpose), held from its dgrad
  // past the GELU backward (which writes c_fc's into grad_operands) to its wgrad.
  Tensor gelu_operand;
  Tensor fc2_grad_operand;
  // Blocks whose backward recomputes the LayerNorm outputs (GptModel::recomputes_layernorm_operand):
  // [BT,C] the FP8 input of c_attn or c_fc, which the forward's LayerNorm writes and the GEMM
  // reads at once, with the transposed copy [C,BT] the backward writes again for the wgrad.
  Tensor layernorm_operand;
  // ... and attn.c_proj's FP8 input (GptModel::recomputes_attention_operand): [BT,C'] written by
  // the attention forward and read by the GEMM at once, with the transposed copy [C',BT] the
  // backward casts again from the kept attention output for the wgrad.
  Tensor attention_operand;
};

namespace {

// Hands out consecutive 256-byte-aligned pieces of one allocation as tensors. Run once
// over a null base to size the allocation, then over the allocation.
class Carver {
 public:
  Carver(const Ops& ops, void* base) : ops_(ops), base_(static_cast<char*>(base)) {}
  // A block-scaled FP8 operand (block != none) also gets its scale arrays, FP32, for its data
  // and for its transposed copy.
  Tensor take(int64_t rows, int64_t cols, DType dtype, int scaling_state = -1, bool with_transpose = false,
              BlockScaling block = BlockScaling::none) {
    Tensor t;
    t.dtype = dtype;
    t.rows = rows;
    t.cols = cols;
    t.scaling_state = scaling_state;
    t.data = reserve(size_t(rows) * size_t(cols) * ops_.element_bytes(dtype));
    if (with_transpose) t.transposed = reserve(size_t(rows) * size_t(cols) * ops_.element_bytes(dtype));
    if (block != BlockScaling::none && is_fp8(dtype)) {
      t.block_scaling = block;
      t.block_scale_inv = static_cast<float*>(reserve(size_t(scale_count(block, rows, cols)) * sizeof(float)));
      if (with_transpose)
        t.transposed_block_scale_inv =
            static_cast<float*>(reserve(size_t(scale_count(block, cols, rows)) * sizeof(float)));
    }
    return t;
  }
  size_t size() const { return offset_ + 256; }

 private:
  void* reserve(size_t bytes) {
    offset_ = (offset_ + 255) / 256 * 256;
    void* p = base_ ? base_ + offset_ : reinterpret_cast<void*>(uintptr_t{1});  // non-null placeholder when sizing
    offset_ += bytes;
    return p;
  }
  const Ops& ops_;
  char* base_;
  size_t offset_ = 0;
};

// A [rows, cols] view of the tensor at slab offset `info.offset`.
Tensor slab_view(void* slab, DType dtype, size_t element_bytes, const TensorInfo& info) {
  Tensor t;
  t.data = static_cast<char*>(slab) + info.offset * element_bytes;
  t.dtype = dtype;
  t.rows = info.shape.size() == 2 ? info.shape[0] : 1;
  t.cols = info.shape.size() == 2 ? info.shape[1] : info.shape[0];
  return t;
}

}  // namespace

GptModel::GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision,
                   Ops& ops, const ModelParallelism& parallelism, const ActivationRecompute& recompute)
    : GptModel(config, micro_batch_size, seq_length, precision, ops, parallelism, ModelUse::train,
               InferenceShape{.batch = 0, .max_prompt = 0, .capacity = 0}, recompute) {}

GptModel::GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision,
                   Ops& ops, const ModelParallelism& parallelism, ModelUse use)
    : GptModel(config, micro_batch_size, seq_length, precision, ops, parallelism, use,
               InferenceShape{.batch = 0, .max_prompt = 0, .capacity = 0}, ActivationRecompute{}) {
  FP8LM_CHECK(use != ModelUse::decode, "a decoding model is built from an InferenceShape");
}

GptModel::GptModel(const GptConfig& config, const InferenceShape& shape, const GptPrecision& precision, Ops& ops)
    : GptModel(config, shape.batch, shape.max_prompt, precision, ops, ModelParallelism{}, ModelUse::decode, shape,
               ActivationRecompute{}) {
  FP8LM_CHECK(shape.capacity >= shape.max_prompt && shape.capacity <= config.n_positions,
              "inference model: cache capacity ", shape.capacity, " outside [", shape.max_prompt, ", ",
              config.n_positions, "]");
}

GptModel::GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision,
                   Ops& ops, const ModelParallelism& parallelism, ModelUse use, const InferenceShape& inference,
                   const ActivationRecompute& recompute)
    : config_(config),
      B_(micro_batch_size),
      T_(seq_length),
      ops_(ops),
      tp_(parallelism.tensor_parallel),
      scaling_(precision.fp8),
      activation_dtype_(ops.activation_dtype()),
      gradient_dtype_(precision.gradients),
      use_(use),
      inference_(inference),
      recompute_(recompute) {
  FP8LM_CHECK(recompute.method == ActivationRecompute::Method::none || (trains() && recompute.layers >= 1),
              "activation recomputation: a training model and at least one layer per group");
  FP8LM_CHECK(!recompute.selective() || (trains() && recompute.method == ActivationRecompute::Method::none),
              "selective recomputation: a training model, and not with full recomputation");
  FP8LM_CHECK(gradient_dtype_ == DType::f32 || gradient_dtype_ == DType::bf16, "gradients in ",
              to_string(gradient_dtype_), ": FP32 or BF16 only");
  FP8LM_CHECK(seq_length <= config.n_positions && micro_batch_size > 0);
  if (tp_ == nullptr) {
    single_rank_ = std::make_unique<TensorParallelMappings>(nullptr, false, ops);
    tp_ = single_rank_.get();
  }
  if (const std::string problem = blockwise_shape_problem(config, micro_batch_size, seq_length, precision, tp_->size());
      !problem.empty())
    throw InputError(problem, "use model widths and a token count (micro-batch x sequence) that are multiples of "
                              "16, or --fp8-recipe tensorwise");
  FP8LM_INPUT_CHECK(precision.fp8.recipe != ScalingRecipe::blockwise || precision.gemm != GemmPrecision::fp8 ||
                        !is_inference(),
                    "--fp8-recipe blockwise is for training and evaluation: decoding multiplies one row per "
                    "sequence, and cuBLASLt's block-scaled GEMMs take rows in multiples of 8");
  layout_ = make_gpt_shard_layout(config, tp_->size(), parallelism.data_parallel_size, &buckets_);
  const size_t n = layout_.total_elements();
  const size_t act_bytes = ops.element_bytes(activation_dtype_);
  // The working slab: the layout without the FP8 blocks' Linear-weight buckets when those have no
  // working copy. Whole buckets go (multiples of kBucketAlignment elements), so every other
  // tensor keeps its alignment.
  FP8LM_CHECK(precision.fp8_linear_working_copy || activation_dtype_ != DType::f32,
              "only a BF16 working copy can leave out the FP8 Linear weights (the FP32 one is the master)");
  auto dropped_bucket = [&](const ParameterBucket& bucket) {
    return !precision.fp8_linear_working_copy && bucket.linear_weights &&
           precision.block(bucket.layer, config.n_layer) == GemmPrecision::fp8;
  };
  working_offsets_.assign(layout_.tensors().size(), 0);
  size_t dropped = 0;  // elements of the dropped buckets before the current one
  for (size_t k = 0, b = 0; k < layout_.tensors().size(); ++k) {
    const TensorInfo& t = layout_.tensors()[k];
    while (b < buckets_.size() && buckets_[b].end <= t.offset) {
      if (dropped_bucket(buckets_[b])) dropped += buckets_[b].end - buckets_[b].begin;
      ++b;
    }
    FP8LM_CHECK(b < buckets_.size() && buckets_[b].begin <= t.offset, "tensor ", t.name, " is in no bucket");
    working_offsets_[k] = dropped_bucket(buckets_[b]) ? kNoWorkingValue : t.offset - dropped;
  }
  size_t working_elements = 0;
  for (size_t k = 0; k < layout_.tensors().size(); ++k)
    if (working_offsets_[k] != kNoWorkingValue)
      working_elements = std::max<size_t>(working_elements, working_offsets_[k] + layout_.tensors()[k].numel);
  const bool compact = std::count(working_offsets_.begin(), working_offsets_.end(), kNoWorkingValue) > 0;
  working_ = ops.allocate((compact ? working_elements : n) * act_bytes);
  if (compact) {
    working_offsets_backend_ = ops.allocate(working_offsets_.size() * sizeof(uint64_t));
    ops.upload(working_offsets_backend_->data(), working_offsets_.data(), working_offsets_.size() * sizeof(uint64_t));
  }
  const size_t grad_bytes = ops.element_bytes(gradient_dtype_);
  if (trains()) gradients_ = ops.allocate(n * grad_bytes);

  auto find = [&](const std::string& name) -> const TensorInfo& {
    const TensorInfo* info = layout_.find(name);
    FP8LM_CHECK(info != nullptr, "no parameter ", name);
    return *info;
  };
  // A tensor's working copy; without one, its shape alone (no data).
  auto working = [&](const std::string& name) {
    TensorInfo info = find(name);
    const uint64_t offset = working_offsets_[size_t(layout_.index_of(name))];
    info.offset = offset == kNoWorkingValue ? 0 : offset;
    Tensor view = slab_view(working_->data(), activation_dtype_, act_bytes, info);
    if (offset == kNoWorkingValue) view.data = nullptr;
    return view;
  };
  auto grad = [&](const std::string& name) {
    return gradients_ ? slab_view(gradients_->data(), gradient_dtype_, grad_bytes, find(name)) : Tensor{};
  };

  // Linear layers: parameters and FP8 scaling states, registered in the order checkpoints
  // name them (per block: c_attn, attn.c_proj, c_fc, mlp.c_proj; then the head).
  auto make_linear = [&](const std::string& name, const std::string& weight_name, bool has_bias,
                         GemmPrecision gemm_precision) {
    LinearParams linear;
    linear.tensor = layout_.index_of(weight_name);
    linear.weight = working(weight_name);
    linear.grad_weight = grad(weight_name);
    if (has_bias) {
      linear.bias = working(name + ".bias");
      linear.grad_bias = grad(name + ".bias");
    }
    linear.input_dtype = forward_operand_dtype(gemm_precision);
    linear.grad_dtype = gradient_operand_dtype(gemm_precision, precision.fp8.format);
    linear.weight_operand = linear.weight;
    linear.weight_operand.dtype = forward_operand_dtype(gemm_precision);
    if (gemm_precision == GemmPrecision::fp8) {
      linear.input_state = scaling_.add(name + std::string(kInputStateSuffix), fp8_dtype_of(linear.input_dtype));
      linear.weight_operand.scaling_state = scaling_.add(name + ".weight", fp8_dtype_of(linear.weight_operand.dtype));
      linear.grad_state = scaling_.add(name + ".grad_output", fp8_dtype_of(linear.grad_dtype));
    }
    linear.owns_operand = linear.weight_operand.dtype != activation_dtype_;
    return linear;
  };
  for (int l = 0; l < config.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    BlockParams block;
    block.ln1 = {working(h + "ln_1.weight"), working(h + "ln_1.bias"), grad(h + "ln_1.weight"), grad(h + "ln_1.bias")};
    block.ln2 = {working(h + "ln_2.weight"), working(h + "ln_2.bias"), grad(h + "ln_2.weight"), grad(h + "ln_2.bias")};
    LinearParams* linears[4] = {&block.qkv, &block.proj, &block.fc, &block.fc2};
    for (int i = 0; i < 4; ++i) {
      const std::string name = h + kBlockLinearNames[i];
      *linears[i] = make_linear(name, name + ".weight", true, precision.block(l, config.n_layer));
    }
    blocks_.push_back(std::move(block));
  }
  // A block whose Linears run in BF16 has no FP8 weights: its weight bucket travels in the
  // working copy's dtype, as every non-Linear bucket does.
  for (ParameterBucket& bucket : buckets_)
    if (bucket.linear_weights && precision.block(bucket.layer, config.n_layer) != GemmPrecision::fp8)
      bucket.linear_weights = false;
  lm_head_ = std::make_unique<LinearParams>(make_linear(
      "lm_head", config.tie_word_embeddings ? "wte.weight" : "lm_head.weight", false, precision.lm_head()));
  ln_f_ = std::make_unique<LayerNormParams>(
      LayerNormParams{working("ln_f.weight"), working("ln_f.bias"), grad("ln_f.weight"), grad("ln_f.bias")});
  wte_ = working("wte.weight");
  grad_wte_ = grad("wte.weight");
  wpe_ = working("wpe.weight");
  grad_wpe_ = grad("wpe.weight");

  // Weight operands that are not views of the working copy get their own buffers.
  std::vector<LinearParams*> owned;
  for (BlockParams& block : blocks_)
    for (LinearParams* linear : {&block.qkv, &block.proj, &block.fc, &block.fc2})
      if (linear->owns_operand) owned.push_back(linear);
  if (lm_head_->owns_operand) owned.push_back(lm_head_.get());
  // Under --fp8-recipe blockwise an FP8 weight takes 128x128 block scales, for W and W^T.
  const BlockScaling weight_blocks = precision.fp8.recipe == ScalingRecipe::blockwise ? BlockScaling::blocks_128x128
                                                                                       : BlockScaling::none;
  // The transposed copy serves dgrad: only a training model runs the backward.
  const bool keeps_weight_transposes = trains() && precision.fp8_weight_transpose_cache;
  FP8LM_CHECK(precision.fp8_weight_transpose_cache || weight_blocks == BlockScaling::none,
              "FP8 weights without a transposed copy need per-tensor scaling, not --fp8-recipe blockwise");
  auto carve_operands = [&](void* base) {
    Carver carver(ops_, base);
    int64_t largest_fp8_weight = 0;
    for (LinearParams* linear : owned) {
      const Tensor& w = linear->weight;
      const DType dtype = linear->weight_operand.dtype;
      const int state = linear->weight_operand.scaling_state;
      linear->weight_operand =
          carver.take(w.rows, w.cols, dtype, state, is_fp8(dtype) && keeps_weight_transposes, weight_blocks);
      if (is_fp8(dtype)) largest_fp8_weight = std::max(largest_fp8_weight, w.numel());
    }
    if (trains() && !keeps_weight_transposes && largest_fp8_weight > 0)
      shared_weight_transpose_ = carver.take(largest_fp8_weight, 1, DType::e4m3).data;
    return carver.size();
  };
  if (!owned.empty()) {
    weight_operands_ = ops.allocate(carve_operands(nullptr));
    carve_operands(weight_operands_->data());
  }

  plan_memory();
  if (is_inference()) plan_kv_cache();
  ops.attach_scaling(scaling_);
}

GptModel::~GptModel() = default;

VocabSlice GptModel::vocab_slice() const {
  const int slice = config_.padded_vocab_size() / tp_->size();
  return VocabSlice{tp_->rank() * slice, slice, config_.vocab_size};
}

Tensor GptModel::local_rows(const Tensor& full) const { return tp_->local_view(full); }

void GptModel::plan_memory() {
  const int tp = tp_->size();
  const int64_t BT = int64_t(B_) * T_, C = config_.n_embd;
  const int64_t F = config_.n_inner / tp, Cl = C / tp, NH = config_.n_head / tp;
  const int64_t N = tp_->local_rows(BT), Vs = vocab_slice().size, L = config_.n_layer;
  const bool sp = tp_->sequence_parallel();
  const DType act = activation_dtype_;
  const bool training = trains(), decoding = is_inference(), evaluating = use_ == ModelUse::evaluate;
  // A GEMM operand of `dtype`. A decoding model shares one block's buffers among all
  // blocks, whose operand dtypes may differ: its buffers take the widest (activation) size.
  auto stamped = [](Tensor t, DType dtype, int state) {
    t.dtype = dtype;
    t.scaling_state = state;
    return t;
  };
  // Under --fp8-recipe blockwise every FP8 activation and gradient operand takes 1x128 tile
  // scales and a transposed copy quantized with its own tiles (the wgrad GEMM's operand: FP8
  // codes cannot be transposed into another tiling).
  const bool blockwise = scaling_.config().recipe == ScalingRecipe::blockwise;
  const BlockScaling tiles = blockwise ? BlockScaling::tiles_1x128 : BlockScaling::none;
  auto carve = [&](void* base) {
    Carver c(ops_, base);
    auto operand = [&](int64_t rows, int64_t cols, DType dtype, int state) {
      if (decoding) return stamped(c.take(rows, cols, act), dtype, state);
      return c.take(rows, cols, dtype, state, blockwise && is_fp8(dtype), tiles);
    };
    Scratch s;
    s.token_embeddings = c.take(BT, C, DType::f32);
    s.token_rows = sp ? c.take(N, C, DType::f32) : s.token_embeddings;
    s.encoded = c.take(N, C, act);
    saved_.assign(L, BlockActivations{});
    Tensor shared_atty_operand;  // decoding: c_proj's input when it is not the activation dtype
    // Carved when a block first needs it (the same place in both carving passes).
    auto gelu_operand = [&]() -> const Tensor& {
      if (!s.gelu_operand) {
        const BlockParams& fp8_block = *std::find_if(blocks_.begin(), blocks_.end(),
                                                     [&](const BlockParams& w) { return recomputes_gelu_output(w); });
        s.gelu_operand = c.take(BT, F, fp8_block.fc2.input_dtype, fp8_block.fc2.input_state, /*with_transpose=*/true);
        s.fc2_grad_operand = c.take(BT, C, fp8_block.fc2.grad_dtype, -1, /*with_transpose=*/true);
      }
      return s.gelu_operand;
    };
    // Carved when a block first needs it (the same place in both carving passes).
    auto layernorm_operand = [&](const LinearParams& linear) {
      if (!s.layernorm_operand)
        s.layernorm_operand = c.take(BT, C, linear.input_dtype, linear.input_state, /*with_transpose=*/true);
      Tensor forward_codes = stamped(s.layernorm_operand, linear.input_dtype, linear.input_state);
      forward_codes.transposed = nullptr;  // the forward writes the codes; the backward the transpose
      return forward_codes;
    };
    // A LayerNorm output operand of `linear` (c_attn or c_fc): shared when the backward
    // recomputes it, else its own or selective recomputation's set's.
    auto ln_operand = [&](const LinearParams& linear, const Tensor* selective) {
      if (recomputes_layernorm_operand(linear)) return layernorm_operand(linear);
      if (selective) return stamped(*selective, linear.input_dtype, linear.input_state);
      return operand(BT, C, linear.input_dtype, linear.input_state);
    };
    // Blocks whose GEMM operands have the same dtypes can share buffers.
    using OperandDtypes = std::tuple<DType, DType, DType, DType>;
    auto operand_dtypes = [](const BlockParams& w) {
      return OperandDtypes{w.qkv.input_dtype, w.proj.input_dtype, w.fc.input_dtype, w.fc2.input_dtype};
    };
    // A block's buffers but its input, with block w's operand dtypes and scaling states; the
    // tensors selective recomputation rewrites are those of `shared` when given.
    auto carve_block = [&](BlockActivations& a, const BlockParams& w, const BlockActivations* shared = nullptr) {
      const bool share_ln = shared && recompute_.layernorm, share_mlp = shared && recompute_.mlp;
      a.ln1 = ln_operand(w.qkv, share_ln ? &shared->ln1 : nullptr);
      a.ln1_mean = c.take(N, 1, DType::f32);
      a.ln1_rstd = c.take(N, 1, DType::f32);
      a.qkv = c.take(BT, 3 * Cl, act);
      a.atty = c.take(BT, Cl, act);
      if (decoding) shared_atty_operand = c.take(BT, Cl, act);
      if (w.proj.input_dtype == act) {
        a.atty_operand = a.atty;
      } else if (decoding) {
        a.atty_operand = stamped(shared_atty_operand, w.proj.input_dtype, w.proj.input_state);
      } else if (recomputes_attention_operand(w.proj)) {
        if (!s.attention_operand)
          s.attention_operand = c.take(BT, Cl, w.proj.input_dtype, w.proj.input_state, /*with_transpose=*/true);
        a.atty_operand = stamped(s.attention_operand, w.proj.input_dtype, w.proj.input_state);
        a.atty_operand.transposed = nullptr;  // the forward writes the codes; the backward the transpose
      } else {
        a.atty_operand = operand(BT, Cl, w.proj.input_dtype, w.proj.input_state);
      }
      a.lse = c.take(int64_t(B_) * NH, T_, DType::f32);
      a.residual_mid = c.take(N, C, act);
      a.ln2 = ln_operand(w.fc, share_ln ? &shared->ln2 : nullptr);
      a.ln2_mean = c.take(N, 1, DType::f32);
      a.ln2_rstd = c.take(N, 1, DType::f32);
      a.fc_pre = share_mlp ? shared->fc_pre : c.take(BT, F, act);
      if (recomputes_gelu_output(w)) {
        a.gelu = stamped(gelu_operand(), w.fc2.input_dtype, w.fc2.input_state);
        a.gelu.transposed = nullptr;  // the forward writes the codes; the backward the transpose
      } else {
        a.gelu = share_mlp ? stamped(shared->gelu, w.fc2.input_dtype, w.fc2.input_state)
                           : operand(BT, F, w.fc2.input_dtype, w.fc2.input_state);
      }
    };
    // Buffers shared with other blocks, stamped with block w's operand dtypes and scaling
    // states (c_proj's input, when not the activation itself, from `atty_operand_buffer`).
    auto stamp_operands = [&](BlockActivations& a, const BlockParams& w, const Tensor& atty_operand_buffer) {
      a.ln1 = stamped(a.ln1, w.qkv.input_dtype, w.qkv.input_state);
      a.atty_operand = w.proj.input_dtype == act ? a.atty
                                                 : stamped(atty_operand_buffer, w.proj.input_dtype, w.proj.input_state);
      a.ln2 = stamped(a.ln2, w.fc.input_dtype, w.fc.input_state);
      a.gelu = stamped(a.gelu, w.fc2.input_dtype, w.fc2.input_state);
    };
    // Selective recomputation's sets, carved when first needed (the same order in both passes).
    std::map<OperandDtypes, BlockActivations> selective_sets;
    auto selective_set = [&](const BlockParams& w) -> const BlockActivations* {
      if (!training || !recompute_.selective()) return nullptr;
      const auto [found, fresh] = selective_sets.try_emplace(operand_dtypes(w));
      BlockActivations& set = found->second;
      if (fresh && recompute_.layernorm) {
        if (!recomputes_layernorm_operand(w.qkv)) set.ln1 = operand(BT, C, w.qkv.input_dtype, w.qkv.input_state);
        if (!recomputes_layernorm_operand(w.fc)) set.ln2 = operand(BT, C, w.fc.input_dtype, w.fc.input_state);
      }
      if (fresh && recompute_.mlp) {
        set.fc_pre = c.take(BT, F, act);
        if (!recomputes_gelu_output(w)) set.gelu = operand(BT, F, w.fc2.input_dtype, w.fc2.input_state);
      }
      return &set;
    };
    // Recomputed blocks share `sets` sets of buffers per operand dtype combination, set k
    // taking the k-th block of every group (its input buffer too, for k > 0: only a group's
    // first block keeps its own). Every position for every combination among the recomputed
    // blocks (the memory estimate counts them so), carved in the order first met, the same in
    // both carving passes.
    std::map<std::pair<OperandDtypes, int>, BlockActivations> recompute_sets;
    const int sets = training ? int(recompute_.buffer_sets(L)) : 0;
    for (int64_t l = 0; l < L && sets > 0; ++l) {
      if (!recompute_.recomputes(int(l)) || recompute_sets.count({operand_dtypes(blocks_[l]), 0})) continue;
      for (int position = 0; position < sets; ++position) {
        BlockActivations& set = recompute_sets[{operand_dtypes(blocks_[l]), position}];
        if (position > 0) set.residual = c.take(N, C, act);
        carve_block(set, blocks_[l]);
      }
    }
    // Evaluation: one set of block buffers per operand dtype combination (the residual stream
    // is s.encoded for every block, as in decoding), carved when first met.
    std::map<OperandDtypes, BlockActivations> evaluation_sets;
    for (int64_t l = 0; l < L; ++l) {
      const BlockParams& w = blocks_[l];
      BlockActivations& a = saved_[l];
      if (decoding && l > 0) {
        // Block l runs after block l-1 is done with the buffers: the same ones, its own dtypes.
        a = saved_[0];
        stamp_operands(a, w, shared_atty_operand);
        continue;
      }
      if (evaluating) {
        // Block l reads the stream (s.encoded) in ln_1 and c_proj's epilogue, and its mlp.c_proj
        // writes the next block's stream there from residual_mid: in place across blocks, never
        // within one kernel.
        const auto [found, fresh] = evaluation_sets.try_emplace(operand_dtypes(w));
        if (fresh) carve_block(found->second, w);
        a = found->second;
        a.residual = s.encoded;
        stamp_operands(a, w, a.atty_operand);
        continue;
      }
      if (sets > 0 && recompute_.recomputes(int(l))) {
        // The set's buffers with this block's scaling states; its own input at a group's start.
        const int position = int(l) - recompute_.group_begin(int(l));
        a = recompute_sets.at({operand_dtypes(w), position});
        if (position == 0) a.residual = l == 0 ? s.encoded : c.take(N, C, act);
        stamp_operands(a, w, a.atty_operand);
        continue;
      }
      a.residual = l == 0 ? s.encoded : c.take(N, C, act);
      carve_block(a, w, selective_set(w));
    }
    s.branch = c.take(BT, C, act);
    s.branch_rows = sp ? c.take(N, C, act) : s.branch;
    s.residual_final = c.take(N, C, act);
    s.lnf = decoding ? c.take(BT, C, lm_head_->input_dtype, lm_head_->input_state)
                     : operand(BT, C, lm_head_->input_dtype, lm_head_->input_state);
    s.lnf_mean = c.take(N, 1, DType::f32);
    s.lnf_rstd = c.take(N, 1, DType::f32);
    if (decoding) {
      // Decoding computes the logits of one token per sequence; nothing runs backward.
      s.logits = c.take(B_, Vs, act);
      scratch_ = std::make_unique<Scratch>(s);
      return c.size();
    }
    s.logits = c.take(BT, Vs, act);
    s.losses = c.take(BT, 1, DType::f32);
    s.ce_partials = c.take(BT, 3, DType::f32);
    s.ce_all = tp > 1 ? c.take(tp * BT, 3, DType::f32) : s.ce_partials;
    if (evaluating) {
      scratch_ = std::make_unique<Scratch>(s);
      return c.size();
    }
    const DType head_grad = lm_head_->grad_dtype;
    s.dlogit_codes_apart = per_tensor_fp8(head_grad);
    if (head_grad == act) {
      s.logits_grad = s.logits;
    } else if (s.dlogit_codes_apart) {
      FP8LM_CHECK(ops_.element_bytes(act) >= ops_.element_bytes(head_grad),
                  "the LM head's FP8 gradient operand does not fit the logits' storage");
      s.logits_grad = c.take(BT, Vs, head_grad, lm_head_->grad_state);
      s.logits_grad.transposed = s.logits.data;
    } else {
      s.logits_grad = c.take(BT, Vs, head_grad, lm_head_->grad_state, is_fp8(head_grad), tiles);
    }
    s.dresidual = c.take(N, C, act);
    s.dresidual_full = sp ? c.take(BT, C, act) : s.dresidual;
    s.dln = c.take(BT, C, act);
    s.dln_rows = sp ? c.take(N, C, act) : s.dln;
    s.datty = c.take(BT, Cl, act);
    s.dqkv = c.take(BT, 3 * Cl, act);
    s.dgelu = c.take(BT, F, act);
    std::vector<DType> grad_dtypes;
    for (const BlockParams& block : blocks_)
      if (std::find(grad_dtypes.begin(), grad_dtypes.end(), block.fc.grad_dtype) == grad_dtypes.end())
        grad_dtypes.push_back(block.fc.grad_dtype);
    // Block scales sized for the widest gradient (BT rows either way): an operand's layout
    // follows its own shape, and the widest needs the most floats.
    for (DType grad_dtype : grad_dtypes)
      s.grad_operands.push_back(c.take(BT, std::max({F, 3 * Cl, C}), grad_dtype, -1, is_fp8(grad_dtype), tiles));
    scratch_ = std::make_unique<Scratch>(s);
    return c.size();
  };
  activations_ = ops_.allocate(carve(nullptr));
  carve(activations_->data());

  ModelShape shape;
  shape.B = B_;
  shape.T = T_;
  shape.C = int(C);
  shape.local_width = int(Cl);
  shape.local_ffn = int(F);
  shape.local_heads = int(NH);
  shape.vocab_slice = int(Vs);
  shape.cache_capacity = is_inference() ? inference_.capacity : 0;
  ops_.plan_workspace(shape);
}

// The key/value cache of an inference model: per block, keys and values [B*capacity, C'],
// and their two scales, in one allocation.
void GptModel::plan_kv_cache() {
  const int64_t L = config_.n_layer, C = config_.n_embd;
  const DType dtype = inference_.fp8_kv_cache ? DType::e4m3 : activation_dtype_;
  const int64_t rows = int64_t(B_) * inference_.capacity;
  auto carve = [&](void* base) {
    Carver c(ops_, base);
    const Tensor scales = c.take(2 * L, 1, DType::f32);
    kv_.assign(size_t(L), KvCache{});
    for (int64_t l = 0; l < L; ++l) {
      KvCache& cache = kv_[size_t(l)];
      cache.keys = c.take(rows, C, dtype);
      cache.values = c.take(rows, C, dtype);
      cache.scales = static_cast<float*>(scales.data) + 2 * l;
      cache.capacity = inference_.capacity;
    }
    return c.size();
  };
  kv_cache_ = ops_.allocate(carve(nullptr));
  carve(kv_cache_->data());
}

// ---- Forward --------------------------------------------------------------------------

namespace {

// The first `rows` rows of an activation buffer (a chunk shorter than the buffer).
Tensor first_rows(Tensor t, int64_t rows) {
  FP8LM_CHECK(rows <= t.rows, "a chunk of ", rows, " rows in a buffer of ", t.rows);
  t.rows = rows;
  return t;
}

}  // namespace

// A row-parallel Linear (c_proj) whose output joins the residual stream:
//   residual_out = residual_in + input . W^T + bias.
// On one tensor-parallel rank the GEMM's epilogue adds the residual and the bias before
// its one rounding. Under tensor parallelism each rank holds a partial product, so the
// products are reduced first and the next LayerNorm adds them, with the bias, once.
GptModel::ResidualAdd GptModel::row_parallel_forward(const LinearParams& linear, const Tensor& input,
                                                     const Tensor& residual_in, const Tensor& residual_out) {
  const Scratch& s = *scratch_;
  if (tp_->size() == 1) {
    ops_.gemm({.pass = GemmPass::forward, .out = residual_out, .input = input, .weight = linear.weight_operand,
               .bias = linear.bias, .residual = residual_in});
    return {.residual_in = residual_out};
  }
  ops_.gemm({.pass = GemmPass::forward, .out = s.branch, .input = input, .weight = linear.weight_operand});
  tp_->row_parallel_output(s.branch, s.branch_rows);
  return {.residual_in = residual_in, .residual_out = residual_out, .branch = s.branch_rows, .branch_bias = linear.bias};
}

// A LayerNorm that feeds column-parallel linears: it takes the residual stream after
// `input`'s pending add, normalizes this rank's rows into `out`, and gathers all rows.
void GptModel::layernorm_forward(const LayerNormParams& ln, const ResidualAdd& input, const Tensor& out,
                                 const Tensor& mean, const Tensor& rstd) {
  ops_.layernorm_forward(layernorm_call(ln, input, out, mean, rstd));
  tp_->column_parallel_input(out);
}

LayerNormForward GptModel::layernorm_call(const LayerNormParams& ln, const ResidualAdd& input, const Tensor& out,
                                          const Tensor& mean, const Tensor& rstd) const {
  return {.out = local_rows(out),
          .mean = mean,
          .rstd = rstd,
          .residual_out = input.residual_out,
          .residual_in = input.residual_in,
          .branch = input.branch,
          .branch_bias = input.branch_bias,
          .weight = ln.weight,
          .bias = ln.bias,
          .eps = config_.layer_norm_epsilon};
}

// A LayerNorm and the column-parallel GEMM that reads its output (gemm.input) as one op, which
// a backend may fuse (Ops::layernorm_to_gemm). Under tensor parallelism the output is gathered
// between the two, so they stay two ops.
void GptModel::layernorm_to_gemm(const LayerNormParams& ln, const ResidualAdd& input, const Tensor& mean,
                                 const Tensor& rstd, const GemmCall& gemm) {
  if (tp_->size() > 1) {
    layernorm_forward(ln, input, gemm.input, mean, rstd);
    return ops_.gemm(gemm);
  }
  ops_.layernorm_to_gemm({.layernorm = layernorm_call(ln, input, gemm.input, mean, rstd), .gemm = gemm});
}

void GptModel::forward(const TokenBatch& batch) {
  const Scratch& s = *scratch_;
  before_forward(-1);
  // The vocabulary-parallel embedding: this slice's rows, summed across the group.
  ops_.embedding_lookup(s.token_embeddings, batch, wte_, vocab_slice());
  tp_->row_parallel_output(s.token_embeddings, s.token_rows);
  ops_.add_position_embedding(s.encoded, s.token_rows, wpe_, int(tp_->first_local_row(s.token_embeddings.rows)), T_,
                              /*stored_wpe_row=*/nullptr, batch.position_ids);
  document_starts_ = batch.document_starts;
  const Chunk whole{.B = B_, .T = T_, .document_starts = document_starts_};
  for (int l = 0; l < config_.n_layer; ++l) {
    before_forward(l);
    block_forward(l, whole);
  }
  before_forward(config_.n_layer);
  // ln_f adds the last block's MLP output into the residual stream first (when its GEMM did not).
  layernorm_forward(*ln_f_, block_output_, s.lnf, s.lnf_mean, s.lnf_rstd);
  ops_.gemm({.pass = GemmPass::forward, .out = s.logits, .input = s.lnf, .weight = lm_head_->weight_operand});
}

void GptModel::block_forward(int l, const Chunk& chunk) {
  const BlockParams& w = blocks_[l];
  const BlockActivations& a = saved_[l];
  const Scratch& s = *scratch_;
  // A chunk of an inference model fills the first rows of the buffers.
  const int64_t chunk_rows = int64_t(chunk.B) * chunk.T;
  auto rows = [&](const Tensor& t) { return chunk.cached ? first_rows(t, chunk_rows) : t; };

  // ln_1 adds the previous block's MLP output (and its bias) into the residual stream,
  // when its GEMM did not.
  const ResidualAdd input = l == 0 ? ResidualAdd{.residual_in = rows(s.encoded)} : block_output_;
  block_forward_to_mlp(l, chunk, input);
  const bool last = l + 1 == config_.n_layer;
  block_output_ = row_parallel_forward(w.fc2, rows(a.gelu), rows(a.residual_mid),
                                       rows(last ? s.residual_final : saved_[l + 1].residual));
}

void GptModel::block_forward_to_mlp(int l, const Chunk& chunk, const ResidualAdd& input) {
  const BlockParams& w = blocks_[l];
  const BlockActivations& a = saved_[l];
  const int tp = tp_->size();
  const AttentionShape heads{.B = chunk.B,
                             .T = chunk.T,
                             .heads = config_.n_head / tp,
                             .head_size = config_.n_embd / config_.n_head,
                             .document_starts = chunk.document_starts};
  const int64_t chunk_rows = int64_t(chunk.B) * chunk.T;
  auto rows = [&](const Tensor& t) { return chunk.cached ? first_rows(t, chunk_rows) : t; };
  layernorm_to_gemm(w.ln1, input, rows(a.ln1_mean), rows(a.ln1_rstd),
                    {.pass = GemmPass::forward, .out = rows(a.qkv), .input = rows(a.ln1),
                     .weight = w.qkv.weight_operand, .bias = w.qkv.bias});
  if (chunk.cached) {
    attention_cached(l, chunk, heads);
  } else {
    ops_.attention_forward(a.atty, a.atty_operand, a.lse, a.qkv, heads);
  }
  const ResidualAdd attention_output =
      row_parallel_forward(w.proj, rows(a.atty_operand), rows(a.residual), rows(a.residual_mid));
  layernorm_to_gemm(w.ln2, attention_output, rows(a.ln2_mean), rows(a.ln2_rstd),
                    fc_gelu_call(w, rows(a.ln2), rows(a.fc_pre), rows(a.gelu)));
}

// mlp.c_fc and the GELU in one GEMM (its epilogue): fc_pre keeps c_fc's output for the GELU
// backward, and gelu is mlp.c_proj's input operand.
GemmCall GptModel::fc_gelu_call(const BlockParams& w, const Tensor& ln2, const Tensor& fc_pre, const Tensor& gelu) {
  return {.pass = GemmPass::forward,
          .out = gelu,
          .input = ln2,
          .weight = w.fc.weight_operand,
          .bias = w.fc.bias,
          .gelu_input = fc_pre};
}

void GptModel::recompute_forward(int begin, int last) {
  // The same values as the forward's, cast with the same scales: nothing to record (nor count).
  ops_.set_amax_recording(AmaxRecording::off);
  const Chunk whole{.B = B_, .T = T_, .document_starts = document_starts_};
  ResidualAdd input{.residual_in = saved_[begin].residual};
  for (int l = begin; l <= last; ++l) {
    block_forward_to_mlp(l, whole, input);
    if (l < last) {
      const BlockActivations& a = saved_[l];
      input = row_parallel_forward(blocks_[l].fc2, a.gelu, a.residual_mid, saved_[l + 1].residual);
    }
  }
  ops_.set_amax_recording(AmaxRecording::on);
}

void GptModel::recompute_selective(int l) {
  const BlockParams& w = blocks_[l];
  const BlockActivations& a = saved_[l];
  // The forward's values from its kept inputs: the plain LayerNorm of the stored residual
  // stream is the fused add's output bit for bit (layers/layernorm.h), and the scales have not
  // moved since the forward. Nothing is recorded or counted twice.
  ops_.set_amax_recording(AmaxRecording::off);
  // A LayerNorm output the backward recomputes for its wgrad (recomputes_layernorm_operand) is
  // not kept; `mlp` still needs ln_2's codes for the c_fc GEMM below.
  const bool ln1_again = recompute_.layernorm && !recomputes_layernorm_operand(w.qkv);
  const bool ln2_again = recomputes_layernorm_operand(w.fc) ? recompute_.mlp : recompute_.layernorm;
  if (ln1_again) layernorm_forward(w.ln1, {.residual_in = a.residual}, a.ln1, a.ln1_mean, a.ln1_rstd);
  if (ln2_again) layernorm_forward(w.ln2, {.residual_in = a.residual_mid}, a.ln2, a.ln2_mean, a.ln2_rstd);
  if (recompute_.mlp) ops_.gemm(fc_gelu_call(w, a.ln2, a.fc_pre, a.gelu));
  ops_.set_amax_recording(AmaxRecording::on);
}

void GptModel::attention_cached(int l, const Chunk& chunk, const AttentionShape& heads) {
  const BlockActivations& a = saved_[l];
  const int64_t chunk_rows = int64_t(chunk.B) * chunk.T;
  const KvCache& cache = kv_[size_t(l)];
  const Tensor qkv = first_rows(a.qkv, chunk_rows);
  if (chunk.position.value == 0) {
    // A prompt: causal attention among its own tokens, as in training.
    ops_.kv_cache_append(cache, qkv, heads, chunk.position);
    Tensor lse = a.lse;
    lse.rows = int64_t(chunk.B) * heads.heads;
    lse.cols = chunk.T;
    ops_.attention_forward(first_rows(a.atty, chunk_rows), first_rows(a.atty_operand, chunk_rows), lse, qkv, heads);
  } else {
    // One new token: attention_decode appends its key and value first.
    ops_.attention_decode(first_rows(a.atty, chunk_rows), first_rows(a.atty_operand, chunk_rows), qkv, cache, heads,
                          chunk.position);
  }
}

void GptModel::forward_cached(const TokenBatch& batch, int position, bool record_amaxes) {
  FP8LM_CHECK(is_inference(), "forward_cached needs a model built for inference");
  const int n = batch.T;
  FP8LM_CHECK(batch.B == B_ && n >= 1 && n <= T_, "forward_cached: a chunk of [", batch.B, ",", n,
              "] in a model of batch ", B_, " and prompts of up to ", T_, " tokens");
  FP8LM_CHECK(position >= 0 && position + n <= inference_.capacity, "forward_cached: positions [", position, ", ",
              position + n, ") beyond the cache's ", inference_.capacity);
  FP8LM_CHECK(position == 0 || n == 1, "forward_cached: after the prompt, one token per sequence at a time");
  FP8LM_CHECK(batch.document_starts == nullptr && batch.position_ids == nullptr,
              "forward_cached: a decoded sequence is one document (its batch carries no document index)");
  FP8LM_CHECK(batch.step_position == nullptr || (n == 1 && position > 0),
              "forward_cached: a stored step position is for one-token steps after the prompt");
  const Chunk chunk{.B = batch.B, .T = n, .position = {.value = position, .stored = batch.step_position}, .cached = true};
  const int64_t chunk_rows = int64_t(batch.B) * n;
  const Scratch& s = *scratch_;
  ops_.set_amax_recording(record_amaxes ? AmaxRecording::on : AmaxRecording::off_any_plan);
  ops_.embedding_lookup(first_rows(s.token_embeddings, chunk_rows), batch, wte_, vocab_slice());
  // A stored position is read by the kernel (the whole table from its row); otherwise the
  // table's rows from `position` on.
  const Tensor positions =
      batch.step_position ? wpe_ : wpe_.row_slice(position, n, ops_.element_bytes(wpe_.dtype));
  ops_.add_position_embedding(first_rows(s.encoded, chunk_rows), first_rows(s.token_rows, chunk_rows), positions,
                              /*first_row=*/0, n, batch.step_position, /*position_ids=*/nullptr);
  for (int l = 0; l < config_.n_layer; ++l) block_forward(l, chunk);
  if (n == 1) {
    layernorm_forward(*ln_f_, block_output_, first_rows(s.lnf, chunk_rows), first_rows(s.lnf_mean, chunk_rows),
                      first_rows(s.lnf_rstd, chunk_rows));
    ops_.gemm({.pass = GemmPass::forward, .out = s.logits, .input = first_rows(s.lnf, chunk_rows),
               .weight = lm_head_->weight_operand});
  }
  ops_.set_amax_recording(AmaxRecording::on);
}

Tensor GptModel::next_token_logits() const {
  FP8LM_CHECK(is_inference(), "next_token_logits needs a model built for inference");
  return scratch_->logits;
}

Tensor GptModel::token_losses() const { return scratch_->losses; }

void GptModel::loss(const TokenBatch& batch, float dloss, const Tensor& loss_sum) {
  const Scratch& s = *scratch_;
  const VocabSlice slice = vocab_slice();
  // The FP8 LM head's gradient codes come from the loss (their transposed copy, into the
  // logits' storage, in the backward).
  const bool dlogit_codes = dloss != 0.0f && s.dlogit_codes_apart;
  Tensor codes = s.logits_grad;
  codes.transposed = nullptr;
  if (tp_->size() == 1) {
    // The whole vocabulary here: one pass over the logits, the same bits as the two halves.
    if (dlogit_codes) {
      ops_.cross_entropy_to_fp8(s.logits, s.losses, batch, slice, dloss, codes);
    } else {
      ops_.cross_entropy(s.logits, s.losses, batch, slice, dloss);
    }
  } else {
    ops_.cross_entropy_partials(s.ce_partials, s.logits, batch, slice);
    tp_->gather_loss_partials(s.ce_partials, s.ce_all);
    ops_.cross_entropy_finish(s.logits, s.losses, s.ce_all, tp_->size(), batch, slice, dloss);
    if (dlogit_codes) ops_.quantize(codes, s.logits, Tensor{});
  }
  ops_.accumulate_loss(loss_sum, s.losses);
}

// ---- Backward -------------------------------------------------------------------------

// The output gradient of `linear` as its GEMM operand: the gradient itself when its dtype
// is the operand's, else `storage` (by default the shared operand storage, FP8 with its
// transpose) viewed as [rows, cols] with the linear's scaling state.
Tensor GptModel::gradient_operand(const Tensor& gradient, const LinearParams& linear, const Tensor* storage) const {
  if (linear.grad_dtype == gradient.dtype) return gradient;
  if (storage == nullptr) return gradient_operand_buffer(gradient.rows, gradient.cols, linear);
  FP8LM_CHECK(storage->dtype == linear.grad_dtype && storage->numel() >= gradient.numel(),
              "gradient_operand: storage of ", to_string(storage->dtype), " for a ", to_string(linear.grad_dtype),
              " operand of [", gradient.rows, ",", gradient.cols, "]");
  Tensor operand = *storage;
  operand.rows = gradient.rows;
  operand.cols = gradient.cols;
  operand.scaling_state = linear.grad_state;
  return operand;
}

Tensor GptModel::gradient_operand_buffer(int64_t rows, int64_t cols, const LinearParams& linear) const {
  const std::vector<Tensor>& buffers = scratch_->grad_operands;
  const auto found = std::find_if(buffers.begin(), buffers.end(),
                                  [&](const Tensor& buffer) { return buffer.dtype == linear.grad_dtype; });
  FP8LM_CHECK(found != buffers.end(), "no gradient operand buffer of dtype ", to_string(linear.grad_dtype));
  Tensor operand = *found;
  FP8LM_CHECK(rows * cols <= operand.numel());
  operand.rows = rows;
  operand.cols = cols;
  operand.scaling_state = linear.grad_state;
  return operand;
}

void GptModel::backward(const TokenBatch& batch) {
  const Scratch& s = *scratch_;
  const LinearParams& head = *lm_head_;
  // The LM head: the loss left the dlogits in the logits buffer, or their FP8 codes apart.
  if (s.dlogit_codes_apart) {
    ops_.transpose_operand(s.logits_grad);
  } else {
    ops_.quantize(s.logits_grad, s.logits, Tensor{});
  }
  // Both sum dlogits, small softmax probabilities beside each target's -1 (core/gemm.h): dgrad
  // over the vocabulary, wgrad over the tokens.
  ops_.gemm({.pass = GemmPass::dgrad,
             .out = s.dln,
             .weight = dgrad_weight(head),
             .grad = s.logits_grad,
             .promote_partial_sums = true});
  ops_.gemm({.pass = GemmPass::wgrad,
             .out = head.grad_weight,
             .input = s.lnf,
             .grad = s.logits_grad,
             .promote_partial_sums = true});
  ops_.zero(s.dresidual.data, size_t(s.dresidual.numel()) * ops_.element_bytes(s.dresidual.dtype));
  layernorm_backward(*ln_f_, s.residual_final, s.lnf_mean, s.lnf_rstd);
  after_backward(config_.n_layer);
  for (int l = config_.n_layer - 1; l >= 0; --l) {
    // A recomputed group's forwards rerun before the backward of its last block.
    if (recompute_.recomputes(l) && l == recompute_.group_last(l, config_.n_layer))
      recompute_forward(recompute_.group_begin(l), l);
    block_backward(l);
    after_backward(l);
  }
  ops_.position_embedding_backward(grad_wpe_, s.dresidual, int(tp_->first_local_row(s.dln.rows)), T_, batch);
  tp_->row_parallel_output_backward(s.dresidual, s.dresidual_full);
  ops_.embedding_lookup_backward(grad_wte_, s.dresidual_full, batch);
  after_backward(-1);
  block_weight_gradients_written_ = true;  // the step's next micro-batches add to them
}

void GptModel::block_backward(int l) {
  const BlockParams& w = blocks_[l];
  const BlockActivations& a = saved_[l];
  const Scratch& s = *scratch_;
  const int tp = tp_->size();
  const AttentionShape heads{.B = B_,
                             .T = T_,
                             .heads = config_.n_head / tp,
                             .head_size = config_.n_embd / config_.n_head,
                             .document_starts = document_starts_};
  if (recompute_.selective()) recompute_selective(l);

  // mlp.c_proj, GELU, mlp.c_fc, ln_2. The GELU backward writes c_fc's output-gradient operand
  // and its bias gradient, and, when this block keeps no GELU output, mlp.c_proj's wgrad input.
  const Tensor dy_fc = gradient_operand_buffer(s.dgelu.rows, s.dgelu.cols, w.fc);
  if (recomputes_gelu_output(w)) {
    const Tensor dy_fc2 = row_parallel_dgrad(w.fc2, s.dgelu, &s.fc2_grad_operand);
    Tensor gelu_wgrad_input = a.gelu;
    gelu_wgrad_input.transposed = s.gelu_operand.transposed;
    ops_.gelu_backward({.dpre = dy_fc,
                        .dbias = w.fc.grad_bias,
                        .dout = s.dgelu,
                        .pre = a.fc_pre,
                        .recomputed_output = gelu_wgrad_input});
    weight_gradient(w.fc2, gelu_wgrad_input, dy_fc2);
  } else {
    row_parallel_backward(w.fc2, s.dgelu, a.gelu);
    ops_.gelu_backward({.dpre = dy_fc, .dbias = w.fc.grad_bias, .dout = s.dgelu, .pre = a.fc_pre});
  }
  ops_.gemm({.pass = GemmPass::dgrad, .out = s.dln, .weight = dgrad_weight(w.fc), .grad = dy_fc});
  ops_.gemm({.pass = GemmPass::wgrad,
             .out = w.fc.grad_weight,
             .input = layernorm_wgrad_input(w.fc, w.ln2, a.ln2, a.residual_mid, a.ln2_mean, a.ln2_rstd),
             .grad = dy_fc,
             .accumulate = block_weight_gradients_written_});
  layernorm_backward(w.ln2, a.residual_mid, a.ln2_mean, a.ln2_rstd);

  // attn.c_proj, attention, c_attn, ln_1.
  const Tensor dy_proj = row_parallel_dgrad(w.proj, s.datty);
  weight_gradient(w.proj, attention_wgrad_input(w.proj, a.atty_operand, a.atty), dy_proj);
  const Tensor dy_qkv = gradient_operand(s.dqkv, w.qkv);
  before_attention_backward(l);
  ops_.attention_backward_to_operand({.operand = dy_qkv,
                                      .dbias = w.qkv.grad_bias,
                                      .dqkv = s.dqkv,
                                      .dout = s.datty,
                                      .qkv = a.qkv,
                                      .out = a.atty,
                                      .lse = a.lse,
                                      .shape = heads});
  ops_.gemm({.pass = GemmPass::dgrad, .out = s.dln, .weight = dgrad_weight(w.qkv), .grad = dy_qkv});
  ops_.gemm({.pass = GemmPass::wgrad,
             .out = w.qkv.grad_weight,
             .input = layernorm_wgrad_input(w.qkv, w.ln1, a.ln1, a.residual, a.ln1_mean, a.ln1_rstd),
             .grad = dy_qkv,
             .accumulate = block_weight_gradients_written_});
  layernorm_backward(w.ln1, a.residual, a.ln1_mean, a.ln1_rstd);
}

// A row-parallel linear (c_proj) whose output was added to the residual stream: the residual
// gradient, of all rows, is its output gradient (and its bias's).
void GptModel::row_parallel_backward(const LinearParams& linear, const Tensor& dinput, const Tensor& input) {
  weight_gradient(linear, input, row_parallel_dgrad(linear, dinput));
}

Tensor GptModel::row_parallel_dgrad(const LinearParams& linear, const Tensor& dinput, const Tensor* operand_storage) {
  const Scratch& s = *scratch_;
  tp_->row_parallel_output_backward(s.dresidual, s.dresidual_full);
  const Tensor dy = gradient_operand(s.dresidual_full, linear, operand_storage);
  ops_.quantize(dy, s.dresidual_full, linear.grad_bias);
  ops_.gemm({.pass = GemmPass::dgrad, .out = dinput, .weight = dgrad_weight(linear), .grad = dy});
  return dy;
}

Tensor GptModel::dgrad_weight(const LinearParams& linear) {
  Tensor weight = linear.weight_operand;
  if (!is_fp8(weight.dtype) || weight.transposed != nullptr) return weight;
  FP8LM_CHECK(shared_weight_transpose_ != nullptr, "dgrad: the FP8 weight of tensor ", linear.tensor,
              " has no transposed copy and the model no shared one");
  // The codes transposed are the copy the weight's cast would have written: the same bytes,
  // read with the same scale.
  weight.transposed = shared_weight_transpose_;
  ops_.transpose_operand(weight);
  return weight;
}

void GptModel::weight_gradient(const LinearParams& linear, const Tensor& input, const Tensor& grad) {
  ops_.gemm({.pass = GemmPass::wgrad,
             .out = linear.grad_weight,
             .input = input,
             .grad = grad,
             .accumulate = block_weight_gradients_written_});
}

bool GptModel::per_tensor_fp8(DType dtype) const {
  return is_fp8(dtype) && scaling_.config().recipe != ScalingRecipe::blockwise;
}

// The GELU backward writes mlp.c_proj's wgrad input again from fc_pre (per-tensor FP8 only),
// so the forward's codes need not be kept. Selective `mlp` recomputation takes the same path:
// the c_fc GEMM's epilogue computes its GELU from the unrounded sum, so its codes can differ
// from the GELU backward's by a step, and the two would otherwise train apart.
bool GptModel::recomputes_gelu_output(const BlockParams& w) const {
  return trains() && per_tensor_fp8(w.fc2.input_dtype);
}

// Selective `layernorm` in an FP8 block: the LayerNorm outputs are c_attn's and c_fc's inputs,
// which their wgrad GEMMs read transposed, so the backward writes those codes again, transposed,
// from the LayerNorm's input and statistics (kept for its own backward) just before each wgrad:
// the same codes with the same scale (per-tensor scales only), and no rerun of the LayerNorm.
// Under sequence parallelism the output is gathered across the group in the forward, so each
// rank would need the others' rows: there the LayerNorm is rerun as in a BF16 block.
bool GptModel::recomputes_layernorm_operand(const LinearParams& linear) const {
  return trains() && recompute_.layernorm && per_tensor_fp8(linear.input_dtype) && !tp_->sequence_parallel();
}

// What the wgrad GEMM of `linear` (c_attn, c_fc) reads as its input: the LayerNorm's kept output,
// or its codes written again (above), into the shared operand's transposed copy.
Tensor GptModel::layernorm_wgrad_input(const LinearParams& linear, const LayerNormParams& ln, const Tensor& output,
                                       const Tensor& input, const Tensor& mean, const Tensor& rstd) {
  if (!recomputes_layernorm_operand(linear)) return output;
  Tensor operand = output;
  operand.transposed = scratch_->layernorm_operand.transposed;
  ops_.layernorm_operand({.out = operand, .input = input, .mean = mean, .rstd = rstd, .weight = ln.weight, .bias = ln.bias});
  return operand;
}

// Selective `core_attn` in an FP8 block: attn.c_proj's input is the attention output's cast,
// whose codes are then not kept: the backward casts the kept BF16 output again, with the same
// scale, for the wgrad (per-tensor scales only; the row-parallel input is this rank's own,
// under sequence parallelism too).
bool GptModel::recomputes_attention_operand(const LinearParams& proj) const {
  return trains() && recompute_.attention_output && per_tensor_fp8(proj.input_dtype);
}

Tensor GptModel::attention_wgrad_input(const LinearParams& proj, const Tensor& operand, const Tensor& output) {
  if (!recomputes_attention_operand(proj)) return operand;
  Tensor again = operand;
  again.transposed = scratch_->attention_operand.transposed;
  ops_.requantize_transposed(again, output);
  return again;
}

// A LayerNorm that feeds column-parallel linears: their input gradients (in s.dln) are summed
// over the tensor-parallel group, and its input gradient adds into the residual gradient.
void GptModel::layernorm_backward(const LayerNormParams& ln, const Tensor& input, const Tensor& mean,
                                  const Tensor& rstd) {
  const Scratch& s = *scratch_;
  tp_->column_parallel_input_backward(s.dln, s.dln_rows);
  ops_.layernorm_backward({.dresidual = s.dresidual,
                           .dweight = ln.grad_weight,
                           .dbias = ln.grad_bias,
                           .dout = s.dln_rows,
                           .input = input,
                           .weight = ln.weight,
                           .mean = mean,
                           .rstd = rstd});
}

// ---- Steps ----------------------------------------------------------------------------

void GptModel::zero_gradients() {
  FP8LM_CHECK(trains(), "only a training model has gradients");
  // The blocks' Linear weight gradients are left as they are: the step's first wgrad GEMMs
  // write them (GemmCall::accumulate), which saves a pass over most of the slab. Everything
  // else is zeroed, in runs of consecutive buckets.
  char* slab = static_cast<char*>(gradients_->data());
  const size_t bytes = ops_.element_bytes(gradient_dtype_);
  size_t run_begin = 0;
  for (const ParameterBucket& bucket : buckets_) {
    if (!(bucket.linear_weights && bucket.layer >= 0)) continue;
    if (bucket.begin > run_begin) ops_.zero(slab + run_begin * bytes, (bucket.begin - run_begin) * bytes);
    run_begin = bucket.end;
  }
  if (layout_.total_elements() > run_begin)
    ops_.zero(slab + run_begin * bytes, (layout_.total_elements() - run_begin) * bytes);
  block_weight_gradients_written_ = false;
}

void GptModel::forward_backward(const TokenBatch& batch, float dloss, const Tensor& loss_sum) {
  FP8LM_CHECK(trains(), "forward_backward needs a model built for training");
  forward(batch);
  loss(batch, dloss, loss_sum);
  backward(batch);
}

void GptModel::forward_eval(const TokenBatch& batch, const Tensor& loss_sum) {
  FP8LM_CHECK(!is_inference(), "forward_eval needs a model built for training or evaluation");
  ops_.set_amax_recording(AmaxRecording::off);
  forward(batch);
  loss(batch, 0.0f, loss_sum);
  ops_.set_amax_recording(AmaxRecording::on);
}

void GptModel::refresh_weight_operands(bool fp8_linear_weights) {
  for (int layer = -1; layer <= config_.n_layer; ++layer) refresh_weight_operands(layer, fp8_linear_weights);
}

void GptModel::refresh_weight_operands(int layer, bool fp8_linear_weights, Ops::Lane lane) {
  if (layer == lm_head_layer()) {
    if (lm_head_->owns_operand) ops_.quantize(lm_head_->weight_operand, lm_head_->weight, Tensor{}, lane);
    return;
  }
  if (layer < 0 || layer >= config_.n_layer) return;
  BlockParams& block = blocks_[layer];
  for (const LinearParams* linear : {&block.qkv, &block.proj, &block.fc, &block.fc2}) {
    if (!linear->owns_operand || (!fp8_linear_weights && is_fp8(linear->weight_operand.dtype))) continue;
    Tensor source = linear->weight;
    FP8LM_CHECK(source.data != nullptr || (fp8_cast_source_ && is_fp8(linear->weight_operand.dtype)),
                "refresh_weight_operands: ", layout_.tensors()[size_t(linear->tensor)].name,
                " has no working copy, and no FP32 master to cast from was set");
    if (fp8_cast_source_ && is_fp8(linear->weight_operand.dtype)) {
      const TensorInfo& tensor = layout_.tensors()[size_t(linear->tensor)];
      const auto [first, count] = fp8_cast_window_;
      FP8LM_CHECK(tensor.offset >= first && tensor.offset - first + tensor.numel <= count, "refresh_weight_operands: ",
                  tensor.name, " lies outside the FP32 values set to cast from");
      source.data = const_cast<float*>(fp8_cast_source_) + (tensor.offset - first);
      source.dtype = DType::f32;
    }
    ops_.quantize(linear->weight_operand, source, Tensor{}, lane);
  }
}

void GptModel::set_working_values(const float* slab_values) {
  Tensor working;
  working.data = working_->data();
  working.dtype = activation_dtype_;
  working.rows = 1;
  working.cols = int64_t(working_->bytes() / ops_.element_bytes(activation_dtype_));
  if (!working_offsets_backend_) return ops_.upload_values(working, slab_values);  // the layout's own order
  std::vector<float> compact(size_t(working.cols), 0.0f);
  for (size_t k = 0; k < layout_.tensors().size(); ++k) {
    const TensorInfo& t = layout_.tensors()[k];
    if (working_offsets_[k] != kNoWorkingValue)
      std::copy(slab_values + t.offset, slab_values + t.offset + t.numel, compact.begin() + ptrdiff_t(working_offsets_[k]));
  }
  ops_.upload_values(working, compact.data());
}

std::vector<WeightOperand> GptModel::fp8_weight_operands() const {
  std::vector<WeightOperand> operands;
  for (int l = 0; l < config_.n_layer; ++l) {
    const BlockParams& block = blocks_[l];
    for (const LinearParams* linear : {&block.qkv, &block.proj, &block.fc, &block.fc2})
      if (is_fp8(linear->weight_operand.dtype)) operands.push_back({linear->tensor, l, linear->weight_operand});
  }
  return operands;
}

std::vector<std::pair<size_t, size_t>> GptModel::partial_gradient_ranges() const {
  std::vector<std::pair<size_t, size_t>> ranges;
  if (!tp_->sequence_parallel()) return ranges;
  for (const TensorInfo& t : layout_.tensors()) {
    if (!t.partial_gradient_under_sp) continue;
    // Neighbours (the LayerNorm parameters of a block) merge into one range, with the
    // padding between them (zero gradients) inside.
    if (!ranges.empty() && t.offset - ranges.back().second < 64) {
      ranges.back().second = t.offset + t.numel;
    } else {
      ranges.push_back({t.offset, t.offset + t.numel});
    }
  }
  return ranges;
}

Tensor GptModel::gradients() const {
  if (!gradients_) return Tensor{};
  Tensor slab;
  slab.data = gradients_->data();
  slab.dtype = gradient_dtype_;
  slab.rows = 1;
  slab.cols = int64_t(layout_.total_elements());
  return slab;
}

size_t GptModel::allocated_bytes() const {
  size_t total = working_->bytes() + activations_->bytes();
  for (const auto* allocation : {&gradients_, &weight_operands_, &kv_cache_, &working_offsets_backend_})
    if (*allocation) total += (*allocation)->bytes();
  return total;
}

SettingsTable GptModel::memory_table() const {
  SettingsTable rows = {
      {"parameters: " + std::string(to_string(activation_dtype_)) + " working copy", format_mib(working_->bytes())}};
  if (weight_operands_)
    rows.push_back({trains() ? "parameters: weight operands (W and, for FP8, W^T)" : "parameters: weight operands (W)",
                    format_mib(weight_operands_->bytes())});
  if (gradients_)
    rows.push_back({gradient_dtype_ == DType::bf16 ? "gradients (BF16)" : "gradients (FP32)", format_mib(gradients_->bytes())});
  rows.push_back({"activations", format_mib(activations_->bytes())});
  if (kv_cache_)
    rows.push_back({"key/value cache (" + std::string(inference_.fp8_kv_cache ? "FP8 E4M3" : to_string(activation_dtype_)) +
                        ")",
                    format_mib(kv_cache_->bytes())});
  rows.push_back({"FP8 scaling states", std::to_string(scaling_.size())});
  return rows;
}

}  // namespace fp8lm
