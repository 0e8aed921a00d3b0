#include "optim/batch_rampup.h"

#include <string>

#include "core/error.h"

namespace fp8lm {

namespace {

int64_t increments(const BatchRampup& rampup) { return (rampup.global_batch - rampup.start) / rampup.increment; }

}  // namespace

void validate_batch_rampup(const BatchRampup& rampup, int64_t sequences_per_micro_step) {
  const std::string flag = "--rampup-batch-size " + std::to_string(rampup.start) + " " +
                           std::to_string(rampup.increment) + " " + std::to_string(rampup.samples);
  // SAMPLES = 0 would divide by zero in Megatron's calculator: refused here.
  FP8LM_INPUT_CHECK(rampup.start >= 1 && rampup.increment >= 1 && rampup.samples >= 1, flag,
                    ": the start batch, the increment and the samples must be >= 1");
  FP8LM_INPUT_CHECK(rampup.start < rampup.global_batch, flag, ": the ramp must start below --global-batch-size (",
                    rampup.global_batch, ")");
  FP8LM_INPUT_CHECK((rampup.global_batch - rampup.start) % rampup.increment == 0, flag,
                    ": --global-batch-size (", rampup.global_batch, ") minus the start batch must be a multiple of the ",
                    "increment, as Megatron asserts");
  for (int64_t batch = rampup.start; batch <= rampup.global_batch; batch += rampup.increment)
    if (batch % sequences_per_micro_step != 0)
      throw InputError(flag + ": the ramp's global batch " + std::to_string(batch) +
                           " is not a multiple of --micro-batch-size x data-parallel size (" +
                           std::to_string(sequences_per_micro_step) + ")",
                       "pick a start and an increment that are multiples of it, as Megatron's consistency check "
                       "requires");
}

int64_t global_batch_at(const BatchRampup& rampup, uint64_t consumed_samples) {
  if (!rampup.enabled() || consumed_samples > uint64_t(rampup.samples)) return rampup.global_batch;
  const double samples_per_increment = double(rampup.samples) / double(increments(rampup));
  const auto steps = static_cast<int64_t>(double(consumed_samples) / samples_per_increment);
  return rampup.start + steps * rampup.increment;
}

int64_t rampup_train_iters(const BatchRampup& rampup, int64_t train_samples) {
  int64_t iterations = 0;
  int64_t consumed = 0;
  while (consumed <= rampup.samples && consumed <= train_samples) {
    consumed += global_batch_at(rampup, uint64_t(consumed));
    ++iterations;
  }
  if (train_samples > consumed) iterations += (train_samples - consumed) / rampup.global_batch;
  return iterations;
}

}  // namespace fp8lm
