// Documents inside a sequence (Megatron's --reset-position-ids and --reset-attention-mask):
// the index the host builds (layers/documents.h), the CPU reference's attention and position
// embedding over it, and the model: a document packed after others, with both flags, is
// scored and trained exactly as if it stood alone at the start of its row.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/shard_writer.h"
#include "byte_vocabulary.h"
#include "cli_testing.h"
#include "core/error.h"
#include "core/loss_mask.h"
#include "layers/attention.h"
#include "layers/documents.h"
#include "layers/encoder.h"
#include "layers/gpt.h"
#include "layers/ops_cpu.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr int32_t kEnd = 9;  // the end-of-document token of these tests' small vocabulary

std::vector<float> random_normal(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// document_starts [B,T] from each row's document lengths (each row's lengths sum to T).
std::vector<int32_t> starts_of(const std::vector<std::vector<int>>& lengths, int T) {
  std::vector<int32_t> starts;
  for (const auto& row : lengths) {
    int start = 0;
    for (int length : row) {
      starts.insert(starts.end(), size_t(length), start);
      start += length;
    }
    REQUIRE(start == T);
  }
  return starts;
}

}  // namespace

TEST_CASE("the document index follows Megatron's rule: positions restart, and attention is cut, after each "
          "end-of-document token",
          "[documents][cpu]") {
  // Megatron's get_ltor_masks_and_position_ids on these rows: an end-of-document token belongs to
  // the document it ends; the next token starts the next document at position 0.
  const int B = 2, T = 7;
  const std::vector<int32_t> tokens = {5, kEnd, 7, 8, kEnd, kEnd, 3,  // documents [0,2) [2,5) [5,6) [6,7)
                                       1, 2, 3, 4, 5, 6, kEnd};       // one document ending at the row's end
  DocumentIndex index;
  build_document_index(tokens.data(), B, T, {.end_of_document = kEnd, .reset_attention_mask = true,
                                             .reset_position_ids = true}, index);
  CHECK(index.starts == std::vector<int32_t>{0, 0, 2, 2, 2, 5, 6, 0, 0, 0, 0, 0, 0, 0});
  CHECK(index.position_ids == std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4, 5, 6});
  // Rows grouped by position id, ascending within each id.
  CHECK(index.position_offsets == std::vector<int32_t>{0, 5, 8, 10, 11, 12, 13, 14});
  CHECK(index.position_rows == std::vector<int32_t>{0, 2, 5, 6, 7, 1, 3, 8, 4, 9, 10, 11, 12, 13});

  SECTION("one flag builds only what it needs") {
    build_document_index(tokens.data(), B, T, {.end_of_document = kEnd, .reset_attention_mask = true}, index);
    CHECK(index.starts.size() == size_t(B * T));
    CHECK(index.position_ids.empty());
    CHECK(index.position_rows.empty());
    build_document_index(tokens.data(), B, T, {.end_of_document = kEnd, .reset_position_ids = true}, index);
    CHECK(index.starts.empty());
    CHECK(index.position_ids == std::vector<int32_t>{0, 1, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4, 5, 6});
    build_document_index(tokens.data(), B, T, {}, index);
    CHECK((index.starts.empty() && index.position_ids.empty() && index.position_offsets.empty()));
  }
  SECTION("the index's starts are whole documents; others are refused, naming the position") {
    build_document_index(tokens.data(), B, T, {.end_of_document = kEnd, .reset_attention_mask = true}, index);
    CHECK_NOTHROW(check_document_starts(index.starts.data(), B, T, "test"));
    std::vector<int32_t> bad = index.starts;
    bad[3] = 1;  // neither position 2's start nor 3
    CHECK_THROWS_WITH(check_document_starts(bad.data(), B, T, "test"), ContainsSubstring("document_starts[0,3] = 1"));
    bad = index.starts;
    bad[7] = 3;  // a row's first token starts its first document
    CHECK_THROWS_WITH(check_document_starts(bad.data(), B, T, "test"), ContainsSubstring("document_starts[1,0]"));
  }
}

