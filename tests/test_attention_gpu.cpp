// The CUDA flash attention (layers/attention.cu) against the CPU reference
// (layers/attention.cpp) on BF16-rounded random inputs.
//
// Bounds (relative L2 error ||gpu - ref|| / ||ref||, see tests/gpu_testing.h):
//   forward out  < 1e-2  (P is rounded to BF16 before P V, and out is stored as BF16)
//   forward lse  < 1e-4  (FP32 statistics; S from exact BF16 products in FP32)
//   backward dq, dk, dv (each) < 2e-2  (P and dS are rounded to BF16 for the tensor cores)
// FP8 output: codes equal casting the returned BF16 output with the same scale (exact),
// amax equals max |bf16 out| (exact, a running max). Backward is bit-reproducible, and the
// chain GPU forward -> GPU backward stays within 2e-2 of the CPU chain.
// Shapes include T that is not a multiple of any tile (the kernels tile by 16/32/64/128).
// Documents (document_starts): the same bounds against the CPU reference, the wgmma kernels
// bit for bit against the mma.sync ones, the FP8 operand against the cast, each document of a
// packed row against that document alone, and starts all 0 bit for bit against nullptr.
// Note: a "[gpu]" filter also selects the hidden "[.bench]" case (Catch2 runs hidden tests
// that a tag matches); "[gpu]~[.bench]" leaves it out.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <cuda_runtime.h>

#include "core/cast_cuda.h"
#include "core/check_cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "layers/attention.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;
using fp8lm::testing::bf16_rounded;
using fp8lm::testing::device_copy;
using fp8lm::testing::from_bf16;
using fp8lm::testing::kPoisonByte;
using fp8lm::testing::random_floats;
using fp8lm::testing::relative_error;
using fp8lm::testing::same_bytes;
using fp8lm::testing::to_bf16;

