// Causal flash attention on Hopper (FA2 style): BF16 inputs/outputs, FP32 accumulation, FP32
// softmax statistics, O(T) memory (no T x T matrix ever reaches global memory). The readable
// specification is the CPU reference in layers/attention.cpp. Head size 64 (every GPT-2 size)
// runs wgmma kernels on compute capability 9.x; head sizes 32 and 128, and 64 elsewhere, run
// the mma.sync kernels. Both compute the same products in the same order: their outputs are
// bit-identical (tested).
//
// This file holds the GPU entry points of layers/attention.h (shape and pointer checks, the
// dispatch on the head size, the launches) and the backward's first, tile-free kernel. The
// tiled kernels live in headers that only this file includes:
//   attention_tiles.cuh          mma.sync / ldmatrix / cp.async helpers, fragment layouts,
//                                and the warp-level products the kernels share
//   attention_forward.cuh        forward: O, lse (+ fused FP8 output and amax)
//   attention_backward_dkdv.cuh  backward step 2: dK, dV
//   attention_backward_dq.cuh    backward step 3: dQ
//   attention_wgmma.cuh          wgmma helpers, the swizzled tiles and their descriptors
//   attention_forward_wgmma.cuh  forward, head size 64, wgmma
//   attention_backward_wgmma.cuh backward steps 2 and 3, head size 64, wgmma
//   attention_dqkv_operand.cuh   their epilogue that writes dqkv's FP8 GEMM operand
// They stay one translation unit on purpose: NVVM's code for one kernel can depend on the
// other kernels of the module (compiled alone, the dK/dV kernel for HS = 128 orders its
// address arithmetic differently), and one unit keeps the generated code what it was.
//
// Notation: B batch, T sequence, C channels, NH heads, HS = C/NH head size (32, 64 or 128).
// qkv [B,T,3C] packs q | k | v; head h reads columns [h*HS, (h+1)*HS) of each third, so
// one head's q (or k, v) rows are HS contiguous bf16 with a row stride of 3C.
//
// Backward: three kernels, no atomics, each output element written once by one thread:
//   1. D[b,h,t] = dout_t . out_t (HS/8 lanes per (b,t,h), 16-byte loads, fixed shuffle
//      order) -> scratch [B,NH,T]. Below.
//   2. dK/dV: a block owns 64 keys and walks the query tiles from its diagonal to T.
//   3. dQ: a block owns 64 queries and walks the key tiles 0..diagonal.
//   At head size 64 on Hopper the wgmma dQ kernel computes D itself (the same bits) and runs
//   first: two kernels.
//   The dQ kernel recomputes S and dP (7 GEMM-shaped products in all instead of FA2's 5):
//   the price of determinism without a T x T buffer or floating-point atomics.
//
// Documents (document_starts, layers/attention.h): every tiled kernel is instantiated twice,
// by a template flag kDocuments. Without documents (nullptr) the launches pick the flag's
// false instances, which never read the pointer and compile to the code the kernels had
// before documents existed. With it, the kernels add the mask s < first[t] and skip the
// tiles that first[]'s monotonicity shows to be invisible (attention_tiles.cuh). The wgmma
// and the mma.sync kernels mask the same elements, and a tile that one of them walks and the
// other skips leaves a row exactly as it was: their outputs stay bit-identical.

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/cast_cuda.h"
#include "core/check_cuda.h"
#include "core/error.h"
#include "core/launch.cuh"
#include "layers/attention.h"
#include "layers/attention_backward_dkdv.cuh"
#include "layers/attention_backward_dq.cuh"
#include "layers/attention_backward_wgmma.cuh"
#include "layers/attention_dqkv_operand.cuh"
#include "layers/attention_forward.cuh"
#include "layers/attention_forward_wgmma.cuh"
#include "layers/attention_tiles.cuh"

