#include "layers/op_profiler.h"

#include <algorithm>
#include <string_view>

#include "core/error.h"

namespace fp8lm {

Ops::LaneEvent& OpProfiler::next_mark() {
  FP8LM_CHECK(backend_ != nullptr, "OpProfiler: not attached to a backend");
  if (marks_used_ == marks_.size()) marks_.push_back(backend_->make_timing_event());
  return *marks_[marks_used_++];
}

void OpProfiler::before(const OpEvent& event) {
  if (event.op_class == nullptr) return;
  const auto [found, inserted] = class_index_.try_emplace(event.op_class, int(totals_.size()));
  if (inserted) totals_.push_back(OpClassProfile{.op_class = event.op_class});
  step_ops_.push_back(TimedOp{.op_class = found->second, .start_mark = marks_used_, .cost = {}});
  backend_->record(next_mark(), event.lane);
}

void OpProfiler::after(const OpEvent& event) {
  if (event.op_class == nullptr) return;
  // Ops do not nest: the op ending is the last one begun.
  FP8LM_CHECK(!step_ops_.empty() && step_ops_.back().start_mark + 1 == marks_used_,
              "OpProfiler: ", event.op_class, " ended without its start");
  step_ops_.back().cost = event.cost();
  backend_->record(next_mark(), event.lane);
}

void OpProfiler::finish_step() {
  for (const TimedOp& op : step_ops_) {
    OpClassProfile& row = totals_[op.op_class];
    row.calls += 1.0;
    row.ms += backend_->elapsed_ms(*marks_[op.start_mark], *marks_[op.start_mark + 1]);
    row.flops += op.cost.flops;
    row.bytes += op.cost.bytes;
  }
  step_ops_.clear();
  marks_used_ = 0;
  ++steps_;
}

void OpProfiler::reset() {
  for (OpClassProfile& row : totals_) row = OpClassProfile{.op_class = row.op_class};
  step_ops_.clear();
  marks_used_ = 0;
  steps_ = 0;
}

double OpFloorModel::floor_ms(const OpClassProfile& row) const {
  const std::string_view name = row.op_class;
  double flops_per_s = 0.0;
  if (name.starts_with("gemm fp8")) flops_per_s = fp8_gemm_flops_per_s;
  if (name.starts_with("gemm bf16")) flops_per_s = bf16_gemm_flops_per_s;
  if (name.starts_with("attention")) flops_per_s = attention_flops_per_s;
  const double compute_s = flops_per_s > 0.0 ? row.flops / flops_per_s : 0.0;
  const double memory_s = bytes_per_s > 0.0 ? row.bytes / bytes_per_s : 0.0;
  return 1e3 * std::max(compute_s, memory_s);
}

OpFloorModel h100_floor_model() {
  return OpFloorModel{.fp8_gemm_flops_per_s = 1469e12,
                      .bf16_gemm_flops_per_s = 729e12,
                      .attention_flops_per_s = 400e12,
                      .bytes_per_s = 3.0e12,
                      .source = "H100 SXM: cuBLASLt 8192^3 FP8 1469 / BF16 729 TFLOP/s, attention 400 TFLOP/s, 3.0 TB/s"};
}

}  // namespace fp8lm
