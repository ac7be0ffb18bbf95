// dist/fsdp/schedule.cpp: a training step's compute and communication lanes, simulated
// (dist/fsdp/schedule.h).
#include "dist/fsdp/schedule.h"

#include <algorithm>
#include <deque>

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
  // The compute lane waits until `ready` (a collective's end).
  void wait(double ready) {
    if (ready <= compute_free_) return;
    out_.exposed_communication += ready - compute_free_;
    compute_free_ = ready;
  }
  void compute(std::string what, double seconds) {
    out_.spans.push_back(
        {ScheduleSpan::Lane::compute, std::move(what), compute_free_, compute_free_ + seconds});
    compute_free_ += seconds;
  }
  double now() const { return compute_free_; }

 private:
  Schedule& out_;
  double compute_free_ = 0, communication_free_ = 0;
};

void check(const std::vector<UnitTimes>& units, const ScheduleOptions& options) {
  SHARDLAB_CHECK(
      options.prefetch >= 0 && options.reductions_in_flight >= 1 && options.optimizer >= 0,
      "simulate_step: prefetch must be at least 0 and reductions in flight at least 1, the optimizer's "
      "time not negative; got {}, {} and {} s",
      options.prefetch, options.reductions_in_flight, options.optimizer);
  for (const UnitTimes& unit : units) {
    SHARDLAB_CHECK(
        unit.forward >= 0 && unit.backward >= 0 && unit.gather >= 0 && unit.reduce >= 0,
        "simulate_step: unit {} has a negative time (forward {}, backward {}, gather {}, reduce {} s)",
        unit.name, unit.forward, unit.backward, unit.gather, unit.reduce);
  }
}

}  // namespace

Schedule simulate_step(const std::vector<UnitTimes>& units, const ScheduleOptions& options) {
  check(units, options);
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
  for (std::size_t i = 0; i < count; ++i) {
    gather(i, lanes.now());
    lanes.wait(gathered[i]);
    for (std::size_t next = i + 1; next <= std::min(count - 1, i + prefetch); ++next)
      gather(next, lanes.now());
    lanes.compute("forward " + units[i].name, units[i].forward);
  }

  // Backward, in reverse: units resharded after forward gather again.
  std::vector<double> regathered(count, -1);
  const auto regather = [&](std::size_t i, double issued) {
    if (units[i].reshards_after_forward && regathered[i] < 0)
      regathered[i] = lanes.communicate("all-gather (backward) " + units[i].name, issued, units[i].gather);
  };
  std::deque<double> in_flight;  // the reductions' ends, oldest first
  double reduced = 0;
  for (std::size_t k = 0; k < count; ++k) {
    const std::size_t i = count - 1 - k;
    regather(i, lanes.now());
    if (units[i].reshards_after_forward) lanes.wait(regathered[i]);
    for (std::size_t ahead = 1; ahead <= prefetch && ahead <= i; ++ahead) regather(i - ahead, lanes.now());
    lanes.compute("backward " + units[i].name, units[i].backward);
    in_flight.push_back(lanes.communicate("reduce " + units[i].name, lanes.now(), units[i].reduce));
    reduced = std::max(reduced, in_flight.back());
    while (in_flight.size() > static_cast<std::size_t>(options.reductions_in_flight)) {
      lanes.wait(in_flight.front());
      in_flight.pop_front();
    }
  }
  lanes.wait(reduced);
  lanes.compute("optimizer", options.optimizer);
  schedule.step = lanes.now();
  return schedule;
}

}  // namespace shardlab::dist
