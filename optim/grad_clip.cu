// Kernels of optim/grad_clip_cuda.h. No spdlog here (nvcc, C++20).
#include "optim/grad_clip_cuda.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "core/check_cuda.h"
#include "core/device_helpers.cuh"
#include "core/launch.cuh"
#include "optim/grad_norm.cuh"
#include "core/error.h"

namespace fp8lm::cuda {

// ---- DeviceTensorLayout ------------------------------------------------------------------

namespace {

template <typename T>
void upload_all(DeviceBuffer<T>& buffer, const std::vector<T>& host) {
  buffer.allocate(host.size());
  if (!host.empty()) buffer.upload(host);
}

}  // namespace

DeviceTensorLayout::DeviceTensorLayout(const TensorLayout& layout) {
  const auto& tensors = layout.tensors();
  FP8LM_CHECK(tensors.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()), "too many tensors: ",
              tensors.size());
  std::vector<uint64_t> offsets, numels;
  std::vector<uint8_t> decay;
  std::vector<uint32_t> chunk_begin;
  std::vector<int32_t> chunk_tensor;
  uint64_t chunks = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorInfo& t = tensors[k];
    FP8LM_CHECK(t.offset + t.numel <= layout.total_elements(), "tensor ", t.name, " outside the slab");
    offsets.push_back(t.offset);
    numels.push_back(t.numel);
    decay.push_back(t.weight_decay ? 1 : 0);
    chunk_begin.push_back(static_cast<uint32_t>(chunks));
    const uint64_t n = (t.numel + kGradNormChunk - 1) / kGradNormChunk;
    // One block per chunk: grid.x (and the uint32 chunk indices) must hold them.
    FP8LM_CHECK(chunks + n < static_cast<uint64_t>(std::numeric_limits<int32_t>::max()),
                "layout too large for the optimizer kernels: ", chunks + n, " chunks");
    chunk_tensor.insert(chunk_tensor.end(), n, static_cast<int32_t>(k));
    chunks += n;
  }
  chunk_begin.push_back(static_cast<uint32_t>(chunks));

  upload_all(offsets_, offsets);
  upload_all(numels_, numels);
  upload_all(decay_, decay);
  upload_all(chunk_begin_, chunk_begin);
  host_chunk_begin_ = chunk_begin;
  upload_all(chunk_tensor_, chunk_tensor);
  table_.offsets = offsets_.data();
  table_.numels = numels_.data();
  table_.decay = decay_.data();
  table_.chunk_begin = chunk_begin_.data();
  table_.chunk_tensor = chunk_tensor_.data();
  table_.count = static_cast<int>(tensors.size());
  table_.num_chunks = static_cast<uint32_t>(chunks);
  table_.total_elements = layout.total_elements();
}

// ---- kernels -----------------------------------------------------------------------------

namespace {

constexpr int kThreads = 256;       // per chunk block
constexpr int kFinalThreads = 1024;  // the one block of the final reduction

// One block per chunk: partial[c] = sum of squares of chunk c. G: the gradients' storage
// (float, or bf16 under --grad-reduce-in-bf16), widened to FP32 on load.
template <typename G>
__global__ void __launch_bounds__(kThreads)
    grad_norm_chunks_kernel(const G* __restrict__ grads, DeviceTensorTable table, uint32_t first_chunk,
                            double* __restrict__ partial, bool vec_ok) {
  device::start_after_previous_kernel();
  const uint32_t c = first_chunk + blockIdx.x;
  const int k = table.chunk_tensor[c];
  const uint64_t tensor_end = table.offsets[k] + table.numels[k];
  const uint64_t begin = table.offsets[k] + static_cast<uint64_t>(c - table.chunk_begin[k]) * kGradNormChunk;
  const uint64_t left = tensor_end - begin;
  const uint32_t n = static_cast<uint32_t>(left < kGradNormChunk ? left : kGradNormChunk);
  const G* g = grads + begin;

  double sum = 0.0;
  uint32_t scalar_from = 0;
  if (vec_ok && begin % 4 == 0) {
    const uint32_t nvec = n / 4;
    for (uint32_t j = threadIdx.x; j < nvec; j += kThreads) {
      float v[4];
      device::load_gradient4(g, 4ull * j, v);
      sum = device::add_square(sum, v[0]);
      sum = device::add_square(sum, v[1]);
      sum = device::add_square(sum, v[2]);
      sum = device::add_square(sum, v[3]);
    }
    scalar_from = nvec * 4;
  }
  for (uint32_t i = scalar_from + threadIdx.x; i < n; i += kThreads) sum = device::add_square(sum, device::gradient_at(g, i));

  sum = device::block_sum_fixed<kThreads>(sum);
  if (threadIdx.x == 0) partial[c] = sum;
}

// One block: *out = sum of partial[0..n) in a fixed order.
__global__ void __launch_bounds__(kFinalThreads)
    grad_norm_final_kernel(const double* __restrict__ partial, uint32_t n, double* __restrict__ out) {
  device::start_after_previous_kernel();
  double sum = 0.0;
  for (uint32_t i = threadIdx.x; i < n; i += kFinalThreads) sum = __dadd_rn(sum, partial[i]);
  sum = device::block_sum_fixed<kFinalThreads>(sum);
  if (threadIdx.x == 0) *out = sum;
}

__global__ void finalize_step_kernel(StepControl* control, const double* sum_of_squares, const float* loss_sum,
                                     float loss_divisor, double max_grad_norm) {
  device::start_after_previous_kernel();
  StepControl c = *control;
  decide_step(c, *sum_of_squares, *loss_sum, loss_divisor, max_grad_norm);
  *control = c;
}

__global__ void set_step_control_kernel(StepControl* control, StepControl value) {
  device::start_after_previous_kernel();
  *control = value;
}

}  // namespace

