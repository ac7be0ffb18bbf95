// dist/fsdp/schedule.h: one training step of FSDP units simulated as the runtime orders it, from each
// unit's compute and collective times: two lanes, compute and communication (the MPI thread or the
// NCCL stream), the communication lane running collectives one at a time in the order they are issued.
//
//   forward, units in order: a unit's compute waits for its all-gather; when it starts, the all-gathers
//     of the next `prefetch` units are issued (the first unit's at the step's start);
//   backward, in reverse: a unit resharded after forward gathers again, the next `prefetch` such
//     units' all-gathers issued when a unit's backward starts (the first at the backward's start);
//     when its backward ends, its reduction is issued, and the compute lane waits for the oldest
//     reduction beyond `reductions_in_flight` (FSDP frees its input);
//   then every reduction is waited for, and the optimizer step runs on the compute lane.
//
// Out come the step time, the communication the compute lane waited for (exposed), and the spans.
#pragma once

#include <string>
#include <vector>

namespace shardlab::dist {

struct UnitTimes {
  std::string name;
  double forward = 0, backward = 0;  // compute, seconds
  double gather = 0;                 // all-gather of its parameters
  double reduce = 0;                 // its gradient's reduction (reduce-scatter, and all-reduce where hybrid)
  bool reshards_after_forward = true;
};

struct ScheduleOptions {
  int prefetch = 1;
  int reductions_in_flight = 2;
  double optimizer = 0;  // the optimizer step's compute
};

struct ScheduleSpan {
  enum class Lane { compute, communication } lane;
  std::string what;  // "forward <unit>", "all-gather <unit>", "reduce <unit>", "optimizer", ...
  double start = 0, end = 0;
};

struct Schedule {
  std::vector<ScheduleSpan> spans;   // in the order they were placed
  double step = 0;                   // the optimizer step's end
  double exposed_communication = 0;  // time the compute lane waited for a collective
};

// `units` in forward order. Errors name a negative time or a prefetch or in-flight count below 0 and 1.
Schedule simulate_step(const std::vector<UnitTimes>& units, const ScheduleOptions& options = {});

}  // namespace shardlab::dist
