#pragma once

#include <cstddef>
#include <memory>
#include <span>

namespace fp8lm {

// A large host array of FP32 values that many threads fill. A value-initialised std::vector
// is zeroed by one thread, page fault by page fault: for gpt-6.7b's 26.6 GB slab that pass
// alone outlasts the parallel drawing of the initial weights. zeros() lets every OpenMP
// thread touch its own pages first.
class HostValues {
 public:
  static HostValues zeros(size_t count);

  float* data() { return values_.get(); }
  const float* data() const { return values_.get(); }
  size_t size() const { return size_; }
  operator std::span<const float>() const { return {values_.get(), size_}; }

 private:
  struct FreeValues {
    void operator()(float* values) const;
  };
  std::unique_ptr<float, FreeValues> values_;
  size_t size_ = 0;
};

}  // namespace fp8lm
