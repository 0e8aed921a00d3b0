// Collectives over an NCCL communicator, on device buffers: every call is enqueued on the CUDA
// stream given at construction and returns before the data has moved. The caller owns that
// stream, orders its own work against it (events), and synchronizes before reading results on
// the host. barrier() is the exception: it waits for the stream (see below).
//
// The communicator is created in blocking mode (calls return once enqueued; NCCL init returns
// once every rank joined). Another thread may end it at any time with ncclCommAbort on handle():
// the Watchdog does that when a peer hangs or NCCL reports an asynchronous error.
#pragma once

#include <memory>
#include <string>

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include "parallel/communicator.h"

namespace fp8lm {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `group`: every rank of it calls this together. Group rank 0 makes the NCCL
  // unique id and MPI broadcasts it. The communicator uses the calling thread's current CUDA
  // device (one GPU per rank). A group of one makes no NCCL communicator (see single_rank).
  static std::unique_ptr<NcclCommunicator> create(MPI_Comm group, std::string name, cudaStream_t stream);
  // A group of one rank that calls neither MPI nor NCCL: collectives are device copies on `stream`.
  static std::unique_ptr<NcclCommunicator> single_rank(std::string name, cudaStream_t stream);
  ~NcclCommunicator() override;  // ncclCommDestroy, unless aborted
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  ncclComm_t handle() const { return comm_; }  // nullptr for a group of one
  cudaStream_t stream() const { return stream_; }

  // Ends every operation in flight (on this rank) and frees the NCCL communicator; the object
  // is unusable afterwards. For error paths: a job that aborts one rank must end all ranks.
  void abort();

  void all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype, ReduceOp op) override;
  void all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) override;
  void broadcast(void* buffer, size_t count, CommDtype dtype, int root) override;
  // One ncclGroupStart/End holding an ncclSend and an ncclRecv per peer (itself included).
  void all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) override;
  // A one-element all-reduce on the stream, then cudaStreamSynchronize: returns on the host once
  // every rank's stream reached the barrier (and all work enqueued before it finished).
  void barrier() override;

 protected:
  void copy_local(void* dst, const void* src, size_t bytes) override;  // cudaMemcpyAsync on the stream

 private:
  NcclCommunicator(std::string name, cudaStream_t stream);
  void check_usable(const char* collective) const;

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  bool aborted_ = false;
  std::string name_;
  float* barrier_scratch_ = nullptr;  // [1] on the device, for barrier()
};

}  // namespace fp8lm
