#include "apps/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>

#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/evaluator.h"
#include "apps/signals.h"
#include "core/choice_eval.h"
#include "core/error.h"
#include "core/indexed_dataset.h"
#include "core/loss_mask.h"
#include "core/mock_data.h"
#include "core/token_data.h"
#include "optim/lr_schedule.h"
#include "parallel/watchdog.h"

namespace fp8lm {

namespace {

struct DataLoaders {
  std::optional<DataLoader> train;
  std::optional<DataLoader> valid;
  // Scored once, at the end of training: --test-data-path, or the test part of --data-path's
  // --split when it holds a global micro-batch (Megatron's do_test).
  std::optional<DataLoader> test;
  std::vector<ChoiceExample> choices;  // --hellaswag-path
};

// --hellaswag-path's examples, read and checked before any work (each must fit a row).
std::vector<ChoiceExample> open_choices(const RunSetup& setup) {
  const TrainOptions& o = setup.options;
  if (o.hellaswag_path.empty()) return {};
  return read_choice_file(o.hellaswag_path, setup.model.vocab_size, setup.seq_length);
}

DataLoaders open_data(const RunSetup& setup) {
  const TrainOptions& o = setup.options;
  DataLoaderOptions loader_options;
  loader_options.micro_batch_size = o.micro_batch_size;
  loader_options.seq_len = setup.seq_length;
  loader_options.vocab_size = setup.model.vocab_size;
  loader_options.seed = o.seed;
  loader_options.data_parallel_rank = setup.data_parallel_rank;
  loader_options.data_parallel_size = setup.data_parallel_size;
  loader_options.format = o.data_format;
  loader_options.loss_mask_token = setup.loss_mask_token;

  DataLoaders loaders;
  DataLoaderOptions valid_options = loader_options;
  valid_options.shuffle = false;  // the same batches at every evaluation
  // Megatron's per-split datasets are their split whole.
  constexpr std::array<double, 3> kWholeTrain = {1, 0, 0}, kWholeValid = {0, 1, 0}, kWholeTest = {0, 0, 1};
  if (o.mock_data) {
    MockDataLoaders mock = make_mock_data_loaders(loader_options);
    loaders.train.emplace(std::move(mock.train));
    if (o.valid_data_path.empty() && o.valid_data_blend.empty()) loaders.valid.emplace(std::move(mock.valid));
  } else if (!o.train_data_blend.empty()) {
    loaders.train = open_indexed_loader(parse_data_path(o.train_data_blend, "--train-data-path"), kWholeTrain,
                                        DataSplit::train, loader_options);
  } else if (!o.data_path.empty()) {
    // Megatron indexed datasets: the train and valid splits of each, blended by weight.
    const DataBlend blend = parse_data_path(o.data_path);
    const auto split = parse_split(o.split);
    loaders.train = open_indexed_loader(blend, split, DataSplit::train, loader_options);
    loaders.valid = open_indexed_loader(blend, split, DataSplit::valid, valid_options);
    if (o.command == RunCommand::train && o.eval_iters > 0) {
      const uint64_t micro_batch = uint64_t(o.micro_batch_size) * uint64_t(setup.data_parallel_size);
      if (indexed_split_holds(blend, split, DataSplit::test, setup.seq_length, micro_batch))
        loaders.test = open_indexed_loader(blend, split, DataSplit::test, valid_options);
      else if (split[2] > 0)
        spdlog::info("--split {}: the test part of --data-path holds less than one global micro-batch ({} samples of "
                     "{} tokens); no test evaluation",
                     o.split, micro_batch, setup.seq_length);
    }
  } else if (!o.train_data_path.empty()) {  // evaluation alone reads no training data
    loaders.train.emplace(expand_shard_paths(o.train_data_path), loader_options);
  }
  loaders.choices = open_choices(setup);
  if (!o.valid_data_path.empty()) loaders.valid.emplace(expand_shard_paths(o.valid_data_path), valid_options);
  if (!o.valid_data_blend.empty())
    loaders.valid = open_indexed_loader(parse_data_path(o.valid_data_blend, "--valid-data-path"), kWholeValid,
                                        DataSplit::valid, valid_options);
  if (!o.test_data_path.empty()) loaders.test.emplace(expand_shard_paths(o.test_data_path), valid_options);
  if (!o.test_data_blend.empty())
    loaders.test = open_indexed_loader(parse_data_path(o.test_data_blend, "--test-data-path"), kWholeTest,
                                       DataSplit::test, valid_options);
  return loaders;
}

// The validation loss: `eval_iters` batches from the start of the validation data, the sum of
// their token losses over the tokens counted (every token, or the unmasked ones under
// --eod-mask-loss, as Megatron's evaluation). Training's periodic evaluation and `fp8lm eval`
// both call it, so a checkpoint's evaluation reproduces the loss its run logged.
BatchLoss validation_loss(BatchScorer& model, DataLoader& valid, int64_t eval_iters, int micro_batch_size,
                          int seq_length, Watchdog* watchdog) {
  std::vector<int32_t> inputs(size_t(micro_batch_size) * seq_length), targets(inputs.size());
  valid.reset();
  BatchLoss total;
  for (int64_t i = 0; i < eval_iters; ++i) {
    valid.next_batch(inputs.data(), targets.data());
    const BatchLoss batch = model.evaluate(inputs.data(), targets.data());
    total.sum += batch.sum;
    total.tokens += batch.tokens;
    if (watchdog) watchdog->heartbeat();
  }
  return total;
}

// Multiple-choice accuracy (core/choice_eval.h): data-parallel rank r scores examples r, r +
// dp, ..., their completions one row each, B rows a batch (so any micro-batch size will do).
// Every rank runs as many batches as the busiest (the rest of its rows fully masked), so that
// each forward's tensor-parallel collectives meet; the counts are summed over the data-parallel
// ranks on the host.
ChoiceAccuracy choice_accuracy(BatchScorer& model, const std::vector<ChoiceExample>& examples, int B, int T,
                               int dp_rank, int dp_size, Watchdog* watchdog) {
  struct Row {
    size_t example;
    int ending;
  };
  std::vector<Row> rows;  // this rank's, in order
  for (size_t e = size_t(dp_rank); e < examples.size(); e += size_t(dp_size))
    for (size_t k = 0; k < examples[e].endings.size(); ++k) rows.push_back({e, int(k)});
  Communicator& dp = model.host_groups().dp();
  double batches = double((rows.size() + size_t(B) - 1) / size_t(B));
  dp.all_reduce(&batches, &batches, 1, CommDtype::f64, ReduceOp::max);
  std::vector<int32_t> inputs(size_t(B) * T), targets(inputs.size());
  std::vector<double> mean_losses(rows.size());
  for (size_t i = 0; i < size_t(batches); ++i) {
    std::fill(inputs.begin(), inputs.end(), 0);
    std::fill(targets.begin(), targets.end(), kMaskedTarget);
    const size_t first = i * size_t(B), end = std::min(rows.size(), first + size_t(B));
    for (size_t r = first; r < end; ++r)
      fill_choice_row(examples[rows[r].example], rows[r].ending, T, inputs.data() + (r - first) * T,
                      targets.data() + (r - first) * T);
    const std::vector<BatchLoss> losses = model.row_losses(inputs.data(), targets.data());
    for (size_t r = first; r < end; ++r) mean_losses[r] = losses[r - first].mean();
    if (watchdog) watchdog->heartbeat();
  }
  double counts[2] = {0.0, 0.0};  // correct, examples
  for (size_t r = 0; r < rows.size(); r += examples[rows[r].example].endings.size()) {
    const ChoiceExample& example = examples[rows[r].example];
    counts[0] += predicted_choice({mean_losses.data() + r, example.endings.size()}) == example.label;
    counts[1] += 1;
  }
  dp.all_reduce(counts, counts, 2, CommDtype::f64, ReduceOp::sum);
  return ChoiceAccuracy{.correct = int64_t(counts[0]), .examples = int64_t(counts[1])};
}

// "42.1s", "3m07s", "2h05m": the progress line's elapsed time and ETA.
std::string format_duration(double seconds) {
  char text[32];
  if (!(seconds >= 0.0)) return "?";
  if (seconds < 60.0) {
    std::snprintf(text, sizeof text, "%.1fs", seconds);
  } else if (seconds < 3600.0) {
    const long whole = long(seconds);
    std::snprintf(text, sizeof text, "%ldm%02lds", whole / 60, whole % 60);
  } else {
    const long minutes = long(seconds / 60.0);
    std::snprintf(text, sizeof text, "%ldh%02ldm", minutes / 60, minutes % 60);
  }
  return text;
}

// The JSONL metrics file. Each line is one write(2) on an O_APPEND descriptor, so no stdio
// buffer is lost when the process dies and every failure is seen where it happens: a metrics
// write that fails (a full disk, /dev/full, `ulimit -f`) ends the run with an error naming the
// file, instead of every metric vanishing behind an exit 0.
class MetricsFile {
 public:
  // Only the first rank of a parallel run writes it (every rank has the same numbers). Opened
  // at start-up, so an unusable path fails before any work.
  MetricsFile(const std::string& path, bool writer) : path_(path) {
    if (path.empty() || !writer) return;
    // O_NONBLOCK for the open only: a FIFO without a reader fails (ENXIO) instead of hanging.
    fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, 0644);
    if (fd_ < 0) {
      throw InputError(detail::concat("--metrics-file ", path, ": cannot open for appending (", std::strerror(errno),
                                      ")"),
                       "pass a file in a writable directory");
    }
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  }
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;
  ~MetricsFile() {
    if (fd_ >= 0) ::close(fd_);  // an error path is already being reported
  }

