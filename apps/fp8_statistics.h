// FP8 tensor statistics (--fp8-stats-interval N, docs/NUMERICS.md): per FP8 operand, what
// the casts of one training step did to its values, as the metrics file's JSONL lines and
// the log's summary. The counting itself happens where the casts happen (core/fp8_stats.h,
// Ops::set_fp8_statistics); the engine collects the counts of a step (TrainingEngine::
// fp8_statistics) and the trainer reports them here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/fp8.h"

namespace fp8lm {

// One FP8 operand (a scaling state) over one step, summed over every rank of the run.
struct Fp8TensorStatistics {
  std::string name;           // the scaling state: "h.3.mlp.c_fc.input", ".weight", ".grad_output", "lm_head.*"
  Fp8Dtype dtype = Fp8Dtype::e4m3;
  double elements = 0.0;      // values quantized over the step, every rank (a replicated tensor counts per rank)
  double saturated = 0.0;     // fractions of `elements` (core/fp8_stats.h for the definitions)
  double underflow = 0.0;
  double subnormal = 0.0;
  float amax = 0.0f;          // max |x| over the step's casts, every rank; NaN if any value was NaN
  float scale = 0.0f;         // the scale of the last cast (this rank's)
  float scale_amax = 0.0f;    // the amax that scale maps onto the format's max: fp8_max / (scale 2^margin)
};

// A record from one state's counts, summed over the ranks (integers held exactly in doubles).
Fp8TensorStatistics make_fp8_tensor_statistics(std::string name, Fp8Dtype dtype, double elements, double saturated,
                                               double underflow, double subnormal, float amax, float scale,
                                               int margin);

// The metrics file's line for one operand:
//   {"iter":100,"fp8_stats":"h.3.mlp.c_fc.input","format":"e4m3","amax":..,"scale_amax":..,
//    "scale":..,"saturated":..,"underflow":..,"subnormal":..,"elements":..}
// A NaN amax is written as null (JSON has no NaN).
nlohmann::json fp8_statistics_line(int64_t iteration, const Fp8TensorStatistics& statistics);

// The log's one-line summary: how many operands, and the `worst` operands by saturated and
// by underflow fraction (those above 0), e.g.
//   "fp8 stats: 36 tensors | saturated: h.1.mlp.c_fc.grad_output 0.0123%, ... | underflow: ..."
std::string fp8_statistics_summary(const std::vector<Fp8TensorStatistics>& statistics, int worst = 3);

// --fp8-auto-precision's rule: a block is switched to BF16 GEMMs when one of its FP8 operands
// has more than `saturation` of its elements saturated, or more than `underflow` of them
// flushed to zero, over a step.
struct AutoPrecisionThresholds {
  double saturation = 1e-4;
  double underflow = 0.01;
};

// Why a block switched: the first of its operands (in scaling-table order) over a threshold.
struct BlockSwitch {
  int block = -1;
  std::string operand;    // "h.3.mlp.c_fc.grad_output"
  std::string measure;    // "saturated" or "underflow"
  double fraction = 0.0;  // the measured fraction
  double threshold = 0.0;
};

// The blocks to switch, in block order, one entry each. Only block operands ("h.N.*") count;
// the LM head's are left alone. The statistics are summed over every rank, so every rank
// decides the same.
std::vector<BlockSwitch> blocks_to_switch(const std::vector<Fp8TensorStatistics>& statistics,
                                          const AutoPrecisionThresholds& thresholds);

// The log line for one switch:
//   "block 3 -> BF16 GEMMs: h.3.mlp.c_fc.grad_output saturated 0.0123% > threshold 0.01%"
std::string describe_block_switch(const BlockSwitch& change);

}  // namespace fp8lm
