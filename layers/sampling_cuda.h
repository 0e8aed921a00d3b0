// The GPU's token choice (layers/sampling.h, Ops::choose_next_tokens): one block per
// sequence over its BF16 logits row.
//
//   greedy:              the largest logit, the lowest id among ties (one pass)
//   temperature only:    p_i = exp(l_i / T - max / T) in double; the first id whose running
//                        sum, in id order, passes uniform * sum p (two passes)
//   top-k and/or top-p:  the same walk over the candidates in sorted order (logit down, id up
//                        among ties), found without sorting: a histogram of the row's 65,536
//                        possible BF16 values gives every count and probability mass in that
//                        order, scanned for the top-k cut, the nucleus and the draw; a last
//                        pass finds the id among the drawn value's ties.
//
// Plain C++ header (no kernels), usable from .cpp files compiled by g++.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "layers/sampling.h"

namespace fp8lm::cuda {

struct TokenChoiceLaunch {
  const uint16_t* logits = nullptr;  // [B, row_stride] BF16 bits
  int B = 0;
  int row_stride = 0;  // Vs
  int vocab_size = 0;  // V <= Vs: the real tokens
  SamplingOptions rule;
  int position = 0;                        // read from stored_position instead when set
  const int32_t* stored_position = nullptr;
  int32_t* next_inputs = nullptr;    // [B] the next step's tokens (load_decode_step's memory)
  int32_t* next_position = nullptr;  // [1] set to position + 1 (may be stored_position)
  DecodingTokens tokens;
};

void choose_next_tokens(const TokenChoiceLaunch& launch, cudaStream_t stream);

}  // namespace fp8lm::cuda
