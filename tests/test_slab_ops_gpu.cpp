// GPU tests of optim/slab_ops.h: every CUDA launcher bit-identical to its CPU twin
// (tests/test_slab_ops.cpp checks the CPU twins by hand).
//
// The layout has tensors of uneven sizes: lengths that are not multiples of 4, a tensor of
// exactly one chunk and tensors of several (the last one partial), an empty tensor, and
// offsets both 16-element aligned and not. Each case also runs with the device pointers
// shifted by a few elements past an aligned allocation, which sends the aligned tensors to the
// scalar path too. Outputs start poisoned (CPU and GPU alike), padding and guard elements
// included, and the whole buffer is compared, so a write outside the tensors shows.
// Comparisons are of the bits; where NaN can come out of arithmetic (sums, conversions) two
// NaNs count as equal, since the GPU's NaN payloads differ from the CPU's.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/check_cuda.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "core/random.h"
#include "core/tensor.h"
#include "optim/grad_clip.h"
#include "optim/grad_clip_cuda.h"
#include "optim/slab_ops.h"
#include "tests/gpu_testing.h"

namespace {

using namespace fp8lm;
using fp8lm::cuda::DeviceBuffer;
using fp8lm::testing::device_copy;
using fp8lm::testing::random_floats;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kPaddingValue = 1e30f;  // beyond every real value: a read of padding would show
constexpr uint32_t kQuietNaNBits = 0x7FC00000u;
constexpr size_t kGuard = 8;  // poisoned elements after every device buffer

void sync() { CUDA_CHECK(cudaDeviceSynchronize()); }

int64_t dim(size_t n) { return static_cast<int64_t>(n); }

TensorLayout uneven_layout() {
  TensorLayout layout;
  layout.add("big", {dim(2 * kGradNormChunk + 5)}, true);  // 3 chunks, the last of 5 elements
  layout.add("seven", {7}, false);
  layout.add("empty", {0}, false);
  layout.add("odd", {3, 5}, true, /*alignment=*/1);
  layout.add("four", {12}, false, /*alignment=*/1);         // a multiple of 4 at an unaligned offset
  layout.add("tail", {2, 6001}, true, /*alignment=*/1);     // 2 chunks at an unaligned offset
  layout.add("chunk", {dim(kGradNormChunk)}, true);         // exactly one chunk
  layout.add("one", {1}, false);
  return layout;
}

int tensor_index(const TensorLayout& layout, const char* name) {
  for (size_t k = 0; k < layout.tensors().size(); ++k)
    if (layout.tensors()[k].name == name) return static_cast<int>(k);
  FAIL("no tensor " << name);
  return -1;
}

const TensorInfo& tensor(const TensorLayout& layout, const char* name) {
  return layout.tensors()[tensor_index(layout, name)];
}

// Random values, a different magnitude per tensor (so the amaxes and scales differ); padding
// holds kPaddingValue.
std::vector<float> random_slab(const TensorLayout& layout, uint64_t seed) {
  std::vector<float> slab(layout.total_elements(), kPaddingValue);
  const std::vector<float> r = random_floats(layout.total_elements(), seed);
  for (size_t k = 0; k < layout.tensors().size(); ++k) {
    const TensorInfo& t = layout.tensors()[k];
    const float magnitude = std::ldexp(1.0f, static_cast<int>(k % 5) * 3 - 6);
    for (size_t i = 0; i < t.numel; ++i) slab[t.offset + i] = r[t.offset + i] * magnitude;
  }
  return slab;
}

// `host` placed `shift` elements into a buffer of shift + size + kGuard elements; the rest is `fill`.
template <typename T>
std::vector<T> placed(const std::vector<T>& host, size_t shift, T fill) {
  std::vector<T> out(shift + host.size() + kGuard, fill);
  std::copy(host.begin(), host.end(), out.begin() + static_cast<std::ptrdiff_t>(shift));
  return out;
}

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }
bool same_value(float a, float b) { return same_bits(a, b) || (std::isnan(a) && std::isnan(b)); }
bool same_byte(uint8_t a, uint8_t b) { return a == b; }
bool bf16_nan(uint16_t x) { return (x & 0x7FFFu) > 0x7F80u; }
bool same_bf16(uint16_t a, uint16_t b) { return a == b || (bf16_nan(a) && bf16_nan(b)); }

