#include <cstdio>
#include <memory>

#include <mpi.h>
#include <spdlog/spdlog.h>

#include "apps/cli.h"
#include "apps/commands.h"
#include "apps/run_setup.h"
#include "apps/trainer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/logging.h"
#include "parallel/process_groups.h"
#include "parallel/watchdog.h"

namespace fp8lm {

namespace {

int train(const ParsedCommandLine& parsed, MpiSession& mpi) {
  const TrainOptions& o = parsed.options;
  // Ranks and sizes come from MPI (a single process without mpirun is a run of one).
  const ParallelLayout layout = detect_parallel_layout(o.tensor_model_parallel_size);
  init_logging(o.log_level, layout.world_rank);
  RunSetup setup = resolve_run_setup(o, layout);
  if (setup.use_cuda) check_ranks_fit_gpus(layout, cuda_availability().device_count);
  log_settings_table("fp8lm train settings", settings_table(setup));
  warn_if_bound_to_one_cpu(setup);
  if (layout.world_rank == 0)
    for (const std::string& warning : o.megatron_warnings) spdlog::warn("{}", warning);
  // A rank that dies or hangs ends the job within the timeout instead of leaving the others
  // waiting in a collective (a single process has nobody to wait for).
  std::unique_ptr<Watchdog> watchdog;
  if (layout.world_size > 1) {
    WatchdogOptions watch;
    watch.timeout_minutes = o.distributed_timeout_minutes;
    watch.rank = layout.world_rank;
    watchdog = std::make_unique<Watchdog>(watch);
  }
  const TrainingSummary summary = run_training(setup, watchdog.get());
  spdlog::info("done: {} steps, loss {:.4f} -> {:.4f}{}", summary.steps, summary.first_loss, summary.last_loss,
               summary.skipped_steps ? ", " + std::to_string(summary.skipped_steps) + " skipped" : std::string());
  spdlog::info("memory: host peak {} (VmHWM), estimated {} before allocation", format_bytes(measure_host_memory().host_peak_bytes),
               format_bytes(setup.memory.host_bytes()));
  (void)mpi;
  return kExitOk;
}

}  // namespace

int run_train_command(const std::vector<std::string>& args) {
  ParsedCommandLine parsed = parse_train_command_line(args);
  if (parsed.help_requested) {
    std::fputs(parsed.help_text.c_str(), stdout);
    return kExitOk;
  }
  MpiSession mpi;
  int world_size = 1;
  if (mpi.active()) MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  if (world_size == 1) return train(parsed, mpi);
  // In a job of several ranks an error on one rank must end every rank now: the others
  // would otherwise wait in their next collective.
  try {
    return train(parsed, mpi);
  } catch (const InputError& e) {
    std::fprintf(stderr, "fp8lm: error: %s\n", e.full_message().c_str());
    mpi.abort_job(kExitInputError);
  } catch (const Error& e) {
    std::fprintf(stderr, "fp8lm: error: %s\n", e.full_message().c_str());
    mpi.abort_job(kExitRuntimeError);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8lm: error: %s\n", e.what());
    mpi.abort_job(kExitRuntimeError);
  }
}

}  // namespace fp8lm
