// Does cuBLASLt take its GELU-backward epilogue (DGELU, DGELU_BGRAD) on an FP8 dgrad GEMM -
// mlp.c_proj's: E5M2 output gradient x E4M3 weight^T, the BF16 GELU input as aux - with D in
// E5M2, the operand c_fc's backward GEMMs read? That would fold the GELU backward's read of
// the BF16 dgelu into the GEMM. Prints the heuristic's status and candidates per case at
// gpt2-1558m:8's and gpt2-124m:32's shapes (docs/PERFORMANCE.md, 2026-12-01: the heuristic
// returns CUBLAS_STATUS_NOT_SUPPORTED, 15, for every FP8 D; a BF16 D is taken).
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a scripts/cublaslt_dgelu_probe.cu -lcublasLt -o /tmp/probe && /tmp/probe
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#define CK(x) do { auto e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)
#define LT(x) do { auto s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cublasLt %d line %d\n", (int)s, __LINE__); return 1; } } while (0)

struct Case { const char* name; cublasLtEpilogue_t epi; cudaDataType_t d; bool bias_grad; };

int run(int M, int N, int K, const Case& c, cublasLtHandle_t h, void* aux, void* bgrad, float* scales, float* amax,
        size_t wsb) {
  cublasLtMatmulDesc_t desc; LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
  int8_t fast = 0; LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  void* sa = scales; void* sb = scales + 1; void* sd = scales + 2;
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
  if (c.d != CUDA_R_16BF) {
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &sd, sizeof sd));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax, sizeof amax));
  }
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epi, sizeof c.epi));
  if (c.epi != CUBLASLT_EPILOGUE_DEFAULT) {
    int64_t ld = N;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
    int32_t at = CUDA_R_16BF;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at, sizeof at));
  }
  if (c.bias_grad) {
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bgrad, sizeof bgrad));
    int32_t bt = CUDA_R_16BF;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
  }
  // column-major: cuBLASLt A = weight^T [N rows of K] (E4M3), B = gradient [M rows of K] (E5M2), D [N x M]
  cublasLtMatrixLayout_t la, lb, lc, ld;
  LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K));
  LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E5M2, K, M, K));
  LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
  LT(cublasLtMatrixLayoutCreate(&ld, c.d, N, M, N));
  cublasLtMatmulPreference_t pref; LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
  cublasLtMatmulHeuristicResult_t res[8]; int got = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, c.d == CUDA_R_16BF ? ld : lc, ld, pref, 8, res, &got);
  printf("%-34s M=%d N=%d K=%d: heuristic status %d, %d candidates\n", c.name, M, N, K, (int)st, got);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  return 0;
}

int main() {
  cublasLtHandle_t h; LT(cublasLtCreate(&h));
  const size_t wsb = size_t{32} << 20;
  struct Shape { int M, N, K; } shapes[] = {{8192, 6400, 1600}, {32768, 3072, 768}};
  for (auto s : shapes) {
    void *aux, *bgrad; float* scales; float* amax;
    CK(cudaMalloc(&aux, (size_t)s.M * s.N * 2));
    CK(cudaMalloc(&bgrad, s.N * 4)); CK(cudaMalloc(&scales, 64)); CK(cudaMalloc(&amax, 64));
    float one[3] = {1, 1, 1}; CK(cudaMemcpy(scales, one, 12, cudaMemcpyHostToDevice));
    Case cases[] = {
        {"plain, BF16 D", CUBLASLT_EPILOGUE_DEFAULT, CUDA_R_16BF, false},
        {"plain, E5M2 D", CUBLASLT_EPILOGUE_DEFAULT, CUDA_R_8F_E5M2, false},
        {"DGELU, BF16 D", CUBLASLT_EPILOGUE_DGELU, CUDA_R_16BF, false},
        {"DGELU, E5M2 D", CUBLASLT_EPILOGUE_DGELU, CUDA_R_8F_E5M2, false},
        {"DGELU, E4M3 D", CUBLASLT_EPILOGUE_DGELU, CUDA_R_8F_E4M3, false},
        {"DGELU_BGRAD, BF16 D", CUBLASLT_EPILOGUE_DGELU_BGRAD, CUDA_R_16BF, true},
        {"DGELU_BGRAD, E5M2 D", CUBLASLT_EPILOGUE_DGELU_BGRAD, CUDA_R_8F_E5M2, true},
    };
    for (auto& c : cases) if (run(s.M, s.N, s.K, c, h, aux, bgrad, scales, amax, wsb)) return 1;
    CK(cudaFree(aux)); CK(cudaFree(bgrad)); CK(cudaFree(scales)); CK(cudaFree(amax));
  }
  printf("cuBLASLt version %zu\n", cublasLtGetVersion());
  return 0;
}
