// optim/optimizer.cpp: the Optimizer base (parameter checks, step loop, per-parameter state
// and its state dict), the update rules of SGD, Adam, AdamW and Adadelta, and clip_grad_norm_.
#include "optim/optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "core/ops.h"

namespace shardlab::optim {

namespace {

// Written as !(x >= 0) so that NaN is refused too.
void check_non_negative(const char* optimizer, const char* what, double value) {
  SHARDLAB_CHECK(value >= 0, "{}: invalid {} {} (must be >= 0)", optimizer, what, value);
}

void check_beta(const char* optimizer, const char* what, double value) {
  SHARDLAB_CHECK(value >= 0 && value < 1, "{}: invalid {} {} (must be in [0, 1))", optimizer, what, value);
}

// A state slot of `param`'s dtype and device, zero-filled the first time it is asked for.
const Tensor& zero_slot(std::map<std::string, Tensor>& state, const char* slot, const Tensor& param) {
  auto it = state.find(slot);
  if (it == state.end())
    it = state.emplace(slot, zeros(param.shape(), {param.dtype(), param.device()})).first;
  return it->second;
}

// The slot the base class keeps for every updated parameter: its own number of updates.
constexpr const char* kStepSlot = "step";

Tensor step_tensor(std::int64_t value) { return scalar_tensor(value, dtype(DType::i64)); }

// Adam's moment updates and parameter step shared by Adam and AdamW (weight decay already
// applied by the caller). Follows torch.optim's single-tensor Adam operation for operation:
// denom = sqrt(v) / sqrt(bc2) + eps and step_size = lr / bc1, so results round alike.
// One fused pass (core's adam_step, the op-by-op formula's rounding) instead of a dozen
// elementwise ops and their temporaries over every shard.
template <typename Options>
void adam_update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state, double lr,
                 const Options& options, bool decoupled, std::int64_t step) {
  adam_step(param, grad, zero_slot(state, "exp_avg", param), zero_slot(state, "exp_avg_sq", param),
            {.lr = lr,
             .beta1 = options.beta1,
             .beta2 = options.beta2,
             .eps = options.eps,
             .weight_decay = options.weight_decay,
             .decoupled = decoupled,
             .step = step});
}

// g + weight_decay * p as a new tensor: the parameter's .grad() itself is never modified.
Tensor with_l2(const Tensor& grad, const Tensor& param, double weight_decay) {
  return weight_decay == 0.0 ? grad : add(grad, mul(param, weight_decay));
}

}  // namespace

// --- Optimizer -------------------------------------------------------------------------------

Optimizer::Optimizer(nn::Named<Variable> parameters, double lr, std::string type_name)
    : type_name_(std::move(type_name)), parameters_(std::move(parameters)), lr_(lr) {
  SHARDLAB_CHECK(!parameters_.empty(), "{}: got an empty parameter list", type_name_);
  check_non_negative(type_name_.c_str(), "learning rate", lr);
  std::set<std::string> seen;
  for (const auto& [name, variable] : parameters_) {
    SHARDLAB_CHECK(seen.insert(name).second, "{}: parameter name '{}' appears twice", type_name_, name);
    SHARDLAB_CHECK(variable.defined(), "{}: parameter '{}' is an undefined Variable", type_name_, name);
    SHARDLAB_CHECK(is_floating(variable.dtype()),
                   "{}: parameter '{}' has dtype {}; only floating parameters can be optimized", type_name_,
                   name, dtype_name(variable.dtype()));
    SHARDLAB_CHECK(variable.requires_grad(), "{}: parameter '{}' does not require grad", type_name_, name);
    // A non-leaf never receives a .grad(): optimizing it would silently do nothing.
    SHARDLAB_CHECK(variable.is_leaf(), "{}: parameter '{}' is not a leaf of the graph", type_name_, name);
  }
}

void Optimizer::set_lr(double lr) {
  check_non_negative(type_name_.c_str(), "learning rate", lr);
  lr_ = lr;
}

