// --profile-ops: the time of every op class of a training step, measured on the backend's
// own clock (CUDA events on the GPU: a mark before and after each op, so the time between
// ops, such as a launch gap or a collective, is not counted against either), beside what
// each op moves and computes (OpCost, layers/observed_ops.h). The profile of a step is
// collected after the step, which waits for the device: profile synchronised (--benchmark)
// steps only.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "layers/observed_ops.h"

namespace fp8lm {

// One op class summed over the profiled steps.
struct OpClassProfile {
  std::string op_class;  // "gemm fp8 forward", "attention backward", ...
  double calls = 0.0;
  double ms = 0.0;
  double flops = 0.0;
  double bytes = 0.0;
};

class OpProfiler final : public OpObserver {
 public:
  void attach(Ops& backend) override { backend_ = &backend; }
  void before(const OpEvent& event) override;
  void after(const OpEvent& event) override;

  // Waits for the marks of the ops since the last call and adds their times to the totals,
  // as one more profiled step.
  void finish_step();
  // Forgets the totals (the warm-up steps), and any marks not yet finished.
  void reset();
  int steps() const { return steps_; }
  // The totals, one row per class, in the order the classes first ran.
  const std::vector<OpClassProfile>& totals() const { return totals_; }

 private:
  struct TimedOp {
    int op_class;  // index into totals_
    size_t start_mark;
    OpCost cost;
  };
  Ops::LaneEvent& next_mark();

  Ops* backend_ = nullptr;
  std::vector<std::unique_ptr<Ops::LaneEvent>> marks_;  // reused every step
  size_t marks_used_ = 0;
  std::vector<TimedOp> step_ops_;
  std::vector<OpClassProfile> totals_;
  std::unordered_map<std::string, int> class_index_;
  int steps_ = 0;
};

// The hardware a profile is held against: the floor of an op class is the larger of its
// FLOPs at the class's compute ceiling and its bytes at the memory bandwidth.
struct OpFloorModel {
  double fp8_gemm_flops_per_s = 0.0;
  double bf16_gemm_flops_per_s = 0.0;
  double attention_flops_per_s = 0.0;
  double bytes_per_s = 0.0;
  const char* source = "";
  double floor_ms(const OpClassProfile& row) const;
};

// One H100 SXM as measured on the device machines (docs/PERFORMANCE.md): cuBLASLt at
// 8192^3 (FP8 1469, BF16 729 TFLOP/s), flash attention at 400 TFLOP/s (FlashAttention-3's
// class on Hopper), device memory at 3.0 TB/s (a device-to-device copy, read + write).
OpFloorModel h100_floor_model();

// Logs the profile per op class, per `step_name` ("step", "decode step") of `step_ms`: time,
// share of the step, calls, TFLOP/s, GB/s and (on the GPU) the floor, sorted by time; and
// prints it as one JSON line ({"op_profile": [...], ...}) on stdout.
void log_op_profile(const OpProfiler& profiler, double step_ms, const std::string& step_name, bool gpu);

}  // namespace fp8lm
