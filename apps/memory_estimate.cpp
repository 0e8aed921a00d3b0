#include "apps/memory_estimate.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "apps/generator.h"
#include "apps/run_setup.h"
#include "core/block_scaling.h"
#include "core/cast_cuda.h"
#include "core/device.h"
#include "core/gemm_cuda.h"
#include "core/error.h"
#include "core/mock_data.h"
#include "core/tensor.h"
#include "layers/attention.h"
#include "layers/gelu.h"
#include "layers/gpt.h"
#include "layers/kv_cache.h"
#include "layers/layernorm.h"
#include "layers/ops_cuda.h"

namespace fp8lm {

namespace {

constexpr uint64_t kSaturated = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kMiB = uint64_t{1} << 20;
// Host memory the CUDA driver, runtime and cuBLASLt keep resident once a context exists: an
// allowance (typically a few hundred MiB), since it is not known before the context is made.
constexpr uint64_t kCudaHostAllowance = 512 * kMiB;
// Device buffers of one NCCL communicator (channels x peers x NCCL_BUFFSIZE, typically far less).
constexpr uint64_t kNcclAllowance = 256 * kMiB;

// Sizes from user input: 64-bit, saturating at kSaturated instead of wrapping.
uint64_t add(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? kSaturated : sum;
}
uint64_t mul(uint64_t a, uint64_t b) {
  uint64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? kSaturated : product;
}
template <typename... Rest>
uint64_t mul(uint64_t a, uint64_t b, Rest... rest) {
  return mul(mul(a, b), uint64_t(rest)...);
}
uint64_t sum(std::initializer_list<uint64_t> terms) {
  uint64_t total = 0;
  for (uint64_t t : terms) total = add(total, t);
  return total;
}
uint64_t round_up(uint64_t value, uint64_t multiple) {
  const uint64_t padded = add(value, multiple - 1);
  return padded == kSaturated ? kSaturated : padded / multiple * multiple;
}

// One rank's share of the model and its batch, as layers/gpt.cpp lays them out.
struct Shape {
  uint64_t L, C, F, V, P, NH;  // layers, width, MLP width, padded vocabulary, positions, heads
  uint64_t tp, dp;
  uint64_t Cl, Fl, NHl, Vs;  // this tensor-parallel rank's slices
  uint64_t B, T, BT, N;      // micro-batch, sequence, tokens, rows this rank keeps (sequence-parallel)
  uint64_t parts;            // of the optimizer shard: dp with the distributed optimizer, else 1
  bool sequence_parallel;
  bool untied_head;          // the LM head's own [V, C] weight (tie_word_embeddings false)
  uint64_t capacity = 0;     // decoding: the key/value cache's positions (0 for training and eval)
};

Shape shape_of(const RunSetup& s) {
  const GptConfig& m = s.model;
  Shape x{};
  x.L = uint64_t(m.n_layer);
  x.C = uint64_t(m.n_embd);
  x.F = uint64_t(m.n_inner);
  x.V = uint64_t(m.padded_vocab_size());
  x.P = uint64_t(m.n_positions);
  x.NH = uint64_t(m.n_head);
  x.tp = uint64_t(std::max(1, s.options.tensor_model_parallel_size));
  x.dp = uint64_t(std::max(1, s.data_parallel_size));
  x.Cl = x.C / x.tp;
  x.Fl = x.F / x.tp;
  x.NHl = x.NH / x.tp;
  x.Vs = x.V / x.tp;
  x.B = uint64_t(std::max(0, s.options.micro_batch_size));
  x.T = uint64_t(std::max(0, s.seq_length));
  x.BT = mul(x.B, x.T);
  x.sequence_parallel = s.options.sequence_parallel;
  x.untied_head = !m.tie_word_embeddings;
  x.N = x.sequence_parallel ? x.BT / x.tp : x.BT;
  const bool sharded = x.dp > 1 && s.options.use_distributed_optimizer.value_or(true);
  x.parts = sharded ? x.dp : 1;
  return x;
}

// Elements of one block's four Linear weights on this rank.
uint64_t block_linear_elements(const Shape& x) {
  return sum({mul(3 * x.C / x.tp, x.C), mul(x.C, x.Cl), mul(x.Fl, x.C), mul(x.C, x.Fl)});
}

// This rank's parameter slab: every bucket padded (make_gpt_shard_layout).
struct Slab {
  uint64_t elements = 0;
  uint64_t largest_bucket = 0;
};

Slab slab_of(const Shape& x) {
  const uint64_t pad = 256 * x.dp;  // kBucketAlignment x data-parallel size
  const uint64_t embedding = round_up(add(mul(x.Vs, x.C), mul(x.P, x.C)), pad);
  const uint64_t weights = round_up(block_linear_elements(x), pad);
  const uint64_t others = round_up(sum({mul(4, x.C), 3 * x.C / x.tp, x.C, x.Fl, x.C}), pad);
  const uint64_t head = round_up(add(mul(2, x.C), x.untied_head ? mul(x.Vs, x.C) : 0), pad);
  return Slab{sum({embedding, mul(x.L, add(weights, others)), head}), std::max({embedding, weights, others, head})};
}

// Elements of the whole model (make_gpt_layout: every tensor whole, the vocabulary padded).
uint64_t canonical_elements(const Shape& x) {
  const uint64_t per_layer = sum({mul(4, x.C), mul(3, x.C, x.C), mul(3, x.C), mul(x.C, x.C), x.C, mul(2, x.F, x.C),
                                  x.F, x.C});
  return sum({mul(x.V, x.C), mul(x.P, x.C), mul(x.L, per_layer), mul(2, x.C), x.untied_head ? mul(x.V, x.C) : 0});
}

// Bytes of one element of `dtype` in the backend's memory: the CPU keeps every dtype as FP32.
struct ElementBytes {
  bool cuda;
  uint64_t operator()(DType dtype) const {
    if (!cuda) return 4;
    switch (dtype) {
      case DType::f32: return 4;
      case DType::bf16: return 2;
      default: return 1;
    }
  }
};

// Bytes of a [rows, cols] tensor of `dtype` (with its transposed copy for FP8 operands that
// keep one), as the model's carver takes it (256-byte aligned).
uint64_t tensor_bytes(const ElementBytes& eb, uint64_t rows, uint64_t cols, DType dtype, bool with_transpose = false) {
  const uint64_t one = round_up(mul(rows, cols, eb(dtype)), 256);
  return with_transpose ? mul(one, 2) : one;
}

// An FP8 GEMM operand as the carver takes it: its data, the transposed copy when it keeps one,
// and under --fp8-recipe blockwise its scale arrays (FP32, for the data and the copy).
uint64_t operand_bytes(const ElementBytes& eb, uint64_t rows, uint64_t cols, DType dtype, bool with_transpose,
                       BlockScaling block) {
  uint64_t bytes = tensor_bytes(eb, rows, cols, dtype, with_transpose);
  if (block == BlockScaling::none || !is_fp8(dtype) || rows > uint64_t(INT64_MAX) || cols > uint64_t(INT64_MAX))
    return bytes;
  bytes = add(bytes, round_up(mul(uint64_t(scale_count(block, int64_t(rows), int64_t(cols))), 4), 256));
  if (with_transpose) bytes = add(bytes, round_up(mul(uint64_t(scale_count(block, int64_t(cols), int64_t(rows))), 4), 256));
  return bytes;
}

// The blocks [begin, end)'s GEMM precisions with how many blocks take each: one entry, or two
// when some run BF16 under fp8 (counted, not looped: the estimate also sizes absurd layer counts).
std::vector<std::pair<GemmPrecision, uint64_t>> block_precisions_in(const Shape& x, const GptPrecision& precision,
                                                                     uint64_t begin, uint64_t end) {
  if (end <= begin) return {};
  if (precision.gemm != GemmPrecision::fp8) return {{precision.gemm, end - begin}};
  const uint64_t bf16 = uint64_t(precision.bf16_block_count_in(int64_t(begin), int64_t(end), int64_t(x.L)));
  std::vector<std::pair<GemmPrecision, uint64_t>> blocks;
  if (bf16 > 0) blocks.push_back({GemmPrecision::bf16, bf16});
  if (end - begin > bf16) blocks.push_back({GemmPrecision::fp8, end - begin - bf16});
  return blocks;
}

// ... of every block.
std::vector<std::pair<GemmPrecision, uint64_t>> block_precisions(const Shape& x, const GptPrecision& precision) {
  return block_precisions_in(x, precision, 0, x.L);
}

// The activation slab of a training model (GptModel::plan_memory), or with `evaluating` of an
// evaluation model: one set of block buffers per block precision shared by every such block, the
// residual stream once, the whole batch's logits and losses, no backward buffers.
uint64_t activation_bytes(const Shape& x, const ElementBytes& eb, DType act, const GptPrecision& precision,
                          const ActivationRecompute& recompute, bool evaluating = false) {
  const DType head_input = forward_operand_dtype(precision.lm_head());
  const DType head_grad = gradient_operand_dtype(precision.lm_head(), precision.fp8.format);
  // Under --fp8-recipe blockwise an FP8 input operand keeps its own transposed copy and tile scales.
  const bool blockwise = precision.fp8.recipe == ScalingRecipe::blockwise;
  const BlockScaling tiles = blockwise ? BlockScaling::tiles_1x128 : BlockScaling::none;
  auto input_operand = [&](uint64_t rows, uint64_t cols, DType dtype) {
    return operand_bytes(eb, rows, cols, dtype, blockwise && is_fp8(dtype), tiles);
  };
  // Each block's saved activations, with its own GEMM operand dtype (BF16 blocks under
  // --first-last-layers-bf16), and one gradient operand buffer per dtype the blocks use.
  // Recomputed blocks (ActivationRecompute) keep their input at a group's start and share
  // buffer sets: one per position in a group for each precision among them.
  std::vector<DType> grad_dtypes;
  for (const auto& [gemm, count] : block_precisions(x, precision)) {
    const DType block_grad = gradient_operand_dtype(gemm, precision.fp8.format);
    if (std::find(grad_dtypes.begin(), grad_dtypes.end(), block_grad) == grad_dtypes.end())
      grad_dtypes.push_back(block_grad);
  }
  const uint64_t residual = tensor_bytes(eb, x.N, x.C, act);  // a block's input (the first's is the encoder output)
  const bool sp = x.sequence_parallel;
  // Under selective `layernorm` FP8 blocks with per-tensor scales keep no LayerNorm output
  // outside sequence parallelism: their backward writes the wgrad operands again
  // (GptModel::recomputes_layernorm_operand) into one buffer with its transpose, counted once below.
  auto recomputes_layernorm_operands = [&](GemmPrecision gemm) {
    return recompute.layernorm && gemm == GemmPrecision::fp8 && !blockwise && !evaluating && !sp;
  };
  // ... and under `core_attn` no cast of the attention output (c_proj's input), which the
  // backward casts again from the kept output (GptModel::recomputes_attention_operand): one
  // buffer with its transpose.
  auto recomputes_attention_operand = [&](GemmPrecision gemm) {
    return recompute.attention_output && gemm == GemmPrecision::fp8 && !blockwise && !evaluating;
  };
  // Selective recomputation's tensors (the LayerNorm outputs, c_fc's and the GELU's), which
  // one set per precision holds for every block.
  auto layernorm_outputs = [&](GemmPrecision gemm) {
    if (recomputes_layernorm_operands(gemm)) return uint64_t(0);
    return mul(2, input_operand(x.BT, x.C, forward_operand_dtype(gemm)));  // ln1, ln2
  };
  // FP8 blocks with per-tensor scales keep no GELU output: their GELU backward recomputes it
  // into one buffer (GptModel::recomputes_gelu_output), which is counted once below.
  auto recomputes_gelu_output = [&](GemmPrecision gemm) {
    return gemm == GemmPrecision::fp8 && !blockwise && !evaluating;
  };
  auto mlp_outputs = [&](GemmPrecision gemm) {
    return add(tensor_bytes(eb, x.BT, x.Fl, act),
               recomputes_gelu_output(gemm) ? 0 : input_operand(x.BT, x.Fl, forward_operand_dtype(gemm)));
  };
  auto selectively_recomputed = [&](GemmPrecision gemm) {
    return add(recompute.layernorm ? layernorm_outputs(gemm) : 0, recompute.mlp ? mlp_outputs(gemm) : 0);
  };
  auto block_buffers = [&](GemmPrecision gemm) {  // all but the input (and what one set holds)
    const DType block_input = forward_operand_dtype(gemm);
    return sum({
        mul(2, tensor_bytes(eb, x.N, 1, DType::f32)),  // ln1 mean, rstd
        tensor_bytes(eb, x.BT, 3 * x.Cl, act),         // qkv
        tensor_bytes(eb, x.BT, x.Cl, act),             // attention output
        block_input == act || recomputes_attention_operand(gemm) ? 0 : input_operand(x.BT, x.Cl, block_input),
        tensor_bytes(eb, mul(x.B, x.NHl), x.T, DType::f32),  // log-sum-exp
        tensor_bytes(eb, x.N, x.C, act),                      // residual_mid
        mul(2, tensor_bytes(eb, x.N, 1, DType::f32)),         // ln2 mean, rstd
        recompute.layernorm ? 0 : layernorm_outputs(gemm),
        recompute.mlp ? 0 : mlp_outputs(gemm),
    });
  };
  // What a training and an evaluation model hold once beside the blocks: the embedding's rows, the
  // row-parallel branch, the last residual stream, ln_f's output and statistics, the logits and
  // the token losses with their cross-entropy partials.
  const uint64_t forward_once = sum({
      tensor_bytes(eb, x.BT, x.C, DType::f32),  // token embeddings
      sp ? tensor_bytes(eb, x.N, x.C, DType::f32) : 0,
      tensor_bytes(eb, x.BT, x.C, act),  // branch
      sp ? tensor_bytes(eb, x.N, x.C, act) : 0,
      tensor_bytes(eb, x.N, x.C, act),  // residual_final
      input_operand(x.BT, x.C, head_input),
      mul(2, tensor_bytes(eb, x.N, 1, DType::f32)),
      tensor_bytes(eb, x.BT, x.Vs, act),      // logits
      tensor_bytes(eb, x.BT, 1, DType::f32),  // losses
      tensor_bytes(eb, x.BT, 3, DType::f32),  // cross-entropy partials
      x.tp > 1 ? tensor_bytes(eb, mul(x.tp, x.BT), 3, DType::f32) : 0,
  });
  if (evaluating) {
    // The residual stream (the encoder output) once, every block's, and one buffer set per precision.
    uint64_t sets = 0;
    for (const auto& [gemm, count] : block_precisions(x, precision)) sets = add(sets, block_buffers(gemm));
    return sum({forward_once, residual, sets});
  }
  const uint64_t recomputed = uint64_t(recompute.recomputed_blocks(int64_t(x.L)));
  uint64_t layers = 0;
  for (const auto& [gemm, count] : block_precisions_in(x, precision, recomputed, x.L))
    layers = add(layers, mul(count, add(residual, block_buffers(gemm))));
  if (recompute.selective())
    for (const auto& [gemm, count] : block_precisions(x, precision)) layers = add(layers, selectively_recomputed(gemm));
  if (recomputed > 0) {
    const uint64_t sets = uint64_t(recompute.buffer_sets(int64_t(x.L)));
    layers = add(layers, mul(uint64_t(recompute.kept_inputs(int64_t(x.L))), residual));
    for (const auto& [gemm, count] : block_precisions_in(x, precision, 0, recomputed))
      layers = add(layers, add(mul(sets, block_buffers(gemm)), mul(sets - 1, residual)));
  }
  uint64_t grad_operands = 0;
  // The shared buffers of the operands written again (above), each with its transpose, once.
  bool layernorm_operand = false, attention_operand = false;
  for (const auto& [gemm, count] : block_precisions(x, precision)) {
    if (!layernorm_operand && recomputes_layernorm_operands(gemm)) {
      layers = add(layers, tensor_bytes(eb, x.BT, x.C, forward_operand_dtype(gemm), true));
      layernorm_operand = true;
    }
    if (!attention_operand && recomputes_attention_operand(gemm)) {
      layers = add(layers, tensor_bytes(eb, x.BT, x.Cl, forward_operand_dtype(gemm), true));
      attention_operand = true;
    }
  }
  for (const auto& [gemm, count] : block_precisions(x, precision)) {
    if (!recomputes_gelu_output(gemm)) continue;
    // The recomputed GELU output with its transpose, and mlp.c_proj's held gradient operand.
    grad_operands = sum({grad_operands, tensor_bytes(eb, x.BT, x.Fl, forward_operand_dtype(gemm), true),
                         tensor_bytes(eb, x.BT, x.C, gradient_operand_dtype(gemm, precision.fp8.format), true)});
  }
  for (DType grad_dtype : grad_dtypes)
    grad_operands = add(grad_operands, operand_bytes(eb, x.BT, std::max({x.Fl, 3 * x.Cl, x.C}), grad_dtype,
                                                     is_fp8(grad_dtype), tiles));
  const uint64_t backward_once = sum({
      // The FP8 head's per-tensor codes: their transposed copy takes the logits' storage.
      head_grad == act                               ? 0
      : is_fp8(head_grad) && tiles == BlockScaling::none ? tensor_bytes(eb, x.BT, x.Vs, head_grad)
                                                     : operand_bytes(eb, x.BT, x.Vs, head_grad, is_fp8(head_grad), tiles),
      tensor_bytes(eb, x.N, x.C, act),  // dresidual
      sp ? tensor_bytes(eb, x.BT, x.C, act) : 0,
      tensor_bytes(eb, x.BT, x.C, act),  // dln
      sp ? tensor_bytes(eb, x.N, x.C, act) : 0,
      tensor_bytes(eb, x.BT, x.Cl, act),      // datty
      tensor_bytes(eb, x.BT, 3 * x.Cl, act),  // dqkv
      tensor_bytes(eb, x.BT, x.Fl, act),      // dgelu
      grad_operands,
  });
  return sum({layers, forward_once, backward_once});
}

// The elements the working copy leaves out (GptPrecision::fp8_linear_working_copy): the FP8
// blocks' Linear-weight buckets, each padded to 256 x dp elements; and the bytes of the table of
// where the other tensors sit, which the model then holds (8 a tensor).
struct LeftOut {
  uint64_t elements = 0, table_bytes = 0;
};
LeftOut working_copy_left_out(const Shape& x, const GptPrecision& precision) {
  if (precision.fp8_linear_working_copy || precision.gemm != GemmPrecision::fp8) return {};
  const uint64_t fp8_blocks = x.L - uint64_t(precision.bf16_block_count(int64_t(x.L)));
  if (fp8_blocks == 0) return {};
  return {mul(fp8_blocks, round_up(block_linear_elements(x), 256 * x.dp)), mul(mul(x.L, 12) + 4, 8)};
}

// Weight operands that are not views of the working copy (FP8 codes and their transposes;
// BF16 copies on the CPU, whose working copy is FP32). A training model's FP8 weights keep
// their transposes, or under --no-fp8-weight-transpose-cache share one the size of the largest
// (GptModel::dgrad_weight); a model that runs no backward has none.
uint64_t weight_operand_bytes(const Shape& x, const ElementBytes& eb, DType act, const GptPrecision& precision,
                              bool trains = true) {
  const BlockScaling blocks =
      precision.fp8.recipe == ScalingRecipe::blockwise ? BlockScaling::blocks_128x128 : BlockScaling::none;
  const bool with_transposes = trains && precision.fp8_weight_transpose_cache;
  uint64_t bytes = 0, largest_fp8 = 0;
  auto add_operand = [&](uint64_t count, uint64_t rows, uint64_t cols, DType dtype) {
    bytes = add(bytes, mul(count, operand_bytes(eb, rows, cols, dtype, is_fp8(dtype) && with_transposes, blocks)));
    if (is_fp8(dtype)) largest_fp8 = std::max(largest_fp8, mul(rows, cols));
  };
  for (const auto& [gemm, count] : block_precisions(x, precision)) {
    const DType block = forward_operand_dtype(gemm);
    if (block == act) continue;
    for (const auto& [rows, cols] : {std::pair{3 * x.C / x.tp, x.C}, {x.C, x.Cl}, {x.Fl, x.C}, {x.C, x.Fl}})
      add_operand(count, rows, cols, block);
  }
  const DType head = forward_operand_dtype(precision.lm_head());
  if (head != act) add_operand(1, x.Vs, x.C, head);
  if (trains && !with_transposes && largest_fp8 > 0)
    bytes = add(bytes, operand_bytes(eb, largest_fp8, 1, DType::e4m3, false, BlockScaling::none));
  return bytes;
}

int fp8_scaling_states(const RunSetup& s) {
  if (!s.options.fp8_enabled()) return 0;
  // Three per FP8 Linear (input, weight, output gradient): four per FP8 block, and the head's.
  const int64_t fp8_blocks = s.model.n_layer - model_precision(s.options).bf16_block_count(s.model.n_layer);
  return int(3 * (4 * std::max<int64_t>(fp8_blocks, 0) + (s.options.fp8_lm_head ? 1 : 0)));
}

// The CUDA backend's workspaces (layers/ops_cuda.cpp plan_workspace), from the kernels' own
// scratch sizes. Shapes beyond the kernels' 32-bit indexing saturate.
uint64_t cuda_workspace_bytes(const Shape& x) {
  const uint64_t widest = std::max({x.Fl, 3 * x.Cl, x.C});
  if (x.BT > uint64_t(INT_MAX) || widest > uint64_t(INT_MAX) || x.N > uint64_t(INT_MAX)) return kSaturated;
  const int BT = int(x.BT);
  size_t floats = cuda::layernorm_backward_scratch_floats(BT, int(x.C));
  floats = std::max(floats, cuda::gelu_backward_scratch_floats(BT, int(x.Fl)));
  floats = std::max(floats, cuda::attention_backward_operand_scratch_floats(int(x.B), int(x.T), int(x.Cl), int(x.NHl)));
  floats = std::max(floats, cuda::dbias_scratch_floats(BT, int(widest)));
  if (x.capacity > 0) {
    if (x.capacity > uint64_t(INT_MAX)) return kSaturated;
    floats = std::max(floats, cuda::attention_decode_scratch_floats(int(x.B), int(x.Cl), int(x.NHl), int(x.capacity)));
  }
  return sum({mul(floats, 4), mul(x.BT, widest, 2), mul(x.BT, std::max(widest, x.C)),
              mul(cuda_token_slot_ints(x.B, x.T), 4), uint64_t(cuda::GemmEngine::kWorkspaceBytes)});
}

// The CPU backend's scratch vectors (layers/ops_cpu.cpp), at their largest: a normalised or
// activated [BT, width] block, and the transposes of the LM head's wgrad GEMM operands.
uint64_t cpu_workspace_bytes(const Shape& x) {
  const uint64_t widest = std::max({x.Fl, 3 * x.Cl, x.C});
  return mul(4, sum({mul(x.BT, widest), std::max(mul(x.BT, x.Vs), mul(x.Vs, x.C)), mul(x.BT, widest)}));
}

std::string number(uint64_t value) { return std::to_string(value); }

// A consumer held in the backend's memory: the host on a CPU run, the GPU on a CUDA run.
void add_backend_consumer(MemoryEstimate& estimate, bool cuda, std::string name, uint64_t bytes, std::string remedy,
                          bool engine_slab = true) {
  MemoryConsumer c;
  c.name = std::move(name);
  (cuda ? c.device_bytes : c.host_bytes) = bytes;
  c.remedy = std::move(remedy);
  c.engine_slab = engine_slab;
  estimate.consumers.push_back(std::move(c));
}

// The backend's workspaces of a training or an evaluation model (ModelShape of plan_workspace).
void add_workspace_consumer(MemoryEstimate& estimate, const Shape& x, bool cuda) {
  if (cuda) {
    add_backend_consumer(estimate, cuda, "GPU workspaces (kernel scratch, cuBLASLt)", cuda_workspace_bytes(x),
                         "lower --micro-batch-size");
  } else {
    add_backend_consumer(estimate, cuda, "CPU backend scratch (normalised blocks, GEMM transposes)",
                         cpu_workspace_bytes(x), "lower --micro-batch-size or --seq-length", /*engine_slab=*/false);
  }
}

// The FP8 amax histories of `states` scaling states: the host table and, on the GPU, its
// device twin. Registering each state re-lays the history, so building it briefly holds two
// copies on the host. Nothing without FP8 states.
void add_scaling_consumer(MemoryEstimate& estimate, int states, int history_len, bool cuda) {
  if (states <= 0) return;
  const uint64_t history = mul(uint64_t(states), uint64_t(history_len), 4);
  MemoryConsumer c;
  c.name = "FP8 amax histories (" + number(uint64_t(states)) + " scaling states x history " +
           number(uint64_t(history_len)) + ")";
  c.host_bytes = mul(history, 2);
  c.device_bytes = cuda ? history : 0;
  c.remedy = "lower --fp8-amax-history-len (the default, Megatron-LM's, is 1)";
  estimate.consumers.push_back(std::move(c));
}

// What the process holds besides its run's slabs: measured, not modelled, what it holds
// before the run allocates (code, the CUDA and MPI libraries, the parsed inputs); on the GPU,
// an allowance for the CUDA context and libraries.
void add_process_consumers(MemoryEstimate& estimate, bool cuda) {
  MemoryConsumer process;
  process.name = "host: this process before allocating (VmRSS)";
  process.host_bytes = measure_host_memory().host_current_bytes;
  estimate.consumers.push_back(std::move(process));
  if (cuda) {
    MemoryConsumer context;
    context.name = "host: CUDA context and libraries (allowance)";
    context.host_bytes = kCudaHostAllowance;
    estimate.consumers.push_back(std::move(context));
  }
}

}  // namespace

uint64_t MemoryEstimate::host_bytes() const {
  uint64_t held = 0, transient = 0;
  for (const MemoryConsumer& c : consumers) {
    if (c.transient) transient = std::max(transient, c.host_bytes);
    else held = add(held, c.host_bytes);
  }
  return add(held, transient);
}

uint64_t MemoryEstimate::device_bytes() const {
  uint64_t held = 0, transient = 0;
  for (const MemoryConsumer& c : consumers) {
    if (c.transient) transient = std::max(transient, c.device_bytes);
    else held = add(held, c.device_bytes);
  }
  return add(held, transient);
}

MemoryEstimate estimate_memory(const RunSetup& s) {
  const TrainOptions& o = s.options;
  const Shape x = shape_of(s);
  const bool cuda = s.use_cuda;
  const ElementBytes eb{cuda};
  const DType act = cuda ? DType::bf16 : DType::f32;
  const bool sharded = x.parts > 1;
  const GptPrecision precision = engine_model_precision(o, sharded, act);

  const Slab slab = slab_of(x);
  const uint64_t n = slab.elements;            // this rank's parameter slab
  const uint64_t S = n / x.parts;              // this rank's optimizer shard
  const uint64_t canonical = canonical_elements(x);  // the whole model (snapshots)
  const uint64_t tensors = mul(x.L, 12) + 4;

  MemoryEstimate estimate;
  const std::string more_tp = "raise --tensor-model-parallel-size";
  const std::string zero = "shard it with the distributed optimizer over more data-parallel ranks";

  // The working copy: every parameter, or all but the FP8 blocks' Linear-weight buckets
  // (GptPrecision::fp8_linear_working_copy), with a table of where each tensor sits.
  const LeftOut left_out = working_copy_left_out(x, precision);
  uint64_t weights = add(mul(n - left_out.elements, eb(act)), left_out.table_bytes);
  weights = add(weights, weight_operand_bytes(x, eb, act, precision));
  const bool keeps_fp8_weight_transposes = o.fp8_enabled() && precision.fp8_weight_transpose_cache &&
                                           precision.fp8.recipe != ScalingRecipe::blockwise;
  add_backend_consumer(estimate, cuda,
                       "parameters (" + std::string(to_string(act)) + " working copy" +
                           (o.fp8_enabled() ? ", FP8 weight operands" : "") + ")",
                       weights,
                       keeps_fp8_weight_transposes
                           ? more_tp + ", or --no-fp8-weight-transpose-cache (1 byte a weight less)"
                           : more_tp);
  // The gradient slab in its dtype: BF16 under --grad-reduce-in-bf16 (Megatron's BF16 main_grad).
  const DType grad_dtype = precision.gradients;
  add_backend_consumer(estimate, cuda, grad_dtype == DType::bf16 ? "gradients (BF16)" : "gradients (FP32)",
                       mul(n, eb(grad_dtype)), more_tp);

  const bool master_is_working_copy = !sharded && act == DType::f32;
  const uint64_t state_bytes_per_element = o.optimizer_state == OptimizerStatePrecision::fp8_fp16 ? 3 : 8;
  uint64_t optimizer = sum({master_is_working_copy ? 0 : mul(S, 4), mul(S, state_bytes_per_element),
                            mul(tensors, 4 * 4 + 8)});
  add_backend_consumer(estimate, cuda,
                       std::string("optimizer: FP32 master + AdamW state (") +
                           std::string(to_string(o.optimizer_state)) + ")" +
                           (sharded ? ", 1/" + number(x.dp) + " shard" : ""),
                       optimizer,
                       o.optimizer_state == OptimizerStatePrecision::fp32
                           ? "pass --optimizer-state-precision fp8-fp16, or " + zero
                           : zero);

  // The data-parallel collectives work in place in the gradient and working slabs (the engine's
  // ZeRO-1), FP32 and BF16 gradients in their own slab: what they need besides is, under
  // --fp8-grad-comm, one bucket of FP8 codes and, for the all-to-all, every rank's codes of
  // this rank's part, and under --fp8-param-gather the FP8 codes of the whole slab, gathered in
  // place.
  uint64_t communication = 0;
  const bool fp8_grad_comm = o.fp8_grad_comm && x.dp > 1;
  if (fp8_grad_comm)
    communication = mul(slab.largest_bucket, o.fp8_grad_reduce == GradReduceAlgorithm::all_to_all ? 2 : 1);
  if (o.fp8_param_gather) communication = add(communication, n);
  if (communication)
    add_backend_consumer(estimate, cuda, "communication buffers (data-parallel)", communication, more_tp);

  add_backend_consumer(
      estimate, cuda,
      "activations (micro-batch " + number(x.B) + " x seq-length " + number(x.T) + ", " + number(x.L) + " layers)",
      activation_bytes(x, eb, act, precision, activation_recompute(o)),
      "lower --micro-batch-size (raise --global-batch-size accumulation instead) or --seq-length, or " + more_tp);

  add_workspace_consumer(estimate, x, cuda);

  add_scaling_consumer(estimate, fp8_scaling_states(s), s.options.fp8.amax_history_len, cuda);

  if (x.dp > 1 || x.tp > 1) {
    if (cuda) {
      MemoryConsumer c;
      c.name = "NCCL communicators (allowance)";
      c.device_bytes = mul(kNcclAllowance, uint64_t((x.dp > 1) + (x.tp > 1)));
      estimate.consumers.push_back(std::move(c));
    }
  }

  {  // Host: the batch, the data streams, the CUDA runtime.
    MemoryConsumer c;
    c.name = "host: token batches and data";
    uint64_t data = mul(x.BT, 4, 2, 2);  // inputs and targets, the loop's and the backend's
    if (cuda) data = add(data, mul(4, add(mul(5, x.BT), 1), 4));  // pinned staging slots
    if (o.mock_data) {
      const uint64_t stream_floor = add(mul(4, x.B, x.dp, x.T), 1);
      const uint64_t train_tokens = std::max<uint64_t>(kMockTrainTokens, stream_floor);
      const uint64_t valid_tokens = o.valid_data_path.empty() && o.valid_data_blend.empty()
                                      ? std::max<uint64_t>(kMockValidTokens, stream_floor)
                                      : 0;
      // uint16 tokens, and each stream's shuffled sample order (8 bytes a sample).
      data = sum({data, mul(add(train_tokens, valid_tokens), 2),
                  x.T ? mul(add(train_tokens, valid_tokens) / x.T, 8) : 0});
    }
    c.host_bytes = data;
    c.remedy = "lower --micro-batch-size";
    estimate.consumers.push_back(std::move(c));
  }
  add_process_consumers(estimate, cuda);

  {  // Host staging: the initial weights, and snapshots for checkpoints (whole tensors).
    MemoryConsumer init;
    init.name = "host: initial weights staging (whole model, FP32)";
    init.transient = true;
    // The canonical FP32 weights and this rank's slab of them, then either the BF16 bits
    // uploaded to the GPU or the master shard (TrainingEngine::set_parameters).
    init.host_bytes = sum({mul(canonical, 4), mul(n, 4),
                           std::max(cuda ? mul(n, 2) : 0, master_is_working_copy ? 0 : mul(n, 4))});
    init.remedy = more_tp;
    estimate.consumers.push_back(init);
    if (!o.save_dir.empty() || !o.load_dir.empty() || !o.init_from.empty()) {
      MemoryConsumer checkpoint;
      checkpoint.name = "host: checkpoint staging (whole model: weights, AdamW state)";
      checkpoint.transient = true;
      // The weights and optimizer snapshots (whole tensors), and then the larger of a
      // gather's buffers (every tensor-parallel rank's slab, this rank's, its shard) and
      // the safetensors writer's copy of one file.
      // Without the optimizer state both ways (--no-save-optim, --no-load-optim), the weights only.
      const bool saves_optimizer = !o.save_dir.empty() && !o.no_save_optim;
      const bool loads_optimizer = !o.load_dir.empty() && !o.no_load_optim;
      const uint64_t state = saves_optimizer || loads_optimizer ? state_bytes_per_element : 0;
      checkpoint.host_bytes = add(mul(canonical, 4 + state), std::max(sum({mul(n, x.tp, 4), mul(n, 4), mul(S, 4)}),
                                                                     mul(canonical, std::max<uint64_t>(4, state))));
      checkpoint.remedy = more_tp;
      estimate.consumers.push_back(checkpoint);
    }
  }
  return estimate;
}

namespace {

// A forward-only model's parameters (fp8lm eval and fp8lm sample; GptPrecision of
// forward_only_model_precision): the working copy, on the GPU without the FP8 blocks' Linear
// weights (their E4M3 codes are cast once from the FP32 values) and with a table of where the
// rest sits, and the weight operands without transposes (no dgrad).
void add_forward_only_parameters(MemoryEstimate& estimate, const Shape& x, bool cuda, const GptPrecision& precision,
                                 bool fp8, std::string remedy) {
  const ElementBytes eb{cuda};
  const DType act = cuda ? DType::bf16 : DType::f32;
  const uint64_t n = slab_of(x).elements;
  const uint64_t operands = weight_operand_bytes(x, eb, act, precision, /*trains=*/false);
  const LeftOut left_out = working_copy_left_out(x, precision);
  add_backend_consumer(estimate, cuda,
                       "parameters (" + std::string(to_string(act)) + " working copy" +
                           (fp8 ? ", FP8 weight operands" : "") + ")",
                       sum({mul(n - left_out.elements, eb(act)), left_out.table_bytes, operands,
                            operands ? uint64_t{256} : uint64_t{0}}),
                       std::move(remedy));
}

// The weights on their way into a forward-only model (Evaluator::load, Generator::load and
// set_parameters; set_forward_only_weights). Setting them holds the canonical FP32 values, this
// rank's slab of them and, on the GPU, the upload's BF16 bits; reading a file first holds the
// canonical values, the mapped file (FP32 at most) and one tensor converted to FP32. On the GPU
// under FP8, one block's Linear weights in FP32 at a time, which its E4M3 codes are cast from.
void add_forward_only_weight_staging(MemoryEstimate& estimate, const Shape& x, bool cuda, bool fp8_block_weights,
                                     bool reads_weights) {
  const uint64_t n = slab_of(x).elements, canonical = canonical_elements(x);
  const uint64_t setting = sum({mul(canonical, 4), mul(n, 4), cuda ? mul(n, 2) : 0});
  const uint64_t reading = sum({mul(canonical, 8), mul(std::max(mul(x.V, x.C), mul(x.F, x.C)), 4)});
  MemoryConsumer c;
  c.name = reads_weights ? "host: weights staging (the file read to FP32, then set)"
                         : "host: weights staging (random initialisation in FP32, then set)";
  c.transient = true;
  c.host_bytes = reads_weights ? std::max(setting, reading) : setting;
  c.remedy = "the host holds the whole model in FP32 while the weights are set: free host memory";
  estimate.consumers.push_back(c);
  if (cuda && fp8_block_weights) {
    MemoryConsumer cast;
    cast.name = "GPU: FP32 weights of one block, cast to FP8 (while loading)";
    cast.transient = true;
    cast.device_bytes = mul(round_up(block_linear_elements(x), 256), 4);
    cast.remedy = "BF16 GEMMs (--bf16) need no FP32 copy on the GPU";
    estimate.consumers.push_back(cast);
  }
}

}  // namespace

MemoryEstimate estimate_evaluation_memory(const RunSetup& s) {
  const TrainOptions& o = s.options;
  // The evaluation model pads its buckets for one data-parallel rank: it reduces nothing.
  RunSetup one_replica = s;
  one_replica.data_parallel_size = 1;
  const Shape x = shape_of(one_replica);
  const uint64_t data_parallel = uint64_t(std::max(1, s.data_parallel_size));
  const bool cuda = s.use_cuda;
  const ElementBytes eb{cuda};
  const DType act = cuda ? DType::bf16 : DType::f32;
  const GptPrecision precision = forward_only_model_precision(o, act);
  const bool fp8_block_weights = o.fp8_enabled() && precision.bf16_block_count(int64_t(x.L)) < int64_t(x.L);

  MemoryEstimate estimate;
  add_forward_only_parameters(estimate, x, cuda, precision, o.fp8_enabled(),
                              "split the model over ranks: mpirun -np N fp8lm eval --tensor-model-parallel-size N");
  add_backend_consumer(estimate, cuda,
                       "activations (micro-batch " + number(x.B) + " x seq-length " + number(x.T) +
                           ", one block's buffers shared by " + number(x.L) + " layers; the batch's logits)",
                       // 256: the carver's slack at the slab's end, as the decoder's estimate counts it
                       add(activation_bytes(x, eb, act, precision, ActivationRecompute{}, /*evaluating=*/true), 256),
                       "lower --micro-batch-size or --seq-length (eval scores --eval-iters batches of this shape)");
  add_workspace_consumer(estimate, x, cuda);
  add_scaling_consumer(estimate, fp8_scaling_states(s), o.fp8.amax_history_len, cuda);
  if (cuda && (data_parallel > 1 || x.tp > 1)) {
    MemoryConsumer c;
    c.name = "NCCL communicators (allowance)";
    c.device_bytes = mul(kNcclAllowance, uint64_t((data_parallel > 1) + (x.tp > 1)));
    estimate.consumers.push_back(std::move(c));
  }
  {  // Host: the batch and the backend's staging of it.
    MemoryConsumer c;
    c.name = "host: token batches and data";
    c.host_bytes = add(mul(x.BT, 4, 2, 2), cuda ? mul(4, add(mul(5, x.BT), 1), 4) : 0);
    c.remedy = "lower --micro-batch-size";
    estimate.consumers.push_back(std::move(c));
  }
  add_process_consumers(estimate, cuda);
  add_forward_only_weight_staging(estimate, x, cuda, fp8_block_weights, /*reads_weights=*/true);
  return estimate;
}

namespace {

// The decoder's model (GptModel's inference constructor): one rank, its whole model, a batch
// of `batch` sequences whose prompt pass takes `max_prompt` tokens each.
Shape decoding_shape_of(const RunSetup& s, const InferenceShape& inference) {
  RunSetup one_rank = s;
  one_rank.options.tensor_model_parallel_size = 1;
  one_rank.options.sequence_parallel = false;
  one_rank.options.micro_batch_size = std::max(0, inference.batch);
  one_rank.seq_length = std::max(0, inference.max_prompt);
  one_rank.data_parallel_size = 1;
  Shape x = shape_of(one_rank);
  x.capacity = uint64_t(std::max(0, inference.capacity));
  return x;
}

// The inference model's activation slab (GptModel::plan_memory without training): one
// block's buffers, shared by every block, each GEMM operand at the activation dtype's size
// (the blocks re-stamp them with their own dtypes); the head's input; one row of logits per
// sequence. The Carver's slack of 256 bytes at the end included.
uint64_t decoding_activation_bytes(const Shape& x, const ElementBytes& eb, DType act, const GptPrecision& precision) {
  const DType head_input = forward_operand_dtype(precision.lm_head());
  return sum({
      tensor_bytes(eb, x.BT, x.C, DType::f32),                   // token embeddings
      tensor_bytes(eb, x.N, x.C, act),                           // encoded: every block's residual stream
      tensor_bytes(eb, x.BT, x.C, act),                          // ln1
      mul(2, tensor_bytes(eb, x.N, 1, DType::f32)),              // ln1 mean, rstd
      tensor_bytes(eb, x.BT, 3 * x.C, act),                      // qkv
      mul(2, tensor_bytes(eb, x.BT, x.C, act)),                  // attention output, and c_proj's operand
      tensor_bytes(eb, mul(x.B, x.NH), x.T, DType::f32),         // log-sum-exp of the prompt's attention
      tensor_bytes(eb, x.N, x.C, act),                           // residual_mid
      tensor_bytes(eb, x.BT, x.C, act),                          // ln2
      mul(2, tensor_bytes(eb, x.N, 1, DType::f32)),              // ln2 mean, rstd
      mul(2, tensor_bytes(eb, x.BT, x.F, act)),                  // fc_pre, gelu
      tensor_bytes(eb, x.BT, x.C, act),                          // branch
      tensor_bytes(eb, x.N, x.C, act),                           // residual_final
      tensor_bytes(eb, x.BT, x.C, head_input),                   // ln_f's output, the head's operand
      mul(2, tensor_bytes(eb, x.N, 1, DType::f32)),              // ln_f mean, rstd
      tensor_bytes(eb, x.B, x.Vs, act),                          // logits [B, V]
      256,
  });
}

}  // namespace

MemoryEstimate estimate_decoding_memory(const RunSetup& s, const GeneratorShape& generator) {
  const TrainOptions& o = s.options;
  const InferenceShape inference = decoding_model_shape(generator);
  const Shape x = decoding_shape_of(s, inference);
  const bool cuda = s.use_cuda;
  const ElementBytes eb{cuda};
  const DType act = cuda ? DType::bf16 : DType::f32;
  const GptPrecision precision = forward_only_model_precision(o, act);
  const uint64_t capacity = uint64_t(std::max(0, inference.capacity));
  const uint64_t new_tokens = capacity + 1 - std::min<uint64_t>(capacity, uint64_t(std::max(1, generator.max_prompt)));
  const bool fp8_block_weights =
      o.fp8_enabled() && precision.bf16_block_count(int64_t(x.L)) < int64_t(x.L);
  const bool reads_weights = !o.load_dir.empty() || !o.init_from.empty();

  MemoryEstimate estimate;
  // The CPU stores every dtype as FP32: an FP8 cache or BF16 GEMMs save nothing there.
  const std::string smaller_cache =
      "lower --batch-size or --max-new-tokens (or shorten the prompt)" +
      std::string(cuda && !generator.fp8_kv_cache ? ", or pass --kv-cache-dtype fp8 (half the bytes)" : "");

  add_forward_only_parameters(estimate, x, cuda, precision, o.fp8_enabled(),
                              "fp8lm sample holds the whole model " + std::string(cuda ? "on one GPU" : "in one process") +
                                  ": use a machine with more memory");

  const DType cache_dtype = generator.fp8_kv_cache ? DType::e4m3 : act;
  add_backend_consumer(estimate, cuda,
                       "key/value cache (" + std::string(generator.fp8_kv_cache ? "FP8 E4M3" : to_string(act)) +
                           ": batch " + number(x.B) + " x capacity " + number(capacity) + " x " + number(x.L) +
                           " layers x keys and values x " + number(x.C) + ")",
                       sum({tensor_bytes(eb, mul(2, x.L), 1, DType::f32),  // the per-layer scales
                            mul(x.L, 2, tensor_bytes(eb, mul(x.B, capacity), x.C, cache_dtype)), 256}),
                       smaller_cache);

  add_backend_consumer(estimate, cuda,
                       "activations (prompt pass: batch " + number(x.B) + " x " + number(x.T) +
                           " tokens, one block's buffers shared by " + number(x.L) + " layers; logits of " +
                           number(x.B) + " sequences)",
                       decoding_activation_bytes(x, eb, act, precision), "lower --batch-size or shorten the prompt");

  if (cuda) {
    add_backend_consumer(estimate, cuda, "GPU workspaces (kernel scratch, cuBLASLt)", cuda_workspace_bytes(x),
                         "lower --batch-size or shorten the prompt");
  } else {
    // CpuOps' scratch vector: a normalised or activated block of the prompt pass.
    add_backend_consumer(estimate, cuda, "CPU backend scratch (a normalised or activated block)",
                         mul(x.BT, std::max(x.C, x.F), 4), "lower --batch-size or shorten the prompt",
                         /*engine_slab=*/false);
  }

  add_backend_consumer(estimate, cuda,
                       "chosen tokens (batch " + number(x.B) + " x capacity " + number(capacity) +
                           ", and a histogram of the 65,536 BF16 values per sequence for top-k and top-p)",
                       decoding_token_bytes(int(x.B), int(capacity)), "lower --batch-size");

  add_scaling_consumer(estimate, fp8_scaling_states(s), s.options.fp8.amax_history_len, cuda);

  {  // The generation loop's host buffers (Generator::generate) and the backend's token copies.
    MemoryConsumer c;
    c.name = "host: prompt, logits and new tokens";
    c.host_bytes = sum({mul(x.BT, 4, 3),           // the prompt pass's tokens, and the backend's inputs and targets
                        mul(x.B, x.Vs, 4),         // the last step's logits, downloaded
                        mul(x.B, new_tokens, 4, 2),  // the generated tokens, and their read-back rows
                        mul(x.B, 64),              // each sequence's state
                        cuda ? mul(4, add(mul(5, x.BT), 1), 4) : 0});  // pinned staging slots
    c.remedy = "lower --batch-size or --max-new-tokens";
    estimate.consumers.push_back(std::move(c));
  }
  add_process_consumers(estimate, cuda);

  add_forward_only_weight_staging(estimate, x, cuda, fp8_block_weights, reads_weights);
  return estimate;
}

uint64_t MemoryEstimate::engine_bytes(bool device) const {
  uint64_t total = 0;
  for (const MemoryConsumer& c : consumers) {
    if (c.engine_slab) total = add(total, device ? c.device_bytes : c.host_bytes);
  }
  return total;
}

// ---- What the machine has -----------------------------------------------------------

namespace {

// A "Key:   123 kB" line of a /proc file, in bytes; 0 when absent.
uint64_t proc_kib_field(const char* path, const std::string& key) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind(key + ":", 0) != 0) continue;
    return std::strtoull(line.c_str() + key.size() + 1, nullptr, 10) * 1024;
  }
  return 0;
}