  void write(const nlohmann::json& line) {
    if (fd_ < 0) return;
    const std::string text = line.dump() + '\n';
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t wrote = ::write(fd_, text.data() + done, text.size() - done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote == 0) errno = EIO;  // no progress and no reason given
      if (wrote <= 0) fail("write failed");
      done += size_t(wrote);
    }
  }
  // Closes the file, checked: some filesystems (NFS) report a failed write only here.
  void close() {
    if (fd_ < 0) return;
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) fail("close failed");
  }

 private:
  [[noreturn]] void fail(const char* what) {
    const int error = errno;
    throw RuntimeError(detail::concat("--metrics-file ", path_, ": ", what, " (", std::strerror(error), ")"),
                       "free space on its filesystem, or pass another --metrics-file");
  }

  std::string path_;
  int fd_ = -1;
};

// --save must name a directory fp8lm can create files in, or a path where one can be made.
// Checked at start-up, so a typo, a regular file or a read-only mount fails now rather than
// at the first save, possibly hours in. A probe file proves it: permission bits alone do not
// tell (root, read-only mounts, ACLs).
void check_save_directory_writable(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string flag = "--save " + dir;
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  fs::path existing = dir;
  if (fs::exists(status)) {
    if (!fs::is_directory(status)) {
      throw InputError(flag + ": exists and is not a directory", "--save names the checkpoint directory");
    }
  } else {
    // The directory will be created at the first save: its nearest existing ancestor must be
    // a directory that accepts new entries.
    existing = fs::path(dir).lexically_normal();
    while (!fs::exists(existing, error)) {
      const fs::path parent = existing.parent_path();
      if (parent.empty()) {  // a relative path: the working directory
        existing = ".";
        break;
      }
      if (parent == existing) break;  // the root
      existing = parent;
    }
    if (!fs::is_directory(existing, error)) {
      throw InputError(flag + ": cannot be created, " + existing.string() + " is not a directory");
    }
  }
  std::string probe = (existing / ".fp8lm-write-test-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    throw InputError(detail::concat(flag, ": cannot create files in ", existing.string(), " (", std::strerror(errno),
                                    ")"),
                     "pass a writable checkpoint directory");
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

// The benchmark's timing of the steps after warm-up. Without --profile-ops the window is
// timed whole, with one wait for the device at each end, as the PyTorch peer times its steps:
// the host prepares step n + 1 (data, token index) while the device runs step n, as in
// training. --profile-ops waits after every step to collect its profile, so there the median
// of the synchronised steps is reported, the host's work between them included.
struct BenchmarkTiming {
  double step_ms = 0.0;
  int64_t steps = 0;
  std::string method;  // "mean over the window" or "median of synchronised steps"
};

// The median step after warm-up, tokens/s, MFU (PaLM / nanoGPT / llm.c's FLOP count:
// 6N + 12 L T C per token, over H100 SXM's dense BF16 peak of 989 TFLOP/s) and peak
// memory, as a table and one JSON line.
void report_benchmark(const RunSetup& setup, TrainingEngine& engine, const BenchmarkTiming& timing, double loss,
                      int64_t steps_run, double engine_seconds) {
  const TrainOptions& o = setup.options;
  // Every step sends the same bytes: the counters over the run, per step, for this rank.
  nlohmann::json bytes_per_step = nlohmann::json::object();
  for (const auto& [group, traffic] : engine.traffic())
    bytes_per_step[group] = double(traffic.total_bytes_sent()) / double(std::max<int64_t>(steps_run, 1));
  // The step's slowest rank sets the pace: every rank's time, the largest.
  double median_ms = timing.step_ms;
  Communicator& world = engine.host_groups().world();
  world.all_reduce(&median_ms, &median_ms, 1, CommDtype::f64, ReduceOp::max);
  const BenchmarkMemory memory = engine.benchmark_memory();
  // Largest rank of each: peak slabs, device memory in use, and the optimizer's share (the
  // FP32 master and the moments; a 1/DP shard each under the distributed optimizer).
  double largest[3] = {double(memory.allocated_bytes), double(memory.device_used_bytes), double(memory.optimizer_bytes)};
  world.all_reduce(largest, largest, 3, CommDtype::f64, ReduceOp::max);
  const double peak = largest[0], device_used = largest[1], optimizer = largest[2];
  if (world.rank() != 0) return;
  const GptConfig& m = setup.model;
  const int gpus = setup.parallel.world_size;
  const double tokens = double(setup.global_batch_size) * setup.seq_length;
  const double flops_per_token = m.training_flops_per_token(setup.seq_length);
  const double tokens_per_s = tokens / (median_ms * 1e-3);
  const double mfu = flops_per_token * tokens_per_s / 989e12;
  const std::string mode = o.precision_name();
  log_settings_table("benchmark", {{"mode", mode},
                                   {"model", m.name},
                                   {"micro-batch x seq-length", std::to_string(o.micro_batch_size) + " x " + std::to_string(setup.seq_length)},
                                   {"timed steps", std::to_string(timing.steps) + " (" + timing.method + ")"},
                                   {"median step", std::to_string(median_ms) + " ms"},
                                   {"ranks (tp x dp)", std::to_string(setup.parallel.tp_size) + " x " + std::to_string(setup.parallel.dp_size)},
                                   {"tokens/s (all ranks)", std::to_string(tokens_per_s)},
                                   {"tokens/s per GPU", std::to_string(tokens_per_s / gpus)},
                                   {"MFU per GPU (of 989 TFLOP/s BF16)", std::to_string(mfu / gpus)},
                                   {"peak memory per rank (fp8lm slabs)", std::to_string(peak / 1073741824.0) + " GiB"},
                                   {"device memory in use (largest rank)", std::to_string(device_used / 1073741824.0) + " GiB"},
                                   {"optimizer memory per rank (master + moments)", std::to_string(optimizer / 1073741824.0) + " GiB"},
                                   {"bytes sent per step (rank 0)", bytes_per_step.dump()}});
  const nlohmann::json line = {{"peer", "fp8lm-" + mode},
                               {"model", m.name},
                               {"params", m.num_parameters()},
                               {"B", o.micro_batch_size},
                               {"T", setup.seq_length},
                               {"tp", setup.parallel.tp_size},
                               {"dp", setup.parallel.dp_size},
                               {"flags", o.fp8_grad_comm ? "fp8-grad-comm" : o.grad_reduce_in_bf16 ? "bf16-grads" : "fp32-grads"},
                               {"fp8_param_gather", o.fp8_param_gather},
                               {"sequence_parallel", o.sequence_parallel},
                               {"distributed_optimizer", setup.parallel.dp_size > 1 && o.use_distributed_optimizer.value_or(true)},
                               {"overlap", o.overlap_grad_reduce || o.overlap_param_gather},
                               {"step_ms", median_ms},
                               {"timing", timing.method},
                               {"tok_s", tokens_per_s},
                               {"tok_s_per_gpu", tokens_per_s / gpus},
                               {"tflops", flops_per_token * tokens_per_s / 1e12},
                               {"mfu_bf16", mfu / gpus},
                               {"peak_gib", peak / 1073741824.0},
                               {"device_used_gib", device_used / 1073741824.0},
                               {"optimizer_gib", optimizer / 1073741824.0},
                               {"bytes_per_step", bytes_per_step},
                               {"startup_s", {{"engine", engine_seconds},
                                              {"draw_initial_values", engine.startup_seconds().draw_initial_values},
                                              {"zero_host_values", engine.startup_seconds().zero_host_values},
                                              {"set_parameters", engine.startup_seconds().set_parameters}}},
                               {"loss", loss}};
  std::printf("%s\n", line.dump().c_str());
  if (const OpProfiler* profiler = engine.op_profiler()) log_op_profile(*profiler, median_ms, "step", setup.use_cuda);
  std::fflush(stdout);
}

}  // namespace

