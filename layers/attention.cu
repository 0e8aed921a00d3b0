// Causal flash attention on Hopper with mma.sync (FA2 style): BF16 inputs/outputs, FP32
// accumulation, FP32 softmax statistics, O(T) memory (no T x T matrix ever reaches global
// memory). The readable specification is the CPU reference in layers/attention.cpp.
//
// Notation: B batch, T sequence, C channels, NH heads, HS = C/NH head size (32, 64 or 128).
// qkv [B,T,3C] packs q | k | v; head h reads columns [h*HS, (h+1)*HS) of each third, so
// one head's q (or k, v) rows are HS contiguous bf16 with a row stride of 3C.
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
// ---- Kernels -----------------------------------------------------------------------------
// All kernels use 4 warps (128 threads). Global -> shared copies are cp.async (16 bytes,
// zero-filled past T, so padding rows are exact zeros: a NaN there would survive P = 0).
//
// forward  grid (ceil(T/BR), NH, B), query blocks scheduled longest first.
//   BR = 64*MT queries per block, each warp owns 16*MT query rows (MT = 2 for HS <= 64, 1 for
//   HS = 128: registers); K/V tiles of BC = 64 keys, double-buffered in shared memory. Per key
//   tile: S = Q K^T (Q fragments live in registers), causal mask only on tiles that cross the
//   diagonal or T, online softmax on the raw scores with p = exp2(S*sl2 - m*sl2) (one FFMA,
//   sl2 = log2(e)/sqrt(HS)), O += P V (P in bf16 straight from the accumulators). Tiles above
//   the diagonal are never loaded; a warp whose rows all precede the tile skips its mma work.
//   Epilogue: O / l -> bf16 (optionally FP8 + amax), lse = ln2 * (m*sl2 + log2 l).
//   smem: Q [BR][HS+8] + K,V [2][64][HS+8]   (HS=64: 55,296 B; HS=128: 87,040 B).
// backward (three kernels, no atomics, each output element written once by one thread):
//   1. D[b,h,t] = dout_t . out_t (HS/8 lanes per (b,t,h), 16-byte loads, fixed shuffle
//      order) -> scratch [B,NH,T].
//   2. dK/dV: grid (ceil(T/64), NH, B); a block owns 64 keys (16 per warp), keeps K and V
//      (fragments in registers for HS <= 64), and walks the query tiles (BQ = 64, or 32 for
//      HS = 128) from its diagonal to T, double-buffering Q, dO, lse, D. Per tile:
//      S^T = K Q^T, P^T = exp2(S^T*scale*log2e - lse*log2e), dV += P^T dO,
//      dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.  dK *= 1/sqrt(HS) at the end.
//      smem: K,V [64][HS+8] + Q,dO [2][BQ][HS+8] + lse,D [2][BQ]  (HS=64: 56,320 B).
//   3. dQ: grid (ceil(T/64), NH, B); a block owns 64 queries (16 per warp) with Q, dO in
//      registers (HS <= 64) and walks the key tiles 0..diagonal, double-buffering K, V:
//      S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dQ += dS K.  dQ *= 1/sqrt(HS).
//      smem: Q,dO [64][HS+8] + K,V [2][64][HS+8]  (HS=64: 55,296 B).
//   The dQ kernel recomputes S and dP (7 GEMM-shaped products in all instead of FA2's 5):
//   the price of determinism without a T x T buffer or floating-point atomics.

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/error.h"
#include "layers/attention.h"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeyTile = 64;  // keys per K/V tile (forward, dQ) and per dK/dV block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- small device helpers -----------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; valid == false zero-fills the 16 bytes (src unread).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

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

__device__ __forceinline__ uint32_t amax_bits(float v) {  // |v| as ordered bits; NaN -> 0x7fc00000
  return isnan(v) ? 0x7fc00000u : __float_as_uint(fabsf(v));
}

// ---- forward ---------------------------------------------------------------------------------

template <int HS, int MT>
struct ForwardConfig {
  static constexpr int LD = HS + 8;
  static constexpr int BR = kWarps * 16 * MT;  // queries per block
  static constexpr int BC = kKeyTile;          // keys per tile
  static constexpr size_t smem_bytes = static_cast<size_t>(BR + 4 * BC) * LD * sizeof(bf16);
};