// The cgroup v2 limit left to this process's group, or kSaturated when unlimited or unknown.
uint64_t cgroup_memory_left() {
  std::ifstream self("/proc/self/cgroup");
  std::string line, group;
  while (std::getline(self, line))
    if (line.rfind("0::", 0) == 0) group = line.substr(3);
  if (group.empty()) return kSaturated;
  const std::string dir = "/sys/fs/cgroup" + (group == "/" ? std::string() : group);
  std::ifstream max_file(dir + "/memory.max"), current_file(dir + "/memory.current");
  std::string max_text;
  uint64_t current = 0;
  if (!(max_file >> max_text) || max_text == "max" || !(current_file >> current)) return kSaturated;
  const uint64_t limit = std::strtoull(max_text.c_str(), nullptr, 10);
  return limit > current ? limit - current : 0;
}

}  // namespace

MemoryAvailability query_memory_availability(bool use_cuda, int device) {
  MemoryAvailability available;
  available.host_bytes = proc_kib_field("/proc/meminfo", "MemAvailable");
  available.host_source = "MemAvailable in /proc/meminfo";
  if (available.host_bytes == 0) {  // not Linux, or an old kernel: nothing to compare against
    available.host_bytes = kSaturated;
    available.host_source = "unknown (no MemAvailable in /proc/meminfo)";
  }
  if (const uint64_t cgroup = cgroup_memory_left(); cgroup < available.host_bytes) {
    available.host_bytes = cgroup;
    available.host_source = "the cgroup's memory.max less memory.current";
  }
  if (use_cuda) {
    const DeviceMemoryInfo info = device_memory_info(device);
    if (info.ok) {
      available.has_device = true;
      available.device_free_bytes = info.free_bytes;
      available.device_total_bytes = info.total_bytes;
    }
  }
  return available;
}

