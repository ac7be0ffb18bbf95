// core/trace.cpp: the recorder's per-thread event buffers and tracks, and the interval arithmetic.
#include "core/trace.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "core/allocator.h"

namespace shardlab::trace {

namespace {

// Each recording thread appends to a buffer of its own, so the compute thread, the collectives'
// progress thread and the watchdog never wait on one another's events (with more threads than
// cores, a lock held by a descheduled thread cost a traced step microseconds per event). The lock
// of a buffer is only ever contended by start() and take(). A global sequence number keeps the
// recording order across threads.
struct Recorded {
  std::uint64_t sequence;
  Event event;
};
struct ThreadBuffer {
  std::mutex mutex;
  std::vector<Recorded> events;
};

std::mutex registry_mutex;                           // the buffers, the tracks and the origin
std::vector<std::shared_ptr<ThreadBuffer>> buffers;  // kept after their thread ends: its events stay
std::atomic<std::uint64_t> sequence{0};
Clock::time_point started;
std::map<std::string, int> named;  // named track -> id
std::vector<Track> all_tracks;
std::atomic<std::uint64_t> flows{0};

int add_track_locked(std::string name) {
  const int id = static_cast<int>(all_tracks.size()) + 1;
  all_tracks.push_back({id, std::move(name)});
  return id;
}

ThreadBuffer& this_thread_buffer() {
  thread_local const std::shared_ptr<ThreadBuffer> mine = [] {
    auto buffer = std::make_shared<ThreadBuffer>();
    std::lock_guard lock(registry_mutex);
    buffers.push_back(buffer);
    return buffer;
  }();
  return *mine;
}

void record(Event event) {
  ThreadBuffer& buffer = this_thread_buffer();
  const std::uint64_t order = sequence.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(buffer.mutex);
  buffer.events.push_back({order, std::move(event)});
}

}  // namespace

void start() {
  std::lock_guard lock(registry_mutex);
  for (const auto& buffer : buffers) {
    std::lock_guard buffer_lock(buffer->mutex);
    buffer->events.clear();
  }
  started = Clock::now();
  detail::recording.store(true, std::memory_order_relaxed);
}

void stop() { detail::recording.store(false, std::memory_order_relaxed); }

Clock::time_point origin() {
  std::lock_guard lock(registry_mutex);
  return started;
}

std::vector<Event> take() {
  std::vector<Recorded> all;
  {
    std::lock_guard lock(registry_mutex);
    for (const auto& buffer : buffers) {
      std::lock_guard buffer_lock(buffer->mutex);
      std::move(buffer->events.begin(), buffer->events.end(), std::back_inserter(all));
      buffer->events.clear();
    }
  }
  std::sort(all.begin(), all.end(),
            [](const Recorded& a, const Recorded& b) { return a.sequence < b.sequence; });
  std::vector<Event> events;
  events.reserve(all.size());
  for (Recorded& recorded : all) events.push_back(std::move(recorded.event));
  return events;
}

int this_thread_track() {
  thread_local int track = 0;
  if (track == 0) {
    std::lock_guard lock(registry_mutex);
    track = add_track_locked("thread " + std::to_string(all_tracks.size() + 1));
  }
  return track;
}

int named_track(const std::string& name) {
  std::lock_guard lock(registry_mutex);
  auto [it, added] = named.try_emplace(name, 0);
  if (added) it->second = add_track_locked(name);
  return it->second;
}

void name_this_thread(const std::string& name) {
  const int track = this_thread_track();
  std::lock_guard lock(registry_mutex);
  all_tracks[static_cast<std::size_t>(track - 1)].name = name;
}

std::vector<Track> tracks() {
  std::lock_guard lock(registry_mutex);
  return all_tracks;
}

void complete(std::string name, std::string category, int track, Clock::time_point begin,
              Clock::time_point end, Args args) {
  if (!on()) return;
  record({.phase = Phase::complete,
          .name = std::move(name),
          .category = std::move(category),
          .track = track,
          .begin = begin,
          .end = end,
          .args = std::move(args)});
}

namespace {

// An event at this moment on this thread's track.
void record_now(Phase phase, std::string name, std::string category, Args args, std::uint64_t flow = 0) {
  if (!on()) return;
  const auto now = Clock::now();
  record({.phase = phase,
          .name = std::move(name),
          .category = std::move(category),
          .track = this_thread_track(),
          .begin = now,
          .end = now,
          .flow = flow,
          .args = std::move(args)});
}

}  // namespace

void instant(std::string name, std::string category, Args args) {
  record_now(Phase::instant, std::move(name), std::move(category), std::move(args));
}

void counter(std::string name, Args values) {
  record_now(Phase::counter, std::move(name), "counter", std::move(values));
}

std::uint64_t next_flow_id() { return flows.fetch_add(1, std::memory_order_relaxed) + 1; }

void flow_start(std::uint64_t id, std::string name, std::string category) {
  record_now(Phase::flow_start, std::move(name), std::move(category), {}, id);
}

void flow_end(std::uint64_t id, std::string name, std::string category) {
  record_now(Phase::flow_end, std::move(name), std::move(category), {}, id);
}

void memory_counter() {
  if (!on()) return;
  const MemoryStats stats = memory_stats(Device::cpu());
  counter("cpu memory", {{"in_use", stats.bytes_in_use}, {"peak", stats.peak_bytes}});
}

Span::Span(std::string name, const char* category)
    : active_(on()), name_(std::move(name)), category_(category) {
  if (active_) begin_ = Clock::now();
}

Span::~Span() {
  if (active_)
    complete(std::move(name_), category_, this_thread_track(), begin_, Clock::now(), std::move(args_));
}

// --- overlap figures ---------------------------------------------------------------------------

std::vector<Interval> merged(std::vector<Interval> intervals) {
  std::erase_if(intervals, [](const Interval& i) { return !(i.end > i.begin); });
  std::sort(intervals.begin(), intervals.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  for (const Interval& i : intervals) {
    if (!out.empty() && i.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, i.end);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

double length(const std::vector<Interval>& intervals) {
  double total = 0;
  for (const Interval& i : merged(intervals)) total += i.end - i.begin;
  return total;
}

std::vector<Interval> subtract(const std::vector<Interval>& from, const std::vector<Interval>& minus) {
  const std::vector<Interval> holes = merged(minus);
  std::vector<Interval> out;
  for (Interval piece : merged(from)) {
    for (const Interval& hole : holes) {
      if (hole.end <= piece.begin || hole.begin >= piece.end) continue;
      if (hole.begin > piece.begin) out.push_back({piece.begin, hole.begin});
      piece.begin = hole.end;
      if (piece.begin >= piece.end) break;
    }
    if (piece.end > piece.begin) out.push_back(piece);
  }
  return out;
}

std::vector<Interval> clip(const std::vector<Interval>& intervals, Interval window) {
  std::vector<Interval> out;
  for (const Interval& i : intervals) {
    const Interval part{std::max(i.begin, window.begin), std::min(i.end, window.end)};
    if (part.end > part.begin) out.push_back(part);
  }
  return out;
}

Overlap overlap(const std::vector<Interval>& communication, const std::vector<Interval>& compute) {
  return {.communication = length(communication),
          .compute = length(compute),
          .exposed = length(subtract(communication, compute))};
}

}  // namespace shardlab::trace
