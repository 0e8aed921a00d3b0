#include "gpu_fixture.h"

#include <memory>

#include <mpi.h>

#include "core/check_cuda.h"
#include "core/device.h"

namespace fp8lm::testing {

namespace {

std::unique_ptr<GpuFixture> fixture;
bool decided = false;

// TP = 2 whenever the world size allows it, as in the host tests.
int tp_size_for(int world_size) { return world_size % 2 == 0 ? 2 : 1; }

}  // namespace

GpuFixture::~GpuFixture() {
  groups.reset();
  for (cudaStream_t stream : streams) {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
}

GpuFixture* gpu_fixture() {
  if (decided) return fixture.get();
  decided = true;
  int world_size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  const ParallelLayout layout = detect_parallel_layout(tp_size_for(world_size));
  const int usable_here = cuda_available() && cuda_availability().device_count >= layout.local_size ? 1 : 0;
  int usable_everywhere = 0;
  MPI_Allreduce(&usable_here, &usable_everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!usable_everywhere) return nullptr;

  CUDA_CHECK(cudaSetDevice(layout.local_rank));
  fixture = std::make_unique<GpuFixture>();
  for (cudaStream_t& stream : fixture->streams) CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cudaStream_t* s = fixture->streams;
  fixture->groups.emplace(ProcessGroups::create_gpu(layout, NcclStreams{s[0], s[1], s[2], s[3]}));
  return fixture.get();
}

void release_gpu_fixture() { fixture.reset(); }

}  // namespace fp8lm::testing