// out [B,T,C], lse [B,NH,T], out_fp8 [B,T,C] (nullable), out_amax (nullable), out_scale
// (nullable = 1), qkv [B,T,3C]. sl2 = log2(e)/sqrt(HS).
template <int HS, int MT>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, uint8_t* __restrict__ out_fp8,
                             float* __restrict__ out_amax, const float* __restrict__ out_scale, bool e5m2,
                             const bf16* __restrict__ qkv, int T, int C, int NH, float sl2) {
  using Cfg = ForwardConfig<HS, MT>;
  constexpr int LD = Cfg::LD, BR = Cfg::BR, BC = Cfg::BC;
  constexpr int KT = HS / 16;  // k-steps over the head dim (S = Q K^T)
  constexpr int NT = HS / 8;   // n-tiles over the head dim (O)
  constexpr int SN = BC / 8;   // n-tiles over the keys of one tile (S)

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [BR][LD]
  bf16* sK = sQ + BR * LD;                       // [2][BC][LD]
  bf16* sV = sK + 2 * BC * LD;                   // [2][BC][LD]

  const int qb = gridDim.x - 1 - blockIdx.x;  // the longest (last) query blocks start first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int c2 = 2 * (lane & 3);

  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* q_base = qkv + static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * HS;
  const bf16* k_base = q_base + C;
  const bf16* v_base = q_base + 2 * static_cast<size_t>(C);

  const int q0 = qb * BR;
  const int q_last = min(q0 + BR, T) - 1;  // last valid query of the block
  const int n_kt = q_last / BC + 1;        // key tiles 0..n_kt-1 reach the diagonal (all keys < T)
  const int warp_q0 = q0 + warp * 16 * MT;
  const int warp_q_last = warp_q0 + 16 * MT - 1;

  load_tile_async<HS, BR>(sQ, q_base, stride, q0, T);
  load_tile_async<HS, BC>(sK, k_base, stride, 0, T);
  load_tile_async<HS, BC>(sV, v_base, stride, 0, T);
  cp_async_commit();

  uint32_t qf[MT][KT][4];
  float o[MT][NT][4];
  float m[MT][2], l[MT][2];  // running max of the raw scores and this thread's partial row sums
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {  // prefetch the next tile into the other buffer (freed by the last sync)
      load_tile_async<HS, BC>(sK + (buf ^ 1) * BC * LD, k_base, stride, (kt + 1) * BC, T);
      load_tile_async<HS, BC>(sV + (buf ^ 1) * BC * LD, v_base, stride, (kt + 1) * BC, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (kt == 0) {  // Q fragments: each warp reads only its own rows of sQ
      const uint32_t q_addr = smem_u32(sQ);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
          ldsm_x4(qf[mt][kk], ldsm_a_addr<LD>(q_addr, warp * 16 * MT + mt * 16, kk * 16, lane));
    }

    const int k0 = kt * BC;
    if (k0 <= warp_q_last && warp_q0 < T) {  // warp-uniform: skip tiles wholly above its rows
      const uint32_t k_addr = smem_u32(sK + buf * BC * LD);
      const uint32_t v_addr = smem_u32(sV + buf * BC * LD);

      // S = Q K^T  [16*MT x BC] per warp
      float s[MT][SN][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < SN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
          uint32_t kb[4];
          ldsm_x4(kb, ldsm_bt_addr<LD>(k_addr, np * 16, kk * 16, lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(s[mt][2 * np], qf[mt][kk], kb[0], kb[1]);
            mma_bf16(s[mt][2 * np + 1], qf[mt][kk], kb[2], kb[3]);
          }
        }
      }

      // Causal mask (s > t, and s >= T) only on tiles that cross the diagonal or T. S stays
      // unscaled: the max is taken on raw scores and exp2(S*sl2 - m*sl2) is one FFMA.
      if ((k0 + BC - 1 > warp_q0) || (k0 + BC > T)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = warp_q0 + mt * 16 + g + (e >> 1) * 8;
              const int col = k0 + nt * 8 + c2 + (e & 1);
              if (col > row || col >= T) s[mt][nt][e] = -INFINITY;
            }
      }

      // Online softmax, per row r (g and g+8); the 4 threads of a quad share a row.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < SN; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][r], mx);
          const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;  // a row with no key yet
          const float alpha = fast_exp2((m[mt][r] - m_use) * sl2);  // m_old = -inf -> 0
          const float m_scaled = m_use * sl2;
          m[mt][r] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < SN; ++nt) {
            const float p0 = fast_exp2(fmaf(s[mt][nt][2 * r], sl2, -m_scaled));
            const float p1 = fast_exp2(fmaf(s[mt][nt][2 * r + 1], sl2, -m_scaled));
            s[mt][nt][2 * r] = p0;
            s[mt][nt][2 * r + 1] = p1;
            sum += p0 + p1;
          }
          l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            o[mt][nt][2 * r] *= alpha;
            o[mt][nt][2 * r + 1] *= alpha;
          }
        }
      }

      // O += P V: P (bf16) straight from the S accumulators, V via ldmatrix.trans.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pa[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pa[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pa[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t vb[4];
          ldsm_x4_trans(vb, ldsm_a_addr<LD>(v_addr, kk * 16, np * 16, lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][2 * np], pa[mt], vb[0], vb[1]);
            mma_bf16(o[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
          }
        }
      }
    }
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  }

  // Epilogue: normalise, write bf16 (+ FP8 and amax), lse. Direct 4-byte (2-byte FP8) stores.
  const float fp8_scale = out_scale != nullptr ? *out_scale : 1.0f;
  const __nv_fp8_interpretation_t fp8_kind = e5m2 ? __NV_E5M2 : __NV_E4M3;
  uint32_t amax = 0;
  const size_t bh = static_cast<size_t>(b) * NH + h;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float row_l = l[mt][r];
      row_l += __shfl_xor_sync(0xffffffffu, row_l, 1);
      row_l += __shfl_xor_sync(0xffffffffu, row_l, 2);
      const int row = warp_q0 + mt * 16 + g + r * 8;
      if (row < T) {
        const float inv_l = row_l > 0.0f ? 1.0f / row_l : 0.0f;
        if ((lane & 3) == 0) lse[bh * T + row] = (m[mt][r] * sl2 + log2f(row_l)) * kLn2;
        const size_t row_off = (static_cast<size_t>(b) * T + row) * C + static_cast<size_t>(h) * HS;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const size_t idx = row_off + nt * 8 + c2;
          const __nv_bfloat162 v = __floats2bfloat162_rn(o[mt][nt][2 * r] * inv_l, o[mt][nt][2 * r + 1] * inv_l);
          *reinterpret_cast<__nv_bfloat162*>(out + idx) = v;
          const float v0 = __low2float(v);
          const float v1 = __high2float(v);
          amax = max(amax, max(amax_bits(v0), amax_bits(v1)));
          if (out_fp8 != nullptr) {
            const uint32_t f0 = __nv_cvt_float_to_fp8(v0 * fp8_scale, __NV_SATFINITE, fp8_kind);
            const uint32_t f1 = __nv_cvt_float_to_fp8(v1 * fp8_scale, __NV_SATFINITE, fp8_kind);
            *reinterpret_cast<uint16_t*>(out_fp8 + idx) = static_cast<uint16_t>(f0 | (f1 << 8));
          }
        }
      }
    }
  }
  if (out_amax != nullptr) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (lane == 0 && amax != 0) atomicMax(reinterpret_cast<unsigned int*>(out_amax), amax);
  }
}

