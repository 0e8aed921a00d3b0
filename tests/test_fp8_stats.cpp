// FP8 tensor statistics (--fp8-stats-interval): every statistic against hand-made tensors
// whose saturated, underflowed and subnormal elements are known, in E4M3 and E5M2, through
// the CPU backend's casts; the report's fields and summary; training runs that write the
// lines, and runs whose losses the statistics must not change by a bit.
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/fp8_statistics.h"
#include "cli_testing.h"
#include "core/fp8.h"
#include "core/fp8_stats.h"
#include "core/scaling.h"
#include "core/tensor.h"
#include "layers/layernorm.h"
#include "layers/ops.h"
#include "layers/ops_cpu.h"
#include "temp_dir.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;

namespace {

// A tensor [1, n] over host values (the CPU backend's memory is host memory).
Tensor host_tensor(std::vector<float>& values, DType dtype = DType::f32, int state = -1) {
  Tensor t;
  t.data = values.data();
  t.dtype = dtype;
  t.rows = 1;
  t.cols = int64_t(values.size());
  t.scaling_state = state;
  return t;
}

// Hand-made values with known classes, and the scale they are cast with.
struct HandMade {
  Fp8Dtype dtype;
  float scale;
  std::vector<float> values;
  uint64_t saturated, underflow, subnormal;
  float amax;
};

// E4M3: max 448, smallest normal 2^-6 = 0.015625, smallest subnormal 2^-9 = 0.001953125.
HandMade e4m3_case() {
  return {Fp8Dtype::e4m3,
          1.0f,
          {
              1000.0f, -500.0f, 465.0f,            // saturated: |x s| > 464, clipped to 448
              448.0f,                              // exactly the max: representable, not clipped
              447.0f, 440.0f, 449.0f, 464.0f,      // round to 448 without the limit (464 a tie, to even): not clipped
              1e-4f, -0.0009765625f, 1e-30f,       // underflow: below half of 2^-9 (the tie rounds to even, 0)
              0.0f, -0.0f,                         // true zeros: not underflow
              0.001f, 0.0078125f, -0.01f,          // subnormal: round to 1, 4 and 5 x 2^-9
              0.015f,                              // rounds up to 2^-6, the smallest normal: normal
              1.0f, -2.5f, 0.5f,                   // normal
          },
          3, 3, 3, 1000.0f};
}

// E5M2 with scale 2^-4: max 57344, smallest normal 2^-14, smallest subnormal 2^-16.
HandMade e5m2_case() {
  return {Fp8Dtype::e5m2,
          0.0625f,
          {
              1e7f, -1e6f, 983040.0f,              // saturated: x s = 625000, -62500, 61440 (a tie, to 65536)
              917504.0f,                           // x s = 57344, the max itself: not clipped
              912000.0f, 918000.0f, 983024.0f,     // x s = 57000, 57375, 61439: round to 57344, not clipped
              0.0001220703125f, 1e-6f,             // underflow: x s = 2^-17 (tie, to 0) and 6.25e-8
              0.0f,                                // true zero
              0.0005f, -0.0002f,                   // subnormal: x s = 3.1e-5 and -1.25e-5 (-> -2^-16)
              0.0009765625f,                       // x s = 2^-14: the smallest normal
              1.0f, -3.0f,                         // normal
          },
          3, 2, 2, 1e7f};
}

// The CPU backend with a delayed-recipe table whose state 0 has the given dtype and scale.
struct CastBench {
  Fp8RecipeConfig config;
  ScalingTable table;
  std::unique_ptr<Ops> ops = make_cpu_ops();
  std::vector<Fp8CastCounts> counts;
  explicit CastBench(Fp8Dtype dtype, float scale, ScalingRecipe recipe = ScalingRecipe::delayed)
      : config{.recipe = recipe}, table(config) {
    table.add("operand", dtype);
    table.add("other", dtype);
    table.scales() = {scale, scale};
    table.scale_invs() = {1.0f / scale, 1.0f / scale};
    table.mark_initialized();
    ops->attach_scaling(table);
    counts.resize(size_t(table.size()));
    ops->set_fp8_statistics(counts.data());
  }
  // Casts `values` into an FP8 operand of state 0 (ops.quantize, as the model casts a
  // gradient or a weight).
  std::vector<float> cast(std::vector<float> values) {
    std::vector<float> out(values.size());
    ops->quantize(host_tensor(out, dtype_of(table.dtype(0)), 0), host_tensor(values), Tensor{});
    return out;
  }
};

}  // namespace