namespace {

struct AttnShape {
  int B, T, NH, HS;
  int C() const { return NH * HS; }
};

// T = 1 (a single key), T below/at/above the tiles, several query blocks, every head size.
const AttnShape kShapes[] = {
    {2, 77, 2, 64},  {1, 256, 3, 32}, {1, 200, 2, 128}, {1, 300, 2, 64}, {2, 130, 1, 128},
    {3, 64, 2, 32},  {1, 1, 2, 64},   {1, 17, 1, 32},   {1, 129, 1, 64},  {1, 1100, 1, 64},
};

std::string describe(const AttnShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " NH=" + std::to_string(s.NH) +
         " HS=" + std::to_string(s.HS);
}

// One third (0 = q, 1 = k, 2 = v) of a packed [B,T,3C] tensor, as [B,T,C].
std::vector<float> third(const std::vector<float>& packed, int part, int B, int T, int C) {
  std::vector<float> out(static_cast<size_t>(B) * T * C);
  for (size_t bt = 0; bt < static_cast<size_t>(B) * T; ++bt)
    for (int i = 0; i < C; ++i) out[bt * C + i] = packed[bt * 3 * C + static_cast<size_t>(part) * C + i];
  return out;
}

// dqkv within the backward's bound (2e-2 relative), as a whole and, with each_part, each of
// dq, dk and dv on its own (a part that is exactly zero has no relative error to take).
void check_backward_error(const std::vector<float>& dqkv_gpu, const std::vector<float>& dqkv_ref, const AttnShape& s,
                          bool each_part) {
  const double all_err = relative_error(dqkv_gpu, dqkv_ref);
  INFO("dqkv rel err " << all_err);
  CHECK(all_err < 2e-2);
  if (!each_part) return;
  const char* names[] = {"dq", "dk", "dv"};
  for (int part = 0; part < 3; ++part) {
    const double err =
        relative_error(third(dqkv_gpu, part, s.B, s.T, s.C()), third(dqkv_ref, part, s.B, s.T, s.C()));
    INFO(names[part] << " rel err " << err);
    CHECK(err < 2e-2);
  }
}


struct ForwardRef {
  std::vector<float> qkv, out, lse;
};

// document_starts [B,T] (host memory, nullable) as in cpu::attention_forward.
ForwardRef forward_reference(const AttnShape& s, uint64_t seed, float std_dev = 1.0f,
                             const int32_t* document_starts = nullptr) {
  ForwardRef ref;
  const int C = s.C();
  ref.qkv = bf16_rounded(random_floats(static_cast<size_t>(s.B) * s.T * 3 * C, seed, std_dev));
  ref.out.resize(static_cast<size_t>(s.B) * s.T * C);
  ref.lse.resize(static_cast<size_t>(s.B) * s.NH * s.T);
  cpu::attention_forward(ref.out.data(), ref.lse.data(), ref.qkv.data(), document_starts, s.B, s.T, C, s.NH);
  return ref;
}

// The GPU forward of ref's qkv (with document_starts, device memory, nullable) against the CPU
// reference: out within 1e-2 and lse within 1e-4 relative, poisoned outputs first.
void check_forward_error(const ForwardRef& ref, const AttnShape& s, const int32_t* document_starts) {
  auto qkv = device_copy(to_bf16(ref.qkv));
  cuda::DeviceBuffer<__nv_bfloat16> out(ref.out.size());
  cuda::DeviceBuffer<float> lse(ref.lse.size());
  out.fill_bytes(kPoisonByte);
  lse.fill_bytes(kPoisonByte);
  cuda::attention_forward(out.data(), lse.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv.data(),
                          document_starts, s.B, s.T, s.C(), s.NH, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const double out_err = relative_error(from_bf16(out.download()), ref.out);
  const double lse_err = relative_error(lse.download(), ref.lse);
  INFO("out rel err " << out_err << ", lse rel err " << lse_err);
  CHECK(out_err < 1e-2);
  CHECK(lse_err < 1e-4);
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Everything one forward (with the FP8 output, scale 4, and amax) and one backward (from that
// forward's out and lse) write, each output poisoned first. document_starts: device memory,
// nullable. mma_sync: the mma.sync kernels at every head size.
struct AttentionRun {
  std::vector<__nv_bfloat16> out, dqkv;
  std::vector<uint8_t> out_fp8;
  std::vector<float> lse, amax, D;
};

AttentionRun run_attention(const AttnShape& s, const cuda::DeviceBuffer<__nv_bfloat16>& qkv,
                           const cuda::DeviceBuffer<__nv_bfloat16>& dout, const int32_t* document_starts,
                           bool mma_sync) {
  const int C = s.C();
  const size_t n_qkv = static_cast<size_t>(s.B) * s.T * 3 * C;
  const size_t n_out = static_cast<size_t>(s.B) * s.T * C;
  const size_t n_lse = static_cast<size_t>(s.B) * s.NH * s.T;
  auto scale = device_copy(std::vector<float>{4.0f});
  cuda::DeviceBuffer<__nv_bfloat16> out(n_out), dqkv(n_qkv);
  cuda::DeviceBuffer<uint8_t> out_fp8(n_out);
  cuda::DeviceBuffer<float> lse(n_lse), scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
  auto amax = device_copy(std::vector<float>{0.0f});
  out.fill_bytes(kPoisonByte);
  dqkv.fill_bytes(kPoisonByte);
  out_fp8.fill_bytes(kPoisonByte);
  lse.fill_bytes(kPoisonByte);
  scratch.fill_bytes(kPoisonByte);
  auto forward = mma_sync ? cuda::attention_forward_mma_sync : cuda::attention_forward;
  auto backward = mma_sync ? cuda::attention_backward_mma_sync : cuda::attention_backward;
  forward(out.data(), lse.data(), out_fp8.data(), amax.data(), scale.data(), Fp8Dtype::e4m3, qkv.data(),
          document_starts, s.B, s.T, C, s.NH, nullptr);
  backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), document_starts, s.B, s.T, C, s.NH,
           scratch.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return AttentionRun{out.download(), dqkv.download(), out_fp8.download(), lse.download(), amax.download(),
                      scratch.download()};
}

// Two runs' outputs, bit for bit.
void check_same_bits(const AttentionRun& a, const AttentionRun& b) {
  CHECK(same_bytes(a.out, b.out));
  CHECK(same_bytes(a.out_fp8, b.out_fp8));
  CHECK(same_bytes(a.lse, b.lse));
  CHECK(bits_of(a.amax[0]) == bits_of(b.amax[0]));
  CHECK(same_bytes(a.dqkv, b.dqkv));
  CHECK(same_bytes(a.D, b.D));
}

// ---- documents: helpers and cases -----------------------------------------------------------

// document_starts [B,T] (host memory) of rows of whole documents: row b holds documents of the
// lengths lengths[b], in order, which sum to T.
std::vector<int32_t> document_starts_of(const std::vector<std::vector<int>>& lengths, int T) {
  std::vector<int32_t> starts;
  for (const std::vector<int>& row : lengths) {
    int start = 0;
    for (int length : row) {
      starts.insert(starts.end(), static_cast<size_t>(length), start);
      start += length;
    }
    REQUIRE(start == T);
  }
  check_document_starts(starts.data(), static_cast<int>(lengths.size()), T, "test documents");
  return starts;
}

// document_starts in device memory; empty (data() nullptr) for none.
cuda::DeviceBuffer<int32_t> device_documents(const std::vector<int32_t>& starts) {
  return starts.empty() ? cuda::DeviceBuffer<int32_t>() : device_copy(starts);
}

// The GPU backward against the CPU reference on the same BF16 out and the reference's lse (so
// the backward alone is measured), with `starts` (empty: none): check_backward_error's bounds.
void check_backward_against_reference(const AttnShape& s, uint64_t seed, uint64_t dout_seed,
                                      const std::vector<int32_t>& starts, bool each_part) {
  const int C = s.C();
  const int32_t* starts_host = starts.empty() ? nullptr : starts.data();
  const ForwardRef ref = forward_reference(s, seed + s.T + s.HS, 1.0f, starts_host);
  const std::vector<float> out = bf16_rounded(ref.out);
  const std::vector<float> dout = bf16_rounded(random_floats(ref.out.size(), dout_seed + s.T));
  std::vector<float> dqkv_ref(ref.qkv.size());
  cpu::attention_backward(dqkv_ref.data(), dout.data(), ref.qkv.data(), out.data(), ref.lse.data(), starts_host, s.B,
                          s.T, C, s.NH);

  const auto starts_d = device_documents(starts);
  auto qkv_d = device_copy(to_bf16(ref.qkv));
  auto out_d = device_copy(to_bf16(out));
  auto dout_d = device_copy(to_bf16(dout));
  auto lse_d = device_copy(ref.lse);
  cuda::DeviceBuffer<__nv_bfloat16> dqkv(ref.qkv.size());
  cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
  dqkv.fill_bytes(kPoisonByte);
  scratch.fill_bytes(kPoisonByte);
  cuda::attention_backward(dqkv.data(), dout_d.data(), qkv_d.data(), out_d.data(), lse_d.data(),
                           starts.empty() ? nullptr : starts_d.data(), s.B, s.T, C, s.NH, scratch.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  check_backward_error(from_bf16(dqkv.download()), dqkv_ref, s, each_part);
}

// `count` documents of `length` tokens, then the documents of `rest`.
std::vector<int> repeated(int length, int count, const std::vector<int>& rest = {}) {
  std::vector<int> lengths(static_cast<size_t>(count), length);
  lengths.insert(lengths.end(), rest.begin(), rest.end());
  return lengths;
}

struct DocumentCase {
  AttnShape shape;
  std::vector<std::vector<int>> lengths;  // [B] rows of document lengths
  bool single_tokens() const {
    for (const auto& row : lengths)
      for (int length : row)
        if (length != 1) return false;
    return true;
  }
};

std::string describe(const DocumentCase& c) {
  std::string text = describe(c.shape) + " documents";
  for (const auto& row : c.lengths) {
    text += " {";
    for (size_t i = 0; i < row.size(); ++i) text += (i ? "," : "") + std::to_string(row[i]);
    text += "}";
  }
  return text;
}

// Documents that start mid-tile and at tile boundaries (the kernels tile keys by 64, queries by
// 64 or 128, and by 32 in the dK/dV kernel at head size 128), of length 1, many short ones, long
// ones over many tiles, rows of one document, B > 1 with a different layout per row; every head
// size, T not a multiple of the tiles.
const std::vector<DocumentCase>& document_cases() {
  static const std::vector<DocumentCase> cases = {
      {{2, 300, 2, 64}, {{37, 27, 64, 1, 100, 71}, {300}}},
      {{1, 256, 3, 32}, {repeated(7, 36, {4})}},
      {{2, 200, 2, 128}, {{64, 64, 72}, {1, 1, 1, 197}}},
      {{1, 1100, 1, 64}, {{500, 1, 599}}},
      {{3, 130, 1, 32}, {{130}, {129, 1}, {65, 65}}},
      {{1, 77, 2, 128}, {{10, 20, 30, 17}}},
      {{2, 77, 2, 64}, {{76, 1}, {1, 76}}},
      {{1, 70, 1, 64}, {repeated(1, 70)}},
      {{1, 333, 1, 128}, {{100, 33, 200}}},
      {{2, 256, 2, 64}, {{128, 128}, {64, 1, 63, 128}}},
      {{1, 600, 1, 32}, {{250, 350}}},
      {{2, 520, 1, 64}, {repeated(3, 100, {220}), {200, 256, 64}}},
  };
  return cases;
}

}  // namespace

TEST_CASE("attention forward matches the CPU reference", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : kShapes) {
    INFO(describe(s));
    for (float std_dev : {1.0f, 3.0f}) {  // 3: peaked softmax rows (scores ~ N(0, 9))
      INFO("qkv std " << std_dev);
      check_forward_error(forward_reference(s, 1234 + s.T + s.HS, std_dev), s, nullptr);
    }
  }
}

TEST_CASE("attention forward fused FP8 output equals casting the BF16 output", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  struct Case {
    AttnShape shape;
    Fp8Dtype dtype;
    float scale;  // 300 with E4M3 saturates the largest outputs (|out| up to ~3)
  };
  const Case cases[] = {
      {{2, 77, 2, 64}, Fp8Dtype::e4m3, 4.0f},   {{2, 77, 2, 64}, Fp8Dtype::e4m3, 300.0f},
      {{1, 200, 2, 128}, Fp8Dtype::e5m2, 0.5f}, {{1, 256, 3, 32}, Fp8Dtype::e5m2, 1000.0f},
  };
  for (const Case& c : cases) {
    const AttnShape& s = c.shape;
    INFO(describe(s) << " dtype " << to_string(c.dtype) << " scale " << c.scale);
    const int C = s.C();
    const ForwardRef ref = forward_reference(s, 99 + s.T);
    auto qkv = device_copy(to_bf16(ref.qkv));
    const size_t n = ref.out.size();

    // Plain BF16 forward, for comparison.
    cuda::DeviceBuffer<__nv_bfloat16> out_plain(n);
    cuda::DeviceBuffer<float> lse_plain(ref.lse.size());
    out_plain.fill_bytes(kPoisonByte);
    cuda::attention_forward(out_plain.data(), lse_plain.data(), nullptr, nullptr, nullptr, c.dtype, qkv.data(), nullptr,
                            s.B, s.T, C, s.NH, nullptr);

    cuda::DeviceBuffer<__nv_bfloat16> out(n);
    cuda::DeviceBuffer<float> lse(ref.lse.size());
    cuda::DeviceBuffer<uint8_t> out_fp8(n);
    auto scale = device_copy(std::vector<float>{c.scale});
    auto amax = device_copy(std::vector<float>{0.0f});
    out.fill_bytes(kPoisonByte);
    lse.fill_bytes(kPoisonByte);
    out_fp8.fill_bytes(kPoisonByte);
    cuda::attention_forward(out.data(), lse.data(), out_fp8.data(), amax.data(), scale.data(), c.dtype, qkv.data(),
                            nullptr, s.B, s.T, C, s.NH, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    const std::vector<__nv_bfloat16> out_bits = out.download();
    const std::vector<__nv_bfloat16> plain_bits = out_plain.download();
    REQUIRE(std::memcmp(out_bits.data(), plain_bits.data(), n * sizeof(__nv_bfloat16)) == 0);
    const std::vector<float> out_host = from_bf16(out_bits);
    CHECK(relative_error(out_host, ref.out) < 1e-2);
    CHECK(relative_error(lse.download(), ref.lse) < 1e-4);

    const std::vector<uint8_t> codes = out_fp8.download();
    size_t mismatches = 0;
    float max_abs = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      if (codes[i] != fp8_encode(out_host[i] * c.scale, c.dtype)) ++mismatches;
      max_abs = std::fmax(max_abs, std::fabs(out_host[i]));
    }
    CHECK(mismatches == 0);
    const float amax_gpu = amax.download()[0];
    CHECK(bits_of(amax_gpu) == bits_of(max_abs));

    // amax is a running max: a larger value already there stays; no-FP8 calls update it too.
    auto big = device_copy(std::vector<float>{1.0e6f});
    cuda::attention_forward(out.data(), lse.data(), out_fp8.data(), big.data(), scale.data(), c.dtype, qkv.data(),
                            nullptr, s.B, s.T, C, s.NH, nullptr);
    auto amax_only = device_copy(std::vector<float>{0.0f});
    cuda::attention_forward(out.data(), lse.data(), nullptr, amax_only.data(), nullptr, c.dtype, qkv.data(), nullptr,
                            s.B, s.T, C, s.NH, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(big.download()[0] == 1.0e6f);
    CHECK(bits_of(amax_only.download()[0]) == bits_of(max_abs));
  }
}

TEST_CASE("attention backward matches the CPU reference", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : kShapes) {
    INFO(describe(s));
    // With T = 1, dq and dk are exactly zero (one key: no softmax gradient).
    check_backward_against_reference(s, 777, 4242, {}, /*each_part=*/s.T >= 2);
  }
}

TEST_CASE("attention backward is bit-reproducible", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : {AttnShape{2, 333, 2, 64}, AttnShape{1, 150, 2, 128}, AttnShape{1, 100, 2, 32}}) {
    INFO(describe(s));
    const int C = s.C();
    const ForwardRef ref = forward_reference(s, 5 + s.HS);
    auto qkv = device_copy(to_bf16(ref.qkv));
    const std::vector<float> dout_host = bf16_rounded(random_floats(ref.out.size(), 6));
    auto dout = device_copy(to_bf16(dout_host));
    cuda::DeviceBuffer<__nv_bfloat16> out(ref.out.size());
    cuda::DeviceBuffer<float> lse(ref.lse.size());
    // The GPU's own forward feeds backward here, as in training.
    cuda::attention_forward(out.data(), lse.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv.data(), nullptr, s.B,
                            s.T, C, s.NH, nullptr);
    cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
    cuda::DeviceBuffer<__nv_bfloat16> dqkv(ref.qkv.size());
    std::vector<std::vector<__nv_bfloat16>> runs;
    for (int run = 0; run < 2; ++run) {
      dqkv.fill_bytes(kPoisonByte);
      scratch.fill_bytes(kPoisonByte);
      cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), nullptr, s.B, s.T, C, s.NH,
                               scratch.data(), nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      runs.push_back(dqkv.download());
    }
    REQUIRE(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(__nv_bfloat16)) == 0);

