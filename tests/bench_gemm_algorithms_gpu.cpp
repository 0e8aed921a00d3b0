// A measurement, not a check (hidden tag [.bench]): for the training GEMMs of gpt2-1558m at
// micro-batch 8 (8,192 rows), how fast is each algorithm cuBLASLt's heuristic offers against
// the first one, the one GemmEngine takes, and does it give the same bits? The answer decides
// whether choosing among the candidates by timing is worth its cost to reproducibility.
//
//   build-gpu/tests/fp8lm_tests "[gemm-algorithms]"
#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
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

// exhaustive: also every configuration of all_configs, with one summary line per shape.
void time_candidates(cublasLtHandle_t handle, const Shape& s, void* workspace, size_t workspace_bytes,
                     bool exhaustive = false) {
  const size_t a_bytes = size_t(s.M) * s.K, b_bytes = size_t(s.N) * s.K;
  const size_t d_elem = s.d_type == CUDA_R_32F ? 4 : 2, d_bytes = size_t(s.M) * s.N * d_elem;
  void *A = nullptr, *B = nullptr, *D = nullptr, *D0 = nullptr;
  CUDA_CHECK(cudaMalloc(&A, a_bytes));
  CUDA_CHECK(cudaMalloc(&B, b_bytes));
  CUDA_CHECK(cudaMalloc(&D, d_bytes));
  CUDA_CHECK(cudaMalloc(&D0, d_bytes));
  const auto a_host = fp8lm::testing::random_fp8_codes(a_bytes, 1);
  const auto b_host = fp8lm::testing::random_fp8_codes(b_bytes, 2);
  CUDA_CHECK(cudaMemcpy(A, a_host.data(), a_bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(B, b_host.data(), b_bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(D0, 0, d_bytes));
  float* scales = nullptr;
  CUDA_CHECK(cudaMalloc(&scales, 64));
  // 16 bytes apart: cuBLASLt's FP8 kernels refuse a scale pointer that is not 16-byte aligned.
  const float host_scales[8] = {0.01f, 0, 0, 0, 0.02f, 0, 0, 0};
  CUDA_CHECK(cudaMemcpy(scales, host_scales, sizeof host_scales, cudaMemcpyHostToDevice));

  // GemmEngine's arrangement: cuBLASLt's A is our B [N,K] (op T), its B our A [M,K] (op N).
  cublasLtMatmulDesc_t desc;
  BENCH_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  const int8_t fast = s.fast_accum ? 1 : 0;
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  const void* b_scale = scales;
  const void* a_scale = scales + 4;
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale));
  BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale));
  cublasLtMatrixLayout_t la, lb, ld;
  BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la, s.b_type, s.K, s.N, s.K));
  BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb, s.a_type, s.K, s.M, s.K));
  BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&ld, s.d_type, s.N, s.M, s.N));
  cublasLtMatmulPreference_t pref;
  BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                    sizeof workspace_bytes));
  constexpr int kRequested = 16;
  cublasLtMatmulHeuristicResult_t results[kRequested] = {};
  int returned = 0;
  BENCH_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, kRequested, results, &returned));
  std::vector<cublasLtMatmulAlgo_t> algos;
  std::vector<size_t> workspace_sizes;  // of the heuristic's candidates
  for (int i = 0; i < returned; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) {
      algos.push_back(results[i].algo);
      workspace_sizes.push_back(results[i].workspaceSize);
    }
  const size_t heuristic_count = algos.size();
  if (exhaustive)
    for (const cublasLtMatmulAlgo_t& algo : all_configs(handle, desc, la, lb, ld, s, workspace_bytes))
      algos.push_back(algo);

  const float alpha = 1.0f, beta = s.accumulate ? 1.0f : 0.0f;
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<uint8_t> first(d_bytes), out(d_bytes);
  double first_us = 0.0, best_us = 1e30;
  int best = -1;
  const double flops = 2.0 * s.M * s.N * s.K;
  double best_heuristic_us = 1e30;
  int best_cluster = -1, best_tile = -1, best_stages = -1, best_id = -1;
  for (int i = 0; i < int(algos.size()); ++i) {
    const cublasLtMatmulAlgo_t* algo = &algos[size_t(i)];
    int tile = -1, stages = -1, splitk = -1, reduction = -1, cluster = -1, id = -1;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &written);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &written);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &written);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &written);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction, sizeof reduction,
                                         &written);
    uint16_t cluster16 = 0;
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster16, sizeof cluster16,
                                         &written);
    cluster = cluster16;
    if (exhaustive && i > 0 && splitk > 1) continue;
    // One call from the zeroed output, for the bits; then the timing.
    CUDA_CHECK(cudaMemcpy(D, D0, d_bytes, cudaMemcpyDeviceToDevice));
    const cublasStatus_t status = cublasLtMatmul(handle, desc, &alpha, B, la, A, lb, &beta, D, ld, D, ld, algo,
                                                 workspace, workspace_bytes, nullptr);
    if (status != CUBLAS_STATUS_SUCCESS) {
      if (!exhaustive) std::printf("%-22s cand %2d refused the call (status %d)\n", s.name, i, int(status));
      continue;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(i == 0 ? first.data() : out.data(), D, d_bytes, cudaMemcpyDeviceToHost));
    const bool same = i == 0 || std::memcmp(first.data(), out.data(), d_bytes) == 0;
    for (int w = 0; w < 3; ++w)
      BENCH_CUBLAS(cublasLtMatmul(handle, desc, &alpha, B, la, A, lb, &beta, D, ld, D, ld, algo, workspace,
                                  workspace_bytes, nullptr));
    constexpr int kIterations = 20;
    CUDA_CHECK(cudaEventRecord(start));
    for (int it = 0; it < kIterations; ++it)
      BENCH_CUBLAS(cublasLtMatmul(handle, desc, &alpha, B, la, A, lb, &beta, D, ld, D, ld, algo, workspace,
                                  workspace_bytes, nullptr));
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const double us = 1000.0 * ms / kIterations;
    if (i == 0) first_us = us;
    if (same && us < best_us) {
      best_us = us;
      best = i;
      best_cluster = cluster;
      best_tile = tile;
      best_stages = stages;
      best_id = id;
    }
    if (same && size_t(i) < heuristic_count) best_heuristic_us = std::min(best_heuristic_us, us);
    if (!exhaustive)
      std::printf("%-22s cand %2d tile %3d stages %3d splitk %2d red %d cluster %2d ws %8zu  %8.1f us %6.0f TFLOP/s "
                  "%s\n",
                  s.name, i, tile, stages, splitk, reduction, cluster, workspace_sizes[size_t(i)], us,
                  flops / us * 1e-6, same ? "same bits" : "DIFFERENT bits");
  }
  if (exhaustive) {
    std::printf("%-22s %4zu configs: heuristic's first %.1f us, its best %.1f us; fastest with the same bits %.1f us "
                "(%.3fx the heuristic's best; algo %d tile %d stages %d cluster %d)\n",
                s.name, algos.size(), first_us, best_heuristic_us, best_us, best_heuristic_us / best_us, best_id,
                best_tile, best_stages, best_cluster);
  } else {
    std::printf("%-22s heuristic's first %.1f us; fastest with the same bits: cand %d, %.1f us (%.3fx)\n\n", s.name,
                first_us, best, best_us, first_us / best_us);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  cudaFree(scales);
  cudaFree(A);
  cudaFree(B);
  cudaFree(D);
  cudaFree(D0);
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

// Times every training shape's candidates (exhaustive: and every configuration).
void time_training_shapes(bool exhaustive) {
  cublasLtHandle_t handle;
  BENCH_CUBLAS(cublasLtCreate(&handle));
  const size_t workspace_bytes = size_t{32} << 20;
  void* workspace = nullptr;
  CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  for (const Shape& s : training_shapes()) time_candidates(handle, s, workspace, workspace_bytes, exhaustive);
  cudaFree(workspace);
  cublasLtDestroy(handle);
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

// Transformer Engine keeps split accumulation (FP32 promotion of the tensor cores' partial sums)
// in the backward GEMMs and fast accumulation only in the forward, as fp8lm does. What would
// fast accumulation save in the backward? Each of gpt2-1558m's dgrad and wgrad shapes, the
// heuristic's candidates both ways.
TEST_CASE("gpt2-1558m's backward GEMMs with fast accumulation against split accumulation, timed",
          "[gemm-fast-accumulation][.bench][gpu]") {
  FP8LM_REQUIRE_GPU();
  cublasLtHandle_t handle;
  BENCH_CUBLAS(cublasLtCreate(&handle));
  const size_t workspace_bytes = size_t{32} << 20;
  void* workspace = nullptr;
  CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  for (const Shape& s : training_shapes()) {
    if (s.fast_accum) continue;  // the forward's already are
    const std::string fast_name = std::string(s.name) + " fast";
    Shape fast = s;
    fast.name = fast_name.c_str();
    fast.fast_accum = true;
    time_candidates(handle, s, workspace, workspace_bytes, /*exhaustive=*/false);
    time_candidates(handle, fast, workspace, workspace_bytes, /*exhaustive=*/false);
  }
  cudaFree(workspace);
  cublasLtDestroy(handle);
}
