// Hopper warpgroup MMA (wgmma) helpers for the flash-attention kernels with head size 64
// (attention_backward_wgmma.cuh). Device code only; included by attention.cu.
//
// Why wgmma: with mma.sync every warp reloads the whole shared B tile through ldmatrix for
// each product (4 warps, 4x the bytes), and at head size 64 the backward was bound by those
// shared-memory reads, not by the tensor cores. wgmma reads its B operand from shared memory
// once per warpgroup (the 4 warps of a block), straight from a 128-byte-swizzled tile.
//
// ---- wgmma.m64n64k16 ---------------------------------------------------------------------
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], BF16 inputs, FP32 accumulators, one warpgroup.
// Warp w of the group owns rows 16w..16w+15, and within them the layouts are mma.sync's
// (attention_tiles.cuh): the 32 accumulators d[nt][e] are eight m16n8 C fragments, columns
// 8nt..8nt+7. B always comes from a swizzled shared tile. A comes from one too where it is
// an input (Q, K, V, dO: wgmma_tile_ss), and from registers where it is the previous
// product's result (P, dS: wgmma_tile): there the registers a0..a3 are an m16n8k16 A
// fragment, so acc_to_a turns a product's accumulators into the next product's A.
//
// ---- The tile: [rows][64] bf16 in shared memory, 128-byte swizzle -------------------------
// Row r (128 bytes) starts at byte 128r; its 16-byte chunk c (columns 8c..8c+7) is stored at
// chunk c ^ (r % 8). The tile starts on a 1024-byte boundary (the swizzle repeats every 8
// rows). One tile serves in both orientations:
//   K-major (trans = 0): rows are the operand's m or n, columns its k (K for S^T = K Q^T as
//     A, Q as B). k-step kk (columns 16kk..16kk+15) starts 32kk bytes into the tile.
//   MN-major (trans_b = 1, B only): rows are B's k, columns its n (dO for dV += P^T dO).
//     k-step kk (rows 16kk..16kk+15) starts 2048kk bytes into the tile.
// In both, the descriptor's stride byte offset (8 rows to the next 8) is 1024 bytes and the
// leading byte offset is unused (one swizzle atom spans all 64 columns).
//
// ---- Ordering -----------------------------------------------------------------------------
// wgmma runs asynchronously: wgmma_fence(the registers it will read), issue, commit a group,
// wait_group<N> until at most N groups are in flight. Accumulators and A registers of a group
// in flight are not touched; fence_registers after the wait keeps the compiler from moving
// their reads before it. Inputs are never held as A registers across tiles: so held, ptxas
// gave their registers to the next product's A fragments, and the forward's later tiles
// computed S from P instead of Q (found on an H100). Read from shared memory, they need no
// registers at all, and no ldmatrix per tile.
// Tiles written with cp.async (the generic proxy) need fence_proxy_async before the barrier
// that publishes them to wgmma (the async proxy): current_tile_ready<true> does both.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "layers/attention_tiles.cuh"

// wgmma is an sm_90a instruction. Built for another target (FP8LM_CUDA_ARCHS), these helpers
// trap, and the host never launches the kernels that use them there (attention.cu).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP8LM_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define FP8LM_WGMMA(...) __trap()
#endif

namespace fp8lm::cuda {

namespace {

constexpr int kSwizzledRowBytes = 128;                      // 64 bf16
constexpr int kSwizzleAtomBytes = 1024;                     // 8 rows: the pattern's period and alignment
constexpr int kMnMajorKStepBytes = 16 * kSwizzledRowBytes;  // 16 rows
constexpr int kKMajorKStepBytes = 16 * 2;                   // 16 columns

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kSwizzledRowBytes + ((chunk ^ (row & 7)) << 4));
}

