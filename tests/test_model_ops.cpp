// The one model's op sequence, pinned: the CPU backend wrapped in a recording Ops runs a
// two-layer model, and the log must be exactly the order layers/gpt.cpp states. The next
// issue's collectives get pinned between these lines the same way.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "core/random.h"
#include "layers/gpt.h"
#include "layers/ops_cpu.h"
#include "recording_ops.h"

using namespace fp8lm;

namespace {

// The step end's leading parts of AdamW's first pass (block 0's and the embedding's, queued
// after the backward's last attention backward): the sequences below check what follows.
void drop_first_pass_parts(std::vector<std::string>& log) {
  const auto is_part = [](const std::string& op) { return op.rfind("adamw_moment_amaxes + norm, tensors ", 0) == 0; };
  CHECK((!log.empty() && is_part(log.front())));
  log.erase(log.begin(), std::find_if_not(log.begin(), log.end(), is_part));
}

GptConfig two_layers() {
  GptConfig c;
  c.name = "two-layers";
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.n_inner = 64;
  c.vocab_size = 50;
  c.n_positions = 16;
  return c;
}

// The forward and backward of layers/gpt.cpp, written out: `op` is the GEMM operand
// dtype of the blocks, `grad` their gradient dtype, `head` the LM head's operand dtype.
// `cast` is what turns an activation into a GEMM operand ("quantize", or "view" when the
// operand is the activation itself).
// `blocks` gives each block's {op, grad} (blocks may differ: --first-last-layers-bf16).
struct BlockDtypes {
  std::string op, grad;
};
std::vector<std::string> expected_sequence(const std::vector<BlockDtypes>& blocks, const std::string& head,
                                           const std::string& head_cast, const std::string& grad_cast) {
  const int layers = int(blocks.size());
  std::vector<std::string> s = {"embedding_lookup", "add_position_embedding"};
  for (int l = 0; l < layers; ++l) {
    const std::string& op = blocks[size_t(l)].op;
    // One rank: the c_proj GEMMs' epilogues add the bias and the residual, so every
    // LayerNorm normalizes the residual stream as it is.
    s.push_back("layernorm -> " + op);
    s.push_back("gemm forward " + op + "x" + op + " +bias");  // c_attn
    s.push_back("attention -> " + op);
    s.push_back("gemm forward " + op + "x" + op + " +bias +residual");  // attn.c_proj
    s.push_back("layernorm -> " + op);
    s.push_back("gemm forward " + op + "x" + op + " +bias +gelu -> " + op);  // c_fc, the GELU its epilogue
    s.push_back("gemm forward " + op + "x" + op + " +bias +residual");  // mlp.c_proj
  }
  s.push_back("layernorm -> " + head);  // ln_f
  s.push_back("gemm forward " + head + "x" + head);
  for (const char* line : {"cross_entropy", "accumulate_loss"}) s.push_back(line);  // one rank: the fused loss
  s.push_back(head_cast + " -> " + head);
  s.push_back("gemm dgrad " + head + "x" + head + " promoted");  // the two sums that always promote
  s.push_back("gemm wgrad " + head + "x" + head + " promoted");
  s.push_back("zero");
  s.push_back("layernorm_backward");
  for (int l = layers - 1; l >= 0; --l) {
    const std::string& op = blocks[size_t(l)].op;
    const std::string& grad = blocks[size_t(l)].grad;
    s.push_back(grad_cast + " -> " + grad + " +dbias");  // mlp.c_proj's output gradient
    s.push_back("gemm dgrad " + grad + "x" + op);
    if (op == "e4m3" || op == "e5m2") {
      // An FP8 block (per-tensor scales) keeps no GELU output: the GELU backward recomputes
      // mlp.c_proj's wgrad input, so that wgrad follows it.
      s.push_back("gelu_backward -> " + grad + " +dbias +recomputed " + op);
      s.push_back("gemm wgrad " + grad + "x" + op);
    } else {
      s.push_back("gemm wgrad " + grad + "x" + op);
      s.push_back("gelu_backward -> " + grad + " +dbias");
    }
    s.push_back("gemm dgrad " + grad + "x" + op);
    s.push_back("gemm wgrad " + grad + "x" + op);
    s.push_back("layernorm_backward");
    s.push_back(grad_cast + " -> " + grad + " +dbias");  // attn.c_proj
    s.push_back("gemm dgrad " + grad + "x" + op);
    s.push_back("gemm wgrad " + grad + "x" + op);
    s.push_back("attention_backward -> " + grad + " +dbias");  // with c_attn's gradient cast
    s.push_back("gemm dgrad " + grad + "x" + op);
    s.push_back("gemm wgrad " + grad + "x" + op);
    s.push_back("layernorm_backward");
  }
  s.push_back("position_embedding_backward");
  s.push_back("embedding_lookup_backward");
  return s;
}

// Every block alike.
std::vector<std::string> expected_sequence(int layers, const std::string& op, const std::string& grad,
                                           const std::string& head, const std::string& head_cast,
                                           const std::string& grad_cast) {
  return expected_sequence(std::vector<BlockDtypes>(size_t(layers), BlockDtypes{op, grad}), head, head_cast, grad_cast);
}

std::vector<int32_t> tokens(size_t n, uint64_t seed) {
  Random random(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(random.next_u64() % 50);
  return t;
}

}  // namespace

TEST_CASE("the model calls the ops in the order it states, for every precision", "[model][cpu]") {
  struct Case {
    GemmPrecision precision;
    const char *op, *grad, *head, *head_cast, *grad_cast;
  };
  // On the CPU activations are FP32: BF16 and FP8 operands are casts, FP32 ones are views.
  for (const Case c : {Case{GemmPrecision::fp8, "e4m3", "e5m2", "bf16", "quantize", "quantize"},
                       Case{GemmPrecision::bf16, "bf16", "bf16", "bf16", "quantize", "quantize"},
                       Case{GemmPrecision::fp32, "f32", "f32", "f32", "view", "view"}}) {
    INFO(to_string(c.precision));
    std::vector<std::string> log;
    auto ops = testing::make_recording_ops(make_cpu_ops(), log);
    GptPrecision precision;
    precision.gemm = c.precision;
    const int B = 2, T = 8;
    GptModel model(two_layers(), B, T, precision, *ops);
    init_gpt_parameters(static_cast<float*>(model.working()), model.layout(), model.config(), 1);
    model.refresh_weight_operands();
    float loss_sum = 0.0f;
    Tensor loss;
    loss.data = &loss_sum;
    loss.rows = loss.cols = 1;
    const auto x = tokens(B * T, 1), y = tokens(B * T, 2);
    const TokenBatch batch = ops->load_batch(x.data(), y.data(), B, T, model.vocab_slice());
    log.clear();
    model.forward_backward(batch, 1.0f / (B * T), loss);
    CHECK(log == expected_sequence(2, c.op, c.grad, c.head, c.head_cast, c.grad_cast));
    CHECK(loss_sum > 0.0f);

    // Evaluation: the same forward and loss with amax recording off around it, no backward.
    log.clear();
    model.forward_eval(batch, loss);
    std::vector<std::string> eval = expected_sequence(2, c.op, c.grad, c.head, c.head_cast, c.grad_cast);
    eval.resize(eval.size() - 5 - 2 * 14 - 2);  // drop the backward (14 ops a block)
    eval.insert(eval.begin(), "amax_recording off");
    eval.push_back("amax_recording on");
    CHECK(log == eval);
  }
}

TEST_CASE("decoding records no amax and frees the GEMMs' plans; a recorded decoding pass records", "[model][cpu]") {
  std::vector<std::string> log;
  auto ops = testing::make_recording_ops(make_cpu_ops(), log);
  const int B = 2, prompt = 4;
  GptModel model(two_layers(), InferenceShape{.batch = B, .max_prompt = prompt, .capacity = 8},
                 GptPrecision{.gemm = GemmPrecision::fp8}, *ops);
  init_gpt_parameters(static_cast<float*>(model.working()), model.layout(), model.config(), 1);
  model.refresh_weight_operands();
  const auto x = tokens(B * prompt, 1);
  for (const bool record : {false, true}) {
    INFO("record " << record);
    const TokenBatch batch = ops->load_batch(x.data(), x.data(), B, prompt, model.vocab_slice());
    log.clear();
    model.forward_cached(batch, 0, record);
    REQUIRE(log.size() > 2);
    CHECK(log.front() == (record ? "amax_recording on" : "amax_recording off, any GEMM plan"));
    CHECK(log.back() == "amax_recording on");
    CHECK(std::count(log.begin(), log.end(), "amax_recording off") == 0);
  }
}

TEST_CASE("the training step: AdamW's first pass runs layer by layer beside the last micro-batch's attention "
          "backwards, over every tensor once",
          "[model][cpu]") {
  const RunSetup setup = resolve_run_setup(
      parse_train_command_line({"--config", testing::source_path("configs/tiny.json"), "--mock-data", "--device", "cpu",
                                "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
                                "--fp8-hybrid"})
          .options);
  std::vector<std::string> log;
  TrainingEngine engine(setup, ParallelLayout{}, testing::make_recording_ops(make_cpu_ops(), log));
  const auto x = tokens(32, 3), y = tokens(32, 4);
  const auto is_first_pass = [](const std::string& op) { return op.rfind("adamw", 0) == 0; };
  const std::string part = "adamw_moment_amaxes + norm, tensors ";
  std::vector<std::pair<size_t, size_t>> ranges;
  const auto collect_parts = [&] {
    for (const std::string& op : log)
      if (op.rfind(part, 0) == 0) {
        const std::string range = op.substr(part.size());
        const size_t dots = range.find("..");
        ranges.emplace_back(std::stoul(range.substr(0, dots)), std::stoul(range.substr(dots + 2)));
      }
  };
  engine.begin_step();
  log.clear();
  engine.forward_backward(x.data(), y.data());
  CHECK(std::none_of(log.begin(), log.end(), is_first_pass));  // not the last micro-batch
  log.clear();
  engine.forward_backward(x.data(), y.data());
  // Each attention backward of the last micro-batch is preceded by the parts of the layers
  // finished since the one before (the head's, then each block's), the first by the pass's
  // begin; no part runs anywhere else in the backward.
  size_t attention_backwards = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].rfind("attention_backward", 0) == 0) {
      ++attention_backwards;
      REQUIRE(i > 0);
      CHECK(log[i - 1].rfind(part, 0) == 0);
    } else if (is_first_pass(log[i])) {
      size_t next = i + 1;
      while (next < log.size() && is_first_pass(log[next])) ++next;
      REQUIRE(next < log.size());
      CHECK(log[next].rfind("attention_backward", 0) == 0);
      if (log[i] == "adamw first pass begin") CHECK(attention_backwards == 0);
    }
  }
  CHECK(attention_backwards == size_t(setup.model.n_layer));
  CHECK(std::count(log.begin(), log.end(), "adamw first pass begin") == 1);
  collect_parts();
  // The step's end queues the rest (block 0's and the embedding's), then takes the norm.
  log.clear();
  AdamWHyperparams hp;
  hp.lr = 1e-3f;
  engine.end_step(hp, 1.0, 0);
  REQUIRE(log.size() > 2);
  CHECK(log[0].rfind(part, 0) == 0);
  const auto finish = std::find(log.begin(), log.end(), "adamw first pass finish");
  REQUIRE(finish != log.end());
  CHECK(std::all_of(log.begin(), finish, [&](const std::string& op) { return op.rfind(part, 0) == 0; }));
  CHECK(*(finish + 1) == "finalize_step");
  collect_parts();
  // Every tensor once.
  std::sort(ranges.begin(), ranges.end());
  size_t next = 0;
  for (const auto& [first, end] : ranges) {
    CHECK(first == next);
    CHECK(end > first);
    next = end;
  }
  CHECK(next == engine.layout().tensors().size());
  // The step's betas must be the ones the parts ran with.
  engine.begin_step();
  engine.forward_backward(x.data(), y.data());
  engine.forward_backward(x.data(), y.data());
  hp.beta2 = 0.98f;  // not the run's --adam-beta2
  CHECK_THROWS_WITH(engine.end_step(hp, 1.0, 1), Catch::Matchers::ContainsSubstring("--adam-beta2"));
}