// ---- backward: D = rowsum(dout * out) -----------------------------------------------------------

// D [B,NH,T] (written), dout [B,T,C], out [B,T,C]. G = HS/8 consecutive lanes share one
// (b, t, h) row, each lane one 16-byte chunk (8 bf16) of dout and out, then a fixed xor
// shuffle tree over the G lanes: deterministic. rows = B*T*NH < 2^31 (checked on the host).
template <int HS>
__global__ void __launch_bounds__(256)
    attention_backward_dot_kernel(float* __restrict__ D, const bf16* __restrict__ dout, const bf16* __restrict__ out,
                                  int rows, int T, int C, int NH) {
  constexpr int G = HS / 8;  // lanes per row: 4, 8 or 16
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = gid / G;  // (b*T + t)*NH + h
  const int chunk = gid % G;
  float sum = 0.0f;
  if (row < rows) {
    const int h = row % NH;
    const int bt = row / NH;
    const size_t off = static_cast<size_t>(bt) * C + static_cast<size_t>(h) * HS + chunk * 8;
    const uint4 a = *reinterpret_cast<const uint4*>(dout + off);
    const uint4 o = *reinterpret_cast<const uint4*>(out + off);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 af = __bfloat1622float2(a2[i]);
      const float2 of = __bfloat1622float2(o2[i]);
      sum += af.x * of.x + af.y * of.y;
    }
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

// ---- backward: dK, dV ---------------------------------------------------------------------------

template <int HS>
struct DkDvConfig {
  static constexpr int LD = HS + 8;
  static constexpr int BK = kKeyTile;          // keys per block (16 per warp)
  static constexpr int BQ = HS <= 64 ? 64 : 32;  // queries per tile (32: measured slower for HS=64)
  static constexpr bool kv_in_regs = HS <= 64;   // K/V fragments held in registers
  static constexpr size_t smem_bytes =
      static_cast<size_t>(2 * BK + 4 * BQ) * LD * sizeof(bf16) + 4 * BQ * sizeof(float);
};

// dqkv [B,T,3C]: writes the k and v thirds. dout [B,T,C], qkv [B,T,3C], lse [B,NH,T],
// D [B,NH,T]. sl2 = log2(e)/sqrt(HS), scale = 1/sqrt(HS).
template <int HS>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dkdv_kernel(bf16* __restrict__ dqkv, const bf16* __restrict__ dout,
                                   const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                   const float* __restrict__ D, int T, int C, int NH, float sl2, float scale) {
  using Cfg = DkDvConfig<HS>;
  constexpr int LD = Cfg::LD, BK = Cfg::BK, BQ = Cfg::BQ;
  constexpr int KT = HS / 16;  // k-steps over the head dim
  constexpr int NT = HS / 8;   // n-tiles over the head dim (dK, dV)
  constexpr int SN = BQ / 8;   // n-tiles over the queries of one tile (S^T, dP^T)

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // [BK][LD]
  bf16* sV = sK + BK * LD;                       // [BK][LD]
  bf16* sQ = sV + BK * LD;                       // [2][BQ][LD]
  bf16* sdO = sQ + 2 * BQ * LD;                  // [2][BQ][LD]
  float* sL = reinterpret_cast<float*>(sdO + 2 * BQ * LD);  // [2][BQ] lse * log2(e)
  float* sD = sL + 2 * BQ;                                   // [2][BQ]

  const int kb = blockIdx.x;  // low key blocks see the most queries: they start first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int c2 = 2 * (lane & 3);

  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* q_base = qkv + static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * HS;
  const bf16* k_base = q_base + C;
  const bf16* v_base = q_base + 2 * static_cast<size_t>(C);
  const bf16* do_base = dout + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * HS;
  const size_t bh = static_cast<size_t>(b) * NH + h;
  const float* lse_bh = lse + bh * T;
  const float* D_bh = D + bh * T;

  const int k0 = kb * BK;
  const int warp_k0 = k0 + warp * 16;
  const int qt_begin = k0 / BQ;
  const int n_qt = (T + BQ - 1) / BQ;

  auto load_query_tile = [&](int qt, int buf) {
    load_tile_async<HS, BQ>(sQ + buf * BQ * LD, q_base, stride, qt * BQ, T);
    load_tile_async<HS, BQ>(sdO + buf * BQ * LD, do_base, static_cast<size_t>(C), qt * BQ, T);
    for (int i = threadIdx.x; i < BQ; i += kThreads) {
      const int t = qt * BQ + i;
      sL[buf * BQ + i] = t < T ? lse_bh[t] * kLog2e : 0.0f;
      sD[buf * BQ + i] = t < T ? D_bh[t] : 0.0f;
    }
  };

  load_tile_async<HS, BK>(sK, k_base, stride, k0, T);
  load_tile_async<HS, BK>(sV, v_base, stride, k0, T);
  load_query_tile(qt_begin, 0);
  cp_async_commit();

  const uint32_t k_addr = smem_u32(sK);
  const uint32_t v_addr = smem_u32(sV);
  constexpr int KF = Cfg::kv_in_regs ? KT : 1;
  uint32_t kf[KF][4], vf[KF][4];  // this warp's 16 keys as A fragments (HS <= 64)

  float dk[NT][4], dv[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.0f;

  for (int qt = qt_begin; qt < n_qt; ++qt) {
    const int buf = (qt - qt_begin) & 1;
    if (qt + 1 < n_qt) {
      load_query_tile(qt + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if constexpr (Cfg::kv_in_regs) {
      if (qt == qt_begin) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
          ldsm_x4(kf[kk], ldsm_a_addr<LD>(k_addr, warp * 16, kk * 16, lane));
          ldsm_x4(vf[kk], ldsm_a_addr<LD>(v_addr, warp * 16, kk * 16, lane));
        }
      }
    }

    const int tq0 = qt * BQ;
    const int tq_last = min(tq0 + BQ, T) - 1;
    if (tq_last >= warp_k0 && warp_k0 < T) {  // warp-uniform: some query t >= key s in range
      const uint32_t q_addr = smem_u32(sQ + buf * BQ * LD);
      const uint32_t do_addr = smem_u32(sdO + buf * BQ * LD);
      const float* sLb = sL + buf * BQ;
      const float* sDb = sD + buf * BQ;

      // S^T = K Q^T  [16 keys x BQ queries]
      float s[SN][4];
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        if constexpr (Cfg::kv_in_regs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = kf[kk][e];
        } else {
          ldsm_x4(a, ldsm_a_addr<LD>(k_addr, warp * 16, kk * 16, lane));
        }
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
          uint32_t qb[4];
          ldsm_x4(qb, ldsm_bt_addr<LD>(q_addr, np * 16, kk * 16, lane));
          mma_bf16(s[2 * np], a, qb[0], qb[1]);
          mma_bf16(s[2 * np + 1], a, qb[2], qb[3]);
        }
      }

      // P^T = exp2(S^T * sl2 - lse2[t]), zero where t < s or t >= T.
      const bool need_mask = (tq0 < warp_k0 + 15) || (tq0 + BQ > T);
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + c2 + (e & 1);
          float p = fast_exp2(s[nt][e] * sl2 - sLb[qi]);
          if (need_mask) {
            const int key = warp_k0 + g + (e >> 1) * 8;
            const int t = tq0 + qi;
            if (t < key || t >= T) p = 0.0f;
          }
          s[nt][e] = p;
        }

      // dV += P^T dO
#pragma unroll
      for (int kq = 0; kq < BQ / 16; ++kq) {
        uint32_t pa[4];
        pa[0] = pack_bf16x2(s[2 * kq][0], s[2 * kq][1]);
        pa[1] = pack_bf16x2(s[2 * kq][2], s[2 * kq][3]);
        pa[2] = pack_bf16x2(s[2 * kq + 1][0], s[2 * kq + 1][1]);
        pa[3] = pack_bf16x2(s[2 * kq + 1][2], s[2 * kq + 1][3]);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t ob[4];
          ldsm_x4_trans(ob, ldsm_a_addr<LD>(do_addr, kq * 16, np * 16, lane));
          mma_bf16(dv[2 * np], pa, ob[0], ob[1]);
          mma_bf16(dv[2 * np + 1], pa, ob[2], ob[3]);
        }
      }

      // dP^T = V dO^T  [16 keys x BQ queries]
      float dp[SN][4];
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        if constexpr (Cfg::kv_in_regs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = vf[kk][e];
        } else {
          ldsm_x4(a, ldsm_a_addr<LD>(v_addr, warp * 16, kk * 16, lane));
        }
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
          uint32_t ob[4];
          ldsm_x4(ob, ldsm_bt_addr<LD>(do_addr, np * 16, kk * 16, lane));
          mma_bf16(dp[2 * np], a, ob[0], ob[1]);
          mma_bf16(dp[2 * np + 1], a, ob[2], ob[3]);
        }
      }

      // dS^T = P^T (dP^T - D[t]); masked entries have P = 0, so dS = 0 there.
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - sDb[nt * 8 + c2 + (e & 1)]);

      // dK += dS^T Q
