// dist/comm/monitor.cpp: the ledger's ring buffer and the watchdog thread.
#include "dist/comm/monitor.h"

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "core/device.h"
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
  poller_ = std::thread([this] { poll(); });
}

Monitor::~Monitor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  watchdog_.join();
  poller_.join();
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

std::uint64_t Monitor::add_abort(std::function<void()> abort) {
  std::lock_guard lock(mutex_);
  aborts_.emplace(next_abort_, std::move(abort));
  return next_abort_++;
}

void Monitor::remove_abort(std::uint64_t key) {
  std::lock_guard lock(mutex_);
  aborts_.erase(key);
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

std::string Monitor::report(const LedgerEntry& call, const std::string& what, Clock::time_point now) const {
  constexpr std::size_t kTailLength = 16;
  std::string text =
      fmt::format("[rank {}] collective watchdog{}: {}{}. Last {} collectives of this rank (oldest first):\n",
                  options_.rank, options_.host.empty() ? "" : " on host " + options_.host,
                  format_entry(call, now), what, std::min(kTailLength, ledger_.size()));
  const std::size_t first = ledger_.size() - std::min(kTailLength, ledger_.size());
  for (std::size_t i = first; i < ledger_.size(); ++i) {
    text += fmt::format("[rank {}]   {}\n", options_.rank, format_entry(ledger_[i], now));
  }
  return text;
}

Clock::duration Monitor::poll_interval() const {
  return std::clamp<Clock::duration>(options_.timeout / 20, std::chrono::milliseconds(1),
                                     std::chrono::milliseconds(100));
}

void Monitor::fire(std::unique_lock<std::mutex>& lock, const std::string& text) {
  fired_ = true;
  const std::map<std::uint64_t, std::function<void()>> aborts = aborts_;
  lock.unlock();
  for (const auto& [key, abort] : aborts) {
    try {
      abort();
    } catch (const std::exception& error) {  // the report matters more: it still goes out
      std::fprintf(stderr, "[rank %d] collective watchdog: aborting a communicator failed: %s\n",
                   options_.rank, error.what());
    }
  }
  options_.on_timeout(text);
  lock.lock();
}

void Monitor::trace_finished(std::unique_lock<std::mutex>& lock, std::vector<LedgerEntry>& finished) {
  if (finished.empty()) return;
  lock.unlock();
  for (const LedgerEntry& entry : finished) trace_call(entry);
  lock.lock();
  finished.clear();
}

void Monitor::watch() {
  bind_thread_to_device(options_.device);
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, poll_interval());
    if (fired_) continue;
    const auto now = Clock::now();
    for (const auto& [id, flying] : in_flight_) {
      if (now - flying.entry.started <= options_.timeout) continue;
      fire(lock,
           report(flying.entry,
                  fmt::format(" did not complete within the {:.1f} s timeout; a rank that never issued it, "
                              "issued a different one, or died leaves the others waiting",
                              std::chrono::duration<double>(options_.timeout).count()),
                  now));
      break;  // fire let go of the lock: in_flight_ may have changed
    }
  }
}

// The queries run without the lock: one may block (a CUDA event query behind a hung kernel, or
// behind the main thread's own blocked call), and the watchdog must be able to fire meanwhile.
void Monitor::poll() {
  bind_thread_to_device(options_.device);
  std::unique_lock lock(mutex_);
  std::vector<LedgerEntry> finished;
  while (!stopping_) {
    wake_.wait_for(lock, poll_interval());
    std::vector<std::pair<std::uint64_t, std::function<bool()>>> queries;
    for (const auto& [id, flying] : in_flight_) {
      if (flying.is_complete) queries.emplace_back(id, flying.is_complete);
    }
    if (queries.empty()) continue;
    lock.unlock();
    std::vector<std::uint64_t> done;
    std::optional<std::pair<std::uint64_t, std::string>> failure;
    for (const auto& [id, is_complete] : queries) {
      try {
        if (is_complete()) done.push_back(id);
      } catch (const std::exception& error) {
        if (!failure) failure.emplace(id, error.what());
      }
    }
    lock.lock();
    const auto now = Clock::now();
    for (const std::uint64_t id : done) {
      if (auto entry = set_state_locked(id, CallState::completed, now)) finished.push_back(std::move(*entry));
    }
    if (auto flying = failure ? in_flight_.find(failure->first) : in_flight_.end();
        flying != in_flight_.end() && !fired_) {
      LedgerEntry call = flying->second.entry;
      if (auto entry = set_state_locked(call.id, CallState::failed, now)) finished.push_back(*entry);
      call.state = CallState::failed;
      call.finished = now;
      fire(lock, report(call, ": " + failure->second, now));
    }
    trace_finished(lock, finished);
  }
}

}  // namespace shardlab::dist
