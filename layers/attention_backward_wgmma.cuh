// Flash-attention backward, steps 2 and 3, for head size 64 with Hopper's wgmma: the same
// algorithm, tiles and order of work as the mma.sync kernels (attention_backward_dkdv.cuh,
// attention_backward_dq.cuh), with each block's 4 warps acting as one warpgroup. Included
// once, by attention.cu. Helpers and layouts: attention_wgmma.cuh.
//
// dK/dV: grid (ceil(T/64), NH, B); a block owns 64 keys (warp w: keys 16w..16w+15, as
// before), K and V in swizzled shared tiles, and walks the query tiles from its diagonal to
// T. Per tile, with Q and dO in swizzled shared tiles (double-buffered):
//   S^T = K Q^T and dP^T = V dO^T   issued together (two groups)
//   P^T = exp2(S^T*sl2 - lse2)       while dP^T runs
//   dV += P^T dO                     issued, then dS^T = P^T (dP^T - D) while it runs
//   dK += dS^T Q
// dQ runs first: grid (ceil(T/64), NH, B); a block owns 64 queries, Q and dO in swizzled
// shared tiles, computes their D = rowsum(dO * O) and writes it for the dK/dV kernel (each row
// once, so the step needs no kernel of its own for D), and walks the key tiles 0..diagonal, K
// and V in swizzled shared tiles:
//   S = Q K^T and dP = dO V^T together, P while dP runs, dS = P (dP - D), dQ += dS K.
// Only the diagonal tile and one reaching past T are masked; the loops peel them off.
// Documents (kDocuments, attention_tiles.cuh), as in the mma.sync kernels: dK/dV keeps
// first[t] beside lse and D, ends its walk before the first query tile whose first query's
// document begins after the block's last key, and masks (s < first[t]) the tiles from the
// first whose last query's document begins after the block's first key on (first[] is
// nondecreasing: the walk's last tiles). dQ starts its walk at the tile of its first row's
// first key and masks the tiles that begin before its last row's first key (the walk's first).
// No atomics: every output element is written once, by one thread; bit-reproducible. (With
// the FP8 operand, only its amax is an atomicMax, which no order changes.)
// smem (each kernel): six swizzled [64][64] tiles (48 KiB, 1024-aligned) and, for dK/dV, lse
// and D of two query tiles.
// Instructions are the cost here: with two blocks a multiprocessor (dK/dV) each warp waits on
// its own chain, so the loops keep the masks, the address arithmetic and the A fragments'
// loads out of the common tile (device calls 117-119, dK/dV at gpt2-1558m's shape: 71.5 ->
// 40.7 M instructions; the backward 0.359 -> 0.302 ms).

#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/launch.cuh"
#include "layers/attention_dqkv_operand.cuh"
#include "layers/attention_tiles.cuh"
#include "layers/attention_wgmma.cuh"

