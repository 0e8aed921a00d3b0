#include "core/gemm_small_m_cuda.h"

#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/error.h"
#include "core/launch.cuh"

namespace fp8lm::cuda {

namespace {

using bf16 = __nv_bfloat16;

// A block is kWarps warps; each warp streams kRowsPerWarp rows of B [N,K] together, so each
// piece of A it decodes serves that many rows. Each lane loads its pieces in batches of
// kPiecesPerBatch 16-byte loads per row and issues the next batch before it multiplies the
// current one: up to 2 x kPiecesPerBatch x kRowsPerWarp loads in flight per lane (HBM latency
// is hidden by bytes in flight, not by threads: at N = 1600 there are only 800 warps for 132
// multiprocessors). Two per batch, not four without the second batch: as many bytes in flight
// at the start of a row, but at M = 1 the kernel stays at 54 registers, so all of gpt2-1558m's
// c_fc (800 blocks) is resident at once. Blocks of 8
// rows keep even N = 1600 at 200 blocks, more than one per multiprocessor.
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kPiecesPerBatch = 2;

// 16 bytes of B, streamed once per step and far larger than L2 at gpt2-1558m: not kept in L1,
// which then holds A (a few KB, read by every warp of the multiprocessor).
__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// The two operand formats: how many values a 16-byte piece holds and their FP32 values.
struct E4m3Codes {
  using Storage = uint8_t;
  static constexpr int kValuesPerPiece = 16;
  // Byte i of the piece (the lower address first) is value i. E4M3 -> FP16 is exact (and keeps
  // NaN), FP16 -> FP32 too.
  __device__ __forceinline__ static void decode(const uint4& piece, float (&values)[kValuesPerPiece]) {
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const auto pair = static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * half));
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
        const float2 f = __half22float2(__half2(raw));
        values[4 * w + 2 * half] = f.x;
        values[4 * w + 2 * half + 1] = f.y;
      }
    }
  }
};

struct Bf16Values {
  using Storage = bf16;
  static constexpr int kValuesPerPiece = 8;
  // A BF16 value is the upper half of its FP32 value.
  __device__ __forceinline__ static void decode(const uint4& piece, float (&values)[kValuesPerPiece]) {
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      values[2 * w] = __uint_as_float(words[w] << 16);
      values[2 * w + 1] = __uint_as_float(words[w] & 0xFFFF0000u);
    }
  }
};

// Everything one launch needs (a kernel parameter: one struct, so a call site reads by name).
struct Problem {
  void* D;           // [M,N] bf16, or E4M3 codes under the GELU epilogue with d_scale
  const void* A;     // [M,K] A's format; with the LayerNorm prologue, where block 0 writes it
  const void* B;     // [N,K]
  const bf16* C;     // [M,N] or nullptr
  const bf16* bias;  // [N] or nullptr
  const float* a_scale_inv;
  const float* b_scale_inv;
  float alpha, beta;
  int M, N, K;
  bf16* gelu_input;      // the GELU epilogue: [M,N] bf16(x) (nullptr: none)
  const float* d_scale;  // an E4M3 D (GELU epilogue only)
  SmallMLayerNorm layernorm;  // layernorm.input nullptr: A read from memory
};

