// The key/value cache kernels (layers/kv_cache.cu) against their CPU twins (and the decoding
// kernel's fused FP8 cast against cast_fp8's codes), and decoding through the cache on the GPU
// against the GPU's own training forward. SKIPPED without a GPU.
#include <cmath>
#include <cstring>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "core/gpt_config.h"
#include "core/random.h"
#include "tests/decoder_testing.h"
#include "tests/gpu_testing.h"
#include "layers/gpt.h"
#include "layers/kv_cache.h"
#include "layers/ops_cuda.h"

using namespace fp8lm;

namespace {

// FP8 E4M3 codes decoded to FP32.
std::vector<float> decode_e4m3(const std::vector<uint8_t>& codes) {
  std::vector<float> values(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) values[i] = fp8_decode(codes[i], Fp8Dtype::e4m3);
  return values;
}

double relative_error(const std::vector<float>& out, const std::vector<float>& reference) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    diff += (double(out[i]) - reference[i]) * (double(out[i]) - reference[i]);
    norm += double(reference[i]) * reference[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

}  // namespace

TEST_CASE("GPU key/value cache: append and decode equal the CPU twin, BF16 and FP8", "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  // Decoding cuts each (head, sequence)'s positions into splits of 128: one split, several
  // with a partial last one, and the head sizes the GPU model takes.
  struct Shape {
    int B, NH, HS, capacity, prompt;
  };
  for (const Shape shape : {Shape{2, 3, 64, 40, 17}, Shape{2, 2, 128, 700, 650}, Shape{1, 4, 32, 1100, 1023}})
  for (const bool fp8 : {false, true}) {
    const int B = shape.B, NH = shape.NH, HS = shape.HS, C = NH * HS, capacity = shape.capacity, prompt = shape.prompt;
    INFO((fp8 ? "fp8 cache" : "bf16 cache") << ", B " << B << ", heads " << NH << " of " << HS << ", length "
                                             << prompt + 1);
    // The prompt's qkv, then one new token's.
    const std::vector<float> prompt_qkv = testing::bf16_rounded(testing::random_floats(size_t(B) * prompt * 3 * C, 1));
    const std::vector<float> step_qkv = testing::bf16_rounded(testing::random_floats(size_t(B) * 3 * C, 2, 1.5f));
    const size_t cache_elements = size_t(B) * capacity * C;

    // CPU twin.
    std::vector<float> keys(cache_elements, 0.0f), values(cache_elements, 0.0f), out(size_t(B) * C);
    float scales[2] = {1.0f, 1.0f};
    if (fp8) {
      float key_amax = 0.0f, value_amax = 0.0f;
      for (int r = 0; r < B * prompt; ++r)
        for (int c = 0; c < C; ++c) {
          key_amax = std::max(key_amax, std::fabs(prompt_qkv[size_t(r) * 3 * C + C + c]));
          value_amax = std::max(value_amax, std::fabs(prompt_qkv[size_t(r) * 3 * C + 2 * C + c]));
        }
      scales[0] = kv_cache_scale(key_amax);
      scales[1] = kv_cache_scale(value_amax);
    }
    cpu::kv_cache_append(keys.data(), values.data(), prompt_qkv.data(), B, prompt, C, capacity, 0, fp8 ? scales : nullptr);
    cpu::kv_cache_append(keys.data(), values.data(), step_qkv.data(), B, 1, C, capacity, prompt, fp8 ? scales : nullptr);
    cpu::attention_decode(out.data(), step_qkv.data(), keys.data(), values.data(), B, C, NH, capacity, prompt + 1,
                          fp8 ? 1.0f / scales[0] : 1.0f, fp8 ? 1.0f / scales[1] : 1.0f);

    // GPU.
    const size_t element = fp8 ? 1 : 2;
    cuda::DeviceBuffer<uint8_t> d_keys, d_values;
    d_keys.allocate(cache_elements * element);
    d_values.allocate(cache_elements * element);
    CUDA_CHECK(cudaMemset(d_keys.data(), 0, cache_elements * element));
    CUDA_CHECK(cudaMemset(d_values.data(), 0, cache_elements * element));
    CUDA_CHECK(cudaDeviceSynchronize());
    cuda::DeviceBuffer<float> d_scales, d_scratch;
    d_scales.allocate(2);
    d_scratch.allocate(cuda::kKvCacheScratchFloats);
    cuda::DeviceBuffer<__nv_bfloat16> d_prompt, d_step, d_out;
    d_prompt.allocate(prompt_qkv.size());
    d_prompt.upload(testing::to_bf16(prompt_qkv));
    d_step.allocate(step_qkv.size());
    d_step.upload(testing::to_bf16(step_qkv));
    d_out.allocate(size_t(B) * C);
    cuda::kv_cache_append(d_keys.data(), d_values.data(), fp8, d_scales.data(), d_scratch.data(), d_prompt.data(), B,
                          prompt, C, capacity, 0, nullptr);
    cuda::kv_cache_append(d_keys.data(), d_values.data(), fp8, d_scales.data(), d_scratch.data(), d_step.data(), B, 1,
                          C, capacity, prompt, nullptr);
    cuda::DeviceBuffer<float> d_decode_scratch;
    d_decode_scratch.allocate(cuda::attention_decode_scratch_floats(B, C, NH, capacity));
    cuda::attention_decode(d_out.data(), d_step.data(), d_keys.data(), d_values.data(), fp8, d_scales.data(), B, C, NH,
                           capacity, prompt + 1, d_decode_scratch.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<float> gpu_keys, gpu_values;
    if (fp8) {
      gpu_keys = decode_e4m3(d_keys.download());
      gpu_values = decode_e4m3(d_values.download());
      const std::vector<float> gpu_scales = d_scales.download();
      CHECK(gpu_scales[0] == scales[0]);
      CHECK(gpu_scales[1] == scales[1]);
    } else {
      std::vector<uint8_t> raw_keys = d_keys.download(), raw_values = d_values.download();
      std::vector<__nv_bfloat16> k(cache_elements), v(cache_elements);
      std::memcpy(k.data(), raw_keys.data(), raw_keys.size());
      std::memcpy(v.data(), raw_values.data(), raw_values.size());
      gpu_keys = testing::from_bf16(k);
      gpu_values = testing::from_bf16(v);
    }
    CHECK(gpu_keys == keys);  // the same codes: the cache is exactly the CPU's
    CHECK(gpu_values == values);
    const std::vector<__nv_bfloat16> gpu_out = d_out.download();
    CHECK(relative_error(testing::from_bf16(gpu_out), out) < 1e-2);

    // A decoding step under delayed scaling: the same launch also writes c_proj's E4M3 operand,
    // the codes cast_fp8 writes from the BF16 output (fp8(out * scale), saturating), and the
    // same BF16 output.
    const float operand_scale = 448.0f / testing::max_abs(testing::from_bf16(gpu_out)) * 0.75f;
    cuda::DeviceBuffer<float> d_operand_scale = testing::device_scalar(operand_scale);
    cuda::DeviceBuffer<uint8_t> d_codes = testing::poisoned<uint8_t>(size_t(B) * C);
    cuda::DeviceBuffer<__nv_bfloat16> d_out_again = testing::poisoned<__nv_bfloat16>(size_t(B) * C);
    cuda::attention_decode(d_out_again.data(), d_step.data(), d_keys.data(), d_values.data(), fp8, d_scales.data(), B,
                           C, NH, capacity, prompt + 1, d_decode_scratch.data(), nullptr, d_codes.data(),
                           d_operand_scale.data(), Fp8Dtype::e4m3);
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(testing::same_bytes(d_out_again.download(), gpu_out));
    const std::vector<uint8_t> expected_codes =
        testing::encode_all(testing::from_bf16(gpu_out), operand_scale, Fp8Dtype::e4m3);
    CHECK(testing::same_bytes(d_codes.download(), expected_codes));

    // The step's append folded into the decoding launch (append = true): a cache holding only the
    // prompt ends with the CPU's cache, and the output is the separate append's, bit for bit.
    cuda::DeviceBuffer<uint8_t> d_keys_folded, d_values_folded;
    d_keys_folded.allocate(cache_elements * element);
    d_values_folded.allocate(cache_elements * element);
    CUDA_CHECK(cudaMemset(d_keys_folded.data(), 0, cache_elements * element));
    CUDA_CHECK(cudaMemset(d_values_folded.data(), 0, cache_elements * element));
    cuda::kv_cache_append(d_keys_folded.data(), d_values_folded.data(), fp8, d_scales.data(), d_scratch.data(),
                          d_prompt.data(), B, prompt, C, capacity, 0, nullptr);
    cuda::DeviceBuffer<__nv_bfloat16> d_out_folded = testing::poisoned<__nv_bfloat16>(size_t(B) * C);
    cuda::attention_decode(d_out_folded.data(), d_step.data(), d_keys_folded.data(), d_values_folded.data(), fp8,
                           d_scales.data(), B, C, NH, capacity, prompt + 1, d_decode_scratch.data(), nullptr, nullptr,
                           nullptr, Fp8Dtype::e4m3, nullptr, /*append=*/true);
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(d_keys_folded.download() == d_keys.download());
    CHECK(d_values_folded.download() == d_values.download());
    CHECK(testing::same_bytes(d_out_folded.download(), gpu_out));
  }
}

TEST_CASE("GPU decoding through the cache gives the GPU training forward's loss", "[gpu][sample]") {
  FP8LM_REQUIRE_GPU();
  const GptConfig config{.n_layer = 2, .n_head = 4, .n_embd = 128, .n_inner = 512, .vocab_size = 512, .n_positions = 64};
  const int B = 2, T = 24;
  Random random(3);
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  for (auto& t : x) t = int32_t(random.next_u64() % 512);
  for (auto& t : y) t = int32_t(random.next_u64() % 512);

  for (const GemmPrecision gemm : {GemmPrecision::bf16, GemmPrecision::fp8}) {
    INFO(to_string(gemm));
    std::unique_ptr<Ops> train_ops = make_cuda_ops(0);
    GptModel trained(config, B, T, GptPrecision{.gemm = gemm}, *train_ops);
    testing::set_random_weights(*train_ops, trained, config);
    cuda::DeviceBuffer<float> loss;
    loss.allocate(1);
    CUDA_CHECK(cudaMemset(loss.data(), 0, sizeof(float)));
    CUDA_CHECK(cudaDeviceSynchronize());  // the legacy stream does not order the backend's
    Tensor loss_tensor;
    loss_tensor.data = loss.data();
    loss_tensor.rows = loss_tensor.cols = 1;
    trained.forward_eval(train_ops->load_batch(x.data(), y.data(), B, T, trained.vocab_slice()), loss_tensor);
    train_ops->synchronize();
    const double expected = loss.download()[0];

    std::unique_ptr<Ops> ops = make_cuda_ops(0);
    GptModel decoder(config, InferenceShape{.batch = B, .max_prompt = 1, .capacity = T}, GptPrecision{.gemm = gemm},
                     *ops);
    testing::set_random_weights(*ops, decoder, config);
    const VocabSlice slice = decoder.vocab_slice();
    std::vector<float> logits(size_t(B) * slice.size);
    double total = 0.0;
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> step = {x[size_t(t)], x[size_t(T + t)]};
      decoder.forward_cached(ops->load_batch(step.data(), step.data(), B, 1, slice), t);
      ops->download_values(logits.data(), decoder.next_token_logits());
      for (int b = 0; b < B; ++b) {
        const float* row = logits.data() + size_t(b) * slice.size;
        double max_logit = row[0], sum = 0.0;
        for (int v = 1; v < slice.vocab_size; ++v) max_logit = std::max<double>(max_logit, row[v]);
        for (int v = 0; v < slice.vocab_size; ++v) sum += std::exp(row[v] - max_logit);
        total += std::log(sum) + max_logit - row[y[size_t(b) * T + t]];
      }
    }
    // BF16 activations round differently one row at a time than in a [B,T] pass; FP8's
    // current scaling sees one row's amax instead of the batch's.
    CHECK(std::fabs(total - expected) < (gemm == GemmPrecision::fp8 ? 0.02 : 0.005) * expected);
  }
}