void Optimizer::step() {
  const NoGradGuard no_grad;
  ++steps_;
  for (const auto& [name, variable] : parameters_) {
    const Tensor& grad = variable.grad();
    if (!grad.defined()) continue;
    const Tensor& param = variable.data();
    // set_grad checks the shape, but FSDP may swap the data (set_data) after the gradient.
    SHARDLAB_CHECK(grad.shape() == param.shape(),
                   "{}.step: gradient of '{}' has shape {} but the parameter has shape {}", type_name_, name,
                   shape_str(grad.shape()), shape_str(param.shape()));
    auto& slots = state_[name];
    auto step_it = slots.find(kStepSlot);
    if (step_it == slots.end()) step_it = slots.emplace(kStepSlot, step_tensor(0)).first;
    // The step tensor is a CPU scalar: counting on the host costs no device round trip.
    const std::int64_t step = ++step_it->second.data<std::int64_t>()[0];
    update(param, grad.dtype() == param.dtype() ? grad : grad.to(param.dtype()), slots, step);
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  for (const auto& [name, variable] : parameters_) variable.zero_grad(set_to_none);
}

nn::StateDict Optimizer::state_dict() const {
  nn::StateDict out;
  for (const auto& [name, variable] : parameters_) {
    const auto it = state_.find(name);
    if (it == state_.end()) continue;
    for (const auto& [slot, tensor] : it->second) out.emplace_back(name + "." + slot, tensor);
  }
  out.emplace_back(kStepSlot, step_tensor(steps_));
  return out;
}

void Optimizer::load_state_dict(const nn::StateDict& state) {
  const std::string where = type_name_ + ".load_state_dict";
  std::vector<std::string> slots = slot_names();
  slots.emplace_back(kStepSlot);
  std::sort(slots.begin(), slots.end());
  const std::string slot_list = fmt::format("{}", fmt::join(slots, ", "));

  std::map<std::string, const Variable*> by_name;
  for (const auto& [name, variable] : parameters_) by_name.emplace(name, &variable);

  // Validate everything before touching state_, so a failed load changes nothing.
  std::set<std::string> seen;
  const Tensor* global_step = nullptr;
  std::map<std::string, std::map<std::string, const Tensor*>> given;  // parameter -> slot -> tensor
  for (const auto& [key, tensor] : state) {
    SHARDLAB_CHECK(seen.insert(key).second, "{}: key '{}' appears twice", where, key);
    SHARDLAB_CHECK(tensor.defined(), "{}: key '{}' holds an undefined tensor", where, key);
    if (key == kStepSlot) {
      global_step = &tensor;
      continue;
    }
    // Parameter names may contain dots ("fc1.weight"); slot names never do.
    const std::size_t dot = key.rfind('.');
    SHARDLAB_CHECK(dot != std::string::npos,
                   "{}: unexpected key '{}' (keys are '<parameter>.<slot>' or 'step')", where, key);
    const std::string name = key.substr(0, dot);
    const std::string slot = key.substr(dot + 1);
    const auto param = by_name.find(name);
    SHARDLAB_CHECK(param != by_name.end(), "{}: unexpected key '{}': no parameter '{}'", where, key, name);
    SHARDLAB_CHECK(std::binary_search(slots.begin(), slots.end(), slot),
                   "{}: unexpected key '{}': {} has no state slot '{}' (its slots: {})", where, key,
                   type_name_, slot, slot_list);
    const Shape expected = slot == kStepSlot ? Shape{} : param->second->shape();
    SHARDLAB_CHECK(tensor.shape() == expected,
                   "{}: key '{}' has shape {} in the state dict but {} in the optimizer", where, key,
                   shape_str(tensor.shape()), shape_str(expected));
    if (slot == kStepSlot) {
      SHARDLAB_CHECK(tensor.item<double>() >= 0, "{}: key '{}' holds a negative step count {}", where, key,
                     tensor.item<double>());
    }
    given[name][slot] = &tensor;
  }
  SHARDLAB_CHECK(global_step != nullptr, "{}: missing key 'step'", where);
  SHARDLAB_CHECK(global_step->shape().empty(),
                 "{}: key 'step' has shape {} in the state dict but [] in the optimizer", where,
                 shape_str(global_step->shape()));
  SHARDLAB_CHECK(global_step->item<double>() >= 0, "{}: key 'step' holds a negative step count {}", where,
                 global_step->item<double>());
  for (const auto& [name, present] : given) {
    for (const std::string& slot : slots) {
      SHARDLAB_CHECK(present.contains(slot), "{}: missing key '{}.{}' (expected shape {})", where, name, slot,
                     shape_str(slot == kStepSlot ? Shape{} : by_name.at(name)->shape()));
    }
  }

  // Copies, so that the caller's tensors (often another optimizer's live state) stay apart.
  std::map<std::string, std::map<std::string, Tensor>> loaded;
  for (const auto& [name, present] : given) {
    const Tensor& param = by_name.at(name)->data();
    for (const auto& [slot, source] : present) {
      if (slot == kStepSlot) {
        loaded[name][slot] = step_tensor(source->item<std::int64_t>());
      } else {
        loaded[name][slot] = empty(param.shape(), {param.dtype(), param.device()});
        loaded[name][slot].copy_(*source);
      }
    }
  }
  state_ = std::move(loaded);
  steps_ = global_step->item<std::int64_t>();
}

// --- SGD -------------------------------------------------------------------------------------

namespace {
SGDOptions checked(SGDOptions options) {
  check_non_negative("SGD", "momentum", options.momentum);
  check_non_negative("SGD", "weight_decay", options.weight_decay);
  // Nesterov's look-ahead is defined on the undamped buffer (PyTorch refuses the rest too).
  SHARDLAB_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
                 "SGD: nesterov needs momentum > 0 and dampening == 0 (got momentum {}, dampening {})",
                 options.momentum, options.dampening);
  return options;
}
}  // namespace

SGD::SGD(nn::Named<Variable> parameters, SGDOptions options)
    : Optimizer(std::move(parameters), options.lr, "SGD"), options(checked(options)) {}

std::vector<std::string> SGD::slot_names() const {
  if (options.momentum == 0.0) return {};
  return {"momentum_buffer"};
}

