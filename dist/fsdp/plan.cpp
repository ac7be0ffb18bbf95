// dist/fsdp/plan.cpp: the plan of a root's units (--explain): per unit its parameters,
// padding, shard, persistent and gathered bytes and collectives per step, from the units
// themselves and traffic_of.
#include <fmt/format.h>

#include <algorithm>

#include "dist/fsdp/unit.h"

namespace shardlab::dist {

using namespace detail;

namespace {

std::string sharding_label(const FsdpOptions& options) {
  std::string label(sharding_name(options.sharding));
  if (options.sharding == Sharding::hybrid) label += fmt::format(":{}", options.hybrid_group_size);
  return label;
}

UnitPlan plan_unit(const Unit& unit, std::int64_t optimizer_state_bytes_per_element) {
  const MixedPrecision& precision = unit.precision();
  const Groups& groups = unit.groups();
  const int shard_size = groups.shard_size(), shard_rank = groups.shard_rank();
  UnitPlan row{.name = unit.name(),
               .sharding = sharding_label(unit.options()),
               .shard_group_size = shard_size,
               .parameters = unit.parameters(),
               .padding = unit.padded() - unit.parameters(),
               .shard_elements = unit.shard_elements()};
  std::int64_t trained_here = 0;  // this rank's elements of trainable parameters
  for (const Slot& slot : unit.slots()) {
    if (slot.variable.requires_grad()) {
      trained_here += unit.piece(slot).count;
    } else {
      row.frozen += slot.variable.numel();
    }
  }
  const bool trains = row.frozen < row.parameters;
  row.optimizer_bytes = trained_here * optimizer_state_bytes_per_element;
  row.persistent_bytes = row.shard_elements * (trains ? 4 + 4 : 4) + row.optimizer_bytes;
  row.unsharded_bytes = unit.padded() * static_cast<std::int64_t>(dtype_size(precision.param_dtype));
  const bool bitwise = unit.options().bitwise;
  const bool cast = precision.reduce_dtype != precision.param_dtype && !bitwise;
  // The reduction reads a buffer of its own (not the gradient shard itself): more than one rank, or a cast.
  const bool separate_reduce_input = trains && (shard_size > 1 || cast) && !bitwise;
  const std::int64_t reduce_input =
      separate_reduce_input ? unit.padded() * static_cast<std::int64_t>(dtype_size(precision.reduce_dtype))
                            : 0;
  row.gathered_through_backward = !unit.reshards_after_forward();
  row.kept_after_backward = !unit.reshards_after_backward();
  if (unit.whole_between_steps()) {
    // ZeRO-1: the gathered parameters and the param_dtype gradient stay (a 1-rank group's
    // uncast gradient is the gradient shard itself); a cast's reduce input is the only buffer more.
    row.gathered_between_steps = true;
    row.persistent_bytes += row.unsharded_bytes + (separate_reduce_input ? row.unsharded_bytes : 0);
    if (trains && cast && shard_size > 1) row.reduce_buffer_bytes = reduce_input;
  } else {
    if (trains && shard_size > 1) row.reduce_buffer_bytes = reduce_input;  // Unit::start_reduction's input
    if (trains && cast) row.cast_buffer_bytes = row.unsharded_bytes;
  }
  // Bitwise: the BinnedSum (three i32 bins an element, a top a block) and, while it reduces, its
  // windows (i64) instead of a gradient in param_dtype.
  if (bitwise && trains)
    row.reduce_buffer_bytes = unit.padded() * (kBinsKept * 4 + 8) + binned_blocks(unit.padded());
  const DType reduced = bitwise ? DType::i64 : precision.reduce_dtype;
  // Bitwise: each group all-reduces the blocks' tops (u8, max) before the windows.
  const auto tops_bytes = [&](const Communicator& group) {
    return traffic_of(
               {.op = Collective::all_reduce, .dtype = DType::u8, .count = binned_blocks(unit.padded())},
               group.rank(), group.size())
        .bytes_received;
  };
  const Fingerprint gather{
      .op = Collective::all_gather, .dtype = precision.param_dtype, .count = unit.padded()};
  if (shard_size > 1) {
    row.forward_gathers = 1;
    row.forward_gather_bytes = traffic_of(gather, shard_rank, shard_size).bytes_received;
    if (unit.reshards_after_forward()) {  // gathered again for backward
      row.backward_gathers = 1;
      row.backward_gather_bytes = row.forward_gather_bytes;
      if (const Communicator* group = unit.post_forward_group()) {  // inside the group, from the slice kept
        row.post_forward_group = group->size();
        row.held_after_forward_bytes = row.unsharded_bytes / group->size();
        row.backward_gather_bytes = traffic_of(gather, group->rank(), group->size()).bytes_received;
      }
    }
    if (trains) {
      row.reduce_scatters = 1;
      row.reduce_scatter_input_bytes = unit.padded() * static_cast<std::int64_t>(dtype_size(reduced));
      row.reduce_bytes =
          traffic_of({.op = Collective::reduce_scatter, .dtype = reduced, .count = unit.padded()}, shard_rank,
                     shard_size)
              .bytes_received;
      if (bitwise) {
        row.all_reduces += 1;
        row.reduce_bytes += tops_bytes(*groups.shard);
      }
    }
  }
  if (groups.replica != nullptr && trains) {
    row.all_reduces += 1;
    row.replica_group_size = groups.replica->size();
    row.replica_all_reduce_bytes = row.shard_elements * static_cast<std::int64_t>(dtype_size(reduced));
    row.reduce_bytes +=
        traffic_of({.op = Collective::all_reduce, .dtype = reduced, .count = row.shard_elements},
                   groups.replica->rank(), groups.replica->size())
            .bytes_received;
    if (bitwise) {
      row.all_reduces += 1;
      row.reduce_bytes += tops_bytes(*groups.replica);
    }
  }
  return row;
}

}  // namespace

Plan explain(nn::Module& root, std::int64_t optimizer_state_bytes_per_element) {
  const auto state = ensure_root(root);
  const Unit& root_unit = *state->units.front();
  const Communicator& all = *root_unit.groups().base;
  Plan plan;
  plan.world_size = all.size();
  plan.shard_group_size = root_unit.groups().shard_size();
  plan.optimizer_state_bytes_per_element = optimizer_state_bytes_per_element;
  plan.sharding = sharding_label(root_unit.options());
  plan.bitwise = root_unit.options().bitwise;
  plan.prefetch = 0;
  for (const Unit* unit : state->units) {
    plan.units.push_back(plan_unit(*unit, optimizer_state_bytes_per_element));
    if (plan.units.back().sharding != plan.sharding) plan.sharding = "mixed";
    plan.prefetch = std::max(plan.prefetch, unit->options().prefetch);
    if (plan.units.back().frozen < plan.units.back().parameters)
      plan.gradient_flags += static_cast<std::int64_t>(unit->slots().size());
  }
  if (plan.world_size > 1 && plan.gradient_flags > 0) {
    plan.flag_bytes =
        traffic_of({.op = Collective::all_reduce, .dtype = DType::u8, .count = plan.gradient_flags},
                   all.rank(), all.size())
            .bytes_received;
  }
  if (root_unit.options().cpu_offload) {
    plan.note =
        root_unit.device().is_cpu()
            ? "cpu offload: nothing to do, parameters and optimizer state are already in host memory"
            : "cpu offload: shards, gradient shards and optimizer state in host memory; copied per gather";
  }
  if (std::any_of(state->units.begin(), state->units.end(),
                  [](const Unit* unit) { return unit->has_prefetch_lists(); })) {
    if (!plan.note.empty()) plan.note += "\n";
    plan.note +=
        "prefetch lists (set_modules_to_*_prefetch) replace the prefetch depth on some units: the peak of "
        "unsharded parameters assumes the depth, the lists may hold more units at once";
  }
  return plan;
}

std::int64_t Plan::total_persistent_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) total += unit.persistent_bytes;
  return total;
}

