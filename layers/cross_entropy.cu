// Fused softmax cross-entropy forward + backward (see layers/cross_entropy.h).
//
// One 1024-thread block per row. The fused kernel, which training runs on one rank, first
// copies a row that fits (kMaxStagedRowBytes: GPT-2's does) into shared memory, so the row
// leaves HBM once. Pass 1: each thread runs an online softmax (running max and sum of
// exp(x - max)) over its 16-byte chunks of the first V columns, a chunk at a time; the block
// combines the pairs, giving logsumexp. Pass 2 (dloss != 0): each thread re-reads its own
// chunks and overwrites them with (softmax - onehot) * dloss in bf16, zeros in the padded
// columns. The exponentials run on the special-function unit (exp2 of an FFMA), a few
// instructions an element in each pass. A thread only ever writes the chunks it read, and
// the one cross-thread read (the target logit, by thread 0) happens before the block's first
// barrier, so in place is safe.
//
// Vocabulary-parallel halves: cross_entropy_partials_kernel is pass 1 and the block combine
// above on one rank's slice (the same code, block_softmax_stats), writing (m, s, target
// logit) instead of logsumexp; cross_entropy_finish_kernel combines the R ranks' pairs in rank
// order on one thread and runs pass 2 with the global column index. With R = 1 the combine
// returns m and s unchanged, so lse, the losses and the dlogits are the fused kernel's bits.
// A masked row (kMaskedTarget) runs both passes as any other, with loss 0 and dloss 0.
//
// Under a delayed per-tensor scale the FP8 LM head's gradient operand comes from pass 2 itself
// (kFp8): each thread casts its BF16-rounded dlogits with the known scale and keeps their amax,
// so the logits are read once and 1 byte an element written, where the BF16 dlogits and the
// cast after them wrote 2, read 2 and wrote 1.
#include "layers/cross_entropy.h"

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/device_helpers.cuh"
#include "core/check_cuda.h"
#include "core/error.h"
#include "core/launch.cuh"
#include "core/loss_mask.h"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace device;

constexpr unsigned kFullMask = 0xffffffffu;
// 1,024 threads a row and two blocks a multiprocessor (at most 32 registers a thread): the
// fused kernel's two staged rows fill 201 of the 228 KB of shared memory.
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerMultiprocessor = 2;

// A row of at most this many bytes leaves HBM once in the fused kernel: copied into shared
// memory, and both passes read it there. GPT-2's 50,304 columns take 98 KiB. Read twice from
// global memory, the second read missed L2 (rows of 100 KB, several a multiprocessor, are
// more than the 50 MB L2 holds in flight), and the loss moved three passes' bytes: at 2.9
// TB/s, the copy ceiling (device calls 86-90, docs/PERFORMANCE.md).
constexpr int kMaxStagedRowBytes = 110 * 1024;
constexpr int kSumThreads = 1024;

constexpr float kLog2e = 1.4426950408889634f;

// 2^x on the special-function unit: ex2.approx, about 2 ulp. Results below 2^-126 flush to 0,
// which cannot move a sum that is at least 1. expf() costs about eight instructions an
// element more, and at one read and one write of 2 bytes an element the kernel was bound by
// its instructions (2 TB/s), not by the bytes (calls 49 and 52 in docs/PERFORMANCE.md).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp(x - m) as one FFMA and one MUFU: x * log2(e) - m * log2(e), with m_log2e = m * log2(e).
__device__ __forceinline__ float exp_minus(float x, float m_log2e) { return exp2_approx(fmaf(x, kLog2e, -m_log2e)); }

// (m, s) <- the online-softmax union of (m, s) and (m2, s2): max and sum of exp(x - max).
// A side with max -inf holds no elements and contributes nothing (avoids -inf - -inf).
// NaN sums propagate, so a NaN logit makes the loss NaN.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float m_new = fmaxf(m, m2);
  const float a = m == -INFINITY ? 0.0f : s * expf(m - m_new);
  const float b = m2 == -INFINITY ? 0.0f : s2 * expf(m2 - m_new);
  m = m_new;
  s = a + b;
}

