#include "parallel/recording_communicator.h"

#include <utility>

#include "core/error.h"

namespace fp8lm {

void RecordingCommunicator::record(std::string line) { log_.push_back(std::move(line)); }

void RecordingCommunicator::all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) {
  record(detail::concat(name(), ".all_reduce ", to_string(dtype), " x", count, " ", to_string(op)));
  inner_.all_reduce(send, recv, count, dtype, op);
  count_all_reduce(count, dtype);
}

void RecordingCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype,
                                           ReduceOp op) {
  record(detail::concat(name(), ".reduce_scatter ", to_string(dtype), " x", recv_count, " ", to_string(op)));
  inner_.reduce_scatter(send, recv, recv_count, dtype, op);
  count_reduce_scatter(recv_count, dtype);
}

void RecordingCommunicator::all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) {
  record(detail::concat(name(), ".all_gather ", to_string(dtype), " x", send_count));
  inner_.all_gather(send, recv, send_count, dtype);
  count_all_gather(send_count, dtype);
}

void RecordingCommunicator::broadcast(void* buffer, size_t count, CommDtype dtype, int root) {
  record(detail::concat(name(), ".broadcast ", to_string(dtype), " x", count, " root=", root));
  inner_.broadcast(buffer, count, dtype, root);
  count_broadcast(count, dtype, root);
}

void RecordingCommunicator::all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) {
  record(detail::concat(name(), ".all_to_all ", to_string(dtype), " x", count_per_rank));
  inner_.all_to_all(send, recv, count_per_rank, dtype);
  count_all_to_all(count_per_rank, dtype);
}

void RecordingCommunicator::barrier() {
  record(name() + ".barrier");
  inner_.barrier();
  count_barrier();
}

}  // namespace fp8lm