TrainingSummary run_training(const RunSetup& initial_setup, Watchdog* watchdog) {
  const auto run_start = std::chrono::steady_clock::now();  // --exit-duration-in-mins counts from here
  // The run's set-up; --fp8-auto-precision adds to its BF16 blocks as the run goes, and the
  // engines built after a switch and the checkpoints take it from here.
  RunSetup setup = initial_setup;
  const TrainOptions& o = setup.options;
  // The outputs first: an unusable --save or --metrics-file fails before any work. The first
  // rank writes both.
  const bool first_rank = setup.parallel.world_rank == 0;
  if (first_rank && !o.save_dir.empty()) check_save_directory_writable(o.save_dir);
  // The first rank writes the checkpoints, so it holds the --save directory's lock for the
  // run: a second run saving there fails now, naming this one.
  std::optional<SaveDirectoryLock> save_lock;
  if (first_rank && !o.save_dir.empty()) save_lock.emplace(o.save_dir);
  MetricsFile metrics_file(o.metrics_file, first_rank);
  if (o.num_threads > 0) omp_set_num_threads(o.num_threads);
  DataLoaders data = open_data(setup);
  if (!data.train) throw InputError("--train-data-path is required (or --mock-data for a synthetic token stream)");
  spdlog::info("train data: {} shard(s), {} tokens, {} samples per epoch", data.train->num_shards(),
               data.train->num_tokens(), data.train->samples_per_epoch());
  if (!data.valid && o.eval_interval > 0 && o.eval_iters > 0)
    spdlog::info("no --valid-data-path: {}", data.choices.empty() ? "evaluation is off"
                                                                  : "evaluations score --hellaswag-path only");

  const auto engine_began = std::chrono::steady_clock::now();
  std::unique_ptr<TrainingEngine> engine = make_engine(setup, setup.parallel);
  const double engine_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - engine_began).count();
  {
    const TrainingEngine::StartupSeconds startup = engine->startup_seconds();
    spdlog::info("engine ready in {:.1f} s: initial values drawn in {:.1f} s (host memory zeroed in {:.1f} s), set on "
                 "the backend in {:.1f} s",
                 engine_seconds, startup.draw_initial_values, startup.zero_host_values, startup.set_parameters);
  }
  // The watchdog polls the engine's NCCL communicators while they live (and stops before
  // the engine destroys them: this guard goes first).
  struct Watched {
    Watchdog* watchdog;
    std::vector<ncclComm_t> comms;
    ~Watched() {
      if (watchdog)
        for (ncclComm_t comm : comms) watchdog->unwatch(comm);
    }
    void watch(std::vector<ncclComm_t> new_comms) {
      if (watchdog) {
        for (ncclComm_t comm : comms) watchdog->unwatch(comm);
        for (ncclComm_t comm : new_comms) watchdog->watch(comm);
      }
      comms = std::move(new_comms);
    }
  } watched{watchdog, {}};
  watched.watch(engine->nccl_comms());
  // The host groups belong to the engine, which a switch to BF16 blocks rebuilds.
  auto world = [&engine]() -> Communicator& { return engine->host_groups().world(); };
  log_settings_table("memory and optimizer state (rank " + std::to_string(setup.parallel.world_rank) + ")",
                     engine->describe());

  TrainingSummary summary;
  int64_t start_step = 0;
  const std::string& checkpoint = !o.load_dir.empty() ? o.load_dir : o.init_from;
  if (!checkpoint.empty()) {
    const LoadedState loaded = load_into_engine(checkpoint, o.ckpt_step, setup, *engine,
                                                o.load_dir.empty() ? CheckpointUse::weights_only : CheckpointUse::resume);
    if (loaded.resumed) {
      start_step = loaded.progress.iteration;
      data.train->set_position(loaded.progress.data);
      summary.skipped_steps = loaded.progress.skipped_steps;
    }
  }
  auto progress_now = [&](int64_t iteration) {
    TrainingProgress progress;
    progress.iteration = iteration;
    progress.data = data.train->position();
    progress.consumed_samples = data.train->consumed_samples();
    progress.skipped_steps = engine->skip_status().total;
    return progress;
  };
  defer_stop_signals_to_training_loop();  // from here a stop signal saves a checkpoint

  const LrSchedule schedule = learning_rate_schedule(o, setup.global_batch_size);
  const WeightDecaySchedule decay_schedule = weight_decay_schedule(o, setup.global_batch_size);

  const int B = o.micro_batch_size, T = setup.seq_length;
  std::vector<int32_t> inputs(size_t(B) * T), targets(size_t(B) * T);
  // --eod-mask-loss --calculate-per-token-loss: the step's micro-batches, read before its first.
  const bool per_token_loss = o.eod_mask_loss && o.calculate_per_token_loss;
  std::vector<int32_t> step_inputs, step_targets;

  // What an evaluation scores: the validation loss (with validation data and --eval-iters),
  // the multiple-choice accuracy (with --hellaswag-path).
  const bool validating = data.valid && o.eval_iters > 0;
  const bool choosing = !data.choices.empty();
  auto evaluate = [&](int64_t iteration) {
    nlohmann::json line = {{"iter", iteration}};
    if (validating) {
      const double val_loss = validation_loss(*engine, *data.valid, o.eval_iters, B, T, watchdog).mean();
      spdlog::info("iter {:6d} | validation loss {:.4f} | perplexity {:.2f}", iteration, val_loss,
                   std::exp(std::min(val_loss, 50.0)));
      line["val_loss"] = val_loss;
      summary.last_val_loss = val_loss;
    }
    if (choosing) {
      const ChoiceAccuracy accuracy = choice_accuracy(*engine, data.choices, B, T, setup.data_parallel_rank,
                                                      setup.data_parallel_size, watchdog);
      spdlog::info("iter {:6d} | hellaswag accuracy {:.4f} ({} of {} examples)", iteration, accuracy.accuracy(),
                   accuracy.correct, accuracy.examples);
      line["hellaswag_accuracy"] = accuracy.accuracy();
      summary.last_choices = accuracy;
    }
    metrics_file.write(line);
  };

  // --benchmark: without --profile-ops the steps after warm-up are timed as one window,
  // with --profile-ops each step is (BenchmarkTiming).
  std::vector<double> benchmark_step_ms;
  std::optional<std::chrono::steady_clock::time_point> window_start;
  BenchmarkTiming benchmark;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point loop_start = Clock::now();
  Clock::time_point interval_start = loop_start;
  int64_t interval_steps = 0;
  int64_t interval_sequences = 0;
  summary.steps = start_step;
  for (int64_t step = start_step; step < o.train_iters; ++step) {
    // The step's global batch, and the schedules where it ends. Under a ramp-up that is the
    // sequences consumed by then, in steps of the final global batch (Megatron counts its
    // schedule in samples); otherwise step + 1.
    const uint64_t consumed = data.train->consumed_samples();
    const int64_t step_batch = global_batch_at(setup.rampup, consumed);
    const int micro_batches = int(step_batch / (int64_t{B} * setup.data_parallel_size));
    const double steps_done = setup.rampup.enabled()
                                  ? double(consumed + uint64_t(step_batch)) / double(setup.global_batch_size)
                                  : double(step + 1);
    const double lr = learning_rate_after(steps_done, schedule);
    const double decay = weight_decay_after(steps_done, decay_schedule);
    const Clock::time_point step_start = Clock::now();
    if (per_token_loss) {
      // Every micro-batch of the step first: each token's weight needs the step's count.
      step_inputs.resize(size_t(micro_batches) * B * T);
      step_targets.resize(step_inputs.size());
      for (int micro = 0; micro < micro_batches; ++micro)
        data.train->next_batch(step_inputs.data() + size_t(micro) * B * T, step_targets.data() + size_t(micro) * B * T);
      engine->begin_step(step, micro_batches, count_unmasked_targets(step_targets.data(), step_targets.size()));
      for (int micro = 0; micro < micro_batches; ++micro)
        engine->forward_backward(step_inputs.data() + size_t(micro) * B * T, step_targets.data() + size_t(micro) * B * T);
    } else {
      engine->begin_step(step, micro_batches);
      for (int micro = 0; micro < micro_batches; ++micro) {
        data.train->next_batch(inputs.data(), targets.data());
        engine->forward_backward(inputs.data(), targets.data());
      }
    }
    engine->end_step(adamw_hyperparams(o, lr, decay), o.clip_grad, step);
    if (o.benchmark) {
      const int64_t steps_done = step - start_step + 1;
      if (OpProfiler* profiler = engine->op_profiler()) {
        engine->step_metrics();  // waits for the device: each step is timed whole
        benchmark_step_ms.push_back(1e3 * std::chrono::duration<double>(Clock::now() - step_start).count());
        profiler->finish_step();
        // The profile covers the timed steps only, as the median does.
        if (steps_done == o.benchmark_warmup) profiler->reset();
      } else {
        if (steps_done == o.benchmark_warmup || (o.benchmark_warmup == 0 && steps_done == 1 && !window_start)) {
          // The window opens once the warm-up steps are done (with none: at the first step's start).
          if (o.benchmark_warmup > 0) engine->step_metrics();
          window_start = o.benchmark_warmup > 0 ? Clock::now() : step_start;
        }
        if (step + 1 == o.train_iters && window_start) {
          engine->step_metrics();
          benchmark.steps = steps_done - o.benchmark_warmup;
          benchmark.step_ms = 1e3 * std::chrono::duration<double>(Clock::now() - *window_start).count() /
                              double(std::max<int64_t>(benchmark.steps, 1));
          benchmark.method = "mean over the window";
        }
      }
    }
    ++interval_steps;
    interval_sequences += step_batch;
    if (watchdog) watchdog->heartbeat();
    const int64_t iteration = step + 1;  // Megatron counts finished iterations from 1

    const TrainingEngine::SkipStatus skips = engine->skip_status();
    if (skips.total > summary.skipped_steps) {
      summary.skipped_steps = skips.total;
      spdlog::warn("iter {}: non-finite loss or gradient; update skipped ({} in a row, {} in total)", iteration,
                   skips.consecutive, skips.total);
      if (skips.consecutive >= o.max_skipped_steps)
        throw RuntimeError("stopping: " + std::to_string(skips.consecutive) + " non-finite steps in a row",
                           "lower --lr, raise --fp8-margin, or check the data; --max-skipped-steps sets the limit");
    }

    // Blocks --fp8-auto-precision switches to BF16 after this step (the engine is rebuilt
    // once this step's metrics are logged).
    std::vector<BlockSwitch> switches;
    if (engine->collects_fp8_statistics(step)) {
      // Every rank takes part (the counts are summed over the ranks); the first one reports.
      // Only here, after the step, are they read back: no other step waits for the device.
      const std::vector<Fp8TensorStatistics> statistics = engine->fp8_statistics();
      const bool report = o.fp8_stats_interval > 0 && iteration % o.fp8_stats_interval == 0;
      if (first_rank && report) {
        for (const Fp8TensorStatistics& tensor : statistics) metrics_file.write(fp8_statistics_line(iteration, tensor));
        spdlog::info("iter {:6d} | {}", iteration, fp8_statistics_summary(statistics));
      }
      if (o.fp8_auto_precision) {
        // Every rank has the same sums, so every rank switches the same blocks.
        switches = blocks_to_switch(statistics, {.saturation = o.fp8_auto_precision_saturation,
                                                 .underflow = o.fp8_auto_precision_underflow});
      }
    }

    const bool log_now = iteration % o.log_interval == 0 || iteration == o.train_iters || step == start_step;
    if (log_now) {
      const StepMetrics m = engine->step_metrics();
      const double seconds = std::chrono::duration<double>(Clock::now() - interval_start).count();
      const double ms_per_iter = 1e3 * seconds / double(interval_steps);
      const double tokens_per_second = double(interval_sequences) * T / seconds;
      // Megatron's --log-throughput figure: model TFLOP/s per GPU.
      const double tflops_per_gpu =
          setup.model.training_flops_per_token(setup.seq_length) * tokens_per_second / world().size() / 1e12;
      // The ETA extrapolates this process's mean step time (a resumed run counts from its start).
      const double elapsed = std::chrono::duration<double>(Clock::now() - loop_start).count();
      const double eta = elapsed / double(iteration - start_step) * double(o.train_iters - iteration);
      if (step == start_step) summary.first_loss = m.loss;
      summary.last_loss = m.loss;
      spdlog::info(
          "iter {:6d}/{} | loss {:.4f} | lr {:.3e}{}{} | grad norm {:.3f} | {:.1f} ms/iter | {:.0f} tokens/s | "
          "{:.{}f} TFLOP/s/GPU | elapsed {} | ETA {}{}",
          iteration, o.train_iters, m.loss, lr,
          decay_schedule.style == WeightDecayIncrStyle::constant ? std::string()
                                                                 : fmt::format(" | weight decay {:.4g}", decay),
          setup.rampup.enabled() ? fmt::format(" | global batch {}", step_batch) : std::string(),
          m.grad_norm, ms_per_iter, tokens_per_second, tflops_per_gpu,
          tflops_per_gpu < 10.0 ? 3 : 1, format_duration(elapsed), format_duration(eta),
          summary.skipped_steps ? " | skipped " + std::to_string(summary.skipped_steps) : std::string());
      metrics_file.write({{"iter", iteration},
                          {"loss", m.loss},
                          {"lr", lr},
                          {"weight_decay", decay},
                          {"global_batch_size", step_batch},
                          {"grad_norm", m.grad_norm},
                          {"tokens_per_s", tokens_per_second},
                          {"tflops_per_gpu", tflops_per_gpu},
                          {"ms_per_iter", ms_per_iter},
                          {"elapsed_s", elapsed},
                          {"skipped_steps", summary.skipped_steps}});
      interval_start = Clock::now();
      interval_steps = 0;
      interval_sequences = 0;
    }
    if (!switches.empty()) {
      for (const BlockSwitch& change : switches) {
        if (first_rank) spdlog::info("iter {:6d} | fp8-auto-precision: {}", iteration, describe_block_switch(change));
        setup.options.bf16_blocks.insert(change.block);
      }
      // The new precision is fixed when the model is built: the training state moves to an
      // engine built for it, as a resume from a checkpoint taken here would (the data position
      // and the learning-rate schedule live in this loop and are untouched).
      const TrainingStateSnapshot state = snapshot_training_state(*engine, o.fp8_enabled());
      watched.watch({});
      engine.reset();
      engine = make_engine(setup, setup.parallel, ParameterStart::set_by_caller);
      watched.watch(engine->nccl_comms());
      restore_training_state(*engine, state);
      if (first_rank)
        spdlog::info("iter {:6d} | fp8-auto-precision: BF16 blocks now {}", iteration,
                     block_list_text(setup.options.bf16_blocks));
    }
    if (o.check_weight_hash_interval > 0 && iteration % o.check_weight_hash_interval == 0) {
      engine->check_replicas_agree(iteration);  // every rank throws alike when they differ
      if (first_rank)
        spdlog::info("iter {:6d} | weights identical on the {} data-parallel replicas (CRC-32)", iteration,
                     setup.data_parallel_size);
    }
    if ((validating || choosing) && o.eval_interval > 0 && iteration % o.eval_interval == 0) evaluate(iteration);
    summary.steps = iteration;

    // Every rank stops at the same iteration: a signal seen by any rank, or the time limit
    // passed on any rank's clock, stops all of them (one all-reduce of both).
    const double minutes = std::chrono::duration<double>(Clock::now() - run_start).count() / 60.0;
    float stop[2] = {float(pending_stop_signal()),
                     o.exit_duration_in_mins && minutes > double(*o.exit_duration_in_mins) ? 1.0f : 0.0f};
    if (world().size() > 1) world().all_reduce(stop, stop, 2, CommDtype::f32, ReduceOp::max);
    const int signal_number = int(stop[0]);
    const bool out_of_time = stop[1] > 0.0f && iteration < o.train_iters;
    const bool periodic = o.save_interval > 0 && iteration % o.save_interval == 0;
    const bool exit_now = (o.exit_interval > 0 && iteration % o.exit_interval == 0) || out_of_time;
    if (!o.save_dir.empty() && (periodic || exit_now || signal_number != 0 || iteration == o.train_iters)) {
      std::optional<Watchdog::Pause> quiet;  // rank 0 writes; the others wait for it
      if (watchdog) quiet.emplace(*watchdog);
      summary.last_checkpoint = save_checkpoint(o.save_dir, setup, *engine, progress_now(iteration));
    }
    if (exit_now && signal_number == 0 && iteration < o.train_iters) {
      if (out_of_time)
        spdlog::info("--exit-duration-in-mins {}: stopping after iteration {}, {:.1f} minutes into the run",
                     *o.exit_duration_in_mins, iteration, minutes);
      else
        spdlog::info("--exit-interval {}: stopping after iteration {}", o.exit_interval, iteration);
      metrics_file.close();
      return summary;
    }
    if (signal_number != 0) {
      summary.stop_signal = signal_number;
      if (o.save_dir.empty())
        throw RuntimeError("stopped by signal " + std::to_string(signal_number) + " after iteration " +
                               std::to_string(iteration) + "; nothing saved",
                           "pass --save DIR so a preempted run keeps its progress");
      spdlog::warn("signal {}: stopped after iteration {}, checkpoint saved", signal_number, iteration);
      metrics_file.close();
      return summary;
    }
  }

  if ((validating || choosing) && o.train_iters > 0 && (o.eval_interval == 0 || o.train_iters % o.eval_interval != 0))
    evaluate(o.train_iters);
  if (data.test && o.eval_iters > 0 && o.train_iters > 0) {
    // Megatron's test evaluation at the end of training: --eval-iters batches from the start of
    // the test data, as an evaluation scores the validation data.
    const double test_loss = validation_loss(*engine, *data.test, o.eval_iters, B, T, watchdog).mean();
    spdlog::info("iter {:6d} | test loss {:.4f} | perplexity {:.2f} (the end of training)", o.train_iters, test_loss,
                 std::exp(std::min(test_loss, 50.0)));
    metrics_file.write(nlohmann::json{{"iter", o.train_iters}, {"test_loss", test_loss}});
    summary.test_loss = test_loss;
  }
  summary.skipped_steps = engine->skip_status().total;
  if (o.benchmark && engine->op_profiler()) {
    benchmark_step_ms.erase(benchmark_step_ms.begin(),
                            benchmark_step_ms.begin() + std::min<size_t>(o.benchmark_warmup, benchmark_step_ms.size()));
    std::sort(benchmark_step_ms.begin(), benchmark_step_ms.end());
    benchmark = BenchmarkTiming{.step_ms = benchmark_step_ms.empty() ? 0.0 : benchmark_step_ms[benchmark_step_ms.size() / 2],
                                .steps = int64_t(benchmark_step_ms.size()),
                                .method = "median of synchronised steps"};
  }
  if (o.benchmark && benchmark.steps > 0)
    report_benchmark(setup, *engine, benchmark, summary.last_loss, summary.steps - start_step, engine_seconds);
  metrics_file.close();
  return summary;
}