TEST_CASE("the training step: AdamW's first pass with the norm, decision, scale update, AdamW writing the FP8 "
          "weights, in that order",
          "[model][cpu]") {
  const RunSetup setup = resolve_run_setup(
      parse_train_command_line({"--config", testing::source_path("configs/tiny.json"), "--mock-data", "--device", "cpu",
                                "--seq-length", "16", "--micro-batch-size", "2", "--fp8-hybrid", "--fp8-interval", "2"})
          .options);
  std::vector<std::string> log;
  TrainingEngine engine(setup, ParallelLayout{}, testing::make_recording_ops(make_cpu_ops(), log));
  const auto x = tokens(32, 3), y = tokens(32, 4);
  AdamWHyperparams hp;
  hp.lr = 1e-3f;
  const int layers = setup.model.n_layer;
  for (int step = 0; step < 2; ++step) {
    engine.begin_step();
    engine.forward_backward(x.data(), y.data());
    log.clear();
    engine.end_step(hp, 1.0, step);
    // --fp8-interval 2: step 0 keeps accumulating amaxes (discarded only if skipped), and its
    // scales are still current scaling's, which need each weight's amax before its cast: the
    // weights are cast after the update. Step 1 updates the scales, then AdamW's update pass
    // casts the FP8 weights (and W^T) with them.
    // AdamW's first pass reads the gradients for their norm too, before the decision; after
    // it, the amaxes again only if the step clips.
    // (The first pass's parts of block 0 and the embedding come first: the backward queued the
    // others beside its attention backwards.)
    drop_first_pass_parts(log);
    std::vector<std::string> expected = {"adamw first pass finish", "finalize_step",
                                         step == 1 ? "update_scales" : "discard_current_amaxes",
                                         "adamw_moment_amaxes if clipped",
                                         step == 1 ? "adamw_apply + " + std::to_string(4 * layers) + " FP8 weights"
                                                   : "adamw_apply"};
    expected.push_back("quantize -> bf16");  // the LM head's BF16 copy (CPU)
    if (step == 0)
      for (int i = 0; i < 4 * layers; ++i) expected.push_back("quantize -> e4m3");
    CHECK(log == expected);
  }
}

