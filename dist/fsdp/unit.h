// dist/fsdp/unit.h: internal to dist/: FSDP's internals, shared by the sources of dist/fsdp/ and by no one
// else: a unit's communicators and parameter slots, the Unit with its hooks, the state of one root's units,
// and the registry of live units.
#pragma once

#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/binned_sum.h"
#include "core/trace.h"
#include "dist/comm/work.h"
#include "dist/fsdp/fsdp.h"

namespace shardlab::dist::detail {

// The ranks a unit shards over and the ranks it replicates over (null when a group has one
// rank), shared by all units made with the same communicator and strategy.
struct Groups {
  Communicator* base = nullptr;  // every rank that trains the unit: shard groups x replicas
  Communicator* shard = nullptr;
  Communicator* replica = nullptr;
  std::unique_ptr<Communicator> owned_shard, owned_replica;

  // Groups of `size` consecutive ranks of the shard group (reshard_after_forward_group), split once
  // per size: a collective over the shard group the first time.
  std::map<int, std::unique_ptr<Communicator>> post_forward;
  Communicator& post_forward_group(int size);

  int shard_size() const { return shard ? shard->size() : 1; }
  int shard_rank() const { return shard ? shard->rank() : 0; }
  // Whether this rank's copy of the unit's shard is the one that counts in sums over all ranks
  // (a replicated shard would be counted once per replica otherwise).
  bool first_replica() const { return replica == nullptr || replica->rank() == 0; }
};

// The sizes of the shard group and the replica group `sharding` makes among `world` ranks (hybrid: groups
// of `group_size`, which the caller checked divides `world`); 1 where a group has one rank.
struct GroupSizes {
  int shard = 1, replica = 1;
};
GroupSizes group_sizes(Sharding sharding, int group_size, int world);
// Whether a unit of `options` gathers its parameters again for backward, unless it is the root.
bool reshards_after_forward(const FsdpOptions& options);

// The groups of `sharding` over `base`, shared by the units made with the same arguments.
std::shared_ptr<Groups> groups_for(Communicator& base, Sharding sharding, int group_size);
// Sums over every rank of `base` (an all-reduce of one f64 on `device`): the ranks of the shards
// of every unit trained by `base` on this device, shared so that clipping sums once for them all.
std::shared_ptr<const ShardRanks> ranks_of(Communicator& base, Device device);

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
// Reduce-scatters a backward leaves in flight: when a unit starts its own, the oldest beyond these
// is waited for and its unsharded gradient freed (FSDP2 keeps one in flight). So a backward holds
// the unsharded gradients of at most this many units and the one it computes, not of every unit.
inline constexpr std::size_t kReductionsInFlight = 2;

struct RootState {
  nn::Module* root = nullptr;
  std::vector<Unit*> units;
  std::vector<Unit*> forward_order, backward_order;
  bool forward_recorded = false, backward_recorded = false;
  bool callback_queued = false;
  bool sync = true;
  bool all_reduce = true;  // set_requires_all_reduce
  Communicator* mesh_ranks = nullptr;  // place_in_mesh's `all`: the ranks of the whole model

  // The units whose reduce-scatter runs, oldest first (kReductionsInFlight).
  std::deque<Unit*> reductions_in_flight;

