#include "optim/grad_clip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace fp8lm {

double grad_sum_of_squares(const float* grads, const TensorLayout& layout) {
  // One work item per chunk, over all tensors, so many small tensors still spread
  // over the threads. Chunk boundaries depend only on the layout.
  struct Chunk {
    size_t begin, end;  // slab element range
  };
  std::vector<Chunk> chunks;
  for (const TensorInfo& t : layout.tensors()) {
    for (size_t start = 0; start < t.numel; start += kGradNormChunk) {
      chunks.push_back({t.offset + start, t.offset + std::min(t.numel, start + kGradNormChunk)});
    }
  }

  std::vector<double> partial(chunks.size(), 0.0);
  const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (count > 1)  // one chunk: no fork/join
  for (int64_t c = 0; c < count; ++c) {
    double sum = 0.0;
    for (size_t i = chunks[c].begin; i < chunks[c].end; ++i) {
      const double g = grads[i];
      sum += g * g;
    }
    partial[c] = sum;
  }

  double total = 0.0;
  for (double p : partial) total += p;  // fixed order: layout order, then chunk order
  return total;
}

double global_grad_norm(const float* grads, const TensorLayout& layout) {
  return std::sqrt(grad_sum_of_squares(grads, layout));
}

}  // namespace fp8lm
