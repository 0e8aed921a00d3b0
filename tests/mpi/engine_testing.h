// Helpers of the multi-rank engine tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/random.h"

namespace fp8lm::testing {

// n token ids of the tiny model's 256-token vocabulary, from a seed.
inline std::vector<int32_t> tiny_tokens(size_t n, uint64_t seed) {
  Random random(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(random.next_u64() % 256);
  return t;
}

}  // namespace fp8lm::testing
