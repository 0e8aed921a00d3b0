// Tensor-core tile helpers shared by the flash-attention kernels (attention_forward.cuh,
// attention_backward_dkdv.cuh, attention_backward_dq.cuh, all compiled in attention.cu):
// cp.async tile loads, ldmatrix addressing, the mma.sync wrapper, the warp-level products
// the kernels are built from, and the reads of the documents' first keys. Device code only;
// included by those files.
//
// ---- Tensor-core building blocks ---------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D[16x8] += A[16x16] B[16x8].
// With g = lane/4 and c = 2*(lane%4) (the thread's "group" row and column pair):
//   A regs a0..a3: (row g, k c..c+1), (row g+8, k c..c+1), (row g, k c+8..), (row g+8, k c+8..)
//   B regs b0,b1:  (k c..c+1, col g), (k c+8..c+9, col g)
//   C regs c0..c3: (row g, col c), (row g, col c+1), (row g+8, col c), (row g+8, col c+1)
// The C fragments of two adjacent n-tiles (16 columns) are exactly an A fragment of those
// 16 columns as k, which lets P (or dS) feed the next mma straight from registers.
// Operands come from shared memory with ldmatrix.x4 (four 8x8 bf16 matrices):
//   A fragment, rows r0..r0+15 x cols k0..k0+15 of a row-major tile:  ldsm_a_addr.
//   B fragment when the tile stores B^T (rows = n, cols = k; e.g. K for S = Q K^T): two
//     n-tiles (16 n) x 16 k per ldmatrix (non-transposed):               ldsm_bt_addr.
//   B fragment when the tile stores B (rows = k, cols = n; e.g. V for O = P V): two n-tiles
//     per ldmatrix.trans, same addresses as the A pattern:               ldsm_a_addr.
// Shared tiles are [rows][HS + 8] bf16: the 16-byte pad shifts consecutive rows by 16 bytes
// mod 128, so the eight 16-byte row reads of every ldmatrix phase hit distinct banks.
//
// All kernels use 4 warps (128 threads). Global -> shared copies are cp.async (16 bytes,
// zero-filled past T, so padding rows are exact zeros: a NaN there would survive P = 0).
//
// ---- Warp products -----------------------------------------------------------------------
// A warp owns 16 rows (queries; keys in dK/dV) and multiplies them by a shared tile:
//   acc[16 x N] += A[16 x HS] Bt^T, Bt a [N][HS] tile (S = Q K^T, S^T = K Q^T, dP = dO V^T,
//     dP^T = V dO^T): per k-step kk of the head dim, load_a_kstep then mma_a_bt_kstep.
//   acc[16 x HS] += bf16(P)[16 x N] B, B a [N][HS] tile (dV += P^T dO, dK += dS^T Q,
//     dQ += dS K): mma_p_b, P (or dS) straight from the accumulators.
// The kk loop of the first product, and its A fragment `uint32_t a[4]`, stay in the kernels:
// with either inside a helper, NVVM orders the dK/dV kernel's loop-carried accumulators
// differently and ptxas allocates its registers differently (found by comparing the
// generated code; the other kernels happen not to be affected). The forward,
// whose warps own 16*MT rows, keeps its own loops so that one ldmatrix of K or V serves all
// MT row blocks; it shares acc_to_a and zero.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/device_helpers.cuh"

