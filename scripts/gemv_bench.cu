// What bounds a decoding step's one-row GEMM (the small-M kernel's FP32 form, core/gemm_small_m.cu):
// the weight stream or the E4M3 decode. Three kernels with the FP32 form's access pattern (4 warps
// a block, 2 rows of B a warp, a lane's 16-byte pieces l, l + 32, ..., two pieces a row in flight,
// double-buffered), at gpt2-1558m's and gpt-6.7b's decoding shapes, each weight read from HBM
// (copies cycled past the 50 MB L2):
//   read     : B's words XOR-ed, no decode and no FMA: the access pattern's bandwidth ceiling
//   bf16     : BF16 B and A decoded by shifts and multiplied in FP32 (the FP32 form's BF16 path)
//   e4m3 cvt : E4M3 B and A, cvt e4m3x2 -> f16x2 -> f32, multiplied in FP32 (its E4M3 path)
// Prints microseconds per call and the weight's GB/s (docs/INFERENCE.md, device call 188).
// With the argument `l2`, every call reads the same copy instead, so a weight that fits the L2
// is read from there (what prefetching the next GEMMs' weights into the L2 can buy at most);
// with `prefetch`, copies cycle as by default and each call's blocks first ask the L2 for the
// copy that the call two after it reads (cp.async.bulk.prefetch.L2, a block's share each).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/gemv_bench.cu -o /tmp/gemv && /tmp/gemv [l2]
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define CHECK(call) do { cudaError_t e = (call); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); std::exit(1); } } while (0)

constexpr int kWarps = 4, kThreads = 128, kRowsPerWarp = 2, kPiecesPerBatch = 2;
enum Variant { kRead, kBf16, kE4m3Cvt };

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <Variant V> struct Fmt;
template <> struct Fmt<kRead> { static constexpr int kPer = 16; };
template <> struct Fmt<kBf16> { static constexpr int kPer = 8; };
template <> struct Fmt<kE4m3Cvt> { static constexpr int kPer = 16; };

__device__ __forceinline__ void decode_cvt(const uint4& piece, float (&v)[16]) {
  const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * h));
      const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
      const float2 f = __half22float2(__half2(raw));
      v[4 * w + 2 * h] = f.x;
      v[4 * w + 2 * h + 1] = f.y;
    }
}
__device__ __forceinline__ void decode_bf16(const uint4& piece, float (&v)[8]) {
  const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    v[2 * w] = __uint_as_float(words[w] << 16);
    v[2 * w + 1] = __uint_as_float(words[w] & 0xFFFF0000u);
  }
}

template <Variant V>
__global__ void __launch_bounds__(kThreads) gemv(const void* B, const void* A, float* D, int N, int K,
                                                  const uint8_t* prefetch, size_t prefetch_bytes) {
  if (prefetch != nullptr && threadIdx.x == 0) {
    const size_t share = (prefetch_bytes / gridDim.x + 15) / 16 * 16;
    const size_t begin = share * blockIdx.x;
    for (size_t at = begin; at < begin + share && at < prefetch_bytes; at += 32768) {
      const size_t n = min(size_t(32768), min(begin + share, prefetch_bytes) - at);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(prefetch + at), "r"(uint32_t(n)) : "memory");
    }
  }
  constexpr int kPer = Fmt<V>::kPer;
  constexpr int kBytes = V == kBf16 ? 2 : 1;
  const int pieces = K / kPer;
  const int lane = threadIdx.x % 32;
  const int first_row = (blockIdx.x * kWarps + threadIdx.x / 32) * kRowsPerWarp;
  const uint8_t* rows[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = static_cast<const uint8_t*>(B) + size_t(min(first_row + r, N - 1)) * K * kBytes;
  float sums[kRowsPerWarp] = {};
  uint32_t bits[kRowsPerWarp] = {};
  auto load_batch = [&](uint4 (&batch)[kPiecesPerBatch][kRowsPerWarp], int begin) {
#pragma unroll
    for (int q = 0; q < kPiecesPerBatch; ++q)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int piece = begin + 32 * q;
        batch[q][r] = piece < pieces ? load_streaming(rows[r] + size_t(piece) * 16) : make_uint4(0, 0, 0, 0);
      }
  };
  uint4 cur[kPiecesPerBatch][kRowsPerWarp];
  load_batch(cur, lane);
  for (int begin = lane; begin < pieces; begin += 32 * kPiecesPerBatch) {
    uint4 next[kPiecesPerBatch][kRowsPerWarp];
    const int next_begin = begin + 32 * kPiecesPerBatch;
    if (next_begin < pieces) load_batch(next, next_begin);
#pragma unroll
    for (int q = 0; q < kPiecesPerBatch; ++q) {
      const int piece = begin + 32 * q;
      if (piece >= pieces) continue;
      if constexpr (V == kRead) {
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) bits[r] ^= cur[q][r].x ^ cur[q][r].y ^ cur[q][r].z ^ cur[q][r].w;
      } else {
        const uint4 a_piece = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(A) + size_t(piece) * 16));
        float a[kPer];
        float b[kRowsPerWarp][kPer];
        if constexpr (V == kBf16) {
          decode_bf16(a_piece, a);
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) decode_bf16(cur[q][r], b[r]);
        } else {
          decode_cvt(a_piece, a);
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) decode_cvt(cur[q][r], b[r]);
        }
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
          for (int e = 0; e < kPer; ++e) sums[r] = fmaf(a[e], b[r][e], sums[r]);
      }
    }
    if (next_begin < pieces)
