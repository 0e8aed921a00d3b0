#include "core/host_values.h"

#include <algorithm>

namespace fp8lm {

HostValues HostValues::zeros(size_t count) {
  HostValues result;
  result.values_.reset(new float[count]);  // uninitialised: the threads below touch it first
  result.size_ = count;
  constexpr size_t kBlock = size_t{1} << 20;
  const size_t blocks = (count + kBlock - 1) / kBlock;
  float* values = result.values_.get();
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < blocks; ++b)
    std::fill(values + b * kBlock, values + std::min(count, (b + 1) * kBlock), 0.0f);
  return result;
}

}  // namespace fp8lm