// Pass 1 and the block's combine: (m, s) = max and sum of exp(x - max) over row[0, real),
// row [chunks] of 8 BF16 values each, in global or shared memory. Each thread runs an online
// softmax over its chunks c = tid, tid + 1024, ...,
// a chunk of 8 at a time: the chunk's max, a rescale of the running sum only when that max
// is a new one, then one FFMA, MUFU and FADD an element. The lanes combine by butterfly, then
// warp 0 combines the 32 warps' pairs. Every thread of the block calls it (it synchronises
// once); the result is valid in warp 0 (every lane holds the same bits: the combine is
// commutative). Shared by the fused kernel and the vocabulary-parallel partials, so that both
// compute the same bits.
__device__ __forceinline__ void block_softmax_stats(const uint4* row, int chunks, int real, float& m_out,
                                                    float& s_out) {
  __shared__ float warp_m[kWarps], warp_s[kWarps];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  float m = -INFINITY, s = 0.0f;
  for (int c = tid; c < chunks; c += kThreads) {
    float x[8];
    unpack_bf16x8(row[c], x);
    const int real_in_chunk = real - c * 8;
    if (real_in_chunk < 8) {  // the padded columns never take part
#pragma unroll
      for (int j = 0; j < 8; j++) x[j] = j < real_in_chunk ? x[j] : -INFINITY;
    }
    float chunk_max = x[0];
#pragma unroll
    for (int j = 1; j < 8; j++) chunk_max = fmaxf(chunk_max, x[j]);
    if (chunk_max > m) {
      s = m == -INFINITY ? 0.0f : s * exp_minus(m, chunk_max * kLog2e);
      m = chunk_max;
    }
    if (m != -INFINITY) {
      const float m_log2e = m * kLog2e;
#pragma unroll
      for (int j = 0; j < 8; j++) s += exp_minus(x[j], m_log2e);  // NaN x makes s NaN; -inf x adds 0
    } else {
      // Every value so far is -inf or NaN (fmaxf passes NaN over): a NaN must still reach the loss.
#pragma unroll
      for (int j = 0; j < 8; j++) s = x[j] != -INFINITY ? NAN : s;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, offset);
    const float s2 = __shfl_xor_sync(kFullMask, s, offset);
    combine(m, s, m2, s2);
  }
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? warp_m[lane] : -INFINITY;
    s = lane < kWarps ? warp_s[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float m2 = __shfl_xor_sync(kFullMask, m, offset);
      const float s2 = __shfl_xor_sync(kFullMask, s, offset);
      combine(m, s, m2, s2);
    }
  }
  m_out = m;
  s_out = s;
}

// Where pass 2 puts this thread's dlogits: BF16 values over the row (in place, the source
// itself), or, with kFp8, their FP8 codes fp8(bf16(dlogit) * scale) with the running max of
// |bf16(dlogit)| (amax bits, core/device_helpers.cuh): cast_fp8's codes and amax of the BF16
// dlogits, bit for bit, without writing or reading those.
struct DlogitsOut {
  bf16* values = nullptr;    // [chunks * 8], or
  uint8_t* codes = nullptr;  // [chunks * 8] with kFp8
  float scale = 1.0f;
  __nv_fp8_interpretation_t interp = __NV_E5M2;
  unsigned amax = 0u;
};

// Pass 2 over this thread's own chunks of the row: dlogits from source [chunks] (8 BF16
// logits each, in global or shared memory) into out, whose values may be the source itself;
// column first_col + c * 8 + j of the global vocabulary (first_col = 0 in the fused kernel). A
// chunk holding neither the target nor a padded column, nearly all of them, takes
// exp(x - lse) * dloss: one FFMA, MUFU and FMUL an element.
template <bool kFp8>
__device__ __forceinline__ void write_dlogits(DlogitsOut& out, const uint4* source, int chunks, int first_col, int V,
                                              int target, float lse, float dloss) {
  const float lse_log2e = lse * kLog2e;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    float x[8];
    unpack_bf16x8(source[c], x);
    const int col0 = first_col + c * 8;
    if (col0 + 8 > V || static_cast<unsigned>(target - col0) < 8u) {
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const int v = col0 + j;
        const float probability = exp_minus(x[j], lse_log2e);
        x[j] = v < V ? (probability - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) x[j] = exp_minus(x[j], lse_log2e) * dloss;
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int j = 0; j < 8; j++) {
        x[j] = round_bf16(x[j]);
        out.amax = max(out.amax, abs_bits(x[j]));
      }
      *reinterpret_cast<uint2*>(out.codes + c * 8) = fp8x8(x, out.scale, out.interp);
    } else {
      store_bf16x8(out.values + c * 8, x);
    }
  }
}