namespace fp8lm::cuda {

namespace {

struct BackwardWgmmaConfig {
  static constexpr int HS = 64;
  static constexpr int BLOCK = 64;   // keys (dK/dV) or queries (dQ) per block; 16 per warp
  static constexpr int TILE = 64;    // queries (dK/dV) or keys (dQ) per walked tile
  static constexpr int kTileBytes = TILE * kSwizzledRowBytes;
  // dK/dV: Q and dO [2], K, V; lse and D [2]. A third buffer, with one barrier a tile
  // instead of two, measured the same (device call 120: 0.299 against 0.299-0.303 ms).
  static constexpr size_t dkdv_smem_bytes =
      kSwizzleAtomBytes /* alignment slack */ + 6 * kTileBytes + 4 * TILE * sizeof(float);
  // dQ: K and V [2], Q, dO.
  static constexpr size_t dq_smem_bytes = kSwizzleAtomBytes /* alignment slack */ + 6 * kTileBytes;
  // dK/dV with documents: first[t] of two query tiles, after lse and D.
  static constexpr size_t dkdv_documents_smem_bytes = 2 * TILE * sizeof(int32_t);
};

// dqkv [B,T,3C]: writes the k and v thirds; with kOperand, their FP8 operand to `operand`
// instead (attention_dqkv_operand.cuh; T a multiple of 64). dout [B,T,C], qkv [B,T,3C],
// lse [B,NH,T], D [B,NH,T]. sl2 = log2(e)/sqrt(64), scale = 1/sqrt(64). document_starts
// [B,T]: read only with kDocuments (shared memory dkdv_smem_bytes + dkdv_documents_smem_bytes).
// Three blocks a multiprocessor (154 registers, no spills; two at 170 with an FP32 P, and the
// backward 0.298 -> 0.275 ms at gpt2-1558m's shape with three, call 124).
template <bool kOperand, bool kDocuments>
__global__ void __launch_bounds__(kThreads, 3)
    attention_backward_dkdv_wgmma_kernel(bf16* __restrict__ dqkv, DqkvOperandTarget operand,
                                         const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                         const float* __restrict__ lse, const float* __restrict__ D, int T, int C,
                                         int NH, float sl2, float scale,
                                         const int32_t* __restrict__ document_starts) {
  device::start_after_previous_kernel();
  using Cfg = BackwardWgmmaConfig;
  constexpr int HS = Cfg::HS, BK = Cfg::BLOCK, BQ = Cfg::TILE;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = swizzle_aligned(smem_raw);
  const uint32_t q_tiles = smem_u32(smem);                  // [2] swizzled [BQ][64]
  const uint32_t do_tiles = q_tiles + 2 * Cfg::kTileBytes;  // [2] swizzled [BQ][64]
  const uint32_t k_tile = q_tiles + 4 * Cfg::kTileBytes;    // swizzled [BK][64], the A of S^T
  const uint32_t v_tile = q_tiles + 5 * Cfg::kTileBytes;    // swizzled [BK][64], the A of dP^T
  float* sL = reinterpret_cast<float*>(smem + 6 * Cfg::kTileBytes);  // [2][BQ] lse * log2(e)
  float* sD = sL + 2 * BQ;                                          // [2][BQ]
  int32_t* sF = reinterpret_cast<int32_t*>(sD + 2 * BQ);            // [2][BQ] first[t] (kDocuments)

  const int kb = blockIdx.x;  // low key blocks see the most queries: they start first
  const Head head = this_head<HS>(T, C, NH);
  const auto [warp, lane, g, c2] = this_thread();

  const int k0 = kb * BK;
  const int warp_k0 = k0 + warp * 16;
  const int qt_begin = k0 / BQ;
  int n_qt = (T + BQ - 1) / BQ;
  const int32_t* first = kDocuments ? document_row(document_starts, T) : nullptr;

  // The query tiles are walked in order from the diagonal's.
  SwizzledTileWalk<BQ> q_walk(head.q(qkv), head.qkv_stride, qt_begin * BQ);
  SwizzledTileWalk<BQ> do_walk(head.rows(dout), head.C, qt_begin * BQ);
  auto load_query_tile = [&](int qt, int buf) {
    q_walk.load_next(q_tiles + buf * Cfg::kTileBytes, T);
    do_walk.load_next(do_tiles + buf * Cfg::kTileBytes, T);
    static_assert(BQ <= kThreads, "one statistic a thread");
    if (threadIdx.x < BQ) {
      const int t = qt * BQ + static_cast<int>(threadIdx.x);
      sL[buf * BQ + threadIdx.x] = t < T ? lse[head.stats + t] * kLog2e : 0.0f;
      sD[buf * BQ + threadIdx.x] = t < T ? D[head.stats + t] : 0.0f;
      if constexpr (kDocuments) sF[buf * BQ + threadIdx.x] = t < T ? first[t] : t;  // t >= T: masked anyway
    }
  };

  SwizzledTileWalk<BK>(head.k(qkv), head.qkv_stride, k0).load_next(k_tile, T);
  SwizzledTileWalk<BK>(head.v(qkv), head.qkv_stride, k0).load_next(v_tile, T);
  load_query_tile(qt_begin, 0);
  cp_async_commit();

  // Documents (block-wide counts, see the top of this file): the walk ends at n_qt, and the
  // tiles from qt_documents on need the documents' mask.
  int qt_documents = n_qt;
  if constexpr (kDocuments) {
    const int n_all = n_qt;
    n_qt = qt_begin + query_tiles_with_first_at_most(first, qt_begin, n_all, BQ, T, min(k0 + BK, T) - 1, false);
    qt_documents = qt_begin + query_tiles_with_first_at_most(first, qt_begin, n_all, BQ, T, k0, true);
  }

  float dk[8][4], dv[8][4];
  zero(dk);
  zero(dv);

  // One query tile. kMasked: the causal and length masks, which only the diagonal tile and a
  // tile reaching past T need; the other tiles run without them (peeled below, so that the
  // compiler cannot turn the mask into selects executed on every tile).
  auto query_tile = [&](int qt, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int buf = (qt - qt_begin) & 1;
    if (qt + 1 < n_qt) {
      load_query_tile(qt + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();
    const uint32_t q_tile = q_tiles + buf * Cfg::kTileBytes;
    const uint32_t do_tile = do_tiles + buf * Cfg::kTileBytes;
    const float* sLb = sL + buf * BQ;
    const float* sDb = sD + buf * BQ;
    const int tq0 = qt * BQ;

    float s[8][4], dp[8][4];
    wgmma_fence();
    wgmma_tile_ss<0>(s, k_tile, q_tile, false);  // S^T = K Q^T
    wgmma_commit();
    wgmma_tile_ss<0>(dp, v_tile, do_tile, false);  // dP^T = V dO^T
    wgmma_commit();
    wgmma_wait<1>();
    fence_registers(s);

    // P^T = exp2(S^T * sl2 - lse2[t]), zero where t < s or t >= T, or s < first[t] (set, not
    // computed: a key outside t's document may score far above lse[t]).
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float2 lse2 = *reinterpret_cast<const float2*>(sLb + nt * 8 + c2);
      int2 first2;
      if constexpr (kMasked && kDocuments) first2 = *reinterpret_cast<const int2*>(sF + buf * BQ + nt * 8 + c2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fast_exp2(s[nt][e] * sl2 - ((e & 1) ? lse2.y : lse2.x));
        if constexpr (kMasked) {
          const int key = warp_k0 + g + (e >> 1) * 8;
          const int t = tq0 + nt * 8 + c2 + (e & 1);
          if (t < key || t >= T) p = 0.0f;
          if constexpr (kDocuments)
            if (key < ((e & 1) ? first2.y : first2.x)) p = 0.0f;
        }
        s[nt][e] = p;
      }
    }

    uint32_t pa[4][4];
    pack_a_fragments(pa, s);
    wgmma_fence(dv, pa);
    wgmma_tile<1>(dv, pa, do_tile, true);  // dV += P^T dO
    wgmma_commit();
    wgmma_wait<1>();
    fence_registers(dp);

    // dS^T = P^T (dP^T - D[t]) with P as rounded to bf16 for dV's product, read back from its
    // A fragments: FP32 P need not stay live, which is what lets three blocks share a
    // multiprocessor (154 registers; 170 with FP32 P, where ptxas refused three). Masked
    // entries have P = 0, so dS = 0 there.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float2 d2 = *reinterpret_cast<const float2*>(sDb + nt * 8 + c2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t pair = pa[nt / 2][(nt & 1) * 2 + (e >> 1)];  // acc_to_a's layout
        const float p = __uint_as_float((e & 1) ? (pair & 0xFFFF0000u) : (pair << 16));
        dp[nt][e] = p * (dp[nt][e] - ((e & 1) ? d2.y : d2.x));
      }
    }

    uint32_t dsa[4][4];
    pack_a_fragments(dsa, dp);
    wgmma_fence(dk, dsa);
    wgmma_tile<1>(dk, dsa, q_tile, true);  // dK += dS^T Q
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dv);
    fence_registers(dk);
    fence_registers(pa);
    fence_registers(dsa);
    __syncthreads();  // buffer `buf` is refilled by the next tile's prefetch
  };
  const int n_whole = T / BQ;  // tiles [0, n_whole) end at or before T
  query_tile(qt_begin, std::true_type{});
  if constexpr (kDocuments) {
    // Unmasked while whole and before qt_documents; from there to the walk's end, masked.
    const int unmasked_end = min(n_whole, qt_documents);
    int qt = qt_begin + 1;
    for (; qt < unmasked_end; ++qt) query_tile(qt, std::false_type{});
    for (; qt < n_qt; ++qt) query_tile(qt, std::true_type{});
  } else {
    for (int qt = qt_begin + 1; qt < n_whole; ++qt) query_tile(qt, std::false_type{});
    if (n_whole > qt_begin && n_whole < n_qt) query_tile(n_whole, std::true_type{});
  }

