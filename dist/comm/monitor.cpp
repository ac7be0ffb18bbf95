// dist/comm/monitor.cpp: the ledger's ring buffer and the watchdog thread.
#include "dist/comm/monitor.h"

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/trace.h"

namespace shardlab::dist {

std::string_view call_state_name(CallState state) {
  switch (state) {
    case CallState::queued:
      return "queued";
    case CallState::checking:
      return "checking fingerprints";
    case CallState::running:
      return "running";
    case CallState::completed:
      return "completed";
    case CallState::failed:
      return "failed";
  }
  return "unknown";
}

namespace {

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

bool in_flight(CallState state) { return state == CallState::checking || state == CallState::running; }

// A finished call as a span on its communicator's track, from the ledger's own times: from when it
// started running (or comparing fingerprints) to its completion; the queued time is an argument.
void trace_call(const LedgerEntry& entry) {
  const Fingerprint& f = entry.fingerprint;
  trace::complete(
      f.tag.empty() ? std::string(collective_name(f.op)) : fmt::format("{} {}", collective_name(f.op), f.tag),
      "communication", trace::named_track("communication: " + entry.communicator), entry.started,
      entry.finished,
      {{"communicator", entry.communicator},
       {"sequence", static_cast<std::int64_t>(entry.sequence)},
       {"ledger_id", static_cast<std::int64_t>(entry.id)},
       {"op", std::string(collective_name(f.op))},
       {"dtype", std::string(dtype_name(f.dtype))},
       {"count", f.count},
       {"tag", f.tag},
       {"state", std::string(call_state_name(entry.state))},
       {"queued_us", std::chrono::duration<double, std::micro>(entry.started - entry.issued).count()}});
}

// Prints the report and ends the whole MPI job. MPI_Abort makes mpirun kill every rank; should
// it not return promptly (MPI itself wedged), a timer ends this process anyway.
void abort_job(const std::string& report) {
  std::fputs(report.c_str(), stderr);
  std::fflush(stderr);
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(kWatchdogExitCode);
  }).detach();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);
}

}  // namespace

std::string format_entry(const LedgerEntry& entry, Clock::time_point now) {
  std::string timing;
  switch (entry.state) {
    case CallState::queued:
      timing = fmt::format(" for {:.2f} s", seconds_between(entry.issued, now));
      break;
    case CallState::checking:
    case CallState::running:
      timing = fmt::format(" for {:.2f} s", seconds_between(entry.started, now));
      break;
    case CallState::completed:
    case CallState::failed:
      timing = fmt::format(" in {:.3f} s", seconds_between(entry.started, entry.finished));
      break;
  }
  return fmt::format("#{} {} {} {}{}", entry.sequence, entry.communicator,
                     describe_in_detail(entry.fingerprint), call_state_name(entry.state), timing);
}

Monitor::Monitor(MonitorOptions options) : options_(std::move(options)) {
  SHARDLAB_CHECK(options_.timeout.count() > 0, "collective watchdog: the timeout must be positive, got {} ms",
                 options_.timeout.count());
  SHARDLAB_CHECK(options_.ledger_capacity > 0, "collective ledger: the capacity must be positive");
  if (!options_.on_timeout) options_.on_timeout = abort_job;
  watchdog_ = std::thread([this] { watch(); });
}

Monitor::~Monitor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  watchdog_.join();
}

std::uint64_t Monitor::record(const std::string& communicator, std::uint64_t sequence,
                              const Fingerprint& fingerprint) {
  std::lock_guard lock(mutex_);
  const auto now = Clock::now();
  if (ledger_.size() == options_.ledger_capacity) ledger_.pop_front();
  ledger_.push_back({.id = next_id_,
                     .communicator = communicator,
                     .sequence = sequence,
                     .fingerprint = fingerprint,
                     .state = CallState::queued,
                     .issued = now,
                     .started = now,
                     .finished = now});
  return next_id_++;
}

void Monitor::set_state(std::uint64_t id, CallState state) {
  std::optional<LedgerEntry> finished;
  {
    const std::lock_guard lock(mutex_);
    finished = set_state_locked(id, state, Clock::now());
  }
  if (finished) trace_call(*finished);
}