template <typename T, typename Same>
void check_same(const std::vector<T>& gpu, const std::vector<T>& cpu, Same same) {
  REQUIRE(gpu.size() == cpu.size());
  size_t differences = 0, first = gpu.size();
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (!same(gpu[i], cpu[i])) {
      if (differences == 0) first = i;
      ++differences;
    }
  }
  INFO(differences << " of " << gpu.size() << " elements differ, the first at index " << first);
  CHECK(differences == 0);
}

// Device pointer placements, in elements past an aligned allocation: (input, output).
struct Placement {
  size_t in;
  size_t out;
};
constexpr Placement kPlacements[] = {{0, 0}, {1, 1}, {0, 3}, {2, 0}, {4, 4}};

}  // namespace

TEST_CASE("GPU slab layout covers the paths the kernels take", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  const TensorLayout layout = uneven_layout();
  const cuda::DeviceTensorLayout device_layout(layout);
  CHECK(device_layout.table().num_chunks == 3 + 1 + 0 + 1 + 1 + 2 + 1 + 1);
  CHECK(tensor(layout, "big").offset % 4 == 0);
  CHECK(tensor(layout, "four").offset % 4 != 0);
  CHECK(tensor(layout, "tail").offset % 4 != 0);
  CHECK(tensor(layout, "chunk").offset % 4 == 0);
}

// ------------------------------------------------------------------------------ tensor_amaxes

TEST_CASE("GPU tensor_amaxes: bit-identical to the CPU, NaN ignored, aligned and not", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  const TensorLayout layout = uneven_layout();
  const cuda::DeviceTensorLayout device_layout(layout);
  const size_t count = layout.tensors().size();

  std::vector<float> values = random_slab(layout, 11);
  values[tensor(layout, "big").offset + 2 * kGradNormChunk + 1] = kNaN;  // in the last, scalar chunk
  values[tensor(layout, "big").offset + 17] = -kNaN;                     // in a vector group
  values[tensor(layout, "tail").offset + 100] = kNaN;
  values[tensor(layout, "four").offset + 3] = -kInf;                     // infinities count
  values[tensor(layout, "one").offset] = kNaN;                           // NaN only: entry unchanged

  std::vector<float> start(count, 0.0f);
  start[tensor_index(layout, "seven")] = 100.0f;  // a running max: bigger than the tensor's values
  start[tensor_index(layout, "empty")] = 3.0f;    // no elements: unchanged
  start[tensor_index(layout, "one")] = 0.25f;

  std::vector<float> ref = start;
  cpu::tensor_amaxes(ref.data(), values.data(), layout);
  CHECK(ref[tensor_index(layout, "seven")] == 100.0f);
  CHECK(ref[tensor_index(layout, "empty")] == 3.0f);
  CHECK(ref[tensor_index(layout, "one")] == 0.25f);
  CHECK(ref[tensor_index(layout, "four")] == kInf);
  CHECK(std::isfinite(ref[tensor_index(layout, "big")]));
  CHECK(std::isfinite(ref[tensor_index(layout, "tail")]));

  for (const Placement& p : kPlacements) {
    INFO("values shifted by " << p.in << " elements");
    DeviceBuffer<float> d_values = device_copy(placed(values, p.in, kPaddingValue));
    DeviceBuffer<float> d_amaxes = device_copy(start);
    cuda::tensor_amaxes(d_amaxes.data(), d_values.data() + p.in, device_layout.table(), nullptr);
    sync();
    check_same(d_amaxes.download(), ref, same_bits);
  }

  // An empty layout: a no-op, with null pointers too.
  const cuda::DeviceTensorLayout empty{TensorLayout{}};
  cuda::tensor_amaxes(nullptr, nullptr, empty.table(), nullptr);
}