// kStaged: the row is first copied into dynamic shared memory, staged_row [Vp / 8] uint4,
// with every chunk of a thread in flight at once (cp.async), and both passes read it there.
// A thread reads back only the chunks it copied, so its own wait is all the synchronisation.
// kFp8: pass 2 writes the codes of the dlogits into codes [N,Vp] (DlogitsOut) and raises
// *amax, leaving the logits as they are; dloss != 0 (the launcher checks).
template <bool kStaged, bool kFp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor)
    cross_entropy_kernel(bf16* __restrict__ logits, float* __restrict__ losses, const int32_t* __restrict__ targets,
                         int V, int Vp, float dloss, uint8_t* __restrict__ codes, const float* __restrict__ scale,
                         float* amax, __nv_fp8_interpretation_t interp) {
  device::start_after_previous_kernel();
  extern __shared__ uint4 staged_row[];
  __shared__ float row_lse;
  const int tid = threadIdx.x;
  bf16* row = logits + static_cast<size_t>(blockIdx.x) * Vp;
  const int chunks = Vp / 8;
  const int target = targets[blockIdx.x];
  const bool target_valid = target >= 0 && target < V;
  const bool masked = target == kMaskedTarget;

  // Thread 0 reads the target logit before the first barrier (no thread writes before the last one).
  float target_logit = NAN;
  if (tid == 0 && target_valid) target_logit = __bfloat162float(row[target]);

  const uint4* source = reinterpret_cast<const uint4*>(row);
  if constexpr (kStaged) {
    for (int c = tid; c < chunks; c += kThreads) cp_async_16(smem_u32(staged_row + c), row + c * 8);
    cp_async_wait_all();
    source = staged_row;
  }

  // Pass 1: online softmax over the elements v < V.
  float m, s;
  block_softmax_stats(source, chunks, V, m, s);
  if (tid == 0) row_lse = m + logf(s);
  __syncthreads();
  const float lse = row_lse;
  if (tid == 0) losses[blockIdx.x] = masked ? 0.0f : target_valid ? lse - target_logit : NAN;

  if (!kFp8 && dloss == 0.0f) return;  // forward only: the logits stay as they are

  // Pass 2: dlogits over this thread's own chunks (a masked row's are (softmax - 0) * 0).
  DlogitsOut out;
  if constexpr (kFp8) {
    out.codes = codes + static_cast<size_t>(blockIdx.x) * Vp;
    out.scale = *scale;
    out.interp = interp;
  } else {
    out.values = row;
  }
  write_dlogits<kFp8>(out, source, chunks, 0, V, target, lse, masked ? 0.0f : dloss);
  if constexpr (kFp8) block_amax_update(amax, out.amax);
}

// partials [N,3] = (m, s, target logit or 0) of this rank's slice logits [N,Vs], global
// columns [vocab_begin, vocab_begin + Vs). Read only.
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor)
    cross_entropy_partials_kernel(float* __restrict__ partials, const bf16* __restrict__ logits,
                                  const int32_t* __restrict__ targets, int V, int Vs, int vocab_begin) {
  device::start_after_previous_kernel();
  const bf16* row = logits + static_cast<size_t>(blockIdx.x) * Vs;
  // Real columns of the slice: its first min(max(V - vocab_begin, 0), Vs). With one rank this
  // is V, the fused kernel's bound.
  const int real = min(max(V - vocab_begin, 0), Vs);
  float m, s;
  block_softmax_stats(reinterpret_cast<const uint4*>(row), Vs / 8, real, m, s);
  if (threadIdx.x == 0) {
    const int target = targets[blockIdx.x];
    const int local_target = target - vocab_begin;
    const bool in_slice = target >= 0 && target < V && local_target >= 0 && local_target < Vs;
    float* out = partials + static_cast<size_t>(blockIdx.x) * 3;
    out[0] = m;
    out[1] = s;
    out[2] = in_slice ? __bfloat162float(row[local_target]) : 0.0f;
  }
}