namespace fp8lm::cuda {

namespace {

// ---- backward step 1: D = rowsum(dout * out) ----------------------------------------------------

// D [B,NH,T] (written), dout [B,T,C], out [B,T,C]. G = HS/8 consecutive lanes share one
// (b, t, h) row, each lane one 16-byte chunk (8 bf16) of dout and out, then a fixed xor
// shuffle tree over the G lanes: deterministic. rows = B*T*NH < 2^31 (checked on the host).
template <int HS>
__global__ void __launch_bounds__(256)
    attention_backward_dot_kernel(float* __restrict__ D, const bf16* __restrict__ dout, const bf16* __restrict__ out,
                                  int rows, int T, int C, int NH) {
  device::start_after_previous_kernel();
  constexpr int G = HS / 8;  // lanes per row: 4, 8 or 16
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = gid / G;  // (b*T + t)*NH + h
  const int chunk = gid % G;
  float sum = 0.0f;
  if (row < rows) {
    const int h = row % NH;
    const int bt = row / NH;
    const size_t off = static_cast<size_t>(bt) * C + static_cast<size_t>(h) * HS + chunk * 8;
    sum = dot_bf16x8(dout + off, out + off);
  }
#pragma unroll
  for (int offset = G / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (row < rows && chunk == 0) {
    const int h = row % NH;
    const int bt = row / NH;
    const int b = bt / T;
    const int t = bt % T;
    D[(static_cast<size_t>(b) * NH + h) * T + t] = sum;
  }
}

// ---- host side ----------------------------------------------------------------------------------

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int checked_head_size(const char* what, int B, int T, int C, int NH) {
  FP8LM_CHECK(B >= 0 && T >= 0 && C > 0 && NH > 0, what, ": bad shape B=", B, " T=", T, " C=", C, " NH=", NH);
  FP8LM_CHECK(C % NH == 0, what, ": C=", C, " is not a multiple of NH=", NH);
  const int HS = C / NH;
  if (HS != 32 && HS != 64 && HS != 128) {
    throw RuntimeError(std::string(what) + ": head size C/NH = " + std::to_string(HS) + " (C=" + std::to_string(C) +
                           ", NH=" + std::to_string(NH) + ") has no CUDA kernel",
                       "the flash-attention kernels support head sizes 32, 64 and 128; choose n_embd and n_head "
                       "so that n_embd / n_head is one of them");
  }
  return HS;
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int HS, int MT>
void launch_forward(bf16* out, float* lse, uint8_t* out_fp8, float* out_amax, const float* out_scale, bool e5m2,
                    const bf16* qkv, const int32_t* document_starts, int B, int T, int C, int NH,
                    cudaStream_t stream) {
  using Cfg = ForwardConfig<HS, MT>;
  auto kernel = document_starts != nullptr ? attention_forward_kernel<HS, MT, true>
                                           : attention_forward_kernel<HS, MT, false>;
  set_smem(kernel, Cfg::smem_bytes);
  const dim3 grid((T + Cfg::BR - 1) / Cfg::BR, NH, B);
  const float sl2 = kLog2e / sqrtf(static_cast<float>(HS));
  launch_kernel(kernel, grid, kThreads, Cfg::smem_bytes, stream, out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, T,
                C, NH, sl2, document_starts);
}

template <int HS>
void launch_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D,
                     const int32_t* document_starts, int B, int T, int C, int NH, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  const float sl2 = kLog2e * scale;
  const bool documents = document_starts != nullptr;
  {
    using Cfg = DkDvConfig<HS>;
    auto kernel = documents ? attention_backward_dkdv_kernel<HS, true> : attention_backward_dkdv_kernel<HS, false>;
    const size_t smem = Cfg::smem_bytes + (documents ? Cfg::documents_smem_bytes : 0);
    set_smem(kernel, smem);
    const dim3 grid((T + Cfg::BK - 1) / Cfg::BK, NH, B);
    launch_kernel(kernel, grid, kThreads, smem, stream, dqkv, dout, qkv, lse, D, T, C, NH, sl2, scale,
                  document_starts);
  }
  {
    using Cfg = DqConfig<HS>;
    auto kernel = documents ? attention_backward_dq_kernel<HS, true> : attention_backward_dq_kernel<HS, false>;
    set_smem(kernel, Cfg::smem_bytes);
    const dim3 grid((T + Cfg::BR - 1) / Cfg::BR, NH, B);
    launch_kernel(kernel, grid, kThreads, Cfg::smem_bytes, stream, dqkv, dout, qkv, lse, D, T, C, NH, sl2, scale,
                  document_starts);
  }
}

// Head size 64 on Hopper (compute capability 9.x): the forward with wgmma.
void launch_forward_wgmma(bf16* out, float* lse, uint8_t* out_fp8, float* out_amax, const float* out_scale, bool e5m2,
                          const bf16* qkv, const int32_t* document_starts, int B, int T, int C, int NH,
                          cudaStream_t stream) {
  using Cfg = ForwardWgmmaConfig;
  auto kernel =
      document_starts != nullptr ? attention_forward_wgmma_kernel<true> : attention_forward_wgmma_kernel<false>;
  set_smem(kernel, Cfg::smem_bytes);
  const dim3 grid((T + Cfg::BR - 1) / Cfg::BR, NH, B);
  const float sl2 = kLog2e / sqrtf(static_cast<float>(Cfg::HS));
  launch_kernel(kernel, grid, kThreads, Cfg::smem_bytes, stream, out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, T,
                C, NH, sl2, document_starts);
}

// Head size 64 on Hopper (compute capability 9.x): the same two steps with wgmma. With
// `operand`, the kernels write dqkv's FP8 operand instead of dqkv (attention_dqkv_operand.cuh).
// The dQ kernel runs first: it writes D (rowsum(dO * O), scratch [B,NH,T]) for the dK/dV kernel.
void launch_backward_wgmma(bf16* dqkv, const DqkvOperandTarget* operand, const bf16* dout, const bf16* qkv,
                           const bf16* out, const float* lse, float* D, const int32_t* document_starts, int B, int T,
                           int C, int NH, cudaStream_t stream) {
  using Cfg = BackwardWgmmaConfig;
  static_assert(2 * sizeof(OperandTile) + kSwizzleAtomBytes <= Cfg::dkdv_smem_bytes &&
                    sizeof(OperandTile) + kSwizzleAtomBytes <= Cfg::dq_smem_bytes,
                "the epilogues stage their operand tiles in the kernels' shared memory");
  const float scale = 1.0f / sqrtf(static_cast<float>(Cfg::HS));
  const float sl2 = kLog2e * scale;
  const dim3 grid((T + Cfg::BLOCK - 1) / Cfg::BLOCK, NH, B);
  const bool documents = document_starts != nullptr;
  const size_t dkdv_smem = Cfg::dkdv_smem_bytes + (documents ? Cfg::dkdv_documents_smem_bytes : 0);
  auto launch = [&](auto dkdv_kernel, auto dq_kernel, const DqkvOperandTarget& target) {
    set_smem(dq_kernel, Cfg::dq_smem_bytes);
    launch_kernel(dq_kernel, grid, kThreads, Cfg::dq_smem_bytes, stream, dqkv, target, dout, qkv, out, lse, D, T, C,
                  NH, sl2, scale, document_starts);
    set_smem(dkdv_kernel, dkdv_smem);
    launch_kernel(dkdv_kernel, grid, kThreads, dkdv_smem, stream, dqkv, target, dout, qkv, lse,
                  static_cast<const float*>(D), T, C, NH, sl2, scale, document_starts);
  };
  if (operand != nullptr && documents) {
    launch(attention_backward_dkdv_wgmma_kernel<true, true>, attention_backward_dq_wgmma_kernel<true, true>, *operand);
  } else if (operand != nullptr) {
    launch(attention_backward_dkdv_wgmma_kernel<true, false>, attention_backward_dq_wgmma_kernel<true, false>,
           *operand);
  } else if (documents) {
    launch(attention_backward_dkdv_wgmma_kernel<false, true>, attention_backward_dq_wgmma_kernel<false, true>,
           DqkvOperandTarget{});
  } else {
    launch(attention_backward_dkdv_wgmma_kernel<false, false>, attention_backward_dq_wgmma_kernel<false, false>,
           DqkvOperandTarget{});
  }
}

// wgmma exists on compute capability 9.x only (sm_90a); other GPUs run the mma.sync kernels.
// The answer is kept per device: the launches ask on every call.
bool has_wgmma() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  constexpr int kDevices = 64;
  static std::array<std::atomic<int>, kDevices> majors{};  // 0: not asked yet
  const auto ask = [device] {
    int major = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major;
  };
  if (device < 0 || device >= kDevices) return ask() == 9;
  int major = majors[static_cast<size_t>(device)].load(std::memory_order_relaxed);
  if (major == 0) {
    major = ask();
    majors[static_cast<size_t>(device)].store(major, std::memory_order_relaxed);
  }
  return major == 9;
}

// Which kernels a call may use: the fastest this GPU has, or the mma.sync ones everywhere
// (the tests that hold the wgmma kernels to them).
enum class Kernels { fastest, mma_sync };

void forward(Kernels kernels, __nv_bfloat16* out, float* lse, uint8_t* out_fp8, float* out_amax,
             const float* out_scale, Fp8Dtype out_dtype, const __nv_bfloat16* qkv, const int32_t* document_starts,
             int B, int T, int C, int NH, cudaStream_t stream) {
  const int HS = checked_head_size("attention_forward", B, T, C, NH);
  if (B == 0 || T == 0) return;
  FP8LM_CHECK(aligned(qkv, 16), "attention_forward: qkv must be 16-byte aligned");
  FP8LM_CHECK(document_starts == nullptr || aligned(document_starts, 4),
              "attention_forward: document_starts must be 4-byte aligned");
  FP8LM_CHECK(aligned(out, 4) && aligned(lse, 4), "attention_forward: out/lse must be 4-byte aligned");
  FP8LM_CHECK(out_fp8 == nullptr || aligned(out_fp8, 2), "attention_forward: out_fp8 must be 2-byte aligned");
  FP8LM_CHECK(out_amax == nullptr || aligned(out_amax, 4), "attention_forward: out_amax must be 4-byte aligned");
  const bool e5m2 = out_dtype == Fp8Dtype::e5m2;
  const int32_t* first = document_starts;
  switch (HS) {
    case 32:
      launch_forward<32, 2>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, first, B, T, C, NH, stream);
      break;
    case 64:
      if (kernels == Kernels::fastest && has_wgmma())
        launch_forward_wgmma(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, first, B, T, C, NH, stream);
      else
        launch_forward<64, 2>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, first, B, T, C, NH, stream);
      break;
    default:
      launch_forward<128, 1>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, first, B, T, C, NH, stream);
      break;
  }
}

