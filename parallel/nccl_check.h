// NCCL_CHECK for parallel/: the NCCL_CHECK of core/check_cuda.h plus, for system and internal
// errors, NCCL's own description of what failed (ncclGetLastError), and a hint per error class.
// Include this header instead of core/check_cuda.h where NCCL is called; it replaces that
// macro for the including file.
#pragma once

#include <nccl.h>

#include "core/check_cuda.h"

namespace fp8lm::detail {

[[noreturn]] void throw_nccl_error(const char* call, const char* file, int line, ncclResult_t status);

}  // namespace fp8lm::detail

#undef NCCL_CHECK
#define NCCL_CHECK(call)                                                               \
  do {                                                                                 \
    const ncclResult_t fp8lm_nccl_status = (call);                                     \
    if (fp8lm_nccl_status != ncclSuccess)                                              \
      ::fp8lm::detail::throw_nccl_error(#call, __FILE__, __LINE__, fp8lm_nccl_status); \
  } while (0)
