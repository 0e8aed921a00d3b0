#include "apps/signals.h"

#include <csignal>
#include <cstring>
#include <unistd.h>

namespace fp8lm {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
volatile std::sig_atomic_t g_deferred = 0;

// Only async-signal-safe calls below: write(2) of constant text, then _exit(2).
void write_stderr(const char* text) {
  ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

extern "C" void on_stop_signal(int signal_number) {
  const char* name = signal_number == SIGTERM ? "SIGTERM" : signal_number == SIGINT ? "SIGINT" : "a stop signal";
  if (g_deferred == 0) {
    write_stderr("fp8lm: stopped by ");
    write_stderr(name);
    write_stderr(" during start-up, before the first training step; nothing to save\n");
    _exit(128 + signal_number);
  }
  if (g_stop_signal != 0) {
    write_stderr("fp8lm: second ");
    write_stderr(name);
    write_stderr(": exiting now, without the checkpoint the first one asked for\n");
    _exit(128 + signal_number);
  }
  g_stop_signal = signal_number;
}

}  // namespace

void install_signal_handlers() {
  // Installed again when the training loop starts, in case a library (MPI, CUDA) replaced
  // them during start-up.
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGXFSZ, &ignore, nullptr);
}

void defer_stop_signals_to_training_loop() {
  install_signal_handlers();
  g_deferred = 1;
}

int pending_stop_signal() { return g_stop_signal; }

}  // namespace fp8lm