// The LayerNorm prologue: every block normalizes the M rows of p.layernorm.input into `a`
// (shared memory, E4M3 codes), warp w taking rows w, w + kWarps, ..., reading each row three
// times (from L1 after the first). The order of every sum is layernorm_forward_kernel's (lane
// l adds chunks l, l + 32, ... of 8 values in order, then a butterfly), so the codes, mean and
// rstd are its bits. Block 0 writes them out and raises the amax.
__device__ void layernorm_prologue(const Problem& p, uint8_t* a) {
  const SmallMLayerNorm& ln = p.layernorm;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int C = p.K, chunks = C / 8;
  const float scale = *ln.scale;
  const bool writer = blockIdx.x == 0;
  unsigned amax_bits = 0u;
  for (int m = warp; m < p.M; m += kWarps) {  // warp-uniform
    const uint4* in_row = static_cast<const uint4*>(ln.input) + size_t(m) * chunks;
    float sum = 0.0f;
    for (int i = lane; i < chunks; i += 32) {
      float x[8];
      device::unpack_bf16x8(__ldg(in_row + i), x);
#pragma unroll
      for (int j = 0; j < 8; j++) sum += x[j];
    }
    sum = device::warp_sum(sum);
    const float row_mean = sum / C;
    float squared_deviation = 0.0f;
    for (int i = lane; i < chunks; i += 32) {
      float x[8];
      device::unpack_bf16x8(__ldg(in_row + i), x);
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const float d = x[j] - row_mean;
        squared_deviation += d * d;
      }
    }
    squared_deviation = device::warp_sum(squared_deviation);
    const float row_rstd = 1.0f / sqrtf(squared_deviation / C + ln.eps);
    for (int i = lane; i < chunks; i += 32) {
      float x[8], w[8], b[8], y[8];
      device::unpack_bf16x8(__ldg(in_row + i), x);
      device::load_bf16x8(static_cast<const bf16*>(ln.weight) + i * 8, w);
      device::load_bf16x8(static_cast<const bf16*>(ln.bias) + i * 8, b);
#pragma unroll
      for (int j = 0; j < 8; j++) y[j] = (x[j] - row_mean) * row_rstd * w[j] + b[j];
      const size_t at = size_t(m) * C + size_t(i) * 8;
#pragma unroll
      for (int j = 0; j < 8; j++) {
        y[j] = device::round_bf16(y[j]);
        amax_bits = max(amax_bits, device::abs_bits(y[j]));
      }
      const uint2 codes = device::fp8x8(y, scale, __NV_E4M3);
      *reinterpret_cast<uint2*>(a + at) = codes;
      if (writer) *reinterpret_cast<uint2*>(static_cast<uint8_t*>(const_cast<void*>(p.A)) + at) = codes;
    }
    if (writer && lane == 0) {
      if (ln.mean != nullptr) ln.mean[m] = row_mean;
      if (ln.rstd != nullptr) ln.rstd[m] = row_rstd;
    }
  }
  if (writer) device::block_amax_update(ln.amax, amax_bits);  // synchronises block 0
  __syncthreads();
}

