#include "core/gemm_small_m_cuda.h"

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/check_cuda.h"
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

// D [M,N] = alpha * a_scale_inv * b_scale_inv * (A [M,K] . B [N,K]^T) + beta * C [M,N] + bias [N],
// M <= kMaxM (rows m >= M are skipped, warp-uniformly). Lane l of a warp owns the pieces
// l, l + 32, l + 64, ... of its rows; the warp's FP32 sums [kRowsPerWarp][kMaxM] are combined
// across lanes at the end.
template <typename Format, int kMaxM>
__global__ void __launch_bounds__(kThreads)
    gemm_small_m_kernel(bf16* __restrict__ D, const typename Format::Storage* __restrict__ A,
                        const typename Format::Storage* __restrict__ B, const bf16* __restrict__ C,
                        const bf16* __restrict__ bias, const float* __restrict__ a_scale_inv,
                        const float* __restrict__ b_scale_inv, float alpha, float beta, int M, int N, int K) {
  device::start_after_previous_kernel();
  constexpr int kPer = Format::kValuesPerPiece;
  using Storage = typename Format::Storage;
  const int pieces = K / kPer;
  const int lane = threadIdx.x % 32;
  const int first_row = (blockIdx.x * kWarps + threadIdx.x / 32) * kRowsPerWarp;
  // A row past N (the last warp of an odd N) streams row N - 1 again and writes nothing:
  // the loop needs no row checks.
  const Storage* b_rows[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) b_rows[r] = B + size_t(min(first_row + r, N - 1)) * size_t(K);

  float sums[kRowsPerWarp][kMaxM];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) sums[r][m] = 0.0f;

  // The pieces [begin, begin + 32 * kPiecesPerBatch) of the warp's rows, this lane's share
  // (zeros past the row's end).
  auto load_batch = [&](uint4 (&batch)[kPiecesPerBatch][kRowsPerWarp], int begin) {
#pragma unroll
    for (int p = 0; p < kPiecesPerBatch; ++p) {
      const int piece = begin + 32 * p;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        batch[p][r] = piece < pieces ? load_streaming(b_rows[r] + size_t(piece) * kPer) : make_uint4(0, 0, 0, 0);
    }
  };
  // Double-buffered: the next batch's loads are issued before this batch is used, so a long
  // row (K = 6400 in E4M3: seven batches a lane) keeps loads in flight while it multiplies.
  uint4 b_pieces[kPiecesPerBatch][kRowsPerWarp];
  load_batch(b_pieces, lane);
  for (int begin = lane; begin < pieces; begin += 32 * kPiecesPerBatch) {
    uint4 next_pieces[kPiecesPerBatch][kRowsPerWarp];
    const int next_begin = begin + 32 * kPiecesPerBatch;
    if (next_begin < pieces) load_batch(next_pieces, next_begin);
#pragma unroll
    for (int p = 0; p < kPiecesPerBatch; ++p) {
      const int piece = begin + 32 * p;
      if (piece < pieces) {
        float b_values[kRowsPerWarp][kPer];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) Format::decode(b_pieces[p][r], b_values[r]);
#pragma unroll
        for (int m = 0; m < kMaxM; ++m) {
          if (m < M) {
            float a_values[kPer];
            Format::decode(__ldg(reinterpret_cast<const uint4*>(A + size_t(m) * K + size_t(piece) * kPer)), a_values);
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
      for (int p = 0; p < kPiecesPerBatch; ++p)
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) b_pieces[p][r] = next_pieces[p][r];
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

  // CpuOps' order: the scaled product, then + C, then + bias, one rounding to BF16.
  const float scale =
      (a_scale_inv ? *a_scale_inv : 1.0f) * (b_scale_inv ? *b_scale_inv : 1.0f) * alpha;
  static_assert(kRowsPerWarp * kMaxM <= 32, "one lane per output of the warp");
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      const int n = first_row + r;
      if (lane != r * kMaxM + m || m >= M || n >= N) continue;
      const size_t at = size_t(m) * N + n;
      float value = sums[r][m] * scale;
      if (C) value += beta * __bfloat162float(C[at]);
      if (bias) value += __bfloat162float(bias[n]);
      D[at] = __float2bfloat16_rn(value);
    }
  }
}

template <typename Format>
void launch(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream) {
  using Storage = typename Format::Storage;
  const int blocks = (desc.N + kRowsPerBlock - 1) / kRowsPerBlock;
  auto run = [&](auto kernel) {
    launch_kernel(kernel, blocks, kThreads, 0, stream, static_cast<bf16*>(args.D), static_cast<const Storage*>(args.A),
                  static_cast<const Storage*>(args.B), static_cast<const bf16*>(args.C),
                  static_cast<const bf16*>(args.bias), args.a_scale_inv, args.b_scale_inv, args.alpha, args.beta,
                  desc.M, desc.N, desc.K);
  };
  static_assert(kSmallMMaxRows == 8, "the instantiations below cover M in [1, 8]");
  if (desc.M == 1) return run(gemm_small_m_kernel<Format, 1>);
  if (desc.M == 2) return run(gemm_small_m_kernel<Format, 2>);
  if (desc.M <= 4) return run(gemm_small_m_kernel<Format, 4>);
  run(gemm_small_m_kernel<Format, 8>);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

const char* small_m_gemm_refusal(const GemmDesc& desc, const GemmArgs& args) {
  if (desc.M < 1 || desc.M > kSmallMMaxRows) return "M is outside [1, kSmallMMaxRows]";
  if (desc.N < 1) return "N < 1";
  const bool e4m3 = desc.a_type == GemmType::e4m3 && desc.b_type == GemmType::e4m3;
  const bool bf16_inputs = desc.a_type == GemmType::bf16 && desc.b_type == GemmType::bf16;
  if (!e4m3 && !bf16_inputs) return "the operands are not both E4M3 or both BF16";
  if (desc.d_type != GemmType::bf16) return "D is not BF16";
  if (args.gelu_input != nullptr) return "a GELU epilogue";
  if (args.bias && desc.bias_type != GemmType::bf16) return "the bias is not BF16";
  if (desc.a_scaling != GemmScaling::tensor || desc.b_scaling != GemmScaling::tensor)
    return "an operand is block-scaled (--fp8-recipe blockwise)";
  if (desc.a_transposed || desc.b_transposed) return "an operand is stored transposed";
  if (desc.K < 16 || desc.K % 16 != 0) return "K is not a positive multiple of 16 (whole 16-byte pieces)";
  if (!aligned16(args.A) || !aligned16(args.B)) return "A or B is not 16-byte aligned";
  if (args.C != nullptr && args.C == args.D) return "C is D (accumulation in place)";
  if (args.C == nullptr && args.beta != 0.0f) return "beta != 0 without C";
  if (bf16_inputs && (args.a_scale_inv || args.b_scale_inv)) return "a scale_inv for a BF16 operand";
  return nullptr;
}

void gemm_small_m(const GemmDesc& desc, const GemmArgs& args, cudaStream_t stream) {
  if (const char* refusal = small_m_gemm_refusal(desc, args))
    throw RuntimeError("small-M GEMM [" + std::to_string(desc.M) + "," + std::to_string(desc.N) + "," +
                           std::to_string(desc.K) + "]: " + refusal,
                       "GemmEngine::gemm sends such a GEMM to cuBLASLt");
  FP8LM_CHECK(args.A && args.B && args.D, "small-M GEMM needs A, B and D");
  if (desc.a_type == GemmType::e4m3) return launch<E4m3Codes>(desc, args, stream);
  launch<Bf16Values>(desc, args, stream);
}

}  // namespace fp8lm::cuda
