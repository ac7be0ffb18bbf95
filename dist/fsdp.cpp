// dist/fsdp.cpp: FSDP units: flattening and sharding, the hooks that gather before forward
// and backward, reduce gradients and reshard, prefetching, and the per-root bookkeeping.
//
// Saved activations: autograd saves the weight views it needs during forward, and resharding
// frees the gathered bytes. A unit's gathered buffer is one Storage object for the unit's
// whole life: resharding calls reallocate(0) on it and gathering reallocates and fills it
// again, so the saved views (which point at the Storage, not at the bytes) are valid again by
// the time the unit's backward runs: the pre-backward hook gathers first (FSDP1's trick).
#include "dist/fsdp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>

#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "core/ops.h"
#include "core/storage.h"
#include "dist/init.h"
#include "optim/optimizer.h"

namespace shardlab::dist {

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
  }
  return "unknown";
}

std::pair<Sharding, int> parse_sharding(std::string_view text) {
  if (text == "full") return {Sharding::full, 0};
  if (text == "grad_op") return {Sharding::grad_op, 0};
  if (text == "none") return {Sharding::none, 0};
  if (text.starts_with("hybrid:")) {
    const std::string digits(text.substr(7));
    char* end = nullptr;
    const long group = std::strtol(digits.c_str(), &end, 10);
    if (!digits.empty() && *end == '\0' && group > 0) return {Sharding::hybrid, static_cast<int>(group)};
  }
  fail("sharding '{}' is not one of full, grad_op, none, hybrid:G (G > 0 ranks per shard group)", text);
}

namespace {

// The ranks a unit shards over and the ranks it replicates over (null when a group has one
// rank), shared by all units made with the same communicator and strategy.
struct Groups {
  Communicator* base = nullptr;  // every rank that trains the unit: shard groups x replicas
  Communicator* shard = nullptr;
  Communicator* replica = nullptr;
  std::unique_ptr<Communicator> owned_shard, owned_replica;

  int shard_size() const { return shard ? shard->size() : 1; }
  int shard_rank() const { return shard ? shard->rank() : 0; }
  // Whether this rank's copy of the unit's shard is the one that counts in sums over all ranks
  // (a replicated shard would be counted once per replica otherwise).
  bool first_replica() const { return replica == nullptr || replica->rank() == 0; }
};

std::shared_ptr<Groups> groups_for(Communicator& base, Sharding sharding, int group_size) {
  static std::mutex mutex;
  static std::map<std::tuple<Communicator*, Sharding, int>, std::weak_ptr<Groups>> cache;
  std::lock_guard lock(mutex);
  auto& slot = cache[{&base, sharding, group_size}];
  if (auto existing = slot.lock()) return existing;
  auto groups = std::make_shared<Groups>();
  groups->base = &base;
  const int rank = base.rank(), world = base.size();
  switch (sharding) {
    case Sharding::full:
    case Sharding::grad_op:
      groups->shard = world > 1 ? &base : nullptr;
      break;
    case Sharding::none:
      groups->replica = world > 1 ? &base : nullptr;
      break;
    case Sharding::hybrid:
      SHARDLAB_CHECK(
          group_size > 0 && world % group_size == 0,
          "fully_shard: hybrid shard groups of {} ranks do not divide the {} ranks of communicator '{}'",
          group_size, world, base.name());
      if (group_size > 1) {
        groups->owned_shard =
            base.split(rank / group_size, rank, fmt::format("{}/shard{}", base.name(), rank / group_size));
        groups->shard = groups->owned_shard.get();
      }
      if (world / group_size > 1) {
        groups->owned_replica =
            base.split(rank % group_size, rank, fmt::format("{}/replica{}", base.name(), rank % group_size));
        groups->replica = groups->owned_replica.get();
      }
      break;
  }
  slot = groups;
  return groups;
}

// One parameter's place in the flat buffer; tied parameters have several names.
struct Slot {
  std::vector<std::string> names;  // dotted, relative to the unit's module
  Variable variable;
  Shape shape;
  nn::Init init;
  std::int64_t offset = 0;
};

class Unit;

// The units under one root, in preorder of the module tree (the root's first), and what the
// steps of that root share: execution orders for prefetching and the end-of-backward callback.
struct RootState {
  nn::Module* root = nullptr;
  std::vector<Unit*> units;
  std::vector<Unit*> forward_order, backward_order;
  bool forward_recorded = false, backward_recorded = false;
  bool callback_queued = false;
  bool sync = true;

