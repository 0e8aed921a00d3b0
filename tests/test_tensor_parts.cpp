// A tensor-parallel rank's part of a tensor and the whole one: the run-wise copies
// (copy_part_from_full, copy_part_to_full) move every element where the element-wise
// index (detail::full_index_of_part_element) says, for every split and tensor-parallel size,
// and the parts of all ranks tile the whole tensor exactly once.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <omp.h>

#include <catch2/catch_test_macros.hpp>

#include "core/random.h"
#include "layers/gpt.h"

using namespace fp8lm;

namespace {

TensorInfo part_info(TensorSplit split, std::vector<int64_t> full_shape, int tp) {
  TensorInfo info;
  info.name = "t";
  info.split = split;
  info.full_shape = full_shape;
  info.shape = full_shape;
  if (split == TensorSplit::rows || split == TensorSplit::qkv_rows) info.shape[0] /= tp;
  if (split == TensorSplit::columns) info.shape[1] /= tp;
  info.numel = 1;
  for (int64_t d : info.shape) info.numel *= size_t(d);
  return info;
}

}  // namespace

TEST_CASE("a rank's part of a tensor copies run by run as the element index places it", "[parallel][layout]") {
  struct Case {
    TensorSplit split;
    std::vector<int64_t> full_shape;
  };
  const std::vector<Case> cases = {
      {TensorSplit::replicated, {6, 8}}, {TensorSplit::rows, {8, 6}},     {TensorSplit::columns, {6, 8}},
      {TensorSplit::qkv_rows, {24, 5}},  {TensorSplit::rows, {16}},       {TensorSplit::qkv_rows, {24}},
  };
  for (const Case& c : cases) {
    for (int tp : {1, 2, 4}) {
      const TensorInfo info = part_info(c.split, c.full_shape, tp);
      size_t full_numel = 1;
      for (int64_t d : c.full_shape) full_numel *= size_t(d);
      std::vector<float> whole(full_numel);
      std::iota(whole.begin(), whole.end(), 0.0f);
      std::vector<int> covered(full_numel, 0);
      for (int rank = 0; rank < tp; ++rank) {
        INFO("split " << int(c.split) << ", tp " << tp << ", rank " << rank);
        std::vector<float> part(info.numel, -1.0f);
        copy_part_from_full(info, whole.data(), part.data(), rank, tp);
        for (size_t i = 0; i < info.numel; ++i) {
          const size_t f = detail::full_index_of_part_element(info, i, rank, tp);
          REQUIRE(part[i] == whole[f]);
          ++covered[f];
        }
        std::vector<float> back(full_numel, -1.0f);
        copy_part_to_full(info, part.data(), back.data(), rank, tp);
        for (size_t i = 0; i < info.numel; ++i)
          REQUIRE(back[detail::full_index_of_part_element(info, i, rank, tp)] == part[i]);
      }
      // Split tensors are tiled once by the ranks' parts; a replicated one is held whole by each.
      const int expected = c.split == TensorSplit::replicated ? tp : 1;
      for (size_t f = 0; f < full_numel; ++f) REQUIRE(covered[f] == expected);
    }
  }
}

TEST_CASE("a rank draws only its part of a tensor's initial values, to the same values", "[parallel][layout]") {
  GptConfig config;
  config.n_layer = 2;
  for (TensorSplit split : {TensorSplit::rows, TensorSplit::qkv_rows, TensorSplit::columns}) {
    for (int tp : {2, 4}) {
      const std::vector<int64_t> full_shape = {12 * 37, 84};  // odd run lengths: pairs straddle parts
      const TensorInfo part = part_info(split, full_shape, tp);
      TensorInfo whole = part;
      whole.name = "h.0.mlp.c_fc.weight";
      whole.shape = whole.full_shape;
      whole.numel = size_t(full_shape[0] * full_shape[1]);
      std::vector<float> reference(whole.numel);
      init_gpt_tensor(reference.data(), whole, 7, config, 1234);
      for (int rank = 0; rank < tp; ++rank) {
        INFO("split " << int(split) << ", tp " << tp << ", rank " << rank);
        std::vector<float> mine(part.numel, -100.0f), expected(part.numel);
        init_gpt_tensor_part(mine.data(), whole, 7, config, 1234, part, rank, tp);
        copy_part_from_full(part, reference.data(), expected.data(), rank, tp);
        REQUIRE(mine == expected);
      }
    }
  }
}