std::optional<LedgerEntry> Monitor::set_state_locked(std::uint64_t id, CallState state,
                                                     Clock::time_point now) {
  LedgerEntry* entry = nullptr;
  if (!ledger_.empty() && id >= ledger_.front().id && id < next_id_)
    entry = &ledger_[id - ledger_.front().id];
  auto flying = in_flight_.find(id);
  if (entry == nullptr && flying != in_flight_.end()) entry = &flying->second.entry;
  if (entry == nullptr) return std::nullopt;  // dropped from the ring buffer and not being timed
  if (in_flight(state)) {
    entry->started = now;
  } else if (state != CallState::queued) {
    entry->finished = now;
  }
  entry->state = state;
  std::optional<LedgerEntry> finished;
  if (trace::on() && (state == CallState::completed || state == CallState::failed)) finished = *entry;
  if (in_flight(state)) {
    in_flight_[id].entry = *entry;
  } else if (flying != in_flight_.end()) {
    in_flight_.erase(flying);
  }
  return finished;
}

void Monitor::poll_until_complete(std::uint64_t id, std::function<bool()> is_complete) {
  std::lock_guard lock(mutex_);
  auto flying = in_flight_.find(id);
  SHARDLAB_CHECK(flying != in_flight_.end(), "collective ledger: call {} is not running", id);
  flying->second.is_complete = std::move(is_complete);
}

std::optional<LedgerEntry> Monitor::longest_in_flight() const {
  const std::lock_guard lock(mutex_);
  const LedgerEntry* longest = nullptr;
  for (const auto& [id, flying] : in_flight_) {
    if (longest == nullptr || flying.entry.started < longest->started) longest = &flying.entry;
  }
  return longest ? std::optional<LedgerEntry>(*longest) : std::nullopt;
}

std::string host_name() {
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "unknown host";
  return name.data();
}

std::vector<LedgerEntry> Monitor::tail(std::size_t count) const {
  std::lock_guard lock(mutex_);
  const std::size_t first = ledger_.size() - std::min(count, ledger_.size());
  return {ledger_.begin() + static_cast<std::ptrdiff_t>(first), ledger_.end()};
}

std::string Monitor::format_tail(std::size_t count) const {
  const auto now = Clock::now();
  std::string text;
  for (const LedgerEntry& entry : tail(count)) text += "  " + format_entry(entry, now) + "\n";
  return text;
}

void Monitor::set_timeout(std::chrono::milliseconds timeout) {
  SHARDLAB_CHECK(timeout.count() > 0, "collective watchdog: the timeout must be positive, got {} ms",
                 timeout.count());
  {
    std::lock_guard lock(mutex_);
    options_.timeout = timeout;
  }
  wake_.notify_all();
}

std::chrono::milliseconds Monitor::timeout() const {
  std::lock_guard lock(mutex_);
  return options_.timeout;
}

std::string Monitor::timeout_report(const LedgerEntry& stuck, Clock::time_point now) const {
  constexpr std::size_t kTailLength = 16;
  std::string text = fmt::format(
      "[rank {}] collective watchdog{}: {} did not complete within the {:.1f} s timeout; a rank that never "
      "issued it, issued a different one, or died leaves the others waiting. Last {} collectives of this "
      "rank (oldest first):\n",
      options_.rank, options_.host.empty() ? "" : " on host " + options_.host, format_entry(stuck, now),
      std::chrono::duration<double>(options_.timeout).count(), std::min(kTailLength, ledger_.size()));
  const std::size_t first = ledger_.size() - std::min(kTailLength, ledger_.size());
  for (std::size_t i = first; i < ledger_.size(); ++i) {
    text += fmt::format("[rank {}]   {}\n", options_.rank, format_entry(ledger_[i], now));
  }
  return text;
}

void Monitor::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    const auto poll =
        std::clamp(options_.timeout / 20, std::chrono::milliseconds(1), std::chrono::milliseconds(100));
    wake_.wait_for(lock, poll);
    const auto now = Clock::now();
    std::vector<std::uint64_t> done;
    const LedgerEntry* stuck = nullptr;
    for (auto& [id, flying] : in_flight_) {
      if (flying.is_complete && flying.is_complete()) {
        done.push_back(id);
      } else if (stuck == nullptr && now - flying.entry.started > options_.timeout) {
        stuck = &flying.entry;
      }
    }
    if (stuck != nullptr && !fired_) {
      fired_ = true;
      const std::string report = timeout_report(*stuck, now);
      lock.unlock();
      options_.on_timeout(report);
      lock.lock();
    }
    std::vector<LedgerEntry> finished;
    for (const std::uint64_t id : done) {
      if (auto entry = set_state_locked(id, CallState::completed, now)) finished.push_back(std::move(*entry));
    }
    if (finished.empty()) continue;
    lock.unlock();
    for (const LedgerEntry& entry : finished) trace_call(entry);
    lock.lock();
  }
}

}  // namespace shardlab::dist
