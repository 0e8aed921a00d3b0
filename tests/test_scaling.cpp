// The scaling rules of core/scaling.h against hand-worked values.
#include <cmath>
#include <limits>

#include <catch2/catch_test_macros.hpp>

#include "core/scaling.h"

using namespace fp8lm;

TEST_CASE("compute_scale: fp8_max / amax / 2^margin", "[scaling]") {
  CHECK(compute_scale(2.0f, 448.0f, 0, 1.0f) == 224.0f);
  CHECK(compute_scale(2.0f, 448.0f, 1, 1.0f) == 112.0f);
  CHECK(compute_scale(7.0f, 57344.0f, 3, 1.0f) == 1024.0f);  // 57344/7/8
  // amax 0 or non-finite keeps the previous scale.
  CHECK(compute_scale(0.0f, 448.0f, 0, 5.0f) == 5.0f);
  CHECK(compute_scale(std::numeric_limits<float>::infinity(), 448.0f, 0, 5.0f) == 5.0f);
  CHECK(compute_scale(std::numeric_limits<float>::quiet_NaN(), 448.0f, 0, 5.0f) == 5.0f);
  // A tiny amax would overflow the scale: it is capped at FLT_MAX.
  CHECK(compute_scale(1e-40f, 448.0f, 0, 1.0f) == std::numeric_limits<float>::max());
}

TEST_CASE("delayed scaling: the window max over the history, rolled each update", "[scaling]") {
  Fp8RecipeConfig config;
  config.amax_history_len = 3;
  config.amax_compute_algo = AmaxComputeAlgo::max;
  ScalingTable table(config);
  const int x = table.add("x", Fp8Dtype::e4m3);

  // Step 0: not initialized, so quantization uses current scaling from the tensor's amax.
  CHECK(table.needs_tensor_amax(x));
  CHECK(table.scale_for(x, 4.0f) == 112.0f);
  table.record_amax(x, 4.0f);
  table.record_amax(x, 2.0f);  // a second micro-batch: running max stays 4
  table.update(0);             // window [4, 0, 0] -> amax 4 -> scale 112; roll -> [0, 0, 4]
  CHECK(table.initialized(x));
  CHECK_FALSE(table.needs_tensor_amax(x));
  CHECK(table.scale(x) == 112.0f);
  CHECK(table.scale_inv(x) == 1.0f / 112.0f);
  CHECK(table.amax_at(x, 0) == 0.0f);
  CHECK(table.amax_at(x, 2) == 4.0f);
  // Delayed: the stored scale is used whatever the tensor's amax now.
  CHECK(table.scale_for(x, 100.0f) == 112.0f);

  table.record_amax(x, 1.0f);  // [1, 0, 4]: max is still 4
  table.update(1);             // -> [0, 4, 1]
  CHECK(table.scale(x) == 112.0f);
  table.record_amax(x, 2.0f);  // [2, 4, 1]
  table.update(2);             // max 4 -> 112; roll -> [4, 1, 2], then slot 0 cleared: [0, 1, 2]
  CHECK(table.scale(x) == 112.0f);
  table.record_amax(x, 0.5f);  // [0.5, 1, 2]: the 4 has left the window
  table.update(3);
  CHECK(table.scale(x) == 224.0f);  // 448 / 2
}

TEST_CASE("delayed scaling: most_recent uses only the newest amax", "[scaling]") {
  Fp8RecipeConfig config;
  config.amax_history_len = 4;
  config.amax_compute_algo = AmaxComputeAlgo::most_recent;
  ScalingTable table(config);
  const int g = table.add("g", Fp8Dtype::e5m2);
  table.record_amax(g, 8.0f);
  table.update(0);
  CHECK(table.scale(g) == 7168.0f);  // 57344 / 8
  table.record_amax(g, 1.0f);
  table.update(1);
  CHECK(table.scale(g) == 57344.0f);
}

