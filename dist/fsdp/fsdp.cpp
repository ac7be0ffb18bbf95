// dist/fsdp/fsdp.cpp: FSDP units: flattening and sharding, the hooks that gather before forward
// and backward, reduce gradients and reshard, prefetching, and the per-root bookkeeping. The
// calls users make are in dist/fsdp/api.cpp, the plan in dist/fsdp/plan.cpp.
//
// Saved activations: autograd saves the weight views it needs during forward, and resharding
// frees the gathered bytes. A unit's gathered buffer is one Storage object for the unit's
// whole life: resharding calls reallocate(0) on it and gathering reallocates and fills it
// again, so the saved views (which point at the Storage, not at the bytes) are valid again by
// the time the unit's backward runs: the pre-backward hook gathers first (FSDP1's trick).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "autograd/record.h"
#include "core/error.h"
#include "core/host_wait.h"
#include "core/op_cost.h"
#include "core/ops.h"
#include "core/storage.h"
#include "dist/comm/init.h"
#include "dist/fsdp/copy_stream.h"
#include "dist/fsdp/offload.h"
#include "dist/fsdp/unit.h"

namespace shardlab::dist {

namespace detail {

std::shared_ptr<Groups> groups_for(Communicator& base, Sharding sharding, int group_size) {
  static std::mutex mutex;
  static std::map<std::tuple<Communicator*, Sharding, int>, std::weak_ptr<Groups>> cache;
  std::lock_guard lock(mutex);
  auto& slot = cache[{&base, sharding, group_size}];
  if (auto existing = slot.lock()) return existing;
  auto groups = std::make_shared<Groups>();
  groups->base = &base;
  const int rank = base.rank(), world = base.size();
  SHARDLAB_CHECK(
      sharding != Sharding::hybrid || (group_size > 0 && world % group_size == 0),
      "fully_shard: hybrid shard groups of {} ranks do not divide the {} ranks of communicator '{}'",
      group_size, world, base.name());
  const GroupSizes sizes = group_sizes(sharding, group_size, world);
  if (sharding != Sharding::hybrid) {  // a group of all ranks is the base itself
    groups->shard = sizes.shard > 1 ? &base : nullptr;
    groups->replica = sizes.replica > 1 ? &base : nullptr;
  } else {
    if (sizes.shard > 1) {
      groups->owned_shard =
          base.split(rank / group_size, rank, fmt::format("{}/shard{}", base.name(), rank / group_size));
      groups->shard = groups->owned_shard.get();
    }
    if (sizes.replica > 1) {
      groups->owned_replica =
          base.split(rank % group_size, rank, fmt::format("{}/replica{}", base.name(), rank % group_size));
      groups->replica = groups->owned_replica.get();
    }
  }
  slot = groups;
  return groups;
}

GroupSizes group_sizes(Sharding sharding, int group_size, int world) {
  switch (sharding) {
    case Sharding::none:
      return {.shard = 1, .replica = world};
    case Sharding::hybrid:
      return {.shard = group_size, .replica = world / group_size};
    case Sharding::full:
    case Sharding::grad_op:
    case Sharding::optimizer:
      break;
  }
  return {.shard = world, .replica = 1};
}

bool reshards_after_forward(const FsdpOptions& options) {
  return options.reshard_after_forward.value_or(options.sharding == Sharding::full ||
                                                options.sharding == Sharding::hybrid);
}

Communicator& Groups::post_forward_group(int size) {
  auto& group = post_forward[size];
  if (!group) {
    const int rank = shard_rank();
    group = shard->split(rank / size, rank, fmt::format("{}/post-forward{}", shard->name(), rank / size));
  }
  return *group;
}

namespace {

class CommunicatorSum final : public ShardRanks {
 public:
  CommunicatorSum(Communicator& base, Device device) : base_(&base), device_(device) {}

  Tensor sum(const Tensor& value) const override {
    if (base_->size() == 1) return value;
    // On the units' device (an NCCL communicator takes device tensors only); a copy, as the
    // all-reduce writes in place.
    const Tensor total = value.device() == device_ ? value.clone() : value.to(device_);
    base_->all_reduce(total, ReduceOp::sum, "clip_grad_norm_").wait();
    return total;
  }