// Losses and (dloss != 0) dlogits of this rank's slice logits [N,Vs] from all_partials
// [R,N,3]. Thread 0 combines the ranks' pairs in rank order; the block then runs pass 2.
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor)
    cross_entropy_finish_kernel(bf16* __restrict__ logits, float* __restrict__ losses,
                                const float* __restrict__ all_partials, const int32_t* __restrict__ targets, int N,
                                int V, int Vs, int vocab_begin, int R, float dloss) {
  device::start_after_previous_kernel();
  __shared__ float row_lse;
  const int i = blockIdx.x;
  const int target = targets[i];
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int r = 0; r < R; r++) m = fmaxf(m, all_partials[(static_cast<size_t>(r) * N + i) * 3]);
    float s = 0.0f;
    for (int r = 0; r < R; r++) {
      const float m_r = all_partials[(static_cast<size_t>(r) * N + i) * 3];
      const float s_r = all_partials[(static_cast<size_t>(r) * N + i) * 3 + 1];
      // A rank without real columns adds nothing (and no -inf - -inf); the rank holding the
      // max adds s_r as is (exp(0) = 1): with R = 1 this leaves m and s unchanged.
      if (m_r != -INFINITY) s += m_r == m ? s_r : s_r * expf(m_r - m);
    }
    const float lse = m + logf(s);
    row_lse = lse;
    const bool target_valid = target >= 0 && target < V;  // then target / Vs < R (V <= R * Vs)
    losses[i] = target == kMaskedTarget ? 0.0f
                : target_valid          ? lse - all_partials[(static_cast<size_t>(target / Vs) * N + i) * 3 + 2]
                                        : NAN;
  }
  __syncthreads();
  if (dloss == 0.0f) return;  // forward only: the logits stay as they are
  bf16* row = logits + static_cast<size_t>(i) * Vs;
  DlogitsOut out;
  out.values = row;
  write_dlogits<false>(out, reinterpret_cast<const uint4*>(row), Vs / 8, vocab_begin, V, target, row_lse,
                       target == kMaskedTarget ? 0.0f : dloss);
}

// *total += sum(losses): each thread sums a fixed strided subset in order, then a fixed tree.
__global__ void __launch_bounds__(kSumThreads) sum_losses_kernel(float* total, const float* __restrict__ losses, int N) {
  device::start_after_previous_kernel();
  __shared__ float partial[kSumThreads];
  const int tid = threadIdx.x;
  float sum = 0.0f;
  for (int i = tid; i < N; i += kSumThreads) sum += losses[i];
  partial[tid] = sum;
  __syncthreads();
  for (int stride = kSumThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  if (tid == 0) *total += partial[0];
}

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

}  // namespace

namespace {

// The fused kernel for one row width: staged in shared memory when the row fits.
template <bool kFp8>
void launch_cross_entropy(bf16* logits, float* losses, const int32_t* targets, int N, int V, int Vp, float dloss,
                          const DlogitCodes& dlogit_codes, cudaStream_t stream) {
  const __nv_fp8_interpretation_t interp = dlogit_codes.dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2;
  const size_t row_bytes = static_cast<size_t>(Vp) * sizeof(bf16);
  if (row_bytes <= kMaxStagedRowBytes) {
    // Above 48 KB of dynamic shared memory a kernel must opt in, once.
    static const bool opted_in = [] {
      CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel<true, kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kMaxStagedRowBytes));
      return true;
    }();
    (void)opted_in;
    launch_kernel(cross_entropy_kernel<true, kFp8>, N, kThreads, row_bytes, stream, logits, losses, targets, V, Vp,
                  dloss, dlogit_codes.codes, dlogit_codes.scale, dlogit_codes.amax, interp);
  } else {
    launch_kernel(cross_entropy_kernel<false, kFp8>, N, kThreads, 0, stream, logits, losses, targets, V, Vp, dloss,
                  dlogit_codes.codes, dlogit_codes.scale, dlogit_codes.amax, interp);
  }
}

void check_fused_loss(const char* what, bf16* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                      float dloss) {
  FP8LM_CHECK(N >= 0, what, ": N must be >= 0, got ", N);
  FP8LM_CHECK(V > 0 && V <= Vp && Vp % 8 == 0, what, ": needs 0 < V <= Vp and Vp % 8 == 0, got V=", V, " Vp=", Vp);
  FP8LM_CHECK(std::isfinite(dloss), what, ": dloss must be finite, got ", dloss);
  if (N == 0) return;
  FP8LM_CHECK(logits != nullptr && losses != nullptr && targets != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(logits, 16), what, ": logits must be 16-byte aligned");
}

}  // namespace

