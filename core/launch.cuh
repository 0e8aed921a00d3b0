// Every fp8lm kernel is launched with launch_kernel and starts with
// device::start_after_previous_kernel(): programmatic dependent launch (PDL, Hopper).
//
// Why: in stream order a kernel is launched only once its predecessor has finished and its
// writes are flushed, so each of a step's ~2,000 kernels pays a launch latency and leaves
// the multiprocessors its predecessor's last wave freed idle. With PDL the next kernel's
// blocks are placed as soon as every block of the running kernel has started; they take the
// multiprocessors as the last wave frees them and wait there.
//
// The protocol, which tests/test_kernel_launch_rules.cpp checks on the sources:
//   - start_after_previous_kernel() is the first statement of every kernel. It waits until
//     the kernel before it in the stream has completed and its writes are visible
//     (griddepcontrol.wait) - so a kernel never reads its inputs early - and then lets the
//     kernel after it be launched (griddepcontrol.launch_dependents).
//   - Because every kernel waits for its predecessor before anything else, a kernel's
//     completion implies its predecessor's, and so on up the stream: whatever ran before is
//     complete, as in plain stream order. cuBLASLt's and NCCL's kernels, copies and event
//     waits between them keep their ordinary (full) dependencies.
// With --programmatic-launch off the attribute is not set and the two instructions do
// nothing: plain stream order, the same bits. Measured (device call 132, one H100): no change
// at gpt2-1558m (long kernels, a host that runs ahead), -1% at gpt2-124m, -4 to -5% a decoding
// step (docs/PERFORMANCE.md).
#pragma once

#include <utility>

#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/launch.h"

namespace fp8lm::cuda {

namespace device {

__device__ __forceinline__ void start_after_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace device

// launch_kernel(kernel, grid, block, shared_bytes, stream, args...), with the PDL attribute when
// programmatic_launch() is on; a bad configuration throws here, at the launch site.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = programmatic_launch() ? 1 : 0;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace fp8lm::cuda