 private:
  Communicator* base_;
  Device device_;
};

}  // namespace

std::shared_ptr<const ShardRanks> ranks_of(Communicator& base, Device device) {
  static std::mutex mutex;
  static std::map<std::tuple<Communicator*, DeviceType, int>, std::weak_ptr<const ShardRanks>> cache;
  std::lock_guard lock(mutex);
  auto& slot = cache[{&base, device.type, device.index}];
  if (auto existing = slot.lock()) return existing;
  auto ranks = std::make_shared<const CommunicatorSum>(base, device);
  slot = ranks;
  return ranks;
}

std::string display_name(const std::string& unit) { return unit.empty() ? "(root)" : unit; }

// --- gathered bytes ----------------------------------------------------------------------------

namespace {

std::mutex unsharded_mutex;
UnshardedMemory unsharded;

void count_unsharded(std::int64_t delta) {
  std::lock_guard lock(unsharded_mutex);
  unsharded.bytes += delta;
  unsharded.peak_bytes = std::max(unsharded.peak_bytes, unsharded.bytes);
  // Guarded: the argument list is built (allocated) before counter() could look at the flag.
  if (trace::on()) trace::counter("gathered parameters", {{"bytes", unsharded.bytes}});
}

// A unit's span that began at `began` (if the trace recorded then) and ends now.
void trace_unit_span(std::optional<trace::Clock::time_point>& began, const char* phase,
                     const std::string& unit) {
  if (began && trace::on()) {
    trace::complete(fmt::format("{} {}", phase, display_name(unit)), "compute", trace::this_thread_track(),
                    *began, trace::Clock::now(), {{"unit", unit}});
    trace::memory_counter();
  }
  began.reset();
}

// A copy or cast kernel of the unit's (`what`: "cast parameters to bf16") as a "copy" span on the
// trace: the bytes FSDP moves on the compute thread besides the collectives.
template <typename Kernel>
decltype(auto) copy_kernel(const char* what, const std::string& unit, Kernel&& kernel) {
  trace::Span span(trace::on() ? fmt::format("{} {}", what, display_name(unit)) : std::string(), "copy");
  return kernel();
}

std::string cast_name(const char* what, DType to) {
  return fmt::format("cast {} to {}", what, dtype_name(to));
}

}  // namespace

// --- the registry of units -------------------------------------------------------------------

namespace {
std::mutex registry_mutex;
std::vector<std::pair<const nn::Module*, std::weak_ptr<Unit>>> registry;
}  // namespace

void register_unit(const nn::Module& module, const std::shared_ptr<Unit>& unit) {
  std::lock_guard lock(registry_mutex);
  registry.emplace_back(&module, unit);
}

std::shared_ptr<Unit> unit_of(const nn::Module& module) {
  std::lock_guard lock(registry_mutex);
  for (const auto& [owner, unit] : registry) {
    if (owner == &module) {
      if (auto live = unit.lock()) return live;
    }
  }
  return nullptr;
}

std::vector<std::shared_ptr<Unit>> live_units() {
  std::lock_guard lock(registry_mutex);
  std::erase_if(registry, [](const auto& entry) { return entry.second.expired(); });
  std::vector<std::shared_ptr<Unit>> units;
  for (const auto& [owner, unit] : registry) units.push_back(unit.lock());
  return units;
}

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : name.empty() ? prefix : prefix + "." + name;
}

std::string describe_module(const std::string& path, const nn::Module& module) {
  return path.empty() ? fmt::format("the root {}", module.type_name())
                      : fmt::format("'{}' ({})", path, module.type_name());
}

// Makes `root` the root of the units in its subtree (once): names them by their path.
std::shared_ptr<RootState> ensure_root(nn::Module& root) {
  auto root_unit = unit_of(root);
  SHARDLAB_CHECK(root_unit != nullptr, "FSDP: the root {} is not sharded; call dist::fully_shard on it last",
                 root.type_name());
  if (root_unit->root_state()) {
    SHARDLAB_CHECK(root_unit->root_state()->root == &root,
                   "FSDP: {} is a unit under another root, not a root of its own", root.type_name());
    return root_unit->root_state();
  }
  // Checked before any unit joins, so that a refusal leaves every unit as it was.
  std::vector<std::pair<std::string, std::shared_ptr<Unit>>> members;
  for (const auto& [path, module] : root.named_modules()) {
    auto unit = unit_of(*module);
    if (!unit || std::any_of(members.begin(), members.end(), [&](const auto& m) { return m.second == unit; }))
      continue;  // none, or one module under two names
    SHARDLAB_CHECK(!unit->root_state(),
                   "FSDP: unit {} already ran as a root of its own; call the root's forward first",
                   describe_module(path, *module));
    SHARDLAB_CHECK(
        unit->groups().base == root_unit->groups().base,
        "FSDP: unit {} runs on communicator '{}' but the root {} on '{}'; the units under one root "
        "share one communicator",
        describe_module(path, *module), unit->groups().base->name(), root.type_name(),
        root_unit->groups().base->name());
    members.emplace_back(path, unit);
  }
  auto state = std::make_shared<RootState>();
  state->root = &root;
  for (auto& [path, unit] : members) {
    unit->join_root(state, path);
    state->units.push_back(unit.get());
  }
  return state;
}

// --- Unit ---------------------------------------------------------------------------------------

Unit::Unit(nn::Module& module, std::vector<Slot> slots, const FsdpOptions& options,
           std::shared_ptr<Groups> groups)
    : module_(&module),
      options_(options),
      slots_(std::move(slots)),
      groups_(std::move(groups)),
      reshard_after_forward_(detail::reshards_after_forward(options)) {
  if (const int group = options.reshard_after_forward_group; group != 0) {
    const int shard_size = groups_->shard_size();
    SHARDLAB_CHECK(
        options.sharding == Sharding::full || options.sharding == Sharding::hybrid,
        "fully_shard: reshard_after_forward_group {} needs a unit that reshards after forward (full or "
        "hybrid), not {}",
        group, sharding_name(options.sharding));
    SHARDLAB_CHECK(
        reshard_after_forward_,
        "fully_shard: reshard_after_forward_group {} with reshard_after_forward false: the parameters "
        "are not resharded after forward at all",
        group);
    SHARDLAB_CHECK(
        group > 1 && group < shard_size && shard_size % group == 0,
        "fully_shard: reshard_after_forward_group {} must divide the shard group of {} ranks and be "
        "neither 1 nor all of it",
        group, shard_size);
    post_forward_group_ = &groups_->post_forward_group(group);
  }
  device_ = slots_.empty() ? Device::cpu() : slots_.front().variable.device();
  shard_device_ = options.cpu_offload ? Device::cpu() : device_;
  for (Slot& slot : slots_) {
    slot.offset = parameters_;
    parameters_ += slot.variable.numel();
  }
  padded_ = padded_length(parameters_, groups_->shard_size());
  shard_elements_ = padded_ / groups_->shard_size();
  for (const Slot& slot : slots_) {
    SHARDLAB_CHECK(
        nn::deferred(slot.variable.data()) == nn::deferred(slots_.front().variable.data()),
        "fully_shard: parameter '{}' has {} bytes but '{}' has {}; a unit's parameters are all made under "
        "nn::DeferredInitGuard or none",
        slot.names.front(), nn::deferred(slot.variable.data()) ? "no" : "its", slots_.front().names.front(),
        nn::deferred(slots_.front().variable.data()) ? "none" : "its");
  }
  deferred_ = !slots_.empty() && nn::deferred(slots_.front().variable.data());
  // This rank's shard: the elements [rank * S, (rank + 1) * S) of the flattened parameters,
  // copied now, or drawn by join_root once the parameters' names from the root are known.
  // Offloaded from a GPU, in pinned memory: its copies to the device run while the host goes on.
  shard_ = zeros({shard_elements_}, dtype(DType::f32).with_device(shard_device_).with_pinned(offloads()));
  for (const Slot& slot : slots_) {
    const Piece part = piece(slot);
    const Tensor target = shard_.narrow(0, part.at, part.count);
    if (!deferred_ && part.count > 0) {
      const Tensor flat = slot.variable.data().contiguous().view({slot.variable.numel()});
      target.copy_(cast(flat.narrow(0, part.from, part.count), DType::f32));
    }
    sharded_parameters_.emplace_back(target, slot.variable.requires_grad(), slot.names.front());
    sharded_parameters_.back().set_shard_info(shard_info(slot));
    computes_with_grad_.push_back(slot.variable.requires_grad() ? 1 : 0);
  }
  hooked_.assign(slots_.size(), false);
  got_gradient_.assign(slots_.size(), 0);
  counted_.assign(slots_.size(), 0);
  // The parameters become views of the gathered buffer, which has no bytes yet.
  storage_ = std::make_shared<Storage>(device_, 0);
  for (const Slot& slot : slots_) {
    slot.variable.set_data(Tensor(storage_, slot.shape, contiguous_strides(slot.shape), slot.offset,
                                  options_.mixed_precision.param_dtype));
  }
}

Unit::~Unit() {
  if (state_ != Gathered::no) count_unsharded(-static_cast<std::int64_t>(storage_->nbytes()));
  drop_held();
}

void Unit::drop_held() {
  if (!held_.defined()) return;
  count_unsharded(-static_cast<std::int64_t>(held_.numel() * held_.element_size()));
  held_ = Tensor();
}

void Unit::reshard_after_forward() {
  if (post_forward_group_ != nullptr) {
    wait_unshard();
    const std::int64_t slice = padded_ / post_forward_group_->size();
    held_ = copy_kernel("keep slice for backward", name_, [&] {
      return gathered().narrow(0, post_forward_group_->rank() * slice, slice).clone();
    });
    count_unsharded(slice * static_cast<std::int64_t>(dtype_size(options_.mixed_precision.param_dtype)));
  }
  free_gathered();
}

bool Unit::trains() const {
  return std::any_of(sharded_parameters_.begin(), sharded_parameters_.end(),
                     [](const Variable& view) { return view.requires_grad(); });
}

ShardInfo Unit::shard_info(const Slot& slot) const {
  const Piece part = piece(slot);
  std::string placement = "Replicate";
  if (options_.sharding != Sharding::none) {
    placement =
        fmt::format("Shard(flat) elements [{}, {}) of {}, rank {} of {}", part.from, part.from + part.count,
                    slot.variable.numel(), groups_->shard_rank(), groups_->shard_size());
    if (groups_->replica != nullptr)
      placement += fmt::format(", replicated over {} groups", groups_->replica->size());
  }
  return ShardInfo{.full_shape = slot.shape,
                   .first = part.from,
                   .count = part.count,
                   .placement = std::move(placement),
                   .counts_once = groups_->first_replica(),
                   .ranks = ranks_of(*groups_->base, device_)};
}

// Users freeze and unfreeze the registered shards; the Variables the forward computes with follow
// before each forward. A change made on one of those instead (a module's member after sharding)
// would be overwritten here without effect, and one pointed at other memory would be computed with
// in place of the parameter: both refused.
void Unit::sync_computed_with() {
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Variable& computes = slots_[i].variable;
    SHARDLAB_CHECK(
        computes.data().storage() == storage_,
        "FSDP: the Variable the layers compute with for '{}' was given other memory (set_data) after "
        "dist::fully_shard; the parameter is its shard: change values through named_parameters() "
        "(the shard's data()) or load_state_dict",
        sharded_parameters_[i].name());
    SHARDLAB_CHECK(computes.requires_grad() == (computes_with_grad_[i] != 0),
                   "FSDP: requires_grad of '{}' was changed on the Variable its module computes with; after "
                   "dist::fully_shard the parameter is what named_parameters() gives: set it there",
                   sharded_parameters_[i].name());
    const bool wanted = sharded_parameters_[i].requires_grad();
    computes.set_requires_grad(wanted);
    computes_with_grad_[i] = wanted ? 1 : 0;
  }
}

