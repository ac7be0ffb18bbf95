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
//   then the step's small collectives (synchronisation) run and are waited for, each unit's replica
//   all-reduce in turn, every reduction is waited for, and the optimizer step runs on the compute lane.
//   With micro-batches, forward and backward repeat before that, each ending as it reduces: waiting
//   for its reductions and its replica all-reduces, or for none where it keeps its gradients.
//
// Where the step's compute is given as segments in the order it ran (the calls of a dry step split by
// their cost labels), a unit's gather is waited for before its first segment of the pass and its
// reduction issued after its last: a parent's compute around its children's (the root's embedding
// before the layers, its head after them) and the step's own (the loss) fall where they ran.
//
// Where both run at once and share the cores (the compute_slowdown and communication_slowdown
// options), each progresses at its share of its speed alone.
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
  double reduce = 0;                 // its gradient's reduce-scatter, issued at its backward's end
  // Hybrid and no sharding: the all-reduce over the replicas, issued for each unit in turn once the
  // whole backward is over (after the reduce-scatter), and waited for.
  double replica_reduce = 0;
  bool reshards_after_forward = true;
};

struct ScheduleOptions {
  int prefetch = 1;
  int reductions_in_flight = 2;
  double optimizer = 0;  // the optimizer step's compute (and the gradient norm's)
  // The step's small collectives after the backward (which parameters got a gradient, the gradient
  // norm, the loss): on the communication lane once the reductions are done, waited for in full.
  double synchronisation = 0;
  // Where compute and collectives share the same cores (ranks on a CPU), how much slower each runs
  // while the other does (1: not at all; CollectiveRates measures both).
  double compute_slowdown = 1, communication_slowdown = 1;
  // Gradient accumulation: the forward and backward run this many times before the optimizer step,
  // each gathering as a step does. A micro-batch before the last reduces (and waits for its
  // reductions at its end) only where `reduce_every_micro_batch`; its replica all-reduces only where
  // `all_reduce_every_micro_batch` too. The step's small collectives come once, after the last.
  int micro_batches = 1;
  bool reduce_every_micro_batch = true, all_reduce_every_micro_batch = true;
};

// A stretch of one pass's compute: of the unit at `unit` in the units given (its forward or backward
// as its cost label named it), or where `unit` is -1 the step's own, outside every unit (the loss).
struct ComputeSegment {
  int unit = -1;
  double seconds = 0;
};

struct ScheduleSpan {
  enum class Lane { compute, communication } lane;
  std::string what;  // "forward <unit>", "all-gather <unit>", "reduce <unit>", "optimizer", ...
  double start = 0, end = 0;
  double waited = 0;  // compute: how long the lane waited for a collective right before it
  int unit = -1;      // compute: the index of the unit it belongs to (-1: outside units, the optimizer)
};

struct Schedule {
  std::vector<ScheduleSpan> spans;   // in the order they were placed
  double step = 0;                   // the optimizer step's end
  double exposed_communication = 0;  // time the compute lane waited for a collective
};

// `units` in forward order, each unit's compute one segment per pass. Errors name a negative time, a
// prefetch or in-flight count below 0 and 1, or fewer than 1 micro-batch.
Schedule simulate_step(const std::vector<UnitTimes>& units, const ScheduleOptions& options = {});

// The passes' compute as `forward` and `backward` segments (the units' forward and backward times
// unused). Every unit needs a segment in each pass, its first forward ones in the order of `units`;
// an Error names a unit without one, one out of order, or a segment's unit out of range.
Schedule simulate_step(const std::vector<UnitTimes>& units, const std::vector<ComputeSegment>& forward,
                       const std::vector<ComputeSegment>& backward, const ScheduleOptions& options = {});

}  // namespace shardlab::dist
