// The bucket index that makes the GPU embedding backward deterministic without atomics:
// the micro-batch's positions grouped by token. The host has the tokens anyway (it uploads
// them), so it builds this next to them and uploads both, with no device sync.
//
//   unique_tokens [U]     the distinct token ids, ascending
//   offsets       [U+1]   positions of unique_tokens[u] are positions[offsets[u] .. offsets[u+1])
//   positions     [P]     flat indices b*T+t, ascending within each token (P <= B*T: only
//                         the tokens of this rank's vocabulary slice [vocab_begin, vocab_end),
//                         whose ids become slice-local, token - vocab_begin)
//
// Consumed by cuda::encoder_backward (layers/encoder.h): one block per unique token sums
// its rows in ascending order, the same order as cpu::encoder_backward.
#pragma once

#include <climits>
#include <cstdint>
#include <vector>

namespace fp8lm {

struct EncoderBackwardIndex {
  std::vector<int32_t> unique_tokens;  // [U]
  std::vector<int32_t> offsets;        // [U+1]
  std::vector<int32_t> positions;      // [B*T]
  std::vector<uint64_t> sort_keys;     // [B*T] the builder's scratch, kept for reuse

  int num_unique() const { return static_cast<int>(unique_tokens.size()); }
};

// host_tokens [B,T] (host memory). Token ids must be >= 0 (checked: RuntimeError).
EncoderBackwardIndex build_encoder_backward_index(const int32_t* host_tokens, int B, int T);

// The same, reusing `index`'s storage (no allocation once it has grown to B*T): for the
// training loop, once per micro-batch. Only tokens in [vocab_begin, vocab_end) are indexed.
void build_encoder_backward_index(const int32_t* host_tokens, int B, int T, EncoderBackwardIndex& index,
                                  int vocab_begin = 0, int vocab_end = INT32_MAX);

}  // namespace fp8lm