namespace {

// "activations 12.0 GiB, parameters 3.1 GiB, gradients 3.1 GiB"
std::string largest_consumers(const MemoryEstimate& estimate, bool device, const MemoryConsumer** largest) {
  std::vector<const MemoryConsumer*> sorted;
  for (const MemoryConsumer& c : estimate.consumers)
    if ((device ? c.device_bytes : c.host_bytes) > 0) sorted.push_back(&c);
  std::stable_sort(sorted.begin(), sorted.end(), [&](const MemoryConsumer* a, const MemoryConsumer* b) {
    return (device ? a->device_bytes : a->host_bytes) > (device ? b->device_bytes : b->host_bytes);
  });
  std::string text;
  for (size_t i = 0; i < std::min<size_t>(3, sorted.size()); ++i)
    text += (i ? ", " : "") + sorted[i]->name + " " + format_bytes(device ? sorted[i]->device_bytes : sorted[i]->host_bytes);
  *largest = sorted.empty() ? nullptr : sorted.front();
  return text;
}

[[noreturn]] void refuse(const MemoryEstimate& estimate, bool device, const std::string& need, const std::string& have) {
  const MemoryConsumer* largest = nullptr;
  const std::string consumers = largest_consumers(estimate, device, &largest);
  std::string hint = largest && !largest->remedy.empty() ? largest->remedy : "lower --micro-batch-size";
  hint += "; the startup table lists every consumer";
  throw InputError("the run does not fit: it needs about " + need + " of " + (device ? "GPU" : "host") +
                       " memory, and " + have + "; largest: " + consumers,
                   hint);
}

}  // namespace

