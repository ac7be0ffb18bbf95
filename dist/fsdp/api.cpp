// dist/fsdp/api.cpp: what users call: fully_shard and the wrapping helpers, the per-parameter
// shard views for the optimizer and their placements, gradient sync and clipping, the full
// parameters, and explicit unshard, reshard and prefetch lists.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/error.h"
#include "core/ops.h"
#include "dist/comm/init.h"
#include "dist/fsdp/unit.h"
#include "optim/optimizer.h"

namespace shardlab::dist {

using namespace detail;

std::string_view sharding_name(Sharding sharding) {
  switch (sharding) {
    case Sharding::full:
      return "full";
    case Sharding::grad_op:
      return "grad_op";
    case Sharding::none:
      return "none";
    case Sharding::hybrid:
      return "hybrid";
    case Sharding::optimizer:
      return "optimizer";
  }
  return "unknown";
}

std::pair<Sharding, int> parse_sharding(std::string_view text) {
  if (text == "full") return {Sharding::full, 0};
  if (text == "grad_op") return {Sharding::grad_op, 0};
  if (text == "none") return {Sharding::none, 0};
  if (text == "optimizer") return {Sharding::optimizer, 0};
  if (text.starts_with("hybrid:")) {
    const std::string digits(text.substr(7));
    char* end = nullptr;
    const long group = std::strtol(digits.c_str(), &end, 10);
    if (!digits.empty() && *end == '\0' && group > 0) return {Sharding::hybrid, static_cast<int>(group)};
  }
  fail("sharding '{}' is not one of full, grad_op, optimizer, none, hybrid:G (G > 0 ranks per shard group)",
       text);
}

// --- the API ------------------------------------------------------------------------------------

void fully_shard(nn::Module& module, const FsdpOptions& options) {
  SHARDLAB_CHECK(options.prefetch >= 0, "fully_shard: prefetch must be >= 0, got {}", options.prefetch);
  const MixedPrecision& precision = options.mixed_precision;
  SHARDLAB_CHECK(is_floating(precision.param_dtype) && is_floating(precision.reduce_dtype) &&
                     (!precision.output_dtype || is_floating(*precision.output_dtype)),
                 "fully_shard: mixed precision dtypes must be floating, got param_dtype {}, reduce_dtype {}, "
                 "output_dtype {}",
                 dtype_name(precision.param_dtype), dtype_name(precision.reduce_dtype),
                 precision.output_dtype ? dtype_name(*precision.output_dtype) : "none");
  SHARDLAB_CHECK(unit_of(module) == nullptr, "fully_shard: this {} is already an FSDP unit",
                 module.type_name());
  SHARDLAB_CHECK(
      module.has_forward(),
      "fully_shard: a {} has no forward of its own, so the hooks that gather its parameters would never "
      "run; shard the modules in it instead",
      module.type_name());
  const auto units = live_units();
  for (const auto& unit : units) {
    for (const auto& [path, inner] : unit->module().named_modules()) {
      SHARDLAB_CHECK(
          inner.get() != &module,
          "fully_shard: {} is inside {}, which is already sharded; call fully_shard on inner modules first "
          "and on the root last",
          describe_module(path, module), describe_module("", unit->module()));
    }
  }
  // Parameters of inner units stay theirs; a parameter held by an inner unit but also
  // reached outside that unit's subtree is a tie across units.
  // A module registered under several names is one unit reached by several paths.
  struct Claim {
    std::vector<std::string> unit_paths;
    std::string held_as;  // the parameter's first name
  };
  std::map<const void*, Claim> claimed;
  for (const auto& [path, inner] : module.named_modules()) {
    auto unit = unit_of(*inner);
    if (!unit) continue;
    // By what the modules register (the shard) and by what they compute with, which a module
    // outside the unit may also hold (a tie the inner fully_shard could not see).
    for (std::size_t i = 0; i < unit->slots().size(); ++i) {
      const Slot& slot = unit->slots()[i];
      for (const void* identity : {static_cast<const void*>(slot.variable.impl().get()),
                                   static_cast<const void*>(unit->sharded_parameters()[i].impl().get())}) {
        Claim& claim = claimed[identity];
        if (claim.unit_paths.empty()) claim.held_as = join_name(path, slot.names.front());
        claim.unit_paths.push_back(path);
      }
    }
  }
  std::vector<Slot> slots;
  std::map<const void*, std::size_t> slot_of;
  std::map<std::string, nn::Init> inits;
  for (auto& [name, init] : module.named_inits()) inits.emplace(name, init);
  for (const auto& [name, variable] : module.named_parameters()) {
    if (auto it = claimed.find(variable.impl().get()); it != claimed.end()) {
      const Claim& claim = it->second;
      const bool inside = std::any_of(
          claim.unit_paths.begin(), claim.unit_paths.end(),
          [&path = name](const std::string& unit_path) { return path.starts_with(unit_path + "."); });
      SHARDLAB_CHECK(
          inside,
          "fully_shard: parameter '{}' is the same tensor as '{}', which the unit '{}' holds; tied "
          "parameters must share a unit (shard a module that contains both instead)",
          name, claim.held_as, claim.unit_paths.front());
      continue;
    }
    SHARDLAB_CHECK(is_floating(variable.dtype()),
                   "fully_shard: parameter '{}' has dtype {}; FSDP shards floating parameters", name,
                   dtype_name(variable.dtype()));
    if (auto it = slot_of.find(variable.impl().get()); it != slot_of.end()) {
      slots[it->second].names.push_back(name);  // tied inside this unit: one slot
      continue;
    }
    if (!slots.empty()) {
      SHARDLAB_CHECK(variable.device() == slots.front().variable.device(),
                     "fully_shard: parameter '{}' is on {} but '{}' is on {}; a unit lives on one device",
                     name, variable.device().str(), slots.front().names.front(),
                     slots.front().variable.device().str());
    }
    slot_of[variable.impl().get()] = slots.size();
    slots.push_back(
        {.names = {name}, .variable = variable, .shape = variable.shape(), .init = inits.at(name)});
  }
  SHARDLAB_CHECK(
      !options.bitwise || slots.empty() || !slots.front().variable.device().is_cuda(),
      "fully_shard: bitwise gradients (FsdpOptions::bitwise) are summed on the CPU, but '{}' is on {}",
      slots.empty() ? "" : slots.front().names.front(),
      slots.empty() ? "" : slots.front().variable.device().str());
  Communicator& base = options.communicator ? *options.communicator : session().world();
  auto unit = std::make_shared<Unit>(module, std::move(slots), options,
                                     groups_for(base, options.sharding, options.hybrid_group_size));
  unit->install_hooks();
  register_unit(module, unit);
  // From now on the module's parameters are the shards, as FSDP2's are DTensors; what its layers
  // compute with is gathered for them, and an optimizer given it (built before sharding, or from a
  // layer's member) would update nothing: refused.
  for (std::size_t i = 0; i < unit->slots().size(); ++i) {
    const Slot& slot = unit->slots()[i];
    for (const std::string& name : slot.names) module.replace_parameter(name, unit->sharded_parameters()[i]);
    slot.variable.set_not_trainable(fmt::format(
        "it is what the layers compute with, gathered by FSDP; since dist::fully_shard the parameter '{}' of "
        "this {} is its shard: build the optimizer from named_parameters() after sharding",
        slot.names.front(), module.type_name()));
  }
}

int shard_by_size(nn::Module& root, std::int64_t min_parameters, const FsdpOptions& options) {
  auto modules = root.named_modules();
  std::set<const void*> taken;
  int units = 0;
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) {
    if (it->first.empty() || !it->second->has_forward()) continue;  // containers: their elements may be units
    std::int64_t own = 0;
    for (const auto& [name, variable] : it->second->named_parameters()) {
      if (!taken.contains(variable.impl().get())) own += variable.numel();
    }
    if (own < min_parameters) continue;
    fully_shard(*it->second, options);
    for (const auto& [name, variable] : it->second->named_parameters()) taken.insert(variable.impl().get());
    ++units;
  }
  fully_shard(root, options);
  return units + 1;
}

