#include "apps/signals.h"

#include <csignal>
#include <unistd.h>

namespace fp8lm {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int signal_number) {
  if (g_stop_signal != 0) _exit(128 + signal_number);  // async-signal-safe
  g_stop_signal = signal_number;
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

int pending_stop_signal() { return g_stop_signal; }

}  // namespace fp8lm
