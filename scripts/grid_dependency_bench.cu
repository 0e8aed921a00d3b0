// What one all-to-all dependency costs on the GPU, with no work in between: the floor under a
// decoding step, which is a chain of ~240-290 of them (docs/INFERENCE.md).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/grid_dependency_bench.cu -o /tmp/gdb && /tmp/gdb
//
// 1. In one persistent kernel (two 128-thread blocks a multiprocessor, every block resident):
//    each phase, every block adds one to the phase's counter (fence, atomic) and waits until
//    the counter before it holds every block (an acquire spin, a fence, a block barrier).
// 2. The same with data: each block also reads a 1,600-value BF16 row that the phase before
//    wrote (from L2) before it signals, as a GEMM phase reads its row of A.
// 3. A chain of kernels of the same grid under programmatic dependent launch, replayed as one
//    CUDA graph: each waits for the one before (griddepcontrol.wait), then releases the next.
// Prints microseconds per dependency for each.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(call)                                                                                 \
  do {                                                                                              \
    cudaError_t e = (call);                                                                         \
    if (e != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e)); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

constexpr int kThreads = 128;
constexpr int kRowWords = 1600 / 2;  // a 1,600-value BF16 row as 32-bit words

__device__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void persistent_chain(int* counters, int phases, unsigned* rows, int with_data) {
  const int G = gridDim.x;
  unsigned sink = 0;
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {
      if (threadIdx.x == 0) {
        while (load_acquire(&counters[p - 1]) < G) {
        }
        __threadfence();
      }
      __syncthreads();
    }
    if (with_data) {
      // Read the row the phase before wrote, write this phase's.
      const unsigned* in = rows + size_t(p % 2) * kRowWords;
      for (int i = threadIdx.x; i < kRowWords; i += kThreads) sink += in[i];
      if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < kRowWords; i += kThreads) rows[size_t((p + 1) % 2) * kRowWords + i] = p + i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&counters[p], 1);
    }
  }
  if (sink == 0xFFFFFFFFu) rows[0] = sink;  // keeps the reads
}

__global__ void chained_kernel(unsigned* out) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] += 1;
}

int main() {
  int device = 0, multiprocessors = 0;
  CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const int G = 2 * multiprocessors;
  const int phases = 2000;
  int* counters = nullptr;
  unsigned* rows = nullptr;
  CHECK(cudaMalloc(&counters, phases * sizeof(int)));
  CHECK(cudaMalloc(&rows, 2 * kRowWords * sizeof(unsigned)));
  CHECK(cudaMemset(rows, 0, 2 * kRowWords * sizeof(unsigned)));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  for (int with_data = 0; with_data < 2; ++with_data) {
    float best = 1e30f;
    for (int repeat = 0; repeat < 5; ++repeat) {
      CHECK(cudaMemset(counters, 0, phases * sizeof(int)));
      void* args[] = {&counters, (void*)&phases, &rows, &with_data};
      CHECK(cudaEventRecord(start));
      CHECK(cudaLaunchCooperativeKernel((void*)persistent_chain, G, kThreads, args, 0, nullptr));
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (ms < best) best = ms;
    }
    std::printf("persistent kernel, %d blocks, %s: %.2f us per dependency\n", G,
                with_data ? "a 1,600-value row read from L2 each phase" : "no data", best * 1000.0f / phases);
  }

  // The PDL chain, captured as one graph.
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int kernels = 300;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(G);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < kernels; ++k) CHECK(cudaLaunchKernelEx(&config, chained_kernel, rows));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  float best = 1e30f;
  for (int repeat = 0; repeat < 10; ++repeat) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ms < best) best = ms;
  }
  std::printf("graph of %d kernels of %d blocks under programmatic dependent launch: %.2f us per kernel\n", kernels,
              G, best * 1000.0f / kernels);
  return 0;
}
