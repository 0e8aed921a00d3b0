#include "parallel/communicator.h"

#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace fp8lm {

std::string_view to_string(CommDtype dtype) {
  switch (dtype) {
    case CommDtype::f32: return "f32";
    case CommDtype::f64: return "f64";
    case CommDtype::bf16: return "bf16";
    case CommDtype::e4m3: return "e4m3";
    case CommDtype::e5m2: return "e5m2";
    case CommDtype::u8: return "u8";
  }
  return "?";
}

std::string_view to_string(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

size_t comm_dtype_size(CommDtype dtype) {
  switch (dtype) {
    case CommDtype::f32: return 4;
    case CommDtype::f64: return 8;
    case CommDtype::bf16: return 2;
    case CommDtype::e4m3:
    case CommDtype::e5m2:
    case CommDtype::u8: return 1;
  }
  throw RuntimeError("comm_dtype_size: unknown CommDtype " + std::to_string(static_cast<int>(dtype)));
}

std::string_view to_string(Collective collective) {
  switch (collective) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::broadcast: return "broadcast";
    case Collective::all_to_all: return "all_to_all";
    case Collective::barrier: return "barrier";
  }
  return "?";
}

uint64_t CommTraffic::total_bytes_sent() const {
  uint64_t total = 0;
  for (const CollectiveTraffic& t : per_collective) total += t.bytes_sent;
  return total;
}

uint64_t CommTraffic::total_calls() const {
  uint64_t total = 0;
  for (const CollectiveTraffic& t : per_collective) total += t.calls;
  return total;
}

// ---- traffic

void Communicator::add_traffic(Collective collective, uint64_t bytes_sent) {
  CollectiveTraffic& t = traffic_[collective];
  t.bytes_sent += bytes_sent;
  t.calls += 1;
}

void Communicator::count_all_reduce(size_t count, CommDtype dtype) {
  const uint64_t n = static_cast<uint64_t>(size());
  const uint64_t bytes = count * comm_dtype_size(dtype);
  // Ring: a reduce-scatter then an all-gather, each sending n-1 of the n chunks.
  add_traffic(Collective::all_reduce, 2 * (n - 1) * bytes / n);
}

void Communicator::count_reduce_scatter(size_t recv_count, CommDtype dtype) {
  const uint64_t n = static_cast<uint64_t>(size());
  add_traffic(Collective::reduce_scatter, (n - 1) * recv_count * comm_dtype_size(dtype));
}

void Communicator::count_all_gather(size_t send_count, CommDtype dtype) {
  const uint64_t n = static_cast<uint64_t>(size());
  add_traffic(Collective::all_gather, (n - 1) * send_count * comm_dtype_size(dtype));
}

void Communicator::count_broadcast(size_t count, CommDtype dtype, int root) {
  const bool sends = size() > 1 && rank() == root;
  add_traffic(Collective::broadcast, sends ? count * comm_dtype_size(dtype) : 0);
}

void Communicator::count_all_to_all(size_t count_per_rank, CommDtype dtype) {
  const uint64_t n = static_cast<uint64_t>(size());
  add_traffic(Collective::all_to_all, (n - 1) * count_per_rank * comm_dtype_size(dtype));
}

void Communicator::count_barrier() { add_traffic(Collective::barrier, 0); }

// ---- argument checks

namespace {

struct ByteRange {
  uintptr_t begin;
  uintptr_t end;
};

ByteRange range_of(const void* p, size_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  return {begin, begin + bytes};
}

bool overlap(ByteRange a, ByteRange b) { return a.begin < b.end && b.begin < a.end; }

}  // namespace

void Communicator::check_reduction(Collective collective, CommDtype dtype, ReduceOp op) const {
  if (dtype == CommDtype::u8) {
    throw RuntimeError(detail::concat(name(), ".", to_string(collective), ": u8 is raw bytes and has no ",
                                      to_string(op), " reduction"),
                       "reduce f32, f64, bf16, e4m3 or e5m2; u8 is for all_gather, broadcast and all_to_all");
  }
  if (op != ReduceOp::sum && op != ReduceOp::max) {
    throw RuntimeError(detail::concat(name(), ".", to_string(collective), ": unknown ReduceOp ", static_cast<int>(op)));
  }
}

void Communicator::check_root(int root) const {
  if (root < 0 || root >= size()) {
    throw RuntimeError(detail::concat(name(), ".broadcast: root ", root, " is not a rank of this group of ", size()));
  }
}

void Communicator::check_all_reduce_buffers(const void* send, const void* recv, size_t count, CommDtype dtype) const {
  const size_t bytes = count * comm_dtype_size(dtype);
  if (send != recv && overlap(range_of(send, bytes), range_of(recv, bytes))) {
    throw RuntimeError(detail::concat(name(), ".all_reduce: send and recv overlap without being the same buffer"));
  }
}

void Communicator::check_reduce_scatter_buffers(const void* send, const void* recv, size_t recv_count,
                                                CommDtype dtype) const {
  const size_t block = recv_count * comm_dtype_size(dtype);
  const void* own_block = static_cast<const char*>(send) + static_cast<size_t>(rank()) * block;
  if (recv != own_block && overlap(range_of(send, block * size()), range_of(recv, block))) {
    throw RuntimeError(detail::concat(name(), ".reduce_scatter: recv overlaps send but is not send + rank*recv_count"));
  }
}

void Communicator::check_all_gather_buffers(const void* send, const void* recv, size_t send_count,
                                            CommDtype dtype) const {
  const size_t block = send_count * comm_dtype_size(dtype);
  const void* own_block = static_cast<const char*>(recv) + static_cast<size_t>(rank()) * block;
  if (send != own_block && overlap(range_of(send, block), range_of(recv, block * size()))) {
    throw RuntimeError(detail::concat(name(), ".all_gather: send overlaps recv but is not recv + rank*send_count"));
  }
}

void Communicator::check_all_to_all_buffers(const void* send, const void* recv, size_t count_per_rank,
                                            CommDtype dtype) const {
  const size_t bytes = count_per_rank * comm_dtype_size(dtype) * size();
  if (bytes > 0 && overlap(range_of(send, bytes), range_of(recv, bytes))) {
    throw RuntimeError(detail::concat(name(), ".all_to_all: send and recv overlap; all_to_all is out of place only"));
  }
}

// ---- a group of one

bool Communicator::completed_alone(const void* send, void* recv, size_t bytes) {
  if (size() != 1) return false;
  if (send != recv && bytes > 0) copy_local(recv, send, bytes);
  return true;
}

void Communicator::copy_local(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

}  // namespace fp8lm
