// A tensor-parallel rank's part of a tensor and the whole one: the run-wise copies
// (copy_part_from_full, copy_part_to_full) move every element where the element-wise
// index (detail::full_index_of_part_element) says, for every split and tensor-parallel size,
// and the parts of all ranks tile the whole tensor exactly once.
#include <algorithm>
#include <numeric>
#include <vector>

#include <catch2/catch_test_macros.hpp>

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

TEST_CASE("a rank draws only the initialisation chunks its part holds, to the same values", "[parallel][layout]") {
  // Weights of width 512 whose chunks (65,536 elements, 128 rows) each hold whole rows: a
  // rank of a row split draws only its rows' chunks; a column split needs every chunk.
  GptConfig config;
  config.n_layer = 2;
  const size_t chunk_rows = kInitChunkElements / 512;
  for (TensorSplit split : {TensorSplit::rows, TensorSplit::qkv_rows, TensorSplit::columns}) {
    for (int tp : {2, 4}) {
      const std::vector<int64_t> full_shape = {int64_t(chunk_rows * 12), 512};
      const TensorInfo part = part_info(split, full_shape, tp);
      TensorInfo whole = part;
      whole.name = "h.0.mlp.c_fc.weight";
      whole.shape = whole.full_shape;
      whole.numel = size_t(full_shape[0] * full_shape[1]);
      std::vector<float> reference(whole.numel);
      init_gpt_tensor(reference.data(), whole, 7, config, 1234);
      for (int rank = 0; rank < tp; ++rank) {
        INFO("split " << int(split) << ", tp " << tp << ", rank " << rank);
        std::vector<float> drawn(whole.numel, -100.0f);  // -100: not drawn
        init_gpt_tensor_for_part(drawn.data(), whole, 7, config, 1234, part, rank, tp);
        std::vector<float> mine(part.numel), expected(part.numel);
        copy_part_from_full(part, drawn.data(), mine.data(), rank, tp);
        copy_part_from_full(part, reference.data(), expected.data(), rank, tp);
        REQUIRE(mine == expected);
        const size_t skipped = size_t(std::count(drawn.begin(), drawn.end(), -100.0f));
        if (split == TensorSplit::columns) {
          CHECK(skipped == 0);
        } else {
          CHECK(skipped == whole.numel - whole.numel / size_t(tp));  // rows of 1/tp only
        }
      }
    }
  }
}
