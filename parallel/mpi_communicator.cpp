#include "parallel/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "parallel/mpi_check.h"

namespace fp8lm {

namespace {

// ---- reductions of encoded types, as NCCL computes them on the GPU.
// NCCL adds two FP8 values in FP16 and two BF16 values in BF16 hardware, rounding once; here the
// operands are added in FP32 and rounded to the type. Both give the same code: the FP16/FP32 sum
// is inexact only when one operand is far below half a unit in the last place of the other,
// where either path rounds to the larger operand. An E5M2 sum above FP16's range becomes inf in
// NCCL and then saturates to the max finite value, which is what fp8_encode does directly.

template <CommDtype dtype>
float decode_element(const unsigned char* element) {
  if constexpr (dtype == CommDtype::bf16) {
    uint16_t bits;
    std::memcpy(&bits, element, sizeof bits);
    return bf16_to_float(bits);
  } else {
    return fp8_decode(*element, dtype == CommDtype::e4m3 ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2);
  }
}

template <CommDtype dtype>
void encode_element(float value, unsigned char* element) {
  if constexpr (dtype == CommDtype::bf16) {
    const uint16_t bits = bf16_from_float(value);
    std::memcpy(element, &bits, sizeof bits);
  } else {
    *element = fp8_encode(value, dtype == CommDtype::e4m3 ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2);
  }
}

// MPI_User_function: inout[i] = in[i] (op) inout[i] for `length` elements of BF16 or FP8.
template <CommDtype dtype, ReduceOp op>
void reduce_encoded(void* in, void* inout, int* length, MPI_Datatype*) {
  constexpr size_t width = dtype == CommDtype::bf16 ? 2 : 1;
  const auto* a = static_cast<const unsigned char*>(in);
  auto* b = static_cast<unsigned char*>(inout);
  for (size_t i = 0; i < static_cast<size_t>(*length); ++i) {
    const float x = decode_element<dtype>(a + i * width);
    const float y = decode_element<dtype>(b + i * width);
    // fmax returns the number when one operand is NaN, as CUDA's __hmax does inside NCCL.
    encode_element<dtype>(op == ReduceOp::sum ? x + y : std::fmax(x, y), b + i * width);
  }
}

// MPI_MAX leaves NaN to the implementation; NCCL's f32/f64 max is fmax.
template <typename T>
void max_ignoring_nan(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const unsigned char*>(in);
  auto* b = static_cast<unsigned char*>(inout);
  for (size_t i = 0; i < static_cast<size_t>(*length); ++i) {
    T x, y;
    std::memcpy(&x, a + i * sizeof(T), sizeof(T));
    std::memcpy(&y, b + i * sizeof(T), sizeof(T));
    const T m = std::fmax(x, y);
    std::memcpy(b + i * sizeof(T), &m, sizeof(T));
  }
}

struct MpiReductionTypes {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;  // 2 contiguous MPI_BYTEs
  MPI_Datatype fp8 = MPI_DATATYPE_NULL;   // 1 MPI_BYTE, both formats: the op knows which one
  MPI_Op f32_max = MPI_OP_NULL, f64_max = MPI_OP_NULL;
  MPI_Op bf16_sum = MPI_OP_NULL, bf16_max = MPI_OP_NULL;
  MPI_Op e4m3_sum = MPI_OP_NULL, e4m3_max = MPI_OP_NULL;
  MPI_Op e5m2_sum = MPI_OP_NULL, e5m2_max = MPI_OP_NULL;
};

MPI_Datatype contiguous_bytes(int bytes) {
  MPI_Datatype type;
  MPI_CHECK(MPI_Type_contiguous(bytes, MPI_BYTE, &type));
  MPI_CHECK(MPI_Type_commit(&type));
  return type;
}

MPI_Op commutative_op(MPI_User_function* function) {
  MPI_Op op;
  MPI_CHECK(MPI_Op_create(function, /*commute=*/1, &op));
  return op;
}

MpiReductionTypes create_reduction_types() {
  MpiReductionTypes t;
  t.bf16 = contiguous_bytes(2);
  t.fp8 = contiguous_bytes(1);
  t.f32_max = commutative_op(&max_ignoring_nan<float>);
  t.f64_max = commutative_op(&max_ignoring_nan<double>);
  t.bf16_sum = commutative_op(&reduce_encoded<CommDtype::bf16, ReduceOp::sum>);
  t.bf16_max = commutative_op(&reduce_encoded<CommDtype::bf16, ReduceOp::max>);
  t.e4m3_sum = commutative_op(&reduce_encoded<CommDtype::e4m3, ReduceOp::sum>);
  t.e4m3_max = commutative_op(&reduce_encoded<CommDtype::e4m3, ReduceOp::max>);
  t.e5m2_sum = commutative_op(&reduce_encoded<CommDtype::e5m2, ReduceOp::sum>);
  t.e5m2_max = commutative_op(&reduce_encoded<CommDtype::e5m2, ReduceOp::max>);
  return t;
}

// Created at the first collective of a group larger than one (MPI is initialized by then) and
// kept until MPI_Finalize releases them.
const MpiReductionTypes& reduction_types() {
  static const MpiReductionTypes types = create_reduction_types();
  return types;
}

MPI_Datatype mpi_datatype(CommDtype dtype) {
  switch (dtype) {
    case CommDtype::f32: return MPI_FLOAT;
    case CommDtype::f64: return MPI_DOUBLE;
    case CommDtype::bf16: return reduction_types().bf16;
    case CommDtype::e4m3:
    case CommDtype::e5m2: return reduction_types().fp8;
    case CommDtype::u8: return MPI_UINT8_T;
  }
  throw RuntimeError("mpi_datatype: unknown CommDtype");
}

MPI_Op mpi_op(CommDtype dtype, ReduceOp op) {
  const MpiReductionTypes& t = reduction_types();
  const bool sum = op == ReduceOp::sum;
  switch (dtype) {
    case CommDtype::f32: return sum ? MPI_SUM : t.f32_max;
    case CommDtype::f64: return sum ? MPI_SUM : t.f64_max;
    case CommDtype::bf16: return sum ? t.bf16_sum : t.bf16_max;
    case CommDtype::e4m3: return sum ? t.e4m3_sum : t.e4m3_max;
    case CommDtype::e5m2: return sum ? t.e5m2_sum : t.e5m2_max;
    case CommDtype::u8: break;
  }
  throw RuntimeError("mpi_op: u8 has no reduction");
}

// MPI counts are int. Element-wise collectives (all_reduce, broadcast) go in chunks of this many
// elements; the others refuse larger counts.
constexpr size_t kMaxElementsPerCall = size_t{1} << 30;

int mpi_count(size_t count, const std::string& group, Collective collective) {
  if (count > static_cast<size_t>(INT_MAX)) {
    throw RuntimeError(detail::concat(group, ".", to_string(collective), ": ", count,
                                      " elements per rank exceed MPI's int count"),
                       "split the call into parts of fewer than 2^31 elements per rank");
  }
  return static_cast<int>(count);
}

const char* offset_bytes(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }
char* offset_bytes(void* base, size_t bytes) { return static_cast<char*>(base) + bytes; }

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, MpiCommOwnership ownership)
    : comm_(comm), ownership_(ownership), name_(std::move(name)) {
  FP8LM_CHECK(comm != MPI_COMM_NULL, "MpiCommunicator '", name_, "' needs a communicator");
  MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::MpiCommunicator(std::string name) : name_(std::move(name)) {}

std::unique_ptr<MpiCommunicator> MpiCommunicator::single_rank(std::string name) {
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(name)));
}