void cross_entropy_forward_backward(bf16* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss, cudaStream_t stream) {
  check_fused_loss("cross_entropy_forward_backward", logits, losses, targets, N, V, Vp, dloss);
  if (N == 0) return;
  launch_cross_entropy<false>(logits, losses, targets, N, V, Vp, dloss, DlogitCodes{}, stream);
}

void cross_entropy_forward_backward(bf16* logits, float* losses, const int32_t* targets, int N, int V, int Vp,
                                    float dloss, const DlogitCodes& dlogit_codes, cudaStream_t stream) {
  const char* what = "cross_entropy_forward_backward to FP8 dlogits";
  check_fused_loss(what, logits, losses, targets, N, V, Vp, dloss);
  FP8LM_CHECK(dloss != 0.0f, what, ": needs dloss != 0 (a forward-only loss writes no dlogits)");
  if (N == 0) return;
  FP8LM_CHECK(dlogit_codes.codes != nullptr && dlogit_codes.scale != nullptr && dlogit_codes.amax != nullptr, what,
              ": null pointer");
  FP8LM_CHECK(aligned(dlogit_codes.codes, 8), what, ": the codes must be 8-byte aligned");
  launch_cross_entropy<true>(logits, losses, targets, N, V, Vp, dloss, dlogit_codes, stream);
}

namespace {

void check_vocab_slice(const char* what, int N, int V, int Vs, int vocab_begin) {
  FP8LM_CHECK(N >= 0, what, ": N must be >= 0, got ", N);
  FP8LM_CHECK(V > 0 && Vs > 0 && Vs % 8 == 0, what, ": needs V > 0 and Vs a positive multiple of 8, got V=", V,
              " Vs=", Vs);
  FP8LM_CHECK(vocab_begin >= 0 && vocab_begin % Vs == 0, what, ": vocab_begin must be a multiple of Vs=", Vs,
              ", got ", vocab_begin);
}

}  // namespace

void cross_entropy_partials(float* partials, const bf16* logits, const int32_t* targets, int N, int V, int Vs,
                            int vocab_begin, cudaStream_t stream) {
  const char* what = "cross_entropy_partials";
  check_vocab_slice(what, N, V, Vs, vocab_begin);
  if (N == 0) return;
  FP8LM_CHECK(partials != nullptr && logits != nullptr && targets != nullptr, what, ": null pointer");
  FP8LM_CHECK(aligned(logits, 16), what, ": logits must be 16-byte aligned");
  launch_kernel(cross_entropy_partials_kernel, N, kThreads, 0, stream, partials, logits, targets, V, Vs, vocab_begin);
}

void cross_entropy_finish(bf16* logits, float* losses, const float* all_partials, const int32_t* targets, int N,
                          int V, int Vs, int vocab_begin, int R, float dloss, cudaStream_t stream) {
  const char* what = "cross_entropy_finish";
  check_vocab_slice(what, N, V, Vs, vocab_begin);
  FP8LM_CHECK(R >= 1 && vocab_begin / Vs < R && static_cast<int64_t>(V) <= static_cast<int64_t>(R) * Vs, what,
              ": needs R >= 1, vocab_begin < R*Vs and V <= R*Vs, got R=", R, " Vs=", Vs,
              " vocab_begin=", vocab_begin, " V=", V);
  FP8LM_CHECK(std::isfinite(dloss), what, ": dloss must be finite, got ", dloss);
  if (N == 0) return;
  FP8LM_CHECK(logits != nullptr && losses != nullptr && all_partials != nullptr && targets != nullptr, what,
              ": null pointer");
  FP8LM_CHECK(aligned(logits, 16), what, ": logits must be 16-byte aligned");
  launch_kernel(cross_entropy_finish_kernel, N, kThreads, 0, stream, logits, losses, all_partials, targets, N, V, Vs,
                vocab_begin, R, dloss);
}

void sum_losses(float* total, const float* losses, int N, cudaStream_t stream) {
  FP8LM_CHECK(N >= 0, "sum_losses: N must be >= 0, got ", N);
  FP8LM_CHECK(total != nullptr && (N == 0 || losses != nullptr), "sum_losses: null pointer");
  launch_kernel(sum_losses_kernel, 1, kSumThreads, 0, stream, total, losses, N);
}

}  // namespace fp8lm::cuda
