// dist/fsdp/step_time.cpp: a step's predicted time from its dry run's costs, the plan and the measured
// rates (dist/fsdp/step_time.h).
#include "dist/fsdp/step_time.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/error.h"
#include "dist/fsdp/unit.h"

namespace shardlab::dist {
namespace {

// One call's roofline time by its bound: the larger of its math and its bytes, and the call's own cost
// (added, or where calls overlap the work, what the call takes beyond it).
TimeBounds call_bounds(const KernelCost& cost, const DeviceRates& device) {
  const double seconds = work_seconds(cost, device);
  const double memory = cost.bytes / device.bytes_per_second;
  const bool dense = cost.dense && seconds > memory;
  return {.dense = dense ? seconds : 0,
          .memory = dense ? 0 : seconds,
          .calls = with_calls(seconds, 1, device) - seconds};
}

void add(TimeBounds& to, const TimeBounds& more) {
  to.dense += more.dense, to.memory += more.memory, to.calls += more.calls;
  to.communication += more.communication;
}

void scale(TimeBounds& bounds, int times) {
  bounds.dense *= times, bounds.memory *= times, bounds.calls *= times;
}

bool descends_from(const std::string& unit, const std::string& ancestor) {
  return ancestor.empty() ? !unit.empty() : unit.starts_with(ancestor + ".");
}

std::int64_t depth(const std::string& unit) {
  return unit.empty() ? 0 : 1 + std::count(unit.begin(), unit.end(), '.');
}

// The dry step's calls as segments per pass (indices into plan.units), each unit's compute and bounds
// added up in `units` and the step's own in `outside`.
struct Passes {
  std::vector<ComputeSegment> forward, backward;
};

Passes split_by_label(const Plan& plan, const std::vector<KernelCost>& dry_step, const DeviceRates& device,
                      std::vector<UnitStepTime>& units, TimeBounds& outside_bounds, double& outside,
                      std::map<std::string, double>& by_op) {
  std::map<std::string, std::pair<int, bool>, std::less<>> by_label;  // label -> (unit, backward)
  for (std::size_t i = 0; i < plan.units.size(); ++i) {
    const std::string name = detail::display_name(plan.units[i].name);
    by_label["forward " + name] = {static_cast<int>(i), false};
    by_label["backward " + name] = {static_cast<int>(i), true};
  }
  Passes passes;
  bool in_backward = false;
  for (const KernelCost& cost : dry_step) {
    if (cost.label.empty()) continue;  // another thread's: the collectives'
    int unit = -1;
    if (cost.label != kStepCostLabel) {
      const auto found = by_label.find(cost.label);
      SHARDLAB_CHECK(
          found != by_label.end(),
          "predict_step_time: a call of the dry step ({}) is labelled '{}', which names no unit of "
          "the plan",
          cost.op, cost.label);
      unit = found->second.first;
      in_backward = in_backward || found->second.second;
    }
    const TimeBounds bounds = call_bounds(cost, device);
    const double seconds = bounds.total();
    by_op[cost.op] += seconds;
    std::vector<ComputeSegment>& pass = in_backward ? passes.backward : passes.forward;
    if (pass.empty() || pass.back().unit != unit) pass.push_back({unit, 0});
    pass.back().seconds += seconds;
    if (unit < 0) {
      outside += seconds;
      add(outside_bounds, bounds);
      continue;
    }
    UnitStepTime& times = units[static_cast<std::size_t>(unit)];
    (in_backward ? times.backward : times.forward) += seconds;
    add(times.bounds, bounds);
  }
  return passes;
}

// A unit without compute of its own in a pass still gathers there, before its first descendant's:
// a zero segment there (the end of the pass where none ran).
void place_units_without_compute(const Plan& plan, std::vector<ComputeSegment>& pass) {
  std::vector<std::size_t> missing;
  for (std::size_t i = 0; i < plan.units.size(); ++i) {
    if (std::none_of(pass.begin(), pass.end(),
                     [&](const ComputeSegment& s) { return s.unit == static_cast<int>(i); }))
      missing.push_back(i);
  }
  std::stable_sort(missing.begin(), missing.end(), [&](std::size_t a, std::size_t b) {
    return depth(plan.units[a].name) < depth(plan.units[b].name);
  });
  for (const std::size_t i : missing) {
    const auto first_descendant = std::find_if(pass.begin(), pass.end(), [&](const ComputeSegment& s) {
      return s.unit >= 0 &&
             descends_from(plan.units[static_cast<std::size_t>(s.unit)].name, plan.units[i].name);
    });
    pass.insert(first_descendant, {static_cast<int>(i), 0});
  }
}

// The units in the order the forward reaches them, and the segments renumbered to match.
std::vector<std::size_t> forward_order(std::vector<ComputeSegment>& forward,
                                       std::vector<ComputeSegment>& backward, std::size_t count) {
  std::vector<std::size_t> order;
  std::vector<int> renumbered(count, -1);
  for (const ComputeSegment& segment : forward) {
    if (segment.unit < 0 || renumbered[static_cast<std::size_t>(segment.unit)] >= 0) continue;
    renumbered[static_cast<std::size_t>(segment.unit)] = static_cast<int>(order.size());
    order.push_back(static_cast<std::size_t>(segment.unit));
  }
  for (auto* pass : {&forward, &backward}) {
    for (ComputeSegment& segment : *pass)
      if (segment.unit >= 0) segment.unit = renumbered[static_cast<std::size_t>(segment.unit)];
  }
  return order;
}

// CPU offload from a GPU: the f32 shard comes to the device before each gather and, where the unit
// trains, its f32 gradient shard goes to the host after the reduction, on the way of its collectives.
void add_offload_copies(const UnitPlan& unit, const DeviceRates& device, bool trains, UnitStepTime& times) {
  SHARDLAB_CHECK(
      device.host_to_device_bytes_per_second > 0 && device.device_to_host_bytes_per_second > 0,
      "predict_step_time: unit '{}' is offloaded to the host, and the rates of {} hold no copy rate "
      "between host and device",
      detail::display_name(unit.name), device.device);
  const double shard_bytes = 4.0 * static_cast<double>(unit.shard_elements);
  times.gather += shard_bytes / device.host_to_device_bytes_per_second;
  if (trains) times.reduce += shard_bytes / device.device_to_host_bytes_per_second;
}

// What the micro-batches after the first add into the gradients the earlier ones left, all of them: per
// unit that trains, each reduced shard added into its gradient shard (every, reduce-scatter: 4 bytes read
// twice and written an element), or without sync each new unsharded gradient added into the kept one (in
// param_dtype, read twice and written) or cast and added into the reduce_dtype sum. A call a parameter,
// and two a unit for a cast and its sum.
double accumulation_seconds(const Plan& plan, const DeviceRates& device) {
  const int later = plan.accumulation.micro_batches - 1;
  if (later == 0) return 0;
  double bytes = 0, calls = 0;
  for (const UnitPlan& unit : plan.units) {
    if (unit.frozen == unit.parameters) continue;
    if (plan.accumulation.sync != MicroBatchSync::last) {
      bytes += 12.0 * static_cast<double>(unit.shard_elements);
    } else if (unit.accumulated_bytes > 0 && unit.accumulated_bytes != unit.unsharded_bytes) {  // in reduce_dtype
      bytes += static_cast<double>(unit.unsharded_bytes + 4 * unit.accumulated_bytes);
      calls += 2;
    } else {
      bytes += 3.0 * static_cast<double>(unit.unsharded_bytes);
    }
  }
  calls += static_cast<double>(plan.gradient_flags);  // a call a parameter
  return later * with_calls(bytes / device.bytes_per_second, calls, device);
}

std::string link_text(const CollectiveRates& link) {
  if (link.ranks <= 1) return "one rank: no collectives";
  std::string text = fmt::format("{} ranks:", link.ranks);
  for (const auto& [op, fit] : link.fits) {
    text += fmt::format(" {} {:.0f} us + {:.2f} GB/s;", collective_name(op), 1e6 * fit.latency_seconds,
                        fit.seconds_per_byte > 0 ? 1e-9 / fit.seconds_per_byte : 0.0);
  }
  text.pop_back();
  return text + fmt::format("; beside each other collectives {:.1f}x slower, compute {:.2f}x",
                            link.communication_slowdown, link.compute_slowdown);
}

double milliseconds(double seconds) { return 1e3 * seconds; }

std::string device_text(const DeviceRates& rates) {
  double fastest = 0;
  for (const auto& [dtype, sizes] : rates.dense) {
    for (const DenseRate& size : sizes) fastest = std::max(fastest, size.per_second);
  }
  return fmt::format("{}: GEMMs up to {:.0f} GFLOP/s, memory {:.1f} GB/s, {:.2f} us a call{}", rates.device,
                     1e-9 * fastest, 1e-9 * rates.bytes_per_second, 1e6 * rates.seconds_per_call,
                     rates.calls_overlap ? " (queued ahead: hidden behind longer work)" : "");
}

}  // namespace

const char* TimeBounds::limited_by() const {
  const double largest = std::max({dense, memory, calls, communication});
  if (largest == communication && communication > 0) return "communication";
  if (largest == dense && dense > 0) return "compute";
  if (largest == calls && calls > memory) return "calls";
  return "memory";
}

StepTimePrediction predict_step_time(const Plan& plan, const std::vector<KernelCost>& dry_step,
                                     const DeviceRates& device, const CollectiveRates& link,
                                     const StepTimeOptions& options) {
  SHARDLAB_CHECK(!plan.bitwise,
                 "predict_step_time: bitwise training's exact sums are not modelled: its step time is not "
                 "predicted (measure it: bench/bitwise_cpu.sh)");
  StepTimePrediction out{.device = device_text(device), .link = link_text(link)};
  std::vector<UnitStepTime> by_plan(plan.units.size());
  TimeBounds outside_bounds;
  Passes passes =
      split_by_label(plan, dry_step, device, by_plan, outside_bounds, out.outside_units, out.by_op);
  place_units_without_compute(plan, passes.forward);
  place_units_without_compute(plan, passes.backward);
  const std::vector<std::size_t> order = forward_order(passes.forward, passes.backward, plan.units.size());

  std::vector<UnitTimes> timed;
  double optimizer_bytes = 0, optimizer_calls = 0, update = 0;
  for (const std::size_t i : order) {
    const UnitPlan& unit = plan.units[i];
    UnitStepTime times = by_plan[i];
    times.name = detail::display_name(unit.name);
    times.gather = collective_seconds(link, Collective::all_gather, static_cast<double>(unit.unsharded_bytes),
                                      unit.shard_group_size);
    times.reduce =
        collective_seconds(link, Collective::reduce_scatter,
                           static_cast<double>(unit.reduce_scatter_input_bytes), unit.shard_group_size);
    times.replica_reduce =
        collective_seconds(link, Collective::all_reduce, static_cast<double>(unit.replica_all_reduce_bytes),
                           unit.replica_group_size);
    const bool trains = unit.frozen < unit.parameters;
    if (unit.offloaded) add_offload_copies(unit, device, trains, times);
    timed.push_back({.name = times.name,
                     .forward = times.forward,
                     .backward = times.backward,
                     .gather = times.gather,
                     .reduce = times.reduce,
                     .replica_reduce = times.replica_reduce,
                     .reshards_after_forward = unit.backward_gathers > 0});
    out.units.push_back(std::move(times));
    if (!trains) continue;
    // The gradient norm reads the gradient; the update reads the shard, its gradient and the state and
    // writes the shard and the state, unless its measured time is given (the host's for an offloaded unit).
    const auto elements = static_cast<double>(unit.shard_elements);
    optimizer_bytes += elements * 4;
    const double per_element = unit.offloaded && options.host_update_seconds_per_element > 0
                                   ? options.host_update_seconds_per_element
                                   : options.update_seconds_per_element;
    if (per_element > 0) {
      update += elements * per_element;
    } else {
      optimizer_bytes +=
          elements * static_cast<double>(4 + 4 + 4 + 2 * plan.optimizer_state_bytes_per_element);
    }
    optimizer_calls += 2;
  }
  const double optimizer_work = optimizer_bytes / device.bytes_per_second + update;
  out.optimizer = with_calls(optimizer_work, optimizer_calls, device);
  out.accumulation = accumulation_seconds(plan, device);
  // Which parameters got a gradient: one all-reduce of a byte a parameter, where the plan has it.
  const double flags = plan.flag_bytes > 0
                           ? collective_seconds(link, Collective::all_reduce,
                                                static_cast<double>(plan.gradient_flags), plan.world_size)
                           : 0;
  out.synchronisation = flags + options.small_all_reduces *
                                    collective_seconds(link, Collective::all_reduce, 8, plan.world_size);
  out.schedule = simulate_step(timed, passes.forward, passes.backward,
                               {.prefetch = plan.prefetch,
                                .reductions_in_flight = static_cast<int>(detail::kReductionsInFlight),
                                .optimizer = out.optimizer + out.accumulation,
                                .synchronisation = out.synchronisation,
                                .compute_slowdown = link.compute_slowdown,
                                .communication_slowdown = link.communication_slowdown,
                                .micro_batches = plan.accumulation.micro_batches,
                                .reduce_every_micro_batch = plan.accumulation.sync != MicroBatchSync::last,
                                .all_reduce_every_micro_batch = plan.accumulation.sync == MicroBatchSync::every});
  out.micro_batches = plan.accumulation.micro_batches;
  // The dry step is one micro-batch: a step's compute is that many times its bounds.
  scale(outside_bounds, out.micro_batches);
  for (UnitStepTime& unit : out.units) scale(unit.bounds, out.micro_batches);

  // Each compute span's wait is its unit's (the units are in the schedule's order); the step's bounds add the
  // rest.
  for (const ScheduleSpan& span : out.schedule.spans) {
    if (span.lane != ScheduleSpan::Lane::compute) continue;
    (span.unit < 0 ? outside_bounds : out.units[static_cast<std::size_t>(span.unit)].bounds).communication +=
        span.waited;
  }
  out.bounds = outside_bounds;
  out.bounds.memory += optimizer_work + out.accumulation;  // the sums' calls counted as memory work too
  out.bounds.calls += out.optimizer - optimizer_work;
  for (const UnitStepTime& unit : out.units) add(out.bounds, unit.bounds);
  return out;
}

std::string StepTimePrediction::str() const {
  const double compute = step() - exposed();
  std::string text = fmt::format(
      "step time per rank, predicted: {:.1f} ms (compute {:.1f} ms, exposed communication {:.1f} ms = "
      "{:.1f}% "
      "of the step); limited by {}\n",
      milliseconds(step()), milliseconds(compute), milliseconds(exposed()),
      step() > 0 ? 100.0 * exposed() / step() : 0.0, bounds.limited_by());
  if (micro_batches > 1)
    text += fmt::format("  {} micro-batches a step; each unit's times below are one micro-batch's\n", micro_batches);
  for (const UnitStepTime& unit : units) {
    text += fmt::format(
        "  {}: forward {:.2f} ms, backward {:.2f} ms, all-gather {:.2f} ms, reduce {:.2f} ms, waited {:.2f} "
        "ms; "
        "limited by {}\n",
        unit.name, milliseconds(unit.forward), milliseconds(unit.backward), milliseconds(unit.gather),
        milliseconds(unit.reduce + unit.replica_reduce), milliseconds(unit.bounds.communication),
        unit.bounds.limited_by());
  }
  text += fmt::format(
      "  outside units (the loss and its gradient) {:.2f} ms; optimizer step and gradient norm "
      "{:.2f} ms; the step's small all-reduces {:.2f} ms{}\n",
      milliseconds(outside_units), milliseconds(optimizer), milliseconds(synchronisation),
      micro_batches > 1 ? fmt::format("; the later micro-batches' gradient sums {:.2f} ms", milliseconds(accumulation))
                        : "");
  text += fmt::format("  device {}\n  link {}\n", device, link);
  return text;
}

nlohmann::json StepTimePrediction::json() const {
  nlohmann::json unit_list = nlohmann::json::array();
  for (const UnitStepTime& unit : units) {
    unit_list.push_back({{"name", unit.name},
                         {"forward", unit.forward},
                         {"backward", unit.backward},
                         {"gather", unit.gather},
                         {"reduce", unit.reduce},
                         {"replica_reduce", unit.replica_reduce},
                         {"waited", unit.bounds.communication},
                         {"limited_by", unit.bounds.limited_by()}});
  }
  nlohmann::json spans = nlohmann::json::array();
  for (const ScheduleSpan& span : schedule.spans) {
    spans.push_back({{"lane", span.lane == ScheduleSpan::Lane::compute ? "compute" : "communication"},
                     {"what", span.what},
                     {"start", span.start},
                     {"end", span.end}});
  }
  return {{"step_seconds", step()},
          {"exposed_communication_seconds", exposed()},
          {"outside_units_seconds", outside_units},
          {"optimizer_seconds", optimizer},
          {"synchronisation_seconds", synchronisation},
          {"micro_batches", micro_batches},
          {"accumulation_seconds", accumulation},
          {"limited_by", bounds.limited_by()},
          {"device", device},
          {"link", link},
          {"units", unit_list},
          {"by_op", by_op},
          {"spans", spans}};
}

std::string step_time_report(const StepTimePrediction& predicted, double measured_step,
                             std::optional<double> measured_exposed_share) {
  std::string text = fmt::format("step time: measured {:.1f} ms, predicted {:.1f} ms ({:+.1f}%)",
                                 milliseconds(measured_step), milliseconds(predicted.step()),
                                 100.0 * (predicted.step() - measured_step) / measured_step);
  if (measured_exposed_share) {
    const double share = predicted.step() > 0 ? predicted.exposed() / predicted.step() : 0;
    text += fmt::format(
        "; exposed communication: measured {:.1f}%, predicted {:.1f}% of the step ({:+.1f} points)",
        100.0 * *measured_exposed_share, 100.0 * share, 100.0 * (share - *measured_exposed_share));
  }
  return text;
}

}  // namespace shardlab::dist
