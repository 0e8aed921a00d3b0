#include "core/launch.h"

#include <atomic>

namespace fp8lm::cuda {
namespace {

// Relaxed: set before the first launch, and either value is correct at any time (every
// kernel waits for its predecessor either way); only the overlap differs.
std::atomic<bool> programmatic_launch_on{true};

}  // namespace

void set_programmatic_launch(bool on) { programmatic_launch_on.store(on, std::memory_order_relaxed); }
bool programmatic_launch() { return programmatic_launch_on.load(std::memory_order_relaxed); }

}  // namespace fp8lm::cuda
