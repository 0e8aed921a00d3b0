// The training step, written once. Only the device work differs between backends; the
// order of that work, the collectives, the clipping, the skip rule and the scale-update
// interval are here.
//
// Data parallelism with the distributed optimizer (ZeRO-1, Megatron's layout): every
// bucket of the parameter slab (layers/gpt.h) is cut into data-parallel-size equal parts;
// this rank owns part dp_rank of every bucket. Its FP32 master weights and optimizer state
// cover those parts only, laid one after the other in the "shard". A step reduce-scatters
// each bucket's gradients in place (the reduced part stays where it was in the model's
// gradient slab), updates the shard from them, writes the new working values beside them
// in the model's working slab, and all-gathers each bucket there, in place. So the only
// shard-sized memory is the master and the state: per-rank memory falls with the number
// of ranks. Without the distributed optimizer the shard is the whole slab and the
// gradients are all-reduced in place.
#include "apps/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "apps/run_setup.h"
#include "core/check_cuda.h"
#include "core/checksum.h"
#include "core/error.h"
#include "core/host_values.h"
#include "core/launch.h"
#include "core/loss_mask.h"
#include "layers/gpt.h"
#include "layers/ops_cpu.h"
#include "layers/ops_cuda.h"
#include "parallel/mappings.h"

namespace fp8lm {

namespace {

// Scalars the step keeps in backend memory, so that a step never waits for the host.
struct StepScalars {
  double sum_of_squares = 0.0;  // of the gradients
  float loss_sum = 0.0f;        // this step's token losses
  float eval_loss_sum = 0.0f;
  StepControl control;
};

// This rank's share of the parameter slab (see the top of the file).
struct ShardPlan {
  struct Part {
    size_t bucket_begin = 0;  // slab offset of the bucket
    size_t part_begin = 0;    // slab offset of this rank's part
    size_t size = 0;          // elements of one part
    size_t shard_offset = 0;  // where the part sits in the shard buffers
    bool linear_weights = false;
    size_t first_tensor = 0, end_tensor = 0;  // the bucket's tensors: [first, end) of the slab layout
  };
  std::vector<Part> parts;  // one per bucket, in bucket order
  size_t size = 0;          // shard elements
  // Every tensor of the slab, the numel of its piece here (0: none), at its offset in the
  // shard (the master and the optimizer state) ...
  TensorLayout layout;
  // ... and at its offset in the model's slabs, where the gradients are reduce-scattered and
  // the working copy is gathered, in place.
  TensorLayout slab_layout;
  TensorLayout norm_layout;  // slab_layout, counting tensors replicated across tensor-parallel ranks on rank 0 only
  // Per bucket, its tensors only (tensor k of the bucket is first_tensor + k of the slab):
  std::vector<TensorLayout> bucket_layouts;  // whole, offsets relative to the bucket
  std::vector<TensorLayout> part_layouts;    // this rank's pieces, offsets relative to the part
};

ShardPlan plan_shard(const TensorLayout& slab, const std::vector<ParameterBucket>& buckets, int parts, int part,
                     int tp_rank) {
  ShardPlan plan;
  for (const ParameterBucket& bucket : buckets) {
    ShardPlan::Part p;
    p.bucket_begin = bucket.begin;
    p.size = (bucket.end - bucket.begin) / size_t(parts);
    p.part_begin = bucket.begin + size_t(part) * p.size;
    p.shard_offset = plan.size;
    p.linear_weights = bucket.linear_weights;
    plan.size += p.size;
    plan.parts.push_back(p);
  }
  plan.bucket_layouts.resize(buckets.size());
  plan.part_layouts.resize(buckets.size());
  const auto& tensors = slab.tensors();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorInfo& t = tensors[k];
    // The bucket holding the tensor (a bucket holds whole tensors, in slab order).
    size_t b = 0;
    while (b < buckets.size() && !(t.offset >= buckets[b].begin && t.offset + t.numel <= buckets[b].end)) ++b;
    FP8LM_CHECK(b < buckets.size(), "tensor ", t.name, " lies in no bucket");
    ShardPlan::Part& p = plan.parts[b];
    if (plan.bucket_layouts[b].tensors().empty()) p.first_tensor = k;
    FP8LM_CHECK(k == p.first_tensor + plan.bucket_layouts[b].tensors().size(), "bucket tensors out of slab order");
    p.end_tensor = k + 1;
    TensorInfo whole = t;
    whole.offset = t.offset - p.bucket_begin;
    plan.bucket_layouts[b].add_at(whole);
    // This rank's piece of it, in the shard, in the slab and in the part; numel 0: none here.
    TensorInfo in_shard = t, in_slab = t, in_part = t;
    in_shard.offset = in_slab.offset = in_part.offset = 0;
    in_shard.numel = in_slab.numel = in_part.numel = 0;
    const size_t begin = std::max(t.offset, p.part_begin), end = std::min(t.offset + t.numel, p.part_begin + p.size);
    if (begin < end) {
      in_shard.offset = p.shard_offset + (begin - p.part_begin);
      in_slab.offset = begin;
      in_part.offset = begin - p.part_begin;
      in_shard.numel = in_slab.numel = in_part.numel = end - begin;
    }
    plan.part_layouts[b].add_at(in_part);
    plan.layout.add_at(in_shard);
    plan.slab_layout.add_at(in_slab);
    TensorInfo norm_piece = in_slab;
    if (t.split == TensorSplit::replicated && tp_rank != 0) norm_piece.numel = 0;
    plan.norm_layout.add_at(norm_piece);
  }
  return plan;
}

CommDtype storage_dtype(const Ops& ops, DType dtype) {
  switch (ops.element_bytes(dtype)) {
    case 4: return CommDtype::f32;
    case 2: return CommDtype::bf16;
    default: return CommDtype::u8;
  }
}

}  // namespace

ScalingSnapshot scaling_table_snapshot(GptModel& model) {
  ScalingTable& table = model.scaling();
  ScalingSnapshot snapshot;
  for (int i = 0; i < table.size(); ++i) {
    snapshot.names.push_back(table.name(i));
    snapshot.dtypes.push_back(table.dtype(i));
  }
  snapshot.history_len = table.config().amax_history_len;
  // Sized as the table: a checkpoint that lacks some of these operands leaves them as they are
  // now (match_scaling_by_name).
  snapshot.history = table.history();
  snapshot.scale = table.scales();
  snapshot.scale_inv = table.scale_invs();
  snapshot.initialized = table.size() > 0 && table.initialized(0);
  return snapshot;
}

void restore_scaling_table(Ops& ops, GptModel& model, const ScalingSnapshot& snapshot) {
  ScalingTable& table = model.scaling();
  FP8LM_CHECK(int(snapshot.names.size()) == table.size() && snapshot.history.size() == table.history().size(),
              "scaling state of another model");
  ops.synchronize();
  table.history() = snapshot.history;
  table.scales() = snapshot.scale;
  table.scale_invs() = snapshot.scale_inv;
  std::fill(table.initialized_flags().begin(), table.initialized_flags().end(), snapshot.initialized ? 1 : 0);
  ops.upload_scaling();
}

std::unique_ptr<Ops> make_run_ops(const RunSetup& setup, int device) {
  if (!setup.use_cuda) return make_cpu_ops();
  check_cuda_model_support(setup.model, setup.options.precision == GemmPrecision::fp32);
  const int world = setup.data_parallel_size * setup.options.tensor_model_parallel_size;
  cuda::set_programmatic_launch(setup.options.programmatic_launch);
  return make_cuda_ops(device, SmallMGemm::on, setup.options.gemm_algorithm,
                       /*background_yields=*/optimizer_first_pass_in_backward(setup.options, world),
                       setup.options.fp8_fast_accumulation);
}

