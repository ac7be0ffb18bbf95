// optim/optimizer.h: optimizers over named parameters, with PyTorch's update rules and
// defaults. An optimizer reads each parameter's .grad() and updates its tensor in place;
// parameters without a gradient are skipped. Under FSDP the "parameters" are the flat
// shards, so the state (momentum, Adam m and v) exists for the local shard only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/variable.h"
#include "nn/module.h"

namespace shardlab::optim {

//   optim::AdamW opt(model->named_parameters(), {.lr = 3e-4});
//   loss.backward();
//   opt.step();
//   opt.zero_grad();
class Optimizer {
 public:
  // Every parameter must be a defined, floating, grad-requiring leaf with a unique name, and
  // the list must not be empty; lr >= 0. Errors name the optimizer type and the parameter.
  Optimizer(nn::Named<Variable> parameters, double lr, std::string type_name);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient. Runs without recording a graph. A
  // gradient of another dtype is cast to the parameter's; its shape must be the parameter's.
  void step();
  // Drops every parameter's gradient (set_to_none, PyTorch's default) or fills it with zeros.
  void zero_grad(bool set_to_none = true);

  // The current learning rate (schedulers change it); options.lr of a subclass is the initial one.
  double lr() const { return lr_; }
  void set_lr(double lr);  // lr >= 0
  const nn::Named<Variable>& parameters() const { return parameters_; }
  // Calls of step() so far.
  std::int64_t steps() const { return steps_; }

  // The per-parameter state as tensors named "<parameter>.<slot>" (e.g. "fc1.weight.exp_avg")
  // plus "step" (an i64 scalar, steps()). Parameters that were never updated have no entries.
  // Every updated parameter has the slot "step" (an i64 CPU scalar, the one slot not on the
  // parameter's device: its own update count, PyTorch's state["step"], which drives Adam's bias
  // correction) and the slots of the optimizer type, in the parameter's dtype and device.
  // The slot tensors are the live state, not copies: save them before the next step().
  nn::StateDict state_dict() const;
  // Replaces the whole state with copies of `state`, converted to each parameter's dtype and
  // device. Every key must name a parameter and a slot of this optimizer type, each updated
  // parameter must have all its slots, shapes must match; on any error nothing is changed.
  void load_state_dict(const nn::StateDict& state);

 protected:
  // Updates one parameter in place; `state` holds its slots (created on first use by the
  // subclass; the slot "step" belongs to the base class). `step` counts this parameter's
  // updates, this one included (1 on its first).
  virtual void update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
                      std::int64_t step) = 0;
  // The slots update() keeps for every parameter, for load_state_dict's checks.
  virtual std::vector<std::string> slot_names() const = 0;

 private:
  friend class LRScheduler;  // reads and records initial_lr_

  std::string type_name_;
  nn::Named<Variable> parameters_;
  double lr_;
  std::int64_t steps_ = 0;
  std::map<std::string, std::map<std::string, Tensor>> state_;  // by parameter name
  // The lr when the first scheduler attached: the base of every later scheduler on this
  // optimizer, as PyTorch's param_group["initial_lr"], so a scheduler created after another
  // has moved the lr (SequentialLR's parts) still starts from the original lr.
  std::optional<double> initial_lr_;
};

// PyTorch's SGD: g += weight_decay * p; with momentum, buf = g on a parameter's first update
// and buf = momentum * buf + (1 - dampening) * g after; g = nesterov ? g + momentum * buf : buf;
// p -= lr * g. Slot: "momentum_buffer" (only with momentum).
struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // L2: added to the gradient
  bool nesterov = false;
};
class SGD final : public Optimizer {
 public:
  SGD(nn::Named<Variable> parameters, SGDOptions options);
  const SGDOptions options;

 protected:
  void update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
              std::int64_t step) override;
  std::vector<std::string> slot_names() const override;
};

// PyTorch's Adam: g += weight_decay * p; m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
// p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps). Slots: "exp_avg", "exp_avg_sq".
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // Adam: L2 added to the gradient; AdamW: decoupled, lr * wd * param
};
class Adam final : public Optimizer {
 public:
  Adam(nn::Named<Variable> parameters, AdamOptions options);
  const AdamOptions options;

 protected:
  void update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
              std::int64_t step) override;
  std::vector<std::string> slot_names() const override;
};

// PyTorch's AdamW: p *= 1 - lr * weight_decay, then Adam's update without weight decay.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};
class AdamW final : public Optimizer {
 public:
  AdamW(nn::Named<Variable> parameters, AdamWOptions options);
  const AdamWOptions options;

 protected:
  void update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
              std::int64_t step) override;
  std::vector<std::string> slot_names() const override;
};

// PyTorch's Adadelta: g += weight_decay * p; s = rho s + (1 - rho) g^2;
// delta = sqrt(a + eps) / sqrt(s + eps) * g; a = rho a + (1 - rho) delta^2; p -= lr * delta.
// Slots: "square_avg", "acc_delta".
struct AdadeltaOptions {
  double lr = 1.0;
  double rho = 0.9;
  double eps = 1e-6;
  double weight_decay = 0.0;
};
class Adadelta final : public Optimizer {
 public:
  Adadelta(nn::Named<Variable> parameters, AdadeltaOptions options);
  const AdadeltaOptions options;

 protected:
  void update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
              std::int64_t step) override;
  std::vector<std::string> slot_names() const override;
};

// Scales all gradients so their global norm is at most max_norm and returns the norm before
// clipping. As PyTorch: the factor is max_norm / (norm + 1e-6), applied when below 1; the sum
// of squares is accumulated in double; variables without a gradient are skipped; max_norm > 0. `combine`
// turns the local sum of squared gradients into the global one: the identity for one process; FSDP passes an
// all-reduce over the shards. It is called exactly once, also when no gradient is defined, so that every rank
// joins the collective.
double clip_grad_norm_(
    const std::vector<Variable>& parameters, double max_norm,
    const std::function<double(double)>& combine = [](double local) { return local; });

// clip_grad_norm_'s two halves, for callers that combine sums their own way (FSDP counts each
// replicated shard once). The sum of the squared gradients of the variables that have one, in
// double (bf16/f16 gradients reduced in f32):
double gradient_sum_of_squares(const std::vector<Variable>& parameters);
// Scales the gradients by max_norm / (norm + 1e-6) when that is below 1 (a NaN norm makes them
// NaN, as in PyTorch) and returns norm; max_norm > 0.
double clip_gradients_to_norm(const std::vector<Variable>& parameters, double max_norm, double norm);

}  // namespace shardlab::optim