void check_memory_fits(const MemoryEstimate& estimate, const MemoryAvailability& available, int ranks_on_host) {
  const uint64_t host_need = mul(estimate.host_bytes(), uint64_t(std::max(1, ranks_on_host)));
  if (host_need > available.host_bytes) {
    const std::string need = format_bytes(host_need) +
                             (ranks_on_host > 1 ? " (" + format_bytes(estimate.host_bytes()) + " per rank x " +
                                                      std::to_string(ranks_on_host) + " ranks on this node)"
                                                : std::string());
    refuse(estimate, false, need, format_bytes(available.host_bytes) + " is available (" + available.host_source + ")");
  }
  if (available.has_device && estimate.device_bytes() > available.device_free_bytes) {
    refuse(estimate, true, format_bytes(estimate.device_bytes()),
           "the GPU has " + format_bytes(available.device_free_bytes) + " free of " +
               format_bytes(available.device_total_bytes) + " (cudaMemGetInfo)");
  }
}

MeasuredMemory measure_host_memory() {
  MeasuredMemory measured;
  measured.host_peak_bytes = proc_kib_field("/proc/self/status", "VmHWM");
  measured.host_current_bytes = proc_kib_field("/proc/self/status", "VmRSS");
  return measured;
}

std::string format_bytes(uint64_t bytes) {
  if (bytes == kSaturated) return "more than 16 EiB";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = double(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  char text[64];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

SettingsTable memory_estimate_rows(const MemoryEstimate& estimate, bool use_cuda) {
  SettingsTable rows;
  for (const MemoryConsumer& c : estimate.consumers) {
    std::string value;
    if (c.device_bytes) value = format_bytes(c.device_bytes) + " GPU";
    if (c.host_bytes) value += (value.empty() ? "" : " + ") + format_bytes(c.host_bytes) + " host";
    if (c.transient) value += " (at start-up / checkpoints / loading)";
    rows.push_back({"memory estimate: " + c.name, value.empty() ? "0" : value});
  }
  rows.push_back({"memory estimate: host total (per rank)", format_bytes(estimate.host_bytes())});
  if (use_cuda) rows.push_back({"memory estimate: GPU total (per rank)", format_bytes(estimate.device_bytes())});
  return rows;
}

SettingsTable measured_memory_rows(const MemoryEstimate& estimate, const std::string& allocations_label,
                                   uint64_t allocated, bool device, uint64_t device_in_use) {
  SettingsTable rows;
  rows.push_back({allocations_label + ": measured / estimated",
                  format_bytes(allocated) + " / " + format_bytes(estimate.engine_bytes(device))});
  const MeasuredMemory host = measure_host_memory();
  rows.push_back({"host memory: resident now, peak (VmRSS, VmHWM) / estimated",
                  format_bytes(host.host_current_bytes) + ", " + format_bytes(host.host_peak_bytes) + " / " +
                      format_bytes(estimate.host_bytes())});
  if (device) {
    // A transient (the FP32 weights a decoder casts its FP8 weights from) is freed by now:
    // the estimate without it is what is still held.
    uint64_t held = 0;
    for (const MemoryConsumer& c : estimate.consumers)
      if (!c.transient) held = add(held, c.device_bytes);
    rows.push_back({"GPU memory: in use (cudaMemGetInfo) / estimated",
                    format_bytes(device_in_use) + " / " + format_bytes(estimate.device_bytes()) +
                        (held != estimate.device_bytes() ? " at its peak, " + format_bytes(held) + " held" : "")});
  }
  return rows;
}

}  // namespace fp8lm
