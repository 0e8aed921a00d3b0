// A measurement, not a check (hidden tag [.bench]): for the training GEMMs of gpt2-1558m at
// micro-batch 8 (8,192 rows), how fast is each algorithm cuBLASLt's heuristic offers against
// the first one, the one GemmEngine takes, and does it give the same bits? The answer decides
// whether choosing among the candidates by timing is worth its cost to reproducibility; and,
// sustained at the power cap, whether a short burst picks the candidate a whole step would.
//
//   build-gpu/tests/fp8lm_tests "[gemm-algorithms]"
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/check_cuda.h"
#include "tests/gpu_testing.h"

namespace {

#define BENCH_CUBLAS(call)                                                         \
  do {                                                                             \
    const cublasStatus_t status_ = (call);                                         \
    REQUIRE(status_ == CUBLAS_STATUS_SUCCESS);                                     \
  } while (0)

struct Shape {
  const char* name;
  int M, N, K;
  cudaDataType_t a_type, b_type, d_type;  // A [M,K], B [N,K], both K-contiguous
  bool fast_accum;
  bool accumulate;  // D += (wgrad into FP32 gradients)
};

// Every configuration cuBLASLt accepts for the call beyond its heuristic's: each algorithm id
// with each tile, stage count and cluster shape it lists or allows (no split-K: another
// summation order), kept when cublasLtMatmulAlgoCheck accepts it. On an H100 with cuBLASLt
// 13.1 (device call 54) that made 14 configurations in all for the forward shapes and 8 for
// dgrad and wgrad, and none was faster than the heuristic's best: the CTA-swizzling,
// custom-option and inner-shape settings, left at their defaults here, may be what others need.
std::vector<cublasLtMatmulAlgo_t> all_configs(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                                              cublasLtMatrixLayout_t ld, const Shape& s, size_t workspace_bytes) {
  std::vector<cublasLtMatmulAlgo_t> configs;
  int ids[256];
  int id_count = 0;
  if (cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, s.b_type, s.a_type, s.d_type, s.d_type, 256, ids,
                               &id_count) != CUBLAS_STATUS_SUCCESS)
    return configs;
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_2x2x1};
  for (int k = 0; k < id_count; ++k) {
    cublasLtMatmulAlgo_t base;
    if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, s.b_type, s.a_type, s.d_type, s.d_type, ids[k],
                               &base) != CUBLAS_STATUS_SUCCESS)
      continue;
    uint32_t tiles[128], stages[128];
    size_t written = 0;
    int tile_count = 1, stage_count = 1;
    tiles[0] = CUBLASLT_MATMUL_TILE_UNDEFINED;
    stages[0] = CUBLASLT_MATMUL_STAGES_UNDEFINED;
    if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, tiles, sizeof tiles, &written) ==
            CUBLAS_STATUS_SUCCESS &&
        written > 0)
      tile_count = int(written / sizeof tiles[0]);
    if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_STAGES_IDS, stages, sizeof stages, &written) ==
            CUBLAS_STATUS_SUCCESS &&
        written > 0)
      stage_count = int(written / sizeof stages[0]);
    for (int t = 0; t < tile_count; ++t)
      for (int g = 0; g < stage_count; ++g)
        for (uint16_t cluster : clusters) {
          cublasLtMatmulAlgo_t algo = base;
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tiles[t], sizeof tiles[t]);
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages[g], sizeof stages[g]);
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster);
          cublasLtMatmulHeuristicResult_t check = {};
          if (cublasLtMatmulAlgoCheck(handle, desc, la, lb, ld, ld, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
              check.state == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= workspace_bytes)
            configs.push_back(algo);
        }
  }
  return configs;
}