  // Epilogue.
  if constexpr (kOperand) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[nt][e] *= scale;
    // The loop's last barrier freed shared memory: both tiles are staged at once.
    OperandTile* tiles = reinterpret_cast<OperandTile*>(smem);
    uint32_t amax = stage_operand_tile(tiles[0], dk, 0u);
    amax = stage_operand_tile(tiles[1], dv, amax);
    __syncthreads();
    const int M = static_cast<int>(gridDim.z) * T, N = 3 * C, row0 = head.first_row + k0;
    write_operand_tile(operand, tiles[0], row0, C + head.first_column, M, N);
    write_operand_tile(operand, tiles[1], row0, 2 * C + head.first_column, M, N);
    publish_amax(operand.amax, amax, lane);
  } else {
    // dk (scaled) and dv rows of this warp's keys, bf16, direct 4-byte stores.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = warp_k0 + g + r * 8;
      if (key < T) {
        bf16* row = head.q(dqkv) + static_cast<size_t>(key) * head.qkv_stride;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int col = nt * 8 + c2;
          *reinterpret_cast<__nv_bfloat162*>(row + C + col) =
              __floats2bfloat162_rn(dk[nt][2 * r] * scale, dk[nt][2 * r + 1] * scale);
          *reinterpret_cast<__nv_bfloat162*>(row + 2 * static_cast<size_t>(C) + col) =
              __floats2bfloat162_rn(dv[nt][2 * r], dv[nt][2 * r + 1]);
        }
      }
    }
  }
}

