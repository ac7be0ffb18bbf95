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

// A unit's group sizes and this rank's place in them: its live groups', or those of a world of another size.
struct GroupLayout {
  int shard_size = 1, shard_rank = 0;
  int replica_size = 1, replica_rank = 0;            // 1: no replica group
  int post_forward_size = 0, post_forward_rank = 0;  // 0: no post-forward group
};

GroupLayout live_layout(const Unit& unit) {
  const Groups& groups = unit.groups();
  GroupLayout layout{.shard_size = groups.shard_size(), .shard_rank = groups.shard_rank()};
  if (groups.replica != nullptr)
    layout.replica_size = groups.replica->size(), layout.replica_rank = groups.replica->rank();
  if (const Communicator* group = unit.post_forward_group())
    layout.post_forward_size = group->size(), layout.post_forward_rank = group->rank();
  return layout;
}

// What a unit is planned as: its options (a what-if's strategy in place of its own) and whether it
// gathers again for backward.
struct Planned {
  FsdpOptions options;
  bool reshards_after_forward = false;
};

Planned planned_as(const Unit& unit, const PlanAt* at) {
  Planned planned{.options = unit.options(), .reshards_after_forward = unit.reshards_after_forward()};
  if (at == nullptr || !at->sharding) return planned;
  planned.options.sharding = *at->sharding;
  planned.options.hybrid_group_size = at->hybrid_group_size;
  planned.options.reshard_after_forward_group = at->reshard_after_forward_group;
  planned.reshards_after_forward = !unit.is_root() && reshards_after_forward(planned.options);
  return planned;
}

// Rank 0's groups were the units' communicator `world_size` ranks: the sizes groups_for and Unit's
// constructor would give them, with their refusals.
GroupLayout layout_at(const Planned& unit, int world_size) {
  const FsdpOptions& options = unit.options;
  SHARDLAB_CHECK(options.sharding != Sharding::hybrid ||
                     (options.hybrid_group_size > 0 && world_size % options.hybrid_group_size == 0),
                 "explain: hybrid shard groups of {} ranks do not divide a world of {} ranks",
                 options.hybrid_group_size, world_size);
  const GroupSizes sizes = group_sizes(options.sharding, options.hybrid_group_size, world_size);
  GroupLayout layout{.shard_size = sizes.shard, .replica_size = sizes.replica};
  if (const int group = options.reshard_after_forward_group; group != 0 && unit.reshards_after_forward) {
    SHARDLAB_CHECK(
        group > 1 && group < layout.shard_size && layout.shard_size % group == 0,
        "explain: reshard_after_forward_group {} must divide the shard group of {} ranks at a world "
        "of {} and be neither 1 nor all of it",
        group, layout.shard_size, world_size);
    layout.post_forward_size = group;
  }
  return layout;
}

