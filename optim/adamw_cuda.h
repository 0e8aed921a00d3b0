// AdamW on the GPU: the device twin of AdamW::step() (optim/adamw.h), over whole slabs,
// with no host sync. The step count t, the clip coefficient and the skip decision come
// from a device StepControl written by finalize_step() (optim/grad_clip_cuda.h).
//
// Semantics (exactly those of optim/adamw.h, per tensor of the layout, padding never
// touched):
//   - control->skip != 0: every kernel returns at once; nothing anywhere changes.
//   - otherwise t = control->step_count (already incremented by finalize_step, so >= 1;
//     t = 0 would divide by a zero bias correction), grad_scale = control->grad_scale,
//     bias corrections 1 - beta^t computed in double (pow) and rounded to float, as
//     adamw_step_scalars() does on the host.
//   - fp8_fp16: pass 1 updates the moments in registers and reduces amax_m = max |m|,
//     amax_v = max v per tensor (atomicMax on the float bits: values >= 0, NaN ignored as
//     on the CPU, so the result does not depend on the order); new scales
//     moment_scale(amax, 448 / 65504); pass 2 recomputes the same moments, updates the
//     master weight from them (unquantized), writes the BF16 copy and re-quantizes m
//     (E4M3, RNE, saturating) and v (FP16 RNE after clamping to 65504) with the new scales.
//   - the per-element arithmetic is that of adamw_moments()/adamw_param(), evaluated with
//     explicit round-to-nearest intrinsics (no FMA contraction), IEEE division and square
//     root: the results are bit-identical to the CPU reference (g++ on x86-64 does not
//     contract either), given bit-identical bias corrections (see the risk note on pow in
//     optim/adamw.cu).
//
// Plain C++ header (no kernels): usable from .cpp files compiled by g++.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <vector>

#include "core/device_memory_cuda.h"
#include "core/gradient_ref.h"
#include "optim/adamw.h"
#include "optim/grad_clip_cuda.h"

namespace fp8lm::cuda {

// FP8 weight operands that the fp8_fp16 update writes in its second pass
// (AdamWCall::weight_casts): tensor `tensor` of the optimizer's table, [rows, cols] row-major
// in the master, becomes codes [rows, cols] = fp8_e4m3(master * scales[state]) and codes_t
// [cols, rows] its transpose (none when codes_t is null), with max |master| raised into
// amax_row[state]: the values, the rounding and the amax protocol of cast_transpose_fp8
// (core/cast_cuda.h) from the FP32 master. first_tile: the cast's first 64x64 tile among all
// casts' (the transpose's grid).
struct DeviceWeightCast {
  uint8_t* codes = nullptr;
  uint8_t* codes_t = nullptr;
  int tensor = -1;
  int state = -1;
  int rows = 0;
  int cols = 0;
  uint32_t first_tile = 0;
};

struct DeviceWeightCastTable {
  const DeviceWeightCast* casts = nullptr;   // [count], first_tile ascending
  const int32_t* cast_of_tensor = nullptr;   // [table.count] index into casts, -1: none
  int count = 0;
  uint32_t num_tiles = 0;
};

// Owns the device arrays of a DeviceWeightCastTable (synchronous uploads, at set-up time).
class DeviceWeightCasts {
 public:
  // casts: codes, codes_t, tensor, state, rows and cols set (first_tile is computed);
  // tensors: the optimizer table's count.
  DeviceWeightCasts(std::vector<DeviceWeightCast> casts, int tensors);
  const DeviceWeightCastTable& table() const { return table_; }

