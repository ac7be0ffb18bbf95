// core/trace.h: the trace recorder (spans, instants, counters and flows on tracks, kept in memory
// while recording is on) and the interval arithmetic that derives overlap figures from spans.
// Recording off, every entry point costs one relaxed load of a global flag; callers that build
// names or arguments check trace::on() first.
//
//   trace::start();
//   { trace::Span span("optimizer step", "compute"); optimizer.step(); }
//   trace::counter("memory", {{"in_use", bytes}});
//   trace::stop();
//   std::vector<trace::Event> events = trace::take();  // dist/fsdp/trace.h writes them as JSON
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace shardlab::trace {

using Clock = std::chrono::steady_clock;

// The Chrome trace-event phases the recorder emits (metadata 'M' is added when writing).
enum class Phase : char { complete = 'X', instant = 'i', counter = 'C', flow_start = 's', flow_end = 'f' };

struct Arg {
  std::string key;
  std::variant<std::int64_t, double, std::string> value;
};
using Args = std::vector<Arg>;

struct Event {
  Phase phase = Phase::instant;
  std::string name, category;
  int track = 0;
  Clock::time_point begin, end;  // end == begin except for complete spans
  std::uint64_t flow = 0;        // flows: start and end share it
  Args args;
};

namespace detail {
inline std::atomic<bool> recording{false};
}

inline bool on() { return detail::recording.load(std::memory_order_relaxed); }

// Recording from now on; events recorded before are dropped. origin() is now.
void start();
void stop();
Clock::time_point origin();
// The events recorded since start(), in recording order; the recorder keeps none.
std::vector<Event> take();

// Tracks are what a viewer draws as rows (Chrome's tid): each recording thread has its own,
// numbered in order of first use; a named track stands for work that is no thread of ours (the
// collectives of one communicator). Ids start at 1.
int this_thread_track();
int named_track(const std::string& name);
void name_this_thread(const std::string& name);
struct Track {
  int id = 0;
  std::string name;
};
std::vector<Track> tracks();

void complete(std::string name, std::string category, int track, Clock::time_point begin,
              Clock::time_point end, Args args = {});
void instant(std::string name, std::string category, Args args = {});
// One sample of each series in `values` (a viewer draws one counter track per name).
void counter(std::string name, Args values);
// An arrow from the span around flow_start to the span around flow_end (on this thread's track).
std::uint64_t next_flow_id();
void flow_start(std::uint64_t id, std::string name, std::string category);
void flow_end(std::uint64_t id, std::string name, std::string category);
// The CPU allocator's bytes in use and peak, as the counter "cpu memory".
void memory_counter();

// A span on this thread's track from construction to destruction; nothing when recording is off
// at construction.
class Span {
 public:
  Span(const char* name, const char* category) : Span(on() ? std::string(name) : std::string(), category) {}
  Span(std::string name, const char* category);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  // Nothing, not even a copy of `value`, when the span is not recorded.
  template <typename T>
  void arg(const char* key, const T& value) {
    if (active_) args_.push_back({key, value});
  }

 private:
  bool active_ = false;
  std::string name_;
  const char* category_;
  Clock::time_point begin_;
  Args args_;
};

// --- overlap figures ---------------------------------------------------------------------------

struct Interval {
  double begin = 0, end = 0;
};
// The union of `intervals` as disjoint intervals in increasing order (empty ones dropped).
std::vector<Interval> merged(std::vector<Interval> intervals);
double length(const std::vector<Interval>& intervals);  // of their union
// The parts of `from` that no interval of `minus` covers.
std::vector<Interval> subtract(const std::vector<Interval>& from, const std::vector<Interval>& minus);
std::vector<Interval> clip(const std::vector<Interval>& intervals, Interval window);

struct Overlap {
  double communication = 0;  // length of the union of communication intervals
  double compute = 0;        // length of the union of compute intervals
  double exposed = 0;        // communication that no compute covers
  // 1 - exposed / communication, as a percentage (100 when there is no communication).
  double percent() const { return communication > 0 ? 100.0 * (1.0 - exposed / communication) : 100.0; }
};
Overlap overlap(const std::vector<Interval>& communication, const std::vector<Interval>& compute);

}  // namespace shardlab::trace
