// GPT-2, written once: the parameter layouts (Hugging Face names) and the model's forward
// and backward over the Ops interface (layers/ops.h), so the CPU reference and the GPU run
// the same code, with tensor and sequence parallelism through the mappings of
// parallel/mappings.h.
//
//   x = wte[tokens] + wpe[positions]                                        [B,T,C]
//   per block:  x = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
//               x = x + mlp.c_proj(gelu(mlp.c_fc(ln_2(x))))
//   logits = ln_f(x) . wte^T  (LM head tied to the token embedding;        [B,T,Vp]
//                              lm_head.weight^T when untied)
//   loss = mean cross-entropy over the B*T targets
//
// Where the residual adds happen: the two c_proj GEMMs (row-parallel under tensor
// parallelism) write their output without bias; after the output is summed across the
// tensor-parallel ranks, the LayerNorm that follows adds the residual, that output and the
// bias in one pass (docs/MODEL.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/gemm.h"
#include "core/gpt_config.h"
#include "core/logging.h"
#include "core/scaling.h"
#include "core/tensor.h"
#include "layers/ops.h"

namespace fp8lm {

class TensorParallelMappings;

// The canonical layout: every parameter tensor whole, with its Hugging Face GPT-2 name, in
// Hugging Face's order. Checkpoints, Hugging Face import and export and the initialisation
// speak it. Linear weights are [out, in] (PyTorch layout; HF's Conv1D stores [in, out]).
//   wte.weight [Vp,C]  wpe.weight [maxT,C]
//   h.{l}.ln_1.weight/bias [C]
//   h.{l}.attn.c_attn.weight [3C,C]  .bias [3C]
//   h.{l}.attn.c_proj.weight [C,C]   .bias [C]
//   h.{l}.ln_2.weight/bias [C]
//   h.{l}.mlp.c_fc.weight [F,C]      .bias [F]     (F = n_inner, 4C for GPT-2)
//   h.{l}.mlp.c_proj.weight [C,F]    .bias [C]
//   ln_f.weight/bias [C]
//   lm_head.weight [Vp,C]            (only without tie_word_embeddings)
TensorLayout make_gpt_layout(const GptConfig& config);

// The tensors with a row per vocabulary entry (padded to Vp, the padded rows zero): the token
// embedding, and an untied LM head.
inline bool is_vocabulary_table(const std::string& name) { return name == "wte.weight" || name == "lm_head.weight"; }

// The four Linear layers of a block, in the order the forward runs them.
inline constexpr const char* kBlockLinearNames[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};

// Parameters whose gradients are complete at the same point of the backward and that travel
// together between data-parallel ranks (Megatron's buckets): one bucket of Linear weights
// and one of the other parameters per block, the head (ln_f) and the embedding.
struct ParameterBucket {
  std::string name;             // "h.3.weights", "h.3.others", "head", "embedding"
  size_t begin = 0;             // slab elements [begin, end); begin a multiple of kBucketAlignment and
  size_t end = 0;               // end - begin a multiple of data-parallel size * kBucketAlignment
  bool linear_weights = false;  // FP8 GEMM operands: gathered as FP8 codes under --fp8-param-gather
  int layer = -1;               // the block, -1 for the head and the embedding
};
inline constexpr size_t kBucketAlignment = 256;

// The layout of one tensor-parallel rank's parameters in memory: each tensor this rank's
// part (Megatron's split: c_attn and c_fc column-parallel, both c_proj row-parallel with
// replicated biases, the embedding vocabulary-parallel, LayerNorm and wpe replicated), in
// buckets laid out one after the other, each padded so that data_parallel_size ranks get
// equal parts of it.
TensorLayout make_gpt_shard_layout(const GptConfig& config, int tensor_parallel_size, int data_parallel_size,
                                   std::vector<ParameterBucket>* buckets);

// One tensor's values between the canonical layout and a tensor-parallel rank's part of it.
//   full [info.full_shape] <-> part [info.shape]
template <typename T>
void copy_part_from_full(const TensorInfo& info, const T* full, T* part, int tp_rank, int tp_size);
template <typename T>
void copy_part_to_full(const TensorInfo& info, const T* part, T* full, int tp_rank, int tp_size);

// GPT-2 initialisation: N(0, 0.02) for embeddings and weights, N(0, 0.02/sqrt(2L)) for
// the residual projections (attn.c_proj, mlp.c_proj), LayerNorm weight 1, biases 0,
// padded vocabulary rows 0. Deterministic in `seed` on every platform and for any thread
// count. Over the canonical layout, so every parallel layout starts from the same weights.
void init_gpt_parameters(float* params, const TensorLayout& layout, const GptConfig& config, uint64_t seed);
// The same for one tensor of the canonical layout, the `index`-th (its random stream is keyed
// by it), so a rank can draw the tensors it holds without the whole model.
//   values [tensor.numel]
void init_gpt_tensor(float* values, const TensorInfo& tensor, size_t index, const GptConfig& config, uint64_t seed);
// Only this tensor-parallel rank's part of it (`part`, TensorInfo of the part), in the part's
// layout: the elements copy_part_from_full would take from init_gpt_tensor's values, drawn
// alone (each element's value is a function of its canonical index).
//   part_values [part.numel]
// Each run of kInitStreamElements elements of a tensor has its own random stream.
inline constexpr size_t kInitStreamElements = size_t{1} << 16;
void init_gpt_tensor_part(float* part_values, const TensorInfo& tensor, size_t index, const GptConfig& config,
                          uint64_t seed, const TensorInfo& part, int tp_rank, int tp_size);
// Elements [begin, end) of that part alone (a data-parallel rank's share of it under the
// distributed optimizer): the values init_gpt_tensor_part puts there.
//   values [end - begin]
void init_gpt_tensor_part_range(float* values, const TensorInfo& tensor, size_t index, const GptConfig& config,
                                uint64_t seed, const TensorInfo& part, int tp_rank, int tp_size, size_t begin,
                                size_t end);

// Whether a scaling state is a Linear's input operand, an activation ("h.3.mlp.c_fc.input"),
// rather than its weight or its output gradient.
bool is_linear_input_state(const std::string& state_name);

// How the run's precision maps onto the model's GEMM operands.
struct GptPrecision {
  GemmPrecision gemm = GemmPrecision::fp32;  // the transformer blocks' Linear layers
  bool fp8_lm_head = false;                  // the tied LM head in FP8 too (else BF16 under fp8)
  // Under fp8, the blocks whose four Linear layers run in BF16 instead. They have no FP8
  // scaling states. The first and last blocks (--first-last-layers-bf16) are ranges,
  // [0, bf16_layers_at_start) and [n_layer - bf16_layers_at_end, n_layer), so that a huge
  // layer count costs nothing to describe; bf16_blocks adds single blocks (--bf16-blocks,
  // and those --fp8-auto-precision switched). A block may be in both.
  int bf16_layers_at_start = 0;
  int bf16_layers_at_end = 0;
  std::set<int> bf16_blocks;
  Fp8RecipeConfig fp8;
  // The gradient slab: f32, or bf16 under --grad-reduce-in-bf16 (Megatron's BF16 main_grad:
  // every gradient producer accumulates into it and the data-parallel reduction runs on it).
  DType gradients = DType::f32;
  // false (--no-fp8-weight-transpose-cache): a training model's FP8 Linear weights keep no
  // transposed copy (1 byte a weight). Before each dgrad the backward writes the weight's codes
  // transposed into one buffer that every FP8 weight shares (GptModel::dgrad_weight): the same
  // bytes the optimizer would have written, so the same GEMM, for one transpose per dgrad.
  // Per-tensor scaling only (a block-scaled weight's transpose carries its own block scales).
  bool fp8_weight_transpose_cache = true;
  // false: the FP8 blocks' Linear weights have no working copy. Their GEMMs read only the FP8
  // operands, which are cast from the optimizer's FP32 master (GptModel::set_fp8_cast_source,
  // or AdamW's update pass), so the copy would be written every step and read by nothing. For a
  // master that is whole on this rank and apart from the working copy: the GPU's unsharded
  // optimizer (the engine decides), and the GPU's decoder, which casts them once from the
  // checkpoint's FP32 values. The other parameters keep theirs.
  bool fp8_linear_working_copy = true;
  bool runs_block_in_bf16(int layer, int n_layer) const {
    return layer < bf16_layers_at_start || layer >= n_layer - bf16_layers_at_end || bf16_blocks.count(layer) > 0;
  }
  // Block `layer`'s GEMM precision, of `n_layer` blocks.
  GemmPrecision block(int layer, int n_layer) const {
    if (gemm != GemmPrecision::fp8) return gemm;
    return runs_block_in_bf16(layer, n_layer) ? GemmPrecision::bf16 : GemmPrecision::fp8;
  }
  // How many of `n_layer` blocks run BF16 under fp8 (the ranges and the set, each block once).
  int64_t bf16_block_count(int64_t n_layer) const { return bf16_block_count_in(0, n_layer, n_layer); }
  // ... of the blocks [begin, end).
  int64_t bf16_block_count_in(int64_t begin, int64_t end, int64_t n_layer) const {
    const int64_t start = std::min<int64_t>(n_layer, bf16_layers_at_start);
    const int64_t tail = std::max<int64_t>(start, n_layer - bf16_layers_at_end);  // [tail, n_layer) BF16
    auto overlap = [&](int64_t a, int64_t b) { return std::max<int64_t>(0, std::min(b, end) - std::max(a, begin)); };
    int64_t count = overlap(0, start) + overlap(tail, n_layer);
    for (int layer : bf16_blocks)
      if (layer >= start && layer < tail && layer >= begin && layer < end) ++count;
    return count;
  }
  // The LM head's GEMM precision: FP8 only when asked, BF16 under fp8 otherwise.
  GemmPrecision lm_head() const {
    if (gemm != GemmPrecision::fp8) return gemm;
    return fp8_lm_head ? GemmPrecision::fp8 : GemmPrecision::bf16;
  }
};

// --fp8-recipe blockwise: every FP8 GEMM dimension a multiple of 16 (core/block_scaling.h; the
// 1x128 tiles and 128x128 blocks may be ragged): "" when this model's FP8 GEMMs fit, else the
// first dimension that does not, in one line. The
// dimensions: n_embd, n_inner, the micro-batch's tokens (micro_batch_size x seq_length: the
// wgrad GEMMs' K) and, with --fp8-lm-head, the padded vocabulary, each this tensor-parallel
// rank's part.
std::string blockwise_shape_problem(const GptConfig& config, int micro_batch_size, int seq_length,
                                    const GptPrecision& precision, int tensor_parallel_size);

// The dtype of a GEMM's forward operands (inputs, weights) and of its output gradient.
DType forward_operand_dtype(GemmPrecision precision);
DType gradient_operand_dtype(GemmPrecision precision, Fp8Format format);

// Where this model instance sits in a parallel run.
struct ModelParallelism {
  const TensorParallelMappings* tensor_parallel = nullptr;  // nullptr: one rank
  int data_parallel_size = 1;                               // pads the buckets
};

// Full activation recomputation (Megatron's --recompute-granularity full): a recomputed
// block keeps no activations for the backward but its input, and the backward reruns its
// forward first (without recording amaxes: the same values, with the same scales).
//   uniform: every block, in groups of `layers` consecutive blocks; only a group's first
//            block keeps its input, and the group's forwards rerun together (`layers` sets
//            of block buffers, shared by the groups);
//   block:   the first `layers` blocks, each keeping its input (one set of buffers).
// Selective recomputation (Megatron's --recompute-granularity selective --recompute-modules)
// keeps every block's other tensors and recomputes, in the block's backward, the outputs of
//   layernorm: ln_1 and ln_2 (their FP8 or BF16 GEMM operands) from the kept residual stream;
//   mlp:       c_fc's output and the GELU's (the largest tensors, 12 of about 27 bytes per
//              channel in FP8) from ln_2's output, one c_fc GEMM more per block.
// Those tensors live in one set per operand dtype combination, rewritten by every block.
struct ActivationRecompute {
  enum class Method : uint8_t { none, uniform, block };
  Method method = Method::none;
  int layers = 1;
  bool layernorm = false;  // selective: the LayerNorm outputs
  bool mlp = false;        // selective: c_fc's output and the GELU output
  // selective `core_attn`: the attention output's FP8 cast (the fused attention keeps no score
  // matrix), cast again for attn.c_proj's wgrad; not a rerun of the block's forward
  bool attention_output = false;
  bool selective() const { return layernorm || mlp; }
  bool recomputes(int layer) const {
    return method == Method::uniform || (method == Method::block && layer < layers);
  }
  // The first and last blocks of `layer`'s group: the backward of the last reruns the group.
  int group_begin(int layer) const { return method == Method::uniform ? layer - layer % layers : layer; }
  int group_last(int layer, int n_layer) const {
    return method == Method::uniform ? std::min(group_begin(layer) + layers, n_layer) - 1 : layer;
  }
  // Of n_layer blocks: how many are recomputed, how many of those keep their input (a group's
  // first), and how many block buffer sets the groups share (per operand dtype combination).
  int64_t recomputed_blocks(int64_t n_layer) const {
    if (method == Method::none) return 0;
    return method == Method::uniform ? n_layer : std::min<int64_t>(n_layer, layers);
  }
  int64_t kept_inputs(int64_t n_layer) const {
    return method == Method::uniform ? (n_layer + layers - 1) / layers : recomputed_blocks(n_layer);
  }
  int64_t buffer_sets(int64_t n_layer) const {
    if (method == Method::none) return 0;
    return method == Method::uniform ? std::min<int64_t>(layers, n_layer) : 1;
  }
};

// Where the step can act between the layers (overlapped data-parallel communication).
// Layers are numbered as buckets are: -1 the embedding (and the tied LM head's weight),
// 0..n_layer-1 the blocks, n_layer the head (ln_f).
struct LayerHooks {
  std::function<void(int layer)> before_forward;  // before the forward reads the layer's parameters
  std::function<void(int layer)> after_backward;  // once the backward has the layer's gradients
  // Before block `layer`'s attention backward: a stretch bound by the kernels' latency, not by
  // memory, where the step can put memory-bound work of its own beside it.
  std::function<void(int layer)> before_attention_backward;
};

// The sizes of a model built for incremental decoding (fp8lm sample): `batch` sequences,
// prompts of up to `max_prompt` tokens run in one pass, and a key/value cache of
// `capacity` positions per sequence, E4M3 when fp8_kv_cache (layers/kv_cache.h).
struct InferenceShape {
  int batch = 1;
  int max_prompt = 1;
  int capacity = 1;
  bool fp8_kv_cache = false;
};

// What a model is built for, which decides what it allocates.
//   train:    gradients, weight transposes (dgrad), every block's activations kept for the backward;
//   evaluate: the whole batch's forward and token losses only (fp8lm eval): no gradients, no
//             transposes, one set of block buffers per combination of GEMM operand dtypes,
//             shared by every block of that combination, and no backward buffers;
//   decode:   incremental decoding through a key/value cache (InferenceShape).
enum class ModelUse : uint8_t { train, evaluate, decode };

class GptModel {
 public:
  // A model to train (and evaluate): gradients, and every block's activations kept for the
  // backward.
  GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision, Ops& ops,
           const ModelParallelism& parallelism = {}, const ActivationRecompute& recompute = {});
  // A model to evaluate with (ModelUse::evaluate): forward_eval and token_losses only, with
  // tensor parallelism as a training model's.
  GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision, Ops& ops,
           const ModelParallelism& parallelism, ModelUse use);
  // A model to decode with: no gradients, one block's activations shared by all blocks, and
  // a key/value cache. One rank (no tensor parallelism).
  GptModel(const GptConfig& config, const InferenceShape& shape, const GptPrecision& precision, Ops& ops);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const GptConfig& config() const { return config_; }
  // This rank's parameter layout (make_gpt_shard_layout) and its buckets.
  const TensorLayout& layout() const { return layout_; }
  const std::vector<ParameterBucket>& buckets() const { return buckets_; }
  ScalingTable& scaling() { return scaling_; }
  int micro_batch_size() const { return B_; }
  int seq_length() const { return T_; }
  VocabSlice vocab_slice() const;

  // Slabs [layout().total_elements()]: the working copy of the parameters in the activation
  // dtype (what the forward reads; FP32 on the CPU, BF16 on the GPU) and the gradients, as a
  // [1, elements] tensor of the gradient dtype (GptPrecision::gradients; empty in an
  // inference model).
  void* working() { return working_->data(); }
  size_t working_bytes() const { return working_->bytes(); }
  // Where each tensor of layout() sits in the working slab: its layout offset less the
  // elements of the dropped Linear-weight buckets before it (GptPrecision::fp8_linear_working_copy),
  // or kNoWorkingValue (optim/adamw.h) for the tensors of those buckets. working_offsets_on_backend() is the same
  // array in backend memory, nullptr while every tensor sits at its layout offset.
  const std::vector<uint64_t>& working_offsets() const { return working_offsets_; }
  const uint64_t* working_offsets_on_backend() const {
    return working_offsets_backend_ ? static_cast<const uint64_t*>(working_offsets_backend_->data()) : nullptr;
  }
  // Writes the working copy from `slab_values` [layout().total_elements()] (host, FP32, in the
  // layout's order), each tensor that has one rounded to the working dtype.
  void set_working_values(const float* slab_values);
  Tensor gradients() const;
  DType gradient_dtype() const { return gradient_dtype_; }

  // Starts a step's gradients: zero, except the blocks' Linear weight gradients, which the
  // next backward writes rather than adds to (read them only after a backward).
  void zero_gradients();
  // One micro-batch: forward, loss, backward. Gradients accumulate with weight dloss per
  // token loss; the token losses accumulate into loss_sum [1] f32.
  void forward_backward(const TokenBatch& batch, float dloss, const Tensor& loss_sum);
  // Forward and loss only; the token losses accumulate into loss_sum. Records no amax.
  void forward_eval(const TokenBatch& batch, const Tensor& loss_sum);
  // The last forward's token losses [B*T] f32 (0 at masked targets), every rank's the same.
  Tensor token_losses() const;
  // Incremental decoding (inference models): runs batch [B,n] (n new tokens of each of the
  // B sequences, at positions [position, position + n)) through the model, appending their
  // keys and values to the cache. position 0 starts the sequences (a prompt: causal
  // attention among its n tokens); after that n is 1 (each token attends to the cache).
  // When n == 1, next_token_logits() [B,Vs] (activation dtype) then holds the logits that
  // follow each sequence's token; a longer prompt only fills the cache, so a caller feeds
  // a prompt's last token as the first step of one token. Records no amax.
  // record_amaxes: the chunk's FP8 casts record their amaxes, as a training forward's do (a
  // prompt that calibrates the activation scales, apps/generator.h); otherwise none is recorded.
  void forward_cached(const TokenBatch& batch, int position, bool record_amaxes = false);
  Tensor next_token_logits() const;
  bool is_inference() const { return use_ == ModelUse::decode; }
  ModelUse use() const { return use_; }
  bool trains() const { return use_ == ModelUse::train; }
  // Casts every weight operand that is not a view of the working copy (FP8 weights and
  // their transposes; BF16-rounded copies on the CPU) from the working copy, recording the
  // FP8 weights' amaxes. After every optimizer step and whenever the weights are set.
  // Without the FP8 Linear weights when they arrive as FP8 codes (--fp8-param-gather).
  void refresh_weight_operands(bool fp8_linear_weights = true);
  // The bucket layer whose parameters hold the LM head's weight: -1 (the embedding's) when it
  // is tied to the token embedding, n_layer (the head's, beside ln_f) when untied.
  int lm_head_layer() const { return config_.tie_word_embeddings ? -1 : config_.n_layer; }
  // The same for one layer (lm_head_layer(): the LM head's operand), on `lane`
  // (Ops::quantize: off the main lane only delayed per-tensor FP8 casts).
  void refresh_weight_operands(int layer, bool fp8_linear_weights, Ops::Lane lane = Ops::Lane::main);
  void set_layer_hooks(LayerHooks hooks) { hooks_ = std::move(hooks); }
  // The FP8 Linear weights are cast from this FP32 copy of the whole parameter slab (the
  // master weights, laid out as layout()) instead of the working copy: one rounding
  // instead of two. nullptr: the working copy (the master is sharded across ranks).
  // `values` may hold a window of the slab instead, elements [first, first + count) (a forward-only
  // model casts its weights layer by layer from a small FP32 staging buffer): refreshing a weight
  // outside the window is an error.
  void set_fp8_cast_source(const float* values, size_t first = 0, size_t count = SIZE_MAX) {
    fp8_cast_source_ = values;
    fp8_cast_window_ = {first, count};
  }
  // The FP8 operands of the Linear weights (empty unless the block GEMMs run in FP8).
  std::vector<WeightOperand> fp8_weight_operands() const;
  // Under sequence parallelism: the slab ranges [begin, end) holding the partial gradients
  // of replicated tensors (TensorInfo::partial_gradient_under_sp), to be summed across the
  // tensor-parallel group once per step. Empty otherwise.
  std::vector<std::pair<size_t, size_t>> partial_gradient_ranges() const;

  // Bytes per memory class, for the startup table and the benchmark.
  SettingsTable memory_table() const;
  size_t allocated_bytes() const;

  struct LinearParams;
  struct LayerNormParams;
  struct BlockParams;
  struct BlockActivations;

 private:
  GptModel(const GptConfig& config, int micro_batch_size, int seq_length, const GptPrecision& precision, Ops& ops,
           const ModelParallelism& parallelism, ModelUse use, const InferenceShape& inference,
           const ActivationRecompute& recompute);
  // The rows one forward pass covers: the whole [B,T] batch (training and evaluation), or
  // in an inference model n new tokens of each sequence at `position`, through the cache.
  struct Chunk {
    int B = 0, T = 0;
    CachePosition position;
    bool cached = false;
    const int32_t* document_starts = nullptr;  // TokenBatch's: the attention kept to documents
  };
  void plan_memory();
  void plan_kv_cache();
  void forward(const TokenBatch& batch);
  void loss(const TokenBatch& batch, float dloss, const Tensor& loss_sum);
  void backward(const TokenBatch& batch);
  void block_forward(int layer, const Chunk& chunk);
  // Attention of an inference chunk: its keys and values into layer's cache, then causal
  // attention within a prompt, or the new token against the cache.
  void attention_cached(int layer, const Chunk& chunk, const AttentionShape& heads);
  void block_backward(int layer);
  // The residual stream after a row-parallel Linear, as the next LayerNorm takes it: the
  // stream itself, or the stream before the add with the reduced branch and its bias.
  struct ResidualAdd {
    Tensor residual_in, residual_out, branch, branch_bias;
  };
  ResidualAdd row_parallel_forward(const LinearParams& linear, const Tensor& input, const Tensor& residual_in,
                                   const Tensor& residual_out);
  // Block l's forward up to the GELU (everything its backward reads) from `input`, the
  // residual stream with its pending add.
  void block_forward_to_mlp(int l, const Chunk& chunk, const ResidualAdd& input);
  // Reruns the forwards of recomputed blocks [begin, last] for their backward.
  void recompute_forward(int begin, int last);
  // Selective recomputation: block l's LayerNorm and/or MLP outputs again, for its backward.
  void recompute_selective(int l);
  void row_parallel_backward(const LinearParams& linear, const Tensor& dinput, const Tensor& input);
  // Its two halves: the dgrad, which returns the output-gradient operand (gradient_operand's,
  // in `operand_storage` when given), and the wgrad that takes it.
  Tensor row_parallel_dgrad(const LinearParams& linear, const Tensor& dinput,
                            const Tensor* operand_storage = nullptr);
  void weight_gradient(const LinearParams& linear, const Tensor& input, const Tensor& grad);
  // The weight operand a dgrad GEMM reads: `linear`'s, or under --no-fp8-weight-transpose-cache
  // an FP8 one with its transposed copy written now into the shared buffer (GptPrecision).
  Tensor dgrad_weight(const LinearParams& linear);
  // An FP8 operand with one scale for the whole tensor (not the blockwise recipe's tiles): its
  // codes can be written again with that scale, or transposed from the codes themselves.
  bool per_tensor_fp8(DType dtype) const;
  // Whether block w's backward recomputes its FP8 GELU output from c_fc's saved output instead
  // of keeping it: in the GELU backward's kernel, which reads that output anyway and writes
  // the transposed copy mlp.c_proj's wgrad reads (one buffer for all blocks, not one each).
  // FP8 blocks with per-tensor scales (delayed or current: either is the forward's scale when
  // the backward runs; block scales would be tiles of the transpose), training, unless
  // selective recomputation reruns the MLP anyway.
  bool recomputes_gelu_output(const BlockParams& w) const;
  bool recomputes_layernorm_operand(const LinearParams& linear) const;
  bool recomputes_attention_operand(const LinearParams& proj) const;
  Tensor attention_wgrad_input(const LinearParams& proj, const Tensor& operand, const Tensor& output);
  Tensor layernorm_wgrad_input(const LinearParams& linear, const LayerNormParams& ln, const Tensor& output,
                               const Tensor& input, const Tensor& mean, const Tensor& rstd);
  void layernorm_forward(const LayerNormParams& ln, const ResidualAdd& input, const Tensor& out, const Tensor& mean,
                         const Tensor& rstd);
  void layernorm_backward(const LayerNormParams& ln, const Tensor& input, const Tensor& mean, const Tensor& rstd);
  LayerNormForward layernorm_call(const LayerNormParams& ln, const ResidualAdd& input, const Tensor& out,
                                  const Tensor& mean, const Tensor& rstd) const;
  void layernorm_to_gemm(const LayerNormParams& ln, const ResidualAdd& input, const Tensor& mean, const Tensor& rstd,
                         const GemmCall& gemm);
  static GemmCall fc_gelu_call(const BlockParams& w, const Tensor& ln2, const Tensor& fc_pre, const Tensor& gelu);
  Tensor gradient_operand(const Tensor& gradient, const LinearParams& linear,
                          const Tensor* storage = nullptr) const;
  Tensor gradient_operand_buffer(int64_t rows, int64_t cols, const LinearParams& linear) const;
  Tensor local_rows(const Tensor& full) const;

  GptConfig config_;
  int B_, T_;
  Ops& ops_;
  const TensorParallelMappings* tp_;
  std::unique_ptr<TensorParallelMappings> single_rank_;  // when no mappings are given
  // Since zero_gradients(), a backward has written the blocks' Linear weight gradients (the
  // step's first wgrad GEMMs write them, the later ones add).
  bool block_weight_gradients_written_ = false;
  std::vector<ParameterBucket> buckets_;
  TensorLayout layout_;
  ScalingTable scaling_;
  DType activation_dtype_;
  DType gradient_dtype_;

  std::unique_ptr<Allocation> working_, gradients_, weight_operands_, activations_;
  // [largest FP8 Linear weight] the transposed copy a dgrad reads, when the weights keep none
  // (GptPrecision::fp8_weight_transpose_cache false); null otherwise.
  void* shared_weight_transpose_ = nullptr;
  std::vector<uint64_t> working_offsets_;  // per tensor of layout_ (working_offsets())
  std::unique_ptr<Allocation> working_offsets_backend_;
  ModelUse use_ = ModelUse::train;
  InferenceShape inference_{.batch = 0, .max_prompt = 0, .capacity = 0};  // a decoding model's
  ActivationRecompute recompute_;
  // The micro-batch's documents (TokenBatch::document_starts), from its forward to its backward.
  const int32_t* document_starts_ = nullptr;
  std::unique_ptr<Allocation> kv_cache_;
  std::vector<KvCache> kv_;  // per block

  std::vector<BlockParams> blocks_;
  std::unique_ptr<LinearParams> lm_head_;
  std::unique_ptr<LayerNormParams> ln_f_;
  Tensor wte_, grad_wte_;  // the token embedding (the LM head's weight too when tied)
  Tensor wpe_, grad_wpe_;

  std::vector<BlockActivations> saved_;
  const float* fp8_cast_source_ = nullptr;
  std::pair<size_t, size_t> fp8_cast_window_{0, SIZE_MAX};  // first element, count
  // The last block_forward's MLP output, which the next ln_1 (or ln_f) adds if pending.
  ResidualAdd block_output_;
  LayerHooks hooks_;
  void before_forward(int layer) const {
    if (hooks_.before_forward) hooks_.before_forward(layer);
  }
  void after_backward(int layer) const {
    if (hooks_.after_backward) hooks_.after_backward(layer);
  }
  void before_attention_backward(int layer) const {
    if (hooks_.before_attention_backward) hooks_.before_attention_backward(layer);
  }
  struct Scratch;
  std::unique_ptr<Scratch> scratch_;
};