TEST_CASE("BF16 first and last layers: the named blocks' GEMMs run BF16, the others FP8, with no FP8 states",
          "[model][cpu]") {
  GptConfig config = two_layers();
  config.n_layer = 4;
  std::vector<std::string> log;
  auto ops = testing::make_recording_ops(make_cpu_ops(), log);
  GptPrecision precision;
  precision.gemm = GemmPrecision::fp8;
  precision.bf16_layers_at_start = 1;
  precision.bf16_layers_at_end = 2;
  const int B = 2, T = 8;
  GptModel model(config, B, T, precision, *ops);
  init_gpt_parameters(static_cast<float*>(model.working()), model.layout(), model.config(), 1);
  model.refresh_weight_operands();

  // FP8 scaling states only for block 1's four Linears (input, weight, output gradient each).
  REQUIRE(model.scaling().size() == 12);
  for (int i = 0; i < model.scaling().size(); ++i) CHECK(model.scaling().name(i).rfind("h.1.", 0) == 0);
  CHECK(model.fp8_weight_operands().size() == 4);
  for (const ParameterBucket& bucket : model.buckets())
    if (bucket.layer >= 0 && bucket.layer < config.n_layer && bucket.name.find("weights") != std::string::npos)
      CHECK(bucket.linear_weights == (bucket.layer == 1));  // FP8 codes under --fp8-param-gather: block 1's only

  float loss_sum = 0.0f;
  Tensor loss;
  loss.data = &loss_sum;
  loss.rows = loss.cols = 1;
  const auto x = tokens(B * T, 1), y = tokens(B * T, 2);
  const TokenBatch batch = ops->load_batch(x.data(), y.data(), B, T, model.vocab_slice());
  log.clear();
  model.forward_backward(batch, 1.0f / (B * T), loss);
  const BlockDtypes bf16{"bf16", "bf16"}, fp8{"e4m3", "e5m2"};
  CHECK(log == expected_sequence({bf16, fp8, bf16, bf16}, "bf16", "quantize", "quantize"));
  CHECK(std::isfinite(loss_sum));
  CHECK(loss_sum > 0.0f);
}