struct TrainingEngine::State {
  ParallelLayout parallel;
  std::unique_ptr<Ops> ops;
  OpProfiler* op_profiler = nullptr;  // --profile-ops: observes `ops`, which owns it
  std::unique_ptr<ProcessGroups> groups;       // over the backend's memory
  std::unique_ptr<ProcessGroups> host;         // over host memory (MPI)
  std::unique_ptr<TensorParallelMappings> tp;
  std::unique_ptr<GptModel> model;
  TensorLayout canonical;
  ShardPlan shard;
  StartupSeconds startup;
  // The shard's layout (master, optimizer state), this rank's pieces at their slab positions
  // (gradients, working copy) and for the norm; per bucket, its tensors whole and this rank's
  // pieces of them (FP8 gradients and weights travel bucket by bucket).
  std::unique_ptr<TensorTable> shard_table, slab_table, norm_table;
  std::vector<std::unique_ptr<TensorTable>> bucket_tables, part_tables;
  // An overlapped weight gather runs AdamW in two calls: the embedding bucket's tensors, then
  // the others, so that the embedding's gather (the next forward's first need) runs on the
  // side lane while AdamW updates the rest. AdamW works tensor by tensor: the same numbers.
  struct UpdateGroup {
    std::unique_ptr<TensorTable> shard, slab;  // the group's tensors only, offsets as in the shard and slab tables
    size_t first_tensor = 0;                   // of the slab layout
    std::unique_ptr<Allocation> scratch;       // AdamW's, for the group's tensors
  };
  std::vector<UpdateGroup> update_groups;  // empty: one call over the whole shard
  OptimizerStatePrecision state_precision;
  Fp8RecipeConfig recipe;
  bool fp8 = false;
  bool sharded = false;           // the distributed optimizer with more than one data-parallel rank
  bool fp8_grad_comm = false, fp8_param_gather = false;
  GradReduceAlgorithm fp8_grad_reduce = GradReduceAlgorithm::all_to_all;
  Fp8Dtype grad_comm_dtype = Fp8Dtype::e5m2;
  // Overlap: each bucket's reduction starts on the side lane once the last micro-batch's
  // backward has its gradients; each bucket's gather runs on the side lane after the update
  // and the next forward waits for it layer by layer (and casts that layer's FP8 weights).
  bool overlap_grad_reduce = false, overlap_param_gather = false;
  int grad_accum_steps = 1;   // this step's micro-batches
  int run_micro_batches = 1;  // a global batch's (--global-batch-size over micro-batch x DP)
  bool last_micro_batch = true;
  std::vector<std::vector<size_t>> buckets_of_layer;  // [layer + 1]: -1 the embedding .. n_layer the head
  std::vector<bool> bucket_reduced;                   // this step
  bool side_lane_busy = false;                        // this step's reductions were queued on the side lane
  std::vector<bool> refresh_pending;                  // [layer + 1]: gathered weights not cast yet
  // This step's FP8 weight operands are cast on the background lane, each layer's as soon as
  // its gather lands (queue_weight_casts), so the next forward waits for them instead of
  // casting them in its own path; weights_cast[layer + 1] marks each layer's done.
  bool weights_cast_beside_forward = false;
  std::vector<std::unique_ptr<Ops::LaneEvent>> weights_cast;
  // The FP8 Linear weight operands AdamW writes in its update pass (--optimizer-weight-casts
  // fused; the delayed recipe with every tensor whole on this rank and fp8-fp16 state), and
  // whether this step's update wrote them (not on a step before FP8 statistics, which count
  // casts only op by op): then publish_parameters casts no Linear weight again.
  std::unique_ptr<WeightCastTable> weight_casts;
  bool weights_cast_in_update = false;
  // AdamW's first pass reads the gradients once for their norm too (fp8-fp16 state whose table
  // is the norm's: every tensor whole and counted on this rank); the amaxes are redone after
  // the decision only when it clips.
  bool norm_in_first_pass = false;
  // Otherwise, with the reduction overlapped, each bucket's part of the norm runs behind its
  // reduction on the side lane (Ops::grad_sum_of_squares_part), and end_step only adds the
  // parts: the norm's read of the gradients leaves the step's tail.
  bool norm_in_parts = false;
  // ... and, on one rank (--optimizer-first-pass backward), that pass runs layer by layer
  // while the last micro-batch's backward goes on: a layer's part waits for the next block's
  // attention backward, bound by its kernels' latency, and runs beside it on the background
  // lane (its blocks take what the attention's leave free). Its ranges of tensors [layer + 1],
  // the betas it takes (the run's; end_step checks that the step's are the same), the layers
  // whose gradients are final but whose parts are not queued yet, and how many are.
  bool first_pass_in_backward = false;
  std::vector<std::vector<Ops::TensorRange>> first_pass_ranges;
  AdamWHyperparams first_pass_hyperparams;
  std::vector<int> first_pass_waiting;
  size_t first_pass_layers_queued = 0;
  std::unique_ptr<Ops::LaneEvent> first_pass_done;
  void queue_first_pass();
  std::unique_ptr<Ops::LaneEvent> main_mark, side_mark;
  std::vector<std::unique_ptr<Ops::LaneEvent>> gathered;  // [bucket]

  // The master weights of this rank's pieces, packed in the shard. Their gradients and
  // working-copy values stay in the model's slabs (shard.slab_layout): the reduce-scatter
  // leaves each bucket's reduced part in place there, AdamW reads it and writes the working
  // values beside it, and the all-gather sends them from there, in place. So ZeRO-1 needs no
  // shard-sized gradient or working buffers.
  std::unique_ptr<Allocation> master_storage;
  float* master = nullptr;
  void* working_update = nullptr;  // what AdamW rewrites: the working slab, or nullptr when it is the master

  std::unique_ptr<Allocation> m_codes, v_bits, m_scales, v_scales, m32, v32;
  std::unique_ptr<Allocation> scalars;  // one StepScalars
  std::unique_ptr<Allocation> adamw_scratch;
  // Communication buffers.
  // One bucket of gradients as they travel as FP8 codes (--fp8-grad-comm), reduced in place in
  // it and converted back into the gradient slab: reused by every bucket, in the order of the
  // one lane that carries a step's reductions (reduce_bucket joins the lanes before another
  // takes it). FP32 and BF16 gradients travel in the gradient slab itself.
  std::unique_ptr<Allocation> grad_staging;
  std::unique_ptr<Allocation> codes_received;  // every rank's codes for this rank's part of a bucket (all-to-all)
  std::unique_ptr<Allocation> weight_codes;    // --fp8-param-gather: the slab's FP8 codes, gathered in place
  std::unique_ptr<Allocation> tensor_amax, tensor_scale, tensor_scale_inv;  // [tensors]
  std::unique_ptr<Allocation> weight_state_of_tensor;        // [tensors] int: the FP8 weight's state, -1
  std::unique_ptr<HostReadback> control_readback;
  StepControl last_seen;
  int64_t next_step = 0;  // begin_step() without a step starts this one

  // FP8 statistics (--fp8-stats-interval): the counts [states] the casts add to while a step
  // that collects them runs, and their copy on the host after it.
  int64_t fp8_stats_interval = 0;
  // --fp8-auto-precision's calibration window: steps [0, N) collect them too (0 without it).
  int64_t fp8_calibration_steps = 0;
  std::unique_ptr<Allocation> fp8_counts;
  std::unique_ptr<HostReadback> fp8_counts_readback;
  int64_t counting_step = -1;  // the step the casts count for now; -1: nothing is counted
  int64_t counted_step = -1;   // the step whose counts the readback holds
  // The weight operands were last cast by refresh_weight_operands() (set_parameters,
  // set_scaling_state), not by a step: casting them again gives the same codes.
  bool weights_from_refresh = false;
  int micro_batches = 0;
  float tokens_per_micro_batch = 1.0f;
  // --eod-mask-loss: targets may be masked, and the step's loss divides by the unmasked
  // targets of every micro-batch and data-parallel rank (this rank's so far: step_loss_tokens).
  bool loss_mask = false;
  DocumentMasking documents;  // --reset-position-ids, --reset-attention-mask
  int64_t step_loss_tokens = 0;
  // --calculate-per-token-loss with the mask: the step's unmasked targets over every rank,
  // known before its first backward (begin_step's loss_tokens); -1 until then.
  bool per_token_loss = false;
  double step_global_loss_tokens = -1.0;
  MemoryEstimate memory_estimate;  // made before anything was allocated (run_setup.cpp)

  BatchReading reading() const { return {.loss_mask = loss_mask, .documents = documents}; }
  size_t tensor_count() const { return model->layout().tensors().size(); }
  StepScalars* device_scalars() { return static_cast<StepScalars*>(scalars->data()); }
  StepControl* control() { return &device_scalars()->control; }
  AdamWStateSlabs optimizer_slabs() {
    AdamWStateSlabs slabs;
    if (state_precision == OptimizerStatePrecision::fp8_fp16) {
      slabs.m8 = static_cast<uint8_t*>(m_codes->data());
      slabs.v16 = static_cast<uint16_t*>(v_bits->data());
      slabs.m_scales = static_cast<float*>(m_scales->data());
      slabs.v_scales = static_cast<float*>(v_scales->data());
    } else {
      slabs.m32 = static_cast<float*>(m32->data());
      slabs.v32 = static_cast<float*>(v32->data());
    }
    return slabs;
  }
  size_t optimizer_bytes() const {
    size_t bytes = master_storage ? master_storage->bytes() : 0;
    for (const auto* a : {&m_codes, &v_bits, &m_scales, &v_scales, &m32, &v32})
      if (*a) bytes += (*a)->bytes();
    return bytes;
  }
  size_t communication_bytes() const {
    size_t bytes = 0;
    for (const auto* a : {&grad_staging, &codes_received, &weight_codes})
      if (*a) bytes += (*a)->bytes();
    return bytes;
  }
  size_t allocated_bytes() const {
    return model->allocated_bytes() + optimizer_bytes() + communication_bytes() + ops->workspace_bytes() +
           (fp8_counts ? fp8_counts->bytes() : 0);
  }
  StepControl read_control() {
    StepControl control;
    ops->download(&control, this->control(), sizeof control);
    return control;
  }
  DType activation_dtype() const { return ops->activation_dtype(); }
  Communicator& world() { return groups->world(); }
  Communicator& dp() { return groups->dp(); }

  const std::vector<size_t>& buckets_of(int layer) const { return buckets_of_layer[size_t(layer + 1)]; }
  void reduce_bucket(size_t bucket, bool overlapped);
  // The targets [B*T] that count in the loss (not kMaskedTarget); masked ones only under
  // --eod-mask-loss, whose normalisation counts them.
  int64_t unmasked_targets(const int32_t* targets) const;
  // What the step's summed token losses divide by: its tokens, or under --eod-mask-loss the
  // unmasked ones of every data-parallel rank (agreed on the host; at least 1).
  float step_loss_divisor();
  void sum_bucket_across_ranks(size_t bucket, bool overlapped);
  void reduce_fp8_bucket(size_t bucket, Communicator& comm, Ops::Lane lane);
  void reduce_gradients();
  // Elements [begin, begin + count) of the model's gradient slab, in its dtype.
  Tensor gradient_range(size_t begin, size_t count) const {
    const Tensor slab = model->gradients();
    Tensor range = slab;
    range.data = static_cast<char*>(slab.data) + begin * ops->element_bytes(slab.dtype);
    range.cols = int64_t(count);
    return range;
  }
  // Orders the main lane after everything queued on the side lane so far.
  void join_side_lane();
  // The AdamW call over `table` (the shard's, or an update group's whose first tensor is
  // first_tensor); the pointers of the per-tensor arrays start at the table's first tensor.
  AdamWCall adamw_call(const TensorTable& table, const TensorTable* slab, size_t first_tensor, float* scratch,
                       const AdamWHyperparams& hyperparams);
  // Bucket b's weights on every rank (all-gather in place), on `lane`.
  void gather_bucket(size_t b, Communicator& comm, Ops::Lane lane);
  // The gathers of buckets [first_bucket, end) after the update.
  void publish_parameters(size_t first_bucket = 0);
  void cast_weights_of(int layer);
  void queue_weight_casts();
  bool collects_fp8_statistics(int64_t step) const {
    if (!fp8_counts || step < 0) return false;
    return (fp8_stats_interval > 0 && (step + 1) % fp8_stats_interval == 0) || step < fp8_calibration_steps;
  }
  // Zeroes the counts and has the casts add to them from now on (in stream order).
  void start_fp8_statistics(int64_t step) {
    ops->zero(fp8_counts->data(), fp8_counts->bytes());
    ops->set_fp8_statistics(static_cast<Fp8CastCounts*>(fp8_counts->data()));
    counting_step = step;
  }
  // No more counting; with `keep`, the counts travel to the host (in stream order, no wait).
  void stop_fp8_statistics(bool keep) {
    if (counting_step < 0) return;
    ops->set_fp8_statistics(nullptr);
    if (keep) {
      fp8_counts_readback->capture(fp8_counts->data());
      counted_step = counting_step;
    }
    counting_step = -1;
  }
  // The canonical layout's values <-> this rank's shard, through host memory (checkpoints).
  template <typename T>
  std::vector<T> gather_canonical(const void* shard_values);
  template <typename T>
  std::vector<T> shard_from_canonical(const std::vector<T>& canonical);
  template <typename T>
  std::vector<T> slab_from_canonical(const std::vector<T>& canonical);
  // The distributed optimizer's parts of this rank's slab, its shard.
  template <typename T>
  std::vector<T> shard_parts(std::span<const T> own);
  // This rank's slab of --seed's initial weights, drawn tensor by tensor: no rank holds the
  // whole canonical model (27 GB of FP32 at 6.7B parameters) to keep its part of it.
  HostValues initial_slab(const GptConfig& config, uint64_t seed);
  // The working copy and the master weights from this rank's slab of values.
  void set_slab_parameters(std::span<const float> own);
  // Under the distributed optimizer: only this rank's shard of the initial weights (1/DP of
  // its slab), and the working copy gathered from every rank's shard as after a step.
  bool draws_shard_only() const;
  HostValues initial_shard(const GptConfig& config, uint64_t seed);
  void set_shard_parameters(std::span<const float> shard_values);
  std::vector<float> canonical_tensor_scales(const float* memory_order);
  std::vector<float> memory_tensor_scales(const std::vector<float>& canonical_order);
};