// ------------------------------------------------------------------------- scales_from_amaxes

TEST_CASE("GPU scales_from_amaxes: bit-identical to the CPU, special amaxes included", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  std::vector<float> amaxes = {0.0f, kNaN, kInf, 1e-45f, 1e-38f, std::numeric_limits<float>::max(), 448.0f, 1.0f};
  const std::vector<float> r = random_floats(300, 5);
  for (size_t i = 0; i < r.size(); ++i)
    amaxes.push_back(std::ldexp(std::fabs(r[i]) + 0.01f, static_cast<int>(i % 61) - 30));
  const int count = static_cast<int>(amaxes.size());  // more than one block of threads
  DeviceBuffer<float> d_amaxes = device_copy(amaxes);

  for (float format_max : {kE4M3Max, kE5M2Max}) {
    for (float headroom : {1.0f, 2.0f, 3.0f, 8.0f}) {
      INFO("fp8_max " << format_max << " headroom " << headroom);
      std::vector<float> scales(count), scale_inv(count);
      cpu::scales_from_amaxes(scales.data(), scale_inv.data(), amaxes.data(), count, format_max, headroom);
      DeviceBuffer<float> d_scales(count), d_scale_inv(count);
      d_scales.fill_bytes(testing::kPoisonByte);
      d_scale_inv.fill_bytes(testing::kPoisonByte);
      cuda::scales_from_amaxes(d_scales.data(), d_scale_inv.data(), d_amaxes.data(), count, format_max, headroom,
                               nullptr);
      sync();
      check_same(d_scales.download(), scales, same_bits);
      check_same(d_scale_inv.download(), scale_inv, same_bits);
    }
  }
  cuda::scales_from_amaxes(nullptr, nullptr, nullptr, 0, kE4M3Max, 1.0f, nullptr);  // no work
}

// --------------------------------------------------------------------------- quantize_tensors

TEST_CASE("GPU quantize_tensors: codes and recorded amaxes bit-identical to the CPU", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  const TensorLayout layout = uneven_layout();
  const cuda::DeviceTensorLayout device_layout(layout);
  const int count = static_cast<int>(layout.tensors().size());
  const std::vector<float> values = random_slab(layout, 23);

  // scale_index: "seven" skipped, "odd" shares "big"'s slot 0, the others one slot each.
  std::vector<int> scale_index(count);
  for (int k = 0; k < count; ++k) scale_index[k] = k + 1;
  scale_index[tensor_index(layout, "big")] = 0;
  scale_index[tensor_index(layout, "seven")] = -1;
  scale_index[tensor_index(layout, "odd")] = 0;
  const int slots = count + 1;

  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    for (bool with_index : {false, true}) {
      // Scales from the tensors' amaxes with headroom 2; one slot 64 times too large, so that
      // its tensor saturates.
      std::vector<float> amaxes(count, 0.0f);
      cpu::tensor_amaxes(amaxes.data(), values.data(), layout);
      std::vector<float> scales(slots, 1.0f), unused(slots);
      cpu::scales_from_amaxes(scales.data(), unused.data(), amaxes.data(), count, fp8_max(dtype), 2.0f);
      scales[tensor_index(layout, "tail")] *= 64.0f;
      std::vector<float> recorded(slots, 0.0f);
      recorded[0] = 1e6f;  // a running max: larger than big's and odd's values
      recorded[2] = 0.5f;

      const int* host_index = with_index ? scale_index.data() : nullptr;
      DeviceBuffer<int> d_index = device_copy(scale_index);
      DeviceBuffer<float> d_scales = device_copy(scales);
      for (const Placement& p : kPlacements) {
        INFO(to_string(dtype) << (with_index ? " with" : " without") << " scale_index, values shifted by " << p.in
                              << ", codes by " << p.out);
        std::vector<uint8_t> codes = placed(std::vector<uint8_t>(layout.total_elements(), 0xFF), p.out,
                                            static_cast<uint8_t>(0xFF));
        std::vector<float> ref_recorded = recorded;
        DeviceBuffer<uint8_t> d_codes = device_copy(codes);
        DeviceBuffer<float> d_recorded = device_copy(recorded);
        DeviceBuffer<float> d_values = device_copy(placed(values, p.in, kPaddingValue));
        cpu::quantize_tensors(codes.data() + p.out, values.data(), layout, scales.data(), host_index,
                              ref_recorded.data(), dtype);
        cuda::quantize_tensors(d_codes.data() + p.out, d_values.data() + p.in, device_layout.table(),
                               d_scales.data(), with_index ? d_index.data() : nullptr, d_recorded.data(), dtype,
                               nullptr);
        sync();
        check_same(d_codes.download(), codes, same_byte);
        check_same(d_recorded.download(), ref_recorded, same_bits);
      }

      // Without recorded_amax: the same codes.
      std::vector<uint8_t> codes(layout.total_elements(), 0xFF);
      cpu::quantize_tensors(codes.data(), values.data(), layout, scales.data(), host_index, nullptr, dtype);
      DeviceBuffer<uint8_t> d_codes(layout.total_elements());
      d_codes.fill_bytes(0xFF);
      DeviceBuffer<float> d_values = device_copy(values);
      cuda::quantize_tensors(d_codes.data(), d_values.data(), device_layout.table(), d_scales.data(),
                             with_index ? d_index.data() : nullptr, nullptr, dtype, nullptr);
      sync();
      check_same(d_codes.download(), codes, same_byte);
    }
  }
}

