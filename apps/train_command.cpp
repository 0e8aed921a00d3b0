#include <cstdio>

#include <spdlog/spdlog.h>

#include "apps/cli.h"
#include "apps/commands.h"
#include "apps/run_setup.h"
#include "apps/trainer.h"
#include "core/error.h"
#include "core/logging.h"

namespace fp8lm {

int run_train_command(const std::vector<std::string>& args) {
  ParsedCommandLine parsed = parse_train_command_line(args);
  if (parsed.help_requested) {
    std::fputs(parsed.help_text.c_str(), stdout);
    return kExitOk;
  }
  init_logging(parsed.options.log_level);
  RunSetup setup = resolve_run_setup(parsed.options);
  log_settings_table("fp8lm train settings", settings_table(setup));
  const TrainingSummary summary = run_training(setup);
  spdlog::info("done: {} steps, loss {:.4f} -> {:.4f}{}", summary.steps, summary.first_loss, summary.last_loss,
               summary.skipped_steps ? ", " + std::to_string(summary.skipped_steps) + " skipped" : std::string());
  return kExitOk;
}

}  // namespace fp8lm
