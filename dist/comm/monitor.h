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

#include "core/device.h"
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
  // The rank's device: the watchdog's threads and the communication threads make it current at
  // their start (bind_thread_to_device), so their CUDA calls open no context on another GPU.
  Device device = Device::cpu();
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  std::size_t ledger_capacity = 256;
  // Called once, from a watchdog thread, with the report (what is stuck, or what failed, and the
  // ledger tail). Default: print it to stderr and abort the MPI job with kWatchdogExitCode.
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
  // For work that completes without telling anyone (a CUDA event): a thread of the watchdog polls
  // `is_complete`, without holding the ledger's lock, and marks the call completed when it answers
  // true. A query may block (behind a hung kernel): the timeout still fires. A query that throws
  // (NCCL's asynchronous error) fails the call, and the report names the error at once.
  void poll_until_complete(std::uint64_t id, std::function<bool()> is_complete);
  // Called from the watchdog, before on_timeout, when it fires: how a backend stops what it has in
  // flight (NCCL: ncclCommAbort), so that no kernel waits forever for a rank that will not come.
  // Returns the key that remove_abort takes when the backend goes.
  std::uint64_t add_abort(std::function<void()> abort);
  void remove_abort(std::uint64_t key);

  // The last `count` entries, oldest first.
  std::vector<LedgerEntry> tail(std::size_t count) const;
  std::string format_tail(std::size_t count) const;
  // The call that has been in flight (checking or running) the longest, if any.
  std::optional<LedgerEntry> longest_in_flight() const;

  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;
  int rank() const { return options_.rank; }
  Device device() const { return options_.device; }

 private:
  // A call the watchdog times: kept apart from the ledger, which may drop old entries.
  struct InFlight {
    LedgerEntry entry;
    std::function<bool()> is_complete;  // empty: the backend reports completion itself
  };

  // Returns the entry of a call that just finished while a trace records: the caller traces it
  // once the lock is released, so that building the event never holds up the other threads.
  std::optional<LedgerEntry> set_state_locked(std::uint64_t id, CallState state, Clock::time_point now);
  void watch();  // the watchdog: times the calls in flight, and fires; never calls CUDA
  void poll();   // the poller: runs the completion queries
  Clock::duration poll_interval() const;
  // Runs the aborts, then on_timeout with the report, once; unlocks `lock` meanwhile.
  void fire(std::unique_lock<std::mutex>& lock, const std::string& report);
  // `call` as the ledger shows it, what happened to it (" did not complete within ...", ": <error>"
  // after a failed one), and the ledger's tail.
  std::string report(const LedgerEntry& call, const std::string& what, Clock::time_point now) const;
  void trace_finished(std::unique_lock<std::mutex>& lock, std::vector<LedgerEntry>& finished);

  MonitorOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<LedgerEntry> ledger_;  // ids ledger_.front().id, ..., next_id_ - 1
  std::map<std::uint64_t, InFlight> in_flight_;
  std::uint64_t next_id_ = 1;
  std::map<std::uint64_t, std::function<void()>> aborts_;
  std::uint64_t next_abort_ = 1;
  bool stopping_ = false;
  bool fired_ = false;
  std::thread watchdog_, poller_;  // last: started once the members above exist
};

}  // namespace shardlab::dist