TEST_CASE("attention over documents gives each document what it gets alone, forward and backward, bit for bit",
          "[documents][cpu]") {
  std::mt19937 rng(601);
  const int B = 2, T = 12, NH = 2, HS = 8, C = NH * HS;
  const std::vector<std::vector<int>> lengths = {{5, 1, 6}, {12}};
  const std::vector<int32_t> starts = starts_of(lengths, T);
  const std::vector<float> qkv = random_normal(size_t(B) * T * 3 * C, rng);
  const std::vector<float> dout = random_normal(size_t(B) * T * C, rng);
  std::vector<float> out(size_t(B) * T * C), lse(size_t(B) * NH * T), dqkv(qkv.size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), starts.data(), B, T, C, NH);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), starts.data(), B, T, C, NH);

  for (int b = 0; b < B; ++b) {
    int first = 0;
    for (int length : lengths[size_t(b)]) {
      INFO("row " << b << ", document [" << first << ", " << first + length << ")");
      const size_t row0 = size_t(b) * T + size_t(first);
      const std::vector<float> doc_qkv(qkv.begin() + long(row0 * 3 * C), qkv.begin() + long((row0 + length) * 3 * C));
      const std::vector<float> doc_dout(dout.begin() + long(row0 * C), dout.begin() + long((row0 + length) * C));
      std::vector<float> alone_out(size_t(length) * C), alone_lse(size_t(NH) * length), alone_dqkv(doc_qkv.size());
      cpu::attention_forward(alone_out.data(), alone_lse.data(), doc_qkv.data(), nullptr, 1, length, C, NH);
      cpu::attention_backward(alone_dqkv.data(), doc_dout.data(), doc_qkv.data(), alone_out.data(), alone_lse.data(),
                              nullptr, 1, length, C, NH);
      CHECK(std::vector<float>(out.begin() + long(row0 * C), out.begin() + long((row0 + length) * C)) == alone_out);
      CHECK(std::vector<float>(dqkv.begin() + long(row0 * 3 * C), dqkv.begin() + long((row0 + length) * 3 * C)) ==
            alone_dqkv);
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < length; ++t)
          CHECK(lse[(size_t(b) * NH + h) * T + size_t(first + t)] == alone_lse[size_t(h) * length + size_t(t)]);
      first += length;
    }
  }

  SECTION("all-zero starts are plain causal attention") {
    const std::vector<int32_t> zeros(size_t(B) * T, 0);
    std::vector<float> plain(out.size()), plain_lse(lse.size()), zero_out(out.size()), zero_lse(lse.size());
    cpu::attention_forward(plain.data(), plain_lse.data(), qkv.data(), nullptr, B, T, C, NH);
    cpu::attention_forward(zero_out.data(), zero_lse.data(), qkv.data(), zeros.data(), B, T, C, NH);
    CHECK(plain == zero_out);
    CHECK(plain_lse == zero_lse);
  }
}

TEST_CASE("the position embedding by position id: each row takes its id's row, and each id's gradient sums its "
          "rows in order",
          "[documents][cpu]") {
  std::mt19937 rng(602);
  const int T = 6, C = 8, N = 12;  // two rows of six
  const std::vector<int32_t> ids = {0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5};
  const std::vector<float> wpe = random_normal(size_t(T) * C, rng);
  const std::vector<float> tokens = random_normal(size_t(N) * C, rng);
  const std::vector<float> dout = random_normal(size_t(N) * C, rng);
  for (const int first_row : {0, 6}) {  // the whole batch, and a sequence-parallel rank's second half
    INFO("first_row " << first_row);
    const int rows = N - first_row;
    std::vector<float> out(size_t(rows) * C);
    cpu::add_position_embedding(out.data(), tokens.data(), wpe.data(), first_row, T, rows, C, ids.data());
    for (int n = 0; n < rows; ++n)
      for (int c = 0; c < C; ++c)
        CHECK(out[size_t(n) * C + c] == tokens[size_t(n) * C + c] + wpe[size_t(ids[size_t(first_row + n)]) * C + c]);

    std::vector<float> dwpe(size_t(T) * C, 0.5f), expected(size_t(T) * C, 0.0f);
    cpu::position_embedding_backward(dwpe.data(), dout.data(), first_row, T, rows, C, ids.data());
    for (int n = 0; n < rows; ++n)
      for (int c = 0; c < C; ++c) expected[size_t(ids[size_t(first_row + n)]) * C + c] += dout[size_t(n) * C + c];
    for (size_t i = 0; i < expected.size(); ++i) CHECK(dwpe[i] == 0.5f + expected[i]);
  }
}