TEST_CASE("GPU quantize_tensors: a NaN makes the recorded amax 0x7FC00000 on both sides, and it stays",
          "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  const TensorLayout layout = uneven_layout();
  const cuda::DeviceTensorLayout device_layout(layout);
  const int count = static_cast<int>(layout.tensors().size());
  std::vector<float> values = random_slab(layout, 31);
  values[tensor(layout, "big").offset + 9] = float_from_bits(0xFFC00123u);  // -NaN with a payload, vector path
  values[tensor(layout, "tail").offset + 7000] = kNaN;                      // scalar path
  values[tensor(layout, "chunk").offset + 5] = kInf;
  const std::vector<float> scales(count, 1.0f);
  DeviceBuffer<float> d_scales = device_copy(scales);

  for (const Placement& p : kPlacements) {
    INFO("values shifted by " << p.in << ", codes by " << p.out);
    std::vector<float> recorded(count, 0.0f), ref(count, 0.0f);
    std::vector<uint8_t> codes = placed(std::vector<uint8_t>(layout.total_elements(), 0xFF), p.out,
                                        static_cast<uint8_t>(0xFF));
    DeviceBuffer<uint8_t> d_codes = device_copy(codes);
    DeviceBuffer<float> d_recorded = device_copy(recorded);
    DeviceBuffer<float> d_values = device_copy(placed(values, p.in, kPaddingValue));
    cpu::quantize_tensors(codes.data() + p.out, values.data(), layout, scales.data(), nullptr, ref.data(),
                          Fp8Dtype::e4m3);
    cuda::quantize_tensors(d_codes.data() + p.out, d_values.data() + p.in, device_layout.table(), d_scales.data(),
                           nullptr, d_recorded.data(), Fp8Dtype::e4m3, nullptr);
    sync();
    const std::vector<float> gpu = d_recorded.download();
    check_same(gpu, ref, same_bits);
    check_same(d_codes.download(), codes, same_byte);
    CHECK(float_bits(gpu[tensor_index(layout, "big")]) == kQuietNaNBits);
    CHECK(float_bits(gpu[tensor_index(layout, "tail")]) == kQuietNaNBits);
    CHECK(gpu[tensor_index(layout, "chunk")] == kInf);
    CHECK(codes[p.out + tensor(layout, "tail").offset + 7000] == 0x7F);

    // Finite values afterwards leave the NaN slots NaN.
    const std::vector<float> finite = random_slab(layout, 37);
    DeviceBuffer<float> d_finite = device_copy(finite);
    cpu::quantize_tensors(codes.data() + p.out, finite.data(), layout, scales.data(), nullptr, ref.data(),
                          Fp8Dtype::e4m3);
    cuda::quantize_tensors(d_codes.data() + p.out, d_finite.data(), device_layout.table(), d_scales.data(), nullptr,
                           d_recorded.data(), Fp8Dtype::e4m3, nullptr);
    sync();
    const std::vector<float> after = d_recorded.download();
    check_same(after, ref, same_bits);
    CHECK(float_bits(after[tensor_index(layout, "big")]) == kQuietNaNBits);
  }

  const cuda::DeviceTensorLayout empty{TensorLayout{}};
  cuda::quantize_tensors(nullptr, nullptr, empty.table(), nullptr, nullptr, nullptr, Fp8Dtype::e4m3, nullptr);
}