#pragma unroll
      for (int q = 0; q < kPiecesPerBatch; ++q)
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) cur[q][r] = next[q][r];
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    float s = V == kRead ? float(bits[r] & 0xFF) : sums[r];
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0 && first_row + r < N) D[first_row + r] = s;
  }
}

struct Shape { const char* name; int K, N; };

int main(int argc, char** argv) {
  const bool from_l2 = argc > 1 && std::strcmp(argv[1], "l2") == 0;
  const bool prefetching = argc > 1 && std::strcmp(argv[1], "prefetch") == 0;
  const Shape shapes[] = {{"1558m c_attn", 1600, 4800}, {"1558m attn.c_proj", 1600, 1600}, {"1558m c_fc", 1600, 6400},
                          {"1558m mlp.c_proj", 6400, 1600}, {"6.7b c_attn", 4096, 12288}, {"6.7b attn.c_proj", 4096, 4096},
                          {"6.7b c_fc", 4096, 16384}, {"6.7b mlp.c_proj", 16384, 4096}};
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  // Random finite E4M3 codes (no NaN: 0x7F/0xFF excluded), subnormals included.
  auto random_codes = [](size_t n, uint64_t seed) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; ++i) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      uint8_t c = uint8_t(seed >> 56);
      if ((c & 0x7F) == 0x7F) c &= 0xFE;
      v[i] = c;
    }
    return v;
  };
  std::printf("%-20s %-10s %10s %10s\n", "shape", "variant", "us", "GB/s");
  for (const Shape& s : shapes) {
    const size_t e4m3_bytes = size_t(s.N) * s.K, bf16_bytes = 2 * e4m3_bytes;
    const int copies = int(std::max<size_t>(2, (size_t{384} << 20) / e4m3_bytes));
    uint8_t *B, *A;
    float* D;
    CHECK(cudaMalloc(&B, bf16_bytes * copies));
    CHECK(cudaMalloc(&A, size_t(s.K) * 2));
    CHECK(cudaMalloc(&D, size_t(s.N) * 4));
    {
      std::vector<uint8_t> host = random_codes(bf16_bytes, 1);
      for (int c = 0; c < copies; ++c) CHECK(cudaMemcpy(B + c * bf16_bytes, host.data(), bf16_bytes, cudaMemcpyHostToDevice));
      std::vector<uint8_t> a = random_codes(size_t(s.K) * 2, 2);
      // The BF16 variant reads the same random bytes, some of them NaN or infinite: no timing depends on values.
      CHECK(cudaMemcpy(A, a.data(), a.size(), cudaMemcpyHostToDevice));
    }
    for (const Variant v : {kRead, kBf16, kE4m3Cvt}) {
      const size_t stride = v == kBf16 ? bf16_bytes : e4m3_bytes;
      const int launch_copies = from_l2 ? 1 : int(std::min<size_t>(copies, (bf16_bytes * copies) / stride));
      const int blocks = (s.N + kWarps * kRowsPerWarp - 1) / (kWarps * kRowsPerWarp);
      auto launch = [&](int c) {
        const void* b = B + size_t(c % launch_copies) * stride;
        const uint8_t* ahead = prefetching ? B + size_t((c + 2) % launch_copies) * stride : nullptr;
        switch (v) {
          case kRead: gemv<kRead><<<blocks, kThreads>>>(b, A, D, s.N, s.K, ahead, stride); break;
          case kBf16: gemv<kBf16><<<blocks, kThreads>>>(b, A, D, s.N, s.K, ahead, stride); break;
          case kE4m3Cvt: gemv<kE4m3Cvt><<<blocks, kThreads>>>(b, A, D, s.N, s.K, ahead, stride); break;
        }
      };
      for (int c = 0; c < launch_copies; ++c) launch(c);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      constexpr int kCalls = 200;
      CHECK(cudaEventRecord(t0));
      for (int c = 0; c < kCalls; ++c) launch(c);
      CHECK(cudaEventRecord(t1));
      CHECK(cudaEventSynchronize(t1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, t0, t1));
      const double us = 1e3 * ms / kCalls;
      const char* names[] = {"read", "bf16", "e4m3 cvt"};
      std::printf("%-20s %-10s %10.2f %10.0f\n", s.name, names[v], us, double(stride) / (us * 1e3));
    }
    CHECK(cudaFree(B));
    CHECK(cudaFree(A));
    CHECK(cudaFree(D));
  }
  return 0;
}