// The board's energy counter, power and SM clock from the NVIDIA management library, opened at
// run time: neither its header nor its stub library comes with the CUDA toolkit, and the
// driver that runs the GPU brings libnvidia-ml.so.1. Without it the readings are absent (-1).
class BoardSensors {
 public:
  BoardSensors() {
    library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(library_, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, void**)>(dlsym(library_, "nvmlDeviceGetHandleByPciBusId_v2"));
    energy_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(
        dlsym(library_, "nvmlDeviceGetTotalEnergyConsumption"));
    power_ = reinterpret_cast<int (*)(void*, unsigned*)>(dlsym(library_, "nvmlDeviceGetPowerUsage"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(library_, "nvmlDeviceGetClockInfo"));
    int cuda_device = 0;
    char bus_id[32] = {};
    if (init == nullptr || by_bus == nullptr || init() != 0 || cudaGetDevice(&cuda_device) != cudaSuccess ||
        cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, cuda_device) != cudaSuccess || by_bus(bus_id, &device_) != 0)
      device_ = nullptr;
  }
  BoardSensors(const BoardSensors&) = delete;
  BoardSensors& operator=(const BoardSensors&) = delete;
  ~BoardSensors() {
    if (library_ == nullptr) return;
    if (auto shutdown = reinterpret_cast<int (*)()>(dlsym(library_, "nvmlShutdown")); shutdown && device_) shutdown();
    dlclose(library_);
  }
  bool available() const { return device_ != nullptr; }
  double energy_joules() const {
    unsigned long long millijoules = 0;
    return device_ && energy_ && energy_(device_, &millijoules) == 0 ? 1e-3 * double(millijoules) : -1.0;
  }
  double power_watts() const {
    unsigned milliwatts = 0;
    return device_ && power_ && power_(device_, &milliwatts) == 0 ? 1e-3 * milliwatts : -1.0;
  }
  double sm_clock_mhz() const {
    constexpr int kSmClock = 1;  // NVML_CLOCK_SM
    unsigned mhz = 0;
    return device_ && clock_ && clock_(device_, kSmClock, &mhz) == 0 ? double(mhz) : -1.0;
  }

 private:
  void* library_ = nullptr;
  void* device_ = nullptr;
  int (*energy_)(void*, unsigned long long*) = nullptr;
  int (*power_)(void*, unsigned*) = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
};

