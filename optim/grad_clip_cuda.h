// The GPU side of optim/grad_clip.h, and the device-resident step control that lets a
// training step run with no host sync: the gradient norm, the clip coefficient, the
// "skip this step" decision and the AdamW step count t all live in device memory, are
// written by finalize_step() and read by the AdamW kernels (optim/adamw_cuda.h).
//
// One step, all asynchronous on one stream:
//     grad_norm_squared(sum, grads, table, norm_scratch, stream);   // sum = sum of g^2 (double)
//     [data parallel: all-reduce `sum` (ncclDouble, sum) here]
//     finalize_step(control, sum, loss_sum, micro_batches, clip_grad, stream);
//     adamw_step_fp8_fp16(..., control, ...);                        // no-op when control->skip
// The host reads StepControl back only when it logs (a cudaMemcpy of the struct).
//
// Plain C++ header (no kernels): usable from .cpp files compiled by g++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "core/device_memory_cuda.h"
#include "core/gradient_ref.h"
#include "core/tensor.h"
#include "optim/grad_clip.h"
#include "optim/step_control.h"

namespace fp8lm::cuda {

// A TensorLayout on the device. The optimizer kernels cut every tensor into chunks of
// kGradNormChunk elements (the CPU's grad-norm chunks); one thread block handles one
// chunk, so a block never crosses a tensor and never touches padding. All pointers are
// device pointers; count and num_chunks are host values (launch sizes).
struct DeviceTensorTable {
  const uint64_t* offsets = nullptr;       // [count] slab offset of each tensor
  const uint64_t* numels = nullptr;        // [count] elements of each tensor (0 allowed)
  const uint8_t* decay = nullptr;          // [count] 1 = AdamW weight decay applies
  const uint32_t* chunk_begin = nullptr;   // [count + 1] first chunk of each tensor (prefix sum)
  const int32_t* chunk_tensor = nullptr;   // [num_chunks] the tensor of each chunk
  int count = 0;                           // number of tensors
  uint32_t num_chunks = 0;                 // sum over tensors of ceil(numel / kGradNormChunk)
  uint64_t total_elements = 0;             // slab size, padding included
};

// Owns the device arrays of a DeviceTensorTable; built once from a layout (synchronous
// uploads, at set-up time). Movable; table() stays valid across moves.
class DeviceTensorLayout {
 public:
  DeviceTensorLayout() = default;
  explicit DeviceTensorLayout(const TensorLayout& layout);
  const DeviceTensorTable& table() const { return table_; }
  // The first chunk of tensor k (k = count: num_chunks), on the host: a range of tensors is a
  // range of chunks, which a launch over part of the table takes.
  uint32_t first_chunk(size_t k) const { return host_chunk_begin_.at(k); }

 private:
  std::vector<uint32_t> host_chunk_begin_;
  DeviceBuffer<uint64_t> offsets_, numels_;
  DeviceBuffer<uint8_t> decay_;
  DeviceBuffer<uint32_t> chunk_begin_;
  DeviceBuffer<int32_t> chunk_tensor_;
  DeviceTensorTable table_;
};

// *control = value, as a kernel on `stream` (no host sync, no pageable-memory copy).
// Start of a run: set_step_control(control, StepControl{}, stream); restore: the saved t.
void set_step_control(StepControl* control /*device*/, const StepControl& value, cudaStream_t stream);

// Doubles of scratch grad_norm_squared() needs: max(1, table.num_chunks).
size_t grad_norm_scratch_size(const DeviceTensorTable& table);

// *out_sum_of_squares = sum over every tensor (padding skipped) of grads[i]^2, in double:
// the device twin of grad_sum_of_squares() (optim/grad_clip.h). Deterministic: one block
// per kGradNormChunk chunk sums its elements in double (fixed per-thread strides, then a
// fixed shuffle tree), writes its partial to scratch, and one block adds the partials in
// a fixed order. Bit-reproducible run to run; agrees with the CPU's double sum to
// ~1e-15 relative (different association only). A non-finite gradient makes it inf/NaN.
//   out_sum_of_squares [1] device, written
//   grads              [table.total_elements] gradient slab, FP32 or BF16 (each value widened
//                      to FP32, then squared in double as the CPU does)
//   scratch            [grad_norm_scratch_size(table)] doubles, device
void grad_norm_squared(double* out_sum_of_squares, GradientView grads, const DeviceTensorTable& table,
                       double* scratch, cudaStream_t stream);

// grad_norm_squared's first half for chunks [first_chunk, end_chunk) only: their partial sums
// into partials[first_chunk, end_chunk), the same bits. For gradients that become final
// bucket by bucket (DeviceTensorLayout::first_chunk gives a range of tensors' chunks); once
// every chunk's partial is written, grad_norm_finish adds them.
void grad_norm_chunks(double* partials, GradientView grads, const DeviceTensorTable& table, uint32_t first_chunk,
                      uint32_t end_chunk, cudaStream_t stream);

// *out_sum_of_squares = partials [chunks] added in grad_norm_squared's fixed order: its
// second half, for AdamW's first pass when that writes the per-chunk partials
// (adamw_fp8_fp16_moment_amaxes_and_norm).
void grad_norm_finish(double* out_sum_of_squares, const double* partials, uint32_t chunks, cudaStream_t stream);

// One thread, no host sync. Reads *sum_of_squares and *loss_sum, then writes *control:
//   grad_norm  = sqrt(sum)                                  (double, stored as float)
//   loss       = *loss_sum / loss_divisor                   (float)
//   skip       = !isfinite(loss) || !isfinite(grad_norm)
//   grad_scale = clip_coefficient(grad_norm, max_grad_norm) (optim/grad_clip.h, computed
//                in double from the double norm exactly as the CPU does; 1 when
//                max_grad_norm <= 0 or the norm is not finite)
//   skip:  consecutive_skips += 1, total_skips += 1, step_count unchanged
//   else:  consecutive_skips = 0, step_count += 1 (the t the AdamW kernels then use)
//   control        [1] device, read and written
//   sum_of_squares [1] device (from grad_norm_squared, all-reduced across ranks if any)
//   loss_sum       [1] device: the step's summed micro-batch losses
void finalize_step(StepControl* control, const double* sum_of_squares, const float* loss_sum, float loss_divisor,
                   double max_grad_norm, cudaStream_t stream);

}  // namespace fp8lm::cuda