MpiCommunicator::~MpiCommunicator() {
  if (ownership_ != MpiCommOwnership::owned || comm_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

void MpiCommunicator::all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) {
  check_reduction(Collective::all_reduce, dtype, op);
  check_all_reduce_buffers(send, recv, count, dtype);
  count_all_reduce(count, dtype);
  const size_t element = comm_dtype_size(dtype);
  if (completed_alone(send, recv, count * element)) return;
  const MPI_Datatype type = mpi_datatype(dtype);
  const MPI_Op reduction = mpi_op(dtype, op);
  for (size_t first = 0; first < count; first += kMaxElementsPerCall) {
    const int chunk = static_cast<int>(std::min(kMaxElementsPerCall, count - first));
    const void* chunk_send = send == recv ? MPI_IN_PLACE : offset_bytes(send, first * element);
    MPI_CHECK(MPI_Allreduce(chunk_send, offset_bytes(recv, first * element), chunk, type, reduction, comm_));
  }
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype, ReduceOp op) {
  check_reduction(Collective::reduce_scatter, dtype, op);
  check_reduce_scatter_buffers(send, recv, recv_count, dtype);
  count_reduce_scatter(recv_count, dtype);
  const size_t block_bytes = recv_count * comm_dtype_size(dtype);
  if (completed_alone(send, recv, block_bytes)) return;
  const int count = mpi_count(recv_count, name_, Collective::reduce_scatter);
  const bool in_place = recv == offset_bytes(send, static_cast<size_t>(rank_) * block_bytes);
  if (!in_place) {
    MPI_CHECK(MPI_Reduce_scatter_block(send, recv, count, mpi_datatype(dtype), mpi_op(dtype, op), comm_));
    return;
  }
  // MPI's in-place form reduces the whole buffer and leaves the result at its start, block 0,
  // not in this rank's block: move it there. The other blocks are unspecified afterwards (the
  // interface allows it), so no buffer of the block's size is needed.
  void* whole = const_cast<void*>(send);
  MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, whole, count, mpi_datatype(dtype), mpi_op(dtype, op), comm_));
  if (recv != whole) std::memmove(recv, whole, block_bytes);
}

