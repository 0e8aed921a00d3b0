#include "parallel/nccl_communicator.h"

#include "core/error.h"
#include "parallel/mpi_check.h"
#include "parallel/nccl_check.h"

namespace fp8lm {

namespace {

ncclDataType_t nccl_datatype(CommDtype dtype) {
  switch (dtype) {
    case CommDtype::f32: return ncclFloat32;
    case CommDtype::f64: return ncclFloat64;
    case CommDtype::bf16: return ncclBfloat16;
    case CommDtype::e4m3: return ncclFloat8e4m3;
    case CommDtype::e5m2: return ncclFloat8e5m2;
    case CommDtype::u8: return ncclUint8;
  }
  throw RuntimeError("nccl_datatype: unknown CommDtype");
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclMax; }

const char* offset_bytes(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }
char* offset_bytes(void* base, size_t bytes) { return static_cast<char*>(base) + bytes; }

// What group rank 0 broadcasts: the id, or that making it failed (then every rank throws
// instead of the others waiting in ncclCommInitRankConfig for a rank that gave up).
struct UniqueIdMessage {
  ncclResult_t status;
  ncclUniqueId id;
};

}  // namespace

NcclCommunicator::NcclCommunicator(std::string name, cudaStream_t stream) : stream_(stream), name_(std::move(name)) {}

std::unique_ptr<NcclCommunicator> NcclCommunicator::single_rank(std::string name, cudaStream_t stream) {
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(name), stream));
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(MPI_Comm group, std::string name, cudaStream_t stream) {
  std::unique_ptr<NcclCommunicator> communicator(new NcclCommunicator(std::move(name), stream));
  MPI_CHECK(MPI_Comm_rank(group, &communicator->rank_));
  MPI_CHECK(MPI_Comm_size(group, &communicator->size_));
  if (communicator->size_ == 1) return communicator;

  UniqueIdMessage message{};
  if (communicator->rank_ == 0) message.status = ncclGetUniqueId(&message.id);
  MPI_CHECK(MPI_Bcast(&message, sizeof message, MPI_BYTE, 0, group));
  if (message.status != ncclSuccess) {
    detail::throw_nccl_error(("ncclGetUniqueId on rank 0 of group " + communicator->name_).c_str(), __FILE__, __LINE__,
                             message.status);
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  config.commName = communicator->name_.c_str();
  ncclComm_t handle = nullptr;
  NCCL_CHECK(ncclCommInitRankConfig(&handle, communicator->size_, message.id, communicator->rank_, &config));
  communicator->comm_ = handle;

  CUDA_CHECK(cudaMalloc(&communicator->barrier_scratch_, sizeof(float)));
  CUDA_CHECK(cudaMemsetAsync(communicator->barrier_scratch_, 0, sizeof(float), stream));
  return communicator;
}

NcclCommunicator::~NcclCommunicator() {
  // Errors are ignored: a destructor cannot report them, and the job is ending either way.
  if (comm_ != nullptr && !aborted_) ncclCommDestroy(comm_);
  if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
}

void NcclCommunicator::abort() {
  if (comm_ == nullptr || aborted_) return;
  aborted_ = true;
  NCCL_CHECK(ncclCommAbort(comm_));
}

void NcclCommunicator::check_usable(const char* collective) const {
  if (aborted_) throw RuntimeError(detail::concat(name_, ".", collective, ": the NCCL communicator was aborted"));
}

void NcclCommunicator::copy_local(void* dst, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
}

void NcclCommunicator::all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) {
  check_usable("all_reduce");
  check_reduction(Collective::all_reduce, dtype, op);
  check_all_reduce_buffers(send, recv, count, dtype);
  count_all_reduce(count, dtype);
  if (completed_alone(send, recv, count * comm_dtype_size(dtype))) return;
  NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_datatype(dtype), nccl_op(op), comm_, stream_));
}

void NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype, ReduceOp op) {
  check_usable("reduce_scatter");
  check_reduction(Collective::reduce_scatter, dtype, op);
  check_reduce_scatter_buffers(send, recv, recv_count, dtype);
  count_reduce_scatter(recv_count, dtype);
  if (completed_alone(send, recv, recv_count * comm_dtype_size(dtype))) return;
  NCCL_CHECK(ncclReduceScatter(send, recv, recv_count, nccl_datatype(dtype), nccl_op(op), comm_, stream_));
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) {
  check_usable("all_gather");
  check_all_gather_buffers(send, recv, send_count, dtype);
  count_all_gather(send_count, dtype);
  if (completed_alone(send, recv, send_count * comm_dtype_size(dtype))) return;
  NCCL_CHECK(ncclAllGather(send, recv, send_count, nccl_datatype(dtype), comm_, stream_));
}

void NcclCommunicator::broadcast(void* buffer, size_t count, CommDtype dtype, int root) {
  check_usable("broadcast");
  check_root(root);
  count_broadcast(count, dtype, root);
  if (completed_alone(buffer, buffer, count * comm_dtype_size(dtype))) return;
  NCCL_CHECK(ncclBroadcast(buffer, buffer, count, nccl_datatype(dtype), root, comm_, stream_));
}

void NcclCommunicator::all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) {
  check_usable("all_to_all");
  check_all_to_all_buffers(send, recv, count_per_rank, dtype);
  count_all_to_all(count_per_rank, dtype);
  const size_t block_bytes = count_per_rank * comm_dtype_size(dtype);
  if (completed_alone(send, recv, block_bytes)) return;
  const ncclDataType_t type = nccl_datatype(dtype);
  NCCL_CHECK(ncclGroupStart());
  // The group must be closed even when a send or receive is refused, or NCCL stays in group mode.
  ncclResult_t first_failure = ncclSuccess;
  for (int peer = 0; peer < size_; ++peer) {
    const size_t offset = static_cast<size_t>(peer) * block_bytes;
    const ncclResult_t sent = ncclSend(offset_bytes(send, offset), count_per_rank, type, peer, comm_, stream_);
    const ncclResult_t received = ncclRecv(offset_bytes(recv, offset), count_per_rank, type, peer, comm_, stream_);
    if (first_failure == ncclSuccess) first_failure = sent != ncclSuccess ? sent : received;
  }
  const ncclResult_t ended = ncclGroupEnd();
  if (first_failure != ncclSuccess) {
    detail::throw_nccl_error("ncclSend/ncclRecv (all_to_all)", __FILE__, __LINE__, first_failure);
  }
  if (ended != ncclSuccess) detail::throw_nccl_error("ncclGroupEnd() (all_to_all)", __FILE__, __LINE__, ended);
}

void NcclCommunicator::barrier() {
  check_usable("barrier");
  count_barrier();
  if (size_ > 1) {
    NCCL_CHECK(ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace fp8lm