  void finish_backward();
  // One all-reduce (max) over all ranks of the flags "this parameter got a gradient since the
  // last reduction" of every unit reducing now; returns them, agreed, in unit and slot order.
  std::vector<std::uint8_t> agree_on_gradients(const std::vector<Unit*>& reducing) const;
  void reshard_all();
};

// The part of one parameter in this rank's shard: its elements [from, from + count), at `at` in
// the shard; count 0 when the rank holds none of them.
struct Piece {
  std::int64_t from = 0, count = 0, at = 0;
};

enum class Gathered : std::uint8_t { no, in_flight, yes };

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(nn::Module& module, std::vector<Slot> slots, const FsdpOptions& options,
       std::shared_ptr<Groups> groups);
  // A unit may die gathered (a forward without backward, then the model goes): its gathered
  // bytes leave the count with it. An all-gather still in flight keeps its buffers alive itself.
  ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  nn::Module& module() const { return *module_; }
  const std::vector<Slot>& slots() const { return slots_; }
  // This rank's piece of each slot as a trainable Variable (sharded_parameters), slot order.
  const std::vector<Variable>& views() const { return views_; }
  const std::string& name() const { return name_; }
  const Tensor& shard() const { return shard_; }
  const std::shared_ptr<RootState>& root_state() const { return root_; }
  bool is_root() const { return root_ && root_->root == module_; }
  std::int64_t parameters() const { return parameters_; }
  std::int64_t padded() const { return padded_; }
  std::int64_t shard_elements() const { return shard_elements_; }
  const Groups& groups() const { return *groups_; }
  const MixedPrecision& precision() const { return options_.mixed_precision; }
  const FsdpOptions& options() const { return options_; }
  Device device() const { return device_; }
  // Whether the parameters are gathered again for backward (FULL_SHARD's second all-gather).
  bool reshards_after_forward() const { return reshard_after_forward_ && !is_root(); }
  // Whether some parameter trains (requires grad): read from the module's parameters each time,
  // since users freeze and unfreeze between steps.
  bool trains() const;
  Piece piece(const Slot& slot) const;
  bool reducing() const { return reducing_; }
  // This rank's "got a gradient since the last reduction" flags, one per slot.
  const std::vector<std::uint8_t>& gradient_flags() const { return got_gradient_; }

  void join_root(std::shared_ptr<RootState> root, std::string name);
  void install_hooks();

  void pre_forward(nn::ForwardInputs& inputs);
  void post_forward(Variable& output);
  void pre_backward();
  void on_gradient_accumulated(std::size_t slot);
  void on_input_gradient();
  void post_backward();
  void flush_backward();  // from the root's end-of-backward callback, before finish_backward
  void finish_backward(const std::uint8_t* agreed_flags);
  void unshard();
  void wait_unshard();
  void reshard();
  Tensor full_shard_values() const;  // the flat f32 parameters [padded], gathered from the shards

 private:
  Tensor gathered() const {
    return Tensor(storage_, {padded_}, {1}, 0, options_.mixed_precision.param_dtype);
  }
  void prefetch(const std::vector<Unit*>& order);
  void prepare_gradients();
  void start_reduction();
  void cast_inputs(nn::ForwardInputs& inputs) const;
  void mark_inputs(nn::ForwardInputs& inputs);
  void cast_output(Variable& output) const;
  // The unit's backward is over, and its gathered parameters no longer read, once every
  // trainable parameter's gradient has arrived and every marked input's gradient too: a frozen
  // weight is still read for its input's gradient after the trainable ones have theirs.
  bool backward_done() const { return ready_ == expected_ && inputs_done_ == inputs_marked_; }

