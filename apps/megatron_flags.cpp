#include "apps/megatron_flags.h"

#include <algorithm>
#include <charconv>
#include <limits>

#include <CLI/CLI.hpp>

#include "core/error.h"

namespace fp8lm {

namespace {

using Kind = MegatronFlagKind;

constexpr const char* kNoDropout =
    "fp8lm trains without dropout, as llm.c and nanoGPT pretrain GPT-2 (Megatron's default is 0.1)";
constexpr const char* kMetricsElsewhere =
    "fp8lm writes every log line to --metrics-file as JSON instead (scripts/plot_loss.sh plots it)";
constexpr const char* kNoRandomState =
    "fp8lm's training draws random numbers only at initialisation and for the data order, which the seed and "
    "the checkpoint's data position reproduce: a checkpoint holds no random state";
constexpr const char* kNonFiniteSteps =
    "fp8lm always checks: a step with a non-finite loss or gradient is skipped, and --max-skipped-steps in a "
    "row stop the run";
constexpr const char* kPythonRuntime = "Python's garbage collector; fp8lm has none";
constexpr const char* kOwnCheckpoints = "a distributed-checkpoint option; fp8lm writes its own checkpoints";
constexpr const char* kLossScaling =
    "FP16 loss scaling, which Megatron applies only with --fp16; BF16 and FP8 training need none";
constexpr const char* kProfileElsewhere =
    "fp8lm writes no profiler trace; --benchmark --profile-ops times each op class";
constexpr const char* kNoPipeline =
    "fp8lm parallelizes with tensor, sequence and data parallelism, not pipeline stages";

// Megatron-LM's flags (megatron/training/arguments.py) that fp8lm does not implement with their
// meaning; those it does are apps/cli.cpp's own options.
const std::vector<MegatronFlag> kFlags = {
    // Megatron's implementation switches: fp8lm has one implementation, with these choices made.
    {"--use-mcore-models", false, Kind::no_effect, nullptr, "Megatron's model classes; fp8lm has one implementation"},
    {"--use-legacy-models", false, Kind::no_effect, nullptr, "Megatron's model classes; fp8lm has one implementation"},
    {"--use-flash-attn", false, Kind::no_effect, nullptr,
     "fp8lm's attention is always fused (FlashAttention's algorithm, on Hopper's wgmma)"},
    {"--no-masked-softmax-fusion", false, Kind::no_effect, nullptr,
     "fp8lm's fused attention never forms the softmax matrix"},
    {"--no-bias-gelu-fusion", false, Kind::no_effect, nullptr,
     "a Megatron kernel switch; fp8lm adds the bias and applies the GELU in c_fc's GEMM epilogue"},
    {"--no-bias-dropout-fusion", false, Kind::no_effect, nullptr, "a Megatron kernel switch; fp8lm has no dropout"},
    {"--no-gradient-accumulation-fusion", false, Kind::no_effect, nullptr,
     "a Megatron kernel switch; fp8lm's weight-gradient GEMMs always add into the gradient slab"},
    {"--no-persist-layer-norm", false, Kind::no_effect, nullptr,
     "Apex's persistent LayerNorm switch; fp8lm has its own LayerNorm kernels"},
    {"--no-async-tensor-model-parallel-allreduce", false, Kind::no_effect, nullptr,
     "a deprecated Megatron switch; fp8lm places its tensor-parallel collectives itself"},
    {"--attention-softmax-in-fp32", false, Kind::no_effect, nullptr, "fp8lm's softmax is always computed in FP32"},
    {"--accumulate-allreduce-grads-in-fp32", false, Kind::no_effect, nullptr,
     "fp8lm's default already: FP32 gradients (--grad-reduce-in-bf16 keeps them in BF16)"},
    {"--use-cpu-initialization", false, Kind::no_effect, nullptr, "fp8lm draws the initial weights on the host"},
    {"--exit-signal-handler", false, Kind::no_effect, nullptr,
     "fp8lm always finishes the step, saves (with --save) and exits on SIGTERM"},
    {"--log-throughput", false, Kind::no_effect, nullptr,
     "fp8lm's progress lines always show tokens/s and model TFLOP/s per GPU"},
    {"--timing-log-level", true, Kind::no_effect, nullptr,
     "Megatron's timers; fp8lm times each op class with --benchmark --profile-ops"},
    {"--num-workers", true, Kind::no_effect, nullptr,
     "PyTorch's data-loader processes; fp8lm prepares the next batch while the device runs the step"},
    {"--no-mmap-bin-files", false, Kind::no_effect, nullptr, "fp8lm maps the .bin files; the tokens read are the same"},
    {"--data-cache-path", true, Kind::no_effect, nullptr,
     "Megatron caches its sample index files there; fp8lm builds its index in memory at start-up"},
    {"--make-vocab-size-divisible-by", true, Kind::no_effect, nullptr,
     "fp8lm pads the vocabulary to a multiple of 128 (its kernels' tile); the padded rows take no part in the loss"},
    {"--cross-entropy-loss-fusion", false, Kind::no_effect, nullptr, "fp8lm's loss is always one fused kernel"},
    {"--apply-query-key-layer-scaling", false, Kind::no_effect, nullptr,
     "a rescaling for FP16 softmax; fp8lm's softmax is computed in FP32, where it cancels out"},
    {"--deterministic-mode", false, Kind::no_effect, nullptr,
     "fp8lm's kernels are always deterministic: a run repeats bit for bit and resumes bit-exactly"},
    {"--check-for-nan-in-loss-and-grad", false, Kind::no_effect, nullptr, kNonFiniteSteps},
    {"--no-check-for-nan-in-loss-and-grad", false, Kind::no_effect, nullptr, kNonFiniteSteps},
    {"--manual-gc", false, Kind::no_effect, nullptr, kPythonRuntime},
    {"--manual-gc-interval", true, Kind::no_effect, nullptr, kPythonRuntime},
    {"--empty-unused-memory-level", true, Kind::no_effect, nullptr,
     "PyTorch's caching allocator; fp8lm allocates its slabs once, at start-up"},
    {"--ddp-bucket-size", true, Kind::no_effect, nullptr,
     "fp8lm's gradient buckets are its parameter slab's: per block, its Linear weights and its other parameters "
     "(docs/PARALLEL.md)"},
    {"--overlap-param-gather-with-optimizer-step", false, Kind::no_effect, nullptr,
     "a schedule of Megatron's interleaved pipeline; fp8lm's --overlap-param-gather overlaps each bucket's gather "
     "with the next forward"},
    {"--tp-comm-overlap", false, Kind::no_effect, nullptr,
     "Transformer Engine's userbuffers, which overlap tensor-parallel communication with the GEMMs; fp8lm runs its "
     "tensor-parallel collectives between its GEMMs"},
    {"--async-save", false, Kind::no_effect, nullptr,
     "fp8lm writes each checkpoint before the next step (under a temporary name, then renamed)"},
    {"--ckpt-fully-parallel-save", false, Kind::no_effect, nullptr, kOwnCheckpoints},
    {"--ckpt-fully-parallel-load", false, Kind::no_effect, nullptr, kOwnCheckpoints},
    {"--ckpt-assume-constant-structure", false, Kind::no_effect, nullptr, kOwnCheckpoints},
    {"--dist-ckpt-strictness", true, Kind::no_effect, nullptr, kOwnCheckpoints},
    {"--use-checkpoint-args", false, Kind::no_effect, nullptr,
     "fp8lm takes the model's shape from --load's checkpoint whenever --config is left out"},
    {"--override-opt_param-scheduler", false, Kind::no_effect, nullptr,
     "fp8lm's resume already takes the schedule from the flags given (the checkpoint's decay style, weight decay "
     "and beta2 only for those left out)"},
    {"--mmap-bin-files", false, Kind::no_effect, nullptr, "fp8lm always maps the .bin files"},
    {"--num-dataset-builder-threads", true, Kind::no_effect, nullptr,
     "Megatron's threads building dataset index files; fp8lm builds its index in memory at start-up"},
    {"--no-shared-fs", false, Kind::no_effect, nullptr,
     "Megatron builds its dataset cache on each node without a shared file system; fp8lm writes no cache"},
    {"--mid-level-dataset-surplus", true, Kind::no_effect, nullptr,
     "the slack of Megatron's blended-dataset sizes; fp8lm's blend draws each source's share exactly (docs/DATA.md)"},
    {"--rotary-percent", true, Kind::no_effect, nullptr,
     "read by Megatron only with --position-embedding-type rope, which fp8lm refuses"},
    {"--legacy-tokenizer", false, Kind::no_effect, nullptr, "fp8lm has one GPT-2 BPE tokenizer"},
    {"--num-query-groups", true, Kind::no_effect, nullptr,
     "read by Megatron only with --group-query-attention, which fp8lm refuses"},
    {"--sgd-momentum", true, Kind::no_effect, nullptr, "read by Megatron only with --optimizer sgd"},
    {"--no-bias-swiglu-fusion", false, Kind::no_effect, nullptr, "fp8lm's MLP has no SwiGLU"},
    {"--no-rope-fusion", false, Kind::no_effect, nullptr, "fp8lm's GPT has no rotary embeddings"},
    {"--attention-backend", true, Kind::no_effect, nullptr,
     "fp8lm's attention is always its own fused kernel (FlashAttention's algorithm, on Hopper's wgmma)"},
    {"--no-create-attention-mask-in-dataloader", false, Kind::no_effect, nullptr,
     "fp8lm builds no attention mask: its attention kernel is causal"},
    {"--dataloader-type", true, Kind::no_effect, nullptr,
     "fp8lm's loader reads its own order, deterministic and resumable (docs/DATA.md)"},
    {"--te-rng-tracker", false, Kind::no_effect, nullptr,
     "Transformer Engine's random-number tracker for dropout; fp8lm has no dropout"},
    {"--distribute-saved-activations", false, Kind::no_effect, nullptr,
     "a memory option of Megatron's full recomputation; fp8lm keeps a recomputed block's input as the block "
     "receives it"},
    {"--fp8-wgrad", false, Kind::no_effect, nullptr, "fp8lm's default: the weight-gradient GEMMs run in FP8"},
    {"--bias-dropout-fusion", false, Kind::no_effect, nullptr, "a Megatron kernel switch; fp8lm has no dropout"},
    {"--async-tensor-model-parallel-allreduce", false, Kind::no_effect, nullptr,
     "a deprecated Megatron switch; fp8lm places its tensor-parallel collectives itself"},
    {"--openai-gelu", false, Kind::no_effect, nullptr,
     "fp8lm's GELU is already GPT-2's tanh approximation, which this flag selects in Megatron"},
    {"--auto-detect-ckpt-format", false, Kind::no_effect, nullptr,
     "fp8lm recognises its own checkpoints and Hugging Face models by their files"},
    {"--timing-log-option", true, Kind::no_effect, nullptr,
     "Megatron's timers; fp8lm times each op class with --benchmark --profile-ops"},
    {"--overlap-p2p-communication", false, Kind::no_effect, nullptr, kNoPipeline},
    {"--defer-embedding-wgrad-compute", false, Kind::no_effect, nullptr, kNoPipeline},
    {"--rerun-mode", true, Kind::no_effect, nullptr,
     "Megatron reruns suspect steps to tell faults from data; fp8lm's steps repeat bit for bit, and it skips a "
     "non-finite step and stops after --max-skipped-steps of them in a row"},
    {"--loss-scale", true, Kind::no_effect, nullptr, kLossScaling},
    {"--initial-loss-scale", true, Kind::no_effect, nullptr, kLossScaling},
    {"--min-loss-scale", true, Kind::no_effect, nullptr, kLossScaling},
    {"--loss-scale-window", true, Kind::no_effect, nullptr, kLossScaling},
    {"--hysteresis", true, Kind::no_effect, nullptr, kLossScaling},
    {"--fp16-lm-cross-entropy", false, Kind::no_effect, nullptr, kLossScaling},

    // Choices fp8lm makes one way: that value, or an error.
    {"--attention-dropout", true, Kind::one_value, "0", kNoDropout},
    {"--hidden-dropout", true, Kind::one_value, "0", kNoDropout},
    {"--position-embedding-type", true, Kind::one_value, "learned_absolute",
     "fp8lm's GPT has GPT-2's learned absolute position embeddings"},
    {"--normalization", true, Kind::one_value, "LayerNorm", "fp8lm's GPT normalizes with LayerNorm (GPT-2)"},
    {"--pipeline-model-parallel-size", true, Kind::one_value, "1",
     "fp8lm parallelizes with tensor, sequence and data parallelism, not pipeline stages"},
    {"--context-parallel-size", true, Kind::one_value, "1",
     "fp8lm has no context parallelism (--sequence-parallel splits the LayerNorm and residual regions)"},
    {"--expert-model-parallel-size", true, Kind::one_value, "1", "fp8lm's GPT has no experts"},
    {"--distributed-backend", true, Kind::one_value, "nccl",
     "fp8lm moves device buffers over NCCL (and host buffers over MPI)"},
    {"--optimizer", true, Kind::one_value, "adam", "fp8lm's optimizer is Megatron's adam: AdamW"},
    {"--num-distributed-optimizer-instances", true, Kind::one_value, "1",
     "fp8lm's distributed optimizer shards over the whole data-parallel group"},
    {"--cuda-graph-impl", true, Kind::one_value, "none",
     "fp8lm does not capture the training step in a CUDA graph (it would save about 0.2% of a gpt2-1558m step: "
     "docs/PERFORMANCE.md)"},

    // Outputs fp8lm does not write: a warning, not an error.
    {"--tensorboard-dir", true, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--tensorboard-log-interval", true, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--log-timers-to-tensorboard", false, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--log-validation-ppl-to-tensorboard", false, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--log-memory-to-tensorboard", false, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--wandb-project", true, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--wandb-exp-name", true, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--wandb-save-dir", true, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--log-params-norm", false, Kind::not_written, nullptr,
     "fp8lm logs the gradient norm, not the parameters' norm"},
    {"--log-num-zeros-in-grad", false, Kind::not_written, nullptr,
     "fp8lm does not count zero gradients (--fp8-stats-interval counts each FP8 operand's underflows)"},
    {"--log-loss-scale-to-tensorboard", false, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--log-world-size-to-tensorboard", false, Kind::not_written, nullptr, kMetricsElsewhere},
    {"--profile", false, Kind::not_written, nullptr, kProfileElsewhere},
    {"--use-pytorch-profiler", false, Kind::not_written, nullptr, kProfileElsewhere},
    {"--profile-step-start", true, Kind::not_written, nullptr, kProfileElsewhere},
    {"--profile-step-end", true, Kind::not_written, nullptr, kProfileElsewhere},
    {"--record-memory-history", false, Kind::not_written, nullptr,
     "PyTorch's allocator history; fp8lm's start-up table gives its memory by class"},
    {"--log-straggler", false, Kind::not_written, nullptr,
     "Megatron's straggler detector; fp8lm's progress lines give every interval's tokens/s per GPU, and its "
     "watchdog names a rank that stops"},
    {"--log-progress", false, Kind::not_written, nullptr,
     "Megatron's progress.txt; fp8lm's progress lines and --metrics-file carry the throughput, elapsed time and ETA"},

    // Features fp8lm does not have.
    {"--fp16", false, Kind::refused, nullptr,
     "fp8lm trains in BF16 or FP8 (--bf16, --fp8-format hybrid); it has no FP16 mixed precision"},
    {"--swiglu", false, Kind::refused, nullptr, "fp8lm's MLP is GPT-2's: c_fc, GELU, c_proj"},
    {"--squared-relu", false, Kind::refused, nullptr, "fp8lm's MLP is GPT-2's: c_fc, GELU, c_proj"},
    {"--disable-bias-linear", false, Kind::refused, nullptr, "fp8lm's Linear layers have biases, as GPT-2's"},
    {"--group-query-attention", false, Kind::refused, nullptr, "fp8lm's attention is multi-head, as GPT-2's"},
    {"--num-experts", true, Kind::refused, nullptr, "fp8lm's GPT is dense: it has no experts"},
    {"--qk-layernorm", false, Kind::refused, nullptr, "fp8lm's attention has no query/key LayerNorm"},
    {"--apply-layernorm-1p", false, Kind::refused, nullptr, "fp8lm's LayerNorm gains are stored as they apply"},
    {"--use-rotary-position-embeddings", false, Kind::refused, nullptr,
     "fp8lm's GPT has GPT-2's learned absolute position embeddings"},
    {"--no-load-rng", false, Kind::no_effect, nullptr, kNoRandomState},
    {"--no-save-rng", false, Kind::no_effect, nullptr, kNoRandomState},
    {"--no-fp8-wgrad", false, Kind::refused, nullptr,
     "fp8lm runs every Linear GEMM in FP8, the weight gradients' too (--bf16-blocks keeps whole blocks in BF16)"},
    {"--fp8-dot-product-attention", false, Kind::refused, nullptr, "fp8lm's attention stays in BF16"},
    {"--fp8-multi-head-attention", false, Kind::refused, nullptr, "fp8lm's attention stays in BF16"},
    {"--tokenizer-model", true, Kind::refused, nullptr,
     "fp8lm reads GPT-2's BPE from --vocab-file and --merge-file (GPT2BPETokenizer)"},
    {"--virtual-pipeline-model-parallel-size", true, Kind::refused, nullptr, kNoPipeline},
    {"--num-layers-per-virtual-pipeline-stage", true, Kind::refused, nullptr, kNoPipeline},
    {"--yaml-cfg", true, Kind::refused, nullptr,
     "fp8lm takes Megatron's flags and a JSON model config (--config), not a YAML file of arguments"},
    {"--encoder-num-layers", true, Kind::refused, nullptr, "fp8lm's GPT is decoder-only, without an encoder"},
    {"--decoder-seq-length", true, Kind::refused, nullptr,
     "an encoder-decoder model's flag; fp8lm's GPT is decoder-only (--seq-length)"},
    {"--use-torch-fsdp2", false, Kind::refused, nullptr,
     "fp8lm shards the optimizer state (--use-distributed-optimizer), not the parameters"},
    {"--skip-train", false, Kind::refused, nullptr, "`fp8lm eval --load DIR` evaluates a checkpoint"},
    {"--use-dist-ckpt", false, Kind::refused, nullptr,
     "fp8lm writes its own checkpoints (safetensors inside, docs/RELIABILITY.md)"},
    {"--ckpt-convert-format", true, Kind::refused, nullptr, "`fp8lm convert` exports a Hugging Face model"},
    {"--apply-residual-connection-post-layernorm", false, Kind::refused, nullptr,
     "fp8lm's blocks are GPT-2's, LayerNorm before attention and MLP"},
    {"--init-method-xavier-uniform", false, Kind::refused, nullptr,
     "fp8lm draws GPT-2's normal initial weights (--init-method-std)"},
    {"--decoder-first-pipeline-num-layers", true, Kind::refused, nullptr, kNoPipeline},
    {"--decoder-last-pipeline-num-layers", true, Kind::refused, nullptr, kNoPipeline},
    {"--microbatch-group-size-per-virtual-pipeline-stage", true, Kind::refused, nullptr, kNoPipeline},
    {"--ckpt-format", true, Kind::refused, nullptr,
     "fp8lm writes its own checkpoints (safetensors inside, docs/RELIABILITY.md); `fp8lm convert` exports a "
     "Hugging Face model"},
};

// "0", "0.0", "0e0": a number equal to the accepted one; other values compare as text.
bool accepted(const std::string& value, const char* wanted) {
  double got = 0.0, want = 0.0;
  const std::string w = wanted;
  const auto [got_end, got_error] = std::from_chars(value.data(), value.data() + value.size(), got);
  const auto [want_end, want_error] = std::from_chars(w.data(), w.data() + w.size(), want);
  const bool numbers = got_error == std::errc() && got_end == value.data() + value.size() &&
                       want_error == std::errc() && want_end == w.data() + w.size();
  return numbers ? got == want : value == w;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

const std::vector<MegatronFlag>& megatron_compatibility_flags() { return kFlags; }

void add_megatron_compatibility_flags(CLI::App& app, MegatronFlagValues& values) {
  const char* group = "Megatron compatibility (docs/MEGATRON.md)";
  values.values.assign(kFlags.size(), {});
  values.given.assign(kFlags.size(), 0);
  for (size_t i = 0; i < kFlags.size(); ++i) {
    const MegatronFlag& flag = kFlags[i];
    std::string help = flag.kind == Kind::no_effect     ? "No effect: "
                       : flag.kind == Kind::one_value   ? std::string("Only ") + flag.accepted_value + ": "
                       : flag.kind == Kind::not_written ? "Not written: "
                                                        : "Refused: ";
    help += flag.why;
    int* given = &values.given[i];
    if (flag.takes_value) {
      CLI::Option* option = app.add_option(flag.name, values.values[i], help)->group(group);
      // A repeated flag keeps its last value.
      option->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
      option->each([given](const std::string&) { *given = 1; });
    } else {
      app.add_flag_callback(flag.name, [given] { *given = 1; }, help)->group(group);
    }
  }
}

std::vector<std::string> check_megatron_compatibility_flags(const MegatronFlagValues& values,
                                                            std::vector<std::string>& warnings) {
  std::vector<std::string> no_effect;
  for (size_t i = 0; i < kFlags.size(); ++i) {
    if (!values.given[i]) continue;
    const MegatronFlag& flag = kFlags[i];
    const std::string name = flag.name;
    std::string value;
    for (const std::string& word : values.values[i]) value += (value.empty() ? "" : " ") + word;
    const std::string shown = flag.takes_value ? name + " " + value : name;
    switch (flag.kind) {
      case Kind::no_effect: no_effect.push_back(shown + ": " + flag.why); break;
      case Kind::not_written: warnings.push_back(shown + " is not written: " + flag.why); break;
      case Kind::one_value:
        if (!accepted(value, flag.accepted_value))
          throw InputError(shown + " is not supported: " + flag.why,
                           "pass " + name + " " + flag.accepted_value + ", or leave it out (docs/MEGATRON.md)");
        break;
      case Kind::refused:
        throw InputError(name + " is not supported: " + flag.why, "leave it out (docs/MEGATRON.md lists the Megatron "
                                                                  "flags fp8lm implements, accepts and refuses)");
    }
  }
  return no_effect;
}

std::string unknown_flag_message(const std::string& flag, const std::vector<std::string>& known_flags) {
  const std::string name = flag.substr(0, flag.find('='));
  std::string nearest;
  size_t best = std::numeric_limits<size_t>::max();
  for (const std::string& known : known_flags) {
    const size_t distance = edit_distance(name, known);
    if (distance < best) {
      best = distance;
      nearest = known;
    }
  }
  // A few letters off (a typo, a singular for a plural), not a different flag.
  const bool close = !nearest.empty() && best <= std::max<size_t>(2, name.size() / 8);
  std::string message = name.rfind('-', 0) == 0 ? "unknown flag " + name : "unexpected argument '" + flag + "'";
  if (close) message += " (did you mean " + nearest + "?)";
  return message;
}

}  // namespace fp8lm