#pragma unroll
      for (int kq = 0; kq < BQ / 16; ++kq) {
        uint32_t da[4];
        da[0] = pack_bf16x2(dp[2 * kq][0], dp[2 * kq][1]);
        da[1] = pack_bf16x2(dp[2 * kq][2], dp[2 * kq][3]);
        da[2] = pack_bf16x2(dp[2 * kq + 1][0], dp[2 * kq + 1][1]);
        da[3] = pack_bf16x2(dp[2 * kq + 1][2], dp[2 * kq + 1][3]);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t qb[4];
          ldsm_x4_trans(qb, ldsm_a_addr<LD>(q_addr, kq * 16, np * 16, lane));
          mma_bf16(dk[2 * np], da, qb[0], qb[1]);
          mma_bf16(dk[2 * np + 1], da, qb[2], qb[3]);
        }
      }
    }
    __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
  }

  // Epilogue: dk (scaled) and dv rows of this warp's keys, bf16, direct 4-byte stores.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = warp_k0 + g + r * 8;
    if (key < T) {
      bf16* row = dqkv + (static_cast<size_t>(b) * T + key) * stride + static_cast<size_t>(h) * HS;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = nt * 8 + c2;
        *reinterpret_cast<__nv_bfloat162*>(row + C + col) =
            __floats2bfloat162_rn(dk[nt][2 * r] * scale, dk[nt][2 * r + 1] * scale);
        *reinterpret_cast<__nv_bfloat162*>(row + 2 * static_cast<size_t>(C) + col) =
            __floats2bfloat162_rn(dv[nt][2 * r], dv[nt][2 * r + 1]);
      }
    }
  }
}

