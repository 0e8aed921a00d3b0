// MPI_CHECK(call): every MPI call of fp8lm goes through it. A failing call throws RuntimeError
// with the call, file, line and MPI's own error string. MPI only returns errors on communicators
// whose error handler is MPI_ERRORS_RETURN: MpiCommunicator and ProcessGroups set it on the
// communicators they create (the default, MPI_ERRORS_ARE_FATAL, aborts inside the call).
#pragma once

#include <string>

#include <mpi.h>

#include "core/error.h"

namespace fp8lm::detail {

// MPI's text for an error code, e.g. "MPI_ERR_TRUNCATE: message truncated".
std::string mpi_error_string(int code);

[[noreturn]] void throw_mpi_error(const char* call, const char* file, int line, int code);

}  // namespace fp8lm::detail

#define MPI_CHECK(call)                                                                 \
  do {                                                                                  \
    const int fp8lm_mpi_status = (call);                                                \
    if (fp8lm_mpi_status != MPI_SUCCESS)                                                \
      ::fp8lm::detail::throw_mpi_error(#call, __FILE__, __LINE__, fp8lm_mpi_status);    \
  } while (0)