// D [M,N] = alpha * a_scale_inv * b_scale_inv * (A [M,K] . B [N,K]^T) + beta * C [M,N] + bias [N]
// (or the GELU epilogue), M <= kMaxM (rows m >= M are skipped, warp-uniformly). Lane l of a warp
// owns the pieces l, l + 32, l + 64, ... of its rows; the warp's FP32 sums [kRowsPerWarp][kMaxM]
// are combined across lanes at the end.
// kFused: the one-row kernel that also takes the GELU epilogue and the LayerNorm prologue (their
// code stays out of the others, whose registers it would raise).
template <typename Format, int kMaxM, bool kLayerNorm = false, bool kFused = false>
__global__ void __launch_bounds__(kThreads) gemm_small_m_kernel(const Problem p) {
  device::start_after_previous_kernel();
  constexpr int kPer = Format::kValuesPerPiece;
  using Storage = typename Format::Storage;
  const int M = p.M, N = p.N, K = p.K;
  const int pieces = K / kPer;
  const int lane = threadIdx.x % 32;
  const int first_row = (blockIdx.x * kWarps + threadIdx.x / 32) * kRowsPerWarp;

  // A row past N (the last warp of an odd N) streams row N - 1 again and writes nothing:
  // the loop needs no row checks.
  const Storage* b_rows[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    b_rows[r] = static_cast<const Storage*>(p.B) + size_t(min(first_row + r, N - 1)) * size_t(K);

  float sums[kRowsPerWarp][kMaxM];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) sums[r][m] = 0.0f;

  // The pieces [begin, begin + 32 * kPiecesPerBatch) of the warp's rows, this lane's share
  // (zeros past the row's end).
  auto load_batch = [&](uint4 (&batch)[kPiecesPerBatch][kRowsPerWarp], int begin) {
#pragma unroll
    for (int q = 0; q < kPiecesPerBatch; ++q) {
      const int piece = begin + 32 * q;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        batch[q][r] = piece < pieces ? load_streaming(b_rows[r] + size_t(piece) * kPer) : make_uint4(0, 0, 0, 0);
    }
  };
  // Double-buffered: the next batch's loads are issued before this batch is used, so a long
  // row (K = 6400 in E4M3: seven batches a lane) keeps loads in flight while it multiplies.
  uint4 b_pieces[kPiecesPerBatch][kRowsPerWarp];
  load_batch(b_pieces, lane);

  // A: the LayerNorm prologue's rows in shared memory (computed while the first batch of B is
  // in flight), or A as given.
  const Storage* A = static_cast<const Storage*>(p.A);
  if constexpr (kLayerNorm) {
    static_assert(std::is_same_v<Format, E4m3Codes>, "the prologue writes E4M3 codes");
    extern __shared__ uint4 staged[];  // A [M,K]
    layernorm_prologue(p, reinterpret_cast<uint8_t*>(staged));
    A = reinterpret_cast<const Storage*>(staged);
  }

  for (int begin = lane; begin < pieces; begin += 32 * kPiecesPerBatch) {
    uint4 next_pieces[kPiecesPerBatch][kRowsPerWarp];
    const int next_begin = begin + 32 * kPiecesPerBatch;
    if (next_begin < pieces) load_batch(next_pieces, next_begin);
#pragma unroll
    for (int q = 0; q < kPiecesPerBatch; ++q) {
      const int piece = begin + 32 * q;
      if (piece < pieces) {
        float b_values[kRowsPerWarp][kPer];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) Format::decode(b_pieces[q][r], b_values[r]);
#pragma unroll
        for (int m = 0; m < kMaxM; ++m) {
          if (m < M) {
            float a_values[kPer];
            const uint4* a_piece = reinterpret_cast<const uint4*>(A + size_t(m) * K + size_t(piece) * kPer);
            Format::decode(kLayerNorm ? *a_piece : __ldg(a_piece), a_values);
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
              for (int e = 0; e < kPer; ++e) sums[r][m] = fmaf(a_values[e], b_values[r][e], sums[r][m]);
          }
        }
      }
    }
    if (next_begin < pieces) {
#pragma unroll
      for (int q = 0; q < kPiecesPerBatch; ++q)
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) b_pieces[q][r] = next_pieces[q][r];
    }
  }

  // Butterfly: every lane ends with the same totals (each level adds the same two partial
  // sums on both sides), in an order fixed by the launch shape.
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < kMaxM; ++m)
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sums[r][m] += __shfl_xor_sync(0xffffffffu, sums[r][m], offset);

  // CpuOps' order: the scaled product, then + C, then + bias, one rounding to BF16 (or the
  // GELU epilogue on that unrounded value).
  const float scale = (p.a_scale_inv ? *p.a_scale_inv : 1.0f) * (p.b_scale_inv ? *p.b_scale_inv : 1.0f) * p.alpha;
  static_assert(kRowsPerWarp * kMaxM <= 32, "one lane per output of the warp");
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      const int n = first_row + r;
      if (lane != r * kMaxM + m || m >= M || n >= N) continue;
      const size_t at = size_t(m) * N + n;
      float value = sums[r][m] * scale;
      if (p.C) value += p.beta * __bfloat162float(p.C[at]);
      if (p.bias) value += __bfloat162float(p.bias[n]);
      if (!kFused || p.gelu_input == nullptr) {
        static_cast<bf16*>(p.D)[at] = __float2bfloat16_rn(value);
        continue;
      }
      p.gelu_input[at] = __float2bfloat16_rn(value);
      const float activated = device::gelu_tanh(value);
      if (p.d_scale == nullptr) {
        static_cast<bf16*>(p.D)[at] = __float2bfloat16_rn(activated);
      } else {
        static_cast<uint8_t*>(p.D)[at] =
            static_cast<uint8_t>(__nv_cvt_float_to_fp8(activated * *p.d_scale, __NV_SATFINITE, __NV_E4M3));
      }
    }
  }
}