void MpiCommunicator::all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) {
  check_all_gather_buffers(send, recv, send_count, dtype);
  count_all_gather(send_count, dtype);
  const size_t block_bytes = send_count * comm_dtype_size(dtype);
  if (completed_alone(send, recv, block_bytes)) return;
  const int count = mpi_count(send_count, name_, Collective::all_gather);
  const MPI_Datatype type = mpi_datatype(dtype);
  const bool in_place = send == offset_bytes(recv, static_cast<size_t>(rank_) * block_bytes);
  if (in_place) {
    MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, count, type, comm_));
  } else {
    MPI_CHECK(MPI_Allgather(send, count, type, recv, count, type, comm_));
  }
}

void MpiCommunicator::broadcast(void* buffer, size_t count, CommDtype dtype, int root) {
  check_root(root);
  count_broadcast(count, dtype, root);
  const size_t element = comm_dtype_size(dtype);
  if (completed_alone(buffer, buffer, count * element)) return;
  const MPI_Datatype type = mpi_datatype(dtype);
  for (size_t first = 0; first < count; first += kMaxElementsPerCall) {
    const int chunk = static_cast<int>(std::min(kMaxElementsPerCall, count - first));
    MPI_CHECK(MPI_Bcast(offset_bytes(buffer, first * element), chunk, type, root, comm_));
  }
}

void MpiCommunicator::all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) {
  check_all_to_all_buffers(send, recv, count_per_rank, dtype);
  count_all_to_all(count_per_rank, dtype);
  if (completed_alone(send, recv, count_per_rank * comm_dtype_size(dtype))) return;
  const int count = mpi_count(count_per_rank, name_, Collective::all_to_all);
  const MPI_Datatype type = mpi_datatype(dtype);
  MPI_CHECK(MPI_Alltoall(send, count, type, recv, count, type, comm_));
}

void MpiCommunicator::barrier() {
  count_barrier();
  if (size_ == 1) return;
  MPI_CHECK(MPI_Barrier(comm_));
}

}  // namespace fp8lm
