#include "parallel/process_groups.h"

#include <cstdlib>

#include <mpi.h>

#include "core/error.h"
#include "parallel/mpi_check.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"

namespace fp8lm {

namespace {

bool mpi_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);  // allowed before MPI_Init
  return initialized != 0;
}

// An MPI_Comm freed at scope exit; for the communicators that only carry NCCL's set-up.
class ScopedMpiComm {
 public:
  ScopedMpiComm() = default;
  ~ScopedMpiComm() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  ScopedMpiComm(const ScopedMpiComm&) = delete;
  ScopedMpiComm& operator=(const ScopedMpiComm&) = delete;

  MPI_Comm comm = MPI_COMM_NULL;
};

// The four MPI communicators of a layout, in Megatron's arrangement. Every rank calls this
// together (MPI_Comm_dup and MPI_Comm_split are collective over MPI_COMM_WORLD).
struct MpiGroupComms {
  ScopedMpiComm world, tp, dp, dp_background;
};

void check_layout_matches_mpi(const ParallelLayout& layout) {
  int world_size = 0, world_rank = 0;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  FP8LM_CHECK(layout.world_size == world_size && layout.world_rank == world_rank, "layout of rank ",
              layout.world_rank, "/", layout.world_size, " does not match MPI's rank ", world_rank, "/", world_size);
}

void check_group_rank(MPI_Comm comm, int expected_rank, int expected_size, const char* group) {
  int rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  FP8LM_CHECK(rank == expected_rank && size == expected_size, group, " group: MPI gave rank ", rank, " of ", size,
              ", the layout says ", expected_rank, " of ", expected_size);
}

void split_mpi_groups(const ParallelLayout& layout, MpiGroupComms& comms) {
  check_layout_matches_mpi(layout);
  // A duplicate, so that fp8lm's messages never match anyone else's on MPI_COMM_WORLD, and so
  // that MPI_ERRORS_RETURN (set by MpiCommunicator) stays on fp8lm's communicators.
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comms.world.comm));
  // Color: which group; key: the rank within it.
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, layout.dp_rank, layout.tp_rank, &comms.tp.comm));
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, layout.tp_rank, layout.dp_rank, &comms.dp.comm));
  MPI_CHECK(MPI_Comm_dup(comms.dp.comm, &comms.dp_background.comm));
  check_group_rank(comms.tp.comm, layout.tp_rank, layout.tp_size, "tp");
  check_group_rank(comms.dp.comm, layout.dp_rank, layout.dp_size, "dp");
}

// Hands the communicator over to an owning MpiCommunicator.
std::unique_ptr<Communicator> owning_mpi_communicator(ScopedMpiComm& scoped, const char* name) {
  auto communicator = std::make_unique<MpiCommunicator>(scoped.comm, name, MpiCommOwnership::owned);
  scoped.comm = MPI_COMM_NULL;
  return communicator;
}

}  // namespace

// ---- launch and MPI lifetime

bool launched_by_mpi() {
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(variable) != nullptr) return true;
  }
  return false;
}

MpiSession::MpiSession() {
  if (mpi_initialized()) {  // a test harness or an embedding program owns MPI
    active_ = true;
    MPI_CHECK(MPI_Query_thread(&thread_level_));
    return;
  }
  if (!launched_by_mpi()) return;
  MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level_));
  active_ = true;
  initialized_here_ = true;
  if (thread_level_ < MPI_THREAD_FUNNELED) {
    throw RuntimeError("MPI provides thread level " + std::to_string(thread_level_) +
                           "; fp8lm needs MPI_THREAD_FUNNELED or higher (its watchdog thread runs beside MPI)",
                       "use an MPI built with thread support (Open MPI 4 and MPICH 3 have it)");
  }
}

MpiSession::~MpiSession() {
  if (!initialized_here_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void MpiSession::abort_job(int exit_code) {
  if (active_) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::exit(exit_code);
}

// ---- layout

ParallelLayout make_parallel_layout(int world_rank, int world_size, int tp_size, int local_rank, int local_size) {
  FP8LM_CHECK(world_size >= 1 && world_rank >= 0 && world_rank < world_size, "world rank ", world_rank, " of ",
              world_size);
  FP8LM_CHECK(local_size >= 1 && local_rank >= 0 && local_rank < local_size, "local rank ", local_rank, " of ",
              local_size);
  FP8LM_INPUT_CHECK(tp_size >= 1, "--tensor-model-parallel-size must be >= 1 (got ", tp_size, ")");
  if (world_size % tp_size != 0) {
    throw InputError(detail::concat("--tensor-model-parallel-size ", tp_size, " does not divide the world size ",
                                    world_size),
                     detail::concat("launch a multiple of ", tp_size, " processes (mpirun -np ", tp_size,
                                    "*N), or choose a tensor-parallel size that divides ", world_size));
  }
  ParallelLayout layout;
  layout.world_size = world_size;
  layout.world_rank = world_rank;
  layout.tp_size = tp_size;
  layout.tp_rank = world_rank % tp_size;
  layout.dp_size = world_size / tp_size;
  layout.dp_rank = world_rank / tp_size;
  layout.local_rank = local_rank;
  layout.local_size = local_size;
  return layout;
}

ParallelLayout detect_parallel_layout(int tp_size) {
  if (!mpi_initialized()) return make_parallel_layout(0, 1, tp_size);
  int world_size = 0, world_rank = 0;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  ScopedMpiComm node;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node.comm));
  int local_size = 0, local_rank = 0;
  MPI_CHECK(MPI_Comm_size(node.comm, &local_size));
  MPI_CHECK(MPI_Comm_rank(node.comm, &local_rank));
  return make_parallel_layout(world_rank, world_size, tp_size, local_rank, local_size);
}

