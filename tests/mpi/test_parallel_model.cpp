// The one model and the one step across ranks (TP=2 at 2 ranks, TP=2 x DP=2 at 4): every rank
// holds the same FP8 scaling state, the same weights and the same metrics after every step;
// and a recording Ops with a recording Communicator pins where each collective of a
// tensor-parallel block sits between the ops.
//
// "mpi:" cases run the CPU backend over MPI; "nccl:" cases the CUDA backend over NCCL, and skip
// on every rank alike without a GPU per rank.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <mpi.h>

#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "core/device.h"
#include "core/loss_mask.h"
#include "core/random.h"
#include "engine_testing.h"
#include "tests/evaluator_testing.h"
#include "layers/gpt.h"
#include "layers/ops_cpu.h"
#include "parallel/mappings.h"
#include "parallel/process_groups.h"
#include "parallel/recording_communicator.h"
#include "tests/byte_vocabulary.h"
#include "tests/recording_ops.h"
#include "tests/temp_dir.h"

using namespace fp8lm;

namespace {

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

RunSetup tiny_setup(const ParallelLayout& layout, const std::string& device, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--config", std::string(FP8LM_SOURCE_DIR) + "/configs/tiny.json", "--mock-data",
                                   "--device", device, "--seq-length", "32", "--micro-batch-size", "2",
                                   "--tensor-model-parallel-size", std::to_string(layout.tp_size), "--lr", "3e-3"};
  args.insert(args.end(), extra.begin(), extra.end());
  return resolve_run_setup(parse_train_command_line(args).options, layout);
}


// True when `values` are the same, bit for bit, on every rank of `comm`.
bool same_on_every_rank(const std::vector<float>& values, MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  std::vector<float> all(values.size() * size_t(size));
  MPI_Allgather(values.data(), int(values.size() * sizeof(float)), MPI_BYTE, all.data(),
                int(values.size() * sizeof(float)), MPI_BYTE, comm);
  for (int r = 1; r < size; ++r)
    if (!std::equal(values.begin(), values.end(), all.begin() + size_t(r) * values.size(),
                    [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }))
      return false;
  return true;
}

struct RankRun {
  std::vector<float> metrics;     // loss, gradient norm, skipped of every step
  std::vector<float> parameters;  // gathered, as one process holds them
};

