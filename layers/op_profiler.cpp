#include "layers/op_profiler.h"

#include <algorithm>
#include <cstdio>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/logging.h"

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

void log_op_profile(const OpProfiler& profiler, double median_step_ms, const std::string& step_name, bool gpu) {
  const double steps = std::max(1, profiler.steps());
  const OpFloorModel floor = h100_floor_model();
  std::vector<OpClassProfile> rows = profiler.totals();
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
  auto fixed = [](double v, int digits) {
    char text[32];
    std::snprintf(text, sizeof text, "%.*f", digits, v);
    return std::string(text);
  };
  SettingsTable table;
  nlohmann::json classes = nlohmann::json::array();
  double total_ms = 0.0, total_floor_ms = 0.0;
  for (const OpClassProfile& row : rows) {
    if (row.calls == 0) continue;  // ran only before the profiled steps
    const double ms = row.ms / steps, flops = row.flops / steps, bytes = row.bytes / steps;
    const double floor_ms = floor.floor_ms(row) / steps;
    total_ms += ms;
    total_floor_ms += floor_ms;
    std::string cells = fixed(ms, 3) + " ms, " + fixed(100.0 * ms / median_step_ms, 1) + "% of the " + step_name + ", " +
                        fixed(row.calls / steps, 0) + " calls";
    if (flops > 0) cells += ", " + fixed(flops / (ms * 1e-3) / 1e12, 1) + " TFLOP/s";
    cells += ", " + fixed(bytes / (ms * 1e-3) / 1e9, 0) + " GB/s";
    if (gpu) cells += ", floor " + fixed(floor_ms, 3) + " ms (" + fixed(ms / std::max(floor_ms, 1e-9), 2) + "x)";
    table.push_back({row.op_class, cells});
    classes.push_back({{"class", row.op_class}, {"calls", row.calls / steps}, {"ms", ms}, {"flops", flops},
                       {"bytes", bytes}, {"floor_ms", floor_ms}});
  }
  table.push_back({"ops, all classes", fixed(total_ms, 3) + " ms of a " + fixed(median_step_ms, 3) +
                                           " ms " + step_name + (gpu ? ", floor " + fixed(total_floor_ms, 3) + " ms" : "")});
  if (gpu) table.push_back({"floor model", floor.source});
  log_settings_table("op profile per " + step_name + " (" + std::to_string(profiler.steps()) + " timed)", table);
  const nlohmann::json line = {{"op_profile", classes}, {"steps", profiler.steps()}, {"step", step_name}, {"step_ms", median_step_ms},
                               {"ops_ms", total_ms}, {"floor_ms", gpu ? total_floor_ms : 0.0}};
  std::printf("%s\n", line.dump().c_str());
}

}  // namespace fp8lm
