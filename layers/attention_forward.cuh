// Flash-attention forward kernel (FA2 style, mma.sync): causal softmax(Q K^T / sqrt(HS)) V,
// optionally within documents, for one (query block, head, batch) per thread block, with the
// optional fused FP8 cast and amax of the output. Included once, by attention.cu, which
// launches it; the tile helpers and the fragment layouts are in attention_tiles.cuh.
//
// grid (ceil(T/BR), NH, B), 4 warps, query blocks scheduled longest first.
//   BR = 64*MT queries per block, each warp owns 16*MT query rows (MT = 2 for HS <= 64, 1 for
//   HS = 128: registers); K/V tiles of BC = 64 keys, double-buffered in shared memory. Per key
//   tile: S = Q K^T (Q fragments live in registers), causal mask only on tiles that cross the
//   diagonal or T, online softmax on the raw scores with p = exp2(S*sl2 - m*sl2) (one FFMA,
//   sl2 = log2(e)/sqrt(HS)), O += P V (P in bf16 straight from the accumulators). Tiles above
//   the diagonal are never loaded; a warp whose rows all precede the tile skips its mma work.
//   Documents (kDocuments, attention_tiles.cuh): the walk starts at the tile of the block's
//   first row's first key, a warp skips tiles that end before all its rows' documents begin,
//   and the mask s < first[t] joins the causal one on tiles that begin before the warp's last
//   row's first key.
//   Epilogue: O / l -> bf16 (optionally FP8 + amax), lse = ln2 * (m*sl2 + log2 l).
//   smem: Q [BR][HS+8] + K,V [2][64][HS+8]   (HS=64: 55,296 B; HS=128: 87,040 B).
// The loops over the MT row blocks sit inside the ldmatrix of K or V, so that one
// shared-memory read serves all MT row blocks: hence this kernel's own S = Q K^T and
// O += P V loops rather than the 16-row warp products of attention_tiles.cuh.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/launch.cuh"
#include "layers/attention_tiles.cuh"

namespace fp8lm::cuda {

namespace {

constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t amax_bits(float v) {  // |v| as ordered bits; NaN -> 0x7fc00000
  return isnan(v) ? 0x7fc00000u : __float_as_uint(fabsf(v));
}

// Where the forward's epilogue writes one head's rows: out [B,T,C] and out_fp8 (nullable)
// at the head's columns, lse [B,NH,T] at the head's row 0.
struct ForwardOutput {
  bf16* out;
  uint8_t* out_fp8;
  float* lse;
  float fp8_scale;
  __nv_fp8_interpretation_t fp8_kind;
};

// Normalises a warp's 16 query rows row0.. (O in m16n8 C fragments, the running max m and
// this thread's partial sums l of rows g and g + 8) and stores them: O / l as bf16 (plus the
// FP8 codes of that bf16), lse = ln2 * (m*sl2 + log2 l). Rows >= T are skipped. Returns
// `amax` raised to the largest |bf16 output| stored. Shared by both forward kernels.
template <int NT>
__device__ __forceinline__ uint32_t store_output_rows(const ForwardOutput& dst, size_t head_offset, size_t lse_offset,
                                                      const float (&o)[NT][4], const float (&m)[2], const float (&l)[2],
                                                      float sl2, int row0, int T, int C, int lane, uint32_t amax) {
  const int g = lane >> 2;
  const int c2 = 2 * (lane & 3);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float row_l = l[r];
    row_l += __shfl_xor_sync(0xffffffffu, row_l, 1);
    row_l += __shfl_xor_sync(0xffffffffu, row_l, 2);
    const int row = row0 + g + r * 8;
    if (row < T) {
      const float inv_l = row_l > 0.0f ? 1.0f / row_l : 0.0f;
      if ((lane & 3) == 0) dst.lse[lse_offset + row] = (m[r] * sl2 + log2f(row_l)) * kLn2;
      const size_t row_off = head_offset + static_cast<size_t>(row) * C;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const size_t idx = row_off + nt * 8 + c2;
        const __nv_bfloat162 v = __floats2bfloat162_rn(o[nt][2 * r] * inv_l, o[nt][2 * r + 1] * inv_l);
        *reinterpret_cast<__nv_bfloat162*>(dst.out + idx) = v;
        const float v0 = __low2float(v);
        const float v1 = __high2float(v);
        amax = max(amax, max(amax_bits(v0), amax_bits(v1)));
        if (dst.out_fp8 != nullptr) {
          const uint32_t f0 = __nv_cvt_float_to_fp8(v0 * dst.fp8_scale, __NV_SATFINITE, dst.fp8_kind);
          const uint32_t f1 = __nv_cvt_float_to_fp8(v1 * dst.fp8_scale, __NV_SATFINITE, dst.fp8_kind);
          *reinterpret_cast<uint16_t*>(dst.out_fp8 + idx) = static_cast<uint16_t>(f0 | (f1 << 8));
        }
      }
    }
  }
  return amax;
}

// Folds a warp's amax bits into *out_amax (nullable): a warp max, then one atomicMax.
__device__ __forceinline__ void publish_amax(float* out_amax, uint32_t amax, int lane) {
  if (out_amax == nullptr) return;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (lane == 0 && amax != 0) atomicMax(reinterpret_cast<unsigned int*>(out_amax), amax);
}

template <int HS, int MT>
struct ForwardConfig {
  static constexpr int LD = HS + 8;
  static constexpr int BR = kWarps * 16 * MT;  // queries per block
  static constexpr int BC = kKeyTile;          // keys per tile
  static constexpr size_t smem_bytes = static_cast<size_t>(BR + 4 * BC) * LD * sizeof(bf16);
};