// Four steps; checks that every rank holds the same scales, weights and metrics after them.
RankRun check_ranks_agree(const std::string& device, const std::vector<std::string>& flags) {
  const ParallelLayout layout = detect_parallel_layout(2);
  const RunSetup setup = tiny_setup(layout, device, flags);
  TrainingEngine engine(setup, layout);
  AdamWHyperparams hp;
  hp.lr = 3e-3f;
  const int tokens_per_micro_batch = 2 * 32;
  RankRun run;
  for (int step = 0; step < 4; ++step) {
    engine.begin_step();
    // Each data-parallel rank reads its own batch; tensor-parallel ranks read the same one.
    const auto x = testing::tiny_tokens(tokens_per_micro_batch, 100 * step + layout.dp_rank);
    const auto y = testing::tiny_tokens(tokens_per_micro_batch, 100 * step + layout.dp_rank + 50);
    engine.forward_backward(x.data(), y.data());
    engine.end_step(hp, 1.0, step);
    const StepMetrics m = engine.step_metrics();
    INFO("step " << step << " loss " << m.loss);
    const std::vector<float> metrics = {float(m.loss), float(m.grad_norm), float(m.skipped)};
    CHECK(same_on_every_rank(metrics, MPI_COMM_WORLD));
    run.metrics.insert(run.metrics.end(), metrics.begin(), metrics.end());
  }
  const ScalingSnapshot scaling = engine.scaling_state();
  REQUIRE(!scaling.names.empty());
  CHECK(same_on_every_rank(scaling.scale, MPI_COMM_WORLD));
  CHECK(same_on_every_rank(scaling.scale_inv, MPI_COMM_WORLD));
  CHECK(same_on_every_rank(scaling.history, MPI_COMM_WORLD));
  run.parameters = engine.parameters();
  CHECK(same_on_every_rank(run.parameters, MPI_COMM_WORLD));
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Recomputing a block's forward inside its backward reruns its collectives too (the
// sequence-parallel all-gather of the LayerNorm output, the row-parallel sums): training is
// the same, bit for bit, as without recomputation. So is transposing each rank's FP8 weight
// shard before its dgrad instead of keeping the transpose (--no-fp8-weight-transpose-cache).
void check_recompute_changes_nothing(const std::string& device) {
  const std::vector<std::string> layout = {"--fp8-hybrid", "--sequence-parallel", "--num-layers", "4"};
  const RankRun plain = check_ranks_agree(device, layout);
  for (const std::vector<std::string>& recompute :
       {std::vector<std::string>{"--recompute-granularity", "full", "--recompute-method", "uniform",
                                 "--recompute-num-layers", "2"},
        std::vector<std::string>{"--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"},
        std::vector<std::string>{"--no-fp8-weight-transpose-cache"}}) {
    std::vector<std::string> flags = layout;
    flags.insert(flags.end(), recompute.begin(), recompute.end());
    INFO(recompute.back());
    const RankRun recomputed = check_ranks_agree(device, flags);
    CHECK(same_bits(recomputed.metrics, plain.metrics));
    CHECK(same_bits(recomputed.parameters, plain.parameters));
  }
}

bool every_rank_has_a_gpu() {
  int gpus = cuda_availability().device_count, fewest = gpus;
  MPI_Allreduce(&gpus, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return fewest >= world_size();
}

}  // namespace

// With the FP8 weights gathered as codes, a rank that keeps no weight transposes
// (--no-fp8-weight-transpose-cache) trains as one that writes them beside the gathered codes.
void check_fp8_ranks_agree(const std::string& device) {
  check_ranks_agree(device, {"--fp8-hybrid"});
  const std::vector<std::string> fp8_traffic = {"--fp8-hybrid", "--sequence-parallel", "--fp8-grad-comm",
                                                "--fp8-param-gather"};
  const RankRun kept = check_ranks_agree(device, fp8_traffic);
  std::vector<std::string> flags = fp8_traffic;
  flags.push_back("--no-fp8-weight-transpose-cache");
  const RankRun derived = check_ranks_agree(device, flags);
  CHECK(same_bits(derived.metrics, kept.metrics));
  CHECK(same_bits(derived.parameters, kept.parameters));
}

TEST_CASE("mpi: FP8 scales, weights and metrics agree on every rank (delayed scaling)", "[mpi][parallel]") {
  check_fp8_ranks_agree("cpu");
}

TEST_CASE("nccl: FP8 scales, weights and metrics agree on every rank (delayed scaling)", "[nccl][parallel]") {
  if (!every_rank_has_a_gpu()) SKIP("needs a GPU per rank");
  check_fp8_ranks_agree("cuda");
}

// fp8lm eval's evaluator splits the model as training does (TP = 2, with and without sequence
// parallelism; at 4 ranks DP = 2 beside it, each rank scoring its own batches): its losses are
// the engine's evaluation's, bit for bit. On the GPU the engine's optimizer is unsharded, so
// that it casts its FP8 weights from FP32 as the evaluator does (the distributed optimizer
// casts them from the gathered BF16 working copy).
void check_evaluator_under_tensor_parallelism(const std::string& device, std::vector<std::string> extra) {
  const ParallelLayout layout = detect_parallel_layout(2);
  for (std::vector<std::string> flags : {std::vector<std::string>{"--fp8-hybrid"},
                                         std::vector<std::string>{"--fp8-hybrid", "--sequence-parallel"},
                                         std::vector<std::string>{"--bf16", "--sequence-parallel"}}) {
    INFO(flags.back());
    flags.insert(flags.end(), extra.begin(), extra.end());
    testing::check_evaluator_matches_engine(tiny_setup(layout, device, flags), layout);
  }
}

TEST_CASE("mpi: the evaluator scores as the training engine under TP = 2 (and DP = 2), bit for bit", "[mpi][parallel]") {
  check_evaluator_under_tensor_parallelism("cpu", {});
}

TEST_CASE("nccl: the evaluator scores as the training engine under TP = 2 (and DP = 2), bit for bit", "[nccl][parallel]") {
  if (!every_rank_has_a_gpu()) SKIP("needs a GPU per rank");
  check_evaluator_under_tensor_parallelism("cuda", {"--no-use-distributed-optimizer"});
}

TEST_CASE("mpi: activation recomputation under TP=2 with sequence parallelism changes nothing", "[mpi][parallel]") {
  check_recompute_changes_nothing("cpu");
}

TEST_CASE("nccl: activation recomputation under TP=2 with sequence parallelism changes nothing", "[nccl][parallel]") {
  if (!every_rank_has_a_gpu()) SKIP("needs a GPU per rank");
  check_recompute_changes_nothing("cuda");
}

TEST_CASE("mpi: the collectives of a tensor-parallel block sit where the model states them", "[mpi][parallel]") {
  const ParallelLayout layout = detect_parallel_layout(2);
  ProcessGroups groups = ProcessGroups::create_host(layout);
  const GptConfig config = tiny_setup(layout, "cpu", {}).model;  // C = 64, 2 heads, F = 256, V = 256
  const int B = 2, T = 32, BT = B * T, C = config.n_embd;
  for (const bool sequence_parallel : {false, true}) {
    INFO("sequence parallel: " << sequence_parallel);
    std::vector<std::string> log;
    RecordingCommunicator recorded_tp(groups.tp(), log);
    auto ops = testing::make_recording_ops(make_cpu_ops(), log);
    TensorParallelMappings tp(&recorded_tp, sequence_parallel, *ops);
    GptPrecision precision;
    precision.gemm = GemmPrecision::fp8;
    GptModel model(config, B, T, precision, *ops, ModelParallelism{&tp, layout.dp_size});
    init_gpt_parameters(static_cast<float*>(model.working()), model.layout(), config, 3);
    model.refresh_weight_operands();
    float loss_sum = 0.0f;
    Tensor loss;
    loss.data = &loss_sum;
    loss.rows = loss.cols = 1;
    const auto x = testing::tiny_tokens(BT, 1), y = testing::tiny_tokens(BT, 2);
    const TokenBatch batch = ops->load_batch(x.data(), y.data(), B, T, model.vocab_slice());
    log.clear();
    model.forward_backward(batch, 1.0f / BT, loss);

    // Block 1's forward, as layers/gpt.cpp states it, with its collectives (the CPU stores
    // every dtype as FP32, so activations travel as f32 here and as bf16 on the GPU).
    const std::string rows = std::to_string(BT * C / (sequence_parallel ? 2 : 1));
    const std::string enter = sequence_parallel ? "tp.all_gather f32 x" + rows : "";  // ln output, all rows
    const std::string leave = sequence_parallel ? "tp.reduce_scatter f32 x" + rows + " sum"
                                                : "tp.all_reduce f32 x" + std::to_string(BT * C) + " sum";
    std::vector<std::string> block = {"residual_layernorm -> e4m3"};
    if (!enter.empty()) block.push_back(enter);
    for (const char* line : {"gemm forward e4m3xe4m3 +bias", "attention -> e4m3", "gemm forward e4m3xe4m3"})
      block.push_back(line);
    block.push_back(leave);  // the row-parallel c_proj's partial output, summed before the add
    block.push_back("residual_layernorm -> e4m3");
    if (!enter.empty()) block.push_back(enter);
    // c_fc with the GELU in its epilogue, then the row-parallel mlp.c_proj.
    for (const char* line : {"gemm forward e4m3xe4m3 +bias +gelu -> e4m3", "gemm forward e4m3xe4m3"})
      block.push_back(line);
    block.push_back(leave);
    const auto start = std::find(log.begin(), log.end(), "attention -> e4m3");  // block 0's attention
    REQUIRE(start != log.end());
    const auto block1 = std::search(start + 1, log.end(), block.begin(), block.end());
    CHECK(block1 != log.end());
    // The vocabulary-parallel embedding sums its rows like a row-parallel output, and the
    // loss gathers every rank's statistics once.
    CHECK(log[0] == "embedding_lookup");
    CHECK(log[1] == (sequence_parallel ? "tp.reduce_scatter f32 x" + rows + " sum"
                                       : "tp.all_reduce f32 x" + std::to_string(BT * C) + " sum"));
    CHECK(std::count(log.begin(), log.end(), "tp.all_gather f32 x" + std::to_string(BT * 3)) == 1);
    // The backward mirrors the forward: each column-parallel input's gradient is summed
    // (all-reduce, or reduce-scatter under sequence parallelism), each row-parallel output's
    // gradient gathered under sequence parallelism.
    const std::string grad_sum = sequence_parallel ? "tp.reduce_scatter f32 x" + rows + " sum"
                                                   : "tp.all_reduce f32 x" + std::to_string(BT * C) + " sum";
    const auto backward = std::find(log.begin(), log.end(), "cross_entropy_finish");
    const long sums = std::count(backward, log.end(), grad_sum);
    CHECK(sums == 2 * config.n_layer + 1);  // c_attn and c_fc of every block, and the LM head
    if (sequence_parallel)
      CHECK(std::count(backward, log.end(), "tp.all_gather f32 x" + rows) == 2 * config.n_layer + 1);
  }
}

TEST_CASE("mpi: every layout starts from the canonical model's initial weights, drawn rank by rank",
          "[mpi][parallel]") {
  // Each rank draws only the tensors it holds (TrainingEngine::State::initial_slab), and under
  // the distributed optimizer only its shard of them, the working copy gathered from every
  // rank's (initial_shard); gathered back, the master is the one-process initialisation bit
  // for bit, and the first forward (the working copy, the FP8 weight operands cast from it)
  // gives the same loss either way.
  for (int tp : {1, 2}) {
    for (const char* precision : {"--fp8-hybrid", "--bf16"}) {
      std::vector<double> first_losses;
      for (const char* optimizer : {"--use-distributed-optimizer", "--no-use-distributed-optimizer"}) {
        const ParallelLayout layout = detect_parallel_layout(tp);
        const RunSetup setup = tiny_setup(layout, "cpu", {precision, "--seed", "31", optimizer});
        TrainingEngine engine(setup, layout);
        const TensorLayout canonical = make_gpt_layout(setup.model);
        std::vector<float> expected(canonical.total_elements(), 0.0f);
        init_gpt_parameters(expected.data(), canonical, setup.model, 31);
        INFO("tp " << tp << ", " << precision << ", " << optimizer);
        const std::vector<float> actual = engine.parameters();
        REQUIRE(actual.size() == expected.size());
        CHECK(std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(float)) == 0);
        const size_t tokens = size_t(setup.options.micro_batch_size) * size_t(setup.seq_length);
        const auto x = testing::tiny_tokens(tokens, 7 + layout.dp_rank), y = testing::tiny_tokens(tokens, 8);
        first_losses.push_back(engine.evaluate(x.data(), y.data()).mean());
      }
      INFO("tp " << tp << ", " << precision);
      CHECK(std::memcmp(&first_losses[0], &first_losses[1], sizeof(double)) == 0);
    }
  }
}

