#include "apps/fp8_statistics.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <cmath>
#include <cstdio>

namespace fp8lm {

Fp8TensorStatistics make_fp8_tensor_statistics(std::string name, Fp8Dtype dtype, double elements, double saturated,
                                               double underflow, double subnormal, float amax, float scale,
                                               int margin) {
  Fp8TensorStatistics s;
  s.name = std::move(name);
  s.dtype = dtype;
  s.elements = elements;
  const double per_element = elements > 0.0 ? 1.0 / elements : 0.0;
  s.saturated = saturated * per_element;
  s.underflow = underflow * per_element;
  s.subnormal = subnormal * per_element;
  s.amax = amax;
  s.scale = scale;
  // compute_scale's rule inverted: scale = fp8_max / amax / 2^margin.
  s.scale_amax = scale > 0.0f ? float(double(fp8_max(dtype)) / (double(scale) * std::ldexp(1.0, margin))) : 0.0f;
  return s;
}

nlohmann::json fp8_statistics_line(int64_t iteration, const Fp8TensorStatistics& s) {
  nlohmann::json line = {{"iter", iteration},
                         {"fp8_stats", s.name},
                         {"format", std::string(to_string(s.dtype))}};
  if (std::isnan(s.amax)) {
    line["amax"] = nullptr;
  } else {
    line["amax"] = s.amax;
  }
  line["scale_amax"] = s.scale_amax;
  line["scale"] = s.scale;
  line["saturated"] = s.saturated;
  line["underflow"] = s.underflow;
  line["subnormal"] = s.subnormal;
  line["elements"] = s.elements;
  return line;
}

namespace {

// "h.1.mlp.c_fc.grad_output 0.0123%, ..." for the `worst` largest values of `field` above 0.
std::string worst_by(const std::vector<Fp8TensorStatistics>& statistics, double Fp8TensorStatistics::*field,
                     int worst) {
  std::vector<const Fp8TensorStatistics*> ranked;
  for (const Fp8TensorStatistics& s : statistics)
    if (s.*field > 0.0) ranked.push_back(&s);
  // Stable, so equal fractions keep the table's (layer) order.
  std::stable_sort(ranked.begin(), ranked.end(),
                   [field](const Fp8TensorStatistics* a, const Fp8TensorStatistics* b) { return a->*field > b->*field; });
  if (ranked.empty()) return "none";
  std::string text;
  for (size_t i = 0; i < ranked.size() && i < size_t(std::max(worst, 0)); ++i) {
    char value[32];
    std::snprintf(value, sizeof value, "%.3g%%", 100.0 * ranked[i]->*field);
    if (!text.empty()) text += ", ";
    text += ranked[i]->name + " " + value;
  }
  return text;
}

}  // namespace

std::string fp8_statistics_summary(const std::vector<Fp8TensorStatistics>& statistics, int worst) {
  return "fp8 stats: " + std::to_string(statistics.size()) + " tensors | saturated: " +
         worst_by(statistics, &Fp8TensorStatistics::saturated, worst) +
         " | underflow: " + worst_by(statistics, &Fp8TensorStatistics::underflow, worst);
}

namespace {

// The block of a block operand's name ("h.12.attn.c_proj.input" -> 12), or -1.
int block_of(const std::string& name) {
  if (name.rfind("h.", 0) != 0) return -1;
  int block = 0;
  const char* begin = name.data() + 2;
  const char* end = name.data() + name.size();
  const auto [stop, error] = std::from_chars(begin, end, block);
  if (error != std::errc() || stop == begin || stop == end || *stop != '.') return -1;
  return block;
}

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g%%", 100.0 * fraction);
  return text;
}

}  // namespace

std::vector<BlockSwitch> blocks_to_switch(const std::vector<Fp8TensorStatistics>& statistics,
                                          const AutoPrecisionThresholds& thresholds) {
  std::map<int, BlockSwitch> first_reason;
  for (const Fp8TensorStatistics& s : statistics) {
    const int block = block_of(s.name);
    if (block < 0 || first_reason.count(block)) continue;
    // Strictly above: a threshold of 1 can never be exceeded.
    if (s.saturated > thresholds.saturation) {
      first_reason[block] = BlockSwitch{block, s.name, "saturated", s.saturated, thresholds.saturation};
    } else if (s.underflow > thresholds.underflow) {
      first_reason[block] = BlockSwitch{block, s.name, "underflow", s.underflow, thresholds.underflow};
    }
  }
  std::vector<BlockSwitch> switches;
  for (auto& [block, change] : first_reason) switches.push_back(std::move(change));
  return switches;
}

std::string describe_block_switch(const BlockSwitch& change) {
  return "block " + std::to_string(change.block) + " -> BF16 GEMMs: " + change.operand + " " + change.measure + " " +
         percent(change.fraction) + " > threshold " + percent(change.threshold);
}

}  // namespace fp8lm
