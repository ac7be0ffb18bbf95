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

// The two lanes as one clock that the compute lane drives: compute advances it by its work, a wait
// until a collective's end; meanwhile the communication lane runs the collectives issued, one at a time
// in issue order. While both run they share the cores: compute at 1 / options.compute_slowdown of its
// speed alone, collectives at 1 / options.communication_slowdown (both 1: they do not interfere).
class Lanes {
 public:
  Lanes(Schedule& out, const ScheduleOptions& options)
      : out_(out),
        compute_slowdown_(options.compute_slowdown),
        communication_slowdown_(options.communication_slowdown) {}

  // Issues a collective of `seconds` alone now; returns its handle for wait().
  std::size_t communicate(std::string what, double seconds) {
    const std::size_t handle = ended_.size();
    ended_.push_back(false);
    span_of_.push_back(out_.spans.size());
    out_.spans.push_back({ScheduleSpan::Lane::communication, std::move(what), now_, now_});
    queue_.push_back({handle, seconds});
    return handle;
  }
  // The compute lane waits until the collective `handle` ended (the communication lane alone meanwhile);
  // the next compute span counts the wait.
  void wait(std::size_t handle) {
    while (!ended_[handle]) {
      const double dt = queue_.front().left;
      now_ += dt;
      out_.exposed_communication += dt;
      waited_ += dt;
      end_head();
    }
  }
  void compute(std::string what, double seconds, int unit = -1) {
    const double start = now_;
    double work = seconds;  // compute left, in seconds alone
    while (work > 0 && !queue_.empty()) {
      const double to_end_head = queue_.front().left * communication_slowdown_;
      if (to_end_head <= work * compute_slowdown_) {
        now_ += to_end_head;
        work = std::max(0.0, work - to_end_head / compute_slowdown_);
        end_head();
      } else {
        now_ += work * compute_slowdown_;
        queue_.front().left -= work * compute_slowdown_ / communication_slowdown_;
        work = 0;
      }
    }
    now_ += work;
    out_.spans.push_back(
        {ScheduleSpan::Lane::compute, std::move(what), start, now_, std::exchange(waited_, 0.0), unit});
  }
  double now() const { return now_; }

 private:
  struct InFlight {
    std::size_t handle;
    double left;  // seconds alone
  };
  void end_head() {
    const std::size_t handle = queue_.front().handle;
    queue_.pop_front();
    ended_[handle] = true;
    out_.spans[span_of_[handle]].end = now_;
    if (!queue_.empty()) {
      out_.spans[span_of_[queue_.front().handle]].start = now_;
    }
  }

  Schedule& out_;
  const double compute_slowdown_, communication_slowdown_;
  double now_ = 0, waited_ = 0;
  std::deque<InFlight> queue_;        // issued and not ended, the running one first
  std::vector<bool> ended_;           // per handle
  std::vector<std::size_t> span_of_;  // per handle: its span in out_.spans
};

