#include "apps/batch_scorer.h"

#include "core/error.h"
#include "core/loss_mask.h"
#include "layers/gpt.h"
#include "layers/ops.h"
#include "parallel/communicator.h"

namespace fp8lm {

namespace {

void forward_only(Ops& ops, GptModel& model, float* device_sum, const DocumentMasking& documents,
                  const int32_t* inputs, const int32_t* targets) {
  ops.zero(device_sum, sizeof(float));
  model.forward_eval(
      ops.load_batch(inputs, targets, model.micro_batch_size(), model.seq_length(), model.vocab_slice(), documents),
      Tensor::scalar_f32(device_sum));
}

}  // namespace

BatchLoss score_batch(Ops& ops, GptModel& model, float* device_sum, Communicator& data_parallel,
                      const BatchReading& reading, const int32_t* inputs, const int32_t* targets) {
  const int64_t tokens = int64_t{model.micro_batch_size()} * model.seq_length();
  const int64_t unmasked = count_unmasked_targets(targets, size_t(tokens));
  FP8LM_CHECK(reading.loss_mask || unmasked == tokens, "masked targets in a run without --eod-mask-loss");
  forward_only(ops, model, device_sum, reading.documents, inputs, targets);
  float host_sum = 0.0f;
  ops.download(&host_sum, device_sum, sizeof(float));
  // Every data-parallel rank's batch.
  double totals[2] = {double(host_sum), double(unmasked)};
  data_parallel.all_reduce(totals, totals, 2, CommDtype::f64, ReduceOp::sum);
  return BatchLoss{.sum = totals[0], .tokens = totals[1]};
}

std::vector<BatchLoss> score_rows(Ops& ops, GptModel& model, float* device_sum, const BatchReading& reading,
                                  const int32_t* inputs, const int32_t* targets) {
  const int B = model.micro_batch_size(), T = model.seq_length();
  // Choice rows mask their targets by construction.
  forward_only(ops, model, device_sum, reading.documents, inputs, targets);
  std::vector<float> losses(size_t(B) * T);
  ops.download(losses.data(), model.token_losses().data, losses.size() * sizeof(float));
  std::vector<BatchLoss> rows(B);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const size_t i = size_t(b) * T + t;
      rows[b].sum += losses[i];
      rows[b].tokens += targets[i] != kMaskedTarget;
    }
  return rows;
}

}  // namespace fp8lm