  // A unit started its reduce-scatter: the oldest beyond kReductionsInFlight frees its input.
  void reduction_started(Unit* unit);
  void finish_backward();
  // A backward that threw before its end (its callbacks never ran): the units drop its partial
  // gradients, as zero_grad would, and are ready for the next step.
  void abandon_backward();
  // Closes the cost labels a forward or backward that threw left open on this thread (every unit's).
  void close_stale_cost_labels();
  // One all-reduce (max) over all ranks of the flags "this parameter got a gradient since the
  // last reduction" of every unit reducing now; returns them, agreed, in unit and slot order.
  std::vector<std::uint8_t> agree_on_gradients(const std::vector<Unit*>& reducing) const;
  void end_step();  // every unit's Unit::end_step
  // Every unit's Unit::wait_for_host_update: the shards hold the optimizer's last step.
  void wait_for_host_updates() const;
  // Offloaded from a GPU: the host waits for the offload copies queued so far (dist/fsdp/offload.h).
  void wait_for_offload_copies() const;
};

// The part of one parameter in this rank's shard: its elements [from, from + count), at `at` in
// the shard; count 0 when the rank holds none of them.
struct Piece {
  std::int64_t from = 0, count = 0, at = 0;
};

// The flat length of `parameters` elements padded with zeros to divide among `shard_size` ranks.
std::int64_t padded_length(std::int64_t parameters, int shard_size);
// The part of `slot` in the shard of `shard_rank`, each shard `shard_elements` long.
Piece piece_of(const Slot& slot, int shard_rank, std::int64_t shard_elements);

// stale: the bytes are there, but the shard changed since they were gathered (Sharding::optimizer
// between steps): the next gather refreshes them in place.
enum class Gathered : std::uint8_t { no, in_flight, yes, stale };

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
  // This rank's piece of each slot as a trainable Variable, slot order: what the module registers
  // under the parameter's names after fully_shard (Variable::shard_info says what it is part of).
  const std::vector<Variable>& sharded_parameters() const { return sharded_parameters_; }
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
  // CPU offload from a GPU: the shards and the optimizer state in the host's pinned memory.
  bool offloads() const { return shard_device_ != device_; }
  // Whether the parameters are gathered again for backward (FULL_SHARD's second all-gather).
  bool reshards_after_forward() const { return reshard_after_forward_ && !is_root(); }
  // The group that gathers them for backward when reshard_after_forward_group keeps a slice of them
  // from forward to backward (null otherwise).
  Communicator* post_forward_group() const { return post_forward_group_; }
  // Whether some parameter trains (requires grad): read from the registered shards each time,
  // since users freeze and unfreeze between steps.
  bool trains() const;
  Piece piece(const Slot& slot) const;
  bool reducing() const { return reducing_; }
  // Waits for the reduce-scatter and frees its input, the unsharded gradient, before the end of the
  // backward; the replica all-reduce and the gradient shard still wait for collect_gradient.
  void release_reduce_input();
  // This rank's "got a gradient since the last reduction" flags, one per slot.
  const std::vector<std::uint8_t>& gradient_flags() const { return got_gradient_; }
  // Between its pre-backward and its post-backward: its gradients still read the gathered parameters.
  bool in_backward() const { return backward_started_ && !reduced_; }
  // set_modules_to_forward_prefetch / set_modules_to_backward_prefetch.
  void set_forward_prefetch(std::vector<std::weak_ptr<Unit>> units) { forward_prefetch_ = std::move(units); }
  void set_backward_prefetch(std::vector<std::weak_ptr<Unit>> units) {
    backward_prefetch_ = std::move(units);
  }
  bool has_prefetch_lists() const { return forward_prefetch_.has_value() || backward_prefetch_.has_value(); }
  void set_reshard_after_backward(bool reshard) { reshard_after_backward_ = reshard; }
  bool reshards_after_backward() const { return reshard_after_backward_; }
  // set_gradient_divide_factor: the reductions sum, and the reduced shard is divided by `factor`.
  void set_gradient_divide_factor(double factor);
  void set_force_sum_reduction(bool force_sum);
  void set_all_reduce_hook(AllReduceHook hook) { all_reduce_hook_ = std::move(hook); }
  // set_reshard_after_backward(false) in a micro-step without gradient sync: gathered until the next forward.
  bool keeps_after_backward() const { return !reshard_after_backward_ && root_ && !root_->sync; }

  void join_root(std::shared_ptr<RootState> root, std::string name);
  void install_hooks();