void check(const std::vector<UnitTimes>& units, const ScheduleOptions& options) {
  SHARDLAB_CHECK(options.prefetch >= 0 && options.reductions_in_flight >= 1 && options.optimizer >= 0 &&
                     options.synchronisation >= 0,
                 "simulate_step: prefetch must be at least 0 and reductions in flight at least 1, the "
                 "optimizer's and the synchronisation's times not negative; got {}, {}, {} and {} s",
                 options.prefetch, options.reductions_in_flight, options.optimizer, options.synchronisation);
  SHARDLAB_CHECK(options.micro_batches >= 1, "simulate_step: a step runs at least 1 micro-batch, got {}",
                 options.micro_batches);
  SHARDLAB_CHECK(options.compute_slowdown >= 1 && options.communication_slowdown >= 1,
                 "simulate_step: the slowdowns of compute and communication beside each other must be at "
                 "least 1, got {} and {}",
                 options.compute_slowdown, options.communication_slowdown);
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

// One forward and backward; returns each unit's reduction handle (kNone where `reduces` is false).
std::vector<std::size_t> simulate_pass(Lanes& lanes, const std::vector<UnitTimes>& units,
                                       const std::vector<ComputeSegment>& forward,
                                       const std::vector<ComputeSegment>& backward,
                                       const std::vector<std::size_t>& backward_order,
                                       const ScheduleOptions& options, bool reduces) {
  const std::size_t count = units.size();
  const auto prefetch = static_cast<std::size_t>(options.prefetch);

  // Forward: gathered[i] is unit i's all-gather (issued at most once).
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::vector<std::size_t> gathered(count, kNone);
  const auto gather = [&](std::size_t i) {
    if (gathered[i] == kNone) gathered[i] = lanes.communicate("all-gather " + units[i].name, units[i].gather);
  };
  std::vector<bool> started(count, false);
  for (const ComputeSegment& segment : forward) {
    if (segment.unit >= 0 && !started[static_cast<std::size_t>(segment.unit)]) {  // its pre-forward
      const auto i = static_cast<std::size_t>(segment.unit);
      started[i] = true;
      gather(i);
      lanes.wait(gathered[i]);
      for (std::size_t next = i + 1; next <= std::min(count - 1, i + prefetch); ++next) gather(next);
    }
    lanes.compute(span_name("forward", units, segment.unit), segment.seconds, segment.unit);
  }

  // Backward: units resharded after forward gather again, the next in backward order prefetched.
  std::vector<std::size_t> position(count), last_segment(count);
  for (std::size_t k = 0; k < count; ++k) position[backward_order[k]] = k;
  for (std::size_t s = 0; s < backward.size(); ++s) {
    if (backward[s].unit >= 0) last_segment[static_cast<std::size_t>(backward[s].unit)] = s;
  }
  std::vector<std::size_t> regathered(count, kNone);
  const auto regather = [&](std::size_t i) {
    if (units[i].reshards_after_forward && regathered[i] == kNone)
      regathered[i] = lanes.communicate("all-gather (backward) " + units[i].name, units[i].gather);
  };
  std::fill(started.begin(), started.end(), false);
  std::deque<std::size_t> in_flight;  // the reductions, oldest first
  std::vector<std::size_t> reduced(count, kNone);
  for (std::size_t s = 0; s < backward.size(); ++s) {
    const int unit = backward[s].unit;
    if (unit >= 0 && !started[static_cast<std::size_t>(unit)]) {  // its pre-backward
      const auto i = static_cast<std::size_t>(unit);
      started[i] = true;
      regather(i);
      if (units[i].reshards_after_forward) lanes.wait(regathered[i]);
      for (std::size_t k = position[i] + 1; k <= std::min(count - 1, position[i] + prefetch); ++k)
        regather(backward_order[k]);
    }
    lanes.compute(span_name("backward", units, unit), backward[s].seconds, unit);
    if (unit < 0 || last_segment[static_cast<std::size_t>(unit)] != s) continue;
    const auto i = static_cast<std::size_t>(unit);  // its post-backward
    if (!reduces) continue;
    in_flight.push_back(lanes.communicate("reduce " + units[i].name, units[i].reduce));
    reduced[i] = in_flight.back();
    while (in_flight.size() > static_cast<std::size_t>(options.reductions_in_flight)) {
      lanes.wait(in_flight.front());
      in_flight.pop_front();
    }
  }
  return reduced;
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
  Lanes lanes(schedule, options);
  for (int micro_batch = 1; micro_batch <= options.micro_batches; ++micro_batch) {
    const bool last = micro_batch == options.micro_batches;
    const bool reduces = last || options.reduce_every_micro_batch;
    const std::vector<std::size_t> reduced = simulate_pass(lanes, units, forward, backward, backward_order,
                                                           options, reduces);
    if (!reduces) continue;
    if (last && options.synchronisation > 0)
      lanes.wait(lanes.communicate("synchronisation", options.synchronisation));
    if (last || options.all_reduce_every_micro_batch) {
      for (std::size_t i = 0; i < units.size(); ++i) {
        if (units[i].replica_reduce <= 0) continue;
        lanes.wait(reduced[i]);
        lanes.wait(lanes.communicate("all-reduce (replicas) " + units[i].name, units[i].replica_reduce));
      }
    }
    for (const std::size_t reduction : reduced) lanes.wait(reduction);
  }
  lanes.compute("optimizer", options.optimizer);
  schedule.step = lanes.now();
  return schedule;
}

}  // namespace shardlab::dist
