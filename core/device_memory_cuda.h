// Device memory: one owning buffer type. The engines carve their slabs (parameters,
// gradients, optimizer state, activations) out of a handful of these, one per tensor
// class, so the allocator is never called inside a training step.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "core/check_cuda.h"

namespace fp8lm::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { allocate(count); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    swap(other);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);
  }

  void allocate(size_t count) {
    if (data_) CUDA_CHECK(cudaFree(data_));
    data_ = nullptr;
    count_ = count;
    if (count) CUDA_CHECK(cudaMalloc(&data_, count * sizeof(T)));
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(const T* host, size_t count, size_t offset = 0, cudaStream_t stream = nullptr) {
    CUDA_CHECK(cudaMemcpyAsync(data_ + offset, host, count * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  void upload(const std::vector<T>& host) {
    FP8LM_CHECK(host.size() <= count_);
    CUDA_CHECK(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_) CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  void fill_bytes(int byte, cudaStream_t stream = nullptr) {
    if (count_) CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream));
  }

 private:
  void swap(DeviceBuffer& other) {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
  }
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace fp8lm::cuda