AdamWHyperparams adamw_hyperparams(const TrainOptions& o, double lr, double weight_decay) {
  AdamWHyperparams hp;
  hp.lr = static_cast<float>(lr);
  hp.beta1 = static_cast<float>(o.adam_beta1);
  hp.beta2 = static_cast<float>(o.adam_beta2);
  hp.eps = static_cast<float>(o.adam_eps);
  hp.weight_decay = static_cast<float>(weight_decay);
  return hp;
}

TrainingEngine::TrainingEngine(const RunSetup& setup, const ParallelLayout& layout, ParameterStart start)
    : TrainingEngine(setup, layout, make_run_ops(setup, layout.local_rank), start) {}

TrainingEngine::TrainingEngine(const RunSetup& setup, const ParallelLayout& layout, std::unique_ptr<Ops> ops,
                               ParameterStart start)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  const TrainOptions& o = setup.options;
  s.parallel = layout;
  s.ops = std::move(ops);
  if (o.profile_ops) {
    auto profiler = std::make_unique<OpProfiler>();
    s.op_profiler = profiler.get();
    s.ops = make_observed_ops(std::move(s.ops), std::move(profiler));
  }
  s.memory_estimate = setup.memory;
  s.host = std::make_unique<ProcessGroups>(ProcessGroups::create_host(layout));
  if (s.ops->stream_handle() != nullptr) {
    // The tensor-parallel and data-parallel traffic of the step runs on the backend's own
    // stream, in its order; the overlapped data-parallel traffic on its side lane.
    const auto compute = static_cast<cudaStream_t>(s.ops->stream_handle());
    const auto side = static_cast<cudaStream_t>(s.ops->side_stream_handle());
    s.groups = std::make_unique<ProcessGroups>(ProcessGroups::create_gpu(layout, NcclStreams{compute, compute, compute, side}));
  } else {
    s.groups = std::make_unique<ProcessGroups>(ProcessGroups::create_host(layout));
  }
  Communicator* tp_group = layout.tp_size > 1 ? &s.groups->tp() : nullptr;
  s.tp = std::make_unique<TensorParallelMappings>(tp_group, o.sequence_parallel, *s.ops);
  s.ops->set_amax_group(tp_group);
  s.sharded = layout.dp_size > 1 && o.use_distributed_optimizer.value_or(true);
  s.model = std::make_unique<GptModel>(setup.model, o.micro_batch_size, setup.seq_length,
                                       engine_model_precision(o, s.sharded, s.ops->activation_dtype()), *s.ops,
                                       ModelParallelism{s.tp.get(), layout.dp_size}, activation_recompute(o));
  s.canonical = make_gpt_layout(setup.model);
  s.state_precision = o.optimizer_state;
  s.recipe = o.fp8;
  s.fp8 = o.fp8_enabled();
  s.fp8_grad_comm = o.fp8_grad_comm && layout.dp_size > 1;
  s.fp8_grad_reduce = o.fp8_grad_reduce;
  s.fp8_param_gather = o.fp8_param_gather;
  s.grad_comm_dtype = gradient_dtype(o.fp8.format);
  s.overlap_grad_reduce = o.overlap_grad_reduce && layout.dp_size > 1;
  s.overlap_param_gather = o.overlap_param_gather && s.sharded;
  s.grad_accum_steps = setup.grad_accum_steps;
  s.run_micro_batches = setup.grad_accum_steps;
  GptModel& model = *s.model;
  Ops& device = *s.ops;
  s.buckets_of_layer.assign(size_t(setup.model.n_layer) + 2, {});
  for (size_t b = 0; b < model.buckets().size(); ++b) s.buckets_of_layer[size_t(model.buckets()[b].layer + 1)].push_back(b);
  s.bucket_reduced.assign(model.buckets().size(), false);
  s.refresh_pending.assign(s.buckets_of_layer.size(), false);
  s.main_mark = device.make_event();
  s.side_mark = device.make_event();
  s.first_pass_done = device.make_event();
  for (size_t b = 0; b < model.buckets().size(); ++b) s.gathered.push_back(device.make_event());
  if (s.overlap_param_gather)
    for (size_t i = 0; i < s.buckets_of_layer.size(); ++i) s.weights_cast.push_back(device.make_event());
  model.set_layer_hooks(LayerHooks{
      .before_forward = [&s](int layer) { s.cast_weights_of(layer); },
      .after_backward =
          [&s](int layer) {
            if (!s.last_micro_batch) return;
            if (s.first_pass_in_backward) s.first_pass_waiting.push_back(layer);
            if (!s.overlap_grad_reduce) return;
            for (size_t b : s.buckets_of(layer)) s.reduce_bucket(b, /*overlapped=*/true);
          },
      .before_attention_backward =
          [&s](int) {
            if (s.last_micro_batch && s.first_pass_in_backward) s.queue_first_pass();
          },
  });

  // The shard and its buffers. With one part, they are the model's own slabs.
  const int parts = s.sharded ? layout.dp_size : 1;
  s.shard = plan_shard(model.layout(), model.buckets(), parts, s.sharded ? layout.dp_rank : 0, layout.tp_rank);
  const size_t S = s.shard.size, total = model.layout().total_elements(), count = s.tensor_count();
  if (!s.sharded && s.activation_dtype() == DType::f32) {
    s.master = static_cast<float*>(model.working());  // the CPU's FP32 working copy is the master
  } else {
    s.master_storage = device.allocate(S * sizeof(float));
    s.master = static_cast<float*>(s.master_storage->data());
  }
  s.working_update = s.master == model.working() ? nullptr : model.working();
  if (!s.sharded) {
    // One part: the master is the whole slab, in the model's layout.
    FP8LM_CHECK(S == total, "an unsharded optimizer holds the whole parameter slab");
    if (s.master != model.working()) model.set_fp8_cast_source(s.master);
  }
  s.shard_table = device.make_table(s.shard.layout);
  if (s.sharded) s.slab_table = device.make_table(s.shard.slab_layout);
  s.norm_table = device.make_table(s.shard.norm_layout);
  if (s.sharded && s.overlap_param_gather && s.shard.parts.size() > 1) {
    // The early gather casts nothing: the first bucket's weights travel in the working dtype.
    FP8LM_CHECK(model.buckets().front().name == "embedding" && !s.shard.parts.front().linear_weights,
                "the first bucket is the embedding");
    const size_t after_embedding = s.shard.parts.front().end_tensor;
    for (const auto& [first, end] : {std::pair<size_t, size_t>{0, after_embedding}, {after_embedding, count}}) {
      TensorLayout shard_part, slab_part;
      for (size_t k = first; k < end; ++k) {
        shard_part.add_at(s.shard.layout.tensors()[k]);
        slab_part.add_at(s.shard.slab_layout.tensors()[k]);
      }
      State::UpdateGroup group;
      group.shard = device.make_table(shard_part);
      group.slab = device.make_table(slab_part);
      group.first_tensor = first;
      group.scratch = device.allocate(adamw_scratch_floats(end - first) * sizeof(float));
      s.update_groups.push_back(std::move(group));
    }
  }

  if (s.state_precision == OptimizerStatePrecision::fp8_fp16) {
    s.m_codes = device.allocate(S * sizeof(uint8_t));
    s.v_bits = device.allocate(S * sizeof(uint16_t));
    s.m_scales = device.allocate(count * sizeof(float));
    s.v_scales = device.allocate(count * sizeof(float));
    const std::vector<float> ones(count, 1.0f);  // fresh state: codes 0, scales 1
    device.upload(s.m_scales->data(), ones.data(), count * sizeof(float));
    device.upload(s.v_scales->data(), ones.data(), count * sizeof(float));
  } else {
    s.m32 = device.allocate(S * sizeof(float));
    s.v32 = device.allocate(S * sizeof(float));
  }
  s.scalars = device.allocate(sizeof(StepScalars));
  s.adamw_scratch = device.allocate(adamw_scratch_floats(count) * sizeof(float));
  const auto same_tensors = [](const TensorLayout& a, const TensorLayout& b) {
    if (a.tensors().size() != b.tensors().size()) return false;
    for (size_t k = 0; k < a.tensors().size(); ++k)
      if (a.tensors()[k].offset != b.tensors()[k].offset || a.tensors()[k].numel != b.tensors()[k].numel) return false;
    return true;
  };
  s.norm_in_first_pass = s.state_precision == OptimizerStatePrecision::fp8_fp16 && !s.sharded &&
                         s.update_groups.empty() && same_tensors(s.shard.layout, s.shard.norm_layout);
  s.first_pass_in_backward = s.norm_in_first_pass && optimizer_first_pass_in_backward(o, s.world().size());
  s.norm_in_parts = s.overlap_grad_reduce && !s.norm_in_first_pass;
  if (s.first_pass_in_backward) {
    // A bucket's tensors are consecutive in the (unsharded) layout: those whose slab offsets
    // lie in it.
    const auto& tensors = s.shard.layout.tensors();
    s.first_pass_ranges.assign(s.buckets_of_layer.size(), {});
    size_t covered = 0;
    for (size_t i = 0; i < s.buckets_of_layer.size(); ++i)
      for (size_t b : s.buckets_of_layer[i]) {
        const ParameterBucket& bucket = model.buckets()[b];
        const auto in_bucket = [&](size_t k) {
          return tensors[k].offset >= bucket.begin && tensors[k].offset < bucket.end;
        };
        Ops::TensorRange range{.first = tensors.size(), .end = 0};
        size_t held = 0;
        for (size_t k = 0; k < tensors.size(); ++k)
          if (in_bucket(k)) {
            range.first = std::min(range.first, k);
            range.end = k + 1;
            ++held;
          }
        if (held == 0) continue;
        FP8LM_CHECK(held == range.end - range.first, "bucket ", bucket.name, ": its tensors are not consecutive");
        covered += held;
        s.first_pass_ranges[i].push_back(range);
      }
    FP8LM_CHECK(covered == tensors.size(), "the buckets hold ", covered, " of the ", tensors.size(),
                " tensors AdamW's first pass reads");
    s.first_pass_hyperparams = adamw_hyperparams(o, /*lr=*/0.0, /*weight_decay=*/0.0);  // the moments take only the betas
  }
  if (optimizer_writes_fp8_weights(o, s.sharded)) {
    const std::vector<WeightOperand> operands = model.fp8_weight_operands();
    if (!operands.empty()) s.weight_casts = device.make_weight_casts(*s.shard_table, operands);
  }

  size_t largest_bucket = 0;
  for (const ParameterBucket& bucket : model.buckets()) largest_bucket = std::max(largest_bucket, bucket.end - bucket.begin);
  if (s.fp8_grad_comm) {
    FP8LM_CHECK(model.gradient_dtype() == DType::f32, "FP8 gradient communication casts FP32 gradients");
    s.grad_staging = device.allocate(largest_bucket);
    // The all-to-all exchanges codes out of place: every rank's codes of this rank's part.
    if (s.fp8_grad_reduce == GradReduceAlgorithm::all_to_all) s.codes_received = device.allocate(largest_bucket);
    s.tensor_amax = device.allocate(count * sizeof(float));
    s.tensor_scale = device.allocate(count * sizeof(float));
    s.tensor_scale_inv = device.allocate(count * sizeof(float));
  }
  if (s.fp8_grad_comm || s.fp8_param_gather) {
    for (size_t b = 0; b < model.buckets().size(); ++b) {
      s.bucket_tables.push_back(device.make_table(s.shard.bucket_layouts[b]));
      s.part_tables.push_back(device.make_table(s.shard.part_layouts[b]));
    }
  }
  if (s.fp8_param_gather) {
    s.weight_codes = device.allocate(total);
    std::vector<int32_t> state_of(count, -1);
    for (const WeightOperand& w : model.fp8_weight_operands()) state_of[w.tensor] = w.operand.scaling_state;
    s.weight_state_of_tensor = device.allocate(count * sizeof(int32_t));
    device.upload(s.weight_state_of_tensor->data(), state_of.data(), count * sizeof(int32_t));
  }

  s.fp8_stats_interval = o.fp8_stats_interval;
  s.fp8_calibration_steps = o.fp8_auto_precision ? o.fp8_auto_precision_steps : 0;
  if (s.fp8 && (o.fp8_stats_interval > 0 || s.fp8_calibration_steps > 0) && model.scaling().size() > 0) {
    const size_t bytes = size_t(model.scaling().size()) * sizeof(Fp8CastCounts);
    s.fp8_counts = device.allocate(bytes);
    s.fp8_counts_readback = device.make_readback(bytes);
  }

  device.set_step_control(s.control(), StepControl{});
  s.control_readback = device.make_readback(sizeof(StepControl));
  s.control_readback->capture(s.control());
  // dloss of a micro-batch is 1 / (its tokens x micro-batches x data-parallel ranks): the
  // loss divisor counts the same tokens.
  s.tokens_per_micro_batch = float(o.micro_batch_size) * float(setup.seq_length) * float(layout.dp_size);
  s.loss_mask = o.eod_mask_loss;
  s.documents = setup.documents;
  s.per_token_loss = o.eod_mask_loss && o.calculate_per_token_loss;

  if (start == ParameterStart::set_by_caller) return;
  const auto began = std::chrono::steady_clock::now();
  const bool shard_only = s.draws_shard_only();
  const HostValues initial = shard_only ? s.initial_shard(setup.model, o.seed) : s.initial_slab(setup.model, o.seed);
  const auto drawn = std::chrono::steady_clock::now();
  if (shard_only)
    s.set_shard_parameters(initial);
  else
    s.set_slab_parameters(initial);
  s.startup.draw_initial_values = std::chrono::duration<double>(drawn - began).count();
  s.startup.set_parameters = std::chrono::duration<double>(std::chrono::steady_clock::now() - drawn).count();
}