std::int64_t padded_length(std::int64_t parameters, int shard_size) {
  return (parameters + shard_size - 1) / shard_size * shard_size;
}

Piece piece_of(const Slot& slot, int shard_rank, std::int64_t shard_elements) {
  const std::int64_t begin = shard_rank * shard_elements, end = begin + shard_elements;
  const std::int64_t from = std::max(begin, slot.offset),
                     to = std::min(end, slot.offset + slot.variable.numel());
  if (from >= to) return {};
  return {.from = from - slot.offset, .count = to - from, .at = from - begin};
}

Piece Unit::piece(const Slot& slot) const { return piece_of(slot, groups_->shard_rank(), shard_elements_); }

void Unit::join_root(std::shared_ptr<RootState> root, std::string name) {
  root_ = std::move(root);
  name_ = std::move(name);
  for (std::size_t i = 0; i < slots_.size(); ++i)
    sharded_parameters_[i].set_name(join_name(name_, slots_[i].names.front()));
  if (!deferred_) return;
  // Sharded initialisation: this rank draws only its slice of each parameter, the exact
  // values nn::initialize(root, seed) gives the whole parameter in one process.
  const auto seed = root_->root->initialized_seed();
  SHARDLAB_CHECK(
      seed.has_value(),
      "FSDP: unit {}'s parameters were made under nn::DeferredInitGuard, but nn::initialize(root, seed) "
      "was not called on the root {}",
      name_.empty() ? "(root)" : "'" + name_ + "'", root_->root->type_name());
  const NoGradGuard no_grad;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const Piece part = piece(slots_[i]);
    if (part.count > 0)
      slots_[i].init.fill(sharded_parameters_[i].data(), *seed, join_name(name_, slots_[i].names.front()),
                          part.from);
  }
}

