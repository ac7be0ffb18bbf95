// optim/optimizer.h: optimizers over named parameters in groups, with PyTorch's update rules,
// defaults and param_groups. An optimizer reads each parameter's .grad() and updates its tensor
// in place; parameters without a gradient (frozen, or unused this step) are skipped and keep no
// state. Under FSDP the parameters are each rank's slices of the flat shards, so the state
// (momentum, Adam m and v) exists for the local shard only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "autograd/variable.h"
#include "nn/module.h"

namespace shardlab::optim {

// Parameters that share hyper-parameters (PyTorch's param_groups). Setting a field the optimizer
// type does not have is an error. Groups may be empty (a rank may hold no element of them).
//
//   optim::AdamW opt({{.parameters = decayed}, {.parameters = plain, .weight_decay = 0.0}},
//                    {.lr = 3e-4, .weight_decay = 0.1});
struct ParamGroup {
  nn::Named<Variable> parameters;
  // Overrides of the optimizer's options for this group; unset fields take the options passed
  // to the optimizer.
  std::optional<double> lr, weight_decay;
  std::optional<double> momentum, dampening;  // SGD
  std::optional<bool> nesterov;               // SGD
  std::optional<double> beta1, beta2, eps;    // Adam, AdamW (eps also Adadelta)
  std::optional<double> rho;                  // Adadelta
};

// --- for the optimizer types: what they tell the Optimizer base and what it hands them ---------

// An optimizer type's hyper-parameters: their names as ParamGroup and the state dict spell them,
// "lr" first; their values in the options passed to the constructor (a flag as 0 or 1), which
// `flags` marks; and the check of one group's values, whose errors start with `context` ("AdamW",
// or "AdamW: group 1" when there are several groups).
struct HyperParameters {
  std::vector<std::string> names;
  std::vector<double> defaults;
  std::vector<bool> flags;
  std::function<void(std::span<const double> values, const std::string& context)> check;
};

// One parameter that step() updates: the Variable, its tensor, its gradient (in the parameter's
// dtype and shape), its state slots (created by the optimizer type on first use; the slot "step"
// is the base class's), its number of updates counting this one (1 on its first), its group's
// hyper-parameter values when the step was taken (a scheduler may change them while an update
// runner still holds the update), and the gate of step_if (undefined for step(): always applied).
struct ParamUpdate {
  Variable variable;
  Tensor param, grad;
  std::map<std::string, Tensor>& state;
  std::int64_t step;
  std::vector<double> hyper;
  Tensor apply;
};

// Runs the updates of each step() and step_if(). Without one, the optimizer applies them at once,
// in one pass; dist::overlap_host_step installs one that applies them later on a host thread,
// unit by unit. While a runner holds updates, the optimizer's own calls wait for them first (all
// but zero_grad(set_to_none = true) and the lr setters, which they do not touch).
// An optimizer type's update rule: a function of the updates alone (it may run on an
// UpdateRunner's thread), each parameter updated only where its gate, if defined, holds.
using UpdateRule = std::function<void(std::span<const ParamUpdate> updates)>;

class UpdateRunner {
 public:
  virtual ~UpdateRunner() = default;
  // Applies `rule` to every entry of `updates` exactly once, in calls grouping them as it
  // chooses, now or later. Their gates are as step_if was given it: place_gates puts a copy on
  // each parameter's device.
  virtual void run(std::vector<ParamUpdate> updates, UpdateRule rule) = 0;
  // Returns once every update run() was given has been applied; rethrows an error it raised.
  virtual void wait() = 0;
};

// Gives each update's gate on its parameter's device, one copy per device (a host wait when one
// goes from a GPU to the host).
void place_gates(std::span<ParamUpdate> updates);

//   optim::AdamW opt(model->named_parameters(), {.lr = 3e-4});
//   loss.backward();
//   opt.step();
//   opt.zero_grad();
class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient, all of them validated first. Runs without
  // recording a graph. A gradient of another dtype is cast to the parameter's; its shape must be
  // the parameter's.
  void step();
  // step() decided on the device: the update happens only where `apply` (a one-element bool
  // tensor, e.g. "the step's loss and gradient norm are finite" computed on the GPU) is true, and
  // the host never reads it, so nothing waits for a GPU (a gate on another device than a
  // parameter's is copied there first: a host wait when it goes from a GPU to the host). The
  // update counts move on now, as if it applied; settle_step() must follow before the optimizer
  // steps or hands out its state again: settle_step(false) takes the counts back and drops the
  // state of parameters this was the first update of, so that a skipped step leaves no trace.
  //
  //   opt.step_if(isfinite(loss));
  //   ... queue the next step's forward and backward, then read the loss ...
  //   opt.settle_step(std::isfinite(loss_on_host));
  void step_if(const Tensor& apply);
  void settle_step(bool applied);
  // Who applies the updates from the next step on (null: the optimizer, at once). The runner
  // replaced is waited for first.
  void set_update_runner(std::shared_ptr<UpdateRunner> runner);
  // Returns once the updates of the steps taken so far are applied (at once without a runner).
  void wait_for_updates() const;
  // Drops every parameter's gradient (set_to_none, PyTorch's default) or fills it with zeros.
  void zero_grad(bool set_to_none = true);
  // How long this optimizer's update takes per element on `device`: its update rule, with group 0's
  // hyper-parameters, timed on a scratch f32 parameter of `elements` (its state made by a first call,
  // then a few calls; on a GPU the slope from there to 16 times as many elements, without the launches'
  // and the wait's fixed time). The parameters and the state are not touched. For a predicted step time.
  double update_seconds_per_element(Device device, std::int64_t elements = std::int64_t{1} << 20) const;