    // End to end (GPU forward's out and lse into GPU backward) against the CPU chain.
    std::vector<float> dqkv_ref(ref.qkv.size());
    const std::vector<float> out_ref = bf16_rounded(ref.out);
    cpu::attention_backward(dqkv_ref.data(), dout_host.data(), ref.qkv.data(), out_ref.data(), ref.lse.data(), nullptr,
                            s.B, s.T, C, s.NH);
    const double err = relative_error(from_bf16(runs[0]), dqkv_ref);
    INFO("end-to-end dqkv rel err " << err);
    CHECK(err < 2e-2);
  }
}

// Head size 64 runs wgmma kernels on Hopper. They compute the mma.sync kernels' products in
// the same order, so every output must be the same bits, including at ragged T and where
// several key tiles feed one query (a register hazard once broke exactly those). The wgmma dQ
// kernel computes D = rowsum(dO * O) itself, in the row-dot kernel's order: its scratch too.
TEST_CASE("attention wgmma kernels equal the mma.sync kernels bit for bit", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : {AttnShape{2, 77, 2, 64}, AttnShape{1, 130, 1, 64}, AttnShape{1, 1100, 1, 64},
                             AttnShape{3, 333, 2, 64}, AttnShape{1, 1, 2, 64}, AttnShape{2, 1024, 3, 64}}) {
    INFO(describe(s));
    const int C = s.C();
    auto qkv = device_copy(to_bf16(random_floats(static_cast<size_t>(s.B) * s.T * 3 * C, 91 + s.T, 2.0f)));
    auto dout = device_copy(to_bf16(random_floats(static_cast<size_t>(s.B) * s.T * C, 92 + s.T)));
    check_same_bits(run_attention(s, qkv, dout, nullptr, false), run_attention(s, qkv, dout, nullptr, true));
  }
}