// The module's hooks own the unit (the module outlives its unit); the parameters' hooks
// only refer to it, since the unit owns the parameters' Variables.
void Unit::install_hooks() {
  auto self = shared_from_this();
  module_->register_forward_pre_hook(
      [self](nn::Module&, nn::ForwardInputs& inputs) { self->pre_forward(inputs); });
  module_->register_forward_hook([self](nn::Module&, Variable& output) { self->post_forward(output); });
  std::weak_ptr<Unit> weak = self;
  // A module inside the unit that owns some of its parameters and runs while they are not
  // gathered (its caller bypassed the unit's forward) would read freed bytes: refuse instead.
  std::set<const void*> mine;  // what its modules compute with, and what they register after fully_shard
  for (const Slot& slot : slots_) mine.insert(slot.variable.impl().get());
  for (const Variable& view : sharded_parameters_) mine.insert(view.impl().get());
  for (const auto& [path, inner] : module_->named_modules()) {
    if (inner.get() == module_) continue;
    bool owns = false;
    for (const auto& [name, variable] : inner->named_parameters(false))
      owns |= mine.contains(variable.impl().get());
    if (!owns) continue;
    inner->register_forward_pre_hook([weak, path = path](nn::Module& running, nn::ForwardInputs&) {
      auto unit = weak.lock();
      if (!unit || unit->state_ == Gathered::yes) return;
      fail(
          "FSDP: {} '{}' ran while its parameters, held by the unit {}, were not gathered: the unit's own "
          "forward did not run first. Call the unit's module, or shard the module that is called",
          running.type_name(), join_name(unit->name_, path), describe_module(unit->name_, *unit->module_));
    });
  }
}

void Unit::unshard(GatherFor purpose) {
  if (state_ == Gathered::in_flight || state_ == Gathered::yes) return;
  wait_for_host_update();  // before anything changes: a failed update leaves the unit as it was
  const DType param_dtype = options_.mixed_precision.param_dtype;
  if (state_ == Gathered::no) {  // a stale buffer is refreshed in place
    storage_->reallocate(static_cast<std::size_t>(padded_) * dtype_size(param_dtype));
    count_unsharded(static_cast<std::int64_t>(storage_->nbytes()));
  }
  if (groups_->shard == nullptr) {
    copy_kernel("copy shard to gathered", name_, [&] { return gathered().copy_(shard_in_param_dtype()); });
    state_ = Gathered::yes;
    return;
  }
  static constexpr const char* purposes[] = {"pre-forward", "pre-backward", "unshard"};
  gather_tag_ = fmt::format("{} {}", purposes[static_cast<int>(purpose)], display_name(name_));
  // The slice kept from forward gathers inside the post-forward group: the same values, fewer bytes.
  const bool from_held = held_.defined();
  Communicator& group = from_held ? *post_forward_group_ : *groups_->shard;
  on_copy_stream(device_, {shard_, held_}, [&] {
    gather_source_ = from_held ? held_ : shard_in_param_dtype();
    gather_work_ = group.all_gather_into(gathered(), gather_source_, gather_tag_);
  });
  if (trace::on()) {
    gather_flow_ = trace::next_flow_id();
    trace::flow_start(gather_flow_, "all_gather " + gather_tag_, "communication");
  }
  state_ = Gathered::in_flight;
}

Tensor Unit::shard_in_param_dtype() const {
  const DType param_dtype = options_.mixed_precision.param_dtype;
  const Tensor on_device = offloads()
                               ? copy_kernel("copy shard to device", name_,
                                             [&] { return offload_copies(device_.index).to_device(shard_); })
                               : shard_;
  if (param_dtype == DType::f32) return on_device;
  return copy_kernel(cast_name("parameters", param_dtype).c_str(), name_,
                     [&] { return cast(on_device, param_dtype); });
}

void Unit::wait_unshard() {
  if (state_ != Gathered::in_flight) return;
  trace::Span span(trace::on() ? "wait all_gather " + gather_tag_ : std::string(), "wait");
  span.arg("unit", name_);
  gather_work_.wait();
  if (trace::on()) trace::flow_end(gather_flow_, "all_gather " + gather_tag_, "communication");
  gather_work_ = Work();
  gather_source_ = Tensor();
  drop_held();  // gathered from it, if it was there
  state_ = Gathered::yes;
}

void Unit::reshard() {
  drop_held();
  free_gathered();
}

void Unit::free_gathered() {
  wait_unshard();  // never free bytes a collective is still writing
  if (state_ == Gathered::no) return;
  count_unsharded(-static_cast<std::int64_t>(storage_->nbytes()));
  storage_->reallocate(0);
  state_ = Gathered::no;
}

void Unit::end_step() {
  if (keeps_after_backward()) return;  // for the next micro-step's forward
  if (!whole_between_steps()) return reshard();
  wait_unshard();
  if (state_ == Gathered::yes) state_ = Gathered::stale;  // the optimizer step changes the shard next
}

// The units `listed` by set_modules_to_*_prefetch, from the first step on; otherwise, once the
// order is recorded, the next options_.prefetch units after this one in it.
void Unit::prefetch(const std::optional<std::vector<std::weak_ptr<Unit>>>& listed,
                    const std::vector<Unit*>& order, bool recorded, GatherFor purpose) {
  if (listed) {
    for (const auto& weak : *listed) {
      if (auto unit = weak.lock()) unit->unshard(purpose);
    }
    return;
  }
  if (!recorded) return;
  const auto me = std::find(order.begin(), order.end(), this);
  if (me == order.end()) return;
  for (auto next = me + 1; next != order.end() && next - me <= options_.prefetch; ++next)
    (*next)->unshard(purpose);
}

void Unit::pre_forward(nn::ForwardInputs& inputs) {
  if (trace::on()) forward_began_ = trace::Clock::now();
  if (!root_) ensure_root(*module_);  // a forward without sharded_parameters()/explain() first
  if (is_root()) root_->close_stale_cost_labels();
  open_cost_label(cost_label("forward"));
  ++forward_labels_open_;
  // Kept after a synced backward, the parameters would outlive the optimizer step that changes them.
  SHARDLAB_CHECK(
      reshard_after_backward_ || !root_->sync,
      "FSDP: unit {} has set_reshard_after_backward(false) while gradient sync is on: parameters kept "
      "gathered after a synced backward would miss the optimizer step that follows it; keep them only "
      "for micro-steps without sync, and set it back to true with set_requires_gradient_sync(true)",
      display_name(name_));
  sync_computed_with();
  RootState& root = *root_;
  if (!root.forward_recorded &&
      std::find(root.forward_order.begin(), root.forward_order.end(), this) == root.forward_order.end()) {
    root.forward_order.push_back(this);
  }
  unshard(GatherFor::forward);
  wait_unshard();
  prefetch(forward_prefetch_, root.forward_order, root.forward_recorded, GatherFor::forward);
  cast_inputs(inputs);
  mark_inputs(inputs);
}