// ---- backward: dQ -------------------------------------------------------------------------------

template <int HS>
struct DqConfig {
  static constexpr int LD = HS + 8;
  static constexpr int BR = kWarps * 16;         // queries per block
  static constexpr int BC = kKeyTile;            // keys per tile
  static constexpr bool qo_in_regs = HS <= 64;   // Q/dO fragments held in registers
  static constexpr size_t smem_bytes = static_cast<size_t>(2 * BR + 4 * BC) * LD * sizeof(bf16);
};

// dqkv [B,T,3C]: writes the q third. Arguments as the dK/dV kernel.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(bf16* __restrict__ dqkv, const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                 const float* __restrict__ lse, const float* __restrict__ D, int T, int C, int NH,
                                 float sl2, float scale) {
  using Cfg = DqConfig<HS>;
  constexpr int LD = Cfg::LD, BR = Cfg::BR, BC = Cfg::BC;
  constexpr int KT = HS / 16;
  constexpr int NT = HS / 8;
  constexpr int SN = BC / 8;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [BR][LD]
  bf16* sdO = sQ + BR * LD;                      // [BR][LD]
  bf16* sK = sdO + BR * LD;                      // [2][BC][LD]
  bf16* sV = sK + 2 * BC * LD;                   // [2][BC][LD]

  const int qb = gridDim.x - 1 - blockIdx.x;  // longest first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int c2 = 2 * (lane & 3);

  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* q_base = qkv + static_cast<size_t>(b) * T * stride + static_cast<size_t>(h) * HS;
  const bf16* k_base = q_base + C;
  const bf16* v_base = q_base + 2 * static_cast<size_t>(C);
  const bf16* do_base = dout + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * HS;
  const size_t bh = static_cast<size_t>(b) * NH + h;

  const int q0 = qb * BR;
  const int q_last = min(q0 + BR, T) - 1;
  const int n_kt = q_last / BC + 1;
  const int warp_q0 = q0 + warp * 16;

  load_tile_async<HS, BR>(sQ, q_base, stride, q0, T);
  load_tile_async<HS, BR>(sdO, do_base, static_cast<size_t>(C), q0, T);
  load_tile_async<HS, BC>(sK, k_base, stride, 0, T);
  load_tile_async<HS, BC>(sV, v_base, stride, 0, T);
  cp_async_commit();

  // Row statistics of this thread's rows g and g+8 (zero for rows >= T: never stored).
  float row_lse2[2], row_D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = warp_q0 + g + r * 8;
    row_lse2[r] = t < T ? lse[bh * T + t] * kLog2e : 0.0f;
    row_D[r] = t < T ? D[bh * T + t] : 0.0f;
  }

  const uint32_t q_addr = smem_u32(sQ);
  const uint32_t do_addr = smem_u32(sdO);
  constexpr int QF = Cfg::qo_in_regs ? KT : 1;
  uint32_t qf[QF][4], dof[QF][4];

  float dq[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[nt][e] = 0.0f;

  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {
      load_tile_async<HS, BC>(sK + (buf ^ 1) * BC * LD, k_base, stride, (kt + 1) * BC, T);
      load_tile_async<HS, BC>(sV + (buf ^ 1) * BC * LD, v_base, stride, (kt + 1) * BC, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if constexpr (Cfg::qo_in_regs) {
      if (kt == 0) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
          ldsm_x4(qf[kk], ldsm_a_addr<LD>(q_addr, warp * 16, kk * 16, lane));
          ldsm_x4(dof[kk], ldsm_a_addr<LD>(do_addr, warp * 16, kk * 16, lane));
        }
      }
    }

    const int k0 = kt * BC;
    if (k0 <= warp_q0 + 15 && warp_q0 < T) {  // warp-uniform
      const uint32_t k_addr = smem_u32(sK + buf * BC * LD);
      const uint32_t v_addr = smem_u32(sV + buf * BC * LD);

      // S = Q K^T and dP = dO V^T  [16 queries x BC keys]
      float s[SN][4], dp[SN][4];
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        if constexpr (Cfg::qo_in_regs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = qf[kk][e];
        } else {
          ldsm_x4(a, ldsm_a_addr<LD>(q_addr, warp * 16, kk * 16, lane));
        }
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
          uint32_t kb[4];
          ldsm_x4(kb, ldsm_bt_addr<LD>(k_addr, np * 16, kk * 16, lane));
          mma_bf16(s[2 * np], a, kb[0], kb[1]);
          mma_bf16(s[2 * np + 1], a, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        if constexpr (Cfg::qo_in_regs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = dof[kk][e];
        } else {
          ldsm_x4(a, ldsm_a_addr<LD>(do_addr, warp * 16, kk * 16, lane));
        }
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
          uint32_t vb[4];
          ldsm_x4(vb, ldsm_bt_addr<LD>(v_addr, np * 16, kk * 16, lane));
          mma_bf16(dp[2 * np], a, vb[0], vb[1]);
          mma_bf16(dp[2 * np + 1], a, vb[2], vb[3]);
        }
      }

      // dS = P (dP - D), P = exp2(S * sl2 - lse2), zero where s > t or s >= T.
      const bool need_mask = (k0 + BC - 1 > warp_q0) || (k0 + BC > T);
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float p = fast_exp2(s[nt][e] * sl2 - row_lse2[r]);
          if (need_mask) {
            const int t = warp_q0 + g + r * 8;
            const int key = k0 + nt * 8 + c2 + (e & 1);
            if (key > t || key >= T) p = 0.0f;
          }
          s[nt][e] = p * (dp[nt][e] - row_D[r]);
        }

      // dQ += dS K: dS as A fragments, K [keys][HS] is B stored as (k = key, n = HS): trans.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t da[4];
        da[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
        da[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        da[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        da[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t kb[4];
          ldsm_x4_trans(kb, ldsm_a_addr<LD>(k_addr, kk * 16, np * 16, lane));
          mma_bf16(dq[2 * np], da, kb[0], kb[1]);
          mma_bf16(dq[2 * np + 1], da, kb[2], kb[3]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = warp_q0 + g + r * 8;
    if (t < T) {
      bf16* row = dqkv + (static_cast<size_t>(b) * T + t) * stride + static_cast<size_t>(h) * HS;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        *reinterpret_cast<__nv_bfloat162*>(row + nt * 8 + c2) =
            __floats2bfloat162_rn(dq[nt][2 * r] * scale, dq[nt][2 * r + 1] * scale);
    }
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
                    const bf16* qkv, int B, int T, int C, int NH, cudaStream_t stream) {
  using Cfg = ForwardConfig<HS, MT>;
  auto kernel = attention_forward_kernel<HS, MT>;
  set_smem(kernel, Cfg::smem_bytes);
  const dim3 grid((T + Cfg::BR - 1) / Cfg::BR, NH, B);
  const float sl2 = kLog2e / sqrtf(static_cast<float>(HS));
  kernel<<<grid, kThreads, Cfg::smem_bytes, stream>>>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, T, C, NH,
                                                      sl2);
  CUDA_CHECK_LAUNCH();
}

template <int HS>
void launch_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D, int B, int T,
                     int C, int NH, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  const float sl2 = kLog2e * scale;
  {
    using Cfg = DkDvConfig<HS>;
    auto kernel = attention_backward_dkdv_kernel<HS>;
    set_smem(kernel, Cfg::smem_bytes);
    const dim3 grid((T + Cfg::BK - 1) / Cfg::BK, NH, B);
    kernel<<<grid, kThreads, Cfg::smem_bytes, stream>>>(dqkv, dout, qkv, lse, D, T, C, NH, sl2, scale);
    CUDA_CHECK_LAUNCH();
  }
  {
    using Cfg = DqConfig<HS>;
    auto kernel = attention_backward_dq_kernel<HS>;
    set_smem(kernel, Cfg::smem_bytes);
    const dim3 grid((T + Cfg::BR - 1) / Cfg::BR, NH, B);
    kernel<<<grid, kThreads, Cfg::smem_bytes, stream>>>(dqkv, dout, qkv, lse, D, T, C, NH, sl2, scale);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void attention_forward(__nv_bfloat16* out, float* lse, uint8_t* out_fp8, float* out_amax, const float* out_scale,
                       Fp8Dtype out_dtype, const __nv_bfloat16* qkv, int B, int T, int C, int NH,
                       cudaStream_t stream) {
  const int HS = checked_head_size("attention_forward", B, T, C, NH);
  if (B == 0 || T == 0) return;
  FP8LM_CHECK(aligned(qkv, 16), "attention_forward: qkv must be 16-byte aligned");
  FP8LM_CHECK(aligned(out, 4) && aligned(lse, 4), "attention_forward: out/lse must be 4-byte aligned");
  FP8LM_CHECK(out_fp8 == nullptr || aligned(out_fp8, 2), "attention_forward: out_fp8 must be 2-byte aligned");
  FP8LM_CHECK(out_amax == nullptr || aligned(out_amax, 4), "attention_forward: out_amax must be 4-byte aligned");
  const bool e5m2 = out_dtype == Fp8Dtype::e5m2;
  switch (HS) {
    case 32: launch_forward<32, 2>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, B, T, C, NH, stream); break;
    case 64: launch_forward<64, 2>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, B, T, C, NH, stream); break;
    default: launch_forward<128, 1>(out, lse, out_fp8, out_amax, out_scale, e5m2, qkv, B, T, C, NH, stream); break;
  }
}

size_t attention_backward_scratch_floats(int B, int T, int C, int NH) {
  (void)C;
  return static_cast<size_t>(B) * NH * T;  // D [B,NH,T]
}

void attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                        const __nv_bfloat16* out, const float* lse, int B, int T, int C, int NH, float* scratch,
                        cudaStream_t stream) {
  const int HS = checked_head_size("attention_backward", B, T, C, NH);
  if (B == 0 || T == 0) return;
  FP8LM_CHECK(aligned(qkv, 16) && aligned(dout, 16) && aligned(out, 16),
              "attention_backward: qkv/dout/out must be 16-byte aligned");
  FP8LM_CHECK(aligned(dqkv, 4) && aligned(lse, 4) && aligned(scratch, 4),
              "attention_backward: dqkv/lse/scratch must be 4-byte aligned");
  FP8LM_CHECK(scratch != nullptr, "attention_backward: scratch is required");

  float* D = scratch;  // [B,NH,T]
  const size_t rows = static_cast<size_t>(B) * T * NH;
  FP8LM_CHECK(rows * (HS / 8) + 256 < 0x7fffffffu, "attention_backward: B*T*NH=", rows, " is too large");
  {
    const int threads = 256;
    const int blocks = static_cast<int>((rows * (HS / 8) + threads - 1) / threads);
    const int r = static_cast<int>(rows);
    switch (HS) {
      case 32: attention_backward_dot_kernel<32><<<blocks, threads, 0, stream>>>(D, dout, out, r, T, C, NH); break;
      case 64: attention_backward_dot_kernel<64><<<blocks, threads, 0, stream>>>(D, dout, out, r, T, C, NH); break;
      default: attention_backward_dot_kernel<128><<<blocks, threads, 0, stream>>>(D, dout, out, r, T, C, NH); break;
    }
    CUDA_CHECK_LAUNCH();
  }
  switch (HS) {
    case 32: launch_backward<32>(dqkv, dout, qkv, lse, D, B, T, C, NH, stream); break;
    case 64: launch_backward<64>(dqkv, dout, qkv, lse, D, B, T, C, NH, stream); break;
    default: launch_backward<128>(dqkv, dout, qkv, lse, D, B, T, C, NH, stream); break;
  }
}

}  // namespace fp8lm::cuda
