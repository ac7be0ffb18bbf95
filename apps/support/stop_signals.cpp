// apps/support/stop_signals.cpp: the handlers of StopSignals (apps/support/stop_signals.h).
#include "apps/support/stop_signals.h"

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <csignal>

#include "core/error.h"

namespace shardlab::apps {

namespace {

constexpr std::array kStopSignals = {SIGTERM, SIGINT, SIGUSR1};

std::atomic<int> first_signal{0};
std::atomic<bool> installed{false};
std::array<struct sigaction, kStopSignals.size()> previous{};

// Async-signal-safe: an atomic store, or the default action taken again.
extern "C" void note_stop_signal(int signal) {
  int none = 0;
  if (first_signal.compare_exchange_strong(none, signal)) return;
  if (signal == SIGUSR1) return;  // a scheduler's warning repeated: already noted
  // A second SIGTERM or SIGINT: the user insists, the process ends now, by that signal.
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

}  // namespace

StopSignals::StopSignals() {
  SHARDLAB_CHECK(!installed.exchange(true), "StopSignals: the signals of this process are already taken");
  first_signal = 0;
  struct sigaction action {};
  action.sa_handler = note_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a read or write interrupted by the signal goes on
  for (std::size_t i = 0; i < kStopSignals.size(); ++i) sigaction(kStopSignals[i], &action, &previous[i]);
}

StopSignals::~StopSignals() {
  for (std::size_t i = 0; i < kStopSignals.size(); ++i) sigaction(kStopSignals[i], &previous[i], nullptr);
  installed = false;
}

int StopSignals::received() { return first_signal.load(); }

std::string signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return fmt::format("signal {}", signal);
  }
}

}  // namespace shardlab::apps