// Backward step 1 of the mma.sync kernels: D [B,NH,T] = rowsum(dout * out) (the wgmma dQ kernel
// computes it itself).
void row_dots(float* D, const __nv_bfloat16* dout, const __nv_bfloat16* out, int B, int T, int C, int NH, int HS,
              cudaStream_t stream) {
  const size_t rows = static_cast<size_t>(B) * T * NH;
  FP8LM_CHECK(rows * (HS / 8) + 256 < 0x7fffffffu, "attention_backward: B*T*NH=", rows, " is too large");
  const int threads = 256;
  const int blocks = static_cast<int>((rows * (HS / 8) + threads - 1) / threads);
  const int r = static_cast<int>(rows);
  switch (HS) {
    case 32:
      launch_kernel(attention_backward_dot_kernel<32>, blocks, threads, 0, stream, D, dout, out, r, T, C, NH);
      break;
    case 64:
      launch_kernel(attention_backward_dot_kernel<64>, blocks, threads, 0, stream, D, dout, out, r, T, C, NH);
      break;
    default:
      launch_kernel(attention_backward_dot_kernel<128>, blocks, threads, 0, stream, D, dout, out, r, T, C, NH);
      break;
  }
}

void check_backward_inputs(const __nv_bfloat16* dout, const __nv_bfloat16* qkv, const __nv_bfloat16* out,
                           const float* lse, const int32_t* document_starts, const float* scratch) {
  FP8LM_CHECK(aligned(qkv, 16) && aligned(dout, 16) && aligned(out, 16),
              "attention_backward: qkv/dout/out must be 16-byte aligned");
  FP8LM_CHECK(aligned(lse, 4) && aligned(scratch, 4), "attention_backward: lse/scratch must be 4-byte aligned");
  FP8LM_CHECK(document_starts == nullptr || aligned(document_starts, 4),
              "attention_backward: document_starts must be 4-byte aligned");
  FP8LM_CHECK(scratch != nullptr, "attention_backward: scratch is required");
}