 private:
  DeviceBuffer<DeviceWeightCast> casts_;
  DeviceBuffer<int32_t> cast_of_tensor_;
  DeviceWeightCastTable table_;
};

// Floats of scratch adamw_step_fp8_fp16() needs: 4 * table.count + 2
// (per-tensor amax of m and v, the previous scale inverses, the two bias corrections).
size_t adamw_fp8_fp16_scratch_size(const DeviceTensorTable& table);

// One AdamW step with FP8-LLM state. Four launches on `stream` (memset, pass 1, scales,
// pass 2), each a no-op when control->skip.
//   master      [total_elements] FP32 master weights, updated in place
//   params_bf16 [total_elements] BF16 working copy: written (= round-to-nearest-even of the
//               updated master) for every real element; padding untouched
//   grads       [total_elements] gradients, unscaled (grad_scale is applied on read): FP32,
//               or BF16 under --grad-reduce-in-bf16 (widened to FP32 on read)
//   m_codes     [total_elements] E4M3 codes of m * m_scale, updated
//   v_bits      [total_elements] FP16 bits of v * v_scale, updated
//   m_scales    [table.count] per-tensor scales, read then overwritten with the new ones
//   v_scales    [table.count]
//   hp          host values (lr of this step, betas, eps, weight decay)
//   control     [1] device: skip, step_count, grad_scale (read only)
//   scratch     [adamw_fp8_fp16_scratch_size(table)] floats, device
// Fresh state: codes and bits 0, scales 1 (as the CPU AdamW constructor).
// Vectorized (4 elements per thread) when every pointer is 16-byte (FP32) / 8-byte
// (FP16, BF16, BF16 gradients) / 4-byte (E4M3) aligned and a tensor's offset is a multiple of 4 (the
// TensorLayout default); any other tensor takes a scalar path with the same results.
void adamw_step_fp8_fp16(float* master, __nv_bfloat16* params_bf16, GradientView grads, uint8_t* m_codes,
                         uint16_t* v_bits, float* m_scales, float* v_scales, const DeviceTensorTable& table,
                         const AdamWHyperparams& hp, const StepControl* control, float* scratch, cudaStream_t stream);

// The same step in two halves, for state sharded across ranks (see cpu::adamw_moment_amaxes):
// the first leaves the updated moments' amaxes in scratch[0, 2*count) (as non-negative
// floats: m then v) for the caller to MAX-reduce across ranks in place; the second takes
// the new scales from them and runs pass 2. Together they are adamw_step_fp8_fp16.
// slab_offsets [table.count] (device, optional): where each tensor's gradient and BF16
// working value sit, when not at table.offsets (the distributed optimizer: the master and
// state packed in the shard, the gradients reduce-scattered and the working copy gathered in
// place in the model's slabs); an offset minus the table's must keep the 4-element alignment
// for the vectorized path (any other tensor takes the scalar path, same results).
void adamw_fp8_fp16_moment_amaxes(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                  const float* m_scales, const float* v_scales, const DeviceTensorTable& table,
                                  const AdamWHyperparams& hp, const StepControl* control, float* scratch,
                                  cudaStream_t stream, const uint64_t* slab_offsets = nullptr);
// The first half in the gradients' one read that also takes their norm, for an optimizer
// whose table is the norm's (every tensor whole, counted once): before the step's decision,
// the amaxes as if the clip coefficient were 1, and *sum_of_squares = what grad_norm_squared
// computes over `table`, bit for bit (norm_scratch: grad_norm_scratch_size(table) doubles).
// After finalize_step, adamw_fp8_fp16_moment_amaxes_if_clipped redoes the amaxes with the
// coefficient when it is not 1 (decided on the device; nothing runs otherwise).
void adamw_fp8_fp16_moment_amaxes_and_norm(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                           const float* m_scales, const float* v_scales,
                                           const DeviceTensorTable& table, const AdamWHyperparams& hp, float* scratch,
                                           double* sum_of_squares, double* norm_scratch, cudaStream_t stream);
// The same first half in parts, for gradients that become final range by range during the
// backward (one rank, its last micro-batch): _begin (the amaxes zeroed), then _part once for
// each range of chunks [first_chunk, end_chunk) (DeviceTensorLayout::first_chunk of a range of
// tensors), on any stream once its gradients are final, in any order, then _finish (the
// norm's fixed-order sum of every chunk's partial) after every part. Together, bit for bit,
// adamw_fp8_fp16_moment_amaxes_and_norm: each chunk is the same block, writing its own partial;
// the amaxes are maxima, which no order changes.
void adamw_fp8_fp16_first_pass_begin(const DeviceTensorTable& table, float* scratch, cudaStream_t stream);
void adamw_fp8_fp16_first_pass_part(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                    const float* m_scales, const float* v_scales, const DeviceTensorTable& table,
                                    uint32_t first_chunk, uint32_t end_chunk, const AdamWHyperparams& hp,
                                    float* scratch, double* norm_scratch, cudaStream_t stream);
void adamw_fp8_fp16_first_pass_finish(const DeviceTensorTable& table, double* sum_of_squares,
                                      const double* norm_scratch, cudaStream_t stream);
void adamw_fp8_fp16_moment_amaxes_if_clipped(GradientView grads, const uint8_t* m_codes, const uint16_t* v_bits,
                                             const float* m_scales, const float* v_scales,
                                             const DeviceTensorTable& table, const AdamWHyperparams& hp,
                                             const StepControl* control, float* scratch, cudaStream_t stream);
// weight_casts (optional, with slab_offsets nullptr): its tensors are updated tile by tile and
// their FP8 operands written in the same pass, with the FP8 scales `fp8_scales` [states]
// and amaxes raised in `amax_row` [states] (nullptr: none recorded); under control->skip
// only the operands are written, from the unchanged master.
// working_offsets [table.count] (device, optional): where each tensor's BF16 working value
// sits in params_bf16 when the working copy is laid out on its own (~0: the tensor has none,
// and nothing is written for it); nullptr: beside its gradient.
void adamw_fp8_fp16_apply(float* master, __nv_bfloat16* params_bf16, GradientView grads, uint8_t* m_codes,
                          uint16_t* v_bits, float* m_scales, float* v_scales, const DeviceTensorTable& table,
                          const AdamWHyperparams& hp, const StepControl* control, float* scratch,
                          cudaStream_t stream, const uint64_t* slab_offsets = nullptr,
                          const DeviceWeightCastTable* weight_casts = nullptr, const float* fp8_scales = nullptr,
                          float* amax_row = nullptr, const uint64_t* working_offsets = nullptr);

// One AdamW step with FP32 state (one pass). Arrays as above; m, v [total_elements] FP32.
void adamw_step_fp32(float* master, __nv_bfloat16* params_bf16, GradientView grads, float* m, float* v,
                     const DeviceTensorTable& table, const AdamWHyperparams& hp, const StepControl* control,
                     cudaStream_t stream, const uint64_t* slab_offsets = nullptr,
                     const uint64_t* working_offsets = nullptr);

// Diagnostics (tests): out[2i] = 1 - beta1^steps[i], out[2i+1] = 1 - beta2^steps[i], as the
// kernels compute them (double pow, rounded to float).
//   out [n, 2] device, written; steps [n] device
void adamw_bias_corrections(float* out, const long long* steps, int n, float beta1, float beta2,
                            cudaStream_t stream);

}  // namespace fp8lm::cuda