// ---- Implementation of the part copies ---------------------------------------------------

namespace detail {
// The canonical element index of element `i` of a tensor-parallel part.
size_t full_index_of_part_element(const TensorInfo& info, size_t i, int tp_rank, int tp_size);

// The part as runs of elements contiguous in both layouts: fn(part_index, full_index, count).
// A row of a 2-D part is contiguous in the whole tensor under every split; a replicated
// tensor, or any with one rank, is one run. (Element by element, a 1.5B-parameter snapshot
// spent seconds per pass in the index arithmetic.)
template <typename Fn>
void for_each_part_run(const TensorInfo& info, int tp_rank, int tp_size, Fn&& fn) {
  if (info.split == TensorSplit::replicated || tp_size == 1) {
    fn(size_t{0}, size_t{0}, info.numel);
    return;
  }
  const size_t run = info.full_shape.size() == 2 ? size_t(info.shape[1]) : 1;
  for (size_t begin = 0; begin < info.numel; begin += run)
    fn(begin, full_index_of_part_element(info, begin, tp_rank, tp_size), run);
}
}  // namespace detail

template <typename T>
void copy_part_from_full(const TensorInfo& info, const T* full, T* part, int tp_rank, int tp_size) {
  detail::for_each_part_run(info, tp_rank, tp_size,
                            [&](size_t p, size_t f, size_t count) { std::copy_n(full + f, count, part + p); });
}

template <typename T>
void copy_part_to_full(const TensorInfo& info, const T* part, T* full, int tp_rank, int tp_size) {
  detail::for_each_part_run(info, tp_rank, tp_size,
                            [&](size_t p, size_t f, size_t count) { std::copy_n(part + p, count, full + f); });
}

}  // namespace fp8lm
