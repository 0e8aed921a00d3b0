// The message of the InputError an action throws, for tests of bad input.
#pragma once

#include <functional>
#include <string>

#include <catch2/catch_test_macros.hpp>

#include "core/error.h"

namespace fp8lm::testing {

// The InputError message `action` throws (fails the test when it throws nothing).
inline std::string input_error_message(const std::function<void()>& action) {
  try {
    action();
  } catch (const InputError& error) {
    return error.full_message();
  }
  FAIL("expected an InputError");
  return {};
}

}  // namespace fp8lm::testing