nn::Named<Variable> sharded_parameters(nn::Module& root) {
  // Names the shards by their paths from the root, and refuses a root that is no unit; what they
  // give is the shards after the optimizer's last step.
  ensure_root(root)->wait_for_host_updates();
  std::set<const void*> seen;
  nn::Named<Variable> shards;
  for (const auto& [name, parameter] : root.named_parameters()) {
    if (seen.insert(parameter.impl().get()).second) shards.emplace_back(name, parameter);  // tied: once
  }
  return shards;
}

void set_requires_gradient_sync(nn::Module& root, bool sync) { ensure_root(root)->sync = sync; }

void set_requires_all_reduce(nn::Module& root, bool all_reduce) {
  const std::shared_ptr<RootState> state = ensure_root(root);
  for (const Unit* unit : state->units) {
    SHARDLAB_CHECK(all_reduce || !unit->options().bitwise || unit->groups().replica == nullptr,
                   "dist::set_requires_all_reduce: unit {} reduces bitwise, in one exact reduction over its "
                   "shard group and its replicas together; accumulate micro-steps with "
                   "dist::set_requires_gradient_sync(root, false) instead",
                   display_name(unit->name()));
  }
  state->all_reduce = all_reduce;
}

Tensor local_gradient_sum_of_squares(nn::Module& root) {
  // Each unit's sum over its own pieces, counted by one replica only: the sum over all ranks
  // then holds every element once, whatever mix of sharded and replicated units the root has.
  // All of them in one sum: one launch on a GPU.
  const std::vector<Unit*>& units = ensure_root(root)->units;
  std::vector<Variable> counted;
  for (const Unit* unit : units) {
    if (!unit->groups().first_replica()) continue;
    const std::vector<Variable>& shards = unit->sharded_parameters();
    counted.insert(counted.end(), shards.begin(), shards.end());
  }
  const Device device = units.front()->device();
  const Tensor local = optim::gradient_sum_of_squares(counted, device);
  return local.device() == device ? local : local.to(device);  // shards offloaded to the host
}

