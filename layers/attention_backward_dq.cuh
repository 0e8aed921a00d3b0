// Flash-attention backward, step 3 of 3: the dQ kernel. Included once, by attention.cu,
// which launches the three steps; the tile helpers and the fragment layouts are in
// attention_tiles.cuh.
//
// grid (ceil(T/64), NH, B), 4 warps; a block owns 64 queries (16 per warp) with Q, dO in
// registers (HS <= 64) and walks the key tiles 0..diagonal, double-buffering K, V:
//   S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dQ += dS K.  dQ *= 1/sqrt(HS).
// Documents (kDocuments, attention_tiles.cuh) as in the forward: the walk starts at the tile
// of the block's first row's first key, a warp skips tiles before all its rows' documents,
// and P = 0 where s < first[t] on tiles that begin before the warp's last row's first key.
// smem: Q,dO [64][HS+8] + K,V [2][64][HS+8]  (HS=64: 55,296 B).
// This kernel recomputes S and dP that the dK/dV kernel also forms (7 GEMM-shaped products
// in all instead of FA2's 5): the price of determinism without a T x T buffer or
// floating-point atomics. Every dQ element is written once, by one thread.

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
struct DqConfig {
  static constexpr int LD = HS + 8;
  static constexpr int BR = kWarps * 16;         // queries per block
  static constexpr int BC = kKeyTile;            // keys per tile
  static constexpr bool qo_in_regs = HS <= 64;   // Q/dO fragments held in registers
  static constexpr size_t smem_bytes = static_cast<size_t>(2 * BR + 4 * BC) * LD * sizeof(bf16);
};

// dqkv [B,T,3C]: writes the q third. Arguments as the dK/dV kernel.
template <int HS, bool kDocuments>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(bf16* __restrict__ dqkv, const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                 const float* __restrict__ lse, const float* __restrict__ D, int T, int C, int NH,
                                 float sl2, float scale, const int32_t* __restrict__ document_starts) {
  device::start_after_previous_kernel();
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
  const Head head = this_head<HS>(T, C, NH);
  const auto [warp, lane, g, c2] = this_thread();

  const int q0 = qb * BR;
  const int q_last = min(q0 + BR, T) - 1;
  const int n_kt = q_last / BC + 1;
  const int warp_q0 = q0 + warp * 16;

  // Documents: as in the forward kernel (attention_forward.cuh).
  const int32_t* first = kDocuments ? document_row(document_starts, T) : nullptr;
  const int kt_begin = kDocuments ? first[q0] / BC : 0;
  int row_first[2];
  int warp_first_min = 0, warp_first_max = 0;
  if constexpr (kDocuments) {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_first[r] = first_key_of(first, warp_q0 + g + r * 8, T);
    warp_first_min = __shfl_sync(0xffffffffu, row_first[0], 0);   // row warp_q0
    warp_first_max = __shfl_sync(0xffffffffu, row_first[1], 28);  // row warp_q0 + 15
  }

  load_tile_async<HS, BR>(sQ, head.q(qkv), head.qkv_stride, q0, T);
  load_tile_async<HS, BR>(sdO, head.rows(dout), head.C, q0, T);
  load_tile_async<HS, BC>(sK + (kt_begin & 1) * BC * LD, head.k(qkv), head.qkv_stride, kt_begin * BC, T);
  load_tile_async<HS, BC>(sV + (kt_begin & 1) * BC * LD, head.v(qkv), head.qkv_stride, kt_begin * BC, T);
  cp_async_commit();

  // Row statistics of this thread's rows g and g+8 (zero for rows >= T: never stored).
  float row_lse2[2], row_D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = warp_q0 + g + r * 8;
    row_lse2[r] = t < T ? lse[head.stats + t] * kLog2e : 0.0f;
    row_D[r] = t < T ? D[head.stats + t] : 0.0f;
  }

  const uint32_t q_addr = smem_u32(sQ);
  const uint32_t do_addr = smem_u32(sdO);
  constexpr int QF = Cfg::qo_in_regs ? KT : 1;
  uint32_t qf[QF][4], dof[QF][4];

  float dq[NT][4];
  zero(dq);

  for (int kt = kt_begin; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {
      load_tile_async<HS, BC>(sK + (buf ^ 1) * BC * LD, head.k(qkv), head.qkv_stride, (kt + 1) * BC, T);
      load_tile_async<HS, BC>(sV + (buf ^ 1) * BC * LD, head.v(qkv), head.qkv_stride, (kt + 1) * BC, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if constexpr (Cfg::qo_in_regs) {
      if (kt == kt_begin) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
          ldsm_x4(qf[kk], ldsm_a_addr<LD>(q_addr, warp * 16, kk * 16, lane));
          ldsm_x4(dof[kk], ldsm_a_addr<LD>(do_addr, warp * 16, kk * 16, lane));
        }
      }
    }

    const int k0 = kt * BC;
    if (k0 <= warp_q0 + 15 && warp_q0 < T && (!kDocuments || k0 + BC > warp_first_min)) {  // warp-uniform
      const uint32_t k_addr = smem_u32(sK + buf * BC * LD);
      const uint32_t v_addr = smem_u32(sV + buf * BC * LD);

      // S = Q K^T and dP = dO V^T  [16 queries x BC keys]
      float s[SN][4], dp[SN][4];
      zero(s);
      zero(dp);
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        load_a_kstep<HS, Cfg::qo_in_regs>(a, qf, q_addr, warp * 16, kk, lane);
        mma_a_bt_kstep<HS>(s, a, k_addr, kk, lane);
      }
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t a[4];
        load_a_kstep<HS, Cfg::qo_in_regs>(a, dof, do_addr, warp * 16, kk, lane);
        mma_a_bt_kstep<HS>(dp, a, v_addr, kk, lane);
      }

      // dS = P (dP - D), P = exp2(S * sl2 - lse2), zero where s > t or s >= T, or s < first[t]
      // (set, not computed: a key outside t's document may score far above lse[t]).
      const bool need_mask = (k0 + BC - 1 > warp_q0) || (k0 + BC > T) || (kDocuments && k0 < warp_first_max);
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
            if constexpr (kDocuments)
              if (key < row_first[r]) p = 0.0f;
          }
          s[nt][e] = p * (dp[nt][e] - row_D[r]);
        }

      // dQ += dS K: dS as A fragments, K [keys][HS] is B stored as (k = key, n = HS): trans.
      mma_p_b<HS>(dq, s, k_addr, lane);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = warp_q0 + g + r * 8;
    if (t < T) {
      bf16* row = head.q(dqkv) + static_cast<size_t>(t) * head.qkv_stride;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        *reinterpret_cast<__nv_bfloat162*>(row + nt * 8 + c2) =
            __floats2bfloat162_rn(dq[nt][2 * r] * scale, dq[nt][2 * r + 1] * scale);
    }
  }
}

}  // namespace

}  // namespace fp8lm::cuda
