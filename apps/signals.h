// SIGTERM / SIGINT handling for preemptible jobs: the signal only sets a flag; the
// training loop finishes the step in flight, saves a checkpoint and exits 0.
#pragma once

namespace fp8lm {

// Installs the handlers (idempotent). A second signal while one is pending exits at
// once with 128 + signal, for a user who really means it.
void install_stop_signal_handlers();
// The signal number received, or 0.
int pending_stop_signal();

}  // namespace fp8lm
