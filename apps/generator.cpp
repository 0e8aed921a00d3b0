#include "apps/generator.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/evaluator.h"
#include "apps/run_setup.h"
#include "core/error.h"
#include "core/launch.h"
#include "layers/gpt.h"
#include "layers/op_profiler.h"
#include "layers/ops_cpu.h"
#include "layers/ops_cuda.h"

namespace fp8lm {

InferenceShape decoding_model_shape(const GeneratorShape& shape) {
  // The prompt's last token runs as the first decoding step.
  return InferenceShape{.batch = shape.batch,
                        .max_prompt = std::max(1, shape.max_prompt - 1),
                        .capacity = shape.capacity,
                        .fp8_kv_cache = shape.fp8_kv_cache};
}

struct Generator::State {
  GptConfig config;
  GeneratorShape shape;
  bool fp8 = false;
  bool replay_steps = false;  // TrainOptions::decode_graph
  MemoryEstimate memory_estimate;  // made before anything was allocated (fp8lm sample)
  std::unique_ptr<Ops> ops;
  OpProfiler* op_profiler = nullptr;  // --profile-ops: observes `ops`, which owns it
  std::unique_ptr<GptModel> model;
  TensorLayout canonical;
  std::vector<float> logits;  // the last step's, [B, Vs]
  std::unique_ptr<Allocation> decoding_memory;  // DecodingTokens': chosen, ended, scratch

  DecodingTokens decoding_tokens(uint64_t seed, int first_position, int stop_token) {
    DecodingTokens t = decoding_tokens_in(decoding_memory->data(), shape.batch, shape.capacity);
    t.seed = seed;
    t.first_position = first_position;
    t.stop_token = stop_token;
    return t;
  }

  // Each activation operand's scale from the amax its casts recorded in the prompt pass (row
  // 0 of the history), with one binade of headroom: decoded tokens up to twice the prompt's
  // largest value are represented, larger ones saturate. The weights keep the scales their
  // codes were cast with. One host round trip, before the first decoding step.
  void calibrate_activation_scales() {
    ops->download_scaling();
    ScalingTable& table = model->scaling();
    for (int i = 0; i < table.size(); ++i) {
      if (!is_linear_input_state(table.name(i))) continue;
      const float amax = table.amax_at(i, /*slot=*/0);
      const float scale = compute_scale(amax, fp8_max(table.dtype(i)), /*margin=*/1, /*previous_scale=*/1.0f);
      table.scales()[size_t(i)] = scale;
      table.scale_invs()[size_t(i)] = 1.0f / scale;
    }
    table.mark_initialized();
    ops->upload_scaling();
  }
};

Generator::Generator(const RunSetup& setup, const GeneratorShape& shape) : state_(std::make_unique<State>()) {
  State& s = *state_;
  const TrainOptions& o = setup.options;
  FP8LM_INPUT_CHECK(setup.parallel.world_size == 1, "fp8lm sample runs on one process (this launch has ",
                    setup.parallel.world_size, ")");
  s.config = setup.model;
  s.shape = shape;
  s.fp8 = o.fp8_enabled();
  s.replay_steps = o.decode_graph && !o.profile_ops;
  if (setup.use_cuda) {
    check_cuda_model_support(setup.model, o.precision == GemmPrecision::fp32);
    cuda::set_programmatic_launch(o.programmatic_launch);
    s.ops = make_cuda_ops(0, o.small_m_gemm, o.gemm_algorithm);
  } else {
    s.ops = make_cpu_ops();
  }
  if (o.profile_ops) {
    auto profiler = std::make_unique<OpProfiler>();
    s.op_profiler = profiler.get();
    s.ops = make_observed_ops(std::move(s.ops), std::move(profiler));
  }
  s.memory_estimate = setup.memory;
  s.model = std::make_unique<GptModel>(setup.model, decoding_model_shape(shape), forward_only_model_precision(o, s.ops->activation_dtype()),
                                       *s.ops);
  s.canonical = make_gpt_layout(setup.model);
  s.decoding_memory = s.ops->allocate(decoding_token_bytes(shape.batch, shape.capacity));
  s.logits.assign(size_t(shape.batch) * s.model->vocab_slice().size, 0.0f);
}

Generator::~Generator() = default;

void Generator::set_parameters(const std::vector<float>& canonical) {
  State& s = *state_;
  set_forward_only_weights(*s.ops, *s.model, s.canonical, canonical, /*tp_rank=*/0, /*tp_size=*/1);
}

std::string Generator::load(const std::string& path, std::optional<int64_t> step) {
  State& s = *state_;
  InferenceWeights weights =
      read_inference_weights(path, step, s.canonical, s.config, s.fp8, scaling_table_snapshot(*s.model));
  ScalingTable& table = s.model->scaling();
  if (weights.scaling) restore_scaling_table(*s.ops, *s.model, *weights.scaling);
  set_parameters(weights.params);
  if (s.fp8)
    spdlog::info("FP8 activations cast with {}", table.uses_current_scaling()
                                                     ? "current scaling (each tensor's own amax)"
                                                     : "the checkpoint's delayed scales");
  return weights.path;
}

GenerationResult Generator::generate(const GenerationRequest& request) {
  State& s = *state_;
  const int B = s.shape.batch;
  const int P = int(request.prompt.size());
  FP8LM_CHECK(P >= 1 && P <= s.shape.max_prompt && request.max_new_tokens >= 1 &&
                  P + request.max_new_tokens - 1 <= s.shape.capacity,
              "generate: a prompt of ", P, " tokens and ", request.max_new_tokens, " new ones in a cache of ",
              s.shape.capacity);
  const VocabSlice slice = s.model->vocab_slice();
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point start) {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };

