// fp8lm eval end to end on the CPU: a checkpoint's evaluation reproduces the validation loss
// its training run logged (both precisions), a Hugging Face export scores as its checkpoint
// does, the JSON line parses, and bad input exits 2 naming the culprit.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/shard_writer.h"
#include "apps/checkpointing.h"
#include "core/choice_eval.h"
#include "core/mock_data.h"
#include "core/random.h"
#include "cli_testing.h"
#include "byte_vocabulary.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

using testing::TempDir;

const std::string kTiny = testing::source_path("configs/tiny.json");

testing::CommandResult run(const std::string& args) {
  auto result = testing::run_fp8lm(args);
  INFO("fp8lm " << args << "\n" << result.output);
  return result;
}

// A validation shard of 4,000 tokens below the tiny config's vocabulary of 256.
std::string write_valid_shard(const TempDir& dir) {
  std::vector<std::filesystem::path> written;
  ShardWriter writer(dir.path(), "val", 1 << 20, written);
  std::vector<uint16_t> tokens(4000);
  uint32_t state = 12345;
  for (size_t i = 0; i < tokens.size(); ++i) {
    state = state * 1664525u + 1013904223u;
    tokens[i] = uint16_t(i % 3 == 0 ? (state >> 24) : (tokens[i - 1] * 7 + 3) % 256);
  }
  writer.append(tokens.data(), tokens.size());
  writer.finish();
  return writer.final_path(0).string();
}

// The one line of output that is a JSON object with a "loss".
nlohmann::json eval_json(const std::string& output) {
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line))
    if (line.rfind("{\"", 0) == 0) {
      nlohmann::json parsed = nlohmann::json::parse(line);
      if (parsed.contains("loss")) return parsed;
    }
  FAIL("no JSON line with a loss in the output");
  return {};
}

double last_val_loss(const std::string& metrics_path) {
  std::ifstream file(metrics_path);
  std::string line;
  double loss = -1.0;
  while (std::getline(file, line)) {
    const auto parsed = nlohmann::json::parse(line);
    if (parsed.contains("val_loss")) loss = parsed["val_loss"].get<double>();
  }
  return loss;
}

}  // namespace

TEST_CASE("eval of a checkpoint reproduces the validation loss its run logged", "[eval]") {
  TempDir dir;
  const std::string valid = write_valid_shard(dir);
  for (const char* precision : {"--bf16", "--fp8-hybrid"}) {
    INFO(precision);
    const std::string ck = dir.file(std::string("ck") + precision), metrics = ck + ".jsonl";
    REQUIRE(run("--config " + kTiny + " --mock-data --valid-data-path " + valid +
                " --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
                "--train-iters 6 --log-interval 3 --eval-interval 3 --eval-iters 3 --log-level warn --save " +
                ck + " --metrics-file " + metrics + " " + precision)
                .exit_code == 0);
    const double logged = last_val_loss(metrics);
    REQUIRE(logged > 0.0);

    // The run's settings (precision, batch shape, eval-iters) are the defaults.
    const auto defaults = run("eval --load " + ck + " --valid-data-path " + valid + " --device cpu --log-level warn");
    REQUIRE(defaults.exit_code == 0);
    const nlohmann::json line = eval_json(defaults.output);
    CHECK(line["loss"].get<double>() == logged);
    CHECK(std::fabs(line["perplexity"].get<double>() - std::exp(logged)) < 1e-9 * std::exp(logged));
    CHECK(line["tokens"].get<int64_t>() == 3 * 2 * 32);
    CHECK(line["precision"] == (std::string(precision) == "--bf16" ? "bf16" : "fp8-hybrid"));
    CHECK_THAT(defaults.output, ContainsSubstring("eval: loss "));
    CHECK_THAT(defaults.output, ContainsSubstring("| perplexity "));

    // The same, spelled out.
    const auto spelled = run("eval --load " + ck + " --valid-data-path " + valid +
                             " --device cpu --log-level warn --eval-iters 3 --micro-batch-size 2 --seq-length 32 " +
                             precision);
    REQUIRE(spelled.exit_code == 0);
    CHECK(eval_json(spelled.output)["loss"].get<double>() == logged);

    // Fewer batches: a different mean, over fewer tokens.
    const auto shorter = run("eval --load " + ck + " --valid-data-path " + valid +
                             " --device cpu --log-level warn --eval-iters 1");
    REQUIRE(shorter.exit_code == 0);
    CHECK(eval_json(shorter.output)["tokens"].get<int64_t>() == 2 * 32);
  }

  // A BF16 checkpoint in the other precision scores close to it, not equal.
  const auto crossed = run("eval --load " + dir.file("ck--bf16") + " --valid-data-path " + valid +
                           " --device cpu --log-level warn --fp8-hybrid");
  REQUIRE(crossed.exit_code == 0);
  const double bf16_logged = last_val_loss(dir.file("ck--bf16.jsonl"));
  CHECK(std::fabs(eval_json(crossed.output)["loss"].get<double>() - bf16_logged) < 0.05 * bf16_logged);
}

