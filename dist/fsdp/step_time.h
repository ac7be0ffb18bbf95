// dist/fsdp/step_time.h: one rank's training step time, predicted before step 1: the kernel calls of a
// dry forward and backward (core/op_cost.h) split by the units' cost labels and timed by the device's
// roofline (core/roofline.h), the plan's collectives timed by the communicator's fitted lines
// (dist/comm/collective_rates.h), both placed by simulate_step (dist/fsdp/schedule.h) as the runtime
// orders them; what --explain prints, and what the run's measured step is set beside.
//
//   const auto dry = kernel_costs([&] { const StepCostLabel step; forward and backward });
//   const StepTimePrediction predicted = predict_step_time(plan, dry, measure_rates(device),
//                                                          measure_collectives(comm));
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/op_cost.h"
#include "core/roofline.h"
#include "dist/comm/collective_rates.h"
#include "dist/fsdp/fsdp.h"
#include "dist/fsdp/schedule.h"

namespace shardlab::dist {

// The cost label of the step's own calls, outside every unit (the loss, its gradient): a dry step runs
// under it, so that calls without a label are another thread's (the communication's), left out.
inline constexpr const char* kStepCostLabel = "step";
struct StepCostLabel {
  StepCostLabel() { open_cost_label(kStepCostLabel); }
  ~StepCostLabel() { close_cost_label(kStepCostLabel); }
  StepCostLabel(const StepCostLabel&) = delete;
  StepCostLabel& operator=(const StepCostLabel&) = delete;
};

// What bounds a stretch of time: dense math at the device's rate, memory traffic, the per-call cost
// (dispatch, launch), or waiting for a collective.
struct TimeBounds {
  double dense = 0, memory = 0, calls = 0, communication = 0;
  double total() const { return dense + memory + calls + communication; }
  const char* limited_by() const;  // "compute", "memory", "calls" or "communication": the largest
};

struct UnitStepTime {
  std::string name;                  // as traces name it: "(root)", "model.layers.0"
  double forward = 0, backward = 0;  // compute (backward: with activation checkpointing's recompute)
  double gather = 0;                 // one all-gather of its parameters (twice where resharded)
  double reduce = 0, replica_reduce = 0;
  // CPU offload's copies are in gather (the shard to the device) and reduce (the gradient shard back).
  TimeBounds bounds;  // its compute by bound, and the waits for its collectives (communication)
};

struct StepTimeOptions {
  // The step's small all-reduces besides the plan's (the samples, the loss, the gradient norm, the
  // stop request): latency each.
  int small_all_reduces = 0;
  // The optimizer's update per element of a shard (optim::Optimizer::update_seconds_per_element);
  // 0: its bytes (shard, gradient, state) at the memory rate.
  double update_seconds_per_element = 0;
  // The same on the host, for CPU offload's units, whose update runs there; 0: update_seconds_per_element.
  double host_update_seconds_per_element = 0;
};

struct StepTimePrediction {
  std::string device, link;             // the rates used, in words
  std::vector<UnitStepTime> units;      // in forward order
  double outside_units = 0;             // the step's own compute (the loss and its gradient)
  double optimizer = 0;                 // the update and the gradient norm, over this rank's shards
  double synchronisation = 0;           // the small all-reduces
  int micro_batches = 1;                // forward and backward passes a step (the units' times are one's)
  double accumulation = 0;              // the later micro-batches' sums into the gradients, after the backward
  TimeBounds bounds;                    // the whole step's
  std::map<std::string, double> by_op;  // the forward's and backward's compute per op (the profiler's names)
  Schedule schedule;

  double step() const { return schedule.step; }
  double exposed() const { return schedule.exposed_communication; }
  std::string str() const;  // the table --explain prints
  nlohmann::json json() const;
};

// `dry_step`: the calls of one forward and backward of the run's micro-batch on this rank (plan.accumulation
// says how many a step runs and how they reduce), under StepCostLabel, with the units' hooks labelling theirs "forward <unit>" and "backward <unit>".
// Errors name a label of no unit in `plan`, a bitwise plan (its exact sums are not modelled), and
// what the rates lack.
StepTimePrediction predict_step_time(const Plan& plan, const std::vector<KernelCost>& dry_step,
                                     const DeviceRates& device, const CollectiveRates& link,
                                     const StepTimeOptions& options = {});

// "step time: measured 150.2 ms, predicted 152.3 ms (+1.4%); exposed communication: measured 7.5%,
// predicted 8.0% of the step (+0.5 points)" (the second part where a traced step measured it).
std::string step_time_report(const StepTimePrediction& predicted, double measured_step,
                             std::optional<double> measured_exposed_share);

}  // namespace shardlab::dist