TrainingEngine::StartupSeconds TrainingEngine::startup_seconds() const { return state_->startup; }

TrainingEngine::~TrainingEngine() {
  if (!state_) return;
  // Runs during unwinding too: after a failed kernel this wait fails as well, and a throw here
  // would end the process with its message instead of the error being reported.
  try {
    if (state_->ops) state_->ops->synchronize();
  } catch (const std::exception&) {
  }
  state_->groups.reset();
}

const TensorLayout& TrainingEngine::layout() const { return state_->canonical; }
const ProcessGroups& TrainingEngine::host_groups() const { return *state_->host; }
std::vector<ncclComm_t> TrainingEngine::nccl_comms() const { return state_->groups->nccl_comms(); }

std::vector<std::pair<std::string, CommTraffic>> TrainingEngine::traffic() const {
  const ProcessGroups& g = *state_->groups;
  return {{"tp", g.tp().traffic()},
          {"dp", g.dp().traffic()},
          {"dp_overlapped", g.dp_background().traffic()},
          {"world", g.world().traffic()}};
}

void TrainingEngine::reset_traffic() {
  const ProcessGroups& g = *state_->groups;
  for (Communicator* c : {&g.tp(), &g.dp(), &g.world(), &g.dp_background()}) c->reset_traffic();
}

void TrainingEngine::begin_step() { begin_step(state_->next_step); }

void TrainingEngine::begin_step(int64_t step) { begin_step(step, state_->run_micro_batches); }

void TrainingEngine::begin_step(int64_t step, int micro_batches) {
  State& s = *state_;
  FP8LM_CHECK(micro_batches >= 1, "micro_batches=", micro_batches);
  s.grad_accum_steps = micro_batches;
  s.next_step = step;
  if (s.collects_fp8_statistics(step) && s.counting_step != step) {
    // The step before did not open the count (this is a run's first step, or steps were
    // skipped): the weight operands this step multiplies were cast uncounted. Cast them again:
    // from the same values with the same scales, so the codes, the amaxes recorded and
    // everything after are what they would have been.
    s.stop_fp8_statistics(/*keep=*/false);
    s.start_fp8_statistics(step);
    if (s.weights_from_refresh) s.model->refresh_weight_operands();
  }
  s.model->zero_gradients();
  s.ops->zero(&s.device_scalars()->loss_sum, sizeof(float));
  s.micro_batches = 0;
  s.step_loss_tokens = 0;
  s.step_global_loss_tokens = -1.0;
  s.first_pass_layers_queued = 0;
  s.first_pass_waiting.clear();  // a backward without an end_step (none in training) left nothing
}

void TrainingEngine::begin_step(int64_t step, int micro_batches, int64_t loss_tokens) {
  State& s = *state_;
  FP8LM_CHECK(s.per_token_loss, "a step's token count is for --eod-mask-loss --calculate-per-token-loss");
  FP8LM_CHECK(loss_tokens >= 0, "loss_tokens=", loss_tokens);
  begin_step(step, micro_batches);
  double total = double(loss_tokens);
  if (s.parallel.dp_size > 1) s.host->dp().all_reduce(&total, &total, 1, CommDtype::f64, ReduceOp::sum);
  s.step_global_loss_tokens = total;
}

void TrainingEngine::forward_backward(const int32_t* inputs, const int32_t* targets) {
  State& s = *state_;
  GptModel& model = *s.model;
  const int64_t tokens = int64_t{model.micro_batch_size()} * model.seq_length();
  const int64_t unmasked = s.unmasked_targets(targets);
  s.step_loss_tokens += unmasked;
  // Megatron's loss of a masked micro-batch: the mean over its unmasked tokens, over the
  // micro-batches, averaged over the data-parallel ranks (without a mask the same weight); with
  // --calculate-per-token-loss the mean over the step's unmasked tokens on every rank (the
  // data-parallel reduction sums).
  float dloss = 0.0f;
  if (s.per_token_loss) {
    FP8LM_CHECK(s.step_global_loss_tokens >= 0.0,
                "--calculate-per-token-loss: begin_step needs the step's unmasked targets before its first micro-batch");
    dloss = s.step_global_loss_tokens > 0.0 ? float(1.0 / s.step_global_loss_tokens) : 0.0f;
  } else if (unmasked == tokens) {
    dloss = 1.0f / (s.tokens_per_micro_batch * float(s.grad_accum_steps));
  } else if (unmasked > 0) {
    dloss = 1.0f / (float(unmasked) * float(s.parallel.dp_size) * float(s.grad_accum_steps));
  }
  const TokenBatch batch =
      s.ops->load_batch(inputs, targets, model.micro_batch_size(), model.seq_length(), model.vocab_slice(), s.documents);
  s.last_micro_batch = s.micro_batches + 1 >= s.grad_accum_steps;
  model.forward_backward(batch, dloss, Tensor::scalar_f32(&s.device_scalars()->loss_sum));
  ++s.micro_batches;
}