// Each input that requires grad passes through an identity whose backward runs once the
// gradient with respect to that input is complete, that is after every node of the unit that
// read the gathered parameters (FSDP2's RegisterPostBackwardFunction).
void Unit::mark_inputs(nn::ForwardInputs& inputs) {
  if (!is_grad_enabled()) return;
  std::weak_ptr<Unit> weak = shared_from_this();
  for (Variable& input : inputs) {
    if (!input.defined() || !input.requires_grad()) continue;
    ++inputs_marked_;
    input = autograd::record("fsdp_post_backward", {input}, input.data(), [weak](const Tensor& grad) {
      if (auto unit = weak.lock()) unit->on_input_gradient();
      return autograd::Grads{grad};
    });
  }
}

void Unit::cast_inputs(nn::ForwardInputs& inputs) const {
  const MixedPrecision& precision = options_.mixed_precision;
  if (!precision.cast_forward_inputs || precision.param_dtype == DType::f32) return;
  for (Variable& input : inputs) {
    if (input.defined() && is_floating(input.dtype()) && input.dtype() != precision.param_dtype)
      input = copy_kernel(cast_name("input", precision.param_dtype).c_str(), name_,
                          [&] { return cast(input, precision.param_dtype); });
  }
}

void Unit::cast_output(Variable& output) const {
  const auto& to = options_.mixed_precision.output_dtype;
  if (to && output.defined() && is_floating(output.dtype()) && output.dtype() != *to)
    output = copy_kernel(cast_name("output", *to).c_str(), name_, [&] { return cast(output, *to); });
}

void Unit::post_forward(Variable& output) {
  if (is_root()) root_->forward_recorded = true;
  if (is_grad_enabled() && trains()) owes_reduction_ = true;
  if (is_grad_enabled() && output.defined() && output.requires_grad()) {
    // The hook sits on the output before cast_output, so it fires when the gradient reaches
    // the unit itself.
    auto self = shared_from_this();
    output.register_hook([self](const Tensor&) {
      self->pre_backward();
      return Tensor();
    });
    if (reshards_after_forward()) reshard_after_forward();
  } else if (is_root()) {
    root_->end_step();  // inference: nothing will gather for backward, so a step ends here
  } else if (reshard_after_forward_) {
    reshard();
  }
  cast_output(output);
  trace_unit_span(forward_began_, "forward", name_);
  if (forward_labels_open_ > 0) {
    --forward_labels_open_;
    if (const std::string label = cost_label("forward"); cost_label_open(label)) close_cost_label(label);
  }
}

std::string Unit::cost_label(const char* phase) const {
  return fmt::format("{} {}", phase, display_name(name_));
}

void Unit::close_backward_cost_label() {
  if (!backward_label_open_) return;
  backward_label_open_ = false;
  if (const std::string label = cost_label("backward"); cost_label_open(label)) close_cost_label(label);
}

void Unit::close_stale_cost_labels() {
  for (const std::string label = cost_label("forward"); forward_labels_open_ > 0; --forward_labels_open_) {
    if (cost_label_open(label)) close_cost_label(label);
  }
  close_backward_cost_label();
}

void Unit::pre_backward() {
  RootState& root = *root_;
  if (!root.callback_queued) {
    root.callback_queued = true;
    // The token outlives the callback: destroyed unrun (the backward threw) or after a
    // finish_backward that threw, it puts the units back in order, so the exception is all the
    // caller sees and the next step trains normally.
    struct Token {
      std::weak_ptr<RootState> state;
      bool finished = false;
      ~Token() {
        if (auto root_state = state.lock(); root_state && !finished) root_state->abandon_backward();
      }
    };
    auto token = std::make_shared<Token>();  // made in place: a temporary's destructor would fire
    token->state = root_;
    autograd::queue_callback([state = root_, token] {
      state->finish_backward();
      token->finished = true;
    });
  }
  if (backward_started_) return;  // the unit's forward ran more than once this step
  backward_started_ = true;
  if (trace::on()) backward_began_ = trace::Clock::now();
  open_cost_label(cost_label("backward"));
  backward_label_open_ = true;
  if (!root.backward_recorded) root.backward_order.push_back(this);
  unshard(GatherFor::backward);
  wait_unshard();
  prefetch(backward_prefetch_, root.backward_order, root.backward_recorded, GatherFor::backward);
  prepare_gradients();
}

// Which parameters train is read now, per backward. Gradients land straight in one flat buffer,
// which the reduce-scatter then reads without a copy: a parameter's first gradient is written into
// its slice (no zero-fill first), later ones add to it. Without sync the buffer survives from the
// previous micro-step and keeps summing.
void Unit::prepare_gradients() {
  expected_ = ready_ = 0;
  std::fill(counted_.begin(), counted_.end(), 0);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const Variable& parameter = slots_[i].variable;
    if (!parameter.requires_grad()) continue;
    ++expected_;
    if (hooked_[i]) continue;
    hooked_[i] = true;
    std::weak_ptr<Unit> weak = shared_from_this();
    parameter.register_post_accumulate_grad_hook([weak, i](const Variable&) {
      if (auto unit = weak.lock()) unit->on_gradient_accumulated(i);
    });
  }
  if (expected_ == 0) return;  // all frozen: nothing to accumulate or reduce
  if (options_.bitwise) return prepare_binned_gradients();
  if (!full_grad_.defined()) {
    full_grad_ = empty({padded_}, dtype(options_.mixed_precision.param_dtype).with_device(device_));
    drop_gradient_views();
  }
  for (const Slot& slot : slots_) {
    if (slot.variable.requires_grad() && !slot.variable.grad().defined())
      slot.variable.set_grad_destination(gradient_slice(slot));
  }
}

// Bitwise: each trainable parameter's gradient parts go into the unit's BinnedSum at its offset in the
// flat gradient; the sum lives until the reduction, so backwards without sync add to it.
void Unit::prepare_binned_gradients() {
  if (binned_ == nullptr) binned_ = std::make_shared<BinnedSum>(padded_);
  for (const Slot& slot : slots_) {
    if (slot.variable.requires_grad()) slot.variable.set_binned_grad(binned_, slot.offset);
  }
}