// One shape's operands, descriptor and heuristic candidates, as GemmEngine arranges them:
// cuBLASLt's A is our B [N,K] (op T), its B our A [M,K] (op N).
class ShapeBench {
 public:
  ShapeBench(cublasLtHandle_t handle, const Shape& s, void* workspace, size_t workspace_bytes)
      : handle_(handle), shape_(s), workspace_(workspace), workspace_bytes_(workspace_bytes) {
    const size_t a_bytes = size_t(s.M) * s.K, b_bytes = size_t(s.N) * s.K;
    const size_t d_elem = s.d_type == CUDA_R_32F ? 4 : 2;
    d_bytes_ = size_t(s.M) * s.N * d_elem;
    CUDA_CHECK(cudaMalloc(&A_, a_bytes));
    CUDA_CHECK(cudaMalloc(&B_, b_bytes));
    CUDA_CHECK(cudaMalloc(&D_, d_bytes_));
    CUDA_CHECK(cudaMalloc(&D0_, d_bytes_));
    const auto a_host = fp8lm::testing::random_fp8_codes(a_bytes, 1);
    const auto b_host = fp8lm::testing::random_fp8_codes(b_bytes, 2);
    CUDA_CHECK(cudaMemcpy(A_, a_host.data(), a_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(B_, b_host.data(), b_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(D0_, 0, d_bytes_));
    CUDA_CHECK(cudaMalloc(&scales_, 64));
    // 16 bytes apart: cuBLASLt's FP8 kernels refuse a scale pointer that is not 16-byte aligned.
    const float host_scales[8] = {0.01f, 0, 0, 0, 0.02f, 0, 0, 0};
    CUDA_CHECK(cudaMemcpy(scales_, host_scales, sizeof host_scales, cudaMemcpyHostToDevice));

    BENCH_CUBLAS(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
    const int8_t fast = s.fast_accum ? 1 : 0;
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    const void* b_scale = scales_;
    const void* a_scale = scales_ + 4;
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale));
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la_, s.b_type, s.K, s.N, s.K));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb_, s.a_type, s.K, s.M, s.K));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&ld_, s.d_type, s.N, s.M, s.N));
    BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref_));
    BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof workspace_bytes_));
    constexpr int kRequested = 16;
    cublasLtMatmulHeuristicResult_t results[kRequested] = {};
    int returned = 0;
    BENCH_CUBLAS(
        cublasLtMatmulAlgoGetHeuristic(handle_, desc_, la_, lb_, ld_, ld_, pref_, kRequested, results, &returned));
    for (int i = 0; i < returned; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) {
        algos_.push_back(results[i].algo);
        workspace_sizes_.push_back(results[i].workspaceSize);
      }
    heuristic_count_ = algos_.size();
  }
  ShapeBench(const ShapeBench&) = delete;
  ShapeBench& operator=(const ShapeBench&) = delete;
  ~ShapeBench() {
    cublasLtMatmulPreferenceDestroy(pref_);
    cublasLtMatrixLayoutDestroy(la_);
    cublasLtMatrixLayoutDestroy(lb_);
    cublasLtMatrixLayoutDestroy(ld_);
    cublasLtMatmulDescDestroy(desc_);
    cudaFree(scales_);
    cudaFree(A_);
    cudaFree(B_);
    cudaFree(D_);
    cudaFree(D0_);
  }

  // The heuristic's candidates, then (add_all_configs) every configuration of all_configs.
  void add_all_configs() {
    for (const cublasLtMatmulAlgo_t& algo : all_configs(handle_, desc_, la_, lb_, ld_, shape_, workspace_bytes_))
      algos_.push_back(algo);
  }
  const std::vector<cublasLtMatmulAlgo_t>& algos() const { return algos_; }
  size_t heuristic_count() const { return heuristic_count_; }
  size_t workspace_size(size_t i) const { return i < workspace_sizes_.size() ? workspace_sizes_[i] : 0; }
  double flops() const { return 2.0 * shape_.M * shape_.N * shape_.K; }

  cublasStatus_t call(const cublasLtMatmulAlgo_t& algo) {
    const float alpha = 1.0f, beta = shape_.accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(handle_, desc_, &alpha, B_, la_, A_, lb_, &beta, D_, ld_, D_, ld_, &algo, workspace_,
                          workspace_bytes_, nullptr);
  }
  // One call from the zeroed output; its bytes, or empty when cuBLASLt refuses the call.
  std::vector<uint8_t> output_of(const cublasLtMatmulAlgo_t& algo) {
    CUDA_CHECK(cudaMemcpy(D_, D0_, d_bytes_, cudaMemcpyDeviceToDevice));
    if (call(algo) != CUBLAS_STATUS_SUCCESS) return {};
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> bytes(d_bytes_);
    CUDA_CHECK(cudaMemcpy(bytes.data(), D_, d_bytes_, cudaMemcpyDeviceToHost));
    return bytes;
  }
  // Mean microseconds a call over `calls` back-to-back calls; while_queued runs once they are all
  // enqueued, while the last ones still run.
  double time_us(const cublasLtMatmulAlgo_t& algo, int calls, const std::function<void()>& while_queued = {}) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaEventRecord(start));
    for (int it = 0; it < calls; ++it) BENCH_CUBLAS(call(algo));
    CUDA_CHECK(cudaEventRecord(stop));
    if (while_queued) while_queued();
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return 1000.0 * ms / calls;
  }

 private:
  cublasLtHandle_t handle_;
  Shape shape_;
  void* workspace_;
  size_t workspace_bytes_;
  size_t d_bytes_ = 0;
  void *A_ = nullptr, *B_ = nullptr, *D_ = nullptr, *D0_ = nullptr;
  float* scales_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, ld_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos_;
  std::vector<size_t> workspace_sizes_;
  size_t heuristic_count_ = 0;
};