TEST_CASE("FP8 code classes: zero, subnormal and normal codes of both formats", "[fp8-stats]") {
  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    INFO(to_string(dtype));
    int subnormals = 0;
    for (int code = 0; code < 256; ++code) {
      const float value = fp8_decode(uint8_t(code), dtype);
      INFO("code " << code << " = " << value);
      CHECK(fp8_code_is_zero(uint8_t(code)) == (value == 0.0f));
      const bool subnormal = std::isfinite(value) && value != 0.0f && std::fabs(value) < fp8_min_normal(dtype);
      CHECK(fp8_code_is_subnormal(uint8_t(code), dtype) == subnormal);
      subnormals += subnormal;
    }
    CHECK(subnormals == (dtype == Fp8Dtype::e4m3 ? 14 : 6));  // 7 or 3 mantissas, both signs
    CHECK(fp8_decode(fp8_encode(fp8_min_normal(dtype), dtype), dtype) == fp8_min_normal(dtype));
  }
}

TEST_CASE("hand-made tensors: saturated, underflowed and subnormal elements counted exactly, E4M3 and E5M2",
          "[fp8-stats]") {
  for (const HandMade& c : {e4m3_case(), e5m2_case()}) {
    INFO(to_string(c.dtype));
    CastBench bench(c.dtype, c.scale);
    const std::vector<float> quantized = bench.cast(c.values);
    const Fp8CastCounts& counts = bench.counts[0];
    CHECK(counts.elements == c.values.size());
    CHECK(counts.saturated == c.saturated);
    CHECK(counts.underflow == c.underflow);
    CHECK(counts.subnormal == c.subnormal);
    CHECK(fp8_stats_amax(counts.amax_bits) == c.amax);
    CHECK(counts.scale == c.scale);
    CHECK(bench.counts[1].elements == 0);  // another state: untouched

    // The same classes read off the quantized values the cast wrote (the CPU holds x s).
    uint64_t at_max = 0, zeros = 0, subnormals = 0;
    for (size_t i = 0; i < quantized.size(); ++i) {
      at_max += std::fabs(quantized[i]) == fp8_max(c.dtype);
      zeros += quantized[i] == 0.0f && c.values[i] != 0.0f;
      subnormals += quantized[i] != 0.0f && std::fabs(quantized[i]) < fp8_min_normal(c.dtype);
    }
    CHECK(zeros == c.underflow);
    CHECK(subnormals == c.subnormal);
    // plus the value at the max itself and those rounded to it
    CHECK(at_max == c.saturated + (c.dtype == Fp8Dtype::e4m3 ? 5 : 4));

    // A second cast adds to the same record.
    bench.cast(c.values);
    CHECK(bench.counts[0].elements == 2 * c.values.size());
    CHECK(bench.counts[0].saturated == 2 * c.saturated);
  }
}