std::int64_t Plan::persistent_unsharded_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) total += unit.gathered_between_steps ? unit.unsharded_bytes : 0;
  return total;
}

std::int64_t Plan::optimizer_state_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) total += unit.optimizer_bytes;
  return total;
}

std::int64_t Plan::gradient_buffer_bytes() const {
  std::vector<std::int64_t> reduce_buffers;
  std::int64_t largest_cast = 0;
  for (const UnitPlan& unit : units) {
    reduce_buffers.push_back(unit.reduce_buffer_bytes);
    largest_cast = std::max(largest_cast, unit.cast_buffer_bytes);
  }
  // The reductions in flight and the gradient the backward computes: bounded by the largest of them.
  const std::size_t held = std::min(reduce_buffers.size(), kReductionsInFlight + 1);
  std::partial_sort(reduce_buffers.begin(), reduce_buffers.begin() + static_cast<std::ptrdiff_t>(held),
                    reduce_buffers.end(), std::greater<>());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < held; ++i) total += reduce_buffers[i];
  return total + largest_cast;
}

std::int64_t Plan::peak_unsharded_bytes() const {
  // Units gathered through backward add up; of the others, the running unit and `prefetch`
  // more are gathered at once.
  std::int64_t total = 0;
  std::vector<std::int64_t> sizes;
  for (const UnitPlan& unit : units) {
    if (unit.gathered_through_backward || unit.gathered_between_steps || unit.kept_after_backward) {
      total += unit.unsharded_bytes;
    } else {
      sizes.push_back(unit.unsharded_bytes);
    }
  }
  std::sort(sizes.rbegin(), sizes.rend());
  for (std::size_t i = 0; i < sizes.size() && i < static_cast<std::size_t>(1 + prefetch); ++i)
    total += sizes[i];
  for (const UnitPlan& unit : units) total += unit.held_after_forward_bytes;
  return total;
}

