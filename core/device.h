// Whether a CUDA GPU is usable, asked without crashing on machines that have the CUDA
// toolkit but no GPU or driver (CI): there cudaGetDeviceCount fails with "CUDA driver
// version is insufficient for CUDA runtime version", which means "no GPU".
#pragma once

#include <cstddef>
#include <string>

namespace fp8lm {

struct CudaAvailability {
  int device_count = 0;
  std::string reason;  // why none is usable, when device_count == 0
  std::string name;    // device 0's name and compute capability, when usable
};

const CudaAvailability& cuda_availability();

// Free and total memory of CUDA device `device` (cudaMemGetInfo; creates the device's context,
// which the run creates anyway). ok is false when there is no such device.
struct DeviceMemoryInfo {
  bool ok = false;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
DeviceMemoryInfo device_memory_info(int device);
inline bool cuda_available() { return cuda_availability().device_count > 0; }

}  // namespace fp8lm