TEST_CASE("mpi: --eod-mask-loss under data parallelism: each rank's micro-batch is its own unmasked mean (or, "
          "with --calculate-per-token-loss, the step's), the step's loss the global one",
          "[mpi][parallel][loss-mask]") {
  // Megatron's normalisation: by default a rank's micro-batch weighs each unmasked token 1 / (its
  // count x the data-parallel ranks); with --calculate-per-token-loss each weighs 1 / (every
  // rank's count). The reported loss is every rank's loss sum over every rank's count either way.
  // The ranks mask different numbers of targets, so the weights differ from a plain mean.
  const testing::TempDir dir;
  const testing::ByteVocabulary vocab = testing::write_byte_vocabulary(dir);  // <|endoftext|> is 257
  const ParallelLayout layout = detect_parallel_layout(1);
  const int dp = layout.dp_size, B = 2, T = 32, kEnd = 257;
  // Rank r's batch: tokens from its seed, 3 r + 1 of its inputs the end-of-document token.
  auto rank_batch = [&](int r) {
    Random random(uint64_t(500 + r));
    std::vector<int32_t> x(size_t(B) * T), y(x.size());
    for (auto& t : x) t = int32_t(random.next_u64() % 300);
    for (auto& t : y) t = int32_t(random.next_u64() % 300);
    for (auto& t : x) t = t == kEnd ? 0 : t;
    for (int k = 0; k < 3 * r + 1; ++k) x[size_t(7 * k + r) % x.size()] = kEnd;
    mask_targets_after_token(kEnd, x.data(), y.data(), y.size());
    return std::pair{x, y};
  };
  double count = 0;
  for (int r = 0; r < dp; ++r) count += double(count_unmasked_targets(rank_batch(r).second.data(), size_t(B) * T));
  for (const bool per_token : {false, true}) {
    std::vector<std::string> flags = {"--fp32", "--vocab-size", "300", "--vocab-file", vocab.vocab_file,
                                      "--merge-file", vocab.merge_file, "--eod-mask-loss", "--use-distributed-optimizer"};
    if (per_token) flags.push_back("--calculate-per-token-loss");
    const RunSetup setup = tiny_setup(layout, "cpu", flags);
    REQUIRE(setup.loss_mask_token == kEnd);
    TrainingEngine engine(setup, layout);
    const std::vector<float> initial = engine.parameters();
    const auto [x, y] = rank_batch(layout.dp_rank);
    if (per_token) {
      engine.begin_step(0, 1, count_unmasked_targets(y.data(), y.size()));
    } else {
      engine.begin_step();
    }
    engine.forward_backward(x.data(), y.data());
    engine.end_step(AdamWHyperparams{.lr = 1e-3f}, 1.0, 0);
    const StepMetrics metrics = engine.step_metrics();

    // Every rank's batch through the model alone, on this process, gradients accumulated.
    std::unique_ptr<Ops> ops = make_cpu_ops();
    GptModel model(setup.model, B, T, GptPrecision{}, *ops);
    float* master = static_cast<float*>(model.working());
    for (const TensorInfo& t : model.layout().tensors())
      std::copy_n(initial.begin() + ptrdiff_t(engine.layout().find(t.name)->offset), t.numel, master + t.offset);
    model.zero_gradients();
    double loss_sum = 0;
    for (int r = 0; r < dp; ++r) {
      const auto [rx, ry] = rank_batch(r);
      const double unmasked = double(count_unmasked_targets(ry.data(), ry.size()));
      float sum = 0.0f;
      Tensor sum_tensor;
      sum_tensor.data = &sum;
      sum_tensor.rows = sum_tensor.cols = 1;
      model.forward_backward(ops->load_batch(rx.data(), ry.data(), B, T, model.vocab_slice()),
                             float(per_token ? 1.0 / count : 1.0 / (unmasked * dp)), sum_tensor);
      loss_sum += sum;
    }
    double squares = 0;
    const float* gradients = model.gradients().as<float>();
    for (size_t i = 0; i < model.layout().total_elements(); ++i) squares += double(gradients[i]) * gradients[i];
    INFO("rank " << layout.world_rank << (per_token ? ", per token" : "") << ": loss " << metrics.loss
                 << " expected " << loss_sum / count);
    CHECK(std::fabs(metrics.loss - loss_sum / count) <= 1e-6 * (loss_sum / count));
    CHECK(std::fabs(metrics.grad_norm - std::sqrt(squares)) <= 1e-5 * std::sqrt(squares));
    // Evaluation: the same global count.
    engine.set_parameters(initial);
    const TrainingEngine::BatchLoss eval = engine.evaluate(x.data(), y.data());
    CHECK(eval.tokens == count);
    CHECK(std::fabs(eval.mean() - loss_sum / count) <= 1e-6 * (loss_sum / count));
  }
}