EvaluationResult run_evaluation(const RunSetup& setup) {
  const TrainOptions& o = setup.options;
  const std::string& checkpoint = !o.load_dir.empty() ? o.load_dir : o.init_from;
  FP8LM_INPUT_CHECK(!checkpoint.empty(), "--load DIR or --init-from PATH is required: the weights to evaluate");
  const bool validating = !o.valid_data_path.empty() || !o.valid_data_blend.empty() || !o.data_path.empty();
  FP8LM_INPUT_CHECK(validating || !o.hellaswag_path.empty(),
                    "--valid-data-path, --data-path or --hellaswag-path is required: what to evaluate on");
  FP8LM_INPUT_CHECK(!validating || o.eval_iters >= 1, "--eval-iters must be >= 1 (got ", o.eval_iters, ")");
  if (o.num_threads > 0) omp_set_num_threads(o.num_threads);
  DataLoaders data = open_data(setup);
  FP8LM_INPUT_CHECK(!validating || data.valid.has_value(), "--split ", o.split,
                    " leaves no documents of --data-path for validation");
  // The forward-only model: no gradients, optimizer state or backward activations.
  Evaluator evaluator(setup, setup.parallel);
  // --load restores the FP8 scaling state too, so the loss is the one the run logged.
  evaluator.load(checkpoint, o.ckpt_step, /*with_scaling=*/!o.load_dir.empty());
  log_settings_table("memory once the weights are loaded (rank " + std::to_string(setup.parallel.world_rank) + ")",
                     evaluator.describe());
  EvaluationResult result;
  if (validating) {
    const BatchLoss total =
        validation_loss(evaluator, *data.valid, o.eval_iters, o.micro_batch_size, setup.seq_length, nullptr);
    result.loss = total.mean();
    result.tokens = int64_t(total.tokens);
  }
  if (!data.choices.empty())
    result.choices = choice_accuracy(evaluator, data.choices, o.micro_batch_size, setup.seq_length,
                                     setup.data_parallel_rank, setup.data_parallel_size, nullptr);
  return result;
}

}  // namespace fp8lm
