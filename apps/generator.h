// Text generation with a trained model: the model built for incremental decoding
// (layers/gpt.h, InferenceShape), its weights read from an fp8lm checkpoint or a Hugging
// Face GPT-2 model, and the next tokens chosen where the logits are (Ops::choose_next_tokens,
// layers/sampling.h), so that the host only queues steps.
//
// Precision: the GEMMs run in the run set-up's precision. Under FP8 the Linear weights are
// cast to E4M3 once, at load, from the FP32 values; activations are cast with the
// checkpoint's delayed scales when it has them for these operands, and with current scaling
// otherwise (a BF16 checkpoint, a Hugging Face model, or --fp8-recipe tensorwise), or with
// scales calibrated on the prompt (GenerationRequest::calibrate_activation_scales). With
// fp8_kv_cache the keys and values are stored in E4M3 (layers/kv_cache.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/logging.h"
#include "layers/sampling.h"

namespace fp8lm {

struct RunSetup;
class OpProfiler;
struct InferenceShape;

struct GeneratorShape {
  int batch = 1;         // sequences decoded together, each continuing the same prompt
  int max_prompt = 1;    // the longest prompt
  int capacity = 1;      // prompt + new tokens, at most n_positions
  bool fp8_kv_cache = false;
};

// The model a generator of `shape` builds (layers/gpt.h): its prompt pass takes all but the
// prompt's last token, which runs as the first decoding step. The memory estimate
// (apps/memory_estimate.h) sizes this model.
InferenceShape decoding_model_shape(const GeneratorShape& shape);

struct GenerationRequest {
  std::vector<int32_t> prompt;  // non-empty, shorter than the capacity
  int max_new_tokens = 1;
  SamplingOptions sampling;
  uint64_t seed = 0;            // sequence b draws from its own stream of (seed, b)
  std::optional<int32_t> stop_token;  // a sequence ends after it (<|endoftext|>); none: max_new_tokens each
  // FP8 activation scales from the prompt (fp8lm sample --fp8-activation-scales prompt): the
  // prompt pass records each activation operand's amax and every later step casts with
  // scale = fp8_max / amax / 2 (one binade of headroom, as the FP8 cache's scales), in the
  // producers' own kernels, instead of current scaling's amax pass before each cast. Needs an
  // FP8 precision with delayed scaling and a prompt of at least 2 tokens.
  bool calibrate_activation_scales = false;
  // Called after each step with the step's token of every sequence (-1 for ended ones).
  std::function<void(const std::vector<int32_t>&)> on_step;
};

struct GenerationResult {
  std::vector<std::vector<int32_t>> tokens;  // [batch][new tokens], without the prompt
  double prefill_ms = 0.0;                   // the prompt (all but its last token) into the cache
  double decode_ms = 0.0;                    // every one-token step, sampling included
  int64_t decode_steps = 0;
  // The steps after the first two, which set up (the first plans and times every GEMM of the
  // step's shapes, the second is recorded): from a sync before the third to the end, steps
  // that ran after a stop token included. What a longer generation's steps cost; 0 steps when
  // there were no more than two.
  double steady_ms = 0.0;
  int64_t steady_steps = 0;
};

class Generator {
 public:
  // The backend and model of `setup` (device, precision, config) at `shape`. One rank.
  Generator(const RunSetup& setup, const GeneratorShape& shape);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Reads the weights (and an FP8 checkpoint's scaling state) of an fp8lm checkpoint or a
  // Hugging Face model; returns the path read.
  std::string load(const std::string& path, std::optional<int64_t> step);
  // Sets the weights from FP32 values in the canonical layout (make_gpt_layout); random
  // weights for benchmarks, and tests.
  void set_parameters(const std::vector<float>& canonical);

  GenerationResult generate(const GenerationRequest& request);
  // With the run set-up's --profile-ops: the ops of the last generate()'s decode steps, per
  // class (layers/op_profiler.h); nullptr without.
  const OpProfiler* op_profiler() const;
  // The logits [batch, vocabulary slice] of the last generate()'s last step, as the sampler
  // read them (tests compare decoders with them).
  const std::vector<float>& last_logits() const;

  // Bytes of every slab the decoder allocated (the model's and the backend's workspaces), the
  // figure the memory estimate's decoder slabs predict (MemoryEstimate::engine_bytes).
  size_t allocated_bytes() const;
  // Rows for the startup table: memory per class, and the measured memory beside the
  // estimate made before anything was allocated (RunSetup::memory).
  SettingsTable describe() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace fp8lm