struct AlgoConfig {
  int id = -1, tile = -1, stages = -1, splitk = -1, reduction = -1, cluster = -1;
};

AlgoConfig config_of(const cublasLtMatmulAlgo_t& algo) {
  AlgoConfig c;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &c.id, sizeof c.id, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile, sizeof c.tile, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages, sizeof c.stages, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.splitk, sizeof c.splitk, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.reduction, sizeof c.reduction,
                                       &written);
  uint16_t cluster16 = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster16, sizeof cluster16,
                                       &written);
  c.cluster = cluster16;
  return c;
}

// exhaustive: also every configuration of all_configs, with one summary line per shape.
void time_candidates(cublasLtHandle_t handle, const Shape& s, void* workspace, size_t workspace_bytes,
                     bool exhaustive = false) {
  ShapeBench bench(handle, s, workspace, workspace_bytes);
  if (exhaustive) bench.add_all_configs();
  const auto& algos = bench.algos();
  std::vector<uint8_t> first;
  double first_us = 0.0, best_us = 1e30;
  int best = -1;
  double best_heuristic_us = 1e30;
  AlgoConfig best_config;
  for (int i = 0; i < int(algos.size()); ++i) {
    const AlgoConfig config = config_of(algos[size_t(i)]);
    if (exhaustive && i > 0 && config.splitk > 1) continue;
    const std::vector<uint8_t> out = bench.output_of(algos[size_t(i)]);
    if (out.empty()) {
      if (!exhaustive) std::printf("%-22s cand %2d refused the call\n", s.name, i);
      continue;
    }
    if (i == 0) first = out;
    const bool same = out == first;
    bench.time_us(algos[size_t(i)], 3);
    const double us = bench.time_us(algos[size_t(i)], 20);
    if (i == 0) first_us = us;
    if (same && us < best_us) {
      best_us = us;
      best = i;
      best_config = config;
    }
    if (same && size_t(i) < bench.heuristic_count()) best_heuristic_us = std::min(best_heuristic_us, us);
    if (!exhaustive)
      std::printf("%-22s cand %2d tile %3d stages %3d splitk %2d red %d cluster %2d ws %8zu  %8.1f us %6.0f TFLOP/s "
                  "%s\n",
                  s.name, i, config.tile, config.stages, config.splitk, config.reduction, config.cluster,
                  bench.workspace_size(size_t(i)), us, bench.flops() / us * 1e-6, same ? "same bits" : "DIFFERENT bits");
  }
  if (exhaustive) {
    std::printf("%-22s %4zu configs: heuristic's first %.1f us, its best %.1f us; fastest with the same bits %.1f us "
                "(%.3fx the heuristic's best; algo %d tile %d stages %d cluster %d)\n",
                s.name, algos.size(), first_us, best_heuristic_us, best_us, best_heuristic_us / best_us,
                best_config.id, best_config.tile, best_config.stages, best_config.cluster);
  } else {
    std::printf("%-22s heuristic's first %.1f us; fastest with the same bits: cand %d, %.1f us (%.3fx)\n\n", s.name,
                first_us, best, best_us, first_us / best_us);
  }
}