// Documents (--reset-position-ids --reset-attention-mask) under TP = 2, with and without sequence
// parallelism: each rank's rows take their position ids from the whole batch's index, its share
// of the position embedding's gradient sums to the whole rows', and the heads of each rank keep
// to the documents. The step's loss and gradient norm are the one process's over the same batch.
void check_documents_under_tensor_parallelism(const std::string& device) {
  const testing::TempDir dir;
  const testing::ByteVocabulary vocab = testing::write_byte_vocabulary(dir);  // <|endoftext|> is 257
  const ParallelLayout layout = detect_parallel_layout(2);
  const int B = 2, T = 32, kEnd = 257;
  Random random(77);
  std::vector<int32_t> x(size_t(B) * T), y(x.size());
  for (auto& t : x) t = int32_t(random.next_u64() % 256);
  for (auto& t : y) t = int32_t(random.next_u64() % 256);
  for (const size_t at : {3, 4, 17, 30, 32 + 9, 32 + 31}) x[at] = kEnd;  // documents of 1 to 22 tokens
  const DocumentMasking documents{.end_of_document = kEnd, .reset_attention_mask = true, .reset_position_ids = true};
  const bool cuda = device == "cuda";
  for (const bool sequence_parallel : {false, true}) {
    INFO("sequence parallel: " << sequence_parallel);
    std::vector<std::string> flags = {cuda ? "--bf16" : "--fp32", "--vocab-size", "300", "--vocab-file",
                                      vocab.vocab_file, "--merge-file", vocab.merge_file, "--reset-position-ids",
                                      "--reset-attention-mask"};
    if (sequence_parallel) flags.push_back("--sequence-parallel");
    const RunSetup setup = tiny_setup(layout, device, flags);
    REQUIRE(setup.documents.end_of_document == kEnd);
    TrainingEngine engine(setup, layout);
    const std::vector<float> initial = engine.parameters();
    engine.begin_step();
    engine.forward_backward(x.data(), y.data());
    engine.end_step(AdamWHyperparams{.lr = 1e-3f}, 1.0, 0);
    const StepMetrics metrics = engine.step_metrics();

    // The batch through the whole model on this process (the CPU reference, FP32).
    std::unique_ptr<Ops> ops = make_cpu_ops();
    GptPrecision precision;
    precision.gemm = GemmPrecision::fp32;
    GptModel model(setup.model, B, T, precision, *ops);
    float* working = static_cast<float*>(model.working());
    for (const TensorInfo& t : model.layout().tensors())
      std::copy_n(initial.begin() + ptrdiff_t(engine.layout().find(t.name)->offset), t.numel, working + t.offset);
    model.refresh_weight_operands();
    model.zero_gradients();
    float sum = 0.0f;
    Tensor sum_tensor;
    sum_tensor.data = &sum;
    sum_tensor.rows = sum_tensor.cols = 1;
    model.forward_backward(ops->load_batch(x.data(), y.data(), B, T, model.vocab_slice(), documents),
                           1.0f / float(B * T), sum_tensor);
    double squares = 0;
    const float* gradients = model.gradients().as<float>();
    for (size_t i = 0; i < model.layout().total_elements(); ++i) squares += double(gradients[i]) * gradients[i];
    const double loss = double(sum) / (B * T);
    INFO("rank " << layout.world_rank << ": loss " << metrics.loss << " expected " << loss << ", norm "
                 << metrics.grad_norm << " expected " << std::sqrt(squares));
    const double tolerance = cuda ? 2e-2 : 1e-5;  // BF16 GEMMs on the GPU against the FP32 reference
    CHECK(std::fabs(metrics.loss - loss) <= tolerance * loss);
    CHECK(std::fabs(metrics.grad_norm - std::sqrt(squares)) <= tolerance * std::sqrt(squares));
    // Without the documents the same batch gives another loss.
    float plain = 0.0f;
    sum_tensor.data = &plain;
    model.forward_eval(ops->load_batch(x.data(), y.data(), B, T, model.vocab_slice()), sum_tensor);
    if (!cuda) CHECK(double(plain) / (B * T) != loss);
  }
}

