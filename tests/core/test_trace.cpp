// tests/core/test_trace.cpp: the trace recorder (nothing while off; spans, counters, flows and tracks
// while on) and the overlap figures on a hand-computed synthetic timeline.
#include <algorithm>
#include <set>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/tensor.h"
#include "core/trace.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("the recorder keeps nothing while off and every event while on", "[trace]") {
  trace::stop();
  trace::take();
  { trace::Span span("ignored", "compute"); }
  trace::counter("ignored", {{"x", std::int64_t{1}}});
  CHECK(trace::take().empty());

  trace::start();
  const auto flow = trace::next_flow_id();
  {
    trace::Span outer("outer", "compute");
    outer.arg("unit", std::string("layers.0"));
    trace::flow_start(flow, "all_gather", "communication");
    { trace::Span inner("inner", "wait"); }
    trace::flow_end(flow, "all_gather", "communication");
  }
  const Tensor held = zeros({1000});
  trace::memory_counter();
  const MemoryStats stats = memory_stats(Device::cpu());
  int other_track = 0;
  std::thread([&] {
    other_track = trace::this_thread_track();
    trace::instant("elsewhere", "data");
  }).join();
  const int comm = trace::named_track("communication: world");
  CHECK(trace::named_track("communication: world") == comm);
  trace::stop();
  trace::instant("after stop", "data");

  const std::vector<trace::Event> events = trace::take();
  REQUIRE(events.size() == 6);
  // Spans are recorded when they end: the inner one first.
  CHECK(events[0].phase == trace::Phase::flow_start);
  CHECK(events[1].name == "inner");
  CHECK(events[2].phase == trace::Phase::flow_end);
  CHECK(events[2].flow == events[0].flow);
  CHECK(events[3].name == "outer");
  CHECK(events[3].phase == trace::Phase::complete);
  CHECK(events[3].begin <= events[1].begin);
  CHECK(events[1].end <= events[3].end);
  REQUIRE(events[3].args.size() == 1);
  CHECK(std::get<std::string>(events[3].args[0].value) == "layers.0");
  CHECK(events[3].track == trace::this_thread_track());
  // The counter is the allocator's own statistics at that moment.
  CHECK(events[4].phase == trace::Phase::counter);
  REQUIRE(events[4].args.size() == 2);
  CHECK(std::get<std::int64_t>(events[4].args[0].value) == stats.bytes_in_use);
  CHECK(std::get<std::int64_t>(events[4].args[1].value) == stats.peak_bytes);
  CHECK(events[5].track == other_track);
  CHECK(other_track != trace::this_thread_track());
  CHECK(other_track != comm);
  bool named = false;
  for (const trace::Track& track : trace::tracks())
    named |= track.id == comm && track.name == "communication: world";
  CHECK(named);
}

TEST_CASE("threads recording at once lose no event and take() returns them in recording order", "[trace]") {
  // Each thread records into a buffer of its own; take() merges them by a global sequence number.
  trace::start();
  constexpr int kThreads = 4, kEach = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kEach; ++i)
        trace::instant("e", "data", {{"thread", std::int64_t{t}}, {"i", std::int64_t{i}}});
    });
  }
  for (std::thread& thread : threads) thread.join();
  trace::instant("last", "data");  // after every thread's events
  trace::stop();
  const std::vector<trace::Event> events = trace::take();
  REQUIRE(events.size() == kThreads * kEach + 1);
  CHECK(events.back().name == "last");
  // Per thread, the events come back in the order that thread recorded them, each once.
  std::vector<std::int64_t> next(kThreads, 0);
  for (std::size_t e = 0; e + 1 < events.size(); ++e) {
    const auto t = static_cast<std::size_t>(std::get<std::int64_t>(events[e].args[0].value));
    CHECK(std::get<std::int64_t>(events[e].args[1].value) == next[t]++);
  }
  CHECK(std::count(next.begin(), next.end(), kEach) == kThreads);
  // Each thread had a track of its own.
  std::set<int> tracks;
  for (const trace::Event& event : events) tracks.insert(event.track);
  CHECK(tracks.size() == kThreads + 1);
  CHECK(trace::take().empty());  // take() keeps nothing
}

TEST_CASE("overlap: communication, compute, exposed communication on a synthetic timeline", "[trace]") {
  // Communication [0,10], [20,30], [25,40]: union [0,10] + [20,40] = 30.
  // Compute [5,22], [35,50] less the waits [15,18]: [5,15] + [18,22] + [35,50] = 10 + 4 + 15 = 29.
  // Exposed: [0,10] less [5,15] = [0,5] (5); [20,40] less [18,22] and [35,50] = [22,35] (13): 18.
  // Overlap: 1 - 18/30 = 40%.
  const std::vector<trace::Interval> communication{{0, 10}, {20, 30}, {25, 40}};
  const std::vector<trace::Interval> busy{{5, 22}, {35, 50}, {6, 7}};
  const std::vector<trace::Interval> waits{{15, 18}};
  const trace::Overlap figures = trace::overlap(communication, trace::subtract(busy, waits));
  CHECK(figures.communication == 30);
  CHECK(figures.compute == 29);
  CHECK(figures.exposed == 18);
  CHECK(figures.percent() == Approx(40.0));

  CHECK(trace::overlap({}, busy).percent() == 100.0);
  CHECK(trace::overlap(communication, {}).percent() == 0.0);
  CHECK(trace::length(trace::clip(communication, {5, 27})) == 5 + 7);
  const std::vector<trace::Interval> none = trace::merged({{3, 3}, {4, 2}});
  CHECK(none.empty());
}
