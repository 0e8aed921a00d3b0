#include "core/gemm_cuda.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <cublasLt.h>

#include "core/check_cuda.h"
#include "core/error.h"
#include "core/gemm_small_m_cuda.h"

// Row-major to cuBLASLt's column-major, the one mapping every call uses:
//
// A row-major matrix X [r,c] with row stride ld is, byte for byte, the column-major
// matrix X^T [c,r] with leading dimension ld. So
//   D [M,N] row-major  = column-major D^T [N,M], ldd = N,
//   A [M,K] row-major  = column-major A^T [K,M], ld = K,
//   B [N,K] row-major  = column-major B^T [K,N], ld = K,
// and D = A . B^T  <=>  D^T = B . A^T = (B^T)^T . (A^T).
// cuBLASLt computes D' = op(A') . op(B') in column-major, so we pass
//   m = N, n = M, k = K,
//   A' = B^T [K,N] (our B), transa = T, lda = K   -> op(A') = B     [N,K]
//   B' = A^T [K,M] (our A), transb = N, ldb = K   -> op(B') = A^T   [K,M]
//   C' = D' = D^T [N,M], ldc = ldd = N.
// That is cuBLASLt's "TN" layout, the one Hopper's FP8 kernels require. Consequences:
// cuBLASLt's A scale pointer is our B's scale_inv and vice versa, cuBLASLt's A type is
// our b_type, and the bias (length = rows of D' = N) is broadcast over D''s M columns,
// i.e. over our rows, as wanted.

namespace fp8lm::cuda {

std::string_view to_string(GemmType type) {
  switch (type) {
    case GemmType::bf16: return "bf16";
    case GemmType::fp32: return "fp32";
    case GemmType::e4m3: return "e4m3";
    case GemmType::e5m2: return "e5m2";
  }
  return "?";
}

std::string_view to_string(GemmScaling scaling) {
  switch (scaling) {
    case GemmScaling::tensor: return "per-tensor";
    case GemmScaling::tiles_1x128: return "1x128 tiles";
    case GemmScaling::blocks_128x128: return "128x128 blocks";
  }
  return "?";
}

namespace {

constexpr bool is_block(GemmScaling scaling) { return scaling != GemmScaling::tensor; }

// cuBLASLt's scale mode (CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE takes an int32_t).
int32_t scale_mode(GemmScaling scaling) {
  switch (scaling) {
    case GemmScaling::tensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case GemmScaling::tiles_1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case GemmScaling::blocks_128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

cudaDataType_t cuda_type(GemmType type) {
  switch (type) {
    case GemmType::bf16: return CUDA_R_16BF;
    case GemmType::fp32: return CUDA_R_32F;
    case GemmType::e4m3: return CUDA_R_8F_E4M3;
    case GemmType::e5m2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

// Largest power of two (at most 256, cuBLASLt's default assumption) dividing the address.
uint16_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint16_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

std::string describe(const GemmEngine::Key& key) {
  std::string s = "GEMM D[" + std::to_string(key.M) + "," + std::to_string(key.N) + "] = A[" +
                  std::to_string(key.M) + "," + std::to_string(key.K) + "](" + std::string(to_string(key.a_type)) +
                  ") . B[" + std::to_string(key.N) + "," + std::to_string(key.K) + "](" +
                  std::string(to_string(key.b_type)) + ")^T -> " + std::string(to_string(key.d_type));
  if (key.has_bias) s += " + bias(" + std::string(to_string(key.bias_type)) + ")";
  if (key.gelu) s += ", GELU epilogue";
  if (key.c_mode == 1) s += ", C == D";
  if (key.c_mode == 2) s += ", C != D";
  if (key.fast_accum) s += ", fast accumulation";
  if (is_block(key.a_scaling) || is_block(key.b_scaling))
    s += ", scales A " + std::string(to_string(key.a_scaling)) + " B " + std::string(to_string(key.b_scaling));
  s += ", pointer alignments A " + std::to_string(key.align_a) + " B " + std::to_string(key.align_b) + " C " +
       std::to_string(key.align_c) + " D " + std::to_string(key.align_d);
  if (key.has_bias) s += " bias " + std::to_string(key.align_bias);
  if (key.gelu) s += " gelu_input " + std::to_string(key.align_gelu_input);
  return s;
}

std::string alignment_hint(const GemmEngine::Key& key) {
  if (is_fp8(key.a_type))
    return "cuBLASLt's FP8 kernels need K and N multiples of 16 and 16-byte-aligned A, B, C, D and bias pointers "
           "(pad the model dimensions, e.g. the vocabulary, to a multiple of 16)";
  return "cuBLASLt's BF16 kernels want K and N multiples of 8 and 16-byte-aligned pointers";
}

// Block scaling's combinations (gemm_cuda.h), checked before cuBLASLt sees them: the
// heuristic's answer to an unsupported one is a bare NOT_SUPPORTED, and a silent fallback to
// another scaling would change the numerics.
void check_block_scaling(const GemmEngine::Key& key) {
  auto refuse = [&](const std::string& why, const std::string& hint) {
    throw RuntimeError(describe(key) + ": " + why, hint);
  };
  if (!is_block(key.a_scaling) || !is_block(key.b_scaling))
    refuse("a block-scaled operand needs a block-scaled partner (cuBLASLt has no block x per-tensor mode)",
           "quantize both operands with --fp8-recipe blockwise's casts");
  if (!is_fp8(key.a_type) || !is_fp8(key.b_type)) refuse("block scaling is for FP8 operands", "");
  if (key.a_scaling == GemmScaling::blocks_128x128 && key.b_scaling == GemmScaling::blocks_128x128)
    refuse("128x128 blocks x 128x128 blocks is not supported on Hopper (1x128 x 1x128, 1x128 x 128x128 and "
           "128x128 x 1x128 are)",
           "give one operand 1x128 tiles");
  if (key.fast_accum)
    refuse("fast accumulation is not supported with block scaling", "set GemmDesc::fast_accum = false");
  if (!key.has_a_scale || !key.has_b_scale) refuse("block scaling needs both scale arrays", "");
  if (key.K % 16 != 0) refuse("K must be a multiple of 16 (a ragged last 128-wide block is fine)",
                              "pad the model dimensions to 16");
  if (key.M % 8 != 0 || key.N % 8 != 0) refuse("M and N must be multiples of 8 under block scaling", "");
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

// The per-call pointers, written on the (cached) descriptor before each cublasLtMatmul.
void set_call_pointers(cublasLtMatmulDesc_t desc, const GemmEngine::Key& key, const GemmArgs& args) {
  // cuBLASLt's A is our B (the file's opening comment).
  if (key.has_a_scale) set_desc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(args.a_scale_inv));
  if (key.has_b_scale) set_desc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(args.b_scale_inv));
  if (key.has_bias) set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
  if (is_fp8(key.d_type)) set_desc(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(args.d_scale));
  if (key.has_d_amax) set_desc(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(args.d_amax));
  if (key.gelu) set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, args.gelu_input);
}

template <typename T>
void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)));
}

}  // namespace