// This thread's share of copying a head's rows (q, k, v or dout: row stride `stride`
// elements from `base`, the head's row 0) into swizzled tiles (1024-byte aligned), ROWS rows
// a tile, one tile after another from row0: a kernel's walked tiles, or its one fixed tile.
// A pass copies 16 rows (8 chunks a row, one a thread); a thread copies the same chunk of
// rows r, r + 16, ..., which all keep row r's swizzle (16 is a multiple of the pattern's 8
// rows). Offsets and pointers are set once, so a tile costs a pointer increment and a
// cp.async per chunk, with row checks only where a tile reaches past T (rows >= T are
// zero-filled and read nothing).
// A wgmma query block's documents (forward and dQ): the walk starts at the tile of the block's
// first row's first key (first[] is nondecreasing), and the key tiles kt_begin..kt_documents-1
// begin before its last row's first key, so they need the documents' mask (the tile of the
// diagonal, n_kt - 1, has its own). row_first: the first keys of this thread's rows g and g + 8.
// Without documents every field is 0 and document_starts is not read.
struct QueryBlockDocuments {
  int kt_begin = 0, kt_documents = 0;
  int row_first[2] = {0, 0};
};
template <bool kDocuments>
__device__ __forceinline__ QueryBlockDocuments query_block_documents(const int32_t* document_starts, int q0,
                                                                     int q_last, int n_kt, int row0, int T) {
  QueryBlockDocuments documents;
  if constexpr (kDocuments) {
    const int32_t* first = document_row(document_starts, T);
    documents.kt_begin = first[q0] / kKeyTile;
    documents.kt_documents = min((first[q_last] + kKeyTile - 1) / kKeyTile, n_kt - 1);
#pragma unroll
    for (int r = 0; r < 2; ++r) documents.row_first[r] = first_key_of(first, row0 + r * 8, T);
  }
  return documents;
}

template <int ROWS>
struct SwizzledTileWalk {
  static constexpr int kChunks = 8;
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kPasses = ROWS / kRowsPerPass;
  static_assert(ROWS % kRowsPerPass == 0, "whole passes");

  // Kept small: the walks live in registers through the kernels' loops.
  const bf16* src;      // this thread's chunk of its first row of the next tile
  int row_stride;       // elements from one row to the next
  uint32_t dst_offset;  // this thread's byte offset in a tile
  int tile_row;         // the next tile's first row

  __device__ __forceinline__ SwizzledTileWalk(const bf16* base, size_t stride, int row0) {
    const int thread_row = static_cast<int>(threadIdx.x) / kChunks;
    const int chunk = static_cast<int>(threadIdx.x) % kChunks;
    tile_row = row0;
    row_stride = static_cast<int>(stride);
    src = base + static_cast<size_t>(row0 + thread_row) * stride + chunk * 8;
    dst_offset = swizzled_offset(thread_row, chunk);
  }

  // Copies the next tile into the swizzled tile at `tile`, and moves on to the one after.
  __device__ __forceinline__ void load_next(uint32_t tile, int T) {
    const size_t pass_stride = static_cast<size_t>(kRowsPerPass) * row_stride;
    const bf16* p = src;
    if (tile_row + ROWS <= T) {
#pragma unroll
      for (int j = 0; j < kPasses; ++j, p += pass_stride)
        cp_async_16(tile + dst_offset + j * kRowsPerPass * kSwizzledRowBytes, p, true);
    } else {
      // A tile reaching past T: rows >= T read nothing, from a valid address (this chunk of
      // the tile's first row, which is < T).
      const int thread_row = static_cast<int>(threadIdx.x) / kChunks;
      const bf16* first_row = src - static_cast<size_t>(thread_row) * row_stride;
#pragma unroll
      for (int j = 0; j < kPasses; ++j, p += pass_stride) {
        const bool valid = tile_row + thread_row + j * kRowsPerPass < T;
        cp_async_16(tile + dst_offset + j * kRowsPerPass * kSwizzledRowBytes, valid ? p : first_row, valid);
      }
    }
    src += kPasses * pass_stride;
    tile_row += ROWS;
  }
};

// The first 1024-byte boundary of the block's dynamic shared memory.
__device__ __forceinline__ unsigned char* swizzle_aligned(unsigned char* smem) {
  const uint32_t base = smem_u32(smem);
  return smem + (((base + kSwizzleAtomBytes - 1) & ~static_cast<uint32_t>(kSwizzleAtomBytes - 1)) - base);
}

// A fragments of all k-steps from a [16 x 8N] accumulator (P or dS), rounded to bf16.
template <int N>
__device__ __forceinline__ void pack_a_fragments(uint32_t (&frag)[N / 2][4], const float (&acc)[N][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 2; ++kk) acc_to_a(frag[kk], acc, kk);
}