namespace {

struct OperandCase {
  AttnShape shape;
  Fp8Dtype dtype;
  float scale;
  enum { fp32, bf16, none } dbias;
  bool amax;
};

struct OperandResult {
  std::vector<uint8_t> codes, codes_t;
  std::vector<float> amax, dbias32;
  std::vector<__nv_bfloat16> dbias16;
};

// The fused operand against attention_backward then cast_transpose_fp8, bit for bit, both from
// the GPU forward's out and lse. document_starts [B,T] (host memory; empty: nullptr). Returns
// the fused operand.
OperandResult check_operand_is_the_cast(const OperandCase& c, const std::vector<int32_t>& document_starts) {
  const AttnShape& s = c.shape;
  INFO(describe(s) << " " << to_string(c.dtype) << " scale " << c.scale << " dbias " << int(c.dbias)
                   << (document_starts.empty() ? "" : " with documents"));
  REQUIRE(cuda::attention_backward_writes_operand(s.B, s.T, s.C(), s.NH));
  const int C = s.C(), M = s.B * s.T, N = 3 * C;
  const size_t n_qkv = size_t(M) * N, n_out = size_t(M) * C, n_lse = size_t(s.B) * s.NH * s.T;
  auto qkv = device_copy(to_bf16(random_floats(n_qkv, 41 + s.T, 2.0f)));
  auto dout = device_copy(to_bf16(random_floats(n_out, 42 + s.T)));
  const auto starts_buffer = device_documents(document_starts);
  const int32_t* starts = starts_buffer.data();
  cuda::DeviceBuffer<__nv_bfloat16> out(n_out), dqkv(n_qkv);
  cuda::DeviceBuffer<float> lse(n_lse);
  cuda::attention_forward(out.data(), lse.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv.data(), starts, s.B,
                          s.T, C, s.NH, nullptr);
  const auto scale = device_copy(std::vector<float>{c.scale});
  const std::vector<float> dbias_start = random_floats(size_t(N), 43 + s.T);

  auto run = [&](bool fused) {
    cuda::DeviceBuffer<uint8_t> codes(n_qkv), codes_t(n_qkv);
    codes.fill_bytes(kPoisonByte);
    codes_t.fill_bytes(kPoisonByte);
    auto amax = device_copy(std::vector<float>{0.5f});
    auto dbias32 = device_copy(dbias_start);
    auto dbias16 = device_copy(to_bf16(dbias_start));
    const GradientRef dbias = c.dbias == OperandCase::fp32   ? GradientRef(dbias32.data())
                              : c.dbias == OperandCase::bf16 ? GradientRef(dbias16.data(), true)
                                                             : GradientRef();
    float* amax_pointer = c.amax ? amax.data() : nullptr;
    cuda::DeviceBuffer<float> scratch(std::max(cuda::attention_backward_operand_scratch_floats(s.B, s.T, C, s.NH),
                                               cuda::dbias_scratch_floats(M, N)));
    scratch.fill_bytes(kPoisonByte);
    if (fused) {
      cuda::attention_backward_operand({.codes = codes.data(),
                                        .codes_t = codes_t.data(),
                                        .dbias = dbias,
                                        .amax = amax_pointer,
                                        .scale = scale.data(),
                                        .dtype = c.dtype},
                                       dout.data(), qkv.data(), out.data(), lse.data(), starts, s.B, s.T, C, s.NH,
                                       scratch.data(), nullptr);
    } else {
      cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), starts, s.B, s.T, C,
                               s.NH, scratch.data(), nullptr);
      cuda::cast_transpose_fp8(codes.data(), codes_t.data(), dbias, amax_pointer, dqkv.data(), scale.data(),
                               c.dtype, M, N, scratch.data(), nullptr, nullptr);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    return OperandResult{codes.download(), codes_t.download(), amax.download(), dbias32.download(),
                         dbias16.download()};
  };
  const OperandResult fused = run(true);
  const OperandResult reference = run(false);
  CHECK(std::memcmp(fused.codes.data(), reference.codes.data(), n_qkv) == 0);
  CHECK(std::memcmp(fused.codes_t.data(), reference.codes_t.data(), n_qkv) == 0);
  CHECK(bits_of(fused.amax[0]) == bits_of(reference.amax[0]));
  CHECK(std::memcmp(fused.dbias32.data(), reference.dbias32.data(), size_t(N) * sizeof(float)) == 0);
  CHECK(std::memcmp(fused.dbias16.data(), reference.dbias16.data(), size_t(N) * sizeof(__nv_bfloat16)) == 0);
  // The cases are not vacuous: the bias gradient moved, the amax was raised, and the large
  // scales saturate some codes.
  if (c.dbias == OperandCase::fp32) CHECK(fused.dbias32 != dbias_start);
  if (c.amax) CHECK(fused.amax[0] > 0.5f);
  if (c.scale == 4096.0f) {
    const uint8_t max_code = c.dtype == Fp8Dtype::e5m2 ? 0x7B : 0x7E;
    CHECK(std::any_of(fused.codes.begin(), fused.codes.end(), [&](uint8_t q) { return (q & 0x7F) == max_code; }));
  }
  return fused;
}

}  // namespace

