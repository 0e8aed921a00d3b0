#include "layers/encoder_index.h"

#include <algorithm>
#include <cstddef>

#include "core/error.h"

namespace fp8lm {

void build_encoder_backward_index(const int32_t* host_tokens, int B, int T, EncoderBackwardIndex& index,
                                  int vocab_begin, int vocab_end) {
  FP8LM_CHECK(B >= 0 && T >= 0, "encoder index: B and T must be >= 0, got B=", B, " T=", T);
  const size_t n = static_cast<size_t>(B) * static_cast<size_t>(T);
  FP8LM_CHECK(n <= static_cast<size_t>(INT32_MAX), "encoder index: B*T=", n, " does not fit int32");
  FP8LM_CHECK(n == 0 || host_tokens != nullptr, "encoder index: null tokens");

  // Sort (token, position) pairs as one 64-bit key: token in the high half, position in
  // the low half, so equal tokens keep ascending positions.
  // Tokens of other ranks' vocabulary slices are left out; the rest become slice-local ids.
  std::vector<uint64_t>& keys = index.sort_keys;
  keys.clear();
  for (size_t i = 0; i < n; i++) {
    const int32_t token = host_tokens[i];
    FP8LM_CHECK(token >= 0, "encoder index: token ", token, " at position ", i, " is negative");
    if (token < vocab_begin || token >= vocab_end) continue;
    const uint32_t local = static_cast<uint32_t>(token - vocab_begin);
    keys.push_back((static_cast<uint64_t>(local) << 32) | static_cast<uint64_t>(i));
  }
  std::sort(keys.begin(), keys.end());

  const size_t kept = keys.size();
  index.unique_tokens.clear();
  index.offsets.clear();
  index.positions.resize(kept);
  for (size_t i = 0; i < kept; i++) {
    const int32_t token = static_cast<int32_t>(keys[i] >> 32);
    index.positions[i] = static_cast<int32_t>(keys[i] & 0xffffffffu);
    if (index.unique_tokens.empty() || index.unique_tokens.back() != token) {
      index.unique_tokens.push_back(token);
      index.offsets.push_back(static_cast<int32_t>(i));
    }
  }
  index.offsets.push_back(static_cast<int32_t>(kept));
}

EncoderBackwardIndex build_encoder_backward_index(const int32_t* host_tokens, int B, int T) {
  EncoderBackwardIndex index;
  build_encoder_backward_index(host_tokens, B, T, index);
  return index;
}

}  // namespace fp8lm