  std::size_t num_groups() const { return groups_.size(); }
  // A group's parameters, in the order given.
  const nn::Named<Variable>& group_parameters(std::size_t group) const;
  // A group's current learning rate (schedulers change it); lr() is group 0's, the only one of an
  // optimizer built from a plain parameter list.
  double lr(std::size_t group = 0) const;
  void set_lr(std::size_t group, double lr);  // lr >= 0
  void set_lr(double lr);                     // every group's
  // Calls of step() so far.
  std::int64_t steps() const { return steps_; }

  // The state as tensors. Per parameter "<parameter>.<slot>" (e.g. "fc1.weight.exp_avg"), for the
  // parameters updated so far only: the slot "step" (an i64 CPU scalar, the one slot not on the
  // parameter's device: its own update count, PyTorch's state["step"], which drives Adam's bias
  // correction) and the slots of the optimizer type, in the parameter's dtype and device. Per
  // group "param_groups.<g>.<name>" (f64 scalars): every hyper-parameter of the type with the
  // group's current value (a flag as 0 or 1), and "initial_lr" once a scheduler recorded it. Last
  // "step" (an i64 scalar, steps()). The slot tensors are the live state, not copies: save them
  // before the next step().
  nn::StateDict state_dict() const;
  // The per-element slots update() keeps for `parameter` (its keys in state_dict() besides "step"
  // once it is updated: Adam's exp_avg and exp_avg_sq, ...); nullopt for a name the optimizer does
  // not hold. What a checkpoint will hold, known before the first step.
  std::optional<std::vector<std::string>> state_slots(const std::string& parameter) const;
  // Replaces the whole state and every group's hyper-parameters (as PyTorch, the loaded ones win)
  // with copies of `state`, slots converted to each parameter's dtype and device. Every key must
  // name a parameter and a slot of its group, or a group of this optimizer and a hyper-parameter
  // of its type; every group needs all its hyper-parameters, each updated parameter all its slots;
  // shapes must match and values pass the constructor's checks. On any error nothing is changed.
  void load_state_dict(const nn::StateDict& state);

