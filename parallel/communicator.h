// One interface for the collectives of one process group (tensor-parallel, data-parallel or
// the world), with two implementations behind it:
//   MpiCommunicator  (parallel/mpi_communicator.h)  host buffers, blocking; CPU runs and CI.
//   NcclCommunicator (parallel/nccl_communicator.h) device buffers, enqueued on a CUDA stream.
// Both reduce BF16 and FP8 the same way: each partial sum (or max) of two values is rounded back
// to the type (round to nearest even; FP8 saturates to the format's max finite value, NaN stays
// NaN; BF16 overflows to infinity, as the GPU's BF16 add does). Max ignores a NaN operand when the other is a number, as
// CUDA's fmax/__hmax (which NCCL uses) do. There is deliberately no "average": NCCL's ncclAvg
// multiplies FP8 inputs by an FP8-rounded 1/N before summing; divide after the sum instead.
//
// A group of one rank never calls MPI or NCCL: every collective's result is its input, copied
// to recv where recv differs from send.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fp8lm {

enum class CommDtype : uint8_t { f32, f64, bf16, e4m3, e5m2, u8 };  // u8: raw bytes (no reduction)
enum class ReduceOp : uint8_t { sum, max };

std::string_view to_string(CommDtype dtype);
std::string_view to_string(ReduceOp op);
size_t comm_dtype_size(CommDtype dtype);  // bytes per element

enum class Collective : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, barrier };
inline constexpr size_t kCollectiveCount = 6;
std::string_view to_string(Collective collective);

struct CollectiveTraffic {
  uint64_t bytes_sent = 0;  // by this rank
  uint64_t calls = 0;
};

// Bytes this rank sent, per collective, counted with the ring algorithm's volume for a group of
// n ranks and a payload of B bytes (B: the full buffer of all_reduce and broadcast; the
// [n*count] buffer of reduce_scatter, all_gather and all_to_all):
//   all_reduce 2(n-1)/n * B (rounded down to whole bytes), reduce_scatter, all_gather and
//   all_to_all (n-1)/n * B, broadcast B on the root and 0 elsewhere, barrier 0.
// A group of one sends nothing; its calls are still counted.
struct CommTraffic {
  std::array<CollectiveTraffic, kCollectiveCount> per_collective{};

  const CollectiveTraffic& operator[](Collective collective) const {
    return per_collective[static_cast<size_t>(collective)];
  }
  CollectiveTraffic& operator[](Collective collective) { return per_collective[static_cast<size_t>(collective)]; }
  uint64_t total_bytes_sent() const;
  uint64_t total_calls() const;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // rank within the group
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // "tp", "dp", "world": used in logs, errors, recordings

  // Buffers live where the implementation says: host memory (MpiCommunicator) or device memory,
  // enqueued on the communicator's stream (NcclCommunicator). Counts are elements.
  // send [count] -> recv [count]; send == recv allowed.
  virtual void all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) = 0;
  // send [size*recv_count] -> recv [recv_count]: block `rank` of the reduction;
  // recv == send + rank*recv_count allowed (in place: no buffer of the result's size is needed,
  // which is how the distributed optimizer reduces its gradients in the model's slab); the other
  // blocks of send are then unspecified afterwards. Nothing outside send's [size*recv_count] is
  // touched.
  virtual void reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype, ReduceOp op) = 0;
  // send [send_count] -> recv [size*send_count], block i from rank i; send == recv + rank*send_count allowed
  // (in place: the weights are gathered in the model's working slab). Nothing outside recv is touched.
  virtual void all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) = 0;
  // buffer [count]: root's contents on every rank.
  virtual void broadcast(void* buffer, size_t count, CommDtype dtype, int root) = 0;
  // send, recv [size*count_per_rank], not overlapping: block j of send goes to rank j, block i of
  // recv came from rank i.
  virtual void all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) = 0;
  virtual void barrier() = 0;

  const CommTraffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = {}; }

 protected:
  // Each adds one call and the bytes this rank sends (see CommTraffic), from size() and rank().
  void count_all_reduce(size_t count, CommDtype dtype);
  void count_reduce_scatter(size_t recv_count, CommDtype dtype);
  void count_all_gather(size_t send_count, CommDtype dtype);
  void count_broadcast(size_t count, CommDtype dtype, int root);
  void count_all_to_all(size_t count_per_rank, CommDtype dtype);
  void count_barrier();

  // Argument checks shared by the implementations; they throw RuntimeError naming the group,
  // so that a misuse fails on every rank before any rank enters the collective.
  void check_reduction(Collective collective, CommDtype dtype, ReduceOp op) const;
  void check_root(int root) const;
  void check_all_reduce_buffers(const void* send, const void* recv, size_t count, CommDtype dtype) const;
  void check_reduce_scatter_buffers(const void* send, const void* recv, size_t recv_count, CommDtype dtype) const;
  void check_all_gather_buffers(const void* send, const void* recv, size_t send_count, CommDtype dtype) const;
  void check_all_to_all_buffers(const void* send, const void* recv, size_t count_per_rank, CommDtype dtype) const;

  // For a group of one rank: copies `bytes` from send to recv where they differ (copy_local)
  // and returns true, meaning the collective is complete. Returns false for larger groups.
  bool completed_alone(const void* send, void* recv, size_t bytes);
  // A copy within this rank's memory. Host memory here; device implementations override it.
  virtual void copy_local(void* dst, const void* src, size_t bytes);

 private:
  void add_traffic(Collective collective, uint64_t bytes_sent);

  CommTraffic traffic_;
};

}  // namespace fp8lm
