// Whether fp8lm's own kernels launch with programmatic dependent launch (Hopper; PDL):
// --programmatic-launch on|off, set once per process when the CUDA backend is made
// (make_cuda_ops). Host-only, so that .cpp files can set it; the launch itself and the
// kernels' side of the protocol are in core/launch.cuh.
#pragma once

namespace fp8lm::cuda {

void set_programmatic_launch(bool on);
bool programmatic_launch();

}  // namespace fp8lm::cuda