TEST_CASE("mpi: documents (--reset-position-ids --reset-attention-mask) under TP = 2, with and without sequence "
          "parallelism, train as one process does",
          "[mpi][parallel][documents]") {
  check_documents_under_tensor_parallelism("cpu");
}

TEST_CASE("nccl: documents (--reset-position-ids --reset-attention-mask) under TP = 2, with and without sequence "
          "parallelism, train as one process does",
          "[nccl][parallel][documents]") {
  if (!every_rank_has_a_gpu()) SKIP("needs a GPU per rank");
  check_documents_under_tensor_parallelism("cuda");
}

// An untied LM head (--untie-embeddings-and-output-weights) under TP = 2: its weight is split by
// vocabulary rows as wte's and travels in the head's bucket; every rank agrees, and a
// forward-only evaluator (which casts the head's FP8 operand at the head's layer) scores as the
// engine, with the head in BF16 and in FP8.
TEST_CASE("mpi: an untied LM head under TP = 2: every rank agrees, and the evaluator scores as the engine",
          "[mpi][parallel][untied-head]") {
  for (const bool fp8_head : {false, true}) {
    INFO("FP8 LM head: " << fp8_head);
    std::vector<std::string> flags = {"--fp8-hybrid", "--untie-embeddings-and-output-weights", "--sequence-parallel"};
    if (fp8_head) flags.push_back("--fp8-lm-head");
    const RankRun untied = check_ranks_agree("cpu", flags);
    flags.erase(flags.begin() + 1);
    const RankRun tied = check_ranks_agree("cpu", flags);
    CHECK_FALSE(same_bits(untied.metrics, tied.metrics));  // the head's own weights: another model
  }
  check_evaluator_under_tensor_parallelism("cpu", {"--untie-embeddings-and-output-weights"});
  const ParallelLayout layout = detect_parallel_layout(2);
  for (const char* layout_flag : {"--no-sequence-parallel", "--sequence-parallel"}) {
    INFO("the FP8 LM head, " << layout_flag);
    std::vector<std::string> flags = {"--fp8-hybrid", "--fp8-lm-head", "--untie-embeddings-and-output-weights"};
    if (std::string(layout_flag) == "--sequence-parallel") flags.push_back(layout_flag);
    testing::check_evaluator_matches_engine(tiny_setup(layout, "cpu", flags), layout);
  }
}

