#include "parallel/nccl_check.h"

#include <string>

namespace fp8lm::detail {

void throw_nccl_error(const char* call, const char* file, int line, ncclResult_t status) {
  std::string what = ncclGetErrorString(status);
  // NCCL keeps the cause of these two (a failed socket, a bad environment, ...) aside.
  if (status == ncclSystemError || status == ncclInternalError) {
    const char* last = ncclGetLastError(nullptr);
    if (last != nullptr && last[0] != '\0') what += std::string(" (") + last + ")";
  }
  std::string hint;
  switch (status) {
    case ncclSystemError: hint = "a system call or the network failed; rerun with NCCL_DEBUG=WARN"; break;
    case ncclInternalError: hint = "rerun with NCCL_DEBUG=INFO to see where NCCL failed"; break;
    case ncclInvalidUsage:
      hint = "the ranks of a group called different collectives, counts or dtypes, or the GPU is shared by two ranks";
      break;
    case ncclRemoteError: hint = "a peer rank failed; its own output names the first failure"; break;
    case ncclUnhandledCudaError: hint = "a CUDA call inside NCCL failed; an earlier kernel may have faulted"; break;
    default: break;
  }
  throw RuntimeError(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + what, hint);
}

}  // namespace fp8lm::detail
