#include "core/host_values.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include <sys/mman.h>

namespace fp8lm {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}

void HostValues::FreeValues::operator()(float* values) const { std::free(values); }

HostValues HostValues::zeros(size_t count) {
  HostValues result;
  // In 2 MiB pages where the kernel allows it: a page fault per 4 KiB was most of the time
  // of touching tens of GB.
  const size_t bytes = std::max(kHugePage, (count * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage);
  void* memory = std::aligned_alloc(kHugePage, bytes);
  if (memory == nullptr) throw std::bad_alloc();
  madvise(memory, bytes, MADV_HUGEPAGE);  // advice only: without it the pages are small
  result.values_.reset(static_cast<float*>(memory));
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