// D [B,NH,T] of one warp's 16 query rows t0..t0+15 (0 for rows >= T, never stored):
// rowsum(dO * O), summed as attention_backward_dot_kernel<64> sums it (8 lanes a row, 8 values
// each by dot_bf16x8, then a butterfly over the 8), so its bits. Returns the rows g and g + 8 that
// the thread's fragments hold; the lanes that finish a row write it to D_out.
__device__ __forceinline__ void row_dots_of_warp(float (&row_D)[2], float* __restrict__ D_out,
                                                 const bf16* __restrict__ do_rows, const bf16* __restrict__ o_rows,
                                                 int C, int t0, int T) {
  const int lane = threadIdx.x % 32, g = lane >> 2, chunk = lane % 8;
  row_D[0] = row_D[1] = 0.0f;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int row = 4 * pass + lane / 8;
    const size_t off = static_cast<size_t>(row) * C + chunk * 8;
    float sum = t0 + row < T ? dot_bf16x8(do_rows + off, o_rows + off) : 0.0f;
#pragma unroll
    for (int offset = 4; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (chunk == 0 && t0 + row < T) D_out[t0 + row] = sum;
    const float of_g = __shfl_sync(0xffffffffu, sum, (g % 4) * 8);  // row 4 pass + g % 4
    if (pass == g / 4) row_D[0] = of_g;
    if (pass == 2 + g / 4) row_D[1] = of_g;
  }
}