 protected:
  // Every parameter must be a defined, floating leaf with a unique name, no Variable may appear
  // twice (under two names or in two groups), and there must be at least one parameter; groups
  // may be empty. Frozen parameters (requires_grad false) are accepted, as in PyTorch: like any
  // other, one is updated only when it has a gradient. Each group's options are resolved from
  // `hyper` and its overrides, then checked.
  // Errors name the optimizer type, and the group and parameter concerned.
  Optimizer(std::vector<ParamGroup> groups, HyperParameters hyper, std::string type_name);

  // A group's hyper-parameter values, in the order of HyperParameters::names (the lr current).
  std::span<const double> hyper_values(std::size_t group) const;

  // The type's update rule, given the parameters that have a gradient this step (one entry each,
  // group by group), or a part of them when an UpdateRunner splits the step.
  virtual UpdateRule update_rule() const = 0;
  // The slots update() keeps for every parameter of a group with these hyper-parameter values,
  // for load_state_dict's checks.
  virtual std::vector<std::string> slot_names(std::span<const double> hyper_values) const = 0;

 private:
  friend class LRScheduler;  // records and reads initial_lrs()

  struct Group {
    nn::Named<Variable> parameters;
    std::vector<double> hyper;
    // The lr when the first scheduler attached: the base of every later scheduler on this
    // optimizer, as PyTorch's param_group["initial_lr"], so a scheduler created after another
    // has moved the lr (SequentialLR's parts) still starts from the original lr.
    std::optional<double> initial_lr;
  };

  std::size_t checked_group(std::size_t group) const;  // the index, or an Error naming it
  // Throws when a step_if waits for its settle_step; `what` names the call refused.
  void check_settled(const char* what) const;
  // step() and step_if(): the gate undefined for step().
  void step_gated(const Tensor& apply);
  // What errors about a group start with: the type alone when there is one group.
  std::string group_context(std::size_t group) const;
  // Every group's initial_lr, recording the current lr for groups without one.
  std::vector<double> initial_lrs();

  std::string type_name_;
  HyperParameters hyper_;
  std::vector<Group> groups_;
  std::map<std::string, std::size_t> group_of_;  // by parameter name
  std::int64_t steps_ = 0;
  std::map<std::string, std::map<std::string, Tensor>> state_;  // by parameter name
  // After step_if, until settle_step: the parameters whose counts it moved on.
  std::optional<std::vector<std::string>> unsettled_;
  std::shared_ptr<UpdateRunner> runner_;
};

// What every optimizer type has and depends only on its options struct: construction from a
// parameter list (one group) or from groups, and each group's resolved options.
template <typename Options>
class OptimizerWith : public Optimizer {
 public:
  OptimizerWith(nn::Named<Variable> parameters, Options options);
  OptimizerWith(std::vector<ParamGroup> groups, Options options);
  // A group's resolved options, its current lr included.
  Options options(std::size_t group = 0) const;
};

// PyTorch's SGD: g += weight_decay * p; with momentum, buf = g on a parameter's first update
// and buf = momentum * buf + (1 - dampening) * g after; g = nesterov ? g + momentum * buf : buf;
// p -= lr * g. Slot: "momentum_buffer" (only in groups with momentum).
struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // L2: added to the gradient
  bool nesterov = false;
};
class SGD final : public OptimizerWith<SGDOptions> {
 public:
  using OptimizerWith::OptimizerWith;

 protected:
  UpdateRule update_rule() const override;
  std::vector<std::string> slot_names(std::span<const double> hyper_values) const override;
};

// PyTorch's Adam: g += weight_decay * p; m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
// p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps). Slots: "exp_avg", "exp_avg_sq".
// One fused pass over all parameters (core's multi-segment adam_step).
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // Adam: L2 added to the gradient; AdamW: decoupled, lr * wd * param
};
class Adam final : public OptimizerWith<AdamOptions> {
 public:
  using OptimizerWith::OptimizerWith;

 protected:
  UpdateRule update_rule() const override;
  std::vector<std::string> slot_names(std::span<const double> hyper_values) const override;
};

