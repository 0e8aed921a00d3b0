// The CUDA backend's uploads of more than one staging chunk (start-up's whole slabs: the BF16
// working copy and the FP32 master weights, tens of GB at gpt-6.7b) land every byte where
// a plain copy would, the partial last chunk included.
#include <cstdint>
#include <cstring>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/dtype.h"
#include "core/random.h"
#include "layers/ops_cuda.h"
#include "tests/gpu_testing.h"

using namespace fp8lm;

TEST_CASE("GPU uploads larger than the pinned staging arrive whole and in order", "[gpu][ops]") {
  FP8LM_REQUIRE_GPU();
  std::unique_ptr<Ops> ops = make_cuda_ops();
  // 2.3 staging chunks of BF16 values (a chunk is 64 Mi of them), and of raw bytes (128 MiB).
  const size_t values = (size_t{1} << 26) * 23 / 10 + 7;
  std::vector<float> host(values);
  Random random(17);
  for (float& v : host) v = float(random.normal());

  Tensor working;
  std::unique_ptr<Allocation> bf16 = ops->allocate(values * sizeof(uint16_t));
  working.data = bf16->data();
  working.dtype = DType::bf16;
  working.rows = 1;
  working.cols = int64_t(values);
  ops->upload_values(working, host.data());
  std::vector<uint16_t> bits(values);
  ops->download(bits.data(), bf16->data(), values * sizeof(uint16_t));
  size_t wrong = 0;
  for (size_t i = 0; i < values; ++i) wrong += bits[i] != bf16_from_float(host[i]);
  CHECK(wrong == 0);

  std::unique_ptr<Allocation> raw = ops->allocate(values * sizeof(float));
  ops->upload(raw->data(), host.data(), values * sizeof(float));
  std::vector<float> back(values);
  ops->download(back.data(), raw->data(), values * sizeof(float));
  CHECK(std::memcmp(back.data(), host.data(), values * sizeof(float)) == 0);
}
