// A micro-batch's documents, for Megatron's --reset-attention-mask and --reset-position-ids.
// A row of T tokens holds pieces of several documents, each ended by the end-of-document token
// (GPT-2's <|endoftext|>), which belongs to the document it ends. Megatron's rule
// (get_ltor_masks_and_position_ids): after an end-of-document token at t, positions restart at
// 0 at t + 1, and the queries from t + 1 on no longer see the keys up to t.
//
//   starts        [B*T]  each token's document's first position in its row (attention)
//   position_ids  [B*T]  t - starts[t]: the token's position in its document (wpe)
//   position_rows [B*T]  the rows b*T+t grouped by position id, ascending within each id, and
//   position_offsets [T+1]  id p's rows are position_rows[offsets[p] .. offsets[p+1])
//                         (the deterministic wpe backward: one owner per id, rows in order)
//
// The host builds the index beside the tokens it loads (Ops::load_batch); the backends upload it.
#pragma once

#include <cstdint>
#include <vector>

namespace fp8lm {

// What a run's documents change. Both flags off: nothing (one sequence per row).
struct DocumentMasking {
  int32_t end_of_document = -1;   // the token that ends a document
  bool reset_attention_mask = false;
  bool reset_position_ids = false;
  bool any() const { return reset_attention_mask || reset_position_ids; }
};

struct DocumentIndex {
  std::vector<int32_t> starts;            // [B*T], empty unless reset_attention_mask
  std::vector<int32_t> position_ids;      // [B*T], empty unless reset_position_ids
  std::vector<int32_t> position_offsets;  // [T+1], likewise
  std::vector<int32_t> position_rows;     // [B*T], likewise
};

// Fills `index` (reusing its storage) from host_tokens [B,T] for what `masking` turns on.
void build_document_index(const int32_t* host_tokens, int B, int T, const DocumentMasking& masking,
                          DocumentIndex& index);

}  // namespace fp8lm