TEST_CASE("mpi: --check-weight-hash-across-dp-replicas-interval: replicas agree after training steps, and a replica "
          "changed on one rank is named",
          "[mpi][parallel]") {
  const ParallelLayout layout = detect_parallel_layout(1);
  const int dp = layout.dp_size;
  for (const char* optimizer : {"--use-distributed-optimizer", "--no-use-distributed-optimizer"}) {
    INFO(optimizer);
    const RunSetup setup = tiny_setup(layout, "cpu", {"--fp8-hybrid", optimizer});
    TrainingEngine engine(setup, layout);
    const size_t tokens = size_t(setup.options.micro_batch_size) * size_t(setup.seq_length);
    for (int step = 0; step < 2; ++step) {
      engine.begin_step();
      const auto x = testing::tiny_tokens(tokens, 300 + 10 * step + layout.dp_rank);
      const auto y = testing::tiny_tokens(tokens, 301 + 10 * step + layout.dp_rank);
      engine.forward_backward(x.data(), y.data());
      engine.end_step(AdamWHyperparams{.lr = 3e-3f}, 1.0, step);
    }
    CHECK_NOTHROW(engine.check_replicas_agree(2));
    // The last data-parallel rank's replica moves one weight (set_parameters is rank-local).
    std::vector<float> values = engine.parameters();
    if (layout.dp_rank == dp - 1) values[values.size() / 3] += 0.25f;
    engine.set_parameters(values);
    CHECK_THROWS_WITH(engine.check_replicas_agree(2),
                      Catch::Matchers::ContainsSubstring("after iteration 2, data-parallel ranks " +
                                                         std::to_string(dp - 1) + " (") &&
                          Catch::Matchers::ContainsSubstring("hold other weights than rank 0"));
  }
}