// out [B,T,C], lse [B,NH,T], out_fp8 [B,T,C] (nullable), out_amax (nullable), out_scale
// (nullable = 1), qkv [B,T,3C]. sl2 = log2(e)/sqrt(HS). document_starts [B,T]: read only with
// kDocuments (attention_tiles.cuh); last, so that the other parameters keep their offsets.
template <int HS, int MT, bool kDocuments>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, uint8_t* __restrict__ out_fp8,
                             float* __restrict__ out_amax, const float* __restrict__ out_scale, bool e5m2,
                             const bf16* __restrict__ qkv, int T, int C, int NH, float sl2,
                             const int32_t* __restrict__ document_starts) {
  device::start_after_previous_kernel();
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
  const Head head = this_head<HS>(T, C, NH);
  const auto [warp, lane, g, c2] = this_thread();

  const int q0 = qb * BR;
  const int q_last = min(q0 + BR, T) - 1;  // last valid query of the block
  const int n_kt = q_last / BC + 1;        // key tiles 0..n_kt-1 reach the diagonal (all keys < T)
  const int warp_q0 = q0 + warp * 16 * MT;
  const int warp_q_last = warp_q0 + 16 * MT - 1;

  // Documents: the block's first row sees the fewest keys' tiles (first[] is nondecreasing), so
  // the walk starts at its first key's tile; each row keeps its first key (rows g and g + 8 of
  // each row block), and the warp its rows' smallest and largest.
  const int32_t* first = kDocuments ? document_row(document_starts, T) : nullptr;
  const int kt_begin = kDocuments ? first[q0] / BC : 0;
  int row_first[MT][2];
  int warp_first_min = 0, warp_first_max = 0;
  if constexpr (kDocuments) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) row_first[mt][r] = first_key_of(first, warp_q0 + mt * 16 + g + r * 8, T);
    warp_first_min = __shfl_sync(0xffffffffu, row_first[0][0], 0);        // row warp_q0
    warp_first_max = __shfl_sync(0xffffffffu, row_first[MT - 1][1], 28);  // row warp_q_last
  }

  load_tile_async<HS, BR>(sQ, head.q(qkv), head.qkv_stride, q0, T);
  load_tile_async<HS, BC>(sK + (kt_begin & 1) * BC * LD, head.k(qkv), head.qkv_stride, kt_begin * BC, T);
  load_tile_async<HS, BC>(sV + (kt_begin & 1) * BC * LD, head.v(qkv), head.qkv_stride, kt_begin * BC, T);
  cp_async_commit();

  uint32_t qf[MT][KT][4];
  float o[MT][NT][4];
  float m[MT][2], l[MT][2];  // running max of the raw scores and this thread's partial row sums
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    zero(o[mt]);
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  for (int kt = kt_begin; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    // prefetch the next tile into the other buffer (freed by the last sync)
    current_tile_ready<false>(kt + 1 < n_kt, [&] {
      load_tile_async<HS, BC>(sK + (buf ^ 1) * BC * LD, head.k(qkv), head.qkv_stride, (kt + 1) * BC, T);
      load_tile_async<HS, BC>(sV + (buf ^ 1) * BC * LD, head.v(qkv), head.qkv_stride, (kt + 1) * BC, T);
    });

    if (kt == kt_begin) {  // Q fragments: each warp reads only its own rows of sQ
      const uint32_t q_addr = smem_u32(sQ);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
          ldsm_x4(qf[mt][kk], ldsm_a_addr<LD>(q_addr, warp * 16 * MT + mt * 16, kk * 16, lane));
    }

    const int k0 = kt * BC;
    // warp-uniform: skip tiles wholly above its rows, or wholly before all its rows' documents
    if (k0 <= warp_q_last && warp_q0 < T && (!kDocuments || k0 + BC > warp_first_min)) {
      const uint32_t k_addr = smem_u32(sK + buf * BC * LD);
      const uint32_t v_addr = smem_u32(sV + buf * BC * LD);

      // S = Q K^T  [16*MT x BC] per warp
      float s[MT][SN][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) zero(s[mt]);
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

      // Causal mask (s > t, and s >= T) only on tiles that cross the diagonal or T, the
      // documents' (s < first[t]) only on tiles that begin before a row's document. S stays
      // unscaled: the max is taken on raw scores and exp2(S*sl2 - m*sl2) is one FFMA. A row
      // that sees no key of the tile keeps its m, l and O (alpha = 1, p = 0), or, before its
      // first key, m = -inf (m_use = 0: alpha = p = 0, no NaN).
      if ((k0 + BC - 1 > warp_q0) || (k0 + BC > T) || (kDocuments && k0 < warp_first_max)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = warp_q0 + mt * 16 + g + (e >> 1) * 8;
              const int col = k0 + nt * 8 + c2 + (e & 1);
              if (col > row || col >= T) s[mt][nt][e] = -INFINITY;
              if constexpr (kDocuments)
                if (col < row_first[mt][e >> 1]) s[mt][nt][e] = -INFINITY;
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
        for (int mt = 0; mt < MT; ++mt) acc_to_a(pa[mt], s[mt], kk);
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
  const ForwardOutput dst{out, out_fp8, lse, out_scale != nullptr ? *out_scale : 1.0f, e5m2 ? __NV_E5M2 : __NV_E4M3};
  uint32_t amax = 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    amax = store_output_rows(dst, head.out_offset, head.stats, o[mt], m[mt], l[mt], sl2, warp_q0 + mt * 16, T, C, lane,
                             amax);
  publish_amax(out_amax, amax, lane);
}

}  // namespace

}  // namespace fp8lm::cuda