TEST_CASE("the loss mask (--eod-mask-loss): training logs, and eval reproduces, the loss over the unmasked targets", "[eval][loss-mask]") {
  TempDir dir;
  const testing::ByteVocabulary vocab = testing::write_byte_vocabulary(dir);  // <|endoftext|> is 257
  const std::string tokenizer = " --vocab-file " + vocab.vocab_file + " --merge-file " + vocab.merge_file;
  std::vector<std::filesystem::path> written;
  ShardWriter writer(dir.path(), "val", 1 << 20, written);
  std::vector<uint16_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t(i % 37 == 0 ? 257 : (i * 7 + i / 5) % 256);
  writer.append(tokens.data(), tokens.size());
  writer.finish();
  const std::string valid = writer.final_path(0).string(), ck = dir.file("ck"), metrics = dir.file("m.jsonl");
  const std::string train = "--config " + kTiny + " --vocab-size 300 --mock-data --valid-data-path " + valid +
                            " --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
                            "--train-iters 4 --log-interval 2 --eval-interval 2 --eval-iters 3 --fp8-hybrid";
  const auto trained = run(train + tokenizer + " --eod-mask-loss --save " + ck + " --metrics-file " + metrics);
  REQUIRE(trained.exit_code == 0);
  CHECK_THAT(trained.output, ContainsSubstring("on (targets after token 257 skipped; each micro-batch's mean)"));
  const double logged = last_val_loss(metrics);
  REQUIRE(logged > 0.0);
  const auto masked = run("eval --load " + ck + " --valid-data-path " + valid + tokenizer +
                          " --eod-mask-loss --device cpu --log-level warn");
  REQUIRE(masked.exit_code == 0);
  CHECK(eval_json(masked.output)["loss"].get<double>() == logged);
  // The tokens counted: 3 batches of 2 x 32 targets, less the masked ones (one in 37 tokens).
  const int64_t counted = eval_json(masked.output)["tokens"].get<int64_t>();
  CHECK(counted < 3 * 2 * 32);
  CHECK(counted >= 3 * 2 * 32 - 3 * 2 * 2);
  // Every target counted: another mean.
  const auto unmasked = run("eval --load " + ck + " --valid-data-path " + valid + " --device cpu --log-level warn");
  REQUIRE(unmasked.exit_code == 0);
  CHECK(eval_json(unmasked.output)["loss"].get<double>() != logged);

  // The token outside the model: refused before any work.
  const auto outside = run("--config " + kTiny + " --mock-data --device cpu --train-iters 1 --eod-mask-loss");
  CHECK(outside.exit_code == 2);
  CHECK_THAT(outside.output, ContainsSubstring("--eod-mask-loss: the end-of-document token 50256 (GPT-2's "
                                               "<|endoftext|>) is outside the model's vocabulary of 256"));
  // Megatron's per-token mean runs too (its weights: tests/test_training_cpu.cpp). On the
  // masked shard, its first step's loss (the same weights and batches) is the one the mean per
  // micro-batch logs: both report the step's loss sum over its unmasked targets.
  const std::string two_steps = "--config " + kTiny + " --vocab-size 300 --train-data-path " + valid +
                                " --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
                                "--train-iters 2 --log-interval 1 --eval-iters 0 --fp8-hybrid --eod-mask-loss" +
                                tokenizer + " --metrics-file ";
  REQUIRE(run(two_steps + dir.file("micro.jsonl")).exit_code == 0);
  const auto per_token = run(two_steps + dir.file("token.jsonl") + " --calculate-per-token-loss");
  REQUIRE(per_token.exit_code == 0);
  CHECK_THAT(per_token.output, ContainsSubstring("the mean over the step's tokens, --calculate-per-token-loss"));
  CHECK(testing::metrics_losses(dir.file("token.jsonl")).front() ==
        testing::metrics_losses(dir.file("micro.jsonl")).front());
}