void Unit::drop_binned_gradients() {
  for (const Slot& slot : slots_) slot.variable.set_binned_grad(nullptr);
  binned_.reset();
}

// Bitwise: every block's top is all-reduced with max over the shard and replica groups, then the windows
// at those tops, integers, are reduce-scattered and all-reduced with sum, exactly, and this rank's
// shard is rounded once: the same bits whatever the ranks, their shares of the batch or the order of
// the parts. A rank whose backward never reached the unit joins with an empty sum.
void Unit::reduce_binned_gradient() {
  const std::shared_ptr<BinnedSum> sum = binned_ != nullptr ? binned_ : std::make_shared<BinnedSum>(padded_);
  reducing_ = true;
  const Tensor tops = sum->tops().clone();
  for (Communicator* group : {groups_->shard, groups_->replica}) {
    if (group != nullptr) group->all_reduce(tops, ReduceOp::max, name_ + " (gradient tops)").wait();
  }
  const Tensor window = sum->window(tops);
  Tensor shard_window = window;
  if (groups_->shard != nullptr) {
    shard_window = empty({shard_elements_}, dtype(DType::i64));
    groups_->shard->reduce_scatter(shard_window, window, ReduceOp::sum, name_ + " (gradient windows)").wait();
  }
  if (groups_->replica != nullptr)
    groups_->replica->all_reduce(shard_window, ReduceOp::sum, name_ + " (gradient windows)").wait();
  reduce_output_ = round_binned(shard_window, tops, groups_->shard_rank() * shard_elements_);
  drop_binned_gradients();
}

Tensor Unit::gradient_slice(const Slot& slot) const {
  return full_grad_.narrow(0, slot.offset, slot.variable.numel()).view(slot.shape);
}

// Zeros what of the flat gradient no backward wrote: the slices of parameters that got no
// gradient (frozen, or unused this step on this rank) and the padding.
void Unit::zero_unwritten_gradients() {
  for (const Slot& slot : slots_) {
    if (!slot.variable.grad().defined()) gradient_slice(slot).fill_(0);
  }
  if (padded_ > parameters_) full_grad_.narrow(0, parameters_, padded_ - parameters_).fill_(0);
}

void Unit::drop_gradient_views() {
  for (const Slot& slot : slots_) {
    slot.variable.set_grad(Tensor());
    slot.variable.set_grad_destination(Tensor());
  }
}

void Unit::on_gradient_accumulated(std::size_t slot) {
  if (!backward_started_ || reduced_) return;
  got_gradient_[slot] = 1;
  if (counted_[slot]) return;
  counted_[slot] = 1;
  ++ready_;
  if (backward_done()) post_backward();
}

void Unit::on_input_gradient() {
  ++inputs_done_;
  if (backward_started_ && backward_done()) post_backward();
}

void Unit::post_backward() {
  if (reduced_) return;
  reduced_ = true;
  if (expected_ > 0) {
    if (root_->sync) {
      start_reduction();
    } else if (accumulates_in_reduce_dtype()) {
      accumulate_in_reduce_dtype();
    }
  }
  if (reshards_after_forward() && !keeps_after_backward()) reshard();
  if (!is_root()) {
    trace_backward_end();
    close_backward_cost_label();  // the root's closes once the whole backward finished
  }
}

void Unit::trace_backward_end() { trace_unit_span(backward_began_, "backward", name_); }

bool Unit::accumulates_in_reduce_dtype() const {
  return !options_.bitwise && options_.mixed_precision.reduce_dtype != options_.mixed_precision.param_dtype;
}

// A backward without sync, as FSDP2's: the param_dtype gradient is added into accumulated_ in
// reduce_dtype (f32 for bf16 compute), so that micro-batches add as the reduction does, and the
// param_dtype buffer is freed until the next backward writes a fresh one (ZeRO-1 keeps its own).
void Unit::accumulate_in_reduce_dtype() {
  zero_unwritten_gradients();
  const DType reduce_dtype = options_.mixed_precision.reduce_dtype;
  const Tensor gradient =
      copy_kernel(cast_name("gradient", reduce_dtype).c_str(), name_, [&] { return cast(full_grad_, reduce_dtype); });
  if (accumulated_.defined()) {
    add_(accumulated_, gradient);
  } else {
    accumulated_ = gradient;
  }
  drop_gradient_views();
  if (!whole_between_steps()) full_grad_ = Tensor();
}

// Reduce-scatter (averaged) the full gradient into this rank's slot; the replica all-reduce of
// hybrid and none waits for it, in finish_backward.
void Unit::start_reduction() {
  if (options_.bitwise) return reduce_binned_gradient();
  // A rank whose backward never reached the unit (no parameter of it used here) still joins
  // with zeros: the other ranks' reduce-scatter needs it.
  if (!full_grad_.defined()) {
    full_grad_ = empty({padded_}, dtype(options_.mixed_precision.param_dtype).with_device(device_));
    drop_gradient_views();
  }
  zero_unwritten_gradients();
  reducing_ = true;
  const DType reduce_dtype = options_.mixed_precision.reduce_dtype;
  // With the sums of backwards without sync (accumulated_), this one's added in.
  const auto gradient_in_reduce_dtype = [&] {
    if (reduce_dtype == options_.mixed_precision.param_dtype) return full_grad_;
    const Tensor gradient = copy_kernel(cast_name("gradient", reduce_dtype).c_str(), name_,
                                        [&] { return cast(full_grad_, reduce_dtype); });
    if (!accumulated_.defined()) return gradient;
    add_(accumulated_, gradient);
    return std::exchange(accumulated_, Tensor());
  };
  if (groups_->shard == nullptr) {  // the computed gradient is the result: no collective orders a copy stream
    reduce_input_ = reduce_output_ = gradient_in_reduce_dtype();
  } else {
    // Allocated here, on the compute stream, which reads it after the reduce-scatter.
    reduce_output_ = empty({shard_elements_}, dtype(reduce_dtype).with_device(device_));
    on_copy_stream(device_, {full_grad_}, [&] {
      reduce_input_ = gradient_in_reduce_dtype();
      reduce_work_ = groups_->shard->reduce_scatter(reduce_output_, reduce_input_, reduce_op(), name_);
    });
    root_->reduction_started(this);
  }
  drop_gradient_views();
  // ZeRO-1 keeps it and writes the next step's gradient into it, unless it is itself the reduced
  // gradient (one rank, no cast), which the gradient shard's views go on reading.
  const bool is_the_result = groups_->shard == nullptr && reduce_input_.storage() == full_grad_.storage();
  if (!whole_between_steps() || is_the_result) full_grad_ = Tensor();
}