// One cached problem: everything cublasLtMatmul needs besides the per-call pointers.
struct GemmEngine::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // cuBLASLt's A: our B^T [K,N]
  cublasLtMatrixLayout_t b = nullptr;  // cuBLASLt's B: our A^T [K,M]
  cublasLtMatrixLayout_t c = nullptr;  // [N,M], ld N (used when C is another buffer)
  cublasLtMatrixLayout_t d = nullptr;  // [N,M], ld N
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {  // destroy calls cannot fail in a way worth reporting from a destructor
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

namespace {

// C as cuBLASLt gets it. No C: D itself with beta = 0 (not read), except for an FP8 D, whose C
// would have to be BF16: then none at all (nullptr, which beta = 0 allows: device call 94).
// C == D: the in-place form (Cdesc == Ddesc). Another buffer: its own layout.
cublasLtMatrixLayout_t c_layout(const GemmEngine::Key& key, const GemmEngine::Plan& plan) {
  return key.c_mode == 2 || is_fp8(key.d_type) ? plan.c : plan.d;
}
const void* c_pointer(const GemmEngine::Key& key, const GemmArgs& args) {
  if (args.C != nullptr) return args.C;
  return is_fp8(key.d_type) ? nullptr : args.D;
}

}  // namespace

GemmEngine::GemmEngine(SmallMGemm small_m, GemmAlgorithmChoice algorithm_choice)
    : small_m_(small_m), algorithm_choice_(algorithm_choice) {
  cublasLtHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  handle_ = handle;
  // cudaMalloc returns 256-byte-aligned memory, as cuBLASLt requires of the workspace.
  const cudaError_t status = cudaMalloc(&workspace_, kWorkspaceBytes);
  if (status != cudaSuccess) {
    cublasLtDestroy(handle_);
    handle_ = nullptr;
    workspace_ = nullptr;
    CUDA_CHECK(status);
  }
}

GemmEngine::~GemmEngine() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

GemmEngine::Plan& GemmEngine::plan_for(const Key& key, const GemmArgs& args, cudaStream_t stream) {
  auto found = plans_.find(key);
  if (found != plans_.end()) return *found->second;

  auto plan = std::make_unique<Plan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Transposed storage flips the op: B stored [K,N] row-major is column-major [N,K], which
  // is already op(A') = B with transa = N; A stored [K,M] is column-major [M,K], so
  // transb = T gives A^T [K,M].
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, key.b_transposed ? CUBLAS_OP_N : CUBLAS_OP_T);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, key.a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
  if (is_fp8(key.a_type)) set_desc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(key.fast_accum ? 1 : 0));
  // Block scaling: the modes of the swapped operands (cuBLASLt's A is our B). Per-tensor plans
  // leave the attribute at its default, as before block scaling existed.
  if (is_block(key.a_scaling) || is_block(key.b_scaling)) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode(key.b_scaling));
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode(key.a_scaling));
  }
  // The heuristic reads these pointers' values (alignment, presence), so the plan is made
  // with the first call's pointers; later calls overwrite them (same alignment: it is in the key).
  const cublasLtEpilogue_t epilogue = key.gelu       ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                      : key.has_bias ? CUBLASLT_EPILOGUE_BIAS
                                                     : CUBLASLT_EPILOGUE_DEFAULT;
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (key.has_bias) set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(cuda_type(key.bias_type)));
  if (key.gelu) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(key.N));
    // A BF16 D's aux is BF16 by default; an E4M3 D's would be E4M3 unless set (a BF16 C allows BF16).
    if (is_fp8(key.d_type))
      set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, static_cast<int32_t>(CUDA_R_16BF));
  }
  set_call_pointers(plan->desc, key, args);

  if (key.b_transposed) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(key.b_type), key.N, key.K, key.N));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(key.b_type), key.K, key.N, key.K));
  }
  if (key.a_transposed) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(key.a_type), key.M, key.K, key.M));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(key.a_type), key.K, key.M, key.K));
  }
  // An FP8 D takes a BF16 C (never read here: an FP8 D has no C).
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, cuda_type(is_fp8(key.d_type) ? GemmType::bf16 : key.d_type),
                                          key.N, key.M, key.N));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, cuda_type(key.d_type), key.N, key.M, key.N));

  struct Preference {
    cublasLtMatmulPreference_t pref = nullptr;
    ~Preference() {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
    }
  } preference;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference.pref));
  set_pref(preference.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{kWorkspaceBytes});
  // cuBLASLt assumes 256-byte-aligned matrices unless told otherwise; tell it the truth
  // (operand tensors carved out of a slab need not be 256-aligned).
  set_pref(preference.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t{key.align_b});
  set_pref(preference.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, uint32_t{key.align_a});
  set_pref(preference.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t{key.align_c});
  set_pref(preference.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t{key.align_d});

  constexpr int kRequested = 8;
  cublasLtMatmulHeuristicResult_t results[kRequested] = {};
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b, c_layout(key, *plan),
                                                               plan->d, preference.pref, kRequested, results, &returned);
  // The usable candidates, the heuristic's order kept (its first is candidates[0]).
  cublasLtMatmulAlgo_t candidates[kRequested];
  int usable = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < returned; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kWorkspaceBytes)
        candidates[usable++] = results[i].algo;
  }
  if (usable == 0) {
    throw RuntimeError("cuBLASLt has no algorithm for " + describe(key) + " (heuristic status " +
                           std::to_string(static_cast<int>(status)) + ", " + std::to_string(returned) + " results)",
                       alignment_hint(key));
  }
  plan->algo = candidates[0];
  if (usable > 1) plan->algo = candidates[choose_by_timing(key, *plan, args, candidates, usable, stream)];

  return *plans_.emplace(key, std::move(plan)).first->second;
}