  nn::Module* module_;
  FsdpOptions options_;
  std::vector<Slot> slots_;
  std::shared_ptr<Groups> groups_;
  bool reshard_after_forward_;
  std::int64_t parameters_ = 0, padded_ = 0, shard_elements_ = 0;
  Device device_;        // where the parameters are gathered and computed with
  Device shard_device_;  // where the shards and the optimizer state live (the CPU when offloaded)
  bool deferred_ = false;
  std::string name_;
  std::shared_ptr<RootState> root_;
  Tensor shard_;                      // f32 [S]: the views_ are its pieces
  std::vector<Variable> views_;       // per slot
  std::shared_ptr<Storage> storage_;  // the gathered parameters, bytes only while gathered
  Gathered state_ = Gathered::no;
  Work gather_work_;
  Tensor gather_source_;  // the shard cast to param_dtype, alive until its all-gather completed
  std::vector<bool> hooked_;  // per slot: its post-accumulate hook is registered
  // Until the next reduction (several backwards without gradient sync): per slot, whether its
  // gradient was accumulated; and whether the forward ran in grad mode with a parameter that
  // trains, which obliges this rank to join the unit's reduction even if no gradient came.
  std::vector<std::uint8_t> got_gradient_;
  bool owes_reduction_ = false;
  // One backward pass.
  Tensor full_grad_;  // [padded] in param_dtype; the parameters' .grad are views into it
  bool backward_started_ = false, reduced_ = false, reducing_ = false;
  std::vector<std::uint8_t> counted_;  // per slot: its gradient arrived in this backward
  std::int64_t ready_ = 0, expected_ = 0;
  std::int64_t inputs_marked_ = 0, inputs_done_ = 0;  // since the last finish_backward
  Work reduce_work_;
  Tensor reduce_input_, reduce_output_;
};

// --- gathered bytes ----------------------------------------------------------------------------

std::mutex unsharded_mutex;
UnshardedMemory unsharded;

void count_unsharded(std::int64_t delta) {
  std::lock_guard lock(unsharded_mutex);
  unsharded.bytes += delta;
  unsharded.peak_bytes = std::max(unsharded.peak_bytes, unsharded.bytes);
}

// --- the registry of units -------------------------------------------------------------------

std::mutex registry_mutex;
std::vector<std::pair<const nn::Module*, std::weak_ptr<Unit>>> registry;

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
    SHARDLAB_CHECK(unit->groups().base == root_unit->groups().base,
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
      reshard_after_forward_(options.reshard_after_forward.value_or(options.sharding == Sharding::full ||
                                                                    options.sharding == Sharding::hybrid)) {
  device_ = slots_.empty() ? Device::cpu() : slots_.front().variable.device();
  shard_device_ = options.cpu_offload ? Device::cpu() : device_;
  for (Slot& slot : slots_) {
    slot.offset = parameters_;
    parameters_ += slot.variable.numel();
  }
  const std::int64_t group = groups_->shard_size();
  padded_ = (parameters_ + group - 1) / group * group;
  shard_elements_ = padded_ / group;
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
  shard_ = zeros({shard_elements_}, dtype(DType::f32).with_device(shard_device_));
  for (const Slot& slot : slots_) {
    const Piece part = piece(slot);
    const Tensor target = shard_.narrow(0, part.at, part.count);
    if (!deferred_ && part.count > 0) {
      const Tensor flat = slot.variable.data().contiguous().view({slot.variable.numel()});
      target.copy_(cast(flat.narrow(0, part.from, part.count), DType::f32));
    }
    views_.emplace_back(target, slot.variable.requires_grad(), slot.names.front());
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
}

bool Unit::trains() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& slot) { return slot.variable.requires_grad(); });
}

Piece Unit::piece(const Slot& slot) const {
  const std::int64_t begin = groups_->shard_rank() * shard_elements_, end = begin + shard_elements_;
  const std::int64_t from = std::max(begin, slot.offset), to = std::min(end, slot.offset + slot.variable.numel());
  if (from >= to) return {};
  return {.from = from - slot.offset, .count = to - from, .at = from - begin};
}

void Unit::join_root(std::shared_ptr<RootState> root, std::string name) {
  root_ = std::move(root);
  name_ = std::move(name);
  for (std::size_t i = 0; i < slots_.size(); ++i) views_[i].set_name(join_name(name_, slots_[i].names.front()));
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
      slots_[i].init.fill(views_[i].data(), *seed, join_name(name_, slots_[i].names.front()), part.from);
  }
}