// ----------------------------------------------------------------------------- sum_fp8_chunks

TEST_CASE("GPU sum_fp8_chunks: bit-identical to the CPU over ranks, strides and placements", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  const TensorLayout layout = uneven_layout();
  const cuda::DeviceTensorLayout device_layout(layout);
  const int count = static_cast<int>(layout.tensors().size());
  const size_t total = layout.total_elements();

  Random random(41);
  std::vector<float> scale_inv(count);
  for (float& s : scale_inv) s = std::ldexp(1.0f + static_cast<float>(random.uniform()), static_cast<int>(random.next_u64() % 21) - 10);
  DeviceBuffer<float> d_scale_inv = device_copy(scale_inv);

  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    for (int ranks : {1, 3, 4}) {
      // total + 4 and total + 3: a multiple of 4 bytes or not (the latter takes the scalar path).
      for (size_t stride : {total, total + 4, total + 3}) {
        // Every byte random: NaN and infinite codes included (their sums are NaN or inf on both sides).
        std::vector<uint8_t> chunks(static_cast<size_t>(ranks - 1) * stride + total);
        for (uint8_t& c : chunks) c = static_cast<uint8_t>(random.next_u64() & 0xFF);
        for (const Placement& p : kPlacements) {
          INFO(to_string(dtype) << ", " << ranks << " ranks, stride " << stride << ", chunks shifted by " << p.in
                                << ", out by " << p.out);
          std::vector<float> out = placed(std::vector<float>(total, -7.0f), p.out, -7.0f);
          DeviceBuffer<float> d_out = device_copy(out);
          DeviceBuffer<uint8_t> d_chunks = device_copy(placed(chunks, p.in, static_cast<uint8_t>(0x7F)));
          cpu::sum_fp8_chunks(out.data() + p.out, chunks.data(), ranks, stride, layout, scale_inv.data(), dtype);
          cuda::sum_fp8_chunks(d_out.data() + p.out, d_chunks.data() + p.in, ranks, stride, device_layout.table(),
                               d_scale_inv.data(), dtype, nullptr);
          sync();
          const std::vector<float> gpu = d_out.download();
          check_same(gpu, out, same_value);

          // Run to run: the same bits.
          cuda::sum_fp8_chunks(d_out.data() + p.out, d_chunks.data() + p.in, ranks, stride, device_layout.table(),
                               d_scale_inv.data(), dtype, nullptr);
          sync();
          const std::vector<float> again = d_out.download();
          CHECK(std::memcmp(gpu.data(), again.data(), gpu.size() * sizeof(float)) == 0);
        }
      }
    }
  }

  const cuda::DeviceTensorLayout empty{TensorLayout{}};
  cuda::sum_fp8_chunks(nullptr, nullptr, 2, 0, empty.table(), nullptr, Fp8Dtype::e4m3, nullptr);
}

