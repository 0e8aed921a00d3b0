// Signal handling for the whole process.
//
// SIGTERM / SIGINT: preemptible jobs get them. Inside the training loop the signal only sets a
// flag; the loop finishes the step in flight, saves a checkpoint and exits 0. Before the loop
// (start-up: parsing, validating shards, building the model, loading a checkpoint) there is
// nothing a checkpoint could keep, so the process exits at once with a message and 128 + signal.
// A second signal while one is pending also exits at once, for a user who really means it.
//
// SIGXFSZ (a write past `ulimit -f`) is ignored: the write then fails with EFBIG and is reported
// like a full disk, naming the file, instead of the process dying silently with 153.
#pragma once

namespace fp8lm {

// Installs the handlers (again, harmlessly, when called twice). main() calls it before
// anything else, so a signal during start-up is reported instead of killing the process
// without a word.
void install_signal_handlers();
// From here on a stop signal is deferred to the training loop, which polls
// pending_stop_signal(). Installs the handlers again first.
void defer_stop_signals_to_training_loop();
// The signal number received in deferred mode, or 0.
int pending_stop_signal();

}  // namespace fp8lm