// ---- The tensor-core form, M <= kSmallMTensorCoreMaxRows (small_m_form sends it E4M3 GEMMs of
// 2 to 16 rows). From two rows the FP32 sums above cost more than the weights' bytes (each
// lane multiplies a loaded piece by every row), so these rows go to the tensor cores, still in
// one pass over B.
// A block owns 16 rows of B (16 columns of D) and its warps split K: warp w takes the 64-byte
// chunks w, w + W, w + 2W, ... of those rows. In a chunk, lane l (g = l / 4, t = l % 4) loads
// 16 bytes at byte 16 t of B's rows g and g + 8, and the same 16 bytes of each row 8 j + g of A
// (j < kTiles); each such piece is two mma k-steps (m16n8k32 for E4M3, m16n8k16 for BF16) with
// B as the 16-row operand and A as the 8-column one. The pieces' four 4-byte words give the
// fragments' registers in the order the mma's layout wants (rows g and g + 8, K slots 4t and
// 4t + 16 for E4M3, 2t and 2t + 8 for BF16): the products' K order is a permutation of the
// chunk's, the same for A and B, so the sums are those of A . B^T in another order. Each warp
// keeps kInFlight chunks of B loading while it multiplies one; the warps' partial sums meet in
// shared memory and are added in warp order (no atomics: bit-reproducible).
constexpr int kMmaRowsPerBlock = 16;
constexpr int kChunkBytes = 64;
constexpr int kInFlight = 4;

template <typename Format>
__device__ __forceinline__ void mma_16x8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Format, E4m3Codes>) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// D [M,N] as gemm_small_m_kernel's, M <= 8 kTiles; N a multiple of 16, K a whole number of
// 64-byte chunks. Dynamic shared memory: the warps' partial sums, W x kTiles x 4 x 32 floats.
template <typename Format, int kTiles>
__global__ void __launch_bounds__(kTiles <= 4 ? 512 : 256) gemm_small_m_mma_kernel(const Problem p) {
  device::start_after_previous_kernel();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int g = lane / 4, t = lane % 4;
  const size_t row_bytes = size_t(p.K) * sizeof(typename Format::Storage);
  const int chunks = int(row_bytes / kChunkBytes);
  const int first_row = blockIdx.x * kMmaRowsPerBlock;
  const uint8_t* b_low = static_cast<const uint8_t*>(p.B) + size_t(first_row + g) * row_bytes + 16 * t;
  const uint8_t* b_high = b_low + 8 * row_bytes;
  const uint8_t* a_lane = static_cast<const uint8_t*>(p.A) + size_t(g) * row_bytes + 16 * t;

  float sums[kTiles][4];
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) sums[j][r] = 0.0f;

  // This warp's chunks are warp, warp + warps, ...: kInFlight of them loading at any time.
  uint4 low[kInFlight], high[kInFlight];
  auto load_chunk = [&](int slot, int chunk) {
    if (chunk < chunks) {
      low[slot] = load_streaming(b_low + size_t(chunk) * kChunkBytes);
      high[slot] = load_streaming(b_high + size_t(chunk) * kChunkBytes);
    }
  };