namespace {

// The ops of one optimizer step's end (AdamW's first pass with the norm, decision, scale
// update, AdamW writing the FP8 weights, the other weight casts) in a 3-block FP8 run with `precision_flags`, checked against the blocks'
// weights cast to `block_dtypes`: the FP8 ones by AdamW, the BF16 ones after it.
void check_step_weight_casts(const std::vector<std::string>& precision_flags,
                             const std::vector<const char*>& block_dtypes) {
  std::vector<std::string> args = {"--config",       testing::source_path("configs/tiny.json"),
                                   "--mock-data",    "--device",
                                   "cpu",            "--seq-length",
                                   "16",             "--micro-batch-size",
                                   "2",              "--fp8-hybrid",
                                   "--num-layers",   "3"};
  args.insert(args.end(), precision_flags.begin(), precision_flags.end());
  const RunSetup setup = resolve_run_setup(parse_train_command_line(args).options);
  std::vector<std::string> log;
  TrainingEngine engine(setup, ParallelLayout{}, testing::make_recording_ops(make_cpu_ops(), log));
  const auto x = tokens(32, 3), y = tokens(32, 4);
  AdamWHyperparams hp;
  hp.lr = 1e-3f;
  engine.begin_step();
  engine.forward_backward(x.data(), y.data());
  log.clear();
  engine.end_step(hp, 1.0, 0);
  const auto fp8_blocks = std::count(block_dtypes.begin(), block_dtypes.end(), std::string("e4m3"));
  drop_first_pass_parts(log);
  std::vector<std::string> expected = {"adamw first pass finish", "finalize_step", "update_scales",
                                       "adamw_moment_amaxes if clipped",
                                       "adamw_apply + " + std::to_string(4 * fp8_blocks) + " FP8 weights",
                                       "quantize -> bf16"};  // ... and the LM head's BF16 copy
  for (const char* block : block_dtypes)
    if (std::string(block) != "e4m3")
      for (int i = 0; i < 4; ++i) expected.push_back(std::string("quantize -> ") + block);
  CHECK(log == expected);
}

}  // namespace

