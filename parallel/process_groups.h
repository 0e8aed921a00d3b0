// Process groups in Megatron's layout, and MPI's lifetime.
//
// World size W = TP * DP. Tensor-parallel groups are consecutive ranks [k*TP, (k+1)*TP);
// data-parallel groups are strided: the ranks with equal rank % TP. For W = 8, TP = 2:
//   tp groups {0,1} {2,3} {4,5} {6,7}      dp groups {0,2,4,6} {1,3,5,7}
// so tp_rank = world_rank % TP and dp_rank = world_rank / TP.
//
// A single process started without mpirun never initializes MPI: MpiSession does nothing,
// detect_parallel_layout() returns a layout of one, and ProcessGroups builds groups of one rank
// whose collectives call neither MPI nor NCCL.
//
// Typical start of a GPU run:
//   MpiSession mpi;
//   ParallelLayout layout = detect_parallel_layout(options.tensor_model_parallel_size);
//   check_ranks_fit_gpus(layout, gpu_count);
//   cudaSetDevice(layout.local_rank);  // then create the four streams
//   ProcessGroups groups = ProcessGroups::create_gpu(layout, streams);
//   Watchdog watchdog(...); for (ncclComm_t c : groups.nccl_comms()) watchdog.watch(c);
// Destroy in reverse: the Watchdog, then ProcessGroups, then MpiSession (MPI_Finalize).
#pragma once

#include <memory>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "parallel/communicator.h"

namespace fp8lm {

// Whether the launcher started this process as a rank of an MPI job (mpirun/mpiexec of Open MPI
// or MPICH, srun with PMIx), read from the environment: OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK.
bool launched_by_mpi();

// Initializes MPI when launched_by_mpi() and MPI is not initialized yet; finalizes it at
// destruction if this session initialized it. Asks for MPI_THREAD_MULTIPLE: the Watchdog calls
// MPI_Abort from its own thread while the main thread may be inside a collective (with less, the
// Watchdog ends the process with _Exit instead, and the launcher ends the others).
class MpiSession {
 public:
  MpiSession();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  bool active() const { return active_; }  // MPI is initialized (by this session or before it)
  int thread_level() const { return thread_level_; }  // MPI_THREAD_*; meaningful when active()

  // For main's error path in a job of several ranks: ends every rank now (MPI_Abort) instead of
  // leaving the others in their next collective until their Watchdog fires. Without MPI: exit.
  [[noreturn]] void abort_job(int exit_code);

 private:
  bool active_ = false;
  bool initialized_here_ = false;
  int thread_level_ = 0;
};

struct ParallelLayout {
  int world_size = 1;
  int world_rank = 0;
  int tp_size = 1;
  int tp_rank = 0;
  int dp_size = 1;
  int dp_rank = 0;
  int local_rank = 0;  // among the ranks on this node
  int local_size = 1;
};

// The layout of world rank `world_rank`, with no MPI. InputError (one line naming the flag)
// when --tensor-model-parallel-size is < 1 or does not divide the world size.
ParallelLayout make_parallel_layout(int world_rank, int world_size, int tp_size, int local_rank = 0,
                                    int local_size = 1);
// From MPI_COMM_WORLD (node-local ranks through MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)), or a
// layout of one when MPI is not initialized.
ParallelLayout detect_parallel_layout(int tp_size);
// InputError when this node has more ranks than GPUs (fp8lm runs one rank per GPU).
void check_ranks_fit_gpus(const ParallelLayout& layout, int gpus_on_node);

// World ranks of this rank's groups, in group-rank order.
std::vector<int> tensor_parallel_group_ranks(const ParallelLayout& layout);
std::vector<int> data_parallel_group_ranks(const ParallelLayout& layout);

// One stream per NCCL communicator, owned by the caller and created on this rank's device.
struct NcclStreams {
  cudaStream_t world = nullptr;
  cudaStream_t tensor_parallel = nullptr;
  cudaStream_t data_parallel = nullptr;
  cudaStream_t data_parallel_background = nullptr;  // gradient/parameter traffic overlapped with compute
};

class ProcessGroups {
 public:
  // MPI communicators over host buffers (MPI_COMM_WORLD duplicated and split), or groups of
  // one without MPI. Collective: every rank calls it together.
  static ProcessGroups create_host(const ParallelLayout& layout);
  // NCCL communicators over device buffers, one per stream. The calling thread's current CUDA
  // device must be this rank's GPU. Collective: every rank calls it together.
  static ProcessGroups create_gpu(const ParallelLayout& layout, const NcclStreams& streams);

  ProcessGroups(ProcessGroups&&) noexcept;
  ProcessGroups& operator=(ProcessGroups&&) noexcept;
  ~ProcessGroups();

  const ParallelLayout& layout() const { return layout_; }
  Communicator& world() const { return *world_; }  // name "world"
  Communicator& tp() const { return *tp_; }        // name "tp"
  Communicator& dp() const { return *dp_; }        // name "dp"
  // The dp group again, as a communicator of its own (second NCCL communicator on its own
  // stream), so that overlapped gradient/parameter collectives never queue behind dp's.
  Communicator& dp_background() const { return *dp_background_; }  // name "dp_background"

  // The NCCL communicators, for Watchdog::watch; empty for host groups and groups of one.
  std::vector<ncclComm_t> nccl_comms() const;

 private:
  ProcessGroups() = default;

  ParallelLayout layout_;
  std::unique_ptr<Communicator> world_;
  std::unique_ptr<Communicator> tp_;
  std::unique_ptr<Communicator> dp_;
  std::unique_ptr<Communicator> dp_background_;
};

}  // namespace fp8lm