namespace fp8lm::cuda {

// Internal linkage, as for the kernels that use these helpers (no relocatable device code).
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeyTile = 64;  // keys per K/V tile (forward, dQ) and per dK/dV block
constexpr float kLog2e = 1.4426950408889634f;

// ---- the block's (batch, head) ---------------------------------------------------------------
// Every attention kernel runs on grid (tiles, NH, B): blockIdx.y is the head, blockIdx.z the
// batch row. Head finds the head's row 0 in each packed tensor: q, k, v in qkv and dqkv
// [B,T,3C] (row stride 3C), its columns in out and dout [B,T,C], its [T] statistics in lse
// and D [B,NH,T].
struct Head {
  size_t C;
  size_t qkv_stride;  // 3C
  size_t qkv_offset;  // b*T*3C + h*HS: q's row 0 (k and v follow at +C, +2C)
  size_t out_offset;  // b*T*C + h*HS
  size_t stats;       // (b*NH + h)*T
  int first_row;      // b*T: the sequence's first row of the [B*T, ...] matrices
  int first_column;   // h*HS: the head's first column within q's (k's, v's) third
  template <typename Element>
  __device__ Element* q(Element* qkv) const {
    return qkv + qkv_offset;
  }
  template <typename Element>
  __device__ Element* k(Element* qkv) const {
    return qkv + qkv_offset + C;
  }
  template <typename Element>
  __device__ Element* v(Element* qkv) const {
    return qkv + qkv_offset + 2 * C;
  }
  template <typename Element>
  __device__ Element* rows(Element* out) const {
    return out + out_offset;
  }
};

template <int HS>
__device__ __forceinline__ Head this_head(int T, int C, int NH) {
  const size_t h = blockIdx.y;
  const size_t b = blockIdx.z;
  return Head{.C = static_cast<size_t>(C),
              .qkv_stride = 3 * static_cast<size_t>(C),
              .qkv_offset = b * T * 3 * C + h * HS,
              .out_offset = b * T * C + h * HS,
              .stats = (b * NH + h) * T,
              .first_row = static_cast<int>(b * T),
              .first_column = static_cast<int>(h * HS)};
}

// ---- documents (layers/attention.h) -------------------------------------------------------
// document_starts [B,T] holds first[t], the first key that query t sees; along a row it is
// nondecreasing, and first[t] <= t. The kernels take a template flag kDocuments: without it
// they never read the pointer and compile to the code they had before documents existed;
// with it they mask s < first[t] beside the causal mask, and skip the tiles that
// monotonicity shows to be invisible to every row of a block or warp.

// This block's batch row of first[] (blockIdx.z is the batch row).
__device__ __forceinline__ const int32_t* document_row(const int32_t* document_starts, int T) {
  return document_starts + static_cast<size_t>(blockIdx.z) * T;
}

// first[t], t clamped to T - 1: rows past T (padding, never stored) read a valid address.
__device__ __forceinline__ int first_key_of(const int32_t* first, int t, int T) { return first[min(t, T - 1)]; }

// How many of the query tiles qt_begin..n_qt-1 (BQ queries each) have first[] <= key at their
// first row (or, with last_rows, at their last row, < T). first[] is nondecreasing, so they
// are the first ones of the walk. Every thread of the block calls it (a block-wide count).
__device__ __forceinline__ int query_tiles_with_first_at_most(const int32_t* first, int qt_begin, int n_qt, int BQ,
                                                               int T, int key, bool last_rows) {
  int count = 0;
  for (int qt0 = qt_begin; qt0 < n_qt; qt0 += kThreads) {
    const int qt = qt0 + static_cast<int>(threadIdx.x);
    bool reaches = false;
    if (qt < n_qt) reaches = first[last_rows ? min(qt * BQ + BQ, T) - 1 : qt * BQ] <= key;
    count += __syncthreads_count(reaches);
  }
  return count;
}

// ---- small device helpers -----------------------------------------------------------------

using device::cp_async_16;
using device::cp_async_commit;
using device::cp_async_wait;
using device::round_bf16;
using device::smem_u32;

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A B, m16n8k16, BF16 inputs, FP32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One lane's share of D = rowsum(dO * O): the 8 values of a 16-byte chunk of dO and of O, in
// this order (the row-dot kernel and the wgmma dQ kernel both sum D this way: the same bits).
__device__ __forceinline__ float dot_bf16x8(const bf16* dout_chunk, const bf16* out_chunk) {
  const uint4 a = *reinterpret_cast<const uint4*>(dout_chunk);
  const uint4 o = *reinterpret_cast<const uint4*>(out_chunk);
  const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 af = __bfloat1622float2(a2[i]);
    const float2 of = __bfloat1622float2(o2[i]);
    sum += af.x * of.x + af.y * of.y;
  }
  return sum;
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte address (shared window) of this lane's row for an A-pattern ldmatrix.x4 (also the
// B pattern of ldmatrix.x4.trans) over rows r0..r0+15, cols c0..c0+15 of a [*][LD] tile.
template <int LD>
__device__ __forceinline__ uint32_t ldsm_a_addr(uint32_t tile, int r0, int c0, int lane) {
  const int row = r0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int col = c0 + (lane >> 4) * 8;
  return tile + static_cast<uint32_t>((row * LD + col) * 2);
}
// Byte address for a B fragment stored transposed (rows = n): rows n0..n0+15, cols k0..k0+15.
// Registers: r[0], r[1] = b0, b1 of n-tile n0; r[2], r[3] = b0, b1 of n-tile n0+8.
template <int LD>
__device__ __forceinline__ uint32_t ldsm_bt_addr(uint32_t tile, int n0, int k0, int lane) {
  const int row = n0 + (lane & 7) + (lane >> 4) * 8;
  const int col = k0 + ((lane >> 3) & 1) * 8;
  return tile + static_cast<uint32_t>((row * LD + col) * 2);
}

// Async copy of ROWS rows x HS bf16 (rows row0.. of a head's q, k, v or dout, row stride
// `stride` elements from `base` = the head's row 0) into a [ROWS][HS+8] shared tile.
// Rows >= T are zero-filled and read nothing (the source address stays `base`).
template <int HS, int ROWS>
__device__ __forceinline__ void load_tile_async(bf16* tile, const bf16* base, size_t stride, int row0, int T) {
  constexpr int kChunks = HS / 8;  // 16-byte chunks per row
  constexpr int LD = HS + 8;
  static_assert((ROWS * kChunks) % kThreads == 0, "every thread copies the same number of chunks");
  const uint32_t tile_addr = smem_u32(tile);
#pragma unroll
  for (int j = 0; j < ROWS * kChunks / kThreads; ++j) {
    const int i = j * kThreads + static_cast<int>(threadIdx.x);
    const int r = i / kChunks;
    const int c = i % kChunks;
    const bool valid = row0 + r < T;
    const bf16* src = base + (valid ? static_cast<size_t>(row0 + r) * stride : 0) + c * 8;
    cp_async_16(tile_addr + static_cast<uint32_t>((r * LD + c * 8) * 2), src, valid);
  }
}

// Publishes cp.async writes to the async proxy (wgmma's operand reads); sm_90 and later.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The walked-tile handshake of every kernel here: issue `load_next` (the next tile, when
// there is one) as its own cp.async group, wait for all older groups (so the current tile has
// landed), and sync the block. kForWgmma also fences the copies for wgmma's reads.
template <bool kForWgmma, typename LoadNext>
__device__ __forceinline__ void current_tile_ready(bool has_next, LoadNext&& load_next) {
  if (has_next) {
    load_next();
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  if constexpr (kForWgmma) fence_proxy_async();
  __syncthreads();
}

// This thread's place in its block: warp, lane, and the m16n8 fragment coordinates
// g = lane / 4 (rows g and g + 8) and c2 = 2 * (lane % 4) (columns c2 and c2 + 1).
struct ThreadPlace {
  int warp, lane, g, c2;
};
__device__ __forceinline__ ThreadPlace this_thread() {
  const int lane = static_cast<int>(threadIdx.x % 32);
  return ThreadPlace{static_cast<int>(threadIdx.x / 32), lane, lane >> 2, 2 * (lane & 3)};
}

// ---- warp products ------------------------------------------------------------------------

// A fragment of k-step kk (16 columns as k) from the C fragments of n-tiles 2*kk and
// 2*kk+1 of a [16 x 8*N] accumulator, rounded to bf16: P (or dS) as the next mma's A.
template <int N>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&acc)[N][4], int kk) {
  a[0] = pack_bf16x2(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack_bf16x2(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack_bf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack_bf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// A fragment of k-step kk (head-dim columns 16*kk..16*kk+15) of this warp's 16 rows: with
// IN_REGS from a_frag[kk] (all HS/16 fragments loaded once per block), else from rows
// a_row0..a_row0+15 of the [*][HS+8] shared tile at a_tile.
template <int HS, bool IN_REGS, int AF>
__device__ __forceinline__ void load_a_kstep(uint32_t (&a)[4], const uint32_t (&a_frag)[AF][4], uint32_t a_tile,
                                             int a_row0, int kk, int lane) {
  constexpr int LD = HS + 8;
  static_assert(!IN_REGS || AF == HS / 16, "one register fragment per k-step");
  if constexpr (IN_REGS) {
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = a_frag[kk][e];
  } else {
    ldsm_x4(a, ldsm_a_addr<LD>(a_tile, a_row0, kk * 16, lane));
  }
}

// k-step kk of acc [16 x 8*N] += A [16 x HS] Bt^T, one warp: a = A's fragment of k-step kk
// (load_a_kstep), Bt = rows 0..8*N-1 of the [*][HS+8] shared tile at bt_tile, i.e. B stored
// transposed (rows = n), as K is for S = Q K^T. The caller loops kk over 0..HS/16-1.
template <int HS, int N>
__device__ __forceinline__ void mma_a_bt_kstep(float (&acc)[N][4], const uint32_t (&a)[4], uint32_t bt_tile, int kk,
                                               int lane) {
  constexpr int LD = HS + 8;
#pragma unroll
  for (int np = 0; np < N / 2; ++np) {
    uint32_t b[4];
    ldsm_x4(b, ldsm_bt_addr<LD>(bt_tile, np * 16, kk * 16, lane));
    mma_bf16(acc[2 * np], a, b[0], b[1]);
    mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
  }
}

// acc [16 x HS] += bf16(P) [16 x 8*N] B, one warp. P: this warp's accumulators (P or dS,
// N n-tiles), fed to the mma through acc_to_a. B: rows 0..8*N-1 of the [*][HS+8] shared tile
// at b_tile, stored as [k][n] (as V is for O = P V), read with ldmatrix.trans.
template <int HS, int N>
__device__ __forceinline__ void mma_p_b(float (&acc)[HS / 8][4], const float (&p)[N][4], uint32_t b_tile, int lane) {
  constexpr int LD = HS + 8;
#pragma unroll
  for (int kk = 0; kk < N / 2; ++kk) {
    uint32_t a[4];
    acc_to_a(a, p, kk);
#pragma unroll
    for (int np = 0; np < HS / 16; ++np) {
      uint32_t b[4];
      ldsm_x4_trans(b, ldsm_a_addr<LD>(b_tile, kk * 16, np * 16, lane));
      mma_bf16(acc[2 * np], a, b[0], b[1]);
      mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc = 0 for a [16 x 8*N] accumulator.
template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
}

}  // namespace

}  // namespace fp8lm::cuda