// Shared-memory matrix descriptor of a swizzled tile's k-step starting at shared address
// `start`: address >> 4 in bits 0-13, leading byte offset 16 (unused here) in bits 16-29,
// stride byte offset 1024 in bits 32-45, base offset 0 (atoms are 1024-aligned), and the
// 128-byte swizzle mode (1) in bits 62-63.
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t start) {
  return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (static_cast<uint64_t>(16 >> 4) << 16) |
         (static_cast<uint64_t>(kSwizzleAtomBytes >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_commit() { FP8LM_WGMMA("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  FP8LM_WGMMA("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[M][N][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i) fence_registers(r[i]);
}

// Before issuing wgmmas: pins the last writes of every register array the coming wgmmas read
// (accumulators, A fragments) ahead of wgmma.fence, which orders them before the async reads.
// Without the pins the compiler may sink those writes (an online-softmax rescale, a packed A
// fragment) below the fence, and the tensor cores read stale registers.
template <typename... Registers>
__device__ __forceinline__ void wgmma_fence(Registers&... registers) {
  (fence_registers(registers), ...);
  FP8LM_WGMMA("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// The 32 FP32 accumulators of an m64n64 product, d[8][4], as operands %0..%31 of both forms
// below: the list in the asm text, and the matching read-write operands.
#define FP8LM_WGMMA_ACCUMULATOR_LIST                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define FP8LM_WGMMA_ACCUMULATORS(d)                                                                              \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])

// d (+)= a B for one k-step: accumulate when `accumulate`, else d = a B. TRANS_B: 0 for a
// K-major B tile, 1 for an MN-major one (see above).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_descriptor,
                                                bool accumulate) {
  FP8LM_WGMMA(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      FP8LM_WGMMA_ACCUMULATOR_LIST
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
      "}\n"
      : FP8LM_WGMMA_ACCUMULATORS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor), "r"(static_cast<int>(accumulate)), "n"(TRANS_B));
}

// d (+)= A B for one k-step, A from shared memory too: a K-major swizzled tile (rows are
// A's m, columns its k).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t a_descriptor, uint64_t b_descriptor,
                                                   bool accumulate) {
  FP8LM_WGMMA(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      FP8LM_WGMMA_ACCUMULATOR_LIST
      "%32, %33, p, 1, 1, 0, %35;\n"
      "}\n"
      : FP8LM_WGMMA_ACCUMULATORS(d)
      : "l"(a_descriptor), "l"(b_descriptor), "r"(static_cast<int>(accumulate)), "n"(TRANS_B));
}

// acc (+)= A B over the 64-deep k, A the K-major swizzled tile at `a_tile`, B the tile at
// `b_tile` in the orientation TRANS_B. Issues four wgmmas; the caller fences, commits, waits.
// The k-steps' descriptors are the tile's plus the step's offset in the address field: tiles
// lie in the first 228 KiB of the shared window, so the 14-bit field never carries.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_tile_ss(float (&acc)[8][4], uint32_t a_tile, uint32_t b_tile, bool accumulate) {
  constexpr uint32_t kStep = TRANS_B ? kMnMajorKStepBytes : kKMajorKStepBytes;
  const uint64_t a_descriptor = swizzled_descriptor(a_tile), b_descriptor = swizzled_descriptor(b_tile);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n64k16_ss<TRANS_B>(acc, a_descriptor + ((kk * kKMajorKStepBytes) >> 4), b_descriptor + ((kk * kStep) >> 4),
                                accumulate || kk > 0);
}

// acc (+)= A B over the 64-deep k of a swizzled tile: A as four k-step fragments in
// registers, B the tile at `tile` in the orientation TRANS_B. The first k-step overwrites acc
// unless `accumulate`. Issues four wgmmas; the caller fences, commits and waits.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_tile(float (&acc)[8][4], const uint32_t (&a)[4][4], uint32_t tile,
                                           bool accumulate) {
  constexpr uint32_t kStep = TRANS_B ? kMnMajorKStepBytes : kKMajorKStepBytes;
  const uint64_t descriptor = swizzled_descriptor(tile);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n64k16<TRANS_B>(acc, a[kk], descriptor + ((kk * kStep) >> 4), accumulate || kk > 0);
}

}  // namespace

}  // namespace fp8lm::cuda
