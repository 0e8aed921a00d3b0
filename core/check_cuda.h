// Check macros for every CUDA, cuBLAS(Lt) and NCCL call. They throw RuntimeError with
// the call, file and line, so the error reaches main() and the user as one line with a
// HINT instead of a silent wrong result. No spdlog here: this header is used by .cu
// files, which nvcc compiles in C++20 where spdlog/fmt 9 do not build.
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "core/error.h"

namespace fp8lm::detail {

[[noreturn]] inline void throw_cuda_error(const char* call, const char* file, int line, const std::string& what) {
  std::string hint;
  if (what.find("out of memory") != std::string::npos) hint = "lower --micro-batch-size or --seq-length";
  if (what.find("no kernel image") != std::string::npos)
    hint = "fp8lm's kernels are built for FP8LM_CUDA_ARCHS (default 90a, Hopper); rebuild for this GPU";
  throw RuntimeError(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + what, hint);
}

}  // namespace fp8lm::detail

#define CUDA_CHECK(call)                                                                           \
  do {                                                                                             \
    cudaError_t fp8lm_cuda_status = (call);                                                        \
    if (fp8lm_cuda_status != cudaSuccess)                                                          \
      ::fp8lm::detail::throw_cuda_error(#call, __FILE__, __LINE__, cudaGetErrorString(fp8lm_cuda_status)); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                         \
  do {                                                                                             \
    cublasStatus_t fp8lm_cublas_status = (call);                                                   \
    if (fp8lm_cublas_status != CUBLAS_STATUS_SUCCESS)                                              \
      ::fp8lm::detail::throw_cuda_error(#call, __FILE__, __LINE__,                                 \
                                        std::string("cuBLAS status ") +                            \
                                            std::to_string(static_cast<int>(fp8lm_cublas_status))); \
  } while (0)

#define NCCL_CHECK(call)                                                                           \
  do {                                                                                             \
    ncclResult_t fp8lm_nccl_status = (call);                                                       \
    if (fp8lm_nccl_status != ncclSuccess)                                                          \
      ::fp8lm::detail::throw_cuda_error(#call, __FILE__, __LINE__, ncclGetErrorString(fp8lm_nccl_status)); \
  } while (0)