TEST_CASE("multiple choice (--hellaswag-path): a trained model picks the true continuation; eval reproduces the accuracy its run logged",
          "[eval][choice-eval]") {
  // 41 examples from a mock stream the training never saw: 24 tokens of context, the next 6 as
  // one ending and 6 random tokens as each of the three others, the true one at label e % 4.
  TempDir dir;
  const std::vector<uint16_t> stream = make_mock_tokens(41 * 40, 256, 999);
  Random random(5);
  std::vector<ChoiceExample> examples;
  for (int e = 0; e < 41; ++e) {
    ChoiceExample example{.index = e, .label = e % 4, .context = {}, .endings = {}};
    const auto first = stream.begin() + ptrdiff_t(e) * 40;
    example.context.assign(first, first + 24);
    for (int k = 0; k < 4; ++k) {
      std::vector<int32_t> ending(6);
      if (k == example.label)
        ending.assign(first + 24, first + 30);
      else
        for (int32_t& token : ending) token = int32_t(random.next_u64() % 256);
      example.endings.push_back(ending);
    }
    examples.push_back(example);
  }
  const std::string choices = dir.file("choices.bin"), ck = dir.file("ck"), metrics = dir.file("m.jsonl");
  write_file_durably(choices, choice_file_bytes(examples));
  const auto trained = run("--config " + kTiny + " --mock-data --device cpu --seq-length 32 --micro-batch-size 4 "
                           "--global-batch-size 4 --lr 3e-3 --train-iters 80 --log-interval 40 --eval-interval 40 "
                           "--eval-iters 0 --fp8-hybrid --hellaswag-path " + choices + " --save " + ck +
                           " --metrics-file " + metrics);
  REQUIRE(trained.exit_code == 0);
  CHECK_THAT(trained.output, ContainsSubstring("hellaswag accuracy"));
  const std::vector<double> logged = testing::metrics_field(metrics, "hellaswag_accuracy");
  REQUIRE(logged.size() == 2);  // iterations 40 and 80
  CHECK(logged.back() >= 0.8);  // chance is 0.25

  const auto scored = run("eval --load " + ck + " --hellaswag-path " + choices + " --device cpu --log-level warn");
  REQUIRE(scored.exit_code == 0);
  std::istringstream lines(scored.output);
  std::string line;
  nlohmann::json json;
  while (std::getline(lines, line))
    if (line.rfind("{\"", 0) == 0) json = nlohmann::json::parse(line);
  REQUIRE(json.contains("hellaswag_accuracy"));
  CHECK(json["hellaswag_accuracy"].get<double>() == logged.back());
  CHECK(json["hellaswag_examples"].get<int64_t>() == 41);
  CHECK_FALSE(json.contains("loss"));  // no validation data given
  CHECK_THAT(scored.output, ContainsSubstring("eval: hellaswag accuracy "));

  // Any micro-batch holds the rows: one of 1 or 3 rows splits examples over batches, and the
  // same completions score the same (a row's forward does not depend on the rows beside it).
  for (const char* rows : {"1", "3"}) {
    const auto narrow = run("eval --load " + ck + " --hellaswag-path " + choices + " --micro-batch-size " + rows +
                            " --device cpu --log-level warn");
    REQUIRE(narrow.exit_code == 0);
    CHECK_THAT(narrow.output, ContainsSubstring("\"hellaswag_correct\":" + json["hellaswag_correct"].dump()));
  }
}

