#include "parallel/mpi_check.h"

namespace fp8lm::detail {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

void throw_mpi_error(const char* call, const char* file, int line, int code) {
  int error_class = code;
  MPI_Error_class(code, &error_class);
  std::string hint;
  if (error_class == MPI_ERR_TRUNCATE || error_class == MPI_ERR_COUNT || error_class == MPI_ERR_TYPE) {
    hint = "the ranks of one group called a collective with different counts or dtypes";
  } else if (error_class == MPI_ERR_OTHER || error_class == MPI_ERR_INTERN) {
    hint = "a peer rank may have died; its own output names the first failure";
  }
  throw RuntimeError(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + mpi_error_string(code),
                     hint);
}

}  // namespace fp8lm::detail