#pragma unroll
  for (int slot = 0; slot < kInFlight; ++slot) load_chunk(slot, warp + slot * warps);
  for (int base = warp; base < chunks; base += kInFlight * warps) {
#pragma unroll
    for (int slot = 0; slot < kInFlight; ++slot) {
      const int chunk = base + slot * warps;
      if (chunk >= chunks) break;
      const uint4 w_low = low[slot], w_high = high[slot];
      load_chunk(slot, chunk + kInFlight * warps);
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        uint4 a = make_uint4(0, 0, 0, 0);
        if (8 * j + g < p.M) a = __ldg(reinterpret_cast<const uint4*>(a_lane + size_t(8 * j) * row_bytes +
                                                                       size_t(chunk) * kChunkBytes));
        mma_16x8<Format>(sums[j], w_low.x, w_high.x, w_low.y, w_high.y, a.x, a.y);
        mma_16x8<Format>(sums[j], w_low.z, w_high.z, w_low.w, w_high.w, a.z, a.w);
      }
    }
  }

  // The warps' partials, then their sum in warp order and the epilogue (CpuOps' order: the
  // scaled product, + C, + bias, one rounding to BF16).
  extern __shared__ float partials[];  // [warps][kTiles][4][32]
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) partials[((warp * kTiles + j) * 4 + r) * 32 + lane] = sums[j][r];
  __syncthreads();
  const float scale = (p.a_scale_inv ? *p.a_scale_inv : 1.0f) * (p.b_scale_inv ? *p.b_scale_inv : 1.0f) * p.alpha;
  for (int i = threadIdx.x; i < kTiles * 4 * 32; i += blockDim.x) {
    const int j = i / 128, r = (i / 32) % 4, owner = i % 32;
    // Accumulator r of lane `owner` in tile j: D's row 8 j + 2 (owner % 4) + (r % 2), column
    // first_row + owner / 4 + 8 (r / 2).
    const int m = 8 * j + 2 * (owner % 4) + (r % 2), n = first_row + owner / 4 + 8 * (r / 2);
    if (m >= p.M) continue;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += partials[w * kTiles * 128 + i];
    const size_t at = size_t(m) * p.N + n;
    float value = total * scale;
    if (p.C) value += p.beta * __bfloat162float(p.C[at]);
    if (p.bias) value += __bfloat162float(p.bias[n]);
    static_cast<bf16*>(p.D)[at] = __float2bfloat16_rn(value);
  }
}

template <typename Format>
void launch_mma(const Problem& problem, cudaStream_t stream) {
  const int blocks = problem.N / kMmaRowsPerBlock;
  auto run = [&](auto kernel, int tiles) {
    // Bytes in flight: a narrow B (few blocks) splits K over more warps, within 48 KB of partials
    // (and the 256 threads of eight tiles' launch bounds).
    const int warps = problem.N <= 2048 && tiles <= 4 ? 16 : 8;
    const size_t shared = size_t(warps) * tiles * 4 * 32 * sizeof(float);
    launch_kernel(kernel, blocks, 32 * warps, shared, stream, problem);
  };
  static_assert(kSmallMTensorCoreMaxRows == 64, "the instantiations below cover M up to 64");
  if (problem.M <= 16) return run(gemm_small_m_mma_kernel<Format, 2>, 2);
  if (problem.M <= 32) return run(gemm_small_m_mma_kernel<Format, 4>, 4);
  run(gemm_small_m_mma_kernel<Format, 8>, 8);
}

// The prologue's shared memory: A's E4M3 codes.
size_t layernorm_shared_bytes(int M, int K) { return size_t(M) * K; }
// What a block may take without raising its dynamic shared-memory limit.
constexpr size_t kDefaultSharedBytes = 48 * 1024;