  GenerationResult result;
  result.tokens.assign(size_t(B), {});

  FP8LM_CHECK(!request.calibrate_activation_scales ||
                  (s.fp8 && P > 1 && s.model->scaling().config().recipe == ScalingRecipe::delayed),
              "generate: calibrating FP8 activation scales needs FP8 delayed scaling and a prompt of 2 or more tokens");
  // The prompt but its last token fills the cache; the last token is the first step.
  const Clock::time_point prefill_start = Clock::now();
  if (P > 1) {
    std::vector<int32_t> tokens;
    for (int b = 0; b < B; ++b) tokens.insert(tokens.end(), request.prompt.begin(), request.prompt.end() - 1);
    const TokenBatch batch = s.ops->load_batch(tokens.data(), tokens.data(), B, P - 1, slice);
    if (request.calibrate_activation_scales) {
      // Current scaling until the scales exist: the prompt's casts take each operand's own
      // amax and record it into a cleared row 0.
      ScalingTable& table = s.model->scaling();
      s.ops->download_scaling();
      table.discard_current_amaxes();
      std::fill(table.initialized_flags().begin(), table.initialized_flags().end(), uint8_t{0});
      s.ops->upload_scaling();
      s.model->forward_cached(batch, 0, /*record_amaxes=*/true);
      s.calibrate_activation_scales();
    } else {
      s.model->forward_cached(batch, 0);
    }
  }
  s.ops->synchronize();
  result.prefill_ms = ms_since(prefill_start);
  if (s.op_profiler) s.op_profiler->reset();  // the profile is the decode steps'

  const Clock::time_point decode_start = Clock::now();
  // Every token is chosen where the logits are (Ops::choose_next_tokens), into the memory the
  // next step reads, so the host only queues steps. It reads the chosen tokens back
  // kReadbackSteps steps at a time, one read-back behind, to report them and to see every
  // sequence end: the GPU runs up to two read-backs ahead, and after a stop token up to that
  // many steps more, which change nothing reported.
  constexpr int kReadbackSteps = 8;
  const int first = P - 1;
  const DecodingTokens tokens = s.decoding_tokens(request.seed, first, request.stop_token.value_or(-1));
  s.ops->zero(tokens.ended, sizeof(int32_t) * (size_t(B) + 1));  // ended and scratch's counter (decoding_tokens_in)
  const std::vector<int32_t> prompt_last(size_t(B), request.prompt.back());
  // The step memory (a step after the prompt reads its tokens and position there), first
  // holding the prompt's last tokens; a prompt of one token runs its first step from
  // load_batch's memory instead (position 0 stores none), and the choice moves on from there.
  const TokenBatch step_batch = s.ops->load_decode_step(prompt_last.data(), B, std::max(first, 1), slice);
  auto run_step = [ops = s.ops.get(), model = s.model.get(), step_batch, prompt_last, slice, B,
                   rule = request.sampling, tokens](int position) {
    const TokenBatch batch =
        position > 0 ? step_batch : ops->load_batch(prompt_last.data(), prompt_last.data(), B, 1, slice);
    model->forward_cached(batch, position);
    ops->choose_next_tokens(model->next_token_logits(), B, slice, rule,
                            CachePosition{.value = position, .stored = batch.step_position}, tokens);
  };

