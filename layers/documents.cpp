#include "layers/documents.h"

#include <cstddef>

#include "core/error.h"

namespace fp8lm {

void build_document_index(const int32_t* host_tokens, int B, int T, const DocumentMasking& masking,
                          DocumentIndex& index) {
  FP8LM_CHECK(!masking.any() || masking.end_of_document >= 0,
              "document index: --reset-attention-mask/--reset-position-ids need the end-of-document token");
  const size_t n = size_t(B) * size_t(T);
  index.starts.clear();
  index.position_ids.clear();
  index.position_offsets.clear();
  index.position_rows.clear();
  if (!masking.any()) return;

  std::vector<int32_t>& starts = masking.reset_attention_mask ? index.starts : index.position_ids;
  starts.resize(n);
  for (int b = 0; b < B; b++) {
    const int32_t* row = host_tokens + size_t(b) * T;
    int32_t* first = starts.data() + size_t(b) * T;
    int32_t start = 0;
    for (int t = 0; t < T; t++) {
      first[t] = start;
      if (row[t] == masking.end_of_document) start = t + 1;  // the next token opens a document
    }
  }
  if (!masking.reset_position_ids) return;
  if (masking.reset_attention_mask) index.position_ids = index.starts;
  std::vector<int32_t>& ids = index.position_ids;  // starts, until made positions below
  std::vector<int32_t>& offsets = index.position_offsets;
  offsets.assign(size_t(T) + 1, 0);
  for (size_t i = 0; i < n; i++) {
    ids[i] = int32_t(i % size_t(T)) - ids[i];
    offsets[size_t(ids[i]) + 1]++;
  }
  for (int p = 0; p < T; p++) offsets[size_t(p) + 1] += offsets[size_t(p)];
  // A counting sort by id keeps each id's rows in ascending order.
  index.position_rows.resize(n);
  std::vector<int32_t> next(offsets.begin(), offsets.end() - 1);
  for (size_t i = 0; i < n; i++) index.position_rows[size_t(next[size_t(ids[i])]++)] = int32_t(i);
}

}  // namespace fp8lm