void Unit::flush_backward() {
  if (backward_started_ && !reduced_) {
    post_backward();  // parameters that got no gradient this step
  } else if (!backward_started_ && owes_reduction_ && root_->sync && trains()) {
    start_reduction();  // the forward ran in grad mode, the backward never came here
  }
}

void Unit::release_reduce_input() {
  if (!reducing_ || reduce_input_released_) return;
  reduce_input_released_ = true;
  {
    trace::Span span(trace::on() ? "wait reduce_scatter " + name_ : std::string(), "wait");
    span.arg("unit", name_);
    reduce_work_.wait();
  }
  // The handle and the member were what kept the input alive (the output is the shard's, kept).
  reduce_work_ = Work();
  reduce_input_ = Tensor();
}

void Unit::collect_gradient() {
  if (!reducing_) return;
  release_reduce_input();
  if (groups_->replica != nullptr && !options_.bitwise) {  // bitwise: summed with the shard's
    if (!root_->all_reduce) return keep_partial_sum();
    if (partial_sum_.defined()) add_partial_sum();
    // In `units` order at the end of the backward on every rank of the replica group alike.
    trace::Span span(trace::on() ? "wait all_reduce " + name_ : std::string(), "wait");
    span.arg("unit", name_);
    groups_->replica->all_reduce(reduce_output_, reduce_op(), name_).wait();
  }
  if (all_reduce_hook_) all_reduce_hook_(reduce_output_);
  // Unless it is a cast, the reduced gradient is a buffer of its own (a 1-rank shard group's is the
  // full-gradient buffer, whose parameter views were dropped): the gradient shard, offloaded to the
  // host's pinned memory by a copy the host waits for once all units' are queued.
  const Tensor reduced = reduce_output_in_f32();
  if (const std::optional<double> divisor = post_divisor()) div_(reduced, *divisor);
  gradient_shard_ = offloads() ? copy_kernel("copy gradient to host", name_,
                                             [&] { return offload_copies(device_.index).to_host(reduced); })
                               : reduced;
}

Tensor Unit::reduce_output_in_f32() const {
  return reduce_output_.dtype() == DType::f32
             ? reduce_output_
             : copy_kernel(cast_name("gradient", DType::f32).c_str(), name_,
                           [&] { return cast(reduce_output_, DType::f32); });
}

// The reduced shard is this rank's alone (the parameter views of a 1-rank shard group's buffer were
// dropped), so the first micro-step's becomes the sum.
void Unit::keep_partial_sum() {
  const Tensor shard = reduce_output_in_f32();
  if (partial_sum_.defined()) {
    add_(partial_sum_, shard);
  } else {
    partial_sum_ = shard;
  }
  const std::string reason = fmt::format(
      "its gradient is reduce-scattered but waits for its all-reduce over the {} replicas of unit {} "
      "(dist::set_requires_all_reduce(root, false)); set it back to true before the last micro-step's "
      "backward",
      groups_->replica->size(), display_name(name_));
  for (const Variable& parameter : sharded_parameters_) {
    if (parameter.requires_grad()) parameter.set_not_trainable(reason);
  }
}

void Unit::add_partial_sum() {
  add_(partial_sum_, reduce_output_in_f32());
  const DType reduce_dtype = options_.mixed_precision.reduce_dtype;
  reduce_output_ = reduce_dtype == DType::f32 ? partial_sum_ : cast(partial_sum_, reduce_dtype);
  partial_sum_ = Tensor();
  for (const Variable& parameter : sharded_parameters_) parameter.clear_not_trainable();
}

std::optional<double> Unit::post_divisor() const {
  if (divide_factor_) return divide_factor_;
  if (!force_sum_ || options_.bitwise) return std::nullopt;
  return static_cast<double>(groups_->shard_size()) * (groups_->replica ? groups_->replica->size() : 1);
}

void Unit::check_no_partial_sum(const char* call) const {
  SHARDLAB_CHECK(!partial_sum_.defined(),
                 "dist::{}: unit {} holds a sum of reduce-scattered gradients that waits for its all-reduce "
                 "(dist::set_requires_all_reduce(root, false)), reduced the way it is set now; change it before "
                 "the first micro-step or after the all-reduce",
                 call, display_name(name_));
}

void Unit::set_gradient_divide_factor(double factor) {
  SHARDLAB_CHECK(std::isfinite(factor) && factor > 0,
                 "dist::set_gradient_divide_factor: the factor must be positive and finite, got {}", factor);
  check_no_partial_sum("set_gradient_divide_factor");
  divide_factor_ = factor;
}

void Unit::set_force_sum_reduction(bool force_sum) {
  if (force_sum != force_sum_) check_no_partial_sum("set_force_sum_reduction_for_comms");
  force_sum_ = force_sum;
}

// A parameter that got a gradient on some rank gets its slice; the others stay without one.
void Unit::give_gradient_shard(const std::uint8_t* agreed_flags) {
  const Tensor gradient = std::exchange(gradient_shard_, Tensor());
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (agreed_flags[i] == 0 || !slots_[i].variable.requires_grad()) continue;
    const Piece part = piece(slots_[i]);
    const Tensor slice = gradient.narrow(0, part.at, part.count);
    if (sharded_parameters_[i].grad().defined()) {
      add_(sharded_parameters_[i].grad(), slice);
    } else {
      sharded_parameters_[i].set_grad(slice);
    }
  }
  std::fill(got_gradient_.begin(), got_gradient_.end(), 0);
}

