// Megatron's conjugate mappings between the tensor-parallel region of a layer and the rest
// of the model (Megatron-LM's tensor_parallel/mappings.py), over one tensor-parallel group.
// The model calls them by name and never calls a collective itself:
//
//   copy_to_tensor_model_parallel_region        forward: identity       backward: all-reduce
//   reduce_from_tensor_model_parallel_region    forward: all-reduce     backward: identity
//   gather_from_sequence_parallel_region        forward: all-gather     backward: reduce-scatter
//   reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter backward: all-gather
//
// A column-parallel layer's input enters through the first pair (under --sequence-parallel,
// the third); a row-parallel layer's output, and the vocabulary-parallel embedding's, leave
// through the second (the fourth). Outside the region, under sequence parallelism, each
// rank keeps rows [rank * R/size, (rank+1) * R/size) of every [R, C] activation.
//
// Tensors are backend memory; the group's communicator runs in the backend's stream order.
// Reductions sum in the tensor's stored dtype (BF16 on the GPU, FP32 on the CPU); a gather
// moves any dtype as it is stored, FP8 codes included (one byte per element on the GPU).
// With one rank every mapping is the identity and nothing is called.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "layers/ops.h"
#include "parallel/communicator.h"

namespace fp8lm {

class TensorParallelMappings {
 public:
  // group: the tensor-parallel communicator; nullptr means one rank.
  TensorParallelMappings(Communicator* group, bool sequence_parallel, const Ops& ops);

  int size() const;
  int rank() const;
  bool sequence_parallel() const { return sequence_parallel_; }
  Communicator* group() const { return group_; }
  // The rows of an [R, C] activation this rank keeps outside the region, and the first one.
  int64_t local_rows(int64_t rows) const { return sequence_parallel_ ? rows / size() : rows; }
  int64_t first_local_row(int64_t rows) const { return sequence_parallel_ ? rank() * (rows / size()) : 0; }
  // rows [first_local_row, +local_rows) of `full`, a view.
  Tensor local_view(const Tensor& full) const;

  // ---- The four mappings (forward and backward).
  // x [R,C]: the backward all-reduces grad in place.
  void copy_to_tensor_model_parallel_region_backward(const Tensor& grad) const;
  // partial [R,C]: summed across the group in place.
  void reduce_from_tensor_model_parallel_region(const Tensor& partial) const;
  // full [R,C] holds this rank's rows at local_view(full): gathered in place.
  void gather_from_sequence_parallel_region(const Tensor& full) const;
  // grad_full [R,C] partial on each rank -> grad_rows [R/size, C] summed.
  void gather_from_sequence_parallel_region_backward(const Tensor& grad_full, const Tensor& grad_rows) const;
  // partial [R,C] -> rows [R/size, C] summed.
  void reduce_scatter_to_sequence_parallel_region(const Tensor& partial, const Tensor& rows) const;
  // grad_rows [R/size, C] -> grad_full [R,C] gathered (grad_rows may be local_view(grad_full)).
  void reduce_scatter_to_sequence_parallel_region_backward(const Tensor& grad_rows, const Tensor& grad_full) const;

  // ---- A layer's entry and exit, choosing the pair by --sequence-parallel.
  // Column-parallel input: `full` [R,C] (its local rows written, under SP) becomes the
  // whole input. Backward: `grad_full` [R,C], partial on every rank, is summed into
  // `grad_rows` (= local_view(grad_full) without SP: in place).
  void column_parallel_input(const Tensor& full) const;
  void column_parallel_input_backward(const Tensor& grad_full, const Tensor& grad_rows) const;
  // Row-parallel output: `partial` [R,C] is summed into `rows` (= partial without SP).
  // Backward: `grad_rows` becomes the whole `grad_full` (= grad_rows without SP).
  void row_parallel_output(const Tensor& partial, const Tensor& rows) const;
  void row_parallel_output_backward(const Tensor& grad_rows, const Tensor& grad_full) const;

  // The vocabulary-parallel cross-entropy's statistics: partials [N,3] of every rank into
  // all_partials [size, N, 3], rank-major (a view of partials itself with one rank).
  void gather_loss_partials(const Tensor& partials, const Tensor& all_partials) const;
  // Once per step under SP: the partial gradients of replicated tensors, summed in their
  // storage type (FP32, or BF16 under --grad-reduce-in-bf16; the caller rounds a BF16 sum
  // held in FP32 storage: Ops::round_to_dtype). grads: a range of the gradient slab.
  void sum_partial_gradients(const Tensor& grads) const;

 private:
  CommDtype storage_dtype(const Tensor& t, bool reduction) const;

  Communicator* group_;
  bool sequence_parallel_;
  const Ops& ops_;
};

}  // namespace fp8lm
