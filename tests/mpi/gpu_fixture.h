// NCCL process groups shared by the [nccl] test cases: made once (NCCL's set-up takes seconds),
// released by main before MPI_Finalize.
#pragma once

#include <optional>

#include <cuda_runtime.h>

#include "parallel/process_groups.h"

namespace fp8lm::testing {

struct GpuFixture {
  cudaStream_t streams[4] = {};  // world, tp, dp, dp_background
  std::optional<ProcessGroups> groups;
  ~GpuFixture();
};

// The fixture, or nullptr when some rank has no GPU of its own. Every rank must call it together
// (the answer is agreed over MPI_COMM_WORLD, so all ranks skip alike).
GpuFixture* gpu_fixture();
void release_gpu_fixture();

}  // namespace fp8lm::testing
