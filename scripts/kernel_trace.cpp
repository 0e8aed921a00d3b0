// A kernel tracer for development (not part of fp8lm): preloaded into any CUDA program, it writes
// "start_ns end_ns stream name" for every kernel the process runs, and "memcpy:" and "memset:"
// rows for its copies and fills, through CUPTI's activity API (CUPTI ships with the CUDA
// toolkit). scripts/trace_steps.py reads the file.
//
//   g++ -std=c++17 -O2 -shared -fPIC -I/usr/local/cuda/include scripts/kernel_trace.cpp \
//       -L/usr/local/cuda/lib64 -L/usr/local/cuda/lib -lcupti -o build-gpu/libkernel_trace.so
//   KTRACE_OUT=step.trace LD_PRELOAD=build-gpu/libkernel_trace.so build-gpu/fp8lm --config \
//       configs/gpt2-1558m.json --mock-data --benchmark --micro-batch-size 8 ... --programmatic-launch off
//   scripts/trace_steps.py step.trace
//
// A thread forces CUPTI to hand its buffers over every 200 ms, so that a run killed at the end
// still leaves its records; the kernels of about 50 ms around each such flush are lost (device
// calls 154-156), which trace_steps.py recognises and leaves out.
#include <cupti.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

static FILE* out = nullptr;
static bool with_api = false;  // KTRACE_API=1: the runtime API calls too (stream 4294967295, "api:NAME")

static void check(CUptiResult r, const char* what) {
  if (r != CUPTI_SUCCESS) {
    const char* text = nullptr;
    cuptiGetResultString(r, &text);
    std::fprintf(stderr, "ktrace: %s: %s\n", what, text ? text : "?");
  }
}

static void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(16) << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
  *max_records = 0;
}

static void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  size_t n = 0;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      std::fprintf(out, "%llu %llu %u %s\n", static_cast<unsigned long long>(k->start),
                   static_cast<unsigned long long>(k->end), k->streamId, k->name);
      ++n;
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      std::fprintf(out, "%llu %llu %u memcpy:%u:%llu\n", static_cast<unsigned long long>(m->start),
                   static_cast<unsigned long long>(m->end), m->streamId, unsigned(m->copyKind),
                   static_cast<unsigned long long>(m->bytes));
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      std::fprintf(out, "%llu %llu %u memset:%llu\n", static_cast<unsigned long long>(m->start),
                   static_cast<unsigned long long>(m->end), m->streamId, static_cast<unsigned long long>(m->bytes));
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME && with_api) {
      // The host's calls, on the same clock: what the host waited in, and when it queued.
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const char* name = nullptr;
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
      std::fprintf(out, "%llu %llu 4294967295 api:%s\n", static_cast<unsigned long long>(a->start),
                   static_cast<unsigned long long>(a->end), name ? name : "?");
    }
  }
  std::fflush(out);
  std::free(buffer);
}

__attribute__((constructor)) static void start_trace() {
  const char* path = std::getenv("KTRACE_OUT");
  if (path == nullptr) return;
  out = std::fopen(path, "w");
  if (out == nullptr) return;
  check(cuptiActivityRegisterCallbacks(requested, completed), "register");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  with_api = std::getenv("KTRACE_API") != nullptr;
  if (with_api) check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime");
  std::thread([] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    }
  }).detach();
  std::fprintf(stderr, "ktrace: tracing kernels to %s\n", path);
}