// The backward's FP8 operand (head size 64, T a multiple of 64) against the cast of the BF16
// dqkv it replaces: codes, transpose, amax and bias gradient bit for bit. Both formats, an
// FP32 and a BF16 bias gradient added to (not overwritten), none, no amax, and scales that
// saturate.
TEST_CASE("attention backward writes dqkv's FP8 operand exactly as the cast of its dqkv", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  if (!cuda::attention_backward_writes_operand(1, 64, 64, 1)) SKIP("no wgmma on this GPU");
  for (const OperandCase& c : {OperandCase{{2, 128, 3, 64}, Fp8Dtype::e5m2, 4.0f, OperandCase::fp32, true},
                               OperandCase{{1, 1024, 2, 64}, Fp8Dtype::e5m2, 1.0f, OperandCase::bf16, true},
                               OperandCase{{3, 192, 1, 64}, Fp8Dtype::e4m3, 2.0f, OperandCase::none, true},
                               OperandCase{{1, 64, 2, 64}, Fp8Dtype::e5m2, 65536.0f, OperandCase::fp32, false},
                               OperandCase{{2, 256, 1, 64}, Fp8Dtype::e4m3, 4096.0f, OperandCase::bf16, true}})
    check_operand_is_the_cast(c, {});
}

TEST_CASE("attention backward's FP8 operand: shapes it cannot tile are refused", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  CHECK_FALSE(cuda::attention_backward_writes_operand(1, 100, 128, 2));  // T not a multiple of 64
  CHECK_FALSE(cuda::attention_backward_writes_operand(1, 128, 64, 2));   // head size 32
  CHECK_FALSE(cuda::attention_backward_writes_operand(1, 128, 256, 2));  // head size 128
  CHECK_THROWS_AS(cuda::attention_backward_operand({}, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 100, 128, 2,
                                                   nullptr, nullptr),
                  RuntimeError);
}

