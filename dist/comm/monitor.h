// dist/comm/monitor.h: the collective ledger (each rank's ring buffer of its recent collectives)
// and the watchdog that turns a collective stuck past its timeout into an abort that prints
// the ledger's tail, so a hung job ends with an explanation instead of hanging forever.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/comm/collective.h"

namespace shardlab::dist {

using Clock = std::chrono::steady_clock;

enum class CallState : std::uint8_t {
  queued,    // issued, waiting behind earlier work of its communicator
  checking,  // debug mode: comparing fingerprints with the other ranks
  running,   // in the backend (MPI call in progress, or NCCL kernel enqueued)
  completed,
  failed,
};
std::string_view call_state_name(CallState state);

struct LedgerEntry {
  std::uint64_t id = 0;        // unique in this process, in issue order
  std::string communicator;    // "world", or the name given to split()
  std::uint64_t sequence = 0;  // 1, 2, ... per communicator: the same call has the same number on every rank
  Fingerprint fingerprint;
  CallState state = CallState::queued;
  Clock::time_point issued, started, finished;
};

// "#17 world all_gather(f32, 2048) running for 1.20 s".
std::string format_entry(const LedgerEntry& entry, Clock::time_point now);

struct MonitorOptions {
  int rank = 0;
  std::string host;  // this machine's name, in the timeout report (none: left out)
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  std::size_t ledger_capacity = 256;
  // Called once, from the watchdog thread, with the report (what is stuck and the ledger
  // tail). Default: print it to stderr and abort the MPI job with kWatchdogExitCode.
  std::function<void(const std::string& report)> on_timeout;
};

// This machine's name (gethostname), "unknown host" when it has none.
std::string host_name();

// The exit status of a process the watchdog ended.
inline constexpr int kWatchdogExitCode = 124;

class Monitor {
 public:
  explicit Monitor(MonitorOptions options);
  ~Monitor();  // stops the watchdog
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Adds a call in state `queued` and returns its ledger id.
  std::uint64_t record(const std::string& communicator, std::uint64_t sequence,
                       const Fingerprint& fingerprint);
  // State changes. The watchdog's clock for a call starts when it enters `checking` or
  // `running` and stops when it leaves them.
  void set_state(std::uint64_t id, CallState state);
  // For work that completes without telling anyone (a CUDA event): the watchdog polls
  // `is_complete` and marks the call completed when it answers true.
  void poll_until_complete(std::uint64_t id, std::function<bool()> is_complete);

  // The last `count` entries, oldest first.
  std::vector<LedgerEntry> tail(std::size_t count) const;
  std::string format_tail(std::size_t count) const;
  // The call that has been in flight (checking or running) the longest, if any.
  std::optional<LedgerEntry> longest_in_flight() const;

  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;
  int rank() const { return options_.rank; }

 private:
  // A call the watchdog times: kept apart from the ledger, which may drop old entries.
  struct InFlight {
    LedgerEntry entry;
    std::function<bool()> is_complete;  // empty: the backend reports completion itself
  };

  // Returns the entry of a call that just finished while a trace records: the caller traces it
  // once the lock is released, so that building the event never holds up the other threads.
  std::optional<LedgerEntry> set_state_locked(std::uint64_t id, CallState state, Clock::time_point now);
  void watch();
  std::string timeout_report(const LedgerEntry& stuck, Clock::time_point now) const;

  MonitorOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<LedgerEntry> ledger_;  // ids ledger_.front().id, ..., next_id_ - 1
  std::map<std::uint64_t, InFlight> in_flight_;
  std::uint64_t next_id_ = 1;
  bool stopping_ = false;
  bool fired_ = false;
  std::thread watchdog_;
};

}  // namespace shardlab::dist