namespace {

// A split-K candidate sums K in another order: never the heuristic's bits.
bool splits_k(const cublasLtMatmulAlgo_t& algo) {
  int splits = 1;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits, &written);
  return splits > 1;
}

// Large enough that a few percent is worth the one-time timing: a training GEMM, not a test's
// or a decoding prompt's small one.
constexpr double kTimedMinFlops = 2.0 * 1024 * 1024 * 1024 * 4;

}  // namespace

int GemmEngine::choose_by_timing(const Key& key, Plan& plan, const GemmArgs& args, const void* candidate_array,
                                 int count, cudaStream_t stream) {
  const auto* candidates = static_cast<const cublasLtMatmulAlgo_t*>(candidate_array);
  if (algorithm_choice_ != GemmAlgorithmChoice::timed || key.c_mode == 1 || is_block(key.a_scaling) ||
      2.0 * key.M * key.N * key.K < kTimedMinFlops)
    return 0;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return 0;

  // The call as gemm() makes it, with one candidate's algorithm. D is this call's output, about
  // to be written anyway, and without C == D every run writes the same D (and gelu_input and
  // d_amax, also outputs).
  set_call_pointers(plan.desc, key, args);
  const float alpha = args.alpha, beta = args.C == nullptr ? 0.0f : args.beta;
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle_, plan.desc, &alpha, args.B, plan.a, args.A, plan.b, &beta, c_pointer(key, args),
                          c_layout(key, plan), args.D, plan.d, &algo, workspace_, kWorkspaceBytes, stream);
  };
  // The outputs a candidate must reproduce: D, and under the GELU epilogue its input (BF16,
  // the same M x N), where an E4M3 D could hide a difference in the sum.
  const size_t d_bytes = size_t(key.M) * key.N * gemm_type_bytes(key.d_type);
  const size_t gelu_input_bytes = key.gelu ? size_t(key.M) * key.N * gemm_type_bytes(GemmType::bf16) : 0;
  auto output = [&] {
    std::vector<unsigned char> bytes(d_bytes + gelu_input_bytes);
    CUDA_CHECK(cudaMemcpyAsync(bytes.data(), args.D, d_bytes, cudaMemcpyDeviceToHost, stream));
    if (gelu_input_bytes > 0)
      CUDA_CHECK(cudaMemcpyAsync(bytes.data() + d_bytes, args.gelu_input, gelu_input_bytes, cudaMemcpyDeviceToHost,
                                 stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return bytes;
  };

  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  constexpr int kRuns = 3;
  std::vector<std::pair<float, int>> timed;  // (ms for kRuns, candidate)
  for (int i = 0; i < count; ++i) {
    if (i > 0 && splits_k(candidates[i])) continue;
    if (run(candidates[i]) != CUBLAS_STATUS_SUCCESS) {  // the warm-up; a refusal drops the candidate
      if (i == 0) break;
      continue;
    }
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < kRuns; ++r) CUBLAS_CHECK(run(candidates[i]));
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    timed.push_back({ms, i});
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  ++timed_plans_;
  if (timed.empty() || timed.front().second != 0) return 0;  // the first refused: leave it to gemm() to report
  std::sort(timed.begin(), timed.end());
  if (timed.front().second == 0) return 0;

  // The fastest candidate whose output is the heuristic first's, bit for bit.
  CUBLAS_CHECK(run(candidates[0]));
  const std::vector<unsigned char> reference = output();
  for (const auto& [ms, i] : timed) {
    if (i == 0) return 0;
    CUBLAS_CHECK(run(candidates[i]));
    if (output() == reference) {
      ++plans_not_first_;
      return i;
    }
  }
  return 0;
}

void GemmEngine::gemm(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream) {
  const bool fp8 = is_fp8(desc.a_type) || is_fp8(desc.b_type);
  Key key{};
  key.M = desc.M;
  key.N = desc.N;
  key.K = desc.K;
  key.a_type = desc.a_type;
  key.b_type = desc.b_type;
  key.d_type = desc.d_type;
  key.has_bias = args.bias != nullptr;
  key.bias_type = key.has_bias ? desc.bias_type : GemmType::bf16;
  key.fast_accum = fp8 && desc.fast_accum;
  key.a_transposed = desc.a_transposed;
  key.b_transposed = desc.b_transposed;
  if (fp8 && (desc.a_transposed || desc.b_transposed))
    throw RuntimeError(describe(key) + ": FP8 operands must be K-contiguous (not transposed)",
                       "cast a transposed FP8 copy with cast_transpose_fp8 / transpose_fp8");
  key.has_a_scale = args.a_scale_inv != nullptr;
  key.has_b_scale = args.b_scale_inv != nullptr;
  key.a_scaling = desc.a_scaling;
  key.b_scaling = desc.b_scaling;
  key.c_mode = args.C == nullptr ? 0 : args.C == args.D ? 1 : 2;
  key.align_a = alignment_of(args.A);
  key.align_b = alignment_of(args.B);
  key.align_d = alignment_of(args.D);
  key.align_c = key.c_mode == 2 ? alignment_of(args.C) : key.align_d;
  key.align_bias = key.has_bias ? alignment_of(args.bias) : 0;
  key.has_d_amax = args.d_amax != nullptr;
  key.gelu = args.gelu_input != nullptr;
  key.align_gelu_input = key.gelu ? alignment_of(args.gelu_input) : 0;

  // ---- validate against cuBLASLt's documented type table (see gemm_cuda.h)
  FP8LM_CHECK(desc.M > 0 && desc.N > 0 && desc.K > 0, "GEMM shape M=", desc.M, " N=", desc.N, " K=", desc.K);
  FP8LM_CHECK(args.A && args.B && args.D, "GEMM needs A, B and D");
  if (args.C == nullptr && args.beta != 0.0f)
    throw RuntimeError(describe(key) + ": beta = " + std::to_string(args.beta) + " but C is nullptr",
                       "pass C = D to accumulate into D");
  const bool bf16_inputs = desc.a_type == GemmType::bf16 && desc.b_type == GemmType::bf16;
  const bool fp8_inputs = is_fp8(desc.a_type) && is_fp8(desc.b_type) &&
                          !(desc.a_type == GemmType::e5m2 && desc.b_type == GemmType::e5m2);
  if (!bf16_inputs && !fp8_inputs)
    throw RuntimeError("unsupported operand types for " + describe(key),
                       "use bf16 x bf16, or FP8 e4m3 x e4m3, e5m2 x e4m3, e4m3 x e5m2 (cuBLASLt has no e5m2 x e5m2)");
  const bool fp8_d = desc.d_type == GemmType::e4m3;
  if (desc.d_type != GemmType::bf16 && desc.d_type != GemmType::fp32 && !fp8_d)
    throw RuntimeError("unsupported output type for " + describe(key), "D must be bf16, fp32 or e4m3");
  if (fp8_d) {
    if (desc.a_type != GemmType::e4m3 || desc.b_type != GemmType::e4m3)
      throw RuntimeError(describe(key) + ": an E4M3 D needs E4M3 x E4M3 operands", "write bf16 and cast");
    if (args.C != nullptr) throw RuntimeError(describe(key) + ": an FP8 D takes no C", "add into a bf16 D instead");
    if (args.d_scale == nullptr)
      throw RuntimeError(describe(key) + ": an FP8 D needs its d_scale", "pass the output's scaling-state scale");
  } else if (args.d_scale != nullptr || args.d_amax != nullptr) {
    throw RuntimeError(describe(key) + ": d_scale and d_amax are for an FP8 D", "pass nullptr for a bf16 or fp32 D");
  }
  if (key.gelu) {
    if (!key.has_bias || desc.bias_type != GemmType::bf16 || args.C != nullptr ||
        (desc.d_type != GemmType::bf16 && !fp8_d))
      throw RuntimeError(describe(key) + ": the GELU epilogue needs a bf16 bias, no C and a bf16 or e4m3 D",
                         "run the GEMM and layers/gelu.h's kernel instead");
    if (key.align_gelu_input < 16 || key.N % 8 != 0)
      throw RuntimeError(describe(key) + ": gelu_input must be 16-byte aligned and N a multiple of 8", "");
  }
  if (key.has_bias) {
    const GemmType expected = desc.d_type == GemmType::bf16 ? GemmType::bf16
                              : fp8_inputs                   ? GemmType::bf16
                                                             : GemmType::fp32;
    if (desc.bias_type != expected)
      throw RuntimeError("unsupported bias type for " + describe(key),
                         "cuBLASLt takes a " + std::string(to_string(expected)) + " bias for this combination");
  }
  if ((key.has_a_scale && !is_fp8(desc.a_type)) || (key.has_b_scale && !is_fp8(desc.b_type)))
    throw RuntimeError(describe(key) + ": scale_inv pointers are for FP8 operands only",
                       "pass a_scale_inv / b_scale_inv = nullptr for BF16 operands");
  if (fp8_inputs) {
    // cuBLASLt's FP8 requirement (16-byte-aligned matrices), checked here rather than left
    // to the library: on cuBLASLt 13.1 (H100) a bias that is not 16-byte aligned either
    // makes the heuristic fail (FP32 output) or, 2-byte aligned with BF16 output, passes the
    // heuristic and then faults in the kernel (misaligned address), which kills the context.
    const bool operands_ok = key.align_a >= 16 && key.align_b >= 16 && key.align_c >= 16 && key.align_d >= 16;
    if (!operands_ok || (key.has_bias && key.align_bias < 16))
      throw RuntimeError(describe(key) + ": FP8 GEMM operands and bias must be 16-byte aligned",
                         "align every tensor carved out of a slab to 16 bytes (or 256)");
  }

  if (is_block(desc.a_scaling) || is_block(desc.b_scaling)) {
    check_block_scaling(key);
    if (reinterpret_cast<uintptr_t>(args.a_scale_inv) % 16 != 0 || reinterpret_cast<uintptr_t>(args.b_scale_inv) % 16 != 0)
      throw RuntimeError(describe(key) + ": block scale arrays must be 16-byte aligned",
                         "carve them 256-byte aligned, as the model does");
  }

  // The one place that chooses the kernel. A decoding step multiplies one row per sequence by
  // every weight, so its GEMMs are a single pass over the weights; cuBLASLt's kernels, tiled
  // for large M, make that pass at ~550 GB/s in FP8 and ~1,170 GB/s in BF16 at M = 1 (H100,
  // gpt2-1558m); the small-M kernel streams them with 16-byte loads and made the FP8 decoding
  // step 1.97x faster (docs/INFERENCE.md); its tensor-core form made batch-8 FP8 decoding 1.7x
  // faster. It takes a GEMM of the rows where it measured faster (small_m_form: E4M3 up to 16,
  // BF16 one, or up to 8 for the LM head) whose types, scaling, layout and alignment it supports
  // (small_m_gemm_refusal: E4M3 x E4M3 or BF16 x BF16 into BF16, per-tensor scales, K a
  // multiple of 16, ...); any other GEMM, every training GEMM (M = B x T) among them, goes to
  // cuBLASLt by that same rule, never after a failed attempt.
  if (routes_to_small_m(desc, args)) {
    gemm_small_m(desc, args, stream);
    ++small_m_calls_;
    return;
  }

  // cuBLASLt 13.1's FP8 kernels return NOT_SUPPORTED for a scale pointer that is not
  // 16-byte aligned (seen on H100; the heuristic does not catch it). The CUDA backend keeps
  // each scaling state's scale_inv in a 16-byte slot of its own (kScaleInvStride), so no
  // GEMM needs its scale copied into an aligned place first (that was one 4-byte copy per
  // operand, about a thousand a step at gpt2-1558m).
  for (const float* scale_inv : {args.a_scale_inv, args.b_scale_inv}) {
    if (scale_inv && reinterpret_cast<uintptr_t>(scale_inv) % 16 != 0)
      throw RuntimeError(describe(key) + ": an FP8 GEMM's scale_inv pointer must be 16-byte aligned",
                         "lay the scaling states' scale_inv out with a stride of 4 floats, as the CUDA backend does");
  }
  Plan& plan = plan_for(key, args, stream);

  // Per-call pointers: host-side attribute writes on the cached descriptor.
  set_call_pointers(plan.desc, key, args);

  const float alpha = args.alpha;
  const float beta = args.C == nullptr ? 0.0f : args.beta;
  const cublasStatus_t status =
      cublasLtMatmul(handle_, plan.desc, &alpha, args.B, plan.a, args.A, plan.b, &beta, c_pointer(key, args),
                     c_layout(key, plan), args.D, plan.d, &plan.algo, workspace_, kWorkspaceBytes, stream);
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw RuntimeError("cublasLtMatmul failed (cuBLAS status " + std::to_string(static_cast<int>(status)) + ") for " +
                           describe(key),
                       alignment_hint(key));
  }
}

bool GemmEngine::routes_to_small_m(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm* layernorm) const {
  return small_m_ == SmallMGemm::on && small_m_gemm_refusal(desc, args, layernorm) == nullptr;
}

bool GemmEngine::gemm_after_layernorm(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm& layernorm,
                                      cudaStream_t stream) {
  if (!routes_to_small_m(desc, args, &layernorm)) return false;
  gemm_small_m(desc, args, stream, &layernorm);
  ++small_m_calls_;
  return true;
}

}  // namespace fp8lm::cuda
