// fp8lm sample: text from a checkpoint (either precision) or a Hugging Face GPT-2 model,
// decoded incrementally with a key/value cache (apps/generator.h), in BF16 or FP8 GEMMs,
// with a BF16 or FP8 cache.
//
// Precision, device and model flags are train's (apps/forwarded_flags.h), defaulting to the
// checkpoint run's precision. The prompt is text (--prompt, --prompt-file), tokenized with
// GPT-2's BPE files; --random-prompt N draws N token ids instead (speed measurements,
// with --random-weights when there is no checkpoint).
#include <climits>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/cli.h"
#include "apps/commands.h"
#include "apps/forwarded_flags.h"
#include "apps/generator.h"
#include "layers/op_profiler.h"
#include "apps/run_setup.h"
#include "core/device.h"
#include "core/error.h"
#include "core/input_file.h"
#include "core/logging.h"
#include "core/random.h"
#include "core/tokenizer.h"
#include "layers/gpt.h"
#include "parallel/process_groups.h"

namespace fp8lm {

namespace {

const char* const kHelpHint = "run `fp8lm sample --help` for its flags";

struct SampleOptions {
  std::string vocab_file, merge_file;
  std::string tokenizer_type = "GPT2BPETokenizer";
  std::string prompt;
  std::string prompt_file;
  int random_prompt = 0;
  bool random_weights = false;
  int max_new_tokens = 64;
  SamplingOptions sampling;
  uint64_t seed = 1234;
  int batch_size = 1;
  std::string kv_cache_dtype = "bf16";
  std::string small_m_gemm = "on";
  std::string cuda_graph = "on";
  std::string fp8_activation_scales = "auto";
  bool ignore_eos = false;
  bool quiet = false;
  bool profile_ops = false;
};

std::vector<ForwardedFlag> sample_flags() {
  std::vector<ForwardedFlag> flags = kWeightsFlags;
  flags.insert(flags.end(), kPrecisionFlags.begin(), kPrecisionFlags.end());
  flags.insert(flags.end(), kRuntimeFlags.begin(), kRuntimeFlags.end());
  return flags;
}

// The text of token ids, as the tokenizer decodes them (bytes as they are).
std::string decode(const Gpt2Tokenizer* tokenizer, const std::vector<int32_t>& ids) {
  if (tokenizer) return tokenizer->decode(ids);
  std::ostringstream out;
  for (size_t i = 0; i < ids.size(); ++i) out << (i ? " " : "") << ids[i];
  return out.str();
}

}  // namespace

int run_sample_command(const std::vector<std::string>& args) {
  CLI::App app{"fp8lm sample: generate text from a checkpoint or a Hugging Face GPT-2 model", "fp8lm sample"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.get_formatter()->column_width(34);
  SampleOptions o;
  ForwardedFlags flags(app, sample_flags());
  app.add_option("--vocab-file", o.vocab_file, "GPT-2's encoder.json");
  app.add_option("--merge-file", o.merge_file, "GPT-2's vocab.bpe");
  app.add_option("--tokenizer-type", o.tokenizer_type, "Only GPT2BPETokenizer (Megatron's name)");
  app.add_option("--prompt", o.prompt, "The text to continue");
  app.add_option("--prompt-file", o.prompt_file, "A file whose text to continue");
  app.add_option("--random-prompt", o.random_prompt, "N random token ids as the prompt (speed measurements)");
  app.add_flag("--random-weights", o.random_weights, "GPT-2's random initialisation from --seed (speed measurements)");
  app.add_option("--max-new-tokens", o.max_new_tokens, "Tokens to generate per sequence (default 64)");
  app.add_option("--temperature", o.sampling.temperature, "Softmax temperature; 0 is greedy (default 1)");
  app.add_option("--top-k", o.sampling.top_k, "Keep the k most likely tokens; 0 keeps all (default 0)");
  app.add_option("--top-p", o.sampling.top_p, "Keep the most likely tokens up to probability p, in (0, 1] (default 1)");
  app.add_option("--seed", o.seed, "Random seed: the same seed gives the same text (default 1234)");
  app.add_option("--batch-size", o.batch_size, "Sequences generated together from the prompt (default 1)");
  app.add_option("--kv-cache-dtype", o.kv_cache_dtype, "bf16 (the activation dtype) or fp8 (E4M3, per-layer scales)");
  app.add_option("--small-m-gemm", o.small_m_gemm,
                 "on: a decoding step's GEMMs run fp8lm's small-M kernel where it measured faster (E4M3 up to 16 rows, "
                 "BF16 one, the LM head up to 8); off: cuBLASLt (default on)");
  app.add_option("--cuda-graph", o.cuda_graph,
                 "on: every decoding step after the first replays one recorded step (a CUDA graph); off: op by op "
                 "(default on; off under --profile-ops)");
  app.add_option("--fp8-activation-scales", o.fp8_activation_scales,
                 "auto: the checkpoint's delayed scales, else current scaling; prompt: calibrated on the prompt "
                 "(its amaxes, one binade of headroom), then cast in the producers' kernels (default auto)");
  app.add_flag("--ignore-eos", o.ignore_eos, "Do not stop a sequence at <|endoftext|>");
  app.add_flag("--quiet", o.quiet, "Print only the JSON summary line");
  app.add_flag("--profile-ops", o.profile_ops,
               "Time every op class of the decode steps (GEMMs, attention, LayerNorm, casts...) against the whole step");
  if (!parse_subcommand_arguments(app, args, "sample")) return kExitOk;
  flags.collect();

  // ---- Validation, before any work.
  auto fail = [&](const std::string& message) { throw InputError("fp8lm sample: " + message, kHelpHint); };
  std::optional<WeightsSource> weights;
  if (!o.random_weights) {
    weights = weights_source(flags, "sample");
  } else if (flags.given("--load") || flags.given("--init-from")) {
    fail("--random-weights contradicts --load and --init-from");
  } else if (!flags.given("--config")) {
    fail("--random-weights needs --config (the model to initialise)");
  }
  const bool prompt_given = app.count("--prompt") > 0, random_prompt_given = app.count("--random-prompt") > 0;
  if (int(prompt_given) + int(!o.prompt_file.empty()) + int(random_prompt_given) != 1)
    fail("give exactly one of --prompt, --prompt-file and --random-prompt (the text to continue)");
  if (prompt_given && o.prompt.empty()) fail("--prompt is empty: give some text to continue");
  if (random_prompt_given && o.random_prompt < 1)
    fail("--random-prompt must be >= 1 (got " + std::to_string(o.random_prompt) + ")");
  if (o.max_new_tokens < 1) fail("--max-new-tokens must be >= 1 (got " + std::to_string(o.max_new_tokens) + ")");
  if (o.batch_size < 1) fail("--batch-size must be >= 1 (got " + std::to_string(o.batch_size) + ")");
  if (o.kv_cache_dtype != "bf16" && o.kv_cache_dtype != "fp8")
    fail("--kv-cache-dtype must be bf16 or fp8 (got '" + o.kv_cache_dtype + "')");
  if (o.small_m_gemm != "on" && o.small_m_gemm != "off")
    fail("--small-m-gemm must be on or off (got '" + o.small_m_gemm + "')");
  if (o.fp8_activation_scales != "auto" && o.fp8_activation_scales != "prompt")
    fail("--fp8-activation-scales must be auto or prompt (got '" + o.fp8_activation_scales + "')");
  if (o.cuda_graph != "on" && o.cuda_graph != "off")
    fail("--cuda-graph must be on or off (got '" + o.cuda_graph + "')");
  if (o.cuda_graph == "on" && o.profile_ops && app.count("--cuda-graph") > 0)
    fail("--profile-ops times each op of a step, which a replayed graph does not show: pass --cuda-graph off");
  if (o.tokenizer_type != "GPT2BPETokenizer")
    fail("--tokenizer-type " + o.tokenizer_type + " is not supported; only GPT2BPETokenizer");
  const bool text_prompt = !random_prompt_given;
  if (text_prompt && (o.vocab_file.empty() || o.merge_file.empty()))
    fail("--vocab-file and --merge-file are required to tokenize the prompt (scripts/fetch_tokenizer.sh fetches them)");
  if (o.vocab_file.empty() != o.merge_file.empty()) fail("--vocab-file and --merge-file go together");
  try {
    validate_sampling_options(o.sampling);
  } catch (const InputError& e) {
    fail(e.what());
  }

  std::unique_ptr<Gpt2Tokenizer> tokenizer;
  if (!o.vocab_file.empty())
    tokenizer = std::make_unique<Gpt2Tokenizer>(Gpt2Tokenizer::load(o.vocab_file, o.merge_file));
  std::vector<int32_t> prompt;
  if (text_prompt) {
    const std::string text = o.prompt_file.empty() ? o.prompt : read_input_file(o.prompt_file);
    prompt = tokenizer->encode(text);
    if (prompt.empty()) fail(std::string(o.prompt_file.empty() ? "--prompt" : o.prompt_file) + " has no tokens");
  }

  // Train's parser resolves the model, the precision and the device; the batch shape is the
  // decoder's (the cache holds the prompt and the new tokens).
  std::vector<std::string> train_args;
  if (weights) train_args = checkpoint_run_flags(weights->path, weights->step, flags.names_given(), false);
  const std::vector<std::string> user_flags = flags.train_arguments();
  train_args.insert(train_args.end(), user_flags.begin(), user_flags.end());
  train_args.insert(train_args.end(), {"--train-iters", "0", "--micro-batch-size", std::to_string(o.batch_size)});
  TrainOptions options;
  try {
    options = parse_train_command_line(train_args).options;
  } catch (const InputError& e) {
    fail(e.what());
  }
  options.command = RunCommand::sample;
  options.profile_ops = o.profile_ops;
  options.small_m_gemm = o.small_m_gemm == "on" ? SmallMGemm::on : SmallMGemm::off;
  options.decode_graph = o.cuda_graph == "on" && !o.profile_ops;
  if (o.fp8_activation_scales == "prompt" && (!options.fp8_enabled() || options.fp8.recipe != ScalingRecipe::delayed))
    fail("--fp8-activation-scales prompt calibrates delayed FP8 scales: it needs an FP8 precision (--fp8-format) "
         "with --fp8-recipe delayed");
  // Decoding multiplies one row per sequence; cuBLASLt's block-scaled GEMMs take rows in
  // multiples of 8, and the decoder lays out no block scales (nor an FP8 cache beside them).
  if (options.fp8_enabled() && options.fp8.recipe == ScalingRecipe::blockwise)
    fail("--fp8-recipe blockwise is for training and evaluation, not decoding (the checkpoint's recipe unless "
         "given): pass --fp8-recipe tensorwise, or --bf16");

  MpiSession mpi;
  const ParallelLayout layout = detect_parallel_layout(1);
  init_logging(options.log_level, layout.world_rank);
  RunSetup setup = resolve_run_setup(options, layout);
  const GptConfig& model = setup.model;
  // The prompt's length is checked before a random prompt is drawn: nothing grows first.
  const int64_t prompt_length = text_prompt ? int64_t(prompt.size()) : int64_t{o.random_prompt};
  if (prompt_length + o.max_new_tokens - 1 > model.n_positions)
    fail("the prompt (" + std::to_string(prompt_length) + " tokens) and --max-new-tokens " +
         std::to_string(o.max_new_tokens) + " exceed the model's context of " + std::to_string(model.n_positions) +
         " tokens");
  const int P = int(prompt_length);
  if (o.fp8_activation_scales == "prompt" && P < 2)
    fail("--fp8-activation-scales prompt needs a prompt of at least 2 tokens to calibrate on (got " +
         std::to_string(P) + ")");
  if (!text_prompt) {
    Random random(o.seed);
    for (int i = 0; i < o.random_prompt; ++i) prompt.push_back(int32_t(random.next_u64() % uint64_t(model.vocab_size)));
  }
  if (tokenizer) tokenizer->check_fits_model(o.vocab_file, model.vocab_size, kHelpHint);

  const GeneratorShape shape{.batch = o.batch_size,
                             .max_prompt = P,
                             .capacity = P + o.max_new_tokens - 1,
                             .fp8_kv_cache = o.kv_cache_dtype == "fp8"};
  // The kernels index the cache's rows (sequence x position) and the prompt pass's tokens in
  // 32 bits.
  const int64_t cache_rows = int64_t{shape.batch} * shape.capacity;
  if (cache_rows > INT_MAX)
    throw InputError("fp8lm sample: --batch-size x (the prompt + --max-new-tokens - 1) (" +
                         std::to_string(shape.batch) + " x " + std::to_string(shape.capacity) + " = " +
                         std::to_string(cache_rows) + " key/value cache rows) exceeds 2^31 - 1: the kernels index "
                         "them in 32 bits",
                     "lower --batch-size or --max-new-tokens");
  // The last check before anything is allocated: the decoder's memory fits this machine.
  setup.memory = estimate_decoding_memory(setup, shape);
  check_run_memory(setup);
  log_settings_table("fp8lm sample memory", memory_estimate_rows(setup.memory, setup.use_cuda));

  Generator generator(setup, shape);
  std::string source = "random weights (seed " + std::to_string(o.seed) + ")";
  if (weights) {
    source = generator.load(weights->path, weights->step);
  } else {
    const TensorLayout canonical = make_gpt_layout(model);
    std::vector<float> values(canonical.total_elements());
    init_gpt_parameters(values.data(), canonical, model, o.seed);
    generator.set_parameters(values);
  }
  spdlog::info("sampling {} x {} new tokens after a {}-token prompt from {}: {}, {} KV cache, {}", o.batch_size,
               o.max_new_tokens, P, source, describe_precision(options), o.kv_cache_dtype, setup.device_description);
  log_settings_table("memory once the weights are set", generator.describe());

  GenerationRequest request;
  request.prompt = prompt;
  request.max_new_tokens = o.max_new_tokens;
  request.sampling = o.sampling;
  request.seed = o.seed;
  request.calibrate_activation_scales = o.fp8_activation_scales == "prompt";
  if (!o.ignore_eos && model.vocab_size > kGpt2EndOfText) request.stop_token = kGpt2EndOfText;
  // One sequence streams as it is generated; a batch prints when done.
  const bool stream = !o.quiet && o.batch_size == 1 && tokenizer;
  if (stream) {
    std::fputs(tokenizer->decode(prompt).c_str(), stdout);
    std::fflush(stdout);
    request.on_step = [&](const std::vector<int32_t>& tokens) {
      if (tokens[0] < 0 || tokens[0] == request.stop_token) return;
      std::fputs(tokenizer->decode({tokens[0]}).c_str(), stdout);
      std::fflush(stdout);
    };
  }
  const GenerationResult result = generator.generate(request);
  if (stream) std::fputs("\n", stdout);
  if (!o.quiet && !stream) {
    for (int b = 0; b < o.batch_size; ++b) {
      if (o.batch_size > 1) std::printf("---- sample %d ----\n", b + 1);
      std::vector<int32_t> ids = prompt;
      ids.insert(ids.end(), result.tokens[size_t(b)].begin(), result.tokens[size_t(b)].end());
      std::printf("%s\n", decode(tokenizer.get(), ids).c_str());
    }
  }
  int64_t generated = 0;
  for (const auto& tokens : result.tokens) generated += int64_t(tokens.size());
  const double decode_s = result.decode_ms / 1000.0;
  // A step's cost is the steady steps' (GenerationResult::steady_ms); the whole decode, its
  // set-up included, is decode_ms and decode_tokens_per_s.
  const double ms_per_step = result.steady_steps ? result.steady_ms / double(result.steady_steps)
                             : result.decode_steps ? result.decode_ms / double(result.decode_steps)
                                                   : 0.0;
  const nlohmann::json line = {{"prompt_tokens", P},
                               {"batch_size", o.batch_size},
                               {"new_tokens", generated},
                               {"decode_steps", result.decode_steps},
                               {"prefill_ms", result.prefill_ms},
                               {"decode_ms", result.decode_ms},
                               {"steady_steps", result.steady_steps},
                               {"ms_per_step", ms_per_step},
                               {"tokens_per_s", ms_per_step > 0 ? o.batch_size * 1000.0 / ms_per_step : 0.0},
                               {"decode_tokens_per_s", decode_s > 0 ? double(generated) / decode_s : 0.0},
                               {"precision", options.precision_name()},
                               {"kv_cache_dtype", o.kv_cache_dtype},
                               {"small_m_gemm", o.small_m_gemm},
                               {"cuda_graph", options.decode_graph ? "on" : "off"},
                               {"programmatic_launch", options.programmatic_launch ? "on" : "off"},
                               {"fp8_activation_scales", o.fp8_activation_scales},
                               {"device", setup.use_cuda ? "cuda" : "cpu"}};
  std::printf("%s\n", line.dump().c_str());
  if (const OpProfiler* profiler = generator.op_profiler(); profiler && result.decode_steps > 0)
    log_op_profile(*profiler, result.decode_ms / double(result.decode_steps), "decode step", setup.use_cuda);
  std::fflush(stdout);
  spdlog::info("memory: host peak {} (VmHWM), estimated {} before allocation",
               format_bytes(measure_host_memory().host_peak_bytes), format_bytes(setup.memory.host_bytes()));
  return kExitOk;
}

}  // namespace fp8lm