// ---- documents: the tests -------------------------------------------------------------------

TEST_CASE("attention forward with documents matches the CPU reference", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const DocumentCase& c : document_cases()) {
    const AttnShape& s = c.shape;
    INFO(describe(c));
    const std::vector<int32_t> starts = document_starts_of(c.lengths, s.T);
    const auto starts_d = device_documents(starts);
    for (float std_dev : {1.0f, 3.0f}) {  // 3: peaked softmax rows
      INFO("qkv std " << std_dev);
      check_forward_error(forward_reference(s, 2024 + s.T + s.HS, std_dev, starts.data()), s, starts_d.data());
    }
  }
}

TEST_CASE("attention backward with documents matches the CPU reference", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const DocumentCase& c : document_cases()) {
    const AttnShape& s = c.shape;
    INFO(describe(c));
    const std::vector<int32_t> starts = document_starts_of(c.lengths, s.T);
    // Documents of one token: dq and dk exactly zero, as with T = 1.
    check_backward_against_reference(s, 4321, 8484, starts, /*each_part=*/!c.single_tokens());
  }
}

// With documents too, the wgmma kernels (head size 64 on Hopper) mask the elements the
// mma.sync kernels mask and skip only tiles that leave a row as it was: the same bits.
TEST_CASE("attention wgmma kernels with documents equal the mma.sync kernels bit for bit", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  std::vector<DocumentCase> cases;
  for (const DocumentCase& c : document_cases())
    if (c.shape.HS == 64) cases.push_back(c);
  cases.push_back({{3, 333, 2, 64}, {{333}, {100, 233}, repeated(64, 5, {13})}});
  cases.push_back({{2, 1024, 3, 64}, {{1, 511, 512}, repeated(17, 60, {4})}});
  for (const DocumentCase& c : cases) {
    const AttnShape& s = c.shape;
    INFO(describe(c));
    const int C = s.C();
    const auto starts = device_documents(document_starts_of(c.lengths, s.T));
    auto qkv = device_copy(to_bf16(random_floats(static_cast<size_t>(s.B) * s.T * 3 * C, 93 + s.T, 2.0f)));
    auto dout = device_copy(to_bf16(random_floats(static_cast<size_t>(s.B) * s.T * C, 94 + s.T)));
    check_same_bits(run_attention(s, qkv, dout, starts.data(), false),
                    run_attention(s, qkv, dout, starts.data(), true));
  }
}

TEST_CASE("attention backward with documents writes dqkv's FP8 operand exactly as the cast of its dqkv",
          "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  if (!cuda::attention_backward_writes_operand(1, 64, 64, 1)) SKIP("no wgmma on this GPU");
  const std::pair<OperandCase, std::vector<std::vector<int>>> cases[] = {
      {{{2, 128, 3, 64}, Fp8Dtype::e5m2, 4.0f, OperandCase::fp32, true}, {{37, 91}, {64, 64}}},
      {{{1, 1024, 2, 64}, Fp8Dtype::e5m2, 1.0f, OperandCase::bf16, true}, {{300, 1, 723}}},
      {{{3, 192, 1, 64}, Fp8Dtype::e4m3, 2.0f, OperandCase::none, true}, {{192}, {1, 191}, repeated(5, 38, {2})}},
  };
  for (const auto& [c, lengths] : cases) check_operand_is_the_cast(c, document_starts_of(lengths, c.shape.T));
}