int64_t TrainingEngine::State::unmasked_targets(const int32_t* targets) const {
  const int64_t tokens = int64_t{model->micro_batch_size()} * model->seq_length();
  const int64_t unmasked = count_unmasked_targets(targets, size_t(tokens));
  FP8LM_CHECK(loss_mask || unmasked == tokens, "masked targets in a run without --eod-mask-loss");
  return unmasked;
}

float TrainingEngine::State::step_loss_divisor() {
  if (!loss_mask) return tokens_per_micro_batch * float(std::max(micro_batches, 1));
  if (per_token_loss) return float(std::max(step_global_loss_tokens, 1.0));  // agreed in begin_step
  double unmasked = double(step_loss_tokens);
  if (parallel.dp_size > 1) host->dp().all_reduce(&unmasked, &unmasked, 1, CommDtype::f64, ReduceOp::sum);
  return float(std::max(unmasked, 1.0));
}

// Bucket b's gradients complete across ranks: the sequence-parallel partial sums, then the
// data-parallel reduction, on the side lane when overlapped with the backward. Every form
// works in place: the reduced part of the bucket (this rank's with the distributed
// optimizer, else the whole bucket) ends where its gradients were, in the model's gradient
// slab, in the slab's dtype (FP32, or BF16 under --grad-reduce-in-bf16: Megatron's BF16
// main_grad, reduced as it is); FP8 codes are cast into the one-bucket staging buffer,
// reduced there, and summed back into the slab. Then, with the norm in parts, the bucket's
// part of it, behind the reduction on its lane.
void TrainingEngine::State::reduce_bucket(size_t b, bool overlapped) {
  sum_bucket_across_ranks(b, overlapped);
  if (!norm_in_parts) return;
  const ShardPlan::Part& p = shard.parts[b];
  ops->grad_sum_of_squares_part(model->gradients(), *norm_table, {.first = p.first_tensor, .end = p.end_tensor},
                                overlapped ? Ops::Lane::side : Ops::Lane::main);
}

void TrainingEngine::State::sum_bucket_across_ranks(size_t b, bool overlapped) {
  const ParameterBucket& bucket = model->buckets()[b];
  for (const auto& [begin, end] : model->partial_gradient_ranges()) {
    if (begin < bucket.begin || end > bucket.end) continue;
    const Tensor partial = gradient_range(begin, end - begin);
    tp->sum_partial_gradients(partial);
    ops->round_to_dtype(partial);
  }
  bucket_reduced[b] = true;
  if (parallel.dp_size == 1) return;
  const ShardPlan::Part& p = shard.parts[b];
  const Ops::Lane lane = overlapped ? Ops::Lane::side : Ops::Lane::main;
  Communicator& comm = overlapped ? groups->dp_background() : dp();
  if (fp8_grad_comm) {
    // The bucket's amaxes start from zero: cleared on the main lane, before the side lane is
    // told to go on (no other bucket's reduction touches these entries).
    ops->zero(static_cast<float*>(tensor_amax->data()) + p.first_tensor,
              (p.end_tensor - p.first_tensor) * sizeof(float));
  }
  if (overlapped) {
    ops->record(*main_mark, Ops::Lane::main);
    ops->wait(*main_mark, Ops::Lane::side);
    side_lane_busy = true;
  } else if (side_lane_busy) {
    join_side_lane();  // the staging buffer was last used there
  }
  if (fp8_grad_comm) return reduce_fp8_bucket(b, comm, lane);

  const Tensor whole = gradient_range(bucket.begin, bucket.end - bucket.begin);
  const CommDtype wire = storage_dtype(*ops, whole.dtype);
  // The reduced range is rounded to the slab's dtype where a collective summed it wider (the
  // CPU's FP32 storage of BF16 gradients; nothing to do for FP32 or on the GPU).
  if (sharded) {
    const Tensor own = gradient_range(p.part_begin, p.size);
    comm.reduce_scatter(whole.data, own.data, p.size, wire, ReduceOp::sum);
    return ops->round_to_dtype(own, lane);
  }
  // A replicated optimizer: every rank's whole bucket summed.
  comm.all_reduce(whole.data, whole.data, size_t(whole.numel()), wire, ReduceOp::sum);
  ops->round_to_dtype(whole, lane);
}

// FP8-LM's automatic scaling, one bucket at a time: one scale per tensor from the MAX of every
// rank's amax (a small all-reduce of the bucket's tensors), with 1/ranks folded in so that
// the sum of all ranks' values stays in range; the codes then travel and are summed in FP32
// (all-to-all) or by the collective (reduce-scatter), and scaled back into this rank's part.
// A tensor lies in one bucket, so its scale, codes and sum do not depend on which lane, or in
// which order, the buckets are reduced: overlapped or not, the numbers are the same.
void TrainingEngine::State::reduce_fp8_bucket(size_t b, Communicator& comm, Ops::Lane lane) {
  const ShardPlan::Part& p = shard.parts[b];
  const size_t first = p.first_tensor, count = p.end_tensor - p.first_tensor;
  const int ranks = parallel.dp_size;
  float* grads = static_cast<float*>(model->gradients().data);  // FP32: the constructor checked
  const float* bucket_grads = grads + p.bucket_begin;
  float* amax = static_cast<float*>(tensor_amax->data()) + first;
  float* scale = static_cast<float*>(tensor_scale->data()) + first;
  float* scale_inv = static_cast<float*>(tensor_scale_inv->data()) + first;
  ops->tensor_amaxes(amax, bucket_grads, *bucket_tables[b], lane);
  comm.all_reduce(amax, amax, count, CommDtype::f32, ReduceOp::max);
  ops->scales_from_amaxes(scale, scale_inv, amax, int(count), fp8_max(grad_comm_dtype), float(ranks), lane);
  auto* codes = static_cast<uint8_t*>(grad_staging->data());
  ops->quantize_tensors(codes, bucket_grads, *bucket_tables[b], scale, nullptr, nullptr, grad_comm_dtype, lane);
  if (fp8_grad_reduce == GradReduceAlgorithm::all_to_all) {
    auto* received = static_cast<uint8_t*>(codes_received->data());
    comm.all_to_all(codes, received, p.size, CommDtype::u8);
    ops->sum_fp8_chunks(grads + p.part_begin, received, ranks, p.size, *part_tables[b], scale_inv, grad_comm_dtype,
                        lane);
  } else {
    const CommDtype wire = grad_comm_dtype == Fp8Dtype::e4m3 ? CommDtype::e4m3 : CommDtype::e5m2;
    uint8_t* own = codes + (p.part_begin - p.bucket_begin);
    comm.reduce_scatter(codes, own, p.size, wire, ReduceOp::sum);
    ops->sum_fp8_chunks(grads + p.part_begin, own, 1, p.size, *part_tables[b], scale_inv, grad_comm_dtype, lane);
  }
}

void TrainingEngine::State::reduce_gradients() {
  for (size_t b = 0; b < bucket_reduced.size(); ++b)
    if (!bucket_reduced[b]) reduce_bucket(b, /*overlapped=*/false);
  std::fill(bucket_reduced.begin(), bucket_reduced.end(), false);
  if (side_lane_busy) join_side_lane();
}

void TrainingEngine::State::join_side_lane() {
  ops->record(*side_mark, Ops::Lane::side);
  ops->wait(*side_mark, Ops::Lane::main);
  side_lane_busy = false;
}

// Every rank's updated weights on every rank, gathered in place in the working slab (BF16 on
// the GPU), or, under --fp8-param-gather, the Linear weights as FP8 codes, which each owner
// casts from its master part with the scale every rank agreed on, into its place among the
// codes. With an overlapped gather the casts and the gathers run on the side lane, bucket by
// bucket in slab order (the embedding first, which the next forward needs first; end_step
// may have started it already), and the weight operands are cast layer by layer behind them
// on the background lane (queue_weight_casts), or, for FP8 codes, as the next forward reaches
// them; otherwise now.
void TrainingEngine::State::publish_parameters(size_t first_bucket) {
  Ops& device = *ops;
  std::fill(refresh_pending.begin(), refresh_pending.end(), true);
  if (!sharded) {  // the master is the whole slab: nothing travels
    if (fp8_param_gather)
      device.quantize_tensors(static_cast<uint8_t*>(weight_codes->data()), master, *shard_table, device.scales(),
                              static_cast<const int*>(weight_state_of_tensor->data()), device.amax_history_row(),
                              forward_dtype(recipe.format));
  } else {
    const Ops::Lane lane = overlap_param_gather ? Ops::Lane::side : Ops::Lane::main;
    Communicator& comm = overlap_param_gather ? groups->dp_background() : dp();
    if (overlap_param_gather) {
      ops->record(*main_mark, Ops::Lane::main);
      ops->wait(*main_mark, Ops::Lane::side);
    }
    for (size_t b = first_bucket; b < shard.parts.size(); ++b) gather_bucket(b, comm, lane);
  }
  // Off the forward's path only where a cast needs nothing but the gathered values and the
  // step's scales: not the FP8 codes' own path, not current scaling (an amax pass first, and
  // a tensor-parallel MAX on the main lane's communicator).
  weights_cast_beside_forward = overlap_param_gather && fp8 && !fp8_param_gather &&
                                recipe.recipe == ScalingRecipe::delayed && !model->scaling().uses_current_scaling();
  if (weights_cast_beside_forward) queue_weight_casts();
  if (!overlap_param_gather)
    for (int layer = -1; layer <= model->config().n_layer; ++layer) cast_weights_of(layer);
}

