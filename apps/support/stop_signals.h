// apps/support/stop_signals.h: SIGTERM, SIGINT and SIGUSR1 as a scheduler's request to stop (what
// a cluster sends before it preempts a job, and what mpirun forwards): the first is noted, for the
// training loop to act on between two steps, with every rank agreeing; a second SIGTERM or SIGINT
// ends the process at once.
#pragma once

#include <functional>
#include <string>
#include <thread>

namespace shardlab::apps {

// The exit status of a run that stopped on such a signal after a complete step, its checkpoint
// written when it has a checkpoint directory: sysexits' EX_TEMPFAIL, "try again later" (with
// --resume). A failure exits 1, a second signal by the signal itself.
inline constexpr int kExitStoppedBySignal = 75;

// While one exists, the three signals are noted instead of ending the process (the handlers it
// replaces come back when it goes). One at a time in a process.
class StopSignals {
 public:
  // `noticed` runs for each such signal on a thread of the object's own, not in the handler, so it
  // may do anything (say where the process is, when that is not where it can stop).
  explicit StopSignals(std::function<void(int signal)> noticed = {});
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first signal noted since it was made, 0 for none.
  static int received();

 private:
  void watch(int read_end) const;

  std::function<void(int)> noticed_;
  std::thread watcher_;
};

// "SIGTERM", "SIGINT", "SIGUSR1" (or "signal N").
std::string signal_name(int signal);

}  // namespace shardlab::apps