// At gpt2-1558m the training step holds the board at its power cap (docs/PERFORMANCE.md, calls
// 157 and 164), where a GEMM's time is what its energy allows; GemmEngine's timed choice
// measures a short burst on a GPU that may not be there yet. So each candidate with the first's
// bits runs sustained: one second of the first to reach the cap, then rounds of a quarter
// second per candidate in turn, so that every candidate sees the same board. Printed: the
// burst's time (20 calls, as in time_candidates), the sustained time (median of the rounds),
// joules a call from the board's counter, the SM clock and power read while the calls run.
void sustain_candidates(cublasLtHandle_t handle, const Shape& s, void* workspace, size_t workspace_bytes,
                        const BoardSensors& sensors) {
  ShapeBench bench(handle, s, workspace, workspace_bytes);
  const auto& algos = bench.algos();
  std::vector<uint8_t> first;
  std::vector<int> kept;
  std::vector<double> burst_us;
  for (int i = 0; i < int(algos.size()); ++i) {
    if (i > 0 && config_of(algos[size_t(i)]).splitk > 1) continue;
    const std::vector<uint8_t> out = bench.output_of(algos[size_t(i)]);
    if (out.empty()) continue;
    if (i == 0) first = out;
    if (out != first) continue;
    bench.time_us(algos[size_t(i)], 3);
    kept.push_back(i);
    burst_us.push_back(bench.time_us(algos[size_t(i)], 20));
  }
  if (kept.empty()) return;
  auto calls_for = [&](size_t k, double window_us) { return std::max(1, int(window_us / burst_us[k])); };
  bench.time_us(algos[size_t(kept[0])], calls_for(0, 1e6));
  constexpr int kRounds = 4;
  const size_t n = kept.size();
  std::vector<std::vector<double>> sustained(n);
  std::vector<double> joules(n, 0.0), calls(n, 0.0), clock_sum(n, 0.0), power_sum(n, 0.0);
  for (int round = 0; round < kRounds; ++round)
    for (size_t k = 0; k < n; ++k) {
      const int count = calls_for(k, 2.5e5);
      double clock = -1.0, power = -1.0;
      const double before = sensors.energy_joules();
      sustained[k].push_back(bench.time_us(algos[size_t(kept[k])], count, [&] {
        clock = sensors.sm_clock_mhz();
        power = sensors.power_watts();
      }));
      joules[k] += sensors.energy_joules() - before;
      calls[k] += count;
      clock_sum[k] += clock;
      power_sum[k] += power;
    }
  size_t burst_best = 0, sustained_best = 0;
  std::vector<double> median(n);
  for (size_t k = 0; k < n; ++k) {
    std::vector<double> sorted = sustained[k];
    std::sort(sorted.begin(), sorted.end());
    median[k] = 0.5 * (sorted[(kRounds - 1) / 2] + sorted[kRounds / 2]);
    if (burst_us[k] < burst_us[burst_best]) burst_best = k;
    if (median[k] < median[sustained_best]) sustained_best = k;
  }
  for (size_t k = 0; k < n; ++k) {
    const AlgoConfig c = config_of(algos[size_t(kept[k])]);
    std::printf("%-22s cand %2d tile %3d stages %3d cluster %2d  burst %7.1f us  sustained %7.1f us (%.3fx) %5.0f "
                "TFLOP/s  %7.4f J a call  %4.0f MHz %4.0f W\n",
                s.name, kept[k], c.tile, c.stages, c.cluster, burst_us[k], median[k], median[k] / burst_us[k],
                bench.flops() / median[k] * 1e-6, sensors.available() ? joules[k] / calls[k] : -1.0,
                clock_sum[k] / kRounds, power_sum[k] / kRounds);
  }
  std::printf("%-22s fastest in a burst: cand %d, sustained %.1f us; fastest sustained: cand %d, %.1f us (%.3fx)\n\n",
              s.name, kept[burst_best], median[burst_best], kept[sustained_best], median[sustained_best],
              median[burst_best] / median[sustained_best]);
}