namespace {

GptConfig small_config() {
  GptConfig c;
  c.name = "documents";
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.n_inner = 64;
  c.vocab_size = 16;
  c.n_positions = 16;
  return c;
}

struct CpuModel {
  std::unique_ptr<Ops> ops = make_cpu_ops();
  std::unique_ptr<GptModel> model;
  CpuModel(int B, int T, GemmPrecision gemm, const ActivationRecompute& recompute = {}) {
    GptPrecision precision;
    precision.gemm = gemm;
    model = std::make_unique<GptModel>(small_config(), B, T, precision, *ops, ModelParallelism{}, recompute);
    init_gpt_parameters(static_cast<float*>(model->working()), model->layout(), model->config(), 7);
    model->refresh_weight_operands();
  }
  std::vector<float> token_losses(const std::vector<int32_t>& x, const std::vector<int32_t>& y,
                                  const DocumentMasking& documents) {
    float sum = 0.0f;
    model->forward_eval(
        ops->load_batch(x.data(), y.data(), model->micro_batch_size(), model->seq_length(), model->vocab_slice(),
                        documents),
        Tensor::scalar_f32(&sum));
    const Tensor losses = model->token_losses();
    const float* values = static_cast<const float*>(losses.data);
    return std::vector<float>(values, values + x.size());
  }
  std::vector<float> gradients(const std::vector<int32_t>& x, const std::vector<int32_t>& y,
                               const DocumentMasking& documents) {
    float sum = 0.0f;
    model->zero_gradients();
    model->forward_backward(
        ops->load_batch(x.data(), y.data(), model->micro_batch_size(), model->seq_length(), model->vocab_slice(),
                        documents),
        0.125f, Tensor::scalar_f32(&sum));
    const Tensor g = model->gradients();
    const float* values = static_cast<const float*>(g.data);
    return std::vector<float>(values, values + g.numel());
  }
};

constexpr DocumentMasking kBoth{.end_of_document = kEnd, .reset_attention_mask = true, .reset_position_ids = true};

}  // namespace

TEST_CASE("a packed document with both flags scores as it does alone at the start of a row", "[documents][cpu]") {
  const int T = 12;
  // Row: document A (5 tokens, ending with the end-of-document token), then document B (7 tokens).
  const std::vector<int32_t> packed = {3, 1, 4, 1, kEnd, 2, 7, 1, 8, 2, 8, 1};
  std::vector<int32_t> targets(packed.begin() + 1, packed.end());
  targets.push_back(5);
  // Document B alone at the start of a row (the rest of the row is another document; causal
  // attention keeps it out of B's tokens).
  std::vector<int32_t> alone(packed.begin() + 5, packed.end());
  std::vector<int32_t> alone_targets(targets.begin() + 5, targets.end());
  alone.resize(T, 6);
  alone_targets.resize(T, 6);

  for (const GemmPrecision gemm : {GemmPrecision::fp32, GemmPrecision::bf16}) {
    INFO(to_string(gemm));
    CpuModel m(1, T, gemm);
    const std::vector<float> with_documents = m.token_losses(packed, targets, kBoth);
    const std::vector<float> plain_alone = m.token_losses(alone, alone_targets, {});
    for (int t = 0; t < 7; ++t) CHECK(with_documents[size_t(5 + t)] == plain_alone[size_t(t)]);
    // Document A is the row's first: the flags change nothing for it.
    const std::vector<float> plain = m.token_losses(packed, targets, {});
    for (int t = 0; t < 5; ++t) CHECK(with_documents[size_t(t)] == plain[size_t(t)]);
    // And B's tokens without the flags see A: other losses.
    bool differs = false;
    for (int t = 5; t < T; ++t) differs = differs || plain[size_t(t)] != with_documents[size_t(t)];
    CHECK(differs);

    // One flag alone: the reset positions, or the cut attention, each changes B's losses.
    const std::vector<float> positions_only =
        m.token_losses(packed, targets, {.end_of_document = kEnd, .reset_position_ids = true});
    const std::vector<float> mask_only =
        m.token_losses(packed, targets, {.end_of_document = kEnd, .reset_attention_mask = true});
    CHECK(positions_only[8] != with_documents[8]);
    CHECK(positions_only[8] != plain[8]);
    CHECK(mask_only[8] != with_documents[8]);
    CHECK(mask_only[8] != plain[8]);
  }
}

TEST_CASE("a packed row's gradients with both flags equal its documents' gradients each alone in a row",
          "[documents][cpu]") {
  const int T = 12;
  const std::vector<int32_t> packed = {3, 1, 4, 1, kEnd, 2, 7, 1, 8, 2, 8, 1};
  std::vector<int32_t> targets(packed.begin() + 1, packed.end());
  targets.push_back(5);
  // The same (context, target) pairs as two rows, each document at the start of its own row,
  // the rest of each row's targets masked (no loss, no gradient).
  std::vector<int32_t> split(2 * T, 6), split_targets(2 * T, kMaskedTarget);
  for (int t = 0; t < 5; ++t) split[size_t(t)] = packed[size_t(t)], split_targets[size_t(t)] = targets[size_t(t)];
  for (int t = 0; t < 7; ++t)
    split[size_t(T + t)] = packed[size_t(5 + t)], split_targets[size_t(T + t)] = targets[size_t(5 + t)];

  CpuModel one_row(1, T, GemmPrecision::fp32), two_rows(2, T, GemmPrecision::fp32);
  const std::vector<float> packed_gradients = one_row.gradients(packed, targets, kBoth);
  const std::vector<float> split_gradients = two_rows.gradients(split, split_targets, {});
  REQUIRE(packed_gradients.size() == split_gradients.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < packed_gradients.size(); ++i) {
    diff += std::pow(double(packed_gradients[i]) - split_gradients[i], 2);
    norm += std::pow(double(split_gradients[i]), 2);
  }
  CHECK(norm > 0.0);
  CHECK(std::sqrt(diff / norm) < 1e-6);  // the same sums, in another order across rows
}

