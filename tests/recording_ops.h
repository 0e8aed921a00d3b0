// An Ops that records every op the model and the step call, in order, then forwards it to
// a real backend (layers/observed_ops.h). Tests use the log to pin the op sequence of a
// block (and, with the recording Communicator of parallel/, where each collective sits
// between the ops).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/observed_ops.h"

namespace fp8lm::testing {

class OpRecorder final : public OpObserver {
 public:
  explicit OpRecorder(std::vector<std::string>& log) : log_(log) {}
  void before(const OpEvent& event) override { log_.push_back(event.describe()); }

 private:
  std::vector<std::string>& log_;
};

inline std::unique_ptr<Ops> make_recording_ops(std::unique_ptr<Ops> inner, std::vector<std::string>& log) {
  return make_observed_ops(std::move(inner), std::make_unique<OpRecorder>(log));
}

}  // namespace fp8lm::testing