  std::vector<bool> ended(size_t(B), false);
  bool all_ended = false;
  // The next `count` steps' rows of tokens.chosen, as the host got them.
  auto report = [&](int count, const int32_t* rows) {
    for (int i = 0; i < count && !all_ended; ++i) {
      std::vector<int32_t> drawn(rows + size_t(i) * B, rows + size_t(i + 1) * B);
      for (int b = 0; b < B; ++b) {
        if (ended[size_t(b)]) {
          drawn[size_t(b)] = -1;
          continue;
        }
        result.tokens[size_t(b)].push_back(drawn[size_t(b)]);
        if (request.stop_token && drawn[size_t(b)] == *request.stop_token) ended[size_t(b)] = true;
      }
      ++result.decode_steps;
      if (request.on_step) request.on_step(drawn);
      all_ended = std::all_of(ended.begin(), ended.end(), [](bool e) { return e; });
    }
  };
  auto chosen_row = [&](int step) { return tokens.chosen + size_t(first + 1 + step) * B; };
  std::unique_ptr<HostReadback> readbacks[2] = {s.ops->make_readback(sizeof(int32_t) * kReadbackSteps * B),
                                                s.ops->make_readback(sizeof(int32_t) * kReadbackSteps * B)};
  int captured = 0;  // read-backs captured; the one before the last is reported
  int reported = 0;  // steps reported
  // With replay_steps the first step after the prompt runs op by op (every kernel and GEMM
  // plan is set up outside the recording), the next is recorded, and it and every later one
  // replay it.
  std::unique_ptr<RecordedOps> recorded_step;
  bool stored_step_ran = false;
  int queued = 0;
  constexpr int kSetUpSteps = 2;
  Clock::time_point steady_start;
  for (int step = 0; step < request.max_new_tokens && !all_ended; ++step) {
    const int position = first + step;
    if (step == kSetUpSteps) {
      s.ops->synchronize();
      steady_start = Clock::now();
    }
    if (!s.replay_steps || position == 0 || !stored_step_ran) {
      run_step(position);
      stored_step_ran = stored_step_ran || position > 0;
    } else {
      if (!recorded_step) recorded_step = s.ops->record_ops([run_step, position] { run_step(position); });
      recorded_step->replay();
    }
    ++queued;
    if (s.op_profiler) {
      s.ops->synchronize();
      s.op_profiler->finish_step();
    }
    if (queued % kReadbackSteps == 0) {
      readbacks[captured % 2]->capture(chosen_row(queued - kReadbackSteps));
      ++captured;
      if (captured >= 2) {
        report(kReadbackSteps, static_cast<const int32_t*>(readbacks[captured % 2]->wait()));
        reported += kReadbackSteps;
      }
    }
  }
  if (captured >= 1 && reported < captured * kReadbackSteps) {
    report(kReadbackSteps, static_cast<const int32_t*>(readbacks[(captured - 1) % 2]->wait()));
    reported += kReadbackSteps;
  }
  if (reported < queued) {
    std::vector<int32_t> rows(size_t(queued - reported) * B);
    s.ops->download(rows.data(), chosen_row(reported), rows.size() * sizeof(int32_t));
    report(queued - reported, rows.data());
  }
  s.ops->download_values(s.logits.data(), s.model->next_token_logits());
  result.decode_ms = ms_since(decode_start);
  if (queued > kSetUpSteps) {
    result.steady_ms = ms_since(steady_start);
    result.steady_steps = queued - kSetUpSteps;
  }
  return result;
}

const OpProfiler* Generator::op_profiler() const { return state_->op_profiler; }

const std::vector<float>& Generator::last_logits() const { return state_->logits; }

size_t Generator::allocated_bytes() const {
  return state_->model->allocated_bytes() + state_->ops->workspace_bytes() + state_->decoding_memory->bytes();
}

SettingsTable Generator::describe() const {
  const State& s = *state_;
  return forward_only_memory_rows(*s.model, *s.ops, s.memory_estimate, "decoder allocations", allocated_bytes());
}

}  // namespace fp8lm
