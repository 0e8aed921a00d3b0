// Token + learned position embedding (GPT-2's "encoder").
//   out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
// BF16 on the GPU; FP32 here.
//
// Under tensor parallelism the token table is split by vocabulary (Megatron's
// VocabParallelEmbedding): each rank looks up the tokens of its slice and writes zeros for
// the others, the ranks sum their FP32 rows (so the sum is exact: one term is non-zero),
// and the position embedding is added after, to this rank's rows. Hence four pieces.
#pragma once

#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/gradient_ref.h"

namespace fp8lm::cpu {

// out [B,T,C], tokens [B,T], wte [Vp,C], wpe [maxT,C]
void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T, int C);

// Accumulates (+=) into dwte [Vp,C] and dwpe [maxT,C] from dout [B,T,C].
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B, int T, int C);

// out [N,C] = wte[tokens[n] - vocab_begin] for tokens in [vocab_begin, vocab_begin + vocab_count),
// 0 for the others. wte [vocab_count,C] (this rank's slice).
void embedding_lookup(float* out, const int32_t* tokens, const float* wte, int vocab_begin, int vocab_count, int N,
                      int C);
// out [N,C] = token_embeddings [N,C] + wpe[(first_row + n) % T]  (rows of a [B*T,C] tensor),
// or wpe[position_ids[first_row + n]] with position_ids [B*T] (each token's position in its
// document: layers/documents.h).
void add_position_embedding(float* out, const float* token_embeddings, const float* wpe, int first_row, int T, int N,
                            int C, const int32_t* position_ids = nullptr);
// dwte [vocab_count,C] += dout rows [N,C] per token of the slice, each token's rows summed in
// ascending order, then added once.
void embedding_lookup_backward(float* dwte, const float* dout, const int32_t* tokens, int vocab_begin,
                               int vocab_count, int N, int C);
// dwpe [T,C] += dout rows [N,C] (rows first_row.. of a [B*T,C] tensor) summed per position
// (or per position_ids[first_row + n]) in ascending row order, then added once.
void position_embedding_backward(float* dwpe, const float* dout, int first_row, int T, int N, int C,
                                 const int32_t* position_ids = nullptr);

}  // namespace fp8lm::cpu

// ---- GPU (layers/encoder.cu) ---------------------------------------------------------
// Requirements, checked on the host before launch (FP8LM_CHECK): C % 8 == 0; bf16
// pointers 16-byte aligned, FP32 gradients 16-byte aligned. Token ids are not checked on
// the device: they must lie in [0, Vp) (the data loader's job).
namespace fp8lm::cuda {

// out [N,C] f32 = float(wte[tokens[n] - vocab_begin]) for tokens of the slice, 0 otherwise.
// tokens [N] (device), wte [vocab_count,C].
void embedding_lookup(float* out, const int32_t* tokens, const __nv_bfloat16* wte, int vocab_begin, int vocab_count,
                      int N, int C, cudaStream_t stream);

// out [N,C] = bf16(token_embeddings [N,C] + float(wpe[(first_row + n) % T])): with the lookup
// above, bit for bit what bf16(float(wte) + float(wpe)) gives. stored_wpe_row (device,
// nullable): wpe's rows start that many rows in (a recorded decoding step's position).
// position_ids [B*T] (device, nullable): wpe[position_ids[first_row + n]] instead.
void add_position_embedding(__nv_bfloat16* out, const float* token_embeddings, const __nv_bfloat16* wpe,
                            int first_row, int T, int N, int C, cudaStream_t stream,
                            const int32_t* stored_wpe_row = nullptr, const int32_t* position_ids = nullptr);

// dwte [Vs,C] += for each unique token u (slice-local id): the sum of dout rows
// positions[offsets[u] .. offsets[u+1]) in that (ascending) order, in FP32, added once to
// the FP32 or BF16 gradient (core/gradient_ref.h). From the index of
// layers/encoder_index.h, built on the host with the tokens and uploaded with them.
void embedding_lookup_backward(GradientRef dwte, const __nv_bfloat16* dout, const int32_t* unique_tokens,
                               const int32_t* offsets, const int32_t* positions, int num_unique, int C,
                               cudaStream_t stream);

// dwpe [T,C] += for each t: the sum of dout rows n with (first_row + n) % T == t, n ascending
// (FP32, added once to the FP32 or BF16 gradient). With position_offsets [T+1] and
// position_rows [B*T] (device, layers/documents.h): the rows first_row + n whose position id
// is t, in position_rows' (ascending) order, instead.
void position_embedding_backward(GradientRef dwpe, const __nv_bfloat16* dout, int first_row, int T, int N, int C,
                                 cudaStream_t stream, const int32_t* position_offsets = nullptr,
                                 const int32_t* position_rows = nullptr);

}  // namespace fp8lm::cuda
