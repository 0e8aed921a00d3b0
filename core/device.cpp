#include "core/device.h"

#include <cuda_runtime.h>

namespace fp8lm {

const CudaAvailability& cuda_availability() {
  static const CudaAvailability availability = [] {
    CudaAvailability result;
    int count = 0;
    cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
      result.reason = cudaGetErrorString(status);
      cudaGetLastError();  // clear the sticky error so later CPU-only code is unaffected
      return result;
    }
    if (count == 0) {
      result.reason = "no CUDA device found";
      return result;
    }
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, 0) != cudaSuccess) {
      result.reason = "cudaGetDeviceProperties failed";
      return result;
    }
    result.device_count = count;
    result.name = std::string(properties.name) + " (sm_" + std::to_string(properties.major) +
                  std::to_string(properties.minor) + ")";
    return result;
  }();
  return availability;
}

DeviceMemoryInfo device_memory_info(int device) {
  DeviceMemoryInfo info;
  if (device < 0 || device >= cuda_availability().device_count) return info;
  if (cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&info.free_bytes, &info.total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return info;
  }
  info.ok = true;
  return info;
}

}  // namespace fp8lm
