// `fp8lm train`'s flags parsed in-process, for the command-line tests.
#pragma once

#include <string>
#include <vector>

#include "apps/cli.h"
#include "core/error.h"

namespace fp8lm::testing {

inline TrainOptions parse_train_flags(std::vector<std::string> args) {
  return parse_train_command_line(args).options;
}

// The InputError the flags raise, as the binary prints it (message and hint, one line), or
// "(no error)".
inline std::string train_flags_error(std::vector<std::string> args) {
  try {
    parse_train_command_line(args);
  } catch (const InputError& e) {
    return e.full_message();
  }
  return "(no error)";
}

}  // namespace fp8lm::testing