// The module's hooks own the unit (the module outlives its unit); the parameters' hooks
// only refer to it, since the unit owns the parameters' Variables.
void Unit::install_hooks() {
  auto self = shared_from_this();
  module_->register_forward_pre_hook([self](nn::Module&, nn::ForwardInputs& inputs) { self->pre_forward(inputs); });
  module_->register_forward_hook([self](nn::Module&, Variable& output) { self->post_forward(output); });
  std::weak_ptr<Unit> weak = self;
  // A module inside the unit that owns some of its parameters and runs while they are not
  // gathered (its caller bypassed the unit's forward) would read freed bytes: refuse instead.
  std::set<const void*> mine;
  for (const Slot& slot : slots_) mine.insert(slot.variable.impl().get());
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

void Unit::unshard() {
  if (state_ != Gathered::no) return;
  storage_->reallocate(static_cast<std::size_t>(padded_) * dtype_size(options_.mixed_precision.param_dtype));
  count_unsharded(static_cast<std::int64_t>(storage_->nbytes()));
  const Tensor on_device = shard_.to(device_);  // itself unless offloaded
  const Tensor source = options_.mixed_precision.param_dtype == DType::f32
                            ? on_device
                            : cast(on_device, options_.mixed_precision.param_dtype);
  if (groups_->shard == nullptr) {
    gathered().copy_(source);
    state_ = Gathered::yes;
    return;
  }
  gather_source_ = source;
  gather_work_ = groups_->shard->all_gather_into(gathered(), source, name_);
  state_ = Gathered::in_flight;
}

void Unit::wait_unshard() {
  if (state_ != Gathered::in_flight) return;
  gather_work_.wait();
  gather_work_ = Work();
  gather_source_ = Tensor();
  state_ = Gathered::yes;
}

void Unit::reshard() {
  wait_unshard();  // never free bytes a collective is still writing
  if (state_ == Gathered::no) return;
  count_unsharded(-static_cast<std::int64_t>(storage_->nbytes()));
  storage_->reallocate(0);
  state_ = Gathered::no;
}

void Unit::prefetch(const std::vector<Unit*>& order) {
  const auto me = std::find(order.begin(), order.end(), this);
  if (me == order.end()) return;
  for (auto next = me + 1; next != order.end() && next - me <= options_.prefetch; ++next) (*next)->unshard();
}

void Unit::pre_forward(nn::ForwardInputs& inputs) {
  if (!root_) ensure_root(*module_);  // a forward without sharded_parameters()/explain() first
  RootState& root = *root_;
  if (!root.forward_recorded &&
      std::find(root.forward_order.begin(), root.forward_order.end(), this) == root.forward_order.end()) {
    root.forward_order.push_back(this);
  }
  unshard();
  wait_unshard();
  if (root.forward_recorded) prefetch(root.forward_order);
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
      input = cast(input, precision.param_dtype);
  }
}

void Unit::cast_output(Variable& output) const {
  const auto& to = options_.mixed_precision.output_dtype;
  if (to && output.defined() && is_floating(output.dtype()) && output.dtype() != *to) output = cast(output, *to);
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
    if (reshards_after_forward()) reshard();
  } else if (is_root()) {
    root_->reshard_all();  // inference: nothing will gather for backward, so a step ends here
  } else if (reshard_after_forward_) {
    reshard();
  }
  cast_output(output);
}

void Unit::pre_backward() {
  RootState& root = *root_;
  if (!root.callback_queued) {
    root.callback_queued = true;
    autograd::queue_callback([state = root_] { state->finish_backward(); });
  }
  if (backward_started_) return;  // the unit's forward ran more than once this step
  backward_started_ = true;
  if (!root.backward_recorded) root.backward_order.push_back(this);
  unshard();
  wait_unshard();
  if (root.backward_recorded) prefetch(root.backward_order);
  prepare_gradients();
}