void Unit::finish_backward(const std::uint8_t* agreed_flags) {
  if (reducing_) {
    if (!partial_sum_.defined()) give_gradient_shard(agreed_flags);
    // A partial sum waits for its all-reduce, and the flags of its micro-steps with it: this rank
    // joins that all-reduce whether or not its next backward reaches the unit.
    owes_reduction_ = partial_sum_.defined();
    reducing_ = false;
  }
  reduce_input_released_ = false;
  reduce_work_ = Work();
  reduce_input_ = reduce_output_ = Tensor();
  backward_started_ = reduced_ = false;
  inputs_marked_ = inputs_done_ = 0;
  end_step();
}

void Unit::abandon_backward() {
  // A reduction in flight completes on its own (its Work keeps the buffers alive).
  reduce_work_ = Work();
  reduce_input_ = reduce_output_ = full_grad_ = accumulated_ = gradient_shard_ = partial_sum_ = Tensor();
  for (const Variable& parameter : sharded_parameters_) parameter.clear_not_trainable();
  drop_gradient_views();
  if (options_.bitwise) drop_binned_gradients();
  std::fill(got_gradient_.begin(), got_gradient_.end(), 0);
  owes_reduction_ = backward_started_ = reduced_ = reducing_ = reduce_input_released_ = false;
  inputs_marked_ = inputs_done_ = 0;
  close_backward_cost_label();
}

void Unit::wait_for_host_update() const {
  if (!host_update_.valid()) return;
  const std::shared_future<void> update = std::exchange(host_update_, {});
  try {
    update.get();
  } catch (const std::exception& error) {
    throw Error(fmt::format("FSDP: the optimizer step of unit {} failed on the host step thread: {}",
                            display_name(name_), error.what()));
  }
}

Tensor Unit::full_shard_values() const {
  wait_for_host_update();
  Tensor full = empty({padded_}, dtype(DType::f32).with_device(device_));
  if (groups_->shard == nullptr) {
    full.copy_(shard_);
  } else {
    groups_->shard->all_gather_into(full, shard_.to(device_), name_ + " (full parameters)").wait();
  }
  return full.to(Device::cpu());
}

// --- RootState ----------------------------------------------------------------------------------

void RootState::reduction_started(Unit* unit) {
  reductions_in_flight.push_back(unit);
  while (reductions_in_flight.size() > kReductionsInFlight) {
    reductions_in_flight.front()->release_reduce_input();
    reductions_in_flight.pop_front();
  }
}

void RootState::finish_backward() {
  for (Unit* unit : units) unit->flush_backward();
  reductions_in_flight.clear();
  std::vector<Unit*> reducing;
  for (Unit* unit : units) {
    if (unit->reducing()) reducing.push_back(unit);
  }
  const std::vector<std::uint8_t> flags = agree_on_gradients(reducing);
  for (Unit* unit : reducing) unit->collect_gradient();
  wait_for_offload_copies();
  std::size_t offset = 0;
  for (Unit* unit : units) {
    const bool reduced = unit->reducing();
    unit->finish_backward(reduced ? flags.data() + offset : nullptr);
    if (reduced) offset += unit->slots().size();
  }
  callback_queued = false;
  if (!backward_order.empty()) backward_recorded = true;
  units.front()->trace_backward_end();
  for (Unit* unit : units) unit->close_backward_cost_label();
}

// Every rank joins the all-reduce, but only a rank whose own backward left a trainable parameter
// without a gradient needs its answer: where this rank has a gradient, the maximum is 1 already. So
// in the common step, every parameter used, the host never reads the flags (on a GPU, a host wait).
std::vector<std::uint8_t> RootState::agree_on_gradients(const std::vector<Unit*>& reducing) const {
  std::vector<std::uint8_t> flags;
  bool all_known = true;
  for (const Unit* unit : reducing) {
    const std::vector<std::uint8_t>& mine = unit->gradient_flags();
    for (std::size_t i = 0; i < mine.size(); ++i)
      all_known &= mine[i] != 0 || !unit->slots()[i].variable.requires_grad();
    flags.insert(flags.end(), mine.begin(), mine.end());
  }
  Communicator* all = units.front()->groups().base;
  if (flags.empty() || all->size() == 1) return flags;
  const auto count = static_cast<std::int64_t>(flags.size());
  // On the units' device (an NCCL communicator takes device tensors only), sent from pinned
  // memory: from pageable memory the copy would wait for the device.
  const Device device = units.front()->device();
  const Tensor local = from_vector(flags, {count});
  const Tensor agreed =
      device.is_cuda() ? local.pin_memory().to(device, /*non_blocking=*/true) : local.to(device);
  // With NCCL the wait is the compute stream's, not the host's; the read below is the host's.
  all->all_reduce(agreed, ReduceOp::max, "gradient flags").wait();
  if (all_known) return flags;
  // Whether a parameter this rank left without a gradient gets one at all is the host's to know
  // now: inside a training step that forbids host waits this read is allowed, and counted apart.
  const HostWaitsUnavoidable read("which parameters got a gradient on another rank");
  const Tensor on_host = agreed.to(Device::cpu());
  std::copy_n(on_host.data<std::uint8_t>(), flags.size(), flags.begin());
  return flags;
}

void RootState::abandon_backward() {
  for (Unit* unit : units) unit->abandon_backward();
  reductions_in_flight.clear();
  callback_queued = false;
}

void RootState::close_stale_cost_labels() {
  for (Unit* unit : units) unit->close_stale_cost_labels();
}

void RootState::end_step() {
  for (Unit* unit : units) unit->end_step();
  wait_for_offload_copies();  // the host may write the shards next (load_state_dict)
}

void RootState::wait_for_host_updates() const {
  for (const Unit* unit : units) unit->wait_for_host_update();
}

void RootState::wait_for_offload_copies() const {
  const Unit* offloaded = nullptr;
  for (const Unit* unit : units) offloaded = unit->offloads() ? unit : offloaded;
  if (offloaded != nullptr) offload_copies(offloaded->device().index).wait_for_host();
}

}  // namespace detail

UnshardedMemory unsharded_memory() {
  std::lock_guard lock(detail::unsharded_mutex);
  return detail::unsharded;
}

void reset_unsharded_peak() {
  std::lock_guard lock(detail::unsharded_mutex);
  detail::unsharded.peak_bytes = detail::unsharded.bytes;
}

}  // namespace shardlab::dist