// PyTorch's AdamW: p *= 1 - lr * weight_decay, then Adam's update without weight decay.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};
class AdamW final : public OptimizerWith<AdamWOptions> {
 public:
  using OptimizerWith::OptimizerWith;

 protected:
  UpdateRule update_rule() const override;
  std::vector<std::string> slot_names(std::span<const double> hyper_values) const override;
};

// PyTorch's Adadelta: g += weight_decay * p; s = rho s + (1 - rho) g^2;
// delta = sqrt(a + eps) / sqrt(s + eps) * g; a = rho a + (1 - rho) delta^2; p -= lr * delta.
// Slots: "square_avg", "acc_delta". One fused pass over all parameters (core's adadelta_step).
struct AdadeltaOptions {
  double lr = 1.0;
  double rho = 0.9;
  double eps = 1e-6;
  double weight_decay = 0.0;
};
class Adadelta final : public OptimizerWith<AdadeltaOptions> {
 public:
  using OptimizerWith::OptimizerWith;

 protected:
  UpdateRule update_rule() const override;
  std::vector<std::string> slot_names(std::span<const double> hyper_values) const override;
};

// Turns a local sum of squares (a one-element f64 tensor) into the global one.
using SumCombiner = std::function<Tensor(const Tensor& local)>;

// Scales all gradients so their global norm is at most max_norm and returns the norm before
// clipping, as a one-element f64 tensor on the parameters' device (the first one's), as PyTorch
// does: nothing in it makes the host wait for a GPU; reading the result (item<double>()) does, so
// read it after the step. As PyTorch: the factor is max_norm / (norm + 1e-6), applied when below 1;
// the sum of squares is accumulated in double; variables without a gradient are skipped;
// max_norm > 0. Sharded parameters (a sharded module's named_parameters()) count with their whole
// gradient: the shards' sums are added over the ranks that hold them (a collective, which every
// such rank must call with the same list). `combine` (none: the identity) turns the local sum over
// the other, whole, parameters into the global one (DDP passes an average). Both are called also
// when no gradient is defined, so that every rank joins the collectives.
Tensor clip_grad_norm_(const std::vector<Variable>& parameters, double max_norm,
                       const SumCombiner& combine = {});

// clip_grad_norm_ whose norm has the same bits however the gradients are split over ranks (FSDP's
// bitwise training, FsdpOptions::bitwise): every element's square added exactly (core/exact_sum.h:
// the square of an f32 is exact in a double, the sum kept in integer limbs), the limbs summed over the
// ranks as clip_grad_norm_ sums (the combiner and the shards' ranks get the limbs, i64 [kExactLimbs]),
// rounded once; the gradients are then clipped to it as clip_grad_norm_ does. CPU gradients only.
Tensor clip_grad_norm_exact(const std::vector<Variable>& parameters, double max_norm,
                            const SumCombiner& combine = {});
// Its norm alone, a one-element f64 tensor: for a caller that reports the norm and does not clip.
Tensor gradient_norm_exact(const std::vector<Variable>& parameters, const SumCombiner& combine = {});

// clip_grad_norm_'s two halves, for callers that combine sums their own way. The sum of the
// squared gradients of the variables that have one, here, in double (core's foreach_sum_squares:
// one pass, one launch per device on a GPU), as a one-element f64 tensor on their device (on
// `if_none` for an empty list: a rank holding nothing to count still answers on its GPU, so no
// zero is copied up from the host inside a step):
Tensor gradient_sum_of_squares(const std::vector<Variable>& parameters, Device if_none = Device::cpu());
// Scales the gradients by max_norm / (norm + 1e-6) when that is below 1 (a NaN norm makes them
// NaN, as in PyTorch) and returns norm; max_norm > 0. Norm stays on its device: no host wait.
Tensor clip_gradients_to_norm(const std::vector<Variable>& parameters, double max_norm, const Tensor& norm);

}  // namespace shardlab::optim
