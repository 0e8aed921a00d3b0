// Collectives over an MPI communicator, on host buffers; every call blocks until this rank's
// part is done. The CPU engine and CI use it; NcclCommunicator is its GPU twin.
//
// BF16, E4M3 and E5M2 are MPI_BYTE-based types here (MPI has none of its own) reduced by
// user-defined MPI_Ops that decode both operands to FP32, add or max, and round back exactly as
// NCCL does on the GPU (see parallel/communicator.h). F32 and F64 sums use MPI_SUM; their max
// is a user op too, so that NaN behaves as NCCL's fmax does.
#pragma once

#include <memory>
#include <string>

#include <mpi.h>

#include "parallel/communicator.h"

namespace fp8lm {

enum class MpiCommOwnership : uint8_t {
  borrowed,  // the caller keeps the MPI_Comm valid while the communicator lives, and frees it
  owned,     // MPI_Comm_free at destruction (skipped when MPI is already finalized)
};

class MpiCommunicator final : public Communicator {
 public:
  // Sets MPI_ERRORS_RETURN on `comm`, so failures throw RuntimeError instead of aborting
  // inside MPI. MPI must be initialized.
  MpiCommunicator(MPI_Comm comm, std::string name, MpiCommOwnership ownership = MpiCommOwnership::borrowed);
  // A group of one rank that never calls MPI: usable when MPI was never initialized.
  static std::unique_ptr<MpiCommunicator> single_rank(std::string name);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm mpi_comm() const { return comm_; }  // MPI_COMM_NULL for single_rank

  void all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype, ReduceOp op) override;
  void all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) override;
  void broadcast(void* buffer, size_t count, CommDtype dtype, int root) override;
  void all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) override;
  void barrier() override;

 private:
  explicit MpiCommunicator(std::string name);  // single rank

  MPI_Comm comm_ = MPI_COMM_NULL;
  MpiCommOwnership ownership_ = MpiCommOwnership::borrowed;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
};

}  // namespace fp8lm