namespace {

// Where a module sits: the module of the outermost unit whose subtree holds it (null when none
// does) and its dotted path from there, which is its name once that unit is the root.
struct Location {
  nn::Module* top = nullptr;
  std::string path;
};

Location locate(const nn::Module& module) {
  Location found;
  std::size_t found_size = 0;
  for (const auto& unit : live_units()) {
    const auto modules = unit->module().named_modules();
    if (modules.size() <= found_size) continue;
    for (const auto& [path, inner] : modules) {
      if (inner.get() == &module) {
        found = {&unit->module(), path};
        found_size = modules.size();
        break;
      }
    }
  }
  return found;
}

std::string describe_anywhere(const nn::Module& module) {
  const Location where = locate(module);
  return where.top ? describe_module(where.path, module) : fmt::format("this {}", module.type_name());
}

std::shared_ptr<Unit> unit_for(std::string_view call, const nn::Module& module) {
  auto unit = unit_of(module);
  SHARDLAB_CHECK(unit != nullptr,
                 "dist::{}: {} is not an FSDP unit; call it on a module dist::fully_shard made one", call,
                 describe_anywhere(module));
  return unit;
}

std::vector<std::weak_ptr<Unit>> prefetch_list(std::string_view call, const nn::Module& module,
                                               const std::vector<nn::Module*>& listed) {
  unit_for(call, module);
  const nn::Module* root = locate(module).top;
  std::vector<std::weak_ptr<Unit>> units;
  for (std::size_t i = 0; i < listed.size(); ++i) {
    SHARDLAB_CHECK(listed[i] != nullptr, "dist::{}: entry {} of the list is null", call, i);
    units.push_back(unit_for(call, *listed[i]));
    SHARDLAB_CHECK(locate(*listed[i]).top == root,
                   "dist::{}: {} is a unit under another root than {}; a unit prefetches units of its own "
                   "root only",
                   call, describe_anywhere(*listed[i]), describe_anywhere(module));
  }
  return units;
}

}  // namespace

void set_reshard_after_backward(nn::Module& module, bool reshard) {
  bool any = false;
  for (const auto& [path, inner] : module.named_modules()) {
    if (auto unit = unit_of(*inner)) {
      unit->set_reshard_after_backward(reshard);
      any = true;
    }
  }
  SHARDLAB_CHECK(any, "dist::set_reshard_after_backward: no FSDP unit in {}; call it after dist::fully_shard",
                 describe_anywhere(module));
}

void UnshardHandle::wait() {
  if (auto unit = unit_.lock()) unit->wait_unshard();
}

UnshardHandle unshard(nn::Module& module) {
  auto unit = unit_for("unshard", module);
  if (!unit->root_state()) ensure_root(*locate(module).top);  // names the units, as the first forward does
  unit->unshard(Unit::GatherFor::caller);
  return UnshardHandle(unit);
}

void reshard(nn::Module& module) {
  auto unit = unit_for("reshard", module);
  SHARDLAB_CHECK(!unit->in_backward(),
                 "dist::reshard: the backward of unit {} is running and reads its gathered parameters; "
                 "reshard it after the backward",
                 describe_anywhere(module));
  unit->reshard();
}

void set_gradient_divide_factor(nn::Module& module, double factor) {
  unit_for("set_gradient_divide_factor", module)->set_gradient_divide_factor(factor);
}

void set_force_sum_reduction_for_comms(nn::Module& module, bool force_sum) {
  unit_for("set_force_sum_reduction_for_comms", module)->set_force_sum_reduction(force_sum);
}

void set_all_reduce_hook(nn::Module& module, AllReduceHook hook) {
  unit_for("set_all_reduce_hook", module)->set_all_reduce_hook(std::move(hook));
}

void set_modules_to_forward_prefetch(nn::Module& unit, std::vector<nn::Module*> next) {
  unit_for("set_modules_to_forward_prefetch", unit)
      ->set_forward_prefetch(prefetch_list("set_modules_to_forward_prefetch", unit, next));
}

void set_modules_to_backward_prefetch(nn::Module& unit, std::vector<nn::Module*> previous) {
  unit_for("set_modules_to_backward_prefetch", unit)
      ->set_backward_prefetch(prefetch_list("set_modules_to_backward_prefetch", unit, previous));
}