// Which parameters train is read now, per backward. Gradients accumulate straight into one flat
// buffer, which the reduce-scatter then reads without a copy. Without sync it survives from the
// previous micro-step and keeps summing.
void Unit::prepare_gradients() {
  expected_ = ready_ = 0;
  std::fill(counted_.begin(), counted_.end(), 0);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const Variable& parameter = slots_[i].variable;
    if (views_[i].requires_grad() != parameter.requires_grad()) views_[i].set_requires_grad(parameter.requires_grad());
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
  if (!full_grad_.defined())
    full_grad_ = zeros({padded_}, dtype(options_.mixed_precision.param_dtype).with_device(device_));
  for (const Slot& slot : slots_) {
    if (slot.variable.requires_grad())
      slot.variable.set_grad(full_grad_.narrow(0, slot.offset, slot.variable.numel()).view(slot.shape));
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
  if (root_->sync && expected_ > 0) start_reduction();
  if (reshards_after_forward()) reshard();
}

// Reduce-scatter (averaged) the full gradient into this rank's slot; the replica all-reduce of
// hybrid and none waits for it, in finish_backward.
void Unit::start_reduction() {
  // A rank whose backward never reached the unit (no parameter of it used here) still joins
  // with zeros: the other ranks' reduce-scatter needs it.
  if (!full_grad_.defined())
    full_grad_ = zeros({padded_}, dtype(options_.mixed_precision.param_dtype).with_device(device_));
  reducing_ = true;
  reduce_input_ = options_.mixed_precision.reduce_dtype == options_.mixed_precision.param_dtype
                      ? full_grad_
                      : cast(full_grad_, options_.mixed_precision.reduce_dtype);
  for (const Slot& slot : slots_) slot.variable.set_grad(Tensor());
  full_grad_ = Tensor();
  if (groups_->shard == nullptr) {
    reduce_output_ = reduce_input_;
    return;
  }
  reduce_output_ =
      empty({shard_elements_}, dtype(options_.mixed_precision.reduce_dtype).with_device(device_));
  reduce_work_ = groups_->shard->reduce_scatter(reduce_output_, reduce_input_, ReduceOp::avg, name_);
}

void Unit::flush_backward() {
  if (backward_started_ && !reduced_) {
    post_backward();  // parameters that got no gradient this step
  } else if (!backward_started_ && owes_reduction_ && root_->sync && trains()) {
    start_reduction();  // the forward ran in grad mode, the backward never came here
  }
}

void Unit::finish_backward(const std::uint8_t* agreed_flags) {
  if (reducing_) {
    reduce_work_.wait();
    if (groups_->replica != nullptr)
      groups_->replica->all_reduce(reduce_output_, ReduceOp::avg, name_).wait();
    // Unless it is a cast, the reduced gradient is a buffer of its own (a 1-rank shard group's
    // is the full-gradient buffer, whose parameter views were dropped): the gradient shard. A
    // parameter that got a gradient on some rank gets its slice; the others stay without one.
    const Tensor gradient =
        (reduce_output_.dtype() == DType::f32 ? reduce_output_ : cast(reduce_output_, DType::f32))
            .to(shard_device_);
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (agreed_flags[i] == 0 || !slots_[i].variable.requires_grad()) continue;
      const Piece part = piece(slots_[i]);
      const Tensor slice = gradient.narrow(0, part.at, part.count);
      if (views_[i].grad().defined()) {
        add_(views_[i].grad(), slice);
      } else {
        views_[i].set_grad(slice);
      }
    }
    std::fill(got_gradient_.begin(), got_gradient_.end(), 0);
    owes_reduction_ = reducing_ = false;
  }
  reduce_work_ = Work();
  reduce_input_ = reduce_output_ = Tensor();
  backward_started_ = reduced_ = false;
  inputs_marked_ = inputs_done_ = 0;
  reshard();
}

Tensor Unit::full_shard_values() const {
  Tensor full = empty({padded_}, dtype(DType::f32).with_device(device_));
  if (groups_->shard == nullptr) {
    full.copy_(shard_);
  } else {
    groups_->shard->all_gather_into(full, shard_.to(device_), name_ + " (full parameters)").wait();
  }
  return full.to(Device::cpu());
}

// --- RootState ----------------------------------------------------------------------------------

