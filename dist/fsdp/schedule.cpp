// dist/fsdp/schedule.cpp: a training step's compute and communication lanes, simulated
// (dist/fsdp/schedule.h).
#include "dist/fsdp/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <utility>

#include "core/error.h"

namespace shardlab::dist {
namespace {

class Lanes {
 public:
  explicit Lanes(Schedule& out) : out_(out) {}

  // A collective issued at `issued`: it runs once the lane is free; returns its end.
  double communicate(std::string what, double issued, double seconds) {
    const double start = std::max(issued, communication_free_);
    communication_free_ = start + seconds;
    out_.spans.push_back({ScheduleSpan::Lane::communication, std::move(what), start, communication_free_});
    return communication_free_;
  }
  // The compute lane waits until `ready` (a collective's end); the next compute span counts the wait.
  void wait(double ready) {
    if (ready <= compute_free_) return;
    out_.exposed_communication += ready - compute_free_;
    waited_ += ready - compute_free_;
    compute_free_ = ready;
  }
  void compute(std::string what, double seconds) {
    out_.spans.push_back({ScheduleSpan::Lane::compute, std::move(what), compute_free_,
                          compute_free_ + seconds, std::exchange(waited_, 0.0)});
    compute_free_ += seconds;
  }
  double now() const { return compute_free_; }