UnitPlan plan_unit(const Unit& unit, const Planned& planned, const GroupLayout& layout,
                   std::int64_t optimizer_state_bytes_per_element) {
  const FsdpOptions& options = planned.options;
  const MixedPrecision& precision = options.mixed_precision;
  const int shard_size = layout.shard_size, shard_rank = layout.shard_rank;
  const std::int64_t padded = padded_length(unit.parameters(), shard_size);
  UnitPlan row{.name = unit.name(),
               .sharding = sharding_label(options),
               .shard_group_size = shard_size,
               .parameters = unit.parameters(),
               .padding = padded - unit.parameters(),
               .shard_elements = padded / shard_size,
               .offloaded = unit.offloads()};
  std::int64_t trained_here = 0;  // this rank's elements of trainable parameters
  for (const Slot& slot : unit.slots()) {
    if (slot.variable.requires_grad()) {
      trained_here += piece_of(slot, shard_rank, row.shard_elements).count;
    } else {
      row.frozen += slot.variable.numel();
    }
  }
  const bool trains = row.frozen < row.parameters;
  row.optimizer_bytes = trained_here * optimizer_state_bytes_per_element;
  row.persistent_bytes = row.shard_elements * (trains ? 4 + 4 : 4) + row.optimizer_bytes;
  row.unsharded_bytes = padded * static_cast<std::int64_t>(dtype_size(precision.param_dtype));
  const bool bitwise = options.bitwise;
  const bool cast = precision.reduce_dtype != precision.param_dtype && !bitwise;
  // The reduction reads a buffer of its own (not the gradient shard itself): more than one rank, or a cast.
  const bool separate_reduce_input = trains && (shard_size > 1 || cast) && !bitwise;
  const std::int64_t reduce_input =
      separate_reduce_input ? padded * static_cast<std::int64_t>(dtype_size(precision.reduce_dtype)) : 0;
  row.gathered_through_backward = !planned.reshards_after_forward;
  row.kept_after_backward = !unit.reshards_after_backward();
  if (options.sharding == Sharding::optimizer) {
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
  if (bitwise && trains) row.reduce_buffer_bytes = padded * (kBinsKept * 4 + 8) + binned_blocks(padded);
  // Backwards without sync keep, until the reduction: the sum in reduce_dtype where it is wider (FSDP2's
  // upcast), else the param_dtype gradient itself (ZeRO-1's is persistent already); bitwise, the BinnedSum.
  if (trains) {
    if (bitwise) {
      row.accumulated_bytes = padded * kBinsKept * 4 + binned_blocks(padded);
    } else if (cast) {
      row.accumulated_bytes = padded * static_cast<std::int64_t>(dtype_size(precision.reduce_dtype));
    } else if (options.sharding != Sharding::optimizer) {
      row.accumulated_bytes = row.unsharded_bytes;
    }
  }
  const DType reduced = bitwise ? DType::i64 : precision.reduce_dtype;
  // Bitwise: each group all-reduces the blocks' tops (u8, max) before the windows.
  const auto tops_bytes = [&](int rank, int size) {
    return traffic_of({.op = Collective::all_reduce, .dtype = DType::u8, .count = binned_blocks(padded)},
                      rank, size)
        .bytes_received;
  };
  const Fingerprint gather{.op = Collective::all_gather, .dtype = precision.param_dtype, .count = padded};
  if (shard_size > 1) {
    row.forward_gathers = 1;
    row.forward_gather_bytes = traffic_of(gather, shard_rank, shard_size).bytes_received;
    if (planned.reshards_after_forward) {  // gathered again for backward
      row.backward_gathers = 1;
      row.backward_gather_bytes = row.forward_gather_bytes;
      if (layout.post_forward_size > 0) {  // inside the group, from the slice kept
        row.post_forward_group = layout.post_forward_size;
        row.held_after_forward_bytes = row.unsharded_bytes / layout.post_forward_size;
        row.backward_gather_bytes =
            traffic_of(gather, layout.post_forward_rank, layout.post_forward_size).bytes_received;
      }
    }
    if (trains) {
      row.reduce_scatters = 1;
      row.reduce_scatter_input_bytes = padded * static_cast<std::int64_t>(dtype_size(reduced));
      row.reduce_bytes = traffic_of({.op = Collective::reduce_scatter, .dtype = reduced, .count = padded},
                                    shard_rank, shard_size)
                             .bytes_received;
      if (bitwise) {
        row.all_reduces += 1;
        row.reduce_bytes += tops_bytes(shard_rank, shard_size);
      }
    }
  }
  if (layout.replica_size > 1 && trains) {
    row.all_reduces += 1;
    row.replica_group_size = layout.replica_size;
    row.replica_all_reduce_bytes = row.shard_elements * static_cast<std::int64_t>(dtype_size(reduced));
    row.replica_reduce_bytes =
        traffic_of({.op = Collective::all_reduce, .dtype = reduced, .count = row.shard_elements},
                   layout.replica_rank, layout.replica_size)
            .bytes_received;
    row.reduce_bytes += row.replica_reduce_bytes;
    if (bitwise) {
      row.all_reduces += 1;
      row.reduce_bytes += tops_bytes(layout.replica_rank, layout.replica_size);
    }
  }
  return row;
}

Plan plan_of(nn::Module& root, std::int64_t optimizer_state_bytes_per_element, const PlanAt* at) {
  const auto state = ensure_root(root);
  const Unit& root_unit = *state->units.front();
  const Communicator& all = *root_unit.groups().base;
  const auto layout = [&](const Unit& unit, const Planned& planned) {
    return at == nullptr ? live_layout(unit) : layout_at(planned, at->world_size);
  };
  const Planned root_planned = planned_as(root_unit, at);
  Plan plan;
  plan.world_size = at == nullptr ? all.size() : at->world_size;
  plan.shard_group_size = layout(root_unit, root_planned).shard_size;
  plan.optimizer_state_bytes_per_element = optimizer_state_bytes_per_element;
  plan.sharding = sharding_label(root_planned.options);
  plan.bitwise = root_unit.options().bitwise;
  plan.prefetch = 0;
  for (const Unit* unit : state->units) {
    const Planned planned = planned_as(*unit, at);
    plan.units.push_back(
        plan_unit(*unit, planned, layout(*unit, planned), optimizer_state_bytes_per_element));
    if (plan.units.back().sharding != plan.sharding) plan.sharding = "mixed";
    plan.prefetch = std::max(plan.prefetch, unit->options().prefetch);
    if (plan.units.back().frozen < plan.units.back().parameters)
      plan.gradient_flags += static_cast<std::int64_t>(unit->slots().size());
  }
  if (plan.world_size > 1 && plan.gradient_flags > 0) {
    plan.flag_bytes =
        traffic_of({.op = Collective::all_reduce, .dtype = DType::u8, .count = plan.gradient_flags},
                   at == nullptr ? all.rank() : 0, plan.world_size)
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

}  // namespace

Plan explain(nn::Module& root, std::int64_t optimizer_state_bytes_per_element) {
  return plan_of(root, optimizer_state_bytes_per_element, nullptr);
}

Plan explain(nn::Module& root, std::int64_t optimizer_state_bytes_per_element, const PlanAt& at) {
  SHARDLAB_CHECK(at.world_size >= 1, "explain: a world of {} ranks", at.world_size);
  return plan_of(root, optimizer_state_bytes_per_element, &at);
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
  const std::int64_t passes = accumulation.micro_batches;
  // Micro-batches whose backward reduces: each agrees on the gradient flags. Without sync only the last.
  const std::int64_t reducing = accumulation.sync == MicroBatchSync::last ? 1 : passes;
  std::int64_t total = reducing * flag_bytes;
  for (const UnitPlan& unit : units) {
    total += passes * (unit.forward_gather_bytes + unit.backward_gather_bytes) +
             reducing * (unit.reduce_bytes - unit.replica_reduce_bytes);
    total += (accumulation.sync == MicroBatchSync::every ? passes : 1) * unit.replica_reduce_bytes;
  }
  return total;
}

std::string_view micro_batch_sync_name(MicroBatchSync sync) {
  switch (sync) {
    case MicroBatchSync::every:
      return "every";
    case MicroBatchSync::reduce_scatter:
      return "reduce-scatter";
    case MicroBatchSync::last:
      return "last";
  }
  return "unknown";
}

MicroBatchSync parse_micro_batch_sync(std::string_view text) {
  for (const MicroBatchSync sync : {MicroBatchSync::every, MicroBatchSync::reduce_scatter, MicroBatchSync::last})
    if (text == micro_batch_sync_name(sync)) return sync;
  fail("micro-batch sync '{}' is not one of every, reduce-scatter, last", text);
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
  text += accumulation_text();
  return text;
}

std::string Plan::accumulation_text() const {
  const int passes = accumulation.micro_batches;
  if (passes == 1) {
    return fmt::format(
        "gradient accumulation (set_requires_gradient_sync(false)) keeps every unit's unsharded gradient "
        "between micro-steps: +{} B per rank; reducing into the shard every micro-step would add nothing but "
        "one reduce-scatter per unit per micro-step\n",
        accumulation_bytes());
  }
  std::string what;
  switch (accumulation.sync) {
    case MicroBatchSync::every:
      what = fmt::format("each reduces into the gradient shards (no more memory, {} reductions per unit)", passes);
      break;
    case MicroBatchSync::reduce_scatter:
      what = fmt::format(
          "each reduce-scatters, the all-reduce over the replicas waits for the last "
          "(set_requires_all_reduce(false)): +{} B per rank of partial sums",
          partial_sum_bytes());
      break;
    case MicroBatchSync::last:
      what = bitwise ? fmt::format(
                           "only the last reduces, the others add into every unit's exact sum "
                           "(set_requires_gradient_sync(false)): {} B per rank",
                           accumulated_gradient_bytes())
                     : fmt::format(
                           "only the last reduces, the others keep every unit's unsharded gradient "
                           "(set_requires_gradient_sync(false)): +{} B per rank",
                           accumulation_bytes());
      break;
  }
  return fmt::format("gradient accumulation: {} micro-batches a step, a forward and backward each; {}\n", passes,
                     what);
}

std::int64_t Plan::partial_sum_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) {
    if (unit.frozen < unit.parameters && unit.replica_reduce_bytes > 0) total += 4 * unit.shard_elements;
  }
  return total;
}

std::int64_t Plan::accumulated_gradient_bytes() const {
  if (accumulation.micro_batches == 1) return gradient_buffer_bytes();
  switch (accumulation.sync) {
    case MicroBatchSync::every:
      return gradient_buffer_bytes();
    case MicroBatchSync::reduce_scatter:
      return gradient_buffer_bytes() + partial_sum_bytes();
    case MicroBatchSync::last: {
      // Every unit's sum until the last backward reduces it, and beside them the gradient that backward
      // computes: bitwise, the largest unit's windows; with a cast, the largest param_dtype buffer
      // (without one, the buffers the backward writes into are the sums themselves).
      std::int64_t beside = 0;
      for (const UnitPlan& unit : units) {
        beside = std::max(beside, bitwise ? unit.reduce_buffer_bytes - unit.accumulated_bytes
                                          : unit.cast_buffer_bytes);
      }
      return accumulation_bytes() + beside;
    }
  }
  return gradient_buffer_bytes();
}

std::int64_t Plan::accumulation_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) total += unit.accumulated_bytes;
  return total;
}

}  // namespace shardlab::dist
