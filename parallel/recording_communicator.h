// A Communicator that appends one line per call to a shared log, then forwards the call to the
// communicator it wraps. Model tests interleave these lines with the ops' own recording to pin
// where each collective sits in a step. Lines, with xN the call's count argument:
//   "tp.all_reduce bf16 x1024 sum"          count
//   "tp.reduce_scatter f32 x512 sum"        recv_count
//   "dp.all_gather bf16 x512"               send_count
//   "world.broadcast f32 x10 root=0"        count
//   "tp.all_to_all u8 x16"                  count_per_rank
//   "world.barrier"
// The line is written before the call is forwarded, so a call that throws is still recorded.
// traffic() counts the calls made through this wrapper that returned (same rules as every
// Communicator).
#pragma once

#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace fp8lm {

class RecordingCommunicator final : public Communicator {
 public:
  // `inner` and `log` must outlive this object; several recorders may share one log.
  RecordingCommunicator(Communicator& inner, std::vector<std::string>& log) : inner_(inner), log_(log) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const std::string& name() const override { return inner_.name(); }
  Communicator& inner() { return inner_; }

  void all_reduce(const void* send, void* recv, size_t count, CommDtype dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_count, CommDtype dtype, ReduceOp op) override;
  void all_gather(const void* send, void* recv, size_t send_count, CommDtype dtype) override;
  void broadcast(void* buffer, size_t count, CommDtype dtype, int root) override;
  void all_to_all(const void* send, void* recv, size_t count_per_rank, CommDtype dtype) override;
  void barrier() override;

 private:
  void record(std::string line);

  Communicator& inner_;
  std::vector<std::string>& log_;
};

}  // namespace fp8lm