// dqkv [B,T,3C]: writes the q third (or, with kOperand, its FP8 operand). out [B,T,C] is the
// forward's output; D [B,NH,T] is written here (row_dots_of_warp) for the dK/dV kernel after
// it. Other arguments as the dK/dV kernel. Four blocks a multiprocessor (122 registers, no
// spills).
template <bool kOperand, bool kDocuments>
__global__ void __launch_bounds__(kThreads, 4)
    attention_backward_dq_wgmma_kernel(bf16* __restrict__ dqkv, DqkvOperandTarget operand,
                                       const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                       const bf16* __restrict__ out, const float* __restrict__ lse,
                                       float* __restrict__ D, int T, int C, int NH, float sl2, float scale,
                                       const int32_t* __restrict__ document_starts) {
  device::start_after_previous_kernel();
  using Cfg = BackwardWgmmaConfig;
  constexpr int HS = Cfg::HS, BR = Cfg::BLOCK, BC = Cfg::TILE;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = swizzle_aligned(smem_raw);
  const uint32_t k_tiles = smem_u32(smem);                  // [2] swizzled [BC][64]
  const uint32_t v_tiles = k_tiles + 2 * Cfg::kTileBytes;   // [2] swizzled [BC][64]
  const uint32_t q_tile = k_tiles + 4 * Cfg::kTileBytes;    // swizzled [BR][64], the A of S
  const uint32_t do_tile = k_tiles + 5 * Cfg::kTileBytes;   // swizzled [BR][64], the A of dP

  const int qb = gridDim.x - 1 - blockIdx.x;  // longest first
  const Head head = this_head<HS>(T, C, NH);
  const auto [warp, lane, g, c2] = this_thread();

  const int q0 = qb * BR;
  const int q_last = min(q0 + BR, T) - 1;
  const int n_kt = q_last / BC + 1;
  const int warp_q0 = q0 + warp * 16;

  // Documents: where the walk starts, and the key tiles that need their mask.
  static_assert(BC == kKeyTile, "query_block_documents counts tiles of kKeyTile keys");
  const QueryBlockDocuments documents =
      query_block_documents<kDocuments>(document_starts, q0, q_last, n_kt, warp_q0 + g, T);
  const int kt_begin = documents.kt_begin, kt_documents = documents.kt_documents;
  const int(&row_first)[2] = documents.row_first;

  SwizzledTileWalk<BR>(head.q(qkv), head.qkv_stride, q0).load_next(q_tile, T);
  SwizzledTileWalk<BR>(head.rows(dout), head.C, q0).load_next(do_tile, T);
  SwizzledTileWalk<BC> k_walk(head.k(qkv), head.qkv_stride, kt_begin * BC), v_walk(head.v(qkv), head.qkv_stride, kt_begin * BC);
  k_walk.load_next(k_tiles + (kt_begin & 1) * Cfg::kTileBytes, T);
  v_walk.load_next(v_tiles + (kt_begin & 1) * Cfg::kTileBytes, T);
  cp_async_commit();

  // Row statistics of this thread's rows g and g+8 (zero for rows >= T: never stored).
  float row_lse2[2], row_D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = warp_q0 + g + r * 8;
    row_lse2[r] = t < T ? lse[head.stats + t] * kLog2e : 0.0f;
  }
  const size_t warp_rows = head.out_offset + static_cast<size_t>(warp_q0) * C;
  row_dots_of_warp(row_D, D + head.stats, dout + warp_rows, out + warp_rows, C, warp_q0, T);

  float dq[8][4];
  zero(dq);

  // One key tile. kMasked: the causal and length masks, which only the last tile (the
  // diagonal's, and the one reaching T) needs, and the documents' (the first tiles); peeled
  // as in the dK/dV kernel.
  auto key_tile = [&](int kt, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {
      k_walk.load_next(k_tiles + (buf ^ 1) * Cfg::kTileBytes, T);
      v_walk.load_next(v_tiles + (buf ^ 1) * Cfg::kTileBytes, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();
    const uint32_t k_tile = k_tiles + buf * Cfg::kTileBytes;
    const uint32_t v_tile = v_tiles + buf * Cfg::kTileBytes;
    const int k0 = kt * BC;

    float s[8][4], dp[8][4];
    wgmma_fence();
    wgmma_tile_ss<0>(s, q_tile, k_tile, false);  // S = Q K^T
    wgmma_commit();
    wgmma_tile_ss<0>(dp, do_tile, v_tile, false);  // dP = dO V^T
    wgmma_commit();
    wgmma_wait<1>();
    fence_registers(s);

    // P = exp2(S * sl2 - lse2), zero where s > t or s >= T, or s < first[t] (set, not
    // computed: a key outside t's document may score far above lse[t]).
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float p = fast_exp2(s[nt][e] * sl2 - row_lse2[r]);
        if constexpr (kMasked) {
          const int t = warp_q0 + g + r * 8;
          const int key = k0 + nt * 8 + c2 + (e & 1);
          if (key > t || key >= T) p = 0.0f;
          if constexpr (kDocuments)
            if (key < row_first[r]) p = 0.0f;
        }
        s[nt][e] = p;
      }
    wgmma_wait<0>();
    fence_registers(dp);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= dp[nt][e] - row_D[e >> 1];  // dS = P (dP - D)

    uint32_t dsa[4][4];
    pack_a_fragments(dsa, s);
    wgmma_fence(dq, dsa);
    wgmma_tile<1>(dq, dsa, k_tile, true);  // dQ += dS K
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dq);
    fence_registers(dsa);
    __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
  };
  int kt = kt_begin;
  if constexpr (kDocuments)
    for (; kt < kt_documents; ++kt) key_tile(kt, std::true_type{});
  for (; kt + 1 < n_kt; ++kt) key_tile(kt, std::false_type{});
  key_tile(n_kt - 1, std::true_type{});

  if constexpr (kOperand) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[nt][e] *= scale;
    OperandTile& tile = *reinterpret_cast<OperandTile*>(smem);  // free since the loop's last barrier
    const uint32_t amax = stage_operand_tile(tile, dq, 0u);
    __syncthreads();
    write_operand_tile(operand, tile, head.first_row + q0, head.first_column, static_cast<int>(gridDim.z) * T, 3 * C);
    publish_amax(operand.amax, amax, lane);
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = warp_q0 + g + r * 8;
      if (t < T) {
        bf16* row = head.q(dqkv) + static_cast<size_t>(t) * head.qkv_stride;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          *reinterpret_cast<__nv_bfloat162*>(row + nt * 8 + c2) =
              __floats2bfloat162_rn(dq[nt][2 * r] * scale, dq[nt][2 * r + 1] * scale);
      }
    }
  }
}

}  // namespace

}  // namespace fp8lm::cuda
