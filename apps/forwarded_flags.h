// Subcommands that run a trained model (eval, sample) take a subset of train's flags with
// train's meaning, and hand them to train's parser (parse_train_command_line), so that
// validation, precision resolution and the run set-up are train's own. A flag a user left
// out defaults to the checkpoint run's setting (its state.json "args").
#pragma once

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "apps/options.h"

namespace CLI {
class App;
}

namespace fp8lm {

struct ForwardedFlag {
  const char* name;  // train's flag, e.g. "--micro-batch-size"
  bool takes_value;
  const char* help;
};

// The flag groups both subcommands take: the weights to run (--load or --init-from, with
// --ckpt-step and --config), the precision and FP8 recipe, and the device and logging.
extern const std::vector<ForwardedFlag> kWeightsFlags;
extern const std::vector<ForwardedFlag> kPrecisionFlags;
extern const std::vector<ForwardedFlag> kRuntimeFlags;

// A subcommand's forwarded flags: registered on its parser, read after parsing.
class ForwardedFlags {
 public:
  ForwardedFlags(CLI::App& app, std::vector<ForwardedFlag> flags);
  // After parsing.
  bool given(const std::string& name) const { return given_.count(name) > 0; }
  const std::set<std::string>& names_given() const { return given_; }
  std::string value(const std::string& name) const;  // the last value given, or ""
  // The flags given, as train arguments, in the order of the table.
  std::vector<std::string> train_arguments() const;
  // Call once after parsing.
  void collect();

 private:
  CLI::App& app_;
  std::vector<ForwardedFlag> flags_;
  std::vector<std::string> list_values_;  // --data-path's, the only list flag
  std::set<std::string> given_;
};

// The weights a subcommand runs: --load DIR or --init-from PATH (exactly one; InputError
// naming `command` otherwise), and --ckpt-step with --load.
struct WeightsSource {
  std::string path;
  std::optional<int64_t> step;
};
WeightsSource weights_source(const ForwardedFlags& flags, const std::string& command);

// The checkpoint run's settings (precision and FP8 recipe, and `shape_keys` such as
// micro-batch size and sequence length) as train flags, for those not in `given`; nothing
// for a Hugging Face model.
std::vector<std::string> checkpoint_run_flags(const std::string& path, std::optional<int64_t> step,
                                              const std::set<std::string>& given, bool with_batch_shape);

// "bf16", or "fp8-hybrid, delayed scaling".
std::string describe_precision(const TrainOptions& options);

}  // namespace fp8lm