void SGD::update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
                 std::int64_t) {
  Tensor direction = with_l2(grad, param, options.weight_decay);
  if (options.momentum != 0.0) {
    auto it = state.find("momentum_buffer");
    if (it == state.end()) {
      // Cloned: the buffer is updated in place later and must not alias .grad().
      it = state.emplace("momentum_buffer", direction.clone()).first;
    } else {
      add_(mul_(it->second, options.momentum), mul(direction, 1.0 - options.dampening));
    }
    const Tensor& buffer = it->second;
    direction = options.nesterov ? add(direction, mul(buffer, options.momentum)) : buffer;
  }
  sub_(param, mul(direction, lr()));
}

// --- Adam ------------------------------------------------------------------------------------

namespace {
template <typename Options>
Options checked_adam(const char* name, Options options) {
  check_beta(name, "beta1", options.beta1);
  check_beta(name, "beta2", options.beta2);
  check_non_negative(name, "eps", options.eps);
  check_non_negative(name, "weight_decay", options.weight_decay);
  return options;
}
}  // namespace

Adam::Adam(nn::Named<Variable> parameters, AdamOptions options)
    : Optimizer(std::move(parameters), options.lr, "Adam"), options(checked_adam("Adam", options)) {}

std::vector<std::string> Adam::slot_names() const { return {"exp_avg", "exp_avg_sq"}; }

void Adam::update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
                  std::int64_t step) {
  adam_update(param, grad, state, lr(), options, /*decoupled=*/false, step);
}

// --- AdamW -----------------------------------------------------------------------------------

AdamW::AdamW(nn::Named<Variable> parameters, AdamWOptions options)
    : Optimizer(std::move(parameters), options.lr, "AdamW"), options(checked_adam("AdamW", options)) {}

std::vector<std::string> AdamW::slot_names() const { return {"exp_avg", "exp_avg_sq"}; }

void AdamW::update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
                   std::int64_t step) {
  // Decoupled decay shrinks the parameter itself, before and apart from the moments.
  adam_update(param, grad, state, lr(), options, /*decoupled=*/true, step);
}

// --- Adadelta --------------------------------------------------------------------------------

namespace {
AdadeltaOptions checked(AdadeltaOptions options) {
  SHARDLAB_CHECK(options.rho >= 0 && options.rho <= 1, "Adadelta: invalid rho {} (must be in [0, 1])",
                 options.rho);
  check_non_negative("Adadelta", "eps", options.eps);
  check_non_negative("Adadelta", "weight_decay", options.weight_decay);
  return options;
}
}  // namespace

Adadelta::Adadelta(nn::Named<Variable> parameters, AdadeltaOptions options)
    : Optimizer(std::move(parameters), options.lr, "Adadelta"), options(checked(options)) {}

std::vector<std::string> Adadelta::slot_names() const { return {"acc_delta", "square_avg"}; }

void Adadelta::update(const Tensor& param, const Tensor& grad, std::map<std::string, Tensor>& state,
                      std::int64_t) {
  // One fused pass (core's adadelta_step) instead of a dozen elementwise ops: the update is
  // a tenth of the CNN's training step otherwise.
  adadelta_step(param, grad, zero_slot(state, "square_avg", param), zero_slot(state, "acc_delta", param),
                {.lr = lr(), .rho = options.rho, .eps = options.eps, .weight_decay = options.weight_decay});
}

// --- clip_grad_norm_ -------------------------------------------------------------------------

double gradient_sum_of_squares(const std::vector<Variable>& parameters) {
  double sum = 0.0;
  for (const Variable& variable : parameters) {
    const Tensor& grad = variable.grad();
    if (!grad.defined()) continue;
    // A bf16/f16 sum would keep about 3 significant digits: reduce those in f32.
    const bool narrow = grad.dtype() == DType::bf16 || grad.dtype() == DType::f16;
    sum += sum_squares(narrow ? grad.to(DType::f32) : grad).item<double>();
  }
  return sum;
}

double clip_gradients_to_norm(const std::vector<Variable>& parameters, double max_norm, double norm) {
  SHARDLAB_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be > 0, got {}", max_norm);
  const double coef = max_norm / (norm + 1e-6);
  // !(coef >= 1) rather than coef < 1: a NaN norm turns the gradients into NaN, as in
  // PyTorch, instead of letting a broken step pass unnoticed.
  if (!(coef >= 1.0)) {
    for (const Variable& variable : parameters) {
      if (variable.grad().defined()) mul_(variable.grad(), coef);
    }
  }
  return norm;
}

double clip_grad_norm_(const std::vector<Variable>& parameters, double max_norm,
                       const std::function<double(double)>& combine) {
  SHARDLAB_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be > 0, got {}", max_norm);
  const double global = combine(gradient_sum_of_squares(parameters));
  SHARDLAB_CHECK(!(global < 0), "clip_grad_norm_: combine returned a negative sum of squares {}", global);
  return clip_gradients_to_norm(parameters, max_norm, std::sqrt(global));
}

}  // namespace shardlab::optim