void RootState::finish_backward() {
  for (Unit* unit : units) unit->flush_backward();
  std::vector<Unit*> reducing;
  for (Unit* unit : units) {
    if (unit->reducing()) reducing.push_back(unit);
  }
  const std::vector<std::uint8_t> flags = agree_on_gradients(reducing);
  std::size_t offset = 0;
  for (Unit* unit : units) {
    const bool reduced = unit->reducing();
    unit->finish_backward(reduced ? flags.data() + offset : nullptr);
    if (reduced) offset += unit->slots().size();
  }
  callback_queued = false;
  if (!backward_order.empty()) backward_recorded = true;
}

std::vector<std::uint8_t> RootState::agree_on_gradients(const std::vector<Unit*>& reducing) const {
  std::vector<std::uint8_t> flags;
  for (const Unit* unit : reducing)
    flags.insert(flags.end(), unit->gradient_flags().begin(), unit->gradient_flags().end());
  Communicator* all = units.front()->groups().base;
  if (flags.empty() || all->size() == 1) return flags;
  const auto count = static_cast<std::int64_t>(flags.size());
  const Tensor agreed = from_vector(std::vector<std::uint8_t>(flags), {count});
  all->all_reduce(agreed, ReduceOp::max, "gradient flags").wait();
  std::copy_n(agreed.data<std::uint8_t>(), flags.size(), flags.begin());
  return flags;
}

void RootState::reshard_all() {
  for (Unit* unit : units) unit->reshard();
}

}  // namespace

UnshardedMemory unsharded_memory() {
  std::lock_guard lock(unsharded_mutex);
  return unsharded;
}

void reset_unsharded_peak() {
  std::lock_guard lock(unsharded_mutex);
  unsharded.peak_bytes = unsharded.bytes;
}

// --- the API ------------------------------------------------------------------------------------