void TrainingEngine::State::gather_bucket(size_t b, Communicator& comm, Ops::Lane lane) {
  Ops& device = *ops;
  const ShardPlan::Part& p = shard.parts[b];
  if (fp8_param_gather && p.linear_weights) {
    auto* codes = static_cast<uint8_t*>(weight_codes->data());
    const auto* state_of = static_cast<const int*>(weight_state_of_tensor->data());
    device.quantize_tensors(codes + p.part_begin, master + p.shard_offset, *part_tables[b], device.scales(),
                            state_of + p.first_tensor, device.amax_history_row(), forward_dtype(recipe.format), lane);
    comm.all_gather(codes + p.part_begin, codes + p.bucket_begin, p.size, CommDtype::u8);
  } else {
    const size_t act_bytes = device.element_bytes(activation_dtype());
    char* working = static_cast<char*>(model->working());
    comm.all_gather(working + p.part_begin * act_bytes, working + p.bucket_begin * act_bytes, p.size,
                    storage_dtype(device, activation_dtype()));
  }
  if (lane == Ops::Lane::side) ops->record(*gathered[b], Ops::Lane::side);
}

AdamWCall TrainingEngine::State::adamw_call(const TensorTable& table, const TensorTable* slab, size_t first_tensor,
                                            float* scratch, const AdamWHyperparams& hyperparams) {
  AdamWCall update;
  update.table = &table;
  update.slab_table = slab;  // sharded: the gradients and working values stay in the slabs
  update.master = master;
  update.working = working_update;
  update.working_offsets = model->working_offsets_on_backend();  // unsharded only (see the model's construction)
  FP8LM_CHECK(update.working_offsets == nullptr || (slab == nullptr && first_tensor == 0),
              "a working copy without the FP8 Linear weights is for the unsharded optimizer");
  update.grads = model->gradients();
  update.precision = state_precision;
  update.state = optimizer_slabs();
  if (update.state.m_scales) {
    update.state.m_scales += first_tensor;
    update.state.v_scales += first_tensor;
  }
  update.hyperparams = hyperparams;
  update.control = control();
  update.scratch = scratch;
  return update;
}

// AdamW's first pass over the tensors of the layers whose gradients are final (one rank, the
// last micro-batch), on the background lane, after what the main lane has queued so far.
void TrainingEngine::State::queue_first_pass() {
  if (first_pass_waiting.empty()) return;
  const AdamWCall call =
      adamw_call(*shard_table, nullptr, 0, static_cast<float*>(adamw_scratch->data()), first_pass_hyperparams);
  if (first_pass_layers_queued == 0) ops->adamw_first_pass_begin(call);
  ops->record(*main_mark, Ops::Lane::main);
  ops->wait(*main_mark, Ops::Lane::background);
  for (int layer : first_pass_waiting) {
    for (const Ops::TensorRange& range : first_pass_ranges[size_t(layer + 1)])
      ops->adamw_first_pass_part(call, range, Ops::Lane::background);
    ++first_pass_layers_queued;
  }
  first_pass_waiting.clear();
}

// Each layer's FP8 weight operands from its gathered working values, on the background lane
// behind the layer's gathers, in the forward's order, so that they leave the forward's path
// (four casts a layer, 2.7 ms of a gpt2-1558m step at DP = 2, device call 204; beside the
// forward's GEMMs they find room only in the gaps: the step gained about 0.4 ms, call 205).
// The forward's cast_weights_of waits for them.
void TrainingEngine::State::queue_weight_casts() {
  for (int layer = -1; layer <= model->config().n_layer; ++layer) {
    for (size_t b : buckets_of(layer)) ops->wait(*gathered[b], Ops::Lane::background);
    model->refresh_weight_operands(layer, /*fp8_linear_weights=*/true, Ops::Lane::background);
    ops->record(*weights_cast[size_t(layer + 1)], Ops::Lane::background);
  }
}

// The layer's gathered weights in use: wait for their buckets, and for the weight operands
// cast behind them, or cast them now.
void TrainingEngine::State::cast_weights_of(int layer) {
  if (!refresh_pending[size_t(layer + 1)]) return;
  refresh_pending[size_t(layer + 1)] = false;
  if (overlap_param_gather)
    for (size_t b : buckets_of(layer)) ops->wait(*gathered[b], Ops::Lane::main);
  if (weights_cast_beside_forward) {
    ops->wait(*weights_cast[size_t(layer + 1)], Ops::Lane::main);
    return;
  }
  model->refresh_weight_operands(layer, /*fp8_linear_weights=*/!fp8_param_gather && !weights_cast_in_update);
  if (!fp8_param_gather) return;
  const auto* codes = static_cast<const uint8_t*>(weight_codes->data());
  for (const WeightOperand& w : model->fp8_weight_operands())
    if (w.layer == layer) ops->fp8_weight_from_codes(w.operand, codes + model->layout().tensors()[w.tensor].offset);
}

void TrainingEngine::end_step(const AdamWHyperparams& hyperparams, double clip_grad, int64_t step) {
  State& s = *state_;
  Ops& ops = *s.ops;
  GptModel& model = *s.model;
  StepScalars* scalars = s.device_scalars();
  s.reduce_gradients();

  // The global norm over every rank's share (tensors replicated across tensor-parallel
  // ranks counted once; in AdamW's first pass where its table is the norm's), and the step's
  // loss over the data-parallel ranks: every rank takes the same decision. Sharded, each
  // data-parallel rank holds a piece of the reduced gradients; otherwise each holds all of
  // them, and only the tensor-parallel pieces add up.
  std::vector<AdamWCall> updates;
  if (s.update_groups.empty()) {
    updates.push_back(s.adamw_call(*s.shard_table, s.slab_table.get(), 0, static_cast<float*>(s.adamw_scratch->data()),
                                   hyperparams));
  } else {
    for (const State::UpdateGroup& group : s.update_groups)
      updates.push_back(s.adamw_call(*group.shard, group.slab.get(), group.first_tensor,
                                     static_cast<float*>(group.scratch->data()), hyperparams));
  }
  s.queue_first_pass();  // block 0's and the embedding's: no attention backward came after them
  if (s.first_pass_layers_queued > 0) {
    FP8LM_CHECK(s.first_pass_layers_queued == s.first_pass_ranges.size(), "AdamW's first pass ran for ",
                s.first_pass_layers_queued, " of ", s.first_pass_ranges.size(), " layers");
    FP8LM_CHECK(hyperparams.beta1 == s.first_pass_hyperparams.beta1 && hyperparams.beta2 == s.first_pass_hyperparams.beta2,
                "end_step: AdamW betas ", hyperparams.beta1, ", ", hyperparams.beta2,
                " differ from the run's --adam-beta1/--adam-beta2 (", s.first_pass_hyperparams.beta1, ", ",
                s.first_pass_hyperparams.beta2, "), with which the first pass ran in the backward");
    s.first_pass_layers_queued = 0;
    ops.record(*s.first_pass_done, Ops::Lane::background);
    ops.wait(*s.first_pass_done, Ops::Lane::main);
    ops.adamw_first_pass_finish(updates.front(), &scalars->sum_of_squares);
  } else if (s.norm_in_first_pass) {
    ops.adamw_moment_amaxes_and_norm(updates.front(), &scalars->sum_of_squares);
  } else if (s.norm_in_parts) {
    ops.grad_sum_of_squares_finish(&scalars->sum_of_squares, model.gradients(), *s.norm_table);
  } else {
    ops.grad_sum_of_squares(&scalars->sum_of_squares, model.gradients(), *s.norm_table);
  }
  Communicator& norm_group = s.sharded ? s.world() : s.groups->tp();
  if (norm_group.size() > 1)
    norm_group.all_reduce(&scalars->sum_of_squares, &scalars->sum_of_squares, 1, CommDtype::f64, ReduceOp::sum);
  if (s.dp().size() > 1) s.dp().all_reduce(&scalars->loss_sum, &scalars->loss_sum, 1, CommDtype::f32, ReduceOp::sum);
  ops.finalize_step(s.control(), &scalars->sum_of_squares, &scalars->loss_sum, s.step_loss_divisor(), clip_grad);

  // The FP8 scale update: THE place scales change (core/scaling.h). Before the optimizer, so
  // that its update pass can cast the next step's FP8 weights with them; nothing in the
  // update reads or records an FP8 scale or amax otherwise. Every rank's amaxes of
  // the step first become one row (the MAX), so every rank computes the same scales. A
  // skipped step discards its amaxes instead; both decide on the device (control->skip).
  if (s.fp8) {
    const int states = model.scaling().size();
    if (s.world().size() > 1 && states > 0)
      s.world().all_reduce(ops.amax_history_row(), ops.amax_history_row(), states, CommDtype::f32, ReduceOp::max);
    if (is_scale_update_step(s.recipe, step)) {
      ops.update_scales(s.control());
      model.scaling().mark_initialized();
    } else {
      ops.discard_current_amaxes(s.control());
    }
  }
  // The statistics of this step end here, before the weights of the next are cast; the next
  // step's start now, when it collects them, so that they count its weights' casts (which
  // then run after the update, op by op: the fused casts count nothing).
  s.stop_fp8_statistics(/*keep=*/s.counting_step == step);
  if (s.collects_fp8_statistics(step + 1)) s.start_fp8_statistics(step + 1);
  if (s.norm_in_first_pass) {
    ops.adamw_moment_amaxes_if_clipped(updates.front());
  } else {
    for (const AdamWCall& update : updates) ops.adamw_moment_amaxes(update);
  }
  // A tensor split across ranks gets one moment scale: the MAX of every part's amax.
  if (s.world().size() > 1 && s.state_precision == OptimizerStatePrecision::fp8_fp16) {
    for (const AdamWCall& update : updates) {
      const size_t tensors = update.table->layout().tensors().size();
      s.world().all_reduce(update.scratch, update.scratch, 2 * tensors, CommDtype::f32, ReduceOp::max);
    }
  }
  // Not while the scales are still current scaling's (the first steps of --fp8-interval > 1),
  // which need each weight's amax before its cast.
  s.weights_cast_in_update =
      s.weight_casts && !s.collects_fp8_statistics(step + 1) && !model.scaling().uses_current_scaling();
  if (s.weights_cast_in_update) updates.front().weight_casts = s.weight_casts.get();
  for (size_t i = 0; i < updates.size(); ++i) {
    ops.adamw_apply(updates[i]);
    if (i > 0 || updates.size() == 1) continue;
    // The embedding's part is updated: its gather starts on the side lane now, while AdamW
    // updates the rest on the main lane (other parts of the working slab).
    ops.record(*s.main_mark, Ops::Lane::main);
    ops.wait(*s.main_mark, Ops::Lane::side);
    s.gather_bucket(0, s.groups->dp_background(), Ops::Lane::side);
  }

  s.weights_from_refresh = false;
  s.next_step = step + 1;
  s.publish_parameters(/*first_bucket=*/s.update_groups.empty() ? 0 : 1);
  s.control_readback->capture(s.control());
}