TEST_CASE("GPU sum_fp8_chunks decodes every FP8 code exactly as fp8_decode", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  TensorLayout layout;
  layout.add("codes", {256}, false);
  const cuda::DeviceTensorLayout device_layout(layout);
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  DeviceBuffer<uint8_t> d_codes = device_copy(codes);
  DeviceBuffer<float> d_one = device_copy(std::vector<float>{1.0f});
  for (Fp8Dtype dtype : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    INFO(to_string(dtype));
    DeviceBuffer<float> d_out(256);
    d_out.fill_bytes(testing::kPoisonByte);
    cuda::sum_fp8_chunks(d_out.data(), d_codes.data(), 1, 0, device_layout.table(), d_one.data(), dtype, nullptr);
    sync();
    std::vector<float> ref(256);
    cpu::decode_fp8(ref.data(), codes.data(), codes.size(), dtype);
    check_same(d_out.download(), ref, same_value);
  }
}

// ------------------------------------------------------------------------------ conversions

TEST_CASE("GPU BF16 conversions: bit-identical to the CPU, aligned and not, grid-stride sizes", "[gpu][slab]") {
  FP8LM_REQUIRE_GPU();
  // The largest size needs more than the launcher's 4096 blocks of 256 threads x 4 elements.
  for (size_t n : {size_t{1}, size_t{3}, size_t{4}, size_t{1000}, size_t{10007}, size_t{4 * 4096 * 256 + 13}}) {
    std::vector<float> in = random_floats(n, 50 + n, 3.0f);
    const std::vector<uint32_t> specials = {0x3F808000u, 0x3F818000u, 0x3F808001u, 0xBF808000u, 0x7F7FFFFFu,
                                            0x7F7F8000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00001u,
                                            0x00008000u, 0x00018000u, 0x80000000u};
    for (size_t i = 0; i < specials.size() && i < n; ++i) in[(i * 7919) % n] = float_from_bits(specials[i]);
    Random random(60 + n);
    std::vector<uint16_t> bits(n);
    for (uint16_t& b : bits) b = static_cast<uint16_t>(random.next_u64() & 0xFFFF);  // every pattern, NaN included

    for (const Placement& p : kPlacements) {
      INFO("n " << n << ", input shifted by " << p.in << ", output by " << p.out);
      {  // FP32 -> BF16
        std::vector<uint16_t> out = placed(std::vector<uint16_t>(n, 0xFFFF), p.out, static_cast<uint16_t>(0xFFFF));
        DeviceBuffer<uint16_t> d_out = device_copy(out);
        DeviceBuffer<float> d_in = device_copy(placed(in, p.in, kNaN));
        cpu::convert_f32_to_bf16(out.data() + p.out, in.data(), n);
        cuda::convert_f32_to_bf16(reinterpret_cast<__nv_bfloat16*>(d_out.data() + p.out), d_in.data() + p.in, n,
                                  nullptr);
        sync();
        check_same(d_out.download(), out, same_bf16);
      }
      {  // BF16 -> FP32
        std::vector<float> out = placed(std::vector<float>(n, -7.0f), p.out, -7.0f);
        DeviceBuffer<float> d_out = device_copy(out);
        DeviceBuffer<uint16_t> d_in = device_copy(placed(bits, p.in, static_cast<uint16_t>(0x7FC0)));
        cpu::convert_bf16_to_f32(out.data() + p.out, bits.data(), n);
        cuda::convert_bf16_to_f32(d_out.data() + p.out, reinterpret_cast<const __nv_bfloat16*>(d_in.data() + p.in),
                                  n, nullptr);
        sync();
        check_same(d_out.download(), out, same_value);
      }
    }
  }
  cuda::convert_f32_to_bf16(nullptr, nullptr, 0, nullptr);  // no work
  cuda::convert_bf16_to_f32(nullptr, nullptr, 0, nullptr);
}