template <typename Format>
void launch(const Problem& problem, bool layernorm, cudaStream_t stream) {
  const int blocks = (problem.N + kRowsPerBlock - 1) / kRowsPerBlock;
  const size_t shared = layernorm ? layernorm_shared_bytes(problem.M, problem.K) : 0;
  auto run = [&](auto kernel) { launch_kernel(kernel, blocks, kThreads, shared, stream, problem); };
  static_assert(kSmallMMaxRows == 8, "the instantiations below cover M in [1, 8]");
  if (problem.gelu_input != nullptr || layernorm) {  // one row (small_m_gemm_refusal)
    if constexpr (std::is_same_v<Format, E4m3Codes>) {
      if (layernorm) return run(gemm_small_m_kernel<Format, 1, true, true>);
    }
    return run(gemm_small_m_kernel<Format, 1, false, true>);
  }
  if (problem.M == 1) return run(gemm_small_m_kernel<Format, 1>);
  if (problem.M == 2) return run(gemm_small_m_kernel<Format, 2>);
  if (problem.M <= 4) return run(gemm_small_m_kernel<Format, 4>);
  run(gemm_small_m_kernel<Format, 8>);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

namespace {

// The conditions both forms share, then each form's own.
const char* refusal_in_form(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm* layernorm,
                            SmallMForm form) {
  const int max_rows = form == SmallMForm::fp32_sums ? kSmallMMaxRows : kSmallMTensorCoreMaxRows;
  if (desc.M < 1 || desc.M > max_rows)
    return form == SmallMForm::fp32_sums ? "M is outside [1, kSmallMMaxRows]" : "M is outside [1, kSmallMTensorCoreMaxRows]";
  if (desc.N < 1) return "N < 1";
  if (form == SmallMForm::tensor_cores) {
    if (args.gelu_input != nullptr || layernorm != nullptr)
      return "a GELU epilogue or LayerNorm prologue in the tensor-core form (the FP32 form's, at one row)";
    if (desc.N % kMmaRowsPerBlock != 0) return "N is not a multiple of 16 (the tensor-core form's block of B's rows)";
    const int bytes = desc.a_type == GemmType::e4m3 ? 1 : 2;
    if ((size_t(desc.K) * bytes) % kChunkBytes != 0) return "K is not a whole number of 64-byte chunks";
  }
  const bool e4m3 = desc.a_type == GemmType::e4m3 && desc.b_type == GemmType::e4m3;
  const bool bf16_inputs = desc.a_type == GemmType::bf16 && desc.b_type == GemmType::bf16;
  if (!e4m3 && !bf16_inputs) return "the operands are not both E4M3 or both BF16";
  const bool gelu = args.gelu_input != nullptr;
  if (!gelu && desc.d_type != GemmType::bf16) return "D is not BF16";
  if (gelu) {
    if (desc.M != 1) return "a GELU epilogue on more than one row (slower than the GELU kernel after it at 8: call 141)";
    if (desc.d_type != GemmType::bf16 && desc.d_type != GemmType::e4m3) return "a GELU epilogue into neither BF16 nor E4M3";
    if (args.bias == nullptr || args.C != nullptr) return "a GELU epilogue without a bias, or with C";
    if ((desc.d_type == GemmType::e4m3) != (args.d_scale != nullptr)) return "an E4M3 D without d_scale (or a BF16 D with one)";
    if (args.d_amax != nullptr) return "a GELU epilogue that sets D's amax";
  }
  if (args.bias && desc.bias_type != GemmType::bf16) return "the bias is not BF16";
  if (desc.a_scaling != GemmScaling::tensor || desc.b_scaling != GemmScaling::tensor)
    return "an operand is block-scaled (--fp8-recipe blockwise)";
  if (desc.a_transposed || desc.b_transposed) return "an operand is stored transposed";
  if (desc.K < 16 || desc.K % 16 != 0) return "K is not a positive multiple of 16 (whole 16-byte pieces)";
  if (!aligned16(args.A) || !aligned16(args.B)) return "A or B is not 16-byte aligned";
  if (args.C != nullptr && args.C == args.D) return "C is D (accumulation in place)";
  if (args.C == nullptr && args.beta != 0.0f) return "beta != 0 without C";
  if (bf16_inputs && (args.a_scale_inv || args.b_scale_inv)) return "a scale_inv for a BF16 operand";
  if (layernorm != nullptr) {
    if (desc.M != 1 || !e4m3)
      return "a LayerNorm prologue for more than one row or BF16 operands (slower than the LayerNorm kernel: call 141)";
    if (!layernorm->input || !layernorm->weight || !layernorm->bias) return "a LayerNorm prologue without input, weight or bias";
    if (!aligned16(layernorm->input) || !aligned16(layernorm->weight) || !aligned16(layernorm->bias))
      return "a LayerNorm prologue's input, weight or bias is not 16-byte aligned";
    if (layernorm->scale == nullptr) return "a LayerNorm prologue without the cast's scale";
    if (desc.K > kSmallMLayerNormPrologueMaxWidth)
      return "a LayerNorm prologue over rows wider than 2,048 (slower than the LayerNorm kernel: call 190)";
    if (layernorm_shared_bytes(desc.M, desc.K) > kDefaultSharedBytes)
      return "a LayerNorm prologue whose rows do not fit 48 KB of shared memory";
  }
  return nullptr;
}

// The most rows GemmEngine sends here, by operand type and width (small_m_form's measurements).
int rows_served(const GemmDesc& desc) {
  if (desc.a_type == GemmType::e4m3) return kSmallMTensorCoreRowsE4m3;
  return desc.N >= kSmallMVocabularyWideN ? kSmallMMaxRows : kSmallMRowsBf16;
}

}  // namespace

std::optional<SmallMForm> small_m_form(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm* layernorm) {
  // Measured on an H100 (device calls 180-184, docs/INFERENCE.md): one row is the FP32 form's
  // (it holds the one-row epilogue and prologue, and the tensor cores' 16-row tiles gained
  // nothing there in a whole step); two to 16 rows of E4M3 the tensor cores' (the FP32 form
  // multiplies every loaded piece by every row: at 8 rows it took 2-4x as long); BF16 one row,
  // and up to 8 rows of a vocabulary-wide output (the tied LM head: 0.11 ms of a batch-8 step
  // in the FP32 form, 0.65 ms in cuBLASLt's kernel), else cuBLASLt's from two rows (its BF16
  // kernels read the blocks' weights faster than either form); wider, cuBLASLt's.
  if (desc.M > rows_served(desc)) return std::nullopt;
  const bool e4m3 = desc.a_type == GemmType::e4m3;
  const SmallMForm preferred = desc.M == 1 || !e4m3 ? SmallMForm::fp32_sums : SmallMForm::tensor_cores;
  for (const SmallMForm form : {preferred, preferred == SmallMForm::fp32_sums ? SmallMForm::tensor_cores
                                                                              : SmallMForm::fp32_sums})
    if (refusal_in_form(desc, args, layernorm, form) == nullptr) return form;
  return std::nullopt;
}

const char* small_m_gemm_refusal(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm* layernorm,
                                 std::optional<SmallMForm> form) {
  if (form) return refusal_in_form(desc, args, layernorm, *form);
  if (small_m_form(desc, args, layernorm)) return nullptr;
  if (desc.M > rows_served(desc)) return "more rows than the small-M kernel serves faster than cuBLASLt";
  // Why the FP32 form, the one that takes the most kinds of problem, does not take it.
  return refusal_in_form(desc, args, layernorm, SmallMForm::fp32_sums);
}

void gemm_small_m(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream, const SmallMLayerNorm* layernorm,
                  std::optional<SmallMForm> form) {
  if (!form) form = small_m_form(desc, args, layernorm);
  if (const char* refusal = small_m_gemm_refusal(desc, args, layernorm, form))
    throw RuntimeError("small-M GEMM [" + std::to_string(desc.M) + "," + std::to_string(desc.N) + "," +
                           std::to_string(desc.K) + "]: " + refusal,
                       "GemmEngine decides which GEMMs the small-M kernel takes (small_m_gemm_refusal)");
  FP8LM_CHECK(args.A && args.B && args.D, "small-M GEMM needs A, B and D");
  const Problem problem{.D = args.D,
                        .A = args.A,
                        .B = args.B,
                        .C = static_cast<const bf16*>(args.C),
                        .bias = static_cast<const bf16*>(args.bias),
                        .a_scale_inv = args.a_scale_inv,
                        .b_scale_inv = args.b_scale_inv,
                        .alpha = args.alpha,
                        .beta = args.beta,
                        .M = desc.M,
                        .N = desc.N,
                        .K = desc.K,
                        .gelu_input = static_cast<bf16*>(args.gelu_input),
                        .d_scale = args.d_scale,
                        .layernorm = layernorm ? *layernorm : SmallMLayerNorm{}};
  const bool e4m3 = desc.a_type == GemmType::e4m3;
  if (*form == SmallMForm::tensor_cores)
    return e4m3 ? launch_mma<E4m3Codes>(problem, stream) : launch_mma<Bf16Values>(problem, stream);
  if (e4m3) return launch<E4m3Codes>(problem, layernorm != nullptr, stream);
  launch<Bf16Values>(problem, layernorm != nullptr, stream);
}

}  // namespace fp8lm::cuda