void backward(Kernels kernels, __nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
              const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B, int T, int C, int NH,
              float* scratch, cudaStream_t stream) {
  const int HS = checked_head_size("attention_backward", B, T, C, NH);
  if (B == 0 || T == 0) return;
  check_backward_inputs(dout, qkv, out, lse, document_starts, scratch);
  FP8LM_CHECK(aligned(dqkv, 4), "attention_backward: dqkv must be 4-byte aligned");
  float* D = scratch;  // [B,NH,T]
  const int32_t* first = document_starts;
  if (HS == 64 && kernels == Kernels::fastest && has_wgmma())
    return launch_backward_wgmma(dqkv, nullptr, dout, qkv, out, lse, D, first, B, T, C, NH, stream);
  row_dots(D, dout, out, B, T, C, NH, HS, stream);
  switch (HS) {
    case 32: launch_backward<32>(dqkv, dout, qkv, lse, D, first, B, T, C, NH, stream); break;
    case 64: launch_backward<64>(dqkv, dout, qkv, lse, D, first, B, T, C, NH, stream); break;
    default: launch_backward<128>(dqkv, dout, qkv, lse, D, first, B, T, C, NH, stream); break;
  }
}

}  // namespace

void attention_forward(__nv_bfloat16* out, float* lse, uint8_t* out_fp8, float* out_amax, const float* out_scale,
                       Fp8Dtype out_dtype, const __nv_bfloat16* qkv, const int32_t* document_starts, int B, int T,
                       int C, int NH, cudaStream_t stream) {
  forward(Kernels::fastest, out, lse, out_fp8, out_amax, out_scale, out_dtype, qkv, document_starts, B, T, C, NH,
          stream);
}

