// FP8LM_HOST_DEVICE: a function the host and the GPU's kernels share (one definition, so that
// the CPU reference and the kernels compute the same thing); plain inline under g++.
#pragma once

#if defined(__CUDACC__)
#define FP8LM_HOST_DEVICE __host__ __device__
#else
#define FP8LM_HOST_DEVICE
#endif
