#include "apps/run_setup.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include <omp.h>
#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/cli.h"
#include "core/device.h"
#include "core/error.h"
#include "core/tokenizer.h"

#include <nlohmann/json.hpp>

namespace fp8lm {

namespace {

std::string join_words(const std::vector<std::string>& words) {
  std::string joined;
  for (const auto& word : words) joined += (joined.empty() ? "" : " ") + word;
  return joined;
}

std::string format_double(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%g", value);
  return buffer;
}

GptConfig model_config_from(const TrainOptions& o) {
  GptConfig config;
  const ModelOverrides& m = o.model;
  const std::string& checkpoint = !o.load_dir.empty() ? o.load_dir : o.init_from;
  std::optional<GptConfig> stored;
  if (o.config_path.empty() && !checkpoint.empty()) stored = stored_model_config(checkpoint, o.ckpt_step);
  if (!o.config_path.empty()) {
    config = load_gpt_config(o.config_path);
  } else if (stored) {
    config = *stored;
  } else {
    FP8LM_INPUT_CHECK(m.num_layers && m.hidden_size && m.num_attention_heads && m.vocab_size,
                      "--config is required (or all of --num-layers, --hidden-size, --num-attention-heads, "
                      "--vocab-size)");
    config.name = "custom";
    config.n_positions = m.max_position_embeddings.value_or(o.seq_length > 0 ? o.seq_length : 1024);
    config.n_inner = m.ffn_hidden_size.value_or(0);  // 0: the default, 4 x n_embd (below)
  }
  if (m.num_layers || m.hidden_size || m.num_attention_heads || m.ffn_hidden_size || m.max_position_embeddings ||
      m.vocab_size || m.init_method_std || m.norm_epsilon) {
    // Re-validate the overridden shape through the same rules as a config file.
    nlohmann::json json = to_hf_json(config);
    if (m.num_layers) json["n_layer"] = *m.num_layers;
    if (m.hidden_size) json["n_embd"] = *m.hidden_size;
    if (m.num_attention_heads) json["n_head"] = *m.num_attention_heads;
    if (m.max_position_embeddings) json["n_positions"] = *m.max_position_embeddings;
    if (m.vocab_size) json["vocab_size"] = *m.vocab_size;
    if (m.init_method_std) json["initializer_range"] = *m.init_method_std;
    if (m.norm_epsilon) json["layer_norm_epsilon"] = *m.norm_epsilon;
    // null: parse_gpt_config derives 4 x n_embd, in 64 bits and checked.
    json["n_inner"] = m.ffn_hidden_size ? nlohmann::json(*m.ffn_hidden_size)
                                        : (config.n_inner && !m.hidden_size ? nlohmann::json(config.n_inner)
                                                                            : nlohmann::json());
    std::string name = config.name;
    config = parse_gpt_config(json, o.config_path.empty() ? "model flags" : o.config_path + " with model flags");
    config.name = name;
  }
  if (m.untie_embeddings_and_output_weights) config.tie_word_embeddings = false;
  if (m.kv_channels && int64_t{*m.kv_channels} * config.n_head != config.n_embd)
    throw InputError("--kv-channels " + std::to_string(*m.kv_channels) + ": fp8lm's heads are hidden-size / "
                         "num-attention-heads = " + std::to_string(config.n_embd) + " / " +
                         std::to_string(config.n_head) + " wide; a projection to another width is not implemented",
                     "leave --kv-channels out, or give " + std::to_string(config.n_embd / config.n_head));
  return config;
}

// --fp8-auto-precision's rule, for the startup table.
std::string auto_precision_description(const TrainOptions& o) {
  if (!o.fp8_auto_precision) return "off";
  std::string when;
  if (o.fp8_auto_precision_steps > 0) when = "iterations 1-" + std::to_string(o.fp8_auto_precision_steps);
  if (o.fp8_stats_interval > 0)
    when += (when.empty() ? "" : " and ") + std::string("every ") + std::to_string(o.fp8_stats_interval);
  return "a block to BF16 above " + format_double(o.fp8_auto_precision_saturation) + " saturated or " +
         format_double(o.fp8_auto_precision_underflow) + " underflowed, checked at " +
         (when.empty() ? std::string("no step") : when);
}

// Which blocks run BF16 GEMMs under --first-last-layers-bf16, for the startup table.
std::string bf16_blocks_description(const TrainOptions& o, int n_layer) {
  if (!o.first_last_layers_bf16) return "off";
  const int start = o.bf16_layers_at_start(), end = o.bf16_layers_at_end();
  auto range = [](int first, int last) {
    return first == last ? std::to_string(first) : std::to_string(first) + "-" + std::to_string(last);
  };
  std::vector<std::string> blocks;
  if (start > 0) blocks.push_back(range(0, start - 1));
  if (end > 0) blocks.push_back(range(n_layer - end, n_layer - 1));
  std::string text = "first " + std::to_string(start) + ", last " + std::to_string(end);
  if (blocks.empty()) return text + " (no block in BF16)";
  text += " (blocks ";
  for (size_t i = 0; i < blocks.size(); ++i) text += (i ? ", " : "") + blocks[i];
  return text + " in BF16)";
}

}  // namespace

LrSchedule learning_rate_schedule(const TrainOptions& o, int global_batch_size) {
  LrSchedule schedule;
  schedule.max_lr = o.lr;
  schedule.min_lr = o.min_lr;
  schedule.warmup_init_lr = o.lr_warmup_init;
  schedule.style = o.lr_decay_style;
  if (o.train_samples > 0) {
    const double batch = double(global_batch_size);
    schedule.decay_iters = double(o.lr_decay_samples < 0 ? o.train_samples : o.lr_decay_samples) / batch;
    schedule.warmup_iters = o.lr_warmup_fraction ? *o.lr_warmup_fraction * schedule.decay_iters
                                                 : double(o.lr_warmup_samples) / batch;
    if (o.lr_decay_style == LrDecayStyle::wsd) schedule.wsd_decay_iters = double(o.lr_wsd_decay_samples) / batch;
  } else {
    schedule.decay_iters = double(o.lr_decay_iters < 0 ? o.train_iters : o.lr_decay_iters);
    schedule.warmup_iters = o.lr_warmup_fraction ? *o.lr_warmup_fraction * schedule.decay_iters
                                                 : double(o.lr_warmup_iters);
    if (o.lr_decay_style == LrDecayStyle::wsd) schedule.wsd_decay_iters = double(o.lr_wsd_decay_iters);
  }
  schedule.wsd_style = o.lr_wsd_decay_style;
  schedule.samples_per_iter = double(global_batch_size);
  validate_lr_schedule(schedule);
  return schedule;
}

WeightDecaySchedule weight_decay_schedule(const TrainOptions& o, int global_batch_size) {
  WeightDecaySchedule schedule;
  schedule.style = o.weight_decay_incr_style;
  const bool ramps = schedule.style != WeightDecayIncrStyle::constant;
  schedule.start = ramps ? o.start_weight_decay.value_or(0.0) : o.weight_decay;
  schedule.end = ramps ? o.end_weight_decay.value_or(0.0) : o.weight_decay;
  schedule.incr_iters =
      o.train_samples > 0 ? double(o.train_samples) / double(global_batch_size) : double(o.train_iters);
  validate_weight_decay_schedule(schedule);
  return schedule;
}

RunSetup resolve_run_setup(const TrainOptions& options, const ParallelLayout& parallel) {
  validate_options(options);
  RunSetup setup;
  setup.options = options;
  start_fresh_without_checkpoint(setup.options);  // --save DIR --load DIR: the job's first run
  adopt_resume_checkpoint(setup.options);         // --load must be a complete checkpoint; its seed wins
  validate_options(setup.options);                // again: a recipe taken from the checkpoint has its own refusals
  setup.model = model_config_from(setup.options);
  setup.parallel = parallel;
  const int tp = options.tensor_model_parallel_size;
  FP8LM_INPUT_CHECK(tp == parallel.tp_size, "--tensor-model-parallel-size ", tp, " needs ", tp,
                    " processes or a multiple of it (launch with mpirun -np N); this run has ", parallel.world_size);
  const int data_parallel_size = parallel.dp_size;
  setup.data_parallel_size = data_parallel_size;
  setup.data_parallel_rank = parallel.dp_rank;
  const GptConfig& m = setup.model;
  FP8LM_INPUT_CHECK(m.n_head % tp == 0, "--tensor-model-parallel-size ", tp, " does not divide the ", m.n_head,
                    " attention heads");
  FP8LM_INPUT_CHECK(m.n_inner % tp == 0, "--tensor-model-parallel-size ", tp, " does not divide the MLP width ",
                    m.n_inner);
  FP8LM_INPUT_CHECK(m.padded_vocab_size() % (8 * tp) == 0, "--tensor-model-parallel-size ", tp,
                    " does not divide the padded vocabulary ", m.padded_vocab_size(), " into slices of a multiple of 8");

  const TrainOptions& o = setup.options;  // with what a resume took from its checkpoint
  int32_t end_of_document = kGpt2EndOfText;
  if (!o.vocab_file.empty()) {
    // Megatron takes the vocabulary from the tokenizer; fp8lm from the config, so the two must agree.
    const Gpt2Tokenizer tokenizer = Gpt2Tokenizer::load(o.vocab_file, o.merge_file);
    tokenizer.check_fits_model(o.vocab_file, m.vocab_size,
                               "give a config with vocab_size >= " + std::to_string(tokenizer.vocab_size()) +
                                   ", or --vocab-size " + std::to_string(tokenizer.vocab_size()));
    end_of_document = tokenizer.end_of_text_id();
  }
  // Megatron's tokenizer.eod: GPT2BPETokenizer's <|endoftext|>.
  const auto check_end_of_document = [&](const char* flag) {
    if (end_of_document >= m.vocab_size)
      throw InputError(std::string(flag) + ": the end-of-document token " + std::to_string(end_of_document) +
                           " (GPT-2's <|endoftext|>) is outside the model's vocabulary of " +
                           std::to_string(m.vocab_size),
                       "give --vocab-file and --merge-file of the tokenizer that made the data");
  };
  if (o.eod_mask_loss) {
    check_end_of_document("--eod-mask-loss");
    setup.loss_mask_token = end_of_document;
  }
  if (o.reset_position_ids || o.reset_attention_mask) {
    check_end_of_document(o.reset_attention_mask ? "--reset-attention-mask" : "--reset-position-ids");
    setup.documents = {.end_of_document = end_of_document,
                       .reset_attention_mask = o.reset_attention_mask,
                       .reset_position_ids = o.reset_position_ids};
  }
  if (o.first_last_layers_bf16) {
    const int64_t bf16_layers = int64_t{o.num_layers_at_start_in_bf16} + o.num_layers_at_end_in_bf16;
    if (bf16_layers > m.n_layer)
      throw InputError("--num-layers-at-start-in-bf16 (" + std::to_string(o.num_layers_at_start_in_bf16) +
                           ") + --num-layers-at-end-in-bf16 (" + std::to_string(o.num_layers_at_end_in_bf16) +
                           ") exceed the model's " + std::to_string(m.n_layer) + " layers",
                       "the two counts may cover each block once at most (--bf16 runs every block in BF16)");
  }

  if (o.recompute_granularity == "full" && o.recompute_num_layers > m.n_layer)
    throw InputError("--recompute-num-layers " + std::to_string(o.recompute_num_layers) + " exceeds the model's " +
                         std::to_string(m.n_layer) + " layers",
                     "--recompute-method uniform --recompute-num-layers 1 recomputes every block");

  if (!o.bf16_blocks.empty() && *o.bf16_blocks.rbegin() >= m.n_layer)
    throw InputError("--bf16-blocks names block " + std::to_string(*o.bf16_blocks.rbegin()) + " but the model has " +
                         std::to_string(m.n_layer) + " blocks",
                     "blocks are numbered from 0 to n_layer - 1");

  setup.seq_length = options.seq_length > 0 ? options.seq_length : setup.model.n_positions;
  FP8LM_INPUT_CHECK(setup.seq_length <= setup.model.n_positions, "--seq-length (", setup.seq_length,
                    ") exceeds the model's n_positions (", setup.model.n_positions, ")");

  // --fp8-recipe blockwise: every FP8 GEMM dimension a multiple of 16 (ragged tiles and blocks are fine).
  if (const std::string problem =
          blockwise_shape_problem(setup.model, options.micro_batch_size, setup.seq_length, model_precision(o), tp);
      !problem.empty())
    throw InputError(problem, "use model widths and a --micro-batch-size x --seq-length that are multiples of 16, or "
                              "--fp8-recipe tensorwise");

  // The kernels index a micro-batch's tokens (and a step's sequences) in 32 bits. fp8lm
  // sample's batch is its --batch-size sequences of prompt and new tokens: it checks them itself.
  const int64_t tokens_per_micro_batch = int64_t{options.micro_batch_size} * setup.seq_length;
  if (tokens_per_micro_batch > INT_MAX && options.command != RunCommand::sample)
    throw InputError("--micro-batch-size x --seq-length (" + std::to_string(options.micro_batch_size) + " x " +
                         std::to_string(setup.seq_length) + " = " + std::to_string(tokens_per_micro_batch) +
                         " tokens) exceeds 2^31 - 1: the kernels index a micro-batch's tokens in 32 bits",
                     options.seq_length > 0 ? "lower --micro-batch-size or --seq-length"
                                            : "--seq-length defaults to the config's n_positions (" +
                                                  std::to_string(setup.model.n_positions) + "): pass a shorter one");
  const int64_t per_step = int64_t{options.micro_batch_size} * data_parallel_size;
  FP8LM_INPUT_CHECK(per_step <= INT_MAX, "--micro-batch-size x data-parallel size (", per_step,
                    ") exceeds 2^31 - 1 sequences per step");
  setup.global_batch_size = options.global_batch_size > 0 ? options.global_batch_size : int(per_step);
  FP8LM_INPUT_CHECK(setup.global_batch_size % per_step == 0, "--global-batch-size (", setup.global_batch_size,
                    ") must be a multiple of --micro-batch-size x data-parallel size (", per_step, ")");
  setup.grad_accum_steps = int(setup.global_batch_size / per_step);
  setup.rampup.global_batch = setup.global_batch_size;
  if (const std::vector<int64_t>& ramp = options.rampup_batch_size; !ramp.empty()) {
    setup.rampup = {.start = ramp[0], .increment = ramp[1], .samples = ramp[2], .global_batch = setup.global_batch_size};
    validate_batch_rampup(setup.rampup, per_step);
  }
  if (setup.options.train_samples > 0) {
    // Megatron's update_train_iters: whole global batches only (after a ramp-up's steps).
    const int64_t first_batch = setup.rampup.enabled() ? setup.rampup.start : setup.global_batch_size;
    FP8LM_INPUT_CHECK(setup.options.train_samples >= first_batch, "--train-samples (", setup.options.train_samples,
                      ") is less than one global batch (", first_batch, " sequences)");
    setup.options.train_iters = setup.rampup.enabled()
                                    ? rampup_train_iters(setup.rampup, setup.options.train_samples)
                                    : setup.options.train_samples / setup.global_batch_size;
    validate_options(setup.options);  // the checks that count optimizer steps
  }

  FP8LM_INPUT_CHECK(!options.sequence_parallel || setup.seq_length % tp == 0, "--sequence-parallel needs --seq-length (",
                    setup.seq_length, ") divisible by --tensor-model-parallel-size (", tp, ")");

  const CudaAvailability& cuda = cuda_availability();
  switch (options.device) {
    case DeviceKind::cpu:
      setup.use_cuda = false;
      break;
    case DeviceKind::cuda:
      if (cuda.device_count == 0)
        throw InputError("--device cuda: no usable CUDA GPU (" + cuda.reason + ")",
                         "run on a machine with an NVIDIA Hopper GPU, or pass --device cpu");
      setup.use_cuda = true;
      break;
    case DeviceKind::auto_select:
      setup.use_cuda = cuda.device_count > 0;
      break;
  }
  setup.device_description = setup.use_cuda ? "cuda: " + cuda.name : "cpu (no GPU: " + (cuda.reason.empty() ? std::string("--device cpu") : cuda.reason) + ")";
  if (!setup.use_cuda && options.device == DeviceKind::cpu) setup.device_description = "cpu (--device cpu)";

  // fp8lm sample's decoder is sized by its prompt, which is read later: it estimates and
  // checks its memory itself (estimate_decoding_memory), before allocating anything.
  if (options.command == RunCommand::sample) return setup;
  // Last, because it needs every size above; before anything is allocated.
  setup.memory = options.command == RunCommand::eval ? estimate_evaluation_memory(setup) : estimate_memory(setup);
  check_run_memory(setup);
  return setup;
}

void check_run_memory(const RunSetup& setup) {
  check_memory_fits(setup.memory, query_memory_availability(setup.use_cuda, setup.parallel.local_rank),
                    setup.parallel.local_size);
}

GptPrecision model_precision(const TrainOptions& o) {
  return GptPrecision{.gemm = o.precision,
                      .fp8_lm_head = o.fp8_lm_head,
                      .bf16_layers_at_start = o.bf16_layers_at_start(),
                      .bf16_layers_at_end = o.bf16_layers_at_end(),
                      .bf16_blocks = o.fp8_enabled() ? o.bf16_blocks : std::set<int>{},
                      .fp8 = o.fp8,
                      .gradients = o.grad_reduce_in_bf16 ? DType::bf16 : DType::f32,
                      .fp8_weight_transpose_cache = o.fp8_weight_transpose_cache};
}

GptPrecision engine_model_precision(const TrainOptions& o, bool sharded_optimizer, DType activation_dtype) {
  GptPrecision precision = model_precision(o);
  // The FP8 weights are cast from an FP32 master that is whole on this rank and apart from the
  // working copy: nothing reads their BF16 values. Sharded, the working copy is what the ranks
  // gather; on the CPU the FP32 working copy is the master.
  precision.fp8_linear_working_copy = sharded_optimizer || activation_dtype == DType::f32;
  return precision;
}

GptPrecision forward_only_model_precision(const TrainOptions& o, DType activation_dtype) {
  GptPrecision precision = model_precision(o);
  // The FP8 weights are cast once, from the checkpoint's FP32 values (set_forward_only_weights).
  precision.fp8_linear_working_copy = activation_dtype == DType::f32;
  return precision;
}

ActivationRecompute activation_recompute(const TrainOptions& o) {
  if (o.recompute_granularity == "selective") {
    auto has = [&](const char* module) {
      return std::find(o.recompute_modules.begin(), o.recompute_modules.end(), module) != o.recompute_modules.end();
    };
    return ActivationRecompute{.layernorm = has("layernorm"), .mlp = has("mlp"), .attention_output = has("core_attn")};
  }
  if (o.recompute_granularity != "full") return {};
  return ActivationRecompute{.method = o.recompute_method == "uniform" ? ActivationRecompute::Method::uniform
                                                                       : ActivationRecompute::Method::block,
                             .layers = o.recompute_num_layers};
}

namespace {
std::string recompute_description(const TrainOptions& o, int n_layer) {
  const ActivationRecompute r = activation_recompute(o);
  if (o.recompute_granularity == "selective") {
    std::string what;
    auto add = [&](const char* part) { what += std::string(what.empty() ? "" : " and ") + part; };
    if (r.attention_output) add("the attention output's FP8 cast (the fused attention keeps no score matrix)");
    if (r.layernorm) add("the LayerNorm outputs");
    if (r.mlp) add("c_fc's and the GELU's outputs");
    return "selective: every block's backward recomputes " + what;
  }
  if (r.method == ActivationRecompute::Method::none) return "off";
  if (r.method == ActivationRecompute::Method::block)
    return "full, block: blocks 0-" + std::to_string(r.layers - 1) + " of " + std::to_string(n_layer) +
           " keep only their input";
  return "full, uniform: every block, in groups of " + std::to_string(r.layers) + " whose first block keeps its input";
}

// A step count of the schedule: whole, or to two decimals (a sample-counted bound).
std::string format_steps(double steps) {
  char buffer[64];
  if (steps == std::floor(steps)) std::snprintf(buffer, sizeof buffer, "%.0f", steps);
  else std::snprintf(buffer, sizeof buffer, "%.2f", steps);
  return buffer;
}

std::string lr_warmup_description(const TrainOptions& o, const LrSchedule& schedule) {
  if (o.lr_warmup_fraction) return format_double(*o.lr_warmup_fraction) + " of the decay steps";
  if (o.train_samples > 0)
    return format_steps(schedule.warmup_iters) + " steps (" + std::to_string(o.lr_warmup_samples) + " samples)";
  return std::to_string(o.lr_warmup_iters) + " steps";
}

std::string lr_decay_style_description(const TrainOptions& o, const LrSchedule& schedule) {
  std::string text(to_string(o.lr_decay_style));
  if (o.lr_decay_style != LrDecayStyle::wsd) return text;
  text += ", " + std::string(to_string(o.lr_wsd_decay_style)) + " anneal over the last " +
          format_steps(schedule.wsd_decay_iters) + " steps";
  if (o.train_samples > 0) text += " (" + std::to_string(o.lr_wsd_decay_samples) + " samples)";
  return text;
}

std::string weight_decay_description(const TrainOptions& o, const WeightDecaySchedule& schedule) {
  if (schedule.style == WeightDecayIncrStyle::constant) return format_double(o.weight_decay);
  return std::string(to_string(schedule.style)) + " from " + format_double(schedule.start) + " to " +
         format_double(schedule.end) + " over " + format_steps(schedule.incr_iters) + " steps";
}
}  // namespace

SettingsTable settings_table(const RunSetup& s) {
  const TrainOptions& o = s.options;
  const GptConfig& m = s.model;
  const LrSchedule schedule = learning_rate_schedule(o, s.global_batch_size);
  auto str = [](auto v) { return std::to_string(v); };
  auto or_none = [](const std::string& v) { return v.empty() ? std::string("(none)") : v; };
  std::string precision;
  switch (o.precision) {
    case GemmPrecision::fp32: precision = "fp32 GEMMs (reference mode)"; break;
    case GemmPrecision::bf16: precision = "bf16 (BF16 GEMMs; no FP8 flag given)"; break;
    case GemmPrecision::fp8:
      precision = std::string("fp8 GEMMs, format ") + std::string(to_string(o.fp8.format)) + " (forward " +
                  std::string(to_string(forward_dtype(o.fp8.format))) + ", gradients " +
                  std::string(to_string(gradient_dtype(o.fp8.format))) + ")";
      break;
  }
  const bool fp8 = o.fp8_enabled();
  SettingsTable rows = {
      {"device", s.device_description},
      {"model config", or_none(o.config_path) + " (" + m.name + ")"},
      {"n_layer / n_head / n_embd", str(m.n_layer) + " / " + str(m.n_head) + " / " + str(m.n_embd)},
      {"n_inner (MLP width)", str(m.n_inner)},
      {"vocab_size (padded)", str(m.vocab_size) + " (" + str(m.padded_vocab_size()) + ")"},
      {"LM head", m.tie_word_embeddings ? "tied to wte" : "its own weight (--untie-embeddings-and-output-weights)"},
      {"n_positions", str(m.n_positions)},
      {"layer_norm_epsilon", format_double(m.layer_norm_epsilon)},
      {"init-method-std (initializer_range)", format_double(m.initializer_range)},
      {"parameters", str(m.num_parameters_unpadded())},
      {"transformer-impl", o.transformer_impl + " (fp8lm's own kernels)"},
      {"precision", precision},
      {"fp8-recipe", !fp8 ? std::string("(fp8 off)")
                     : o.fp8.recipe == ScalingRecipe::blockwise
                         ? "blockwise (1x128 tiles: activations, gradients; 128x128 blocks: weights; power-of-two "
                           "scales)"
                         : std::string(to_string(o.fp8.recipe))},
      {"fp8-amax-history-len", fp8 ? str(o.fp8.amax_history_len) : "(fp8 off)"},
      {"fp8-amax-compute-algo", fp8 ? std::string(to_string(o.fp8.amax_compute_algo)) : "(fp8 off)"},
      {"fp8-margin", fp8 ? str(o.fp8.margin) : "(fp8 off)"},
      {"fp8-interval", fp8 ? str(o.fp8.interval) : "(fp8 off)"},
      {"fp8-lm-head", fp8 ? (o.fp8_lm_head ? "fp8" : "bf16") : "(fp8 off)"},
      {"fp8-fast-accumulation", fp8 ? std::string(to_string(o.fp8_fast_accumulation)) : "(fp8 off)"},
      {"fp8-weight-transpose-cache",
       !fp8                           ? "(fp8 off)"
       : o.fp8_weight_transpose_cache ? "kept (written with the FP8 weights)"
                                      : "off (each dgrad transposes its weight's codes first)"},
      {"first-last-layers-bf16", !fp8 ? "(fp8 off)" : bf16_blocks_description(o, m.n_layer)},
      {"bf16-blocks", !fp8 ? "(fp8 off)" : o.bf16_blocks.empty() ? "none" : block_list_text(o.bf16_blocks)},
      {"fp8-auto-precision", !fp8 ? "(fp8 off)" : auto_precision_description(o)},
      {"optimizer-state-precision", std::string(to_string(o.optimizer_state))},
      {"optimizer-weight-casts",
       !fp8 ? "(fp8 off)"
       : optimizer_writes_fp8_weights(o, s.data_parallel_size > 1 && o.use_distributed_optimizer.value_or(true))
           ? "fused (AdamW's update pass writes the FP8 Linear weights)"
       : o.fused_weight_casts
           ? "separate (fused needs the delayed recipe, fp8-fp16 state, no distributed optimizer, no FP8 weight gather)"
           : "separate"},
      {"optimizer-first-pass",
       optimizer_first_pass_in_backward(o, s.data_parallel_size * o.tensor_model_parallel_size)
           ? "backward (AdamW's amaxes and the norm layer by layer beside the attention backward)"
       : o.first_pass_in_backward ? "step (backward needs fp8-fp16 state on one rank)"
                                  : "step"},
      {"micro-batch-size", str(o.micro_batch_size)},
      {"recompute (activations)", recompute_description(o, m.n_layer)},
      {"global-batch-size", s.rampup.enabled() ? "ramp-up from " + str(s.rampup.start) + " by " +
                                                     str(s.rampup.increment) + " over " + str(s.rampup.samples) +
                                                     " samples, then " + str(s.global_batch_size)
                                               : str(s.global_batch_size)},
      {"gradient accumulation steps",
       s.rampup.enabled() ? str(s.rampup.start / (o.micro_batch_size * s.data_parallel_size)) + " to " +
                                str(s.grad_accum_steps) + " (the ramp-up)"
                          : str(s.grad_accum_steps)},
      {"seq-length", str(s.seq_length)},
      {"tokens per step", str(int64_t{s.global_batch_size} * s.seq_length) + (s.rampup.enabled() ? " (after the ramp-up)" : "")},
      {"train-iters", o.train_samples > 0 ? str(o.train_iters) + " (--train-samples " + str(o.train_samples) +
                                                (s.rampup.enabled() ? " over the ramp-up's batches, then the global batch)"
                                                                    : " over the global batch)")
                                          : str(o.train_iters)},
      {"lr / min-lr", format_double(o.lr) + " / " + format_double(o.min_lr)},
      {"lr-warmup", lr_warmup_description(o, schedule)},
      {"lr-warmup-init", format_double(o.lr_warmup_init)},
      {"lr-decay-iters", o.train_samples > 0 ? format_steps(schedule.decay_iters) + " steps (" +
                                                   str(o.lr_decay_samples < 0 ? o.train_samples : o.lr_decay_samples) +
                                                   " samples)"
                                             : format_steps(schedule.decay_iters)},
      {"lr-decay-style", lr_decay_style_description(o, schedule)},
      {"weight-decay", weight_decay_description(o, weight_decay_schedule(o, s.global_batch_size))},
      {"adam-beta1 / beta2 / eps", format_double(o.adam_beta1) + " / " + format_double(o.adam_beta2) + " / " +
                                       format_double(o.adam_eps)},
      {"clip-grad", o.clip_grad > 0 ? format_double(o.clip_grad) : "off"},
      {"max-skipped-steps", str(o.max_skipped_steps)},
      {"seed", str(o.seed)},
      {"train-data-path", o.mock_data                  ? "(mock data)"
                          : !o.train_data_blend.empty() ? join_words(o.train_data_blend) + " (indexed, whole)"
                                                        : or_none(o.train_data_path)},
      {"valid-data-path", !o.valid_data_blend.empty() ? join_words(o.valid_data_blend) + " (indexed, whole)"
                          : o.mock_data && o.valid_data_path.empty() ? "(mock data)"
                                                                      : or_none(o.valid_data_path)},
      {"data-format", std::string(to_string(o.data_format))},
      {"data-path / split", o.data_path.empty() ? std::string("(none)") : join_words(o.data_path) + " / " + o.split},
      {"save", or_none(o.save_dir)},
      {"save-interval", str(o.save_interval)},
      {"load", or_none(o.load_dir) + (o.ckpt_step ? " (ckpt-step " + str(*o.ckpt_step) + ")" : "")},
      {"init-from", or_none(o.init_from) + (o.finetune ? " (--load with --finetune)" : "")},
      {"exit-interval", str(o.exit_interval)},
      {"check-weight-hash-across-dp-replicas-interval",
       o.check_weight_hash_interval > 0 ? str(o.check_weight_hash_interval) : std::string("off")},
      {"exit-duration-in-mins", o.exit_duration_in_mins ? str(*o.exit_duration_in_mins) : "(none)"},
      {"vocab-file / merge-file", o.vocab_file.empty() ? std::string("(none)") : o.vocab_file + " / " + o.merge_file},
      {"eod-mask-loss", s.loss_mask_token < 0 ? std::string("off")
                        : "on (targets after token " + str(s.loss_mask_token) + " skipped; " +
                              (o.calculate_per_token_loss ? "the mean over the step's tokens, --calculate-per-token-loss)"
                                                          : "each micro-batch's mean)")},
      {"reset-position-ids / reset-attention-mask",
       !s.documents.any() ? std::string("off / off")
                          : std::string(o.reset_position_ids ? "on" : "off") + " / " +
                                (o.reset_attention_mask ? "on" : "off") + " (documents end at token " +
                                str(s.documents.end_of_document) + ")"},
      {"eval-interval / eval-iters", str(o.eval_interval) + " / " + str(o.eval_iters)},
      {"log-interval", str(o.log_interval)},
      {"metrics-file", or_none(o.metrics_file)},
      {"fp8-stats-interval", !fp8 ? std::string("(fp8 off)") : o.fp8_stats_interval > 0 ? str(o.fp8_stats_interval) : "off"},
      {"world size", str(s.parallel.world_size)},
      {"tensor-model-parallel-size", str(o.tensor_model_parallel_size) + (o.sequence_parallel ? " (sequence-parallel)" : "")},
      {"data-parallel size", str(s.data_parallel_size)},
      {"this rank: world / tp / dp", str(s.parallel.world_rank) + " / " + str(s.parallel.tp_rank) + " / " +
                                         str(s.parallel.dp_rank)},
      {"this rank's GPU", s.use_cuda ? "cuda:" + str(s.parallel.local_rank) + " (local rank " + str(s.parallel.local_rank) +
                                           " of " + str(s.parallel.local_size) + ")"
                                     : "(cpu)"},
      {"distributed optimizer (ZeRO-1)",
       s.data_parallel_size > 1 && o.use_distributed_optimizer.value_or(true) ? "on" : "off"},
      {"gradient communication", o.fp8_grad_comm ? "fp8 (" + std::string(to_string(o.fp8_grad_reduce)) + ")"
                                 : o.grad_reduce_in_bf16 ? "bf16" : "fp32"},
      {"parameter gather", o.fp8_param_gather ? "fp8 Linear weights + bf16" : "working-copy dtype"},
      {"overlap grad reduce / param gather", std::string(o.overlap_grad_reduce ? "on" : "off") + " / " +
                                                 (o.overlap_param_gather ? "on" : "off")},
      {"distributed-timeout-minutes", format_double(o.distributed_timeout_minutes)},
      {"CPU threads", std::to_string(o.num_threads > 0 ? o.num_threads : omp_get_max_threads()) +
                          " (this process may run on " + str(affinity_cpus()) + " of " + str(hardware_threads()) +
                          " hardware threads)"},
      {"log-level", o.log_level},
      {"gemm-algorithm", std::string(to_string(o.gemm_algorithm))},
      {"programmatic-launch", o.programmatic_launch ? "on" : "off"},
      {"benchmark", o.benchmark ? "on (warm-up " + str(o.benchmark_warmup) + " steps" +
                                     (o.profile_ops ? ", every op class profiled)" : ")")
                               : "off"},
  };
  for (const std::string& note : o.megatron_no_effect) rows.push_back({"Megatron flag, no effect here", note});
  for (auto& row : memory_estimate_rows(s.memory, s.use_cuda)) rows.push_back(std::move(row));
  return rows;
}

void warn_if_bound_to_one_cpu(const RunSetup& s) {
  // Open MPI binds each rank to one core by default; the set-up's parallel host work (weight
  // initialisation, checkpoint staging and conversion) then runs serially: at gpt2-1558m on
  // two H100s, 78 s to build each rank's engine, against 34 s for a whole one-GPU run.
  const char* omp_threads = std::getenv("OMP_NUM_THREADS");
  const bool one_thread_asked = s.options.num_threads == 1 || (omp_threads && std::string(omp_threads) == "1");
  if (s.parallel.world_size == 1 || one_thread_asked || affinity_cpus() > 1 || hardware_threads() == 1) return;
  spdlog::warn("rank {} may run on 1 of this node's {} CPUs (its affinity mask): start-up work runs serially. HINT: "
               "mpirun --bind-to none, or --map-by ppr:<ranks>:node:PE=<cpus>",
               s.parallel.world_rank, hardware_threads());
}

}  // namespace fp8lm
