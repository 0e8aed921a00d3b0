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

const char* small_m_gemm_refusal(const GemmDesc& desc, const GemmArgs& args, const SmallMLayerNorm* layernorm) {
  if (desc.M < 1 || desc.M > kSmallMMaxRows) return "M is outside [1, kSmallMMaxRows]";
  if (desc.N < 1) return "N < 1";
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
    if (layernorm_shared_bytes(desc.M, desc.K) > kDefaultSharedBytes)
      return "a LayerNorm prologue whose rows do not fit 48 KB of shared memory";
  }
  return nullptr;
}

void gemm_small_m(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream, const SmallMLayerNorm* layernorm) {
  if (const char* refusal = small_m_gemm_refusal(desc, args, layernorm))
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
  if (desc.a_type == GemmType::e4m3) return launch<E4m3Codes>(problem, layernorm != nullptr, stream);
  launch<Bf16Values>(problem, layernorm != nullptr, stream);
}

}  // namespace fp8lm::cuda