nn::Named<ParameterShard> parameter_shards(nn::Module& root) {
  nn::Named<ParameterShard> shards;
  for (const auto& [name, shard] : sharded_parameters(root)) {
    const ShardInfo& info = *shard.shard_info();
    shards.emplace_back(name, ParameterShard{.full_shape = info.full_shape,
                                             .first = info.first,
                                             .count = info.count,
                                             .local = shard,
                                             .placement = info.placement,
                                             .first_replica = info.counts_once,
                                             .piece = info.piece});
  }
  return shards;
}

void place_in_mesh(nn::Module& root, Communicator& all, const nn::Named<ShardInfo::Piece>& pieces,
                   bool counts_copies) {
  const std::shared_ptr<RootState> state = ensure_root(root);
  const nn::Named<Variable> shards = sharded_parameters(root);
  std::map<std::string, const ShardInfo::Piece*> by_name;
  for (const auto& [name, piece] : pieces) {
    const std::string& wanted = name;
    SHARDLAB_CHECK(std::ranges::any_of(shards, [&](const auto& shard) { return shard.first == wanted; }),
                   "place_in_mesh: '{}' is no parameter of the {}", name, root.type_name());
    by_name[name] = &piece;
  }
  for (const auto& [name, shard] : shards) {
    ShardInfo info = *shard.shard_info();
    info.ranks = ranks_of(all, shard.data().device());
    if (const auto it = by_name.find(name); it != by_name.end()) {
      info.piece = *it->second;
    } else {
      info.counts_once = info.counts_once && counts_copies;
    }
    shard.set_shard_info(std::move(info));
  }
  state->mesh_ranks = &all;
}

Communicator& root_communicator(nn::Module& root) {
  const std::shared_ptr<RootState> state = ensure_root(root);
  return state->mesh_ranks != nullptr ? *state->mesh_ranks : *state->units.front()->groups().base;
}

Shape whole_shape(const ParameterShard& shard) { return shard.piece ? shard.piece->whole : shard.full_shape; }

std::vector<ElementRun> whole_runs(const ParameterShard& shard) {
  if (!shard.piece) return {{.first = shard.first, .count = shard.count, .at = 0}};
  // The piece's flat index (o * extent + e) * inner + n lies at (o * whole extent + offset + e) * inner + n
  // of the whole: contiguous within one o.
  const ShardInfo::Piece& piece = *shard.piece;
  const auto dim = static_cast<std::size_t>(piece.dim);
  std::int64_t inner = 1;
  for (std::size_t d = dim + 1; d < shard.full_shape.size(); ++d) inner *= shard.full_shape[d];
  const std::int64_t row = shard.full_shape[dim] * inner, whole_row = piece.whole[dim] * inner;
  std::vector<ElementRun> runs;
  for (std::int64_t i = shard.first; i < shard.first + shard.count;) {
    const std::int64_t o = i / row, within = i % row;
    const std::int64_t count = std::min(row - within, shard.first + shard.count - i);
    runs.push_back(
        {.first = o * whole_row + piece.offset * inner + within, .count = count, .at = i - shard.first});
    i += count;
  }
  return runs;
}

nn::Named<Tensor> gather_full_parameters(nn::Module& root) {
  std::map<std::string, Tensor> by_name;
  for (Unit* unit : ensure_root(root)->units) {
    const Tensor full = unit->full_shard_values();
    for (const Slot& slot : unit->slots()) {
      const Tensor value = full.narrow(0, slot.offset, slot.variable.numel()).view(slot.shape).clone();
      for (const std::string& name : slot.names) by_name[join_name(unit->name(), name)] = value;
    }
  }
  nn::Named<Tensor> ordered;
  for (const auto& [name, variable] : root.named_parameters()) ordered.emplace_back(name, by_name.at(name));
  return ordered;
}

namespace {
std::set<Communicator*> unit_communicators(nn::Module& root) {
  std::set<Communicator*> out;
  for (Unit* unit : ensure_root(root)->units) {
    for (Communicator* comm :
         {unit->groups().base, unit->groups().shard, unit->groups().replica, unit->post_forward_group()}) {
      if (comm != nullptr) out.insert(comm);
    }
  }
  return out;
}
}  // namespace

CollectiveCounters collective_counters(nn::Module& root) {
  CollectiveCounters sum;
  for (Communicator* comm : unit_communicators(root)) {
    const CollectiveCounters counters = comm->counters();
    for (std::size_t i = 0; i < sum.by_kind.size(); ++i) sum.by_kind[i] += counters.by_kind[i];
  }
  return sum;
}

void reset_collective_counters(nn::Module& root) {
  for (Communicator* comm : unit_communicators(root)) comm->reset_counters();
}

}  // namespace shardlab::dist