// The twelve FP8 GEMMs of a gpt2-1558m training step at micro-batch 8 (8,192 rows).
std::vector<Shape> training_shapes() {
  const int rows = 8192, C = 1600;
  const cudaDataType_t e4m3 = CUDA_R_8F_E4M3, e5m2 = CUDA_R_8F_E5M2, bf16 = CUDA_R_16BF, f32 = CUDA_R_32F;
  return {
      {"fwd c_attn", rows, 3 * C, C, e4m3, e4m3, bf16, true, false},
      {"fwd attn.c_proj", rows, C, C, e4m3, e4m3, bf16, true, false},
      {"fwd c_fc", rows, 4 * C, C, e4m3, e4m3, bf16, true, false},
      {"fwd mlp.c_proj", rows, C, 4 * C, e4m3, e4m3, bf16, true, false},
      {"dgrad c_attn", rows, C, 3 * C, e5m2, e4m3, bf16, false, false},
      {"dgrad attn.c_proj", rows, C, C, e5m2, e4m3, bf16, false, false},
      {"dgrad c_fc", rows, C, 4 * C, e5m2, e4m3, bf16, false, false},
      {"dgrad mlp.c_proj", rows, 4 * C, C, e5m2, e4m3, bf16, false, false},
      {"wgrad c_attn", 3 * C, C, rows, e5m2, e4m3, f32, false, true},
      {"wgrad attn.c_proj", C, C, rows, e5m2, e4m3, f32, false, true},
      {"wgrad c_fc", 4 * C, C, rows, e5m2, e4m3, f32, false, true},
      {"wgrad mlp.c_proj", C, 4 * C, rows, e5m2, e4m3, f32, false, true},
  };
}

// A cuBLASLt handle and the 32 MiB workspace every bench gives its candidates.
struct BenchContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  BenchContext() {
    BENCH_CUBLAS(cublasLtCreate(&handle));
    CUDA_CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
  }
  BenchContext(const BenchContext&) = delete;
  BenchContext& operator=(const BenchContext&) = delete;
  ~BenchContext() {
    cudaFree(workspace);
    cublasLtDestroy(handle);
  }
};

// Times every training shape's candidates (exhaustive: and every configuration).
void time_training_shapes(bool exhaustive) {
  const BenchContext bench;
  for (const Shape& s : training_shapes())
    time_candidates(bench.handle, s, bench.workspace, BenchContext::kWorkspaceBytes, exhaustive);
}

}  // namespace

TEST_CASE("cuBLASLt's candidate algorithms for gpt2-1558m's training GEMMs, timed", "[gemm-algorithms][.bench][gpu]") {
  FP8LM_REQUIRE_GPU();
  time_training_shapes(/*exhaustive=*/false);
}

TEST_CASE("every cuBLASLt configuration for gpt2-1558m's training GEMMs, timed",
          "[gemm-algorithms-exhaustive][.bench][gpu]") {
  FP8LM_REQUIRE_GPU();
  time_training_shapes(/*exhaustive=*/true);
}

TEST_CASE("gpt2-1558m's training GEMMs' candidates sustained at the power cap", "[gemm-sustained][.bench][gpu]") {
  FP8LM_REQUIRE_GPU();
  const BenchContext bench;
  const BoardSensors sensors;
  if (!sensors.available()) std::printf("no NVML: energy, clock and power are not read\n");
  for (const Shape& s : training_shapes())
    sustain_candidates(bench.handle, s, bench.workspace, BenchContext::kWorkspaceBytes, sensors);
}

// Transformer Engine keeps split accumulation (FP32 promotion of the tensor cores' partial sums)
// in the backward GEMMs and fast accumulation only in the forward, as fp8lm does. What would
// fast accumulation save in the backward? Each of gpt2-1558m's dgrad and wgrad shapes, the
// heuristic's candidates both ways.
TEST_CASE("gpt2-1558m's backward GEMMs with fast accumulation against split accumulation, timed",
          "[gemm-fast-accumulation][.bench][gpu]") {
  FP8LM_REQUIRE_GPU();
  const BenchContext bench;
  for (const Shape& s : training_shapes()) {
    if (s.fast_accum) continue;  // the forward's already are
    const std::string fast_name = std::string(s.name) + " fast";
    Shape fast = s;
    fast.name = fast_name.c_str();
    fast.fast_accum = true;
    time_candidates(bench.handle, s, bench.workspace, BenchContext::kWorkspaceBytes, /*exhaustive=*/false);
    time_candidates(bench.handle, fast, bench.workspace, BenchContext::kWorkspaceBytes, /*exhaustive=*/false);
  }
}
