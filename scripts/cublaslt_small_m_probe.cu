// cuBLASLt at a decoding step's 32 rows (gpt2-1558m at batch 32): every heuristic candidate and
// split-K variants of the first, E4M3 x E4M3 -> BF16 and BF16 x BF16 -> BF16, the weights cycled
// past the L2, 200 back-to-back calls each (docs/INFERENCE.md, device call 215: 10-17 us a call in
// both precisions, so neither another candidate nor split-K makes FP8 pay at 32 rows).
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/cublaslt_small_m_probe.cu -lcublasLt -o /tmp/p && /tmp/p
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#define CK(x) do { auto e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)
#define LT(x) do { auto st_ = (x); if (st_ != CUBLAS_STATUS_SUCCESS) { printf("cublasLt %d line %d\n", (int)st_, __LINE__); return 1; } } while (0)

int main() {
  cublasLtHandle_t h; LT(cublasLtCreate(&h));
  const size_t wsb = size_t{32} << 20; void* ws; CK(cudaMalloc(&ws, wsb));
  struct Shape { const char* name; int N, K; } shapes[] = {{"c_attn", 4800, 1600}, {"attn.c_proj", 1600, 1600}, {"c_fc", 6400, 1600}, {"mlp.c_proj", 1600, 6400}};
  const int M = 32;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (bool fp8 : {true, false}) for (auto s : shapes) {
    const size_t eb = fp8 ? 1 : 2, wbytes = size_t(s.N) * s.K * eb;
    const int copies = int((size_t{256} << 20) / wbytes) + 1;
    char* W; CK(cudaMalloc(&W, wbytes * copies)); CK(cudaMemset(W, 0x11, wbytes * copies));
    void *A, *D; CK(cudaMalloc(&A, size_t(M) * s.K * eb)); CK(cudaMemset(A, 0x11, size_t(M) * s.K * eb));
    CK(cudaMalloc(&D, size_t(M) * s.N * 2));
    float* one; CK(cudaMalloc(&one, 16)); float h1[4] = {1, 1, 1, 1}; CK(cudaMemcpy(one, h1, 16, cudaMemcpyHostToDevice));
    cublasLtMatmulDesc_t desc; LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
    if (fp8) {
      int8_t fast = 1; LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
      void* p = one;
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p, sizeof p));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p, sizeof p));
    }
    const cudaDataType_t it = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    cublasLtMatrixLayout_t la, lb, ld;
    LT(cublasLtMatrixLayoutCreate(&la, it, s.K, s.N, s.K));
    LT(cublasLtMatrixLayoutCreate(&lb, it, s.K, M, s.K));
    LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, s.N, M, s.N));
    cublasLtMatmulPreference_t pref; LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[32]; int got = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 32, res, &got));
    std::vector<cublasLtMatmulAlgo_t> algos;
    std::vector<int> origin;
    for (int i = 0; i < got; ++i) { algos.push_back(res[i].algo); origin.push_back(i); }
    for (int split : {2, 3, 4, 6, 8}) {  // split-K variants of the heuristic's first
      cublasLtMatmulAlgo_t a = res[0].algo;
      cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split);
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(h, desc, la, lb, ld, ld, &a, &check) == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= wsb) {
        algos.push_back(a); origin.push_back(-split);
      }
    }
    float alpha = 1, beta = 0;
    for (size_t i = 0; i < algos.size(); ++i) {
      int splits = 1, tile = 0, id = 0; size_t w = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&algos[i], CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits, &w);
      cublasLtMatmulAlgoConfigGetAttribute(&algos[i], CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
      cublasLtMatmulAlgoConfigGetAttribute(&algos[i], CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
      auto call = [&](int c) { return cublasLtMatmul(h, desc, &alpha, W + size_t(c % copies) * wbytes, la, A, lb, &beta, D, ld, D, ld, &algos[i], ws, wsb, 0); };
      int status = 0;
      for (int c = 0; c < copies; ++c) { const int st = int(call(c)); if (st) status = st; }
      const bool ok = status == 0;
      CK(cudaDeviceSynchronize());
      const int reps = 200;
      CK(cudaEventRecord(e0));
      for (int c = 0; c < reps; ++c) call(c);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
      printf("%s %-12s M=%d %s algo %3d tile %3d splitK %d: %s%d %7.2f us  %6.0f GB/s\n", fp8 ? "E4M3" : "BF16", s.name, M,
             origin[i] >= 0 ? "heuristic" : "split of", id, tile, splits, ok ? "ok" : "FAILED ", status, 1e3 * ms / reps,
             wbytes / (1e3 * ms / reps) / 1e3);
    }
    cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(desc);
    CK(cudaFree(W)); CK(cudaFree(A)); CK(cudaFree(D)); CK(cudaFree(one));
  }
  return 0;
}