void set_step_control(StepControl* control, const StepControl& value, cudaStream_t stream) {
  FP8LM_CHECK(control != nullptr, "set_step_control needs a device StepControl");
  launch_kernel(set_step_control_kernel, 1, 1, 0, stream, control, value);
}

size_t grad_norm_scratch_size(const DeviceTensorTable& table) {
  return table.num_chunks > 0 ? static_cast<size_t>(table.num_chunks) : 1;
}

void grad_norm_squared(double* out_sum_of_squares, GradientView grads, const DeviceTensorTable& table,
                       double* scratch, cudaStream_t stream) {
  FP8LM_CHECK(out_sum_of_squares != nullptr, "grad_norm_squared needs an output");
  if (table.num_chunks == 0) {  // no parameters: the sum is 0
    CUDA_CHECK(cudaMemsetAsync(out_sum_of_squares, 0, sizeof(double), stream));
    return;
  }
  grad_norm_chunks(scratch, grads, table, 0, table.num_chunks, stream);
  grad_norm_finish(out_sum_of_squares, scratch, table.num_chunks, stream);
}

void grad_norm_chunks(double* partials, GradientView grads, const DeviceTensorTable& table, uint32_t first_chunk,
                      uint32_t end_chunk, cudaStream_t stream) {
  FP8LM_CHECK(first_chunk <= end_chunk && end_chunk <= table.num_chunks, "grad_norm_chunks: chunks [", first_chunk,
              ", ", end_chunk, ") outside the table's ", table.num_chunks);
  if (first_chunk == end_chunk) return;
  FP8LM_CHECK(grads && partials != nullptr, "grad_norm_chunks needs grads and the partials' scratch");
  // The vector path loads four gradients at once: 16 bytes in FP32, 8 in BF16.
  const bool vec_ok = reinterpret_cast<uintptr_t>(grads.data) % (grads.bf16 ? 8 : 16) == 0;
  const uint32_t blocks = end_chunk - first_chunk;
  if (grads.bf16) {
    launch_kernel(grad_norm_chunks_kernel<__nv_bfloat16>, blocks, kThreads, 0, stream,
                  static_cast<const __nv_bfloat16*>(grads.data), table, first_chunk, partials, vec_ok);
  } else {
    launch_kernel(grad_norm_chunks_kernel<float>, blocks, kThreads, 0, stream, static_cast<const float*>(grads.data),
                  table, first_chunk, partials, vec_ok);
  }
}

void grad_norm_finish(double* out_sum_of_squares, const double* partials, uint32_t chunks, cudaStream_t stream) {
  FP8LM_CHECK(out_sum_of_squares != nullptr, "grad_norm_finish needs an output");
  if (chunks == 0) {
    CUDA_CHECK(cudaMemsetAsync(out_sum_of_squares, 0, sizeof(double), stream));
    return;
  }
  FP8LM_CHECK(partials != nullptr, "grad_norm_finish needs the partial sums");
  launch_kernel(grad_norm_final_kernel, 1, kFinalThreads, 0, stream, partials, chunks, out_sum_of_squares);
}

void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum, float loss_divisor,
                   double max_grad_norm, cudaStream_t stream) {
  FP8LM_CHECK(control && sum_of_squares && loss_sum, "finalize_step needs control, sum_of_squares and loss_sum");
  launch_kernel(finalize_step_kernel, 1, 1, 0, stream, control, sum_of_squares, loss_sum, loss_divisor, max_grad_norm);
}

}  // namespace fp8lm::cuda