  void pre_forward(nn::ForwardInputs& inputs);
  void post_forward(Variable& output);
  void pre_backward();
  void on_gradient_accumulated(std::size_t slot);
  void on_input_gradient();
  void post_backward();
  void flush_backward();  // from the root's end-of-backward callback, before finish_backward
  // With the others' at the end of backward: waits for the reduction and makes the gradient shard
  // (copied to the host when offloaded), which finish_backward then gives the parameters.
  void collect_gradient();
  void finish_backward(const std::uint8_t* agreed_flags);
  void abandon_backward();
  void close_stale_cost_labels();
  void close_backward_cost_label();
  // Why an all-gather runs: it names the collective (ledger tag, trace span) "pre-forward fc1",
  // "pre-backward fc1" or "unshard fc1" (dist::unshard), so the two gathers of a step differ.
  enum class GatherFor { forward, backward, caller };
  void unshard(GatherFor purpose);
  void wait_unshard();
  void reshard();
  // After forward: frees the gathered parameters, keeping this rank's slice of them for the
  // post-forward group's all-gather in backward when there is one.
  void reshard_after_forward();
  // The step's end: frees the gathered parameters, or with Sharding::optimizer keeps them, stale.
  void end_step();
  // Sharding::optimizer: parameters and unsharded gradient stay whole between steps.
  bool whole_between_steps() const { return options_.sharding == Sharding::optimizer; }
  // The unit's backward span on the trace, from its pre-backward to now: at post-backward, or for
  // the root (whose span holds the others') once the whole backward finished.
  void trace_backward_end();
  Tensor full_shard_values() const;  // the flat f32 parameters [padded], gathered from the shards
  // dist::overlap_host_step: the optimizer's update of this unit's shard, running on the host step
  // thread. Gathering and full_shard_values wait for it first; a failed update is rethrown there, once.
  void set_host_update(std::shared_future<void> update) { host_update_ = std::move(update); }
  void wait_for_host_update() const;