std::int64_t Plan::held_after_forward_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) {
    total += unit.gathered_through_backward || unit.gathered_between_steps ? unit.unsharded_bytes
                                                                           : unit.held_after_forward_bytes;
  }
  return total;
}

std::int64_t Plan::bytes_per_step() const {
  std::int64_t total = flag_bytes;
  for (const UnitPlan& unit : units)
    total += unit.forward_gather_bytes + unit.backward_gather_bytes + unit.reduce_bytes;
  return total;
}

std::string Plan::str() const {
  std::string text = fmt::format("FSDP plan: sharding {}, {} ranks, shard groups of {}, prefetch {}\n",
                                 sharding, world_size, shard_group_size, prefetch);
  text += fmt::format("{:<16} {:>10} {:>7} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10}\n", "unit",
                      "params", "pad", "shard/rank", "persist B", "unshard B", "fwd AG B", "bwd AG B",
                      "reduce B", "frozen", "sharding");
  for (const UnitPlan& unit : units) {
    text += fmt::format("{:<16} {:>10} {:>7} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10}\n",
                        unit.name.empty() ? "(root)" : unit.name, unit.parameters, unit.padding,
                        unit.shard_elements, unit.persistent_bytes, unit.unsharded_bytes,
                        unit.forward_gather_bytes, unit.backward_gather_bytes, unit.reduce_bytes, unit.frozen,
                        unit.sharding);
  }
  if (!note.empty()) text += note + "\n";
  if (std::any_of(units.begin(), units.end(),
                  [](const UnitPlan& unit) { return unit.post_forward_group > 0; })) {
    text += fmt::format(
        "parameters held from forward to backward: {} B per rank (units resharded to post-forward groups "
        "keep their slice, gathered inside the group for backward)\n",
        held_after_forward_bytes());
  }
  if (flag_bytes > 0) {
    text += fmt::format(
        "gradient flags: one all-reduce of {} B per step (which of {} parameters had a gradient)\n",
        flag_bytes, gradient_flags);
  }
  text += fmt::format(
      "persistent model state per rank: {} B; peak unsharded parameters: {} B; received per step: {} B\n",
      total_persistent_bytes(), peak_unsharded_bytes(), bytes_per_step());
  text += fmt::format(
      "gradient accumulation (set_requires_gradient_sync(false)) keeps every unit's unsharded gradient "
      "between micro-steps: +{} B per rank; reducing into the shard every micro-step would add nothing but "
      "one reduce-scatter per unit per micro-step\n",
      accumulation_bytes());
  return text;
}

std::int64_t Plan::accumulation_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) {
    if (unit.frozen < unit.parameters && !unit.gathered_between_steps)
      total += unit.unsharded_bytes;  // the gradient has the parameters' dtype; ZeRO-1 keeps it anyway
  }
  return total;
}

}  // namespace shardlab::dist