// The defining property: each document of a packed row gets what it gets as a sequence of its
// own (a call with T = its length), up to the order of the sums (tiles fall elsewhere). Both
// backward runs read the packed forward's out and lse, so the backward is compared alone.
TEST_CASE("attention over packed documents equals attention over each document alone", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  const DocumentCase cases[] = {
      {{1, 300, 2, 64}, {{37, 27, 64, 1, 100, 71}}},
      {{2, 256, 1, 32}, {repeated(7, 36, {4}), {200, 56}}},
      {{1, 200, 2, 128}, {{64, 64, 72}}},
      {{1, 1100, 1, 64}, {{500, 1, 599}}},
      {{2, 333, 2, 128}, {{1, 1, 1, 330}, {100, 33, 200}}},
  };
  for (const DocumentCase& c : cases) {
    const AttnShape& s = c.shape;
    INFO(describe(c));
    const int C = s.C();
    const std::vector<float> qkv = bf16_rounded(random_floats(static_cast<size_t>(s.B) * s.T * 3 * C, 55 + s.T));
    const std::vector<float> dout = bf16_rounded(random_floats(static_cast<size_t>(s.B) * s.T * C, 56 + s.T));

    // The packed rows, with documents.
    const auto starts = device_documents(document_starts_of(c.lengths, s.T));
    auto qkv_d = device_copy(to_bf16(qkv));
    auto dout_d = device_copy(to_bf16(dout));
    cuda::DeviceBuffer<__nv_bfloat16> out_d(dout.size()), dqkv_d(qkv.size());
    cuda::DeviceBuffer<float> lse_d(static_cast<size_t>(s.B) * s.NH * s.T);
    cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
    out_d.fill_bytes(kPoisonByte);
    lse_d.fill_bytes(kPoisonByte);
    dqkv_d.fill_bytes(kPoisonByte);
    cuda::attention_forward(out_d.data(), lse_d.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, qkv_d.data(),
                            starts.data(), s.B, s.T, C, s.NH, nullptr);
    cuda::attention_backward(dqkv_d.data(), dout_d.data(), qkv_d.data(), out_d.data(), lse_d.data(), starts.data(),
                             s.B, s.T, C, s.NH, scratch.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<__nv_bfloat16> out_bits = out_d.download();
    const std::vector<float> out = from_bf16(out_bits), lse = lse_d.download(), dqkv = from_bf16(dqkv_d.download());

    for (int b = 0; b < s.B; ++b) {
      int start = 0;
      for (const int n : c.lengths[static_cast<size_t>(b)]) {
        INFO("row " << b << ", the document at " << start << " of length " << n);
        // Rows start..start+n-1 of batch row b: [n, width] from a [B,T,width] tensor.
        auto rows = [&](const auto& packed, int width) {
          using Value = typename std::decay_t<decltype(packed)>::value_type;
          const size_t first = (static_cast<size_t>(b) * s.T + start) * width;
          return std::vector<Value>(packed.begin() + first, packed.begin() + first + static_cast<size_t>(n) * width);
        };
        // The packed lse [B,NH,T] at this document's rows, as [1,NH,n].
        std::vector<float> lse_rows;
        for (int h = 0; h < s.NH; ++h) {
          const auto at = lse.begin() + (static_cast<std::ptrdiff_t>(b) * s.NH + h) * s.T + start;
          lse_rows.insert(lse_rows.end(), at, at + n);
        }
        const AttnShape alone{1, n, s.NH, s.HS};
        auto qkv_alone = device_copy(to_bf16(rows(qkv, 3 * C)));
        cuda::DeviceBuffer<__nv_bfloat16> out_alone(static_cast<size_t>(n) * C);
        cuda::DeviceBuffer<__nv_bfloat16> dqkv_alone(static_cast<size_t>(n) * 3 * C);
        cuda::DeviceBuffer<float> lse_alone(static_cast<size_t>(s.NH) * n);
        cuda::DeviceBuffer<float> scratch_alone(cuda::attention_backward_scratch_floats(1, n, C, s.NH));
        out_alone.fill_bytes(kPoisonByte);
        lse_alone.fill_bytes(kPoisonByte);
        dqkv_alone.fill_bytes(kPoisonByte);
        cuda::attention_forward(out_alone.data(), lse_alone.data(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3,
                                qkv_alone.data(), nullptr, alone.B, alone.T, C, alone.NH, nullptr);
        auto packed_out = device_copy(rows(out_bits, C));
        auto packed_lse = device_copy(lse_rows);
        auto dout_alone = device_copy(to_bf16(rows(dout, C)));
        cuda::attention_backward(dqkv_alone.data(), dout_alone.data(), qkv_alone.data(), packed_out.data(),
                                 packed_lse.data(), nullptr, alone.B, alone.T, C, alone.NH, scratch_alone.data(),
                                 nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const double out_err = relative_error(rows(out, C), from_bf16(out_alone.download()));
        const double lse_err = relative_error(lse_rows, lse_alone.download());
        const double dqkv_err = relative_error(rows(dqkv, 3 * C), from_bf16(dqkv_alone.download()));
        INFO("out rel err " << out_err << ", lse rel err " << lse_err << ", dqkv rel err " << dqkv_err);
        CHECK(out_err < 1e-2);
        CHECK(lse_err < 1e-4);
        CHECK(dqkv_err < 1e-2);
        start += n;
      }
    }
  }
}

// Starts all 0 are one document a row: the kernels with documents must then compute exactly
// what the kernels without them compute (the same products, sums and masks), every kernel
// family included.
TEST_CASE("attention with every document start 0 gives the bits of attention without documents",
          "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  for (const AttnShape& s : {AttnShape{2, 77, 2, 64}, AttnShape{1, 200, 2, 128}, AttnShape{1, 256, 3, 32},
                             AttnShape{1, 1100, 1, 64}, AttnShape{3, 333, 2, 64}, AttnShape{1, 1, 2, 64}}) {
    INFO(describe(s));
    const int C = s.C();
    const auto zeros = device_documents(std::vector<int32_t>(static_cast<size_t>(s.B) * s.T, 0));
    auto qkv = device_copy(to_bf16(random_floats(static_cast<size_t>(s.B) * s.T * 3 * C, 95 + s.T, 2.0f)));
    auto dout = device_copy(to_bf16(random_floats(static_cast<size_t>(s.B) * s.T * C, 96 + s.T)));
    for (bool mma_sync : {false, true}) {
      INFO((mma_sync ? "mma.sync kernels" : "fastest kernels"));
      check_same_bits(run_attention(s, qkv, dout, zeros.data(), mma_sync),
                      run_attention(s, qkv, dout, nullptr, mma_sync));
    }
  }
  if (cuda::attention_backward_writes_operand(2, 128, 192, 3)) {
    INFO("the FP8 operand");
    const OperandCase c{{2, 128, 3, 64}, Fp8Dtype::e5m2, 4.0f, OperandCase::fp32, true};
    const OperandResult zeros = check_operand_is_the_cast(c, std::vector<int32_t>(2 * 128, 0));
    const OperandResult none = check_operand_is_the_cast(c, {});
    CHECK(same_bytes(zeros.codes, none.codes));
    CHECK(same_bytes(zeros.codes_t, none.codes_t));
    CHECK(same_bytes(zeros.amax, none.amax));
    CHECK(same_bytes(zeros.dbias32, none.dbias32));
  }
}

TEST_CASE("attention rejects unsupported head sizes with a hint", "[gpu][attention]") {
  FP8LM_REQUIRE_GPU();
  // HS = 96 / 2 = 48: checked before any pointer is touched.
  try {
    cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, nullptr, nullptr, 1, 16, 96, 2,
                            nullptr);
    FAIL("attention_forward accepted HS = 48");
  } catch (const RuntimeError& e) {
    CHECK(!e.hint().empty());
  }
  CHECK_THROWS_AS(
      cuda::attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 96, 2, nullptr, nullptr),
      RuntimeError);
  CHECK_THROWS_AS(cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, Fp8Dtype::e4m3, nullptr,
                                          nullptr, 1, 16, 256, 1, nullptr),
                  RuntimeError);  // HS = 256
}

