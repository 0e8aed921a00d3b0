// Flash-attention forward for head size 64 with Hopper's wgmma: the algorithm of
// attention_forward.cuh (online softmax on raw scores, exp2 with one FFMA, P in bf16 from
// the accumulators, the fused FP8 output and amax), with each block's 4 warps acting as one
// warpgroup. Included once, by attention.cu. Helpers and layouts: attention_wgmma.cuh.
//
// grid (ceil(T/64), NH, B), query blocks longest first. A block owns 64 queries, one m64
// product (warp w: rows 16w..16w+15). Per key tile (64 keys, K and V in swizzled shared
// tiles, double-buffered): S = Q K^T, mask, online softmax, rescale O, O += P V.
// Blocks of 128 queries (two m64 products, one's softmax overlapping the other's wgmmas,
// the mma.sync kernel's MT = 2) measured 19% slower at gpt2-1558m's shape (0.121 against
// 0.101 ms, one H100): more blocks in flight beat the overlap within one.
// Epilogue as the mma.sync kernel: O / l -> bf16 (optionally FP8 + amax), lse.
// Only the last key tile (the diagonal's, and one reaching past T) is masked, and with
// documents (attention_tiles.cuh) the tiles that begin before the block's last row's first key;
// the loop peels them off. The walk starts at the tile of the block's first row's first key.
// smem: Q and K, V [2] as swizzled [64][64] tiles (40 KiB, 1024-aligned).

#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/launch.cuh"
#include "layers/attention_forward.cuh"
#include "layers/attention_tiles.cuh"
#include "layers/attention_wgmma.cuh"