 private:
  Schedule& out_;
  double compute_free_ = 0, communication_free_ = 0, waited_ = 0;
};

void check(const std::vector<UnitTimes>& units, const ScheduleOptions& options) {
  SHARDLAB_CHECK(options.prefetch >= 0 && options.reductions_in_flight >= 1 && options.optimizer >= 0 &&
                     options.synchronisation >= 0,
                 "simulate_step: prefetch must be at least 0 and reductions in flight at least 1, the "
                 "optimizer's and the synchronisation's times not negative; got {}, {}, {} and {} s",
                 options.prefetch, options.reductions_in_flight, options.optimizer, options.synchronisation);
  for (const UnitTimes& unit : units) {
    SHARDLAB_CHECK(
        unit.forward >= 0 && unit.backward >= 0 && unit.gather >= 0 && unit.reduce >= 0 &&
            unit.replica_reduce >= 0,
        "simulate_step: unit {} has a negative time (forward {}, backward {}, gather {}, reduce {}, replica "
        "reduce {} s)",
        unit.name, unit.forward, unit.backward, unit.gather, unit.reduce, unit.replica_reduce);
  }
}

// The units in the order of their first segment in `pass`; checks every segment's unit and time.
std::vector<std::size_t> first_appearances(const std::vector<UnitTimes>& units,
                                           const std::vector<ComputeSegment>& pass, const char* name) {
  std::vector<std::size_t> order;
  std::vector<bool> seen(units.size(), false);
  for (const ComputeSegment& segment : pass) {
    SHARDLAB_CHECK(
        segment.unit >= -1 && segment.unit < static_cast<int>(units.size()) && segment.seconds >= 0,
        "simulate_step: a {} segment names unit {} of {} with {} s", name, segment.unit, units.size(),
        segment.seconds);
    if (segment.unit < 0 || seen[static_cast<std::size_t>(segment.unit)]) continue;
    seen[static_cast<std::size_t>(segment.unit)] = true;
    order.push_back(static_cast<std::size_t>(segment.unit));
  }
  for (std::size_t i = 0; i < units.size(); ++i)
    SHARDLAB_CHECK(seen[i], "simulate_step: unit {} has no {} segment", units[i].name, name);
  return order;
}

std::string span_name(const char* pass, const std::vector<UnitTimes>& units, int unit) {
  return unit < 0 ? fmt::format("{}, outside units", pass)
                  : fmt::format("{} {}", pass, units[static_cast<std::size_t>(unit)].name);
}

}  // namespace

Schedule simulate_step(const std::vector<UnitTimes>& units, const ScheduleOptions& options) {
  std::vector<ComputeSegment> forward, backward;
  for (std::size_t i = 0; i < units.size(); ++i) {
    forward.push_back({static_cast<int>(i), units[i].forward});
    backward.push_back({static_cast<int>(units.size() - 1 - i), units[units.size() - 1 - i].backward});
  }
  return simulate_step(units, forward, backward, options);
}

Schedule simulate_step(const std::vector<UnitTimes>& units, const std::vector<ComputeSegment>& forward,
                       const std::vector<ComputeSegment>& backward, const ScheduleOptions& options) {
  check(units, options);
  const std::vector<std::size_t> forward_order = first_appearances(units, forward, "forward");
  const std::vector<std::size_t> backward_order = first_appearances(units, backward, "backward");
  for (std::size_t i = 0; i < units.size(); ++i) {
    SHARDLAB_CHECK(forward_order[i] == i,
                   "simulate_step: the forward segments reach unit {} before unit {}, the units' order",
                   units[forward_order[i]].name, units[i].name);
  }
  Schedule schedule;
  Lanes lanes(schedule);
  const std::size_t count = units.size();
  const auto prefetch = static_cast<std::size_t>(options.prefetch);

  // Forward: gathered[i] is when unit i's parameters are whole (issued at most once).
  std::vector<double> gathered(count, -1);
  const auto gather = [&](std::size_t i, double issued) {
    if (gathered[i] < 0)
      gathered[i] = lanes.communicate("all-gather " + units[i].name, issued, units[i].gather);
  };
  std::vector<bool> started(count, false);
  for (const ComputeSegment& segment : forward) {
    if (segment.unit >= 0 && !started[static_cast<std::size_t>(segment.unit)]) {  // its pre-forward
      const auto i = static_cast<std::size_t>(segment.unit);
      started[i] = true;
      gather(i, lanes.now());
      lanes.wait(gathered[i]);
      for (std::size_t next = i + 1; next <= std::min(count - 1, i + prefetch); ++next)
        gather(next, lanes.now());
    }
    lanes.compute(span_name("forward", units, segment.unit), segment.seconds);
  }

  // Backward: units resharded after forward gather again, the next in backward order prefetched.
  std::vector<std::size_t> position(count), last_segment(count);
  for (std::size_t k = 0; k < count; ++k) position[backward_order[k]] = k;
  for (std::size_t s = 0; s < backward.size(); ++s) {
    if (backward[s].unit >= 0) last_segment[static_cast<std::size_t>(backward[s].unit)] = s;
  }
  std::vector<double> regathered(count, -1);
  const auto regather = [&](std::size_t i, double issued) {
    if (units[i].reshards_after_forward && regathered[i] < 0)
      regathered[i] = lanes.communicate("all-gather (backward) " + units[i].name, issued, units[i].gather);
  };
  std::fill(started.begin(), started.end(), false);
  std::deque<double> in_flight;  // the reductions' ends, oldest first
  std::vector<double> reduced(count, 0);
  for (std::size_t s = 0; s < backward.size(); ++s) {
    const int unit = backward[s].unit;
    if (unit >= 0 && !started[static_cast<std::size_t>(unit)]) {  // its pre-backward
      const auto i = static_cast<std::size_t>(unit);
      started[i] = true;
      regather(i, lanes.now());
      if (units[i].reshards_after_forward) lanes.wait(regathered[i]);
      for (std::size_t k = position[i] + 1; k <= std::min(count - 1, position[i] + prefetch); ++k)
        regather(backward_order[k], lanes.now());
    }
    lanes.compute(span_name("backward", units, unit), backward[s].seconds);
    if (unit < 0 || last_segment[static_cast<std::size_t>(unit)] != s) continue;
    const auto i = static_cast<std::size_t>(unit);  // its post-backward
    in_flight.push_back(lanes.communicate("reduce " + units[i].name, lanes.now(), units[i].reduce));
    reduced[i] = in_flight.back();
    while (in_flight.size() > static_cast<std::size_t>(options.reductions_in_flight)) {
      lanes.wait(in_flight.front());
      in_flight.pop_front();
    }
  }
  if (options.synchronisation > 0)
    lanes.wait(lanes.communicate("synchronisation", lanes.now(), options.synchronisation));
  for (std::size_t i = 0; i < count; ++i) {
    if (units[i].replica_reduce <= 0) continue;
    lanes.wait(reduced[i]);
    lanes.wait(
        lanes.communicate("all-reduce (replicas) " + units[i].name, lanes.now(), units[i].replica_reduce));
  }
  for (const double end : reduced) lanes.wait(end);
  lanes.compute("optimizer", options.optimizer);
  schedule.step = lanes.now();
  return schedule;
}

}  // namespace shardlab::dist