void fully_shard(nn::Module& module, const FsdpOptions& options) {
  SHARDLAB_CHECK(options.prefetch >= 0, "fully_shard: prefetch must be >= 0, got {}", options.prefetch);
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
    for (const Slot& slot : unit->slots()) {
      Claim& claim = claimed[slot.variable.impl().get()];
      if (claim.unit_paths.empty()) claim.held_as = join_name(path, slot.names.front());
      claim.unit_paths.push_back(path);
    }
  }
  std::vector<Slot> slots;
  std::map<const void*, std::size_t> slot_of;
  std::map<std::string, nn::Init> inits;
  for (auto& [name, init] : module.named_inits()) inits.emplace(name, init);
  for (const auto& [name, variable] : module.named_parameters()) {
    if (auto it = claimed.find(variable.impl().get()); it != claimed.end()) {
      const Claim& claim = it->second;
      const bool inside =
          std::any_of(claim.unit_paths.begin(), claim.unit_paths.end(),
                      [&](const std::string& unit_path) { return name.starts_with(unit_path + "."); });
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
  Communicator& base = options.communicator ? *options.communicator : session().world();
  auto unit = std::make_shared<Unit>(module, std::move(slots), options,
                                     groups_for(base, options.sharding, options.hybrid_group_size));
  unit->install_hooks();
  std::lock_guard lock(registry_mutex);
  registry.emplace_back(&module, unit);
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
  std::map<const void*, Variable> view_of;  // by the module parameter's identity
  for (const Unit* unit : ensure_root(root)->units) {
    for (std::size_t i = 0; i < unit->slots().size(); ++i)
      view_of.emplace(unit->slots()[i].variable.impl().get(), unit->views()[i]);
  }
  nn::Named<Variable> views;
  for (const auto& [name, parameter] : root.named_parameters()) {
    const auto it = view_of.find(parameter.impl().get());
    if (it == view_of.end()) continue;  // a tied parameter's second name
    views.emplace_back(name, it->second);
    view_of.erase(it);
  }
  return views;
}

void set_requires_gradient_sync(nn::Module& root, bool sync) { ensure_root(root)->sync = sync; }

double clip_grad_norm_(nn::Module& root, double max_norm) {
  const auto state = ensure_root(root);
  // Each unit's sum over its own pieces, counted by one replica only: the sum over all ranks
  // then holds every element once, whatever mix of sharded and replicated units the root has.
  std::vector<Variable> views;
  double local = 0.0;
  for (const Unit* unit : state->units) {
    views.insert(views.end(), unit->views().begin(), unit->views().end());
    if (unit->groups().first_replica()) local += optim::gradient_sum_of_squares(unit->views());
  }
  Communicator& all = *state->units.front()->groups().base;
  double global = local;
  if (all.size() > 1) {
    const Tensor total = full({1}, local, dtype(DType::f64));
    all.all_reduce(total, ReduceOp::sum, "clip_grad_norm_").wait();
    global = total.item<double>();
  }
  return optim::clip_gradients_to_norm(views, max_norm, std::sqrt(global));
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

// --- the plan -----------------------------------------------------------------------------------

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
  row.persistent_bytes =
      row.shard_elements * (trains ? 4 + 4 : 4) + trained_here * optimizer_state_bytes_per_element;
  row.unsharded_bytes = unit.padded() * static_cast<std::int64_t>(dtype_size(precision.param_dtype));
  row.gathered_through_backward = !unit.reshards_after_forward();
  const Fingerprint gather{.op = Collective::all_gather, .dtype = precision.param_dtype, .count = unit.padded()};
  if (shard_size > 1) {
    row.forward_gathers = 1;
    row.forward_gather_bytes = traffic_of(gather, shard_rank, shard_size).bytes_received;
    if (unit.reshards_after_forward()) {  // gathered again for backward
      row.backward_gathers = 1;
      row.backward_gather_bytes = row.forward_gather_bytes;
    }
    if (trains) {
      row.reduce_scatters = 1;
      row.reduce_bytes =
          traffic_of({.op = Collective::reduce_scatter, .dtype = precision.reduce_dtype, .count = unit.padded()},
                     shard_rank, shard_size)
              .bytes_received;
    }
  }
  if (groups.replica != nullptr && trains) {
    row.all_reduces = 1;
    row.reduce_bytes +=
        traffic_of({.op = Collective::all_reduce, .dtype = precision.reduce_dtype, .count = row.shard_elements},
                   groups.replica->rank(), groups.replica->size())
            .bytes_received;
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
        traffic_of({.op = Collective::all_reduce, .dtype = DType::u8, .count = plan.gradient_flags}, all.rank(),
                   all.size())
            .bytes_received;
  }
  if (root_unit.options().cpu_offload) {
    plan.note =
        root_unit.device().is_cpu()
            ? "cpu offload: nothing to do, parameters and optimizer state are already in host memory"
            : "cpu offload: shards, gradient shards and optimizer state in host memory; copied per gather";
  }
  return plan;
}

std::int64_t Plan::total_persistent_bytes() const {
  std::int64_t total = 0;
  for (const UnitPlan& unit : units) total += unit.persistent_bytes;
  return total;
}

std::int64_t Plan::peak_unsharded_bytes() const {
  // Units gathered through backward add up; of the others, the running unit and `prefetch`
  // more are gathered at once.
  std::int64_t total = 0;
  std::vector<std::int64_t> sizes;
  for (const UnitPlan& unit : units) {
    if (unit.gathered_through_backward) {
      total += unit.unsharded_bytes;
    } else {
      sizes.push_back(unit.unsharded_bytes);
    }
  }
  std::sort(sizes.rbegin(), sizes.rend());
  for (std::size_t i = 0; i < sizes.size() && i < static_cast<std::size_t>(1 + prefetch); ++i) total += sizes[i];
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
                      "params", "pad", "shard/rank", "persist B", "unshard B", "fwd AG B", "bwd AG B", "reduce B",
                      "frozen", "sharding");
  for (const UnitPlan& unit : units) {
    text += fmt::format("{:<16} {:>10} {:>7} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10}\n",
                        unit.name.empty() ? "(root)" : unit.name, unit.parameters, unit.padding,
                        unit.shard_elements, unit.persistent_bytes, unit.unsharded_bytes,
                        unit.forward_gather_bytes, unit.backward_gather_bytes, unit.reduce_bytes, unit.frozen,
                        unit.sharding);
  }
  if (!note.empty()) text += note + "\n";
  if (flag_bytes > 0) {
    text += fmt::format("gradient flags: one all-reduce of {} B per step (which of {} parameters had a gradient)\n",
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
    if (unit.frozen < unit.parameters) total += unit.unsharded_bytes;  // the gradient has the parameters' dtype
  }
  return total;
}

}  // namespace shardlab::dist