TEST_CASE("infinities saturate and NaN counts as an element only, with a NaN amax", "[fp8-stats]") {
  CastBench bench(Fp8Dtype::e4m3, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  bench.cast({inf, -inf, 1.0f});
  CHECK(bench.counts[0].saturated == 2);
  CHECK(std::isinf(fp8_stats_amax(bench.counts[0].amax_bits)));
  bench.cast({std::nanf(""), 0.0f});
  CHECK(bench.counts[0].elements == 5);
  CHECK(bench.counts[0].saturated == 2);
  CHECK(bench.counts[0].underflow == 0);
  CHECK(bench.counts[0].subnormal == 0);
  CHECK(std::isnan(fp8_stats_amax(bench.counts[0].amax_bits)));
}

TEST_CASE("current scaling: the scale maps the tensor's amax onto fp8_max, which is not saturation",
          "[fp8-stats]") {
  CastBench bench(Fp8Dtype::e4m3, 1.0f, ScalingRecipe::tensorwise);
  bench.cast({2.0f, -1.0f, 0.5f, 1e-6f});  // scale 448 / 2 = 224: 2 -> 448 exactly
  const Fp8CastCounts& counts = bench.counts[0];
  CHECK(counts.scale == 224.0f);
  CHECK(counts.saturated == 0);  // 2 -> 448 exactly: in range
  // An amax whose FP32 scale maps it one ulp above 448 (448.00003): every element equal to the
  // amax still rounds to 448, and none was clipped.
  CastBench rounding(Fp8Dtype::e4m3, 1.0f, ScalingRecipe::tensorwise);
  const float amax = 1.0052499771118164f;
  rounding.cast({amax, -amax, amax, 0.5f});
  REQUIRE(amax * rounding.counts[0].scale > 448.0f);
  CHECK(rounding.counts[0].saturated == 0);
  CHECK(counts.underflow == 1);  // 1e-6 x 224 = 2.2e-4, below 2^-10
  CHECK(fp8_stats_amax(counts.amax_bits) == 2.0f);
  const Fp8TensorStatistics report =
      make_fp8_tensor_statistics("t", Fp8Dtype::e4m3, double(counts.elements), double(counts.saturated),
                                 double(counts.underflow), double(counts.subnormal),
                                 fp8_stats_amax(counts.amax_bits), counts.scale, 0);
  CHECK(report.scale_amax == 2.0f);  // current scaling: the amax the scale came from is this tensor's
}

TEST_CASE("nothing is counted without a counts pointer, nor while evaluating", "[fp8-stats]") {
  CastBench bench(Fp8Dtype::e4m3, 1.0f);
  bench.ops->set_amax_recording(AmaxRecording::off);  // an evaluation pass
  bench.cast({1000.0f, 1.0f});
  CHECK(bench.counts[0].elements == 0);
  bench.ops->set_amax_recording(AmaxRecording::on);
  bench.ops->set_fp8_statistics(nullptr);
  bench.cast({1000.0f, 1.0f});
  CHECK(bench.counts[0].elements == 0);
  bench.ops->set_fp8_statistics(bench.counts.data());
  bench.cast({1000.0f, 1.0f});
  CHECK(bench.counts[0].elements == 2);
  CHECK(bench.counts[0].saturated == 1);
}

TEST_CASE("the fused producers count their FP8 outputs: LayerNorm, and the weight casts of quantize_tensors",
          "[fp8-stats]") {
  const HandMade c = e4m3_case();
  CastBench bench(c.dtype, 4.0f);
  // LayerNorm into an FP8 operand: every output element counted, from the values it normalized.
  const int N = 3, C = 8;
  std::vector<float> input(N * C), weight(C, 1.0f), bias(C, 0.0f), mean(N), rstd(N), out(N * C), expected(N * C);
  for (int i = 0; i < N * C; ++i) input[i] = float((i * 37) % 11) - 5.0f;
  weight[0] = 200.0f;  // column 0 times 200 x scale 4: saturates
  LayerNormForward call;
  call.out = host_tensor(out, DType::e4m3, 0);
  call.out.rows = N;
  call.out.cols = C;
  auto matrix = [&](std::vector<float>& v, int rows, int cols) {
    Tensor t = host_tensor(v);
    t.rows = rows;
    t.cols = cols;
    return t;
  };
  call.residual_in = matrix(input, N, C);
  call.mean = matrix(mean, 1, N);
  call.rstd = matrix(rstd, 1, N);
  call.weight = matrix(weight, 1, C);
  call.bias = matrix(bias, 1, C);
  bench.ops->layernorm_forward(call);
  cpu::residual_layernorm_forward(expected.data(), nullptr, mean.data(), rstd.data(), input.data(), nullptr, nullptr,
                                  weight.data(), bias.data(), N, C, call.eps);
  Fp8CastTally tally;
  for (float x : expected) tally.add(x, x * 4.0f, fp8_encode(x * 4.0f, c.dtype), c.dtype);
  CHECK(bench.counts[0].elements == uint64_t(N * C));
  CHECK(bench.counts[0].saturated == tally.saturated);
  CHECK(tally.saturated > 0);
  CHECK(bench.counts[0].underflow == tally.underflow);
  CHECK(bench.counts[0].subnormal == tally.subnormal);

  // quantize_tensors with a state per tensor (the FP8 weight gather): each tensor's elements
  // to its state; a tensor without a state (-1) is not counted; without scale_index (FP8
  // gradient communication, per-tensor scales) nothing is.
  TensorLayout layout;
  layout.add("a", {int64_t(c.values.size())}, false);
  layout.add("b", {4}, false);
  layout.add("c", {int64_t(c.values.size())}, false);
  std::vector<float> slab(layout.total_elements(), 1000.0f);
  for (const TensorInfo* t : {&layout.tensors()[0], &layout.tensors()[2]})
    std::copy(c.values.begin(), c.values.end(), slab.begin() + ptrdiff_t(t->offset));
  std::vector<uint8_t> codes(slab.size());
  const std::unique_ptr<TensorTable> table = bench.ops->make_table(layout);
  const std::vector<int> state_of = {1, -1, 1};
  const std::vector<float> scales = {4.0f, 1.0f};  // state 1 casts with scale 1
  bench.ops->quantize_tensors(codes.data(), slab.data(), *table, scales.data(), state_of.data(), nullptr, c.dtype);
  CHECK(bench.counts[1].elements == 2 * c.values.size());
  CHECK(bench.counts[1].saturated == 2 * c.saturated);
  CHECK(bench.counts[1].underflow == 2 * c.underflow);
  CHECK(bench.counts[1].subnormal == 2 * c.subnormal);
  CHECK(bench.counts[1].scale == 1.0f);
  const uint64_t before = bench.counts[0].elements + bench.counts[1].elements;
  const std::vector<float> per_tensor_scales = {4.0f, 1.0f, 1.0f};  // without scale_index: one per tensor
  bench.ops->quantize_tensors(codes.data(), slab.data(), *table, per_tensor_scales.data(), nullptr, nullptr, c.dtype);
  CHECK(bench.counts[0].elements + bench.counts[1].elements == before);
}

TEST_CASE("a statistics record: fractions, the scale's amax, its JSON line and the log's summary", "[fp8-stats]") {
  const Fp8TensorStatistics s = make_fp8_tensor_statistics("h.3.mlp.c_fc.grad_output", Fp8Dtype::e5m2, 1000.0, 5.0,
                                                           20.0, 100.0, 3.5f, 57344.0f / 8.0f / 4.0f, 2);
  CHECK(s.saturated == 0.005);
  CHECK(s.underflow == 0.02);
  CHECK(s.subnormal == 0.1);
  CHECK(s.scale_amax == 8.0f);  // scale = 57344 / 8 / 2^2
  CHECK(compute_scale(s.scale_amax, kE5M2Max, 2, 1.0f) == s.scale);
  const nlohmann::json line = fp8_statistics_line(100, s);
  CHECK(line["iter"] == 100);
  CHECK(line["fp8_stats"] == "h.3.mlp.c_fc.grad_output");
  CHECK(line["format"] == "e5m2");
  CHECK(line["amax"].get<double>() == 3.5);
  CHECK(line["scale_amax"].get<double>() == 8.0);
  CHECK(line["saturated"].get<double>() == 0.005);
  CHECK(line["elements"].get<double>() == 1000.0);
  Fp8TensorStatistics nan_amax = s;
  nan_amax.amax = std::nanf("");
  CHECK(fp8_statistics_line(1, nan_amax)["amax"].is_null());
  CHECK(nlohmann::json::parse(fp8_statistics_line(1, nan_amax).dump())["amax"].is_null());

  std::vector<Fp8TensorStatistics> all;
  for (int i = 0; i < 5; ++i) {
    Fp8TensorStatistics t = s;
    t.name = "t" + std::to_string(i);
    t.saturated = i == 0 ? 0.0 : 0.001 * i;
    t.underflow = 0.0;
    all.push_back(t);
  }
  const std::string summary = fp8_statistics_summary(all);
  CHECK_THAT(summary, ContainsSubstring("5 tensors"));
  CHECK_THAT(summary, ContainsSubstring("saturated: t4 0.4%, t3 0.3%, t2 0.2% |"));
  CHECK_THAT(summary, ContainsSubstring("underflow: none"));
}

// ---- training runs ------------------------------------------------------------------------

namespace {

std::string run_args(const std::string& extra) {
  return "--config " + testing::source_path("configs/tiny.json") +
         " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 4"
         " --lr 3e-3 --log-interval 1 --eval-interval 0 --eval-iters 0 " +
         extra;
}

struct Metrics {
  std::vector<double> losses;
  std::vector<nlohmann::json> statistics;  // the fp8_stats lines
};

Metrics read_metrics(const std::string& path) {
  Metrics metrics;
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    const nlohmann::json json = nlohmann::json::parse(line);
    if (json.contains("fp8_stats")) {
      metrics.statistics.push_back(json);
    } else if (json.contains("loss")) {
      metrics.losses.push_back(json["loss"].get<double>());
    }
  }
  return metrics;
}

Metrics train(const testing::TempDir& dir, const std::string& name, const std::string& extra,
              std::string* output = nullptr) {
  const std::string metrics = dir.file(name + ".jsonl");
  const auto result = testing::run_fp8lm(run_args(extra) + " --metrics-file " + metrics);
  INFO("fp8lm " << extra << "\n" << result.output);
  REQUIRE(result.exit_code == 0);
  if (output) *output = result.output;
  return read_metrics(metrics);
}

// The tiny model's 2 blocks: 4 Linears x (input, weight, grad_output).
std::set<std::string> block_operands() {
  std::set<std::string> names;
  for (int layer = 0; layer < 2; ++layer)
    for (const char* linear : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"})
      for (const char* operand : {"input", "weight", "grad_output"})
        names.insert("h." + std::to_string(layer) + "." + linear + "." + operand);
  return names;
}

}  // namespace

TEST_CASE("a run with --fp8-stats-interval writes one line per FP8 operand at each interval, and a summary",
          "[fp8-stats][cpu]") {
  const testing::TempDir dir;
  std::string output;
  // A long max window, so that iteration 4's scale provably covers iteration 2's amax.
  const Metrics m = train(dir, "stats",
                          "--fp8-hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-stats-interval 2",
                          &output);
  CHECK_THAT(output, ContainsSubstring("fp8 stats: 24 tensors | saturated:"));
  CHECK_THAT(output, ContainsSubstring("| fp8-stats-interval"));
  REQUIRE(m.statistics.size() == 2 * 24);
  std::map<int, std::set<std::string>> names_at;
  std::map<std::string, nlohmann::json> at_2;
  const int C = 64, tokens = 4 * 32;  // a step: 2 micro-batches of 2 sequences of 32 tokens
  for (const nlohmann::json& line : m.statistics) {
    const std::string name = line["fp8_stats"];
    INFO(line.dump());
    const int iter = line["iter"];
    CHECK((iter == 2 || iter == 4));
    names_at[iter].insert(name);
    if (iter == 2) at_2[name] = line;
    const bool gradient = name.ends_with(".grad_output");
    CHECK(line["format"] == (gradient ? "e5m2" : "e4m3"));
    for (const char* fraction : {"saturated", "underflow", "subnormal"}) {
      CHECK(line[fraction].get<double>() >= 0.0);
      CHECK(line[fraction].get<double>() <= 1.0);
    }
    const double amax = line["amax"], scale = line["scale"], scale_amax = line["scale_amax"];
    CHECK(amax > 0.0);
    CHECK(scale > 0.0);
    const Fp8Dtype dtype = gradient ? Fp8Dtype::e5m2 : Fp8Dtype::e4m3;
    CHECK(std::fabs(compute_scale(float(scale_amax), fp8_max(dtype), 0, 1.0f) - scale) <= 1e-6 * scale);
    // Elements: the step's two micro-batches for activations and gradients, one cast of the weight.
    const double elements = line["elements"];
    if (name == "h.0.attn.c_attn.input" || name == "h.1.mlp.c_proj.grad_output") CHECK(elements == tokens * C);
    if (name == "h.0.attn.c_attn.grad_output") CHECK(elements == tokens * 3 * C);
    if (name == "h.0.mlp.c_fc.input") CHECK(elements == tokens * C);
    if (name == "h.0.mlp.c_proj.input") CHECK(elements == tokens * 4 * C);
    if (name == "h.1.mlp.c_fc.weight") CHECK(elements == 4 * C * C);
    if (name == "h.0.attn.c_attn.weight") CHECK(elements == 3 * C * C);
    // Delayed scaling: iteration 4's scale comes from a window that holds iteration 2's amax.
    if (iter == 4) CHECK(scale_amax >= at_2.at(name)["amax"].get<double>() * (1.0 - 1e-6));
  }
  CHECK(names_at[2] == block_operands());
  CHECK(names_at[4] == block_operands());
}

TEST_CASE("current scaling: every operand's scale comes from its own amax", "[fp8-stats][cpu]") {
  const testing::TempDir dir;
  // One micro-batch per step: each state is cast once per step, so its scale is that cast's.
  const Metrics m = train(dir, "tensorwise",
                          "--fp8-format e4m3 --fp8-recipe tensorwise --fp8-lm-head --global-batch-size 2 "
                          "--fp8-stats-interval 1 --train-iters 2");
  std::set<std::string> names = block_operands();
  for (const char* operand : {"lm_head.input", "lm_head.weight", "lm_head.grad_output"}) names.insert(operand);
  std::set<std::string> seen;
  for (const nlohmann::json& line : m.statistics) {
    INFO(line.dump());
    seen.insert(line["fp8_stats"].get<std::string>());
    CHECK(line["format"] == "e4m3");
    CHECK(std::fabs(line["scale_amax"].get<double>() - line["amax"].get<double>()) <=
          1e-6 * line["amax"].get<double>());
    // Only the element(s) at the amax can reach 448 (x s rounds to 448 or a float neighbour).
    CHECK(line["saturated"].get<double>() * line["elements"].get<double>() <= 8.0);
  }
  CHECK(seen == names);
  CHECK(m.statistics.size() == 2 * names.size());
}

TEST_CASE("statistics change no number: the losses are bit-identical with and without them", "[fp8-stats][cpu]") {
  const testing::TempDir dir;
  int run = 0;
  for (const char* recipe : {"--fp8-hybrid", "--fp8-hybrid --fp8-interval 2 --fp8-amax-history-len 4",
                             "--fp8-format e4m3 --fp8-recipe tensorwise --fp8-lm-head"}) {
    INFO(recipe);
    ++run;  // the metrics file is appended to: one per run
    const Metrics off = train(dir, "off" + std::to_string(run), recipe);
    const Metrics on = train(dir, "on" + std::to_string(run), std::string(recipe) + " --fp8-stats-interval 1");
    CHECK(off.statistics.empty());
    CHECK(!on.statistics.empty());
    REQUIRE(off.losses.size() == 4);
    CHECK(on.losses == off.losses);  // to the last bit
  }
}

TEST_CASE("a resumed run counts its first step's weights, and resumes bit-exactly", "[fp8-stats][cpu]") {
  const testing::TempDir dir;
  const std::string args = "--fp8-hybrid --train-iters 6";
  const Metrics straight = train(dir, "straight", args + " --save " + dir.file("straight"));
  // 3 steps without statistics, then a resumed run with them at every step from step 4 on.
  train(dir, "first", args + " --exit-interval 3 --save " + dir.file("split"));
  const Metrics resumed = train(dir, "resumed", args + " --fp8-stats-interval 1 --load " + dir.file("split") +
                                                    " --save " + dir.file("split"));
  REQUIRE(resumed.losses.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(resumed.losses[i] == straight.losses[3 + i]);
  std::map<int, std::set<std::string>> names_at;
  for (const nlohmann::json& line : resumed.statistics) names_at[line["iter"].get<int>()].insert(line["fp8_stats"]);
  CHECK(names_at.size() == 3);
  CHECK(names_at[4] == block_operands());  // the weights too: cast again, identically, to be counted
  CHECK(names_at[6] == block_operands());
  auto bytes = [](const std::string& path) {
    std::ifstream file(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(file), {});
  };
  CHECK(bytes(dir.file("straight/iter_0000006/fp8_scaling.safetensors")) ==
        bytes(dir.file("split/iter_0000006/fp8_scaling.safetensors")));
  CHECK(bytes(dir.file("straight/iter_0000006/model.safetensors")) ==
        bytes(dir.file("split/iter_0000006/model.safetensors")));
}

TEST_CASE("the flag --fp8-stats-interval is validated: not negative, and only with FP8 GEMMs", "[fp8-stats][cli]") {
  const auto bf16 = testing::run_fp8lm(run_args("--bf16 --fp8-stats-interval 2"));
  CHECK(bf16.exit_code != 0);
  CHECK_THAT(bf16.output, ContainsSubstring("--fp8-stats-interval needs --fp8-format"));
  CHECK_THAT(bf16.output, ContainsSubstring("HINT"));
  const auto negative = testing::run_fp8lm(run_args("--fp8-hybrid --fp8-stats-interval -1"));
  CHECK(negative.exit_code != 0);
  CHECK_THAT(negative.output, ContainsSubstring("--fp8-stats-interval must be >= 0 (got -1)"));
}