bool TrainingEngine::collects_fp8_statistics(int64_t step) const { return state_->collects_fp8_statistics(step); }

std::vector<Fp8TensorStatistics> TrainingEngine::fp8_statistics() {
  State& s = *state_;
  FP8LM_CHECK(s.counted_step >= 0, "fp8_statistics: no step has collected FP8 statistics yet");
  const ScalingTable& table = s.model->scaling();
  const size_t states = size_t(table.size());
  const auto* counts = static_cast<const Fp8CastCounts*>(s.fp8_counts_readback->wait());
  // Every rank's counts summed (integers, exact in doubles below 2^53) and amaxes MAX-ed: a
  // data-parallel rank saw its own micro-batches, a tensor-parallel rank its part of a tensor.
  // [4][states]: elements, saturated, underflow, subnormal; then [2][states]: amax (NaN as 0),
  // and whether it was NaN.
  std::vector<double> sums(4 * states), maxima(2 * states);
  for (size_t k = 0; k < states; ++k) {
    sums[k] = double(counts[k].elements);
    sums[states + k] = double(counts[k].saturated);
    sums[2 * states + k] = double(counts[k].underflow);
    sums[3 * states + k] = double(counts[k].subnormal);
    const float amax = fp8_stats_amax(counts[k].amax_bits);
    maxima[k] = std::isnan(amax) ? 0.0 : double(amax);
    maxima[states + k] = std::isnan(amax) ? 1.0 : 0.0;
  }
  Communicator& world = s.host->world();
  if (world.size() > 1 && states > 0) {
    world.all_reduce(sums.data(), sums.data(), sums.size(), CommDtype::f64, ReduceOp::sum);
    world.all_reduce(maxima.data(), maxima.data(), maxima.size(), CommDtype::f64, ReduceOp::max);
  }
  std::vector<Fp8TensorStatistics> result;
  for (size_t k = 0; k < states; ++k) {
    if (sums[k] == 0.0) continue;  // not cast in the step (no rank holds a part of it)
    const float amax = maxima[states + k] > 0.0 ? std::nanf("") : float(maxima[k]);
    result.push_back(make_fp8_tensor_statistics(table.name(int(k)), table.dtype(int(k)), sums[k], sums[states + k],
                                                sums[2 * states + k], sums[3 * states + k], amax, counts[k].scale,
                                                table.config().margin));
  }
  return result;
}

StepMetrics TrainingEngine::step_metrics() {
  State& s = *state_;
  std::memcpy(&s.last_seen, s.control_readback->wait(), sizeof(StepControl));
  StepMetrics metrics;
  metrics.loss = s.last_seen.loss;
  metrics.grad_norm = s.last_seen.grad_norm;
  metrics.skipped = s.last_seen.skip != 0;
  return metrics;
}

TrainingEngine::SkipStatus TrainingEngine::skip_status() {
  State& s = *state_;
  if (s.control_readback->ready()) std::memcpy(&s.last_seen, s.control_readback->wait(), sizeof(StepControl));
  return SkipStatus{s.last_seen.total_skips, s.last_seen.consecutive_skips};
}

BatchLoss TrainingEngine::evaluate(const int32_t* inputs, const int32_t* targets) {
  State& s = *state_;
  return score_batch(*s.ops, *s.model, &s.device_scalars()->eval_loss_sum, s.host->dp(), s.reading(), inputs,
                     targets);
}

std::vector<BatchLoss> TrainingEngine::row_losses(const int32_t* inputs, const int32_t* targets) {
  State& s = *state_;
  return score_rows(*s.ops, *s.model, &s.device_scalars()->eval_loss_sum, s.reading(), inputs, targets);
}

uint32_t TrainingEngine::replica_checksum() {
  State& s = *state_;
  s.ops->synchronize();
  std::vector<uint8_t> bytes(s.model->working_bytes());
  s.ops->download(bytes.data(), s.model->working(), bytes.size());
  uint32_t crc = crc32(bytes.data(), bytes.size());
  if (!s.sharded && s.master != s.model->working()) {
    std::vector<float> master(s.shard.size);
    s.ops->download(master.data(), s.master, master.size() * sizeof(float));
    crc = crc32(master.data(), master.size() * sizeof(float), crc);
  }
  return crc;
}

void TrainingEngine::check_replicas_agree(int64_t iteration) {
  State& s = *state_;
  const uint32_t own = replica_checksum();
  Communicator& dp = s.host->dp();
  std::vector<uint32_t> all(size_t(dp.size()));
  dp.all_gather(&own, all.data(), sizeof own, CommDtype::u8);
  std::string differ;
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r) + " (" + crc32_hex(all[r]) + ")";
  if (!differ.empty())
    throw RuntimeError("--check-weight-hash-across-dp-replicas-interval: after iteration " + std::to_string(iteration) +
                           ", data-parallel ranks " + differ + " hold other weights than rank 0 (" +
                           crc32_hex(all[0]) + ") in tensor-parallel rank " + std::to_string(s.parallel.tp_rank) +
                           "'s replicas",
                       "a replica's memory or arithmetic went wrong (fp8lm's steps are deterministic): resume from "
                       "the last checkpoint, and check that GPU");
}

// ---- Snapshots in the canonical layout --------------------------------------------------

template <typename T>
std::vector<T> TrainingEngine::State::gather_canonical(const void* shard_values) {
  const TensorLayout& slab = model->layout();
  std::vector<T> values(shard.size);
  ops->download(values.data(), shard_values, values.size() * sizeof(T));
  // This tensor-parallel rank's slab: every data-parallel rank's parts.
  std::vector<T> own(slab.total_elements(), T{});
  if (sharded) {
    std::vector<T> all(values.size() * size_t(parallel.dp_size));
    host->dp().all_gather(values.data(), all.data(), values.size() * sizeof(T), CommDtype::u8);
    for (int r = 0; r < parallel.dp_size; ++r)
      for (const ShardPlan::Part& p : shard.parts)
        std::copy_n(all.begin() + size_t(r) * values.size() + p.shard_offset, p.size,
                    own.begin() + p.bucket_begin + size_t(r) * p.size);
  } else {
    own = std::move(values);
  }
  // Every tensor-parallel rank's parts into whole tensors.
  std::vector<T> slabs(own.size() * size_t(parallel.tp_size));
  host->tp().all_gather(own.data(), slabs.data(), own.size() * sizeof(T), CommDtype::u8);
  std::vector<T> canonical(this->canonical.total_elements(), T{});
  for (const TensorInfo& t : slab.tensors()) {
    const TensorInfo* whole = this->canonical.find(t.name);
    for (int r = 0; r < parallel.tp_size; ++r)
      copy_part_to_full(t, slabs.data() + size_t(r) * own.size() + t.offset, canonical.data() + whole->offset, r,
                        parallel.tp_size);
  }
  return canonical;
}

template <typename T>
std::vector<T> TrainingEngine::State::slab_from_canonical(const std::vector<T>& canonical_values) {
  const TensorLayout& slab = model->layout();
  FP8LM_CHECK(canonical_values.size() == canonical.total_elements(), "a snapshot of ", canonical_values.size(),
              " values for a canonical slab of ", canonical.total_elements());
  std::vector<T> own(slab.total_elements(), T{});
  for (const TensorInfo& t : slab.tensors())
    copy_part_from_full(t, canonical_values.data() + canonical.find(t.name)->offset, own.data() + t.offset,
                        parallel.tp_rank, parallel.tp_size);
  return own;
}

template <typename T>
std::vector<T> TrainingEngine::State::shard_parts(std::span<const T> own) {
  std::vector<T> part(shard.size, T{});
  for (const ShardPlan::Part& p : shard.parts)
    std::copy_n(own.begin() + p.part_begin, p.size, part.begin() + p.shard_offset);
  return part;
}

template <typename T>
std::vector<T> TrainingEngine::State::shard_from_canonical(const std::vector<T>& canonical_values) {
  std::vector<T> own = slab_from_canonical(canonical_values);
  return sharded ? shard_parts<T>(own) : own;
}

HostValues TrainingEngine::State::initial_slab(const GptConfig& config, uint64_t seed) {
  const TensorLayout& slab = model->layout();
  const auto began = std::chrono::steady_clock::now();
  HostValues own = HostValues::zeros(slab.total_elements());
  startup.zero_host_values = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  for (const TensorInfo& t : slab.tensors()) {
    const size_t index = size_t(canonical.index_of(t.name));
    init_gpt_tensor_part(own.data() + t.offset, canonical.tensors()[index], index, config, seed, t, parallel.tp_rank,
                         parallel.tp_size);
  }
  return own;
}

// The working copy can be gathered in place from the ranks' shards when it is the whole slab
// in its own order and travels as values (under --fp8-param-gather the Linear weights travel
// as FP8 codes, whose scales the first step sets: that start draws the slab).
bool TrainingEngine::State::draws_shard_only() const {
  return sharded && !fp8_param_gather && master != model->working() && model->working_offsets_on_backend() == nullptr;
}

HostValues TrainingEngine::State::initial_shard(const GptConfig& config, uint64_t seed) {
  const TensorLayout& slab = model->layout();
  const auto began = std::chrono::steady_clock::now();
  HostValues values = HostValues::zeros(shard.size);  // the buckets' padding stays 0, as in the slab
  startup.zero_host_values = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  for (const ShardPlan::Part& p : shard.parts) {
    const size_t part_end = p.part_begin + p.size;
    for (const TensorInfo& t : slab.tensors()) {
      const size_t first = std::max(p.part_begin, t.offset), last = std::min(part_end, t.offset + size_t(t.numel));
      if (first >= last) continue;
      const size_t index = size_t(canonical.index_of(t.name));
      init_gpt_tensor_part_range(values.data() + p.shard_offset + (first - p.part_begin), canonical.tensors()[index],
                                 index, config, seed, t, parallel.tp_rank, parallel.tp_size, first - t.offset,
                                 last - t.offset);
    }
  }
  return values;
}

