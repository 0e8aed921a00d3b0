// Flash-attention backward, step 2 of 3: the dK/dV kernel. Included once, by attention.cu,
// which launches the three steps; the tile helpers and the fragment layouts are in
// attention_tiles.cuh.
//
// grid (ceil(T/64), NH, B), 4 warps; a block owns 64 keys (16 per warp), keeps K and V
// (fragments in registers for HS <= 64), and walks the query tiles (BQ = 64, or 32 for
// HS = 128) from its diagonal to T, double-buffering Q, dO, lse, D. Per tile:
//   S^T = K Q^T, P^T = exp2(S^T*scale*log2e - lse*log2e), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.  dK *= 1/sqrt(HS) at the end.
// P^T is rounded to bf16 once, for both products: dV's reads it as bf16 anyway, and dS^T
// then uses the same P as the wgmma kernel's, which keeps no FP32 copy (the error it adds
// to dS^T is of the rounding dS^T itself gets before dK's product).
// smem: K,V [64][HS+8] + Q,dO [2][BQ][HS+8] + lse,D [2][BQ]  (HS=64: 56,320 B).
// No atomics: every dK/dV element is written once, by one thread.
// Documents (kDocuments, attention_tiles.cuh): first[t] of each query tile joins lse and D in
// shared memory ([2][BQ] more). The walk stops at the first tile whose first query's first
// key lies past the block's last key: first[] is nondecreasing, so no later query sees any of
// the block's keys. A warp skips a tile whose first query's first key lies past its keys, and
// P = 0 where s < first[t] on tiles whose last query's first key lies past the warp's first key.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/launch.cuh"
#include "layers/attention_tiles.cuh"

namespace fp8lm::cuda {

namespace {

template <int HS>
struct DkDvConfig {
  static constexpr int LD = HS + 8;
  static constexpr int BK = kKeyTile;          // keys per block (16 per warp)
  static constexpr int BQ = HS <= 64 ? 64 : 32;  // queries per tile (32: measured slower for HS=64)
  static constexpr bool kv_in_regs = HS <= 64;   // K/V fragments held in registers
  static constexpr size_t smem_bytes =
      static_cast<size_t>(2 * BK + 4 * BQ) * LD * sizeof(bf16) + 4 * BQ * sizeof(float);
  static constexpr size_t documents_smem_bytes = 2 * BQ * sizeof(int32_t);  // first[t] [2][BQ]
};

// dqkv [B,T,3C]: writes the k and v thirds. dout [B,T,C], qkv [B,T,3C], lse [B,NH,T],
// D [B,NH,T]. sl2 = log2(e)/sqrt(HS), scale = 1/sqrt(HS). document_starts [B,T]: read only
// with kDocuments; shared memory smem_bytes, plus documents_smem_bytes with kDocuments.
template <int HS, bool kDocuments>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dkdv_kernel(bf16* __restrict__ dqkv, const bf16* __restrict__ dout,
                                   const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                   const float* __restrict__ D, int T, int C, int NH, float sl2, float scale,
                                   const int32_t* __restrict__ document_starts) {
  device::start_after_previous_kernel();
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
  int32_t* sF = reinterpret_cast<int32_t*>(sD + 2 * BQ);     // [2][BQ] first[t] (kDocuments)

  const int kb = blockIdx.x;  // low key blocks see the most queries: they start first
  const Head head = this_head<HS>(T, C, NH);
  const auto [warp, lane, g, c2] = this_thread();

  const int k0 = kb * BK;
  const int warp_k0 = k0 + warp * 16;
  const int qt_begin = k0 / BQ;
  int n_qt = (T + BQ - 1) / BQ;
  const int32_t* first = kDocuments ? document_row(document_starts, T) : nullptr;

  auto load_query_tile = [&](int qt, int buf) {
    load_tile_async<HS, BQ>(sQ + buf * BQ * LD, head.q(qkv), head.qkv_stride, qt * BQ, T);
    load_tile_async<HS, BQ>(sdO + buf * BQ * LD, head.rows(dout), head.C, qt * BQ, T);
    for (int i = threadIdx.x; i < BQ; i += kThreads) {
      const int t = qt * BQ + i;
      sL[buf * BQ + i] = t < T ? lse[head.stats + t] * kLog2e : 0.0f;
      sD[buf * BQ + i] = t < T ? D[head.stats + t] : 0.0f;
      if constexpr (kDocuments) sF[buf * BQ + i] = t < T ? first[t] : t;  // t >= T: masked anyway
    }
  };

  load_tile_async<HS, BK>(sK, head.k(qkv), head.qkv_stride, k0, T);
  load_tile_async<HS, BK>(sV, head.v(qkv), head.qkv_stride, k0, T);
  load_query_tile(qt_begin, 0);
  cp_async_commit();

  // Documents: the walk ends before the first tile whose first query's document begins after
  // the block's last key (block-wide count; the diagonal's tile always counts).
  if constexpr (kDocuments)
    n_qt = qt_begin + query_tiles_with_first_at_most(first, qt_begin, n_qt, BQ, T, min(k0 + BK, T) - 1, false);

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
    const int32_t* sFb = sF + buf * BQ;
    // warp-uniform: some query t >= key s in range, and (documents) one whose document
    // begins at or before the warp's last key
    if (tq_last >= warp_k0 && warp_k0 < T && (!kDocuments || sFb[0] <= warp_k0 + 15)) {
      const uint32_t q_addr = smem_u32(sQ + buf * BQ * LD);
      const uint32_t do_addr = smem_u32(sdO + buf * BQ * LD);
      const float* sLb = sL + buf * BQ;
      const float* sDb = sD + buf * BQ;

      // S^T = K Q^T  [16 keys x BQ queries]
      float s[SN][4];
      zero(s);
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        load_a_kstep<HS, Cfg::kv_in_regs>(a, kf, k_addr, warp * 16, kk, lane);
        mma_a_bt_kstep<HS>(s, a, q_addr, kk, lane);
      }

      // P^T = exp2(S^T * sl2 - lse2[t]), zero where t < s or t >= T, or s < first[t] (set,
      // not computed: a key outside t's document may score far above lse[t]).
      const bool need_mask =
          (tq0 < warp_k0 + 15) || (tq0 + BQ > T) || (kDocuments && sFb[tq_last - tq0] > warp_k0);
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
            if constexpr (kDocuments)
              if (key < sFb[qi]) p = 0.0f;
          }
          s[nt][e] = round_bf16(p);  // as dV's product reads it, and dS uses it (the wgmma kernel's P)
        }

      // dV += P^T dO
      mma_p_b<HS>(dv, s, do_addr, lane);

      // dP^T = V dO^T  [16 keys x BQ queries]
      float dp[SN][4];
      zero(dp);
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        load_a_kstep<HS, Cfg::kv_in_regs>(a, vf, v_addr, warp * 16, kk, lane);
        mma_a_bt_kstep<HS>(dp, a, do_addr, kk, lane);
      }

      // dS^T = P^T (dP^T - D[t]); masked entries have P = 0, so dS = 0 there.
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - sDb[nt * 8 + c2 + (e & 1)]);

      // dK += dS^T Q
      mma_p_b<HS>(dk, dp, q_addr, lane);
    }
    __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
  }

  // Epilogue: dk (scaled) and dv rows of this warp's keys, bf16, direct 4-byte stores.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = warp_k0 + g + r * 8;
    if (key < T) {
      bf16* row = head.q(dqkv) + static_cast<size_t>(key) * head.qkv_stride;
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

}  // namespace

}  // namespace fp8lm::cuda