TEST_CASE("eval of a Hugging Face export scores as its checkpoint does", "[eval]") {
  TempDir dir;
  const std::string valid = write_valid_shard(dir);
  const std::string ck = dir.file("ck");
  REQUIRE(run("--config " + kTiny +
              " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --train-iters 4 --eval-interval 0 "
              "--log-level warn --bf16 --save " + ck)
              .exit_code == 0);
  REQUIRE(run("convert --load " + ck + " --to " + dir.file("hf") + " --dtype fp32 --log-level warn").exit_code == 0);
  const std::string common =
      " --valid-data-path " + valid + " --device cpu --log-level warn --eval-iters 2 --micro-batch-size 2 --seq-length 32";
  const auto from_checkpoint = run("eval --load " + ck + common);
  const auto from_hf = run("eval --init-from " + dir.file("hf") + common);
  const auto from_file = run("eval --init-from " + dir.file("hf/model.safetensors") + common);
  REQUIRE(from_checkpoint.exit_code == 0);
  REQUIRE(from_hf.exit_code == 0);
  REQUIRE(from_file.exit_code == 0);
  const double expected = eval_json(from_checkpoint.output)["loss"].get<double>();
  CHECK(eval_json(from_hf.output)["loss"].get<double>() == expected);
  CHECK(eval_json(from_file.output)["loss"].get<double>() == expected);
  CHECK(eval_json(from_hf.output)["precision"] == "bf16");
}

TEST_CASE("eval: bad input exits 2 naming the flag, file or path", "[eval]") {
  TempDir dir;
  const std::string valid = write_valid_shard(dir);
  const std::string ck = dir.file("ck");
  REQUIRE(run("--config " + kTiny + " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --train-iters 1 "
              "--eval-interval 0 --log-level warn --save " + ck)
              .exit_code == 0);
  struct Case {
    std::string args;
    std::string named;
  };
  const std::string data = " --valid-data-path " + valid + " --device cpu";
  for (const Case& c : std::vector<Case>{
           {"eval --load " + ck + data + " --train-iters 5", "--train-iters"},
           {"eval --load " + ck + data + " --bogus", "--bogus"},
           {"eval" + data, "--load DIR or --init-from PATH is required"},
           {"eval --load " + ck + " --init-from " + ck + data, "--load and --init-from are alternatives"},
           {"eval --load " + ck + " --device cpu", "--valid-data-path, --data-path or --hellaswag-path is required"},
           {"eval --load " + ck + " --device cpu --valid-data-path " + dir.file("nothing*.bin"), "nothing*.bin"},
           {"eval --load " + dir.file("missing") + data, dir.file("missing")},
           {"eval --load " + ck + data + " --eval-iters 0", "--eval-iters"},
           {"eval --load " + ck + data + " --micro-batch-size x", "--micro-batch-size"},
           {"eval --load " + ck + data + " --fp8-format e5m2", "--fp8-format"},
           {"evaluate --load " + ck, "unknown subcommand 'evaluate'"},
       }) {
    const auto result = run(c.args);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.output, ContainsSubstring(c.named));
    CHECK_THAT(result.output, ContainsSubstring("fp8lm: error:"));
  }
  // --help lists the flags and exits 0.
  const auto help = run("eval --help");
  CHECK(help.exit_code == 0);
  CHECK_THAT(help.output, ContainsSubstring("--valid-data-path"));
  CHECK_THAT(help.output, ContainsSubstring("--init-from"));
}

TEST_CASE("eval of a checkpoint with BF16 first and last layers reproduces its logged loss, or takes the flags given",
          "[eval]") {
  TempDir dir;
  const std::string valid = write_valid_shard(dir);
  const std::string ck = dir.file("ck"), metrics = ck + ".jsonl";
  REQUIRE(run("--config " + kTiny + " --mock-data --valid-data-path " + valid +
              " --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --num-layers 3 "
              "--train-iters 6 --log-interval 3 --eval-interval 3 --eval-iters 3 --log-level warn --fp8-hybrid "
              "--first-last-layers-bf16 --save " + ck + " --metrics-file " + metrics)
              .exit_code == 0);
  const double logged = last_val_loss(metrics);
  REQUIRE(logged > 0.0);
  const auto defaults = run("eval --load " + ck + " --valid-data-path " + valid + " --device cpu --log-level warn");
  REQUIRE(defaults.exit_code == 0);
  CHECK(eval_json(defaults.output)["loss"].get<double>() == logged);
  // Every block in FP8 instead: another loss, close to it.
  const auto all_fp8 = run("eval --load " + ck + " --valid-data-path " + valid + " --device cpu --log-level warn "
                           "--first-last-layers-bf16 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0");
  REQUIRE(all_fp8.exit_code == 0);
  const double fp8_loss = eval_json(all_fp8.output)["loss"].get<double>();
  CHECK(fp8_loss != logged);
  CHECK(std::fabs(fp8_loss - logged) < 0.05 * logged);
}