TEST_CASE("delayed scaling: margin and interval", "[scaling]") {
  Fp8RecipeConfig config;
  config.amax_history_len = 2;
  config.margin = 2;
  config.interval = 3;
  ScalingTable table(config);
  const int w = table.add("w", Fp8Dtype::e4m3);
  table.record_amax(w, 1.0f);
  table.update(0);  // not an interval boundary: nothing changes
  table.update(1);
  CHECK_FALSE(table.initialized(w));
  CHECK(table.scale(w) == 1.0f);
  table.update(2);  // (2+1) % 3 == 0
  CHECK(table.scale(w) == 112.0f);  // 448 / 1 / 4
}

TEST_CASE("delayed scaling: zero or non-finite amax keeps the previous scale", "[scaling]") {
  Fp8RecipeConfig config;
  config.amax_history_len = 1;
  ScalingTable table(config);
  const int x = table.add("x", Fp8Dtype::e4m3);
  table.record_amax(x, 2.0f);
  table.update(0);
  CHECK(table.scale(x) == 224.0f);
  table.update(1);  // nothing recorded: amax 0
  CHECK(table.scale(x) == 224.0f);
  table.record_amax(x, std::numeric_limits<float>::quiet_NaN());
  table.update(2);
  CHECK(table.scale(x) == 224.0f);
  // A skipped step discards what it recorded.
  table.record_amax(x, 1000.0f);
  table.discard_current_amaxes();
  table.record_amax(x, 4.0f);
  table.update(3);
  CHECK(table.scale(x) == 112.0f);
}

TEST_CASE("tensorwise scaling uses the current tensor's amax every time", "[scaling]") {
  Fp8RecipeConfig config;
  config.recipe = ScalingRecipe::tensorwise;
  ScalingTable table(config);
  const int x = table.add("x", Fp8Dtype::e4m3);
  CHECK(table.scale_for(x, 2.0f) == 224.0f);
  table.update(0);
  CHECK(table.scale_for(x, 4.0f) == 112.0f);
  CHECK(table.scale_inv(x) == 1.0f / 112.0f);
}

TEST_CASE("hybrid: forward tensors E4M3, gradients E5M2", "[scaling]") {
  CHECK(forward_dtype(Fp8Format::hybrid) == Fp8Dtype::e4m3);
  CHECK(gradient_dtype(Fp8Format::hybrid) == Fp8Dtype::e5m2);
  CHECK(gradient_dtype(Fp8Format::e4m3) == Fp8Dtype::e4m3);
}

TEST_CASE("the margin is exact for every --fp8-margin the flag accepts, 64 included", "[scaling]") {
  // The old rule divided by float(1 << margin): undefined for margin 64 (x86 then ignored the
  // margin and returned 448/amax). Margins 0 to 63 keep their old values wherever the scale is
  // a normal float: lowering 448 by 2^m before the division equals dividing after it.
  for (float amax : {3.0f, 0.37f, 1e-3f, 2e4f}) {
    for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      const float format_max = fp8_max(dtype);
      for (int margin = 0; margin <= kMaxFp8Margin; ++margin) {
        INFO("amax " << amax << " margin " << margin);
        const float scale = compute_scale(amax, format_max, margin, 1.0f);
        CHECK(scale == std::ldexp(format_max, -margin) / amax);
        if (margin < 64) CHECK(scale == format_max / amax / static_cast<float>(1ull << margin));
      }
    }
  }
  CHECK(compute_scale(1.0f, 448.0f, 64, 1.0f) == std::ldexp(448.0f, -64));

  // The delayed update and current scaling take it the same way.
  Fp8RecipeConfig config;
  config.margin = kMaxFp8Margin;
  ScalingTable table(config);
  const int x = table.add("x", Fp8Dtype::e4m3);
  CHECK(table.scale_for(x, 2.0f) == std::ldexp(224.0f, -64));  // current scaling before the first update
  table.record_amax(x, 4.0f);
  table.update(0);
  CHECK(table.scale(x) == std::ldexp(112.0f, -64));
  CHECK(table.scale_inv(x) == 1.0f / std::ldexp(112.0f, -64));
}