void TrainingEngine::State::set_shard_parameters(std::span<const float> shard_values) {
  ops->synchronize();
  FP8LM_CHECK(draws_shard_only() && shard_values.size() == shard.size, "set_shard_parameters: ", shard_values.size(),
              " values for a shard of ", shard.size);
  ops->upload(master, shard_values.data(), shard_values.size() * sizeof(float));
  // This rank's part of each bucket in the working copy, rounded as set_working_values rounds
  // the whole slab; then every rank's parts on every rank.
  const DType working_dtype = activation_dtype();
  char* working = static_cast<char*>(model->working());
  for (const ShardPlan::Part& p : shard.parts) {
    Tensor part;
    part.data = working + p.part_begin * ops->element_bytes(working_dtype);
    part.dtype = working_dtype;
    part.rows = 1;
    part.cols = int64_t(p.size);
    ops->upload_values(part, shard_values.data() + p.shard_offset);
  }
  for (size_t b = 0; b < shard.parts.size(); ++b) gather_bucket(b, dp(), Ops::Lane::main);
  stop_fp8_statistics(/*keep=*/false);
  model->refresh_weight_operands();
  weights_from_refresh = true;
  std::fill(refresh_pending.begin(), refresh_pending.end(), false);
  ops->synchronize();
}

// Per-tensor scales between the model's tensor order and the canonical one (every rank of
// a tensor holds the same scale: the step agrees on it).
std::vector<float> TrainingEngine::State::canonical_tensor_scales(const float* memory_order) {
  std::vector<float> local(tensor_count());
  ops->download(local.data(), memory_order, local.size() * sizeof(float));
  std::vector<float> result(canonical.tensors().size(), 1.0f);
  const auto& tensors = model->layout().tensors();
  for (size_t k = 0; k < tensors.size(); ++k) result[canonical.index_of(tensors[k].name)] = local[k];
  return result;
}

std::vector<float> TrainingEngine::State::memory_tensor_scales(const std::vector<float>& canonical_order) {
  std::vector<float> result(tensor_count(), 1.0f);
  const auto& tensors = model->layout().tensors();
  for (size_t k = 0; k < tensors.size(); ++k) result[k] = canonical_order.at(canonical.index_of(tensors[k].name));
  return result;
}

std::vector<float> TrainingEngine::parameters() {
  State& s = *state_;
  s.ops->synchronize();
  return s.gather_canonical<float>(s.master);
}

std::vector<float> TrainingEngine::gradients() {
  State& s = *state_;
  s.ops->synchronize();
  std::vector<float> own(s.model->layout().total_elements());
  s.ops->download_values(own.data(), s.model->gradients());
  std::vector<float> canonical(s.canonical.total_elements(), 0.0f);
  for (const TensorInfo& t : s.model->layout().tensors())
    copy_part_to_full(t, own.data() + t.offset, canonical.data() + s.canonical.find(t.name)->offset,
                      s.parallel.tp_rank, s.parallel.tp_size);
  return canonical;
}

void TrainingEngine::set_parameters(const std::vector<float>& values) {
  state_->set_slab_parameters(state_->slab_from_canonical(values));
}

void TrainingEngine::State::set_slab_parameters(std::span<const float> own) {
  ops->synchronize();
  FP8LM_CHECK(own.size() == model->layout().total_elements(), "set_slab_parameters: ", own.size(), " values for ",
              model->layout().total_elements(), " slab elements");
  model->set_working_values(own.data());
  if (master != model->working()) {
    if (sharded) {
      const std::vector<float> part = shard_parts<float>(own);
      ops->upload(master, part.data(), part.size() * sizeof(float));
    } else {
      ops->upload(master, own.data(), own.size() * sizeof(float));
    }
  }
  // Every rank holds the whole weights here: every operand is cast from them now (uncounted:
  // a step that collects FP8 statistics counts them again at its start).
  stop_fp8_statistics(/*keep=*/false);
  model->refresh_weight_operands();
  weights_from_refresh = true;
  std::fill(refresh_pending.begin(), refresh_pending.end(), false);
  ops->synchronize();
}

OptimizerSnapshot TrainingEngine::optimizer_state() {
  State& s = *state_;
  s.ops->synchronize();
  OptimizerSnapshot snapshot;
  snapshot.precision = s.state_precision;
  if (s.state_precision == OptimizerStatePrecision::fp8_fp16) {
    snapshot.m8 = s.gather_canonical<uint8_t>(s.m_codes->data());
    snapshot.v16 = s.gather_canonical<uint16_t>(s.v_bits->data());
    snapshot.m_scales = s.canonical_tensor_scales(static_cast<const float*>(s.m_scales->data()));
    snapshot.v_scales = s.canonical_tensor_scales(static_cast<const float*>(s.v_scales->data()));
  } else {
    snapshot.m32 = s.gather_canonical<float>(s.m32->data());
    snapshot.v32 = s.gather_canonical<float>(s.v32->data());
  }
  snapshot.step_count = s.read_control().step_count;
  return snapshot;
}

void TrainingEngine::set_optimizer_state(const OptimizerSnapshot& snapshot) {
  State& s = *state_;
  FP8LM_CHECK(snapshot.precision == s.state_precision);
  s.ops->synchronize();
  auto put = [&](const auto& canonical_values, const std::unique_ptr<Allocation>& allocation) {
    const auto values = s.shard_from_canonical(canonical_values);
    s.ops->upload(allocation->data(), values.data(), values.size() * sizeof(values[0]));
  };
  if (s.state_precision == OptimizerStatePrecision::fp8_fp16) {
    put(snapshot.m8, s.m_codes);
    put(snapshot.v16, s.v_bits);
    const std::vector<float> m_scales = s.memory_tensor_scales(snapshot.m_scales);
    const std::vector<float> v_scales = s.memory_tensor_scales(snapshot.v_scales);
    s.ops->upload(s.m_scales->data(), m_scales.data(), m_scales.size() * sizeof(float));
    s.ops->upload(s.v_scales->data(), v_scales.data(), v_scales.size() * sizeof(float));
  } else {
    put(snapshot.m32, s.m32);
    put(snapshot.v32, s.v32);
  }
  StepControl control = s.read_control();
  control.step_count = snapshot.step_count;
  s.ops->set_step_control(s.control(), control);
  s.ops->synchronize();
}

ScalingSnapshot TrainingEngine::scaling_state() {
  State& s = *state_;
  ScalingTable& table = s.model->scaling();
  // An overlapped FP8 weight gather casts on the side lane, recording the weights' amaxes
  // into this row: the all-reduce below must come after it.
  s.join_side_lane();
  // So do the weight casts queued behind the BF16 gathers, on the background lane.
  if (s.weights_cast_beside_forward) s.ops->wait(*s.weights_cast.back(), Ops::Lane::main);
  // The amaxes recorded since the last update (the weights') are this rank's parts: the
  // row every rank would agree on at the next step is what is saved.
  if (s.world().size() > 1 && table.size() > 0)
    s.world().all_reduce(s.ops->amax_history_row(), s.ops->amax_history_row(), table.size(), CommDtype::f32,
                         ReduceOp::max);
  s.ops->synchronize();
  s.ops->download_scaling();
  return scaling_table_snapshot(*s.model);
}

void TrainingEngine::set_scaling_state(const ScalingSnapshot& snapshot) {
  State& s = *state_;
  restore_scaling_table(*s.ops, *s.model, snapshot);
  // The weight operands must be cast with the restored weight scales. Recording the
  // weight amaxes again is idempotent: the saved row 0 already holds them.
  s.stop_fp8_statistics(/*keep=*/false);
  s.model->refresh_weight_operands();
  s.weights_from_refresh = true;
  s.ops->synchronize();
}

void TrainingEngine::set_total_skips(int64_t total) {
  State& s = *state_;
  s.ops->synchronize();
  StepControl control = s.read_control();
  control.total_skips = static_cast<int>(total);
  control.consecutive_skips = 0;
  s.ops->set_step_control(s.control(), control);
  s.ops->synchronize();
  s.last_seen = control;
}

OpProfiler* TrainingEngine::op_profiler() { return state_->op_profiler; }

BenchmarkMemory TrainingEngine::benchmark_memory() const {
  const State& s = *state_;
  BenchmarkMemory memory;
  memory.allocated_bytes = s.allocated_bytes();
  memory.device_used_bytes = s.ops->device_memory_in_use();
  memory.optimizer_bytes = s.optimizer_bytes();
  memory.communication_bytes = s.communication_bytes();
  return memory;
}

SettingsTable TrainingEngine::describe() const {
  const State& s = *state_;
  SettingsTable rows = s.model->memory_table();
  rows.push_back({"optimizer: FP32 master + state (" + std::string(to_string(s.state_precision)) + ")" +
                      (s.sharded ? ", this rank's 1/" + std::to_string(s.parallel.dp_size) : ""),
                  format_mib(s.optimizer_bytes())});
  rows.push_back({"optimizer state bytes / parameter",
                  s.state_precision == OptimizerStatePrecision::fp8_fp16 ? "3 (E4M3 m + FP16 v) + 4 FP32 master"
                                                                         : "8 (FP32 m + v) + 4 FP32 master"});
  if (s.communication_bytes()) rows.push_back({"communication buffers", format_mib(s.communication_bytes())});
  rows.push_back({"backend workspaces", format_mib(s.ops->workspace_bytes())});
  rows.push_back({"estimated peak memory (this rank)", format_mib(s.allocated_bytes())});
  // The start-up estimate beside what was measured once everything is allocated.
  const bool device = s.ops->stream_handle() != nullptr;
  for (auto& row : measured_memory_rows(s.memory_estimate, "engine allocations", s.allocated_bytes(), device,
                                        device ? s.ops->device_memory_in_use() : 0))
    rows.push_back(std::move(row));
  return rows;
}

std::unique_ptr<TrainingEngine> make_engine(const RunSetup& setup, const ParallelLayout& layout, ParameterStart start) {
  return std::make_unique<TrainingEngine>(setup, layout, start);
}

}  // namespace fp8lm
