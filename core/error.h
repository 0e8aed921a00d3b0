// Errors that carry a hint, and the check macros every layer uses.
//
// Two classes of failure, because the caller reacts differently:
//   InputError   - the user's input is wrong (a flag, a config, a data or checkpoint file).
//                  Reported in one line that names the culprit; the process exits with 2,
//                  before any work starts.
//   RuntimeError - something failed while working (CUDA, I/O, numerics). Exit code 1.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace fp8lm {

class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string hint)
      : std::runtime_error(std::move(message)), hint_(std::move(hint)) {}
  const std::string& hint() const { return hint_; }
  // The message plus " HINT: ..." where a hint exists: what users see.
  std::string full_message() const {
    return hint_.empty() ? std::string(what()) : std::string(what()) + " HINT: " + hint_;
  }

 private:
  std::string hint_;
};

class InputError : public Error {
 public:
  explicit InputError(std::string message, std::string hint = {})
      : Error(std::move(message), std::move(hint)) {}
};

class RuntimeError : public Error {
 public:
  explicit RuntimeError(std::string message, std::string hint = {})
      : Error(std::move(message), std::move(hint)) {}
};

// Exit codes of the fp8lm binary.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntimeError = 1;
inline constexpr int kExitInputError = 2;

namespace detail {
template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

}  // namespace fp8lm

// FP8LM_CHECK(cond, parts...): an internal invariant; throws RuntimeError with file:line.
#define FP8LM_CHECK(cond, ...)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      throw ::fp8lm::RuntimeError(::fp8lm::detail::concat(__FILE__, ":", __LINE__, ": ",    \
                                                          "check failed (" #cond ") ",      \
                                                          ##__VA_ARGS__));                  \
    }                                                                                       \
  } while (0)

// FP8LM_INPUT_CHECK(cond, message): user input validation; throws InputError(message).
#define FP8LM_INPUT_CHECK(cond, ...)                                                        \
  do {                                                                                      \
    if (!(cond)) throw ::fp8lm::InputError(::fp8lm::detail::concat(__VA_ARGS__));           \
  } while (0)