TEST_CASE("fp8lm train and eval take --reset-position-ids and --reset-attention-mask; eval reproduces the run's "
          "validation loss with them, and the end-of-document token must be in the vocabulary",
          "[documents][eval]") {
  testing::TempDir dir;
  const testing::ByteVocabulary vocab = testing::write_byte_vocabulary(dir);  // <|endoftext|> is 257
  const std::string tokenizer = " --vocab-file " + vocab.vocab_file + " --merge-file " + vocab.merge_file;
  std::vector<std::filesystem::path> written;
  ShardWriter writer(dir.path(), "val", 1 << 20, written);
  std::vector<uint16_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t(i % 11 == 0 ? 257 : (i * 7 + i / 5) % 256);
  writer.append(tokens.data(), tokens.size());
  writer.finish();
  const std::string valid = writer.final_path(0).string(), ck = dir.file("ck"), metrics = dir.file("m.jsonl");
  const std::string kTiny = testing::source_path("configs/tiny.json");
  const std::string flags = " --reset-position-ids --reset-attention-mask";
  auto run = [](const std::string& args) {
    auto result = testing::run_fp8lm(args);
    INFO("fp8lm " << args << "\n" << result.output);
    return result;
  };
  const auto trained = run("--config " + kTiny + " --vocab-size 300 --train-data-path " + valid +
                           " --valid-data-path " + valid +
                           " --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
                           "--train-iters 4 --log-interval 2 --eval-interval 2 --eval-iters 3 --fp8-hybrid" +
                           tokenizer + flags + " --save " + ck + " --metrics-file " + metrics);
  REQUIRE(trained.exit_code == 0);
  CHECK_THAT(trained.output, ContainsSubstring("on / on (documents end at token 257)"));
  const std::vector<double> val = testing::metrics_field(metrics, "val_loss");
  REQUIRE(!val.empty());
  // eval's one JSON line's loss.
  auto eval_loss = [](const std::string& output) {
    std::istringstream lines(output);
    std::string line;
    while (std::getline(lines, line))
      if (line.rfind("{\"", 0) == 0 && nlohmann::json::parse(line).contains("loss"))
        return nlohmann::json::parse(line)["loss"].get<double>();
    return -1.0;
  };
  const auto eval = run("eval --load " + ck + " --valid-data-path " + valid + tokenizer + flags +
                        " --device cpu --log-level warn");
  REQUIRE(eval.exit_code == 0);
  CHECK(eval_loss(eval.output) == val.back());
  // The documents change what the model sees: without the flags, another loss.
  const auto whole =
      run("eval --load " + ck + " --valid-data-path " + valid + tokenizer + " --device cpu --log-level warn");
  REQUIRE(whole.exit_code == 0);
  CHECK(eval_loss(whole.output) != val.back());
  CHECK(eval_loss(whole.output) > 0.0);

  // The token outside the model: refused before any work, naming the flag.
  const auto outside = run("--config " + kTiny + " --mock-data --device cpu --train-iters 1 --reset-attention-mask");
  CHECK(outside.exit_code == 2);
  CHECK_THAT(outside.output, ContainsSubstring("--reset-attention-mask: the end-of-document token 50256"));
}

TEST_CASE("recomputed blocks keep to the documents: the same gradients, bit for bit, as without recomputation",
          "[documents][cpu][recompute]") {
  const int T = 12;
  const std::vector<int32_t> packed = {3, 1, 4, 1, kEnd, 2, 7, 1, 8, 2, 8, 1, 5, kEnd, 3, 3, 1, 2, 6, 6, kEnd, 1, 4, 2};
  std::vector<int32_t> targets(packed.begin() + 1, packed.end());
  targets.push_back(5);
  const std::vector<float> plain = CpuModel(2, T, GemmPrecision::fp8).gradients(packed, targets, kBoth);
  for (const ActivationRecompute& recompute :
       {ActivationRecompute{.method = ActivationRecompute::Method::uniform, .layers = 2},
        ActivationRecompute{.method = ActivationRecompute::Method::block, .layers = 1},
        ActivationRecompute{.layernorm = true, .mlp = true}}) {
    INFO("method " << int(recompute.method) << ", selective " << recompute.selective());
    CHECK(CpuModel(2, T, GemmPrecision::fp8, recompute).gradients(packed, targets, kBoth) == plain);
  }
  // The documents matter to these gradients.
  CHECK(CpuModel(2, T, GemmPrecision::fp8).gradients(packed, targets, {}) != plain);
}
