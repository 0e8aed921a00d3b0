#include "parallel/mappings.h"

#include "core/error.h"

namespace fp8lm {

TensorParallelMappings::TensorParallelMappings(Communicator* group, bool sequence_parallel, const Ops& ops)
    : group_(group), sequence_parallel_(sequence_parallel), ops_(ops) {
  FP8LM_CHECK(!sequence_parallel || (group != nullptr && group->size() > 1),
              "sequence parallelism needs a tensor-parallel group of two or more ranks");
}

int TensorParallelMappings::size() const { return group_ ? group_->size() : 1; }
int TensorParallelMappings::rank() const { return group_ ? group_->rank() : 0; }

Tensor TensorParallelMappings::local_view(const Tensor& full) const {
  return full.row_slice(first_local_row(full.rows), local_rows(full.rows), ops_.element_bytes(full.dtype));
}

// What travels: a stored FP32 (every dtype on the CPU) or BF16 value, or one byte: FP8
// codes, reduced in their format or gathered as raw bytes.
CommDtype TensorParallelMappings::storage_dtype(const Tensor& t, bool reduction) const {
  switch (ops_.element_bytes(t.dtype)) {
    case 4: return CommDtype::f32;
    case 2: return CommDtype::bf16;
    default:
      if (!reduction) return CommDtype::u8;
      return t.dtype == DType::e5m2 ? CommDtype::e5m2 : CommDtype::e4m3;
  }
}

void TensorParallelMappings::copy_to_tensor_model_parallel_region_backward(const Tensor& grad) const {
  if (size() == 1) return;
  group_->all_reduce(grad.data, grad.data, size_t(grad.numel()), storage_dtype(grad, true), ReduceOp::sum);
}

void TensorParallelMappings::reduce_from_tensor_model_parallel_region(const Tensor& partial) const {
  if (size() == 1) return;
  group_->all_reduce(partial.data, partial.data, size_t(partial.numel()), storage_dtype(partial, true), ReduceOp::sum);
}

void TensorParallelMappings::gather_from_sequence_parallel_region(const Tensor& full) const {
  if (size() == 1) return;
  const Tensor local = local_view(full);
  group_->all_gather(local.data, full.data, size_t(local.numel()), storage_dtype(full, false));
}

void TensorParallelMappings::gather_from_sequence_parallel_region_backward(const Tensor& grad_full,
                                                                           const Tensor& grad_rows) const {
  if (size() == 1) return;
  FP8LM_CHECK(grad_rows.numel() * size() == grad_full.numel(), "reduce-scatter: rows do not tile the tensor");
  group_->reduce_scatter(grad_full.data, grad_rows.data, size_t(grad_rows.numel()), storage_dtype(grad_full, true),
                         ReduceOp::sum);
}

void TensorParallelMappings::reduce_scatter_to_sequence_parallel_region(const Tensor& partial,
                                                                        const Tensor& rows) const {
  gather_from_sequence_parallel_region_backward(partial, rows);
}

void TensorParallelMappings::reduce_scatter_to_sequence_parallel_region_backward(const Tensor& grad_rows,
                                                                                 const Tensor& grad_full) const {
  if (size() == 1) return;
  FP8LM_CHECK(grad_rows.numel() * size() == grad_full.numel(), "all-gather: rows do not tile the tensor");
  group_->all_gather(grad_rows.data, grad_full.data, size_t(grad_rows.numel()), storage_dtype(grad_full, false));
}

void TensorParallelMappings::column_parallel_input(const Tensor& full) const {
  if (sequence_parallel_) gather_from_sequence_parallel_region(full);
  // else copy_to_tensor_model_parallel_region: the identity forward.
}

void TensorParallelMappings::column_parallel_input_backward(const Tensor& grad_full, const Tensor& grad_rows) const {
  if (sequence_parallel_) {
    gather_from_sequence_parallel_region_backward(grad_full, grad_rows);
  } else {
    copy_to_tensor_model_parallel_region_backward(grad_full);
  }
}

void TensorParallelMappings::row_parallel_output(const Tensor& partial, const Tensor& rows) const {
  if (sequence_parallel_) {
    reduce_scatter_to_sequence_parallel_region(partial, rows);
  } else {
    reduce_from_tensor_model_parallel_region(partial);
  }
}

void TensorParallelMappings::row_parallel_output_backward(const Tensor& grad_rows, const Tensor& grad_full) const {
  if (sequence_parallel_) reduce_scatter_to_sequence_parallel_region_backward(grad_rows, grad_full);
  // else reduce_from_tensor_model_parallel_region: the identity backward.
}

void TensorParallelMappings::gather_loss_partials(const Tensor& partials, const Tensor& all_partials) const {
  if (size() == 1) return;
  group_->all_gather(partials.data, all_partials.data, size_t(partials.numel()), CommDtype::f32);
}

void TensorParallelMappings::sum_partial_gradients(const Tensor& grads) const {
  if (size() == 1 || !sequence_parallel_) return;
  group_->all_reduce(grads.data, grads.data, size_t(grads.numel()), storage_dtype(grads, true), ReduceOp::sum);
}

}  // namespace fp8lm