void check_ranks_fit_gpus(const ParallelLayout& layout, int gpus_on_node) {
  if (layout.local_size <= gpus_on_node) return;
  throw InputError(detail::concat(layout.local_size, " ranks run on the node of rank ", layout.world_rank,
                                  " but it has ", gpus_on_node, " GPU", gpus_on_node == 1 ? "" : "s",
                                  ": fp8lm runs one rank per GPU"),
                   gpus_on_node == 0 ? std::string("run on a node with GPUs, or without mpirun on the CPU")
                                     : detail::concat("start at most ", gpus_on_node,
                                                      " processes per node (mpirun --npernode ", gpus_on_node, ")"));
}

std::vector<int> tensor_parallel_group_ranks(const ParallelLayout& layout) {
  std::vector<int> ranks;
  for (int tp_rank = 0; tp_rank < layout.tp_size; ++tp_rank) ranks.push_back(layout.dp_rank * layout.tp_size + tp_rank);
  return ranks;
}

std::vector<int> data_parallel_group_ranks(const ParallelLayout& layout) {
  std::vector<int> ranks;
  for (int dp_rank = 0; dp_rank < layout.dp_size; ++dp_rank) ranks.push_back(dp_rank * layout.tp_size + layout.tp_rank);
  return ranks;
}

// ---- groups

ProcessGroups::ProcessGroups(ProcessGroups&&) noexcept = default;
ProcessGroups& ProcessGroups::operator=(ProcessGroups&&) noexcept = default;
ProcessGroups::~ProcessGroups() = default;

ProcessGroups ProcessGroups::create_host(const ParallelLayout& layout) {
  ProcessGroups groups;
  groups.layout_ = layout;
  if (!mpi_initialized()) {
    FP8LM_CHECK(layout.world_size == 1, "a layout of ", layout.world_size, " ranks needs MPI (start with mpirun)");
    groups.world_ = MpiCommunicator::single_rank("world");
    groups.tp_ = MpiCommunicator::single_rank("tp");
    groups.dp_ = MpiCommunicator::single_rank("dp");
    groups.dp_background_ = MpiCommunicator::single_rank("dp_background");
    return groups;
  }
  MpiGroupComms comms;
  split_mpi_groups(layout, comms);
  groups.world_ = owning_mpi_communicator(comms.world, "world");
  groups.tp_ = owning_mpi_communicator(comms.tp, "tp");
  groups.dp_ = owning_mpi_communicator(comms.dp, "dp");
  groups.dp_background_ = owning_mpi_communicator(comms.dp_background, "dp_background");
  return groups;
}

ProcessGroups ProcessGroups::create_gpu(const ParallelLayout& layout, const NcclStreams& streams) {
  ProcessGroups groups;
  groups.layout_ = layout;
  if (!mpi_initialized()) {
    FP8LM_CHECK(layout.world_size == 1, "a layout of ", layout.world_size, " ranks needs MPI (start with mpirun)");
    groups.world_ = NcclCommunicator::single_rank("world", streams.world);
    groups.tp_ = NcclCommunicator::single_rank("tp", streams.tensor_parallel);
    groups.dp_ = NcclCommunicator::single_rank("dp", streams.data_parallel);
    groups.dp_background_ = NcclCommunicator::single_rank("dp_background", streams.data_parallel_background);
    return groups;
  }
  // The MPI communicators only carry the NCCL ids; they are freed when this returns.
  MpiGroupComms comms;
  split_mpi_groups(layout, comms);
  MPI_CHECK(MPI_Comm_set_errhandler(comms.world.comm, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_set_errhandler(comms.tp.comm, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_set_errhandler(comms.dp.comm, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_set_errhandler(comms.dp_background.comm, MPI_ERRORS_RETURN));
  // Every rank creates them in this order, so no rank waits in one group's initialization for a
  // peer that is initializing another.
  groups.world_ = NcclCommunicator::create(comms.world.comm, "world", streams.world);
  groups.tp_ = NcclCommunicator::create(comms.tp.comm, "tp", streams.tensor_parallel);
  groups.dp_ = NcclCommunicator::create(comms.dp.comm, "dp", streams.data_parallel);
  groups.dp_background_ =
      NcclCommunicator::create(comms.dp_background.comm, "dp_background", streams.data_parallel_background);
  return groups;
}

std::vector<ncclComm_t> ProcessGroups::nccl_comms() const {
  std::vector<ncclComm_t> handles;
  for (const Communicator* communicator : {world_.get(), tp_.get(), dp_.get(), dp_background_.get()}) {
    const auto* nccl = dynamic_cast<const NcclCommunicator*>(communicator);
    if (nccl != nullptr && nccl->handle() != nullptr) handles.push_back(nccl->handle());
  }
  return handles;
}

}  // namespace fp8lm