TEST_CASE("initial weights drawn element by element equal each stream drawn in order", "[layout]") {
  // The values the engine drew before it drew elements alone: per run of kInitStreamElements,
  // Random(seed * C1 + index * C2 + run), one number skipped, then Random::normal() per element.
  GptConfig config;
  config.n_layer = 3;
  TensorInfo t;
  t.name = "h.1.mlp.c_proj.weight";  // the residual projections' smaller std
  t.shape = t.full_shape = {3, int64_t(kInitStreamElements) + 333};
  t.numel = size_t(t.shape[0] * t.shape[1]);
  const uint64_t seed = 4321;
  const size_t index = 17;
  const double std_dev = 0.02 / std::sqrt(2.0 * config.n_layer);
  std::vector<float> expected(t.numel);
  for (size_t run = 0; run * kInitStreamElements < t.numel; ++run) {
    Random random(seed * 0x9E3779B97F4A7C15ull + index * 0xD1B54A32D192ED03ull + run);
    random.next_u64();
    for (size_t i = run * kInitStreamElements; i < std::min(t.numel, (run + 1) * kInitStreamElements); ++i)
      expected[i] = static_cast<float>(random.normal() * std_dev);
  }
  std::vector<float> drawn(t.numel);
  init_gpt_tensor(drawn.data(), t, index, config, seed);
  REQUIRE(drawn == expected);
}

TEST_CASE("initial weights: GPT-2's distributions, the same for any thread count", "[layout]") {
  GptConfig config;
  config.n_layer = 4;
  config.n_embd = 64;
  config.n_inner = 256;
  config.vocab_size = 1000;
  const TensorLayout layout = make_gpt_layout(config);
  std::vector<float> one_thread(layout.total_elements()), many(layout.total_elements());
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  init_gpt_parameters(one_thread.data(), layout, config, 99);
  omp_set_num_threads(std::max(threads, 3));
  init_gpt_parameters(many.data(), layout, config, 99);
  omp_set_num_threads(threads);
  REQUIRE(one_thread == many);

  auto moments = [&](const std::string& name, size_t rows) {
    const TensorInfo* t = layout.find(name);
    REQUIRE(t != nullptr);
    const size_t n = std::min(t->numel, rows * size_t(t->shape.back()));
    double sum = 0, squares = 0;
    for (size_t i = 0; i < n; ++i) {
      sum += many[t->offset + i];
      squares += double(many[t->offset + i]) * many[t->offset + i];
    }
    return std::pair{sum / double(n), std::sqrt(squares / double(n))};
  };
  const auto [wte_mean, wte_std] = moments("wte.weight", size_t(config.vocab_size));
  CHECK(std::fabs(wte_mean) < 1e-3);
  CHECK(std::fabs(wte_std - 0.02) < 0.02 * 0.02);
  const auto [proj_mean, proj_std] = moments("h.1.mlp.c_proj.weight", 64);
  CHECK(std::fabs(proj_std - 0.02 / std::sqrt(8.0)) < 0.02 * 0.02 / std::sqrt(8.0) * 2);
  CHECK(std::fabs(proj_mean) < 1e-3);
  // Padded vocabulary rows, biases and LayerNorm gains.
  const TensorInfo& wte = *layout.find("wte.weight");
  for (size_t i = size_t(config.vocab_size) * config.n_embd; i < wte.numel; ++i) REQUIRE(many[wte.offset + i] == 0.0f);
  const TensorInfo& bias = *layout.find("h.2.mlp.c_fc.bias");
  const TensorInfo& gain = *layout.find("h.2.ln_1.weight");
  for (size_t i = 0; i < bias.numel; ++i) REQUIRE(many[bias.offset + i] == 0.0f);
  for (size_t i = 0; i < gain.numel; ++i) REQUIRE(many[gain.offset + i] == 1.0f);
  // Another seed, other values.
  std::vector<float> other(layout.total_elements());
  init_gpt_parameters(other.data(), layout, config, 100);
  CHECK(other != many);
}