void attention_forward_mma_sync(__nv_bfloat16* out, float* lse, uint8_t* out_fp8, float* out_amax,
                                const float* out_scale, Fp8Dtype out_dtype, const __nv_bfloat16* qkv,
                                const int32_t* document_starts, int B, int T, int C, int NH, cudaStream_t stream) {
  forward(Kernels::mma_sync, out, lse, out_fp8, out_amax, out_scale, out_dtype, qkv, document_starts, B, T, C, NH,
          stream);
}

size_t attention_backward_scratch_floats(int B, int T, int C, int NH) {
  (void)C;
  return static_cast<size_t>(B) * NH * T;  // D [B,NH,T]
}

void attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                        const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B, int T,
                        int C, int NH, float* scratch, cudaStream_t stream) {
  backward(Kernels::fastest, dqkv, dout, qkv, out, lse, document_starts, B, T, C, NH, scratch, stream);
}

void attention_backward_mma_sync(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                 const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B,
                                 int T, int C, int NH, float* scratch, cudaStream_t stream) {
  backward(Kernels::mma_sync, dqkv, dout, qkv, out, lse, document_starts, B, T, C, NH, scratch, stream);
}

bool attention_backward_writes_operand(int B, int T, int C, int NH) {
  return B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0 && C / NH == 64 && T % kOperandTile == 0 && has_wgmma();
}

size_t attention_backward_operand_scratch_floats(int B, int T, int C, int NH) {
  const size_t D = attention_backward_scratch_floats(B, T, C, NH);
  const size_t D_padded = (D + 3) / 4 * 4;  // the partials 16-byte aligned
  return D_padded + static_cast<size_t>(B) * T / kOperandTile * 3 * static_cast<size_t>(C);
}

void attention_backward_operand(const DqkvOperand& operand, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                const __nv_bfloat16* out, const float* lse, const int32_t* document_starts, int B,
                                int T, int C, int NH, float* scratch, cudaStream_t stream) {
  const int HS = checked_head_size("attention_backward_operand", B, T, C, NH);
  if (B == 0 || T == 0) return;
  FP8LM_CHECK(attention_backward_writes_operand(B, T, C, NH), "attention_backward_operand: head size ", HS, " and T=",
              T, " on this GPU: the operand needs head size 64, T a multiple of ", kOperandTile, " and wgmma");
  check_backward_inputs(dout, qkv, out, lse, document_starts, scratch);
  FP8LM_CHECK(operand.codes != nullptr && operand.codes_t != nullptr && operand.scale != nullptr,
              "attention_backward_operand: codes, codes_t and scale are required");
  FP8LM_CHECK(aligned(operand.codes, 16) && aligned(operand.codes_t, 16),
              "attention_backward_operand: codes and codes_t must be 16-byte aligned");
  FP8LM_CHECK(operand.amax == nullptr || aligned(operand.amax, 4),
              "attention_backward_operand: amax must be 4-byte aligned");
  float* D = scratch;
  const size_t D_floats = attention_backward_scratch_floats(B, T, C, NH);
  float* partials = operand.dbias ? scratch + (D_floats + 3) / 4 * 4 : nullptr;
  const DqkvOperandTarget target{.codes = operand.codes,
                                 .codes_t = operand.codes_t,
                                 .bias_partials = partials,
                                 .amax = operand.amax,
                                 .scale = operand.scale,
                                 .kind = operand.dtype == Fp8Dtype::e5m2 ? __NV_E5M2 : __NV_E4M3};
  launch_backward_wgmma(nullptr, &target, dout, qkv, out, lse, D, document_starts, B, T, C, NH, stream);
  if (operand.dbias) add_column_partials(operand.dbias, partials, B * T / kOperandTile, 3 * C, stream);
}

}  // namespace fp8lm::cuda