 private:
  Tensor gathered() const {
    return Tensor(storage_, {padded_}, {1}, 0, options_.mixed_precision.param_dtype);
  }
  void prefetch(const std::optional<std::vector<std::weak_ptr<Unit>>>& listed,
                const std::vector<Unit*>& order, bool recorded, GatherFor purpose);
  ShardInfo shard_info(const Slot& slot) const;
  void sync_computed_with();
  void prepare_gradients();
  Tensor gradient_slice(const Slot& slot) const;
  void zero_unwritten_gradients();
  void drop_gradient_views();
  // Backwards without sync add their gradient in reduce_dtype where it differs from param_dtype.
  bool accumulates_in_reduce_dtype() const;
  void accumulate_in_reduce_dtype();
  void start_reduction();
  // What the reduced shard is divided by after collectives that sum (a divide factor, or forced sums
  // outside bitwise, whose reduction is a sum by design); none where they average.
  std::optional<double> post_divisor() const;
  ReduceOp reduce_op() const { return post_divisor() ? ReduceOp::sum : ReduceOp::avg; }
  // Refuses a change of how the unit divides while partial_sum_ holds shards reduced the old way.
  void check_no_partial_sum(const char* call) const;
  Tensor reduce_output_in_f32() const;
  // set_requires_all_reduce(false): adds the reduce-scattered shard into partial_sum_, and the
  // parameters wait for their gradient; at the next all-reduce, partial_sum_ joins its input.
  void keep_partial_sum();
  void add_partial_sum();
  void give_gradient_shard(const std::uint8_t* agreed_flags);
  void prepare_binned_gradients();
  void reduce_binned_gradient();
  void drop_binned_gradients();
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
  bool reshard_after_backward_ = true;
  std::int64_t parameters_ = 0, padded_ = 0, shard_elements_ = 0;
  Device device_;        // where the parameters are gathered and computed with
  Device shard_device_;  // where the shards and the optimizer state live (the CPU when offloaded)
  bool deferred_ = false;
  std::string name_;
  std::shared_ptr<RootState> root_;
  Tensor shard_;                              // f32 [S]: the sharded_parameters_ are its pieces
  std::vector<Variable> sharded_parameters_;  // per slot
  // Per slot: requires_grad as last given to the Variable the forward computes with, from its view.
  std::vector<std::uint8_t> computes_with_grad_;
  std::shared_ptr<Storage> storage_;  // the gathered parameters, bytes only while gathered
  Gathered state_ = Gathered::no;
  // Explicit prefetch lists; unset: the next options_.prefetch units of the recorded order.
  std::optional<std::vector<std::weak_ptr<Unit>>> forward_prefetch_, backward_prefetch_;
  Work gather_work_;
  std::uint64_t gather_flow_ = 0;  // the trace's arrow from the all-gather's issue to its wait
  std::string gather_tag_;         // the in-flight all-gather's tag
  // When the trace records: the start of this unit's forward and backward spans.
  std::optional<trace::Clock::time_point> forward_began_, backward_began_;
  // The cost labels (core/op_cost.h) "forward <unit>" and "backward <unit>" this unit has open on the
  // step's thread, so that a step's kernel costs split by unit.
  int forward_labels_open_ = 0;
  bool backward_label_open_ = false;
  std::string cost_label(const char* phase) const;
  Tensor gather_source_;  // the shard cast to param_dtype, alive until its all-gather completed
  Communicator* post_forward_group_ = nullptr;
  // From forward to backward, with a post-forward group: this rank's slice of the gathered parameters.
  Tensor held_;
  void drop_held();
  void free_gathered();  // reshard() without dropping held_
  // The shard as the all-gather sends it: on the device (copied there when offloaded), in param_dtype.
  Tensor shard_in_param_dtype() const;
  std::vector<bool> hooked_;  // per slot: its post-accumulate hook is registered
  // Until the next reduction (several backwards without gradient sync): per slot, whether its
  // gradient was accumulated; and whether the forward ran in grad mode with a parameter that
  // trains, which obliges this rank to join the unit's reduction even if no gradient came.
  std::vector<std::uint8_t> got_gradient_;
  bool owes_reduction_ = false;
  // One backward pass.
  // [padded] in param_dtype; the parameters' .grad (or, before their first gradient, their grad
  // destinations) are views into it.
  Tensor full_grad_;
  // [padded] in reduce_dtype: the gradients of the backwards without sync since the last reduction,
  // where reduce_dtype differs from param_dtype (accumulate_in_reduce_dtype); undefined otherwise.
  Tensor accumulated_;
  // FsdpOptions::bitwise: the order-free sum [padded] that the parameters' gradient parts go into,
  // over every backward until the reduction.
  std::shared_ptr<BinnedSum> binned_;
  bool backward_started_ = false, reduced_ = false, reducing_ = false;
  bool reduce_input_released_ = false;  // release_reduce_input ran this backward
  std::vector<std::uint8_t> counted_;   // per slot: its gradient arrived in this backward
  std::int64_t ready_ = 0, expected_ = 0;
  std::int64_t inputs_marked_ = 0, inputs_done_ = 0;  // since the last finish_backward
  Work reduce_work_;
  Tensor reduce_input_, reduce_output_;
  std::optional<double> divide_factor_;  // set_gradient_divide_factor; unset: the mean
  bool force_sum_ = false;               // set_force_sum_reduction_for_comms
  AllReduceHook all_reduce_hook_;
  // f32 [S]: the reduce-scattered shards of the synced backwards since the last all-reduce over the
  // replicas (set_requires_all_reduce(false)); undefined when none waits.
  Tensor partial_sum_;
  Tensor gradient_shard_;  // f32 [S] on shard_device_, from collect_gradient to finish_backward
  mutable std::shared_future<void> host_update_;  // invalid when none is pending
};

// --- the registry of units -------------------------------------------------------------------

std::shared_ptr<Unit> unit_of(const nn::Module& module);  // null when the module is no unit
std::vector<std::shared_ptr<Unit>> live_units();
void register_unit(const nn::Module& module, const std::shared_ptr<Unit>& unit);
std::string join_name(const std::string& prefix, const std::string& name);
std::string describe_module(const std::string& path, const nn::Module& module);  // for messages
// How traces, tags and messages name a unit: the root's own name is empty.
std::string display_name(const std::string& unit);
// Makes `root` the root of the units in its subtree (once): names them by their path.
std::shared_ptr<RootState> ensure_root(nn::Module& root);

}  // namespace shardlab::dist::detail