namespace fp8lm::cuda {

namespace {

struct ForwardWgmmaConfig {
  static constexpr int HS = 64;
  static constexpr int BR = 64;  // queries per block
  static constexpr int BC = 64;  // keys per tile
  static constexpr int kTileBytes = BC * kSwizzledRowBytes;
  static constexpr size_t smem_bytes = kSwizzleAtomBytes /* alignment slack */ + 5 * kTileBytes;
};

// Arguments as attention_forward_kernel.
template <bool kDocuments>
__global__ void __launch_bounds__(kThreads)
    attention_forward_wgmma_kernel(bf16* __restrict__ out, float* __restrict__ lse, uint8_t* __restrict__ out_fp8,
                                   float* __restrict__ out_amax, const float* __restrict__ out_scale, bool e5m2,
                                   const bf16* __restrict__ qkv, int T, int C, int NH, float sl2,
                                   const int32_t* __restrict__ document_starts) {
  device::start_after_previous_kernel();
  using Cfg = ForwardWgmmaConfig;
  constexpr int HS = Cfg::HS, BR = Cfg::BR, BC = Cfg::BC;
  constexpr int NT = HS / 8;  // n-tiles over the head dim (O)
  constexpr int SN = BC / 8;  // n-tiles over the keys of one tile (S)

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = swizzle_aligned(smem_raw);
  const uint32_t k_tiles = smem_u32(smem);                         // [2] swizzled [BC][64]
  const uint32_t v_tiles = k_tiles + 2 * Cfg::kTileBytes;          // [2] swizzled [BC][64]
  const uint32_t q_tile = k_tiles + 4 * Cfg::kTileBytes;           // swizzled [BR][64], the A of S

  const int qb = gridDim.x - 1 - blockIdx.x;  // the longest (last) query blocks start first
  const Head head = this_head<HS>(T, C, NH);
  const auto [warp, lane, g, c2] = this_thread();

  const int q0 = qb * BR;
  const int q_last = min(q0 + BR, T) - 1;  // last valid query of the block
  const int n_kt = q_last / BC + 1;        // key tiles 0..n_kt-1 reach the diagonal (all keys < T)
  const int warp_q0 = q0 + warp * 16;      // this warp's first query

  // Documents: where the walk starts, and the key tiles that need their mask.
  static_assert(BC == kKeyTile, "query_block_documents counts tiles of kKeyTile keys");
  const QueryBlockDocuments documents =
      query_block_documents<kDocuments>(document_starts, q0, q_last, n_kt, warp_q0 + g, T);
  const int kt_begin = documents.kt_begin, kt_documents = documents.kt_documents;
  const int(&row_first)[2] = documents.row_first;

  SwizzledTileWalk<BR>(head.q(qkv), head.qkv_stride, q0).load_next(q_tile, T);
  SwizzledTileWalk<BC> k_walk(head.k(qkv), head.qkv_stride, kt_begin * BC),
      v_walk(head.v(qkv), head.qkv_stride, kt_begin * BC);
  k_walk.load_next(k_tiles + (kt_begin & 1) * Cfg::kTileBytes, T);
  v_walk.load_next(v_tiles + (kt_begin & 1) * Cfg::kTileBytes, T);
  cp_async_commit();

  float o[NT][4];
  float m[2], l[2];  // running max of the raw scores and this thread's partial row sums
  zero(o);
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.0f;

  // One key tile. kMasked: the causal and length masks, which only the last tile (the
  // diagonal's, and the one reaching T) needs, and the documents' (the first tiles); the
  // others run without them (peeled below, so that the compiler cannot turn the mask into
  // selects executed on every tile).
  auto key_tile = [&](int kt, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int buf = kt & 1;
    // prefetch the next tile into the other buffer (freed by the last sync)
    current_tile_ready<true>(kt + 1 < n_kt, [&] {
      k_walk.load_next(k_tiles + (buf ^ 1) * Cfg::kTileBytes, T);
      v_walk.load_next(v_tiles + (buf ^ 1) * Cfg::kTileBytes, T);
    });

    const int k0 = kt * BC;
    const uint32_t k_tile = k_tiles + buf * Cfg::kTileBytes;
    const uint32_t v_tile = v_tiles + buf * Cfg::kTileBytes;

    float s[SN][4];
    wgmma_fence();
    wgmma_tile_ss<0>(s, q_tile, k_tile, false);  // S = Q K^T
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);

    // Causal mask (s > t, and s >= T) only on tiles that cross the diagonal or T, and the
    // documents' (s < first[t]) on those that begin before a row's document. S stays
    // unscaled: the max is taken on raw scores and exp2(S*sl2 - m*sl2) is one FFMA. A row that
    // sees no key of the tile is left as it was (see the mma.sync kernel).
    if constexpr (kMasked) {
#pragma unroll
      for (int nt = 0; nt < SN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = warp_q0 + g + (e >> 1) * 8;
          const int col = k0 + nt * 8 + c2 + (e & 1);
          if (col > row || col >= T) s[nt][e] = -INFINITY;
          if constexpr (kDocuments)
            if (col < row_first[e >> 1]) s[nt][e] = -INFINITY;
        }
    }

    // Online softmax, per row r (g and g+8); the 4 threads of a quad share a row.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < SN; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;  // a row with no key yet
      const float alpha = fast_exp2((m[r] - m_use) * sl2);      // m_old = -inf -> 0
      const float m_scaled = m_use * sl2;
      m[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < SN; ++nt) {
        const float p0 = fast_exp2(fmaf(s[nt][2 * r], sl2, -m_scaled));
        const float p1 = fast_exp2(fmaf(s[nt][2 * r + 1], sl2, -m_scaled));
        s[nt][2 * r] = p0;
        s[nt][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        o[nt][2 * r] *= alpha;
        o[nt][2 * r + 1] *= alpha;
      }
    }

    uint32_t pa[4][4];
    pack_a_fragments(pa, s);
    wgmma_fence(o, pa);
    wgmma_tile<1>(o, pa, v_tile, true);  // O += P V
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(pa);
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  };
  int kt = kt_begin;
  if constexpr (kDocuments)
    for (; kt < kt_documents; ++kt) key_tile(kt, std::true_type{});
  for (; kt + 1 < n_kt; ++kt) key_tile(kt, std::false_type{});
  key_tile(n_kt - 1, std::true_type{});

  // Epilogue: normalise, write bf16 (+ FP8 and amax), lse. Direct 4-byte (2-byte FP8) stores.
  const ForwardOutput dst{out, out_fp8, lse, out_scale != nullptr ? *out_scale : 1.0f, e5m2 ? __NV_E5M2 : __NV_E4M3};
  publish_amax(out_amax, store_output_rows(dst, head.out_offset, head.stats, o, m, l, sl2, warp_q0, T, C, lane, 0u),
               lane);
}

}  // namespace

}  // namespace fp8lm::cuda