TEST_CASE("BF16 first and last layers in the step: the BF16 blocks' weights are cast to BF16, the others to FP8",
          "[model][cpu]") {
  check_step_weight_casts({"--first-last-layers-bf16"}, {"bf16", "e4m3", "bf16"});
}

TEST_CASE("BF16 blocks by number: the named blocks' GEMMs run BF16 beside the first and last layers, the others FP8",
          "[model][cpu][auto-precision]") {
  GptConfig config = two_layers();
  config.n_layer = 5;
  std::vector<std::string> log;
  auto ops = testing::make_recording_ops(make_cpu_ops(), log);
  GptPrecision precision;
  precision.gemm = GemmPrecision::fp8;
  precision.bf16_layers_at_end = 1;  // block 4
  precision.bf16_blocks = {1, 4};    // block 4 twice: counted once
  CHECK(precision.bf16_block_count(config.n_layer) == 2);
  const int B = 2, T = 8;
  GptModel model(config, B, T, precision, *ops);
  init_gpt_parameters(static_cast<float*>(model.working()), model.layout(), model.config(), 1);
  model.refresh_weight_operands();
  REQUIRE(model.scaling().size() == 3 * 12);  // blocks 0, 2 and 3
  for (int i = 0; i < model.scaling().size(); ++i) {
    const std::string name = model.scaling().name(i);
    CHECK((name.rfind("h.0.", 0) == 0 || name.rfind("h.2.", 0) == 0 || name.rfind("h.3.", 0) == 0));
  }
  float loss_sum = 0.0f;
  Tensor loss;
  loss.data = &loss_sum;
  loss.rows = loss.cols = 1;
  const auto x = tokens(B * T, 1), y = tokens(B * T, 2);
  const TokenBatch batch = ops->load_batch(x.data(), y.data(), B, T, model.vocab_slice());
  log.clear();
  model.forward_backward(batch, 1.0f / (B * T), loss);
  const BlockDtypes bf16{"bf16", "bf16"}, fp8{"e4m3", "e5m2"};
  CHECK(log == expected_sequence({fp8, bf16, fp8, fp8, bf16}, "bf16", "quantize", "quantize"));
}

TEST_CASE("BF16 blocks by number in the step: the named block's weights are cast to BF16, the others to FP8",
          "[model][cpu][auto-precision]") {
  check_step_weight_casts({"--bf16-blocks", "1"}, {"e4m3", "bf16", "e4m3"});
}

TEST_CASE("the GELU epilogue's precondition refuses a GEMM without a bias, with a residual or aliasing", "[model][cpu]") {
  // Shapes only: the check reads no data, so any distinct addresses will do.
  float storage[6];
  auto tensor = [&](int i, int64_t rows, int64_t cols) {
    Tensor t;
    t.data = &storage[i];
    t.rows = rows;
    t.cols = cols;
    return t;
  };
  GemmCall call{.out = tensor(0, 4, 16), .input = tensor(1, 4, 8), .weight = tensor(2, 16, 8), .bias = tensor(3, 1, 16),
                .gelu_input = tensor(4, 4, 16)};
  CHECK_NOTHROW(check_gelu_epilogue(call));
  GemmCall no_bias = call;
  no_bias.bias = Tensor{};
  CHECK_THROWS_AS(check_gelu_epilogue(no_bias), RuntimeError);
  GemmCall residual = call;
  residual.residual = tensor(5, 4, 16);
  CHECK_THROWS_AS(check_gelu_epilogue(residual), RuntimeError);
  GemmCall aliased = call;
  aliased.gelu_input = call.out;
  CHECK_THROWS_AS(check_gelu_epilogue(aliased), RuntimeError);
  GemmCall wrong_shape = call;
  wrong_shape.gelu_input = tensor(4, 4, 8);
  CHECK_THROWS_AS(check_gelu_epilogue(wrong_shape), RuntimeError);
  GemmCall dgrad = call;
  dgrad.pass = GemmPass::dgrad;
  CHECK_THROWS_AS(check_gelu_epilogue(dgrad), RuntimeError);
  // Without gelu_input there is nothing to check.
  no_bias.gelu_input = Tensor{};
  CHECK_NOTHROW(check_gelu_epilogue(no_bias));
}