// Throughput (hidden: run with "[.bench]" or "[attention][.bench]"). Causal FLOPs: forward
// 4*B*NH*T*T*HS/2 (two GEMMs, half the matrix); backward counted as 2.5x forward (the
// usual FA convention; this backward does 3.5x the forward's work to stay deterministic).
TEST_CASE("attention throughput", "[gpu][attention][.bench]") {
  FP8LM_REQUIRE_GPU();
  // documents: 0 without; otherwise every row made of documents of that many tokens (1024: one
  // document a row, through the document kernels).
  for (const auto& [s, document_length] :
       {std::pair{AttnShape{8, 1024, 25, 64}, 0}, std::pair{AttnShape{8, 1024, 25, 64}, 1024},
        std::pair{AttnShape{8, 1024, 25, 64}, 256}, std::pair{AttnShape{8, 1024, 25, 64}, 32},
        std::pair{AttnShape{32, 1024, 12, 64}, 0}}) {
    const int C = s.C();
    const size_t n_qkv = static_cast<size_t>(s.B) * s.T * 3 * C;
    const size_t n_out = static_cast<size_t>(s.B) * s.T * C;
    // A 1M-value random block repeated: realistic data without minutes of host RNG.
    auto tiled = [](size_t n, uint64_t seed) {
      const std::vector<float> block = random_floats(size_t{1} << 20, seed);
      std::vector<float> values(n);
      for (size_t i = 0; i < n; ++i) values[i] = block[i % block.size()];
      return values;
    };
    auto qkv = device_copy(to_bf16(tiled(n_qkv, 1)));
    auto dout = device_copy(to_bf16(tiled(n_out, 2)));
    cuda::DeviceBuffer<__nv_bfloat16> out(n_out);
    cuda::DeviceBuffer<uint8_t> out_fp8(n_out);
    cuda::DeviceBuffer<float> lse(static_cast<size_t>(s.B) * s.NH * s.T);
    auto scale = device_copy(std::vector<float>{1.0f});
    auto amax = device_copy(std::vector<float>{0.0f});
    cuda::DeviceBuffer<__nv_bfloat16> dqkv(n_qkv);
    cuda::DeviceBuffer<float> scratch(cuda::attention_backward_scratch_floats(s.B, s.T, C, s.NH));
    const std::vector<std::vector<int>> rows(size_t(s.B),
                                             repeated(document_length, s.T / std::max(document_length, 1)));
    auto starts = device_documents(document_length > 0 ? document_starts_of(rows, s.T) : std::vector<int32_t>{0});
    const int32_t* documents = document_length > 0 ? starts.data() : nullptr;

    auto forward = [&] {
      cuda::attention_forward(out.data(), lse.data(), out_fp8.data(), amax.data(), scale.data(), Fp8Dtype::e4m3,
                              qkv.data(), documents, s.B, s.T, C, s.NH, nullptr);
    };
    auto backward = [&] {
      cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), documents, s.B, s.T, C,
                               s.NH, scratch.data(), nullptr);
    };
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    auto time_ms = [&](auto&& fn) {
      for (int i = 0; i < 3; ++i) fn();  // warm-up
      constexpr int kIters = 20;
      CUDA_CHECK(cudaEventRecord(start));
      for (int i = 0; i < kIters; ++i) fn();
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      return static_cast<double>(ms) / kIters;
    };
    const double fwd_ms = time_ms(forward);
    const double bwd_ms = time_ms(backward);
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    const double fwd_flops = 4.0 * s.B * s.NH * static_cast<double>(s.T) * s.T * s.HS / 2.0;
    const double bwd_flops = 2.5 * fwd_flops;
    // The causal whole-row FLOPs, also for documents: the rate against the work of one document a row.
    std::printf("attention %s, documents of %d: forward %.3f ms (%.1f TFLOP/s, with FP8 out), backward %.3f ms "
                "(%.1f TFLOP/s)\n",
                describe(s).c_str(), document_length, fwd_ms, fwd_flops / fwd_ms * 1e-9, bwd_ms,
                bwd_flops / bwd_ms * 1e-9);
    const std::vector<__nv_bfloat16> gradient_bits = dqkv.download();
    uint64_t hash = 1469598103934665603ull;  // FNV-1a of dqkv's bytes: equal bits across builds
    const auto* bytes = reinterpret_cast<const unsigned char*>(gradient_bits.data());
    for (size_t i = 0; i < gradient_bits.size() * sizeof(__nv_bfloat16); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
    std::printf("attention %s: dqkv FNV-1a %016llx\n", describe(s).c_str(), static_cast<unsigned long long>(hash));
    const std::vector<float> dq = from_bf16(gradient_bits);
    bool finite = true;
    for (size_t i = 0; i < dq.size(); i += 997) finite = finite && std::isfinite(dq[i]);
    CHECK(finite);
  }
}
