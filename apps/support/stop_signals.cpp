// apps/support/stop_signals.cpp: the handlers of StopSignals (apps/support/stop_signals.h), and the
// thread that tells its caller of each signal through a pipe (the self-pipe trick).
#include "apps/support/stop_signals.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "core/error.h"

namespace shardlab::apps {

namespace {

constexpr std::array kStopSignals = {SIGTERM, SIGINT, SIGUSR1};

std::atomic<int> first_signal{0};
std::atomic<int> pipe_write_end{-1};
std::atomic<bool> installed{false};
std::array<struct sigaction, kStopSignals.size()> previous{};

static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

// Async-signal-safe: atomics, write(2), and the default action taken again.
extern "C" void note_stop_signal(int signal) {
  const int saved_errno = errno;  // the interrupted code may be about to read it
  int none = 0;
  const bool first = first_signal.compare_exchange_strong(none, signal);
  const unsigned char byte = static_cast<unsigned char>(signal);
  if (const int fd = pipe_write_end.load(); fd >= 0) (void)!write(fd, &byte, 1);
  errno = saved_errno;
  if (first || signal == SIGUSR1) return;  // SIGUSR1 again: a scheduler's warning repeated
  // A second SIGTERM or SIGINT: the user insists, the process ends now, by that signal.
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

StopSignals::StopSignals(std::function<void(int signal)> noticed) : noticed_(std::move(noticed)) {
  SHARDLAB_CHECK(!installed.exchange(true), "StopSignals: the signals of this process are already taken");
  first_signal = 0;
  std::array<int, 2> ends{};
  SHARDLAB_CHECK(pipe(ends.data()) == 0, "StopSignals: pipe: {}", std::strerror(errno));
  pipe_write_end = ends[1];
  watcher_ = std::thread([this, read_end = ends[0]] { watch(read_end); });
  struct sigaction action {};
  action.sa_handler = note_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a read or write interrupted by the signal goes on
  for (std::size_t i = 0; i < kStopSignals.size(); ++i) sigaction(kStopSignals[i], &action, &previous[i]);
}

StopSignals::~StopSignals() {
  for (std::size_t i = 0; i < kStopSignals.size(); ++i) sigaction(kStopSignals[i], &previous[i], nullptr);
  close(pipe_write_end.exchange(-1));  // the watcher reads the end of the pipe and returns
  watcher_.join();
  installed = false;
}

void StopSignals::watch(int read_end) const {
  unsigned char byte = 0;
  while (true) {
    const ssize_t got = read(read_end, &byte, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    if (noticed_) noticed_(byte);
  }
  close(read_end);
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
