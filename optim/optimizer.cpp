// optim/optimizer.cpp: the Optimizer base (parameter checks, parameter groups and their
// hyper-parameters, the step loop, per-parameter state and the state dict), the update rules
// of SGD, Adam, AdamW and Adadelta, and clip_grad_norm_.
#include "optim/optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <set>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <variant>

#include "core/exact_sum.h"
#include "core/ops.h"
#include "core/random.h"

namespace shardlab::optim {

namespace {

// Written as !(x >= 0) so that NaN is refused too.
void check_non_negative(const std::string& context, const char* what, double value) {
  SHARDLAB_CHECK(value >= 0, "{}: invalid {} {} (must be >= 0)", context, what, value);
}

void check_beta(const std::string& context, const char* what, double value) {
  SHARDLAB_CHECK(value >= 0 && value < 1, "{}: invalid {} {} (must be in [0, 1))", context, what, value);
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
// Group keys of the state dict are "param_groups.<g>.<hyper-parameter>".
constexpr std::string_view kGroupPrefix = "param_groups.";
constexpr const char* kInitialLr = "initial_lr";

Tensor step_tensor(std::int64_t value) { return scalar_tensor(value, dtype(DType::i64)); }

// --- hyper-parameters by name --------------------------------------------------------------------

// A hyper-parameter of an options struct, by the name ParamGroup and the state dict give it.
template <typename Options>
struct Field {
  const char* name;
  std::variant<double Options::*, bool Options::*> member;
};

// The options a group's values stand for.
template <typename Options>
Options options_from(std::span<const Field<Options>> fields, std::span<const double> values) {
  Options options;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    std::visit(
        [&](auto member) {
          using Value = std::remove_reference_t<decltype(options.*member)>;
          options.*member = static_cast<Value>(values[i]);
        },
        fields[i].member);
  }
  return options;
}

// What OptimizerWith needs to know of an optimizer type besides its options struct.
template <typename Options>
struct TypeInfo {
  const char* name;
  std::span<const Field<Options>> fields;
  void (*check)(const Options& options, const std::string& context);
};
template <typename Options>
TypeInfo<Options> type_info();  // specialized below, next to each type's update rule

// The base class's view of a type's hyper-parameters, with `defaults` as the values.
template <typename Options>
HyperParameters hyper_parameters(const TypeInfo<Options>& type, const Options& defaults) {
  HyperParameters hyper;
  for (const Field<Options>& field : type.fields) {
    hyper.names.emplace_back(field.name);
    hyper.defaults.push_back(
        std::visit([&](auto member) { return static_cast<double>(defaults.*member); }, field.member));
    hyper.flags.push_back(std::holds_alternative<bool Options::*>(field.member));
  }
  hyper.check = [type](std::span<const double> values, const std::string& context) {
    type.check(options_from(type.fields, values), context);
  };
  return hyper;
}

// The fields a group sets, in ParamGroup's order.
std::vector<std::pair<const char*, double>> overrides_of(const ParamGroup& group) {
  std::vector<std::pair<const char*, double>> out;
  const auto add = [&](const char* name, const auto& value) {
    if (value) out.emplace_back(name, static_cast<double>(*value));
  };
  add("lr", group.lr);
  add("weight_decay", group.weight_decay);
  add("momentum", group.momentum);
  add("dampening", group.dampening);
  add("nesterov", group.nesterov);
  add("beta1", group.beta1);
  add("beta2", group.beta2);
  add("eps", group.eps);
  add("rho", group.rho);
  return out;
}

// Everything the base class checks of a group's values before the type's own checks.
void check_values(const HyperParameters& hyper, std::span<const double> values, const std::string& context) {
  check_non_negative(context, "learning rate", values[0]);
  for (std::size_t i = 0; i < values.size(); ++i) {
    SHARDLAB_CHECK(!hyper.flags[i] || values[i] == 0 || values[i] == 1,
                   "{}: invalid {} {} (a flag is 0 or 1)", context, hyper.names[i], values[i]);
  }
  hyper.check(values, context);
}

std::vector<ParamGroup> one_group(nn::Named<Variable> parameters) {
  std::vector<ParamGroup> groups(1);
  groups[0].parameters = std::move(parameters);
  return groups;
}

}  // namespace

// --- Optimizer -------------------------------------------------------------------------------

namespace {

// A Variable the model only computes with (FSDP's gathered parameter) never receives the gradient
// the step needs: updating it would silently do nothing.
void check_trainable(const std::string& where, const std::string& name, const Variable& variable) {
  const std::string* reason = variable.not_trainable_reason();
  SHARDLAB_CHECK(reason == nullptr, "{}: parameter '{}' cannot be trained here: {}", where, name,
                 reason == nullptr ? "" : *reason);
}

}  // namespace

Optimizer::Optimizer(std::vector<ParamGroup> groups, HyperParameters hyper, std::string type_name)
    : type_name_(std::move(type_name)), hyper_(std::move(hyper)) {
  std::map<const autograd::VariableImpl*, std::string> variables;  // to refuse a Variable passed twice
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& [name, variable] : groups[g].parameters) {
      SHARDLAB_CHECK(group_of_.emplace(name, g).second, "{}: parameter name '{}' appears twice", type_name_,
                     name);
      SHARDLAB_CHECK(!name.starts_with(kGroupPrefix),
                     "{}: parameter name '{}' is reserved: state dict keys starting with '{}' name groups",
                     type_name_, name, kGroupPrefix);
      SHARDLAB_CHECK(variable.defined(), "{}: parameter '{}' is an undefined Variable", type_name_, name);
      SHARDLAB_CHECK(is_floating(variable.dtype()),
                     "{}: parameter '{}' has dtype {}; only floating parameters can be optimized", type_name_,
                     name, dtype_name(variable.dtype()));
      // A non-leaf never receives a .grad(): optimizing it would silently do nothing.
      SHARDLAB_CHECK(variable.is_leaf(), "{}: parameter '{}' is not a leaf of the graph", type_name_, name);
      check_trainable(type_name_, name, variable);
      const auto [seen, first] = variables.emplace(variable.impl().get(), name);
      SHARDLAB_CHECK(first, "{}: parameters '{}' and '{}' are the same Variable", type_name_, seen->second,
                     name);
    }
  }
  SHARDLAB_CHECK(!group_of_.empty(), "{}: got an empty parameter list", type_name_);

  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::vector<double> values = hyper_.defaults;
    for (const auto& [field, value] : overrides_of(groups[g])) {
      const auto it = std::find(hyper_.names.begin(), hyper_.names.end(), field);
      SHARDLAB_CHECK(it != hyper_.names.end(), "{}: group {} sets {}, which {} does not have (it has {})",
                     type_name_, g, field, type_name_, fmt::join(hyper_.names, ", "));
      values[static_cast<std::size_t>(it - hyper_.names.begin())] = value;
    }
    groups_.push_back({std::move(groups[g].parameters), std::move(values), std::nullopt});
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) check_values(hyper_, groups_[g].hyper, group_context(g));
}

std::size_t Optimizer::checked_group(std::size_t group) const {
  SHARDLAB_CHECK(group < groups_.size(), "{}: no parameter group {} (it has {})", type_name_, group,
                 groups_.size());
  return group;
}

std::string Optimizer::group_context(std::size_t group) const {
  return groups_.size() == 1 ? type_name_ : fmt::format("{}: group {}", type_name_, group);
}

const nn::Named<Variable>& Optimizer::group_parameters(std::size_t group) const {
  return groups_[checked_group(group)].parameters;
}

std::span<const double> Optimizer::hyper_values(std::size_t group) const {
  return groups_[checked_group(group)].hyper;
}

double Optimizer::lr(std::size_t group) const { return groups_[checked_group(group)].hyper[0]; }

void Optimizer::set_lr(std::size_t group, double lr) {
  const std::size_t g = checked_group(group);
  check_non_negative(group_context(g), "learning rate", lr);
  groups_[g].hyper[0] = lr;
}

void Optimizer::set_lr(double lr) {
  check_non_negative(type_name_, "learning rate", lr);
  for (Group& group : groups_) group.hyper[0] = lr;
}

std::vector<double> Optimizer::initial_lrs() {
  std::vector<double> out;
  for (Group& group : groups_) {
    if (!group.initial_lr) group.initial_lr = group.hyper[0];
    out.push_back(*group.initial_lr);
  }
  return out;
}

void Optimizer::check_settled(const char* what) const {
  SHARDLAB_CHECK(!unsettled_,
                 "{}.{}: step {} came from step_if and is not settled: call settle_step(applied) first",
                 type_name_, what, steps_);
}

Optimizer::~Optimizer() {
  if (!runner_) return;
  try {
    runner_->wait();  // its updates write this optimizer's state
  } catch (...) {
    // The error was the caller's to see at a step; a destructor cannot throw it.
  }
}

void Optimizer::set_update_runner(std::shared_ptr<UpdateRunner> runner) {
  wait_for_updates();
  runner_ = std::move(runner);
}

void Optimizer::wait_for_updates() const {
  if (runner_) runner_->wait();
}

void Optimizer::step() {
  wait_for_updates();
  check_settled("step");
  step_gated(Tensor());
}

void Optimizer::step_if(const Tensor& apply) {
  wait_for_updates();
  check_settled("step_if");
  SHARDLAB_CHECK(apply.defined() && apply.dtype() == DType::boolean && apply.numel() == 1,
                 "{}.step_if: apply must be one bool, got {}", type_name_,
                 apply.defined() ? fmt::format("[{} {}]", shape_str(apply.shape()), dtype_name(apply.dtype()))
                                 : std::string("an undefined tensor"));
  step_gated(apply);
}

void Optimizer::settle_step(bool applied) {
  wait_for_updates();
  SHARDLAB_CHECK(unsettled_, "{}.settle_step: no step_if to settle", type_name_);
  if (!applied) {
    for (const std::string& name : *unsettled_) {
      auto& slots = state_.at(name);
      if (--slots.at(kStepSlot).data<std::int64_t>()[0] == 0) state_.erase(name);
    }
    --steps_;
  }
  unsettled_.reset();
}

void place_gates(std::span<ParamUpdate> updates) {
  std::vector<std::pair<Device, Tensor>> gates;  // the gate on each parameter device
  for (ParamUpdate& update : updates) {
    if (!update.apply.defined()) continue;
    const Device device = update.param.device();
    auto it =
        std::find_if(gates.begin(), gates.end(), [&](const auto& entry) { return entry.first == device; });
    if (it == gates.end())
      it = gates.insert(gates.end(),
                        {device, update.apply.device() == device ? update.apply : update.apply.to(device)});
    update.apply = it->second;
  }
}

void Optimizer::step_gated(const Tensor& apply) {
  const NoGradGuard no_grad;
  // Every gradient is checked before any parameter or counter changes.
  for (const Group& group : groups_) {
    for (const auto& [name, variable] : group.parameters) {
      check_trainable(type_name_ + ".step", name, variable);  // made trainable-only after construction
      const Tensor& grad = variable.grad();
      // set_grad checks the shape, but FSDP may swap the data (set_data) after the gradient.
      SHARDLAB_CHECK(!grad.defined() || grad.shape() == variable.data().shape(),
                     "{}.step: gradient of '{}' has shape {} but the parameter has shape {}", type_name_,
                     name, shape_str(grad.shape()), shape_str(variable.data().shape()));
    }
  }
  ++steps_;
  std::vector<ParamUpdate> updates;
  std::vector<std::string> counted;
  for (const Group& group : groups_) {
    for (const auto& [name, variable] : group.parameters) {
      const Tensor& grad = variable.grad();
      if (!grad.defined()) continue;
      auto& slots = state_[name];
      auto step_it = slots.find(kStepSlot);
      if (step_it == slots.end()) step_it = slots.emplace(kStepSlot, step_tensor(0)).first;
      // The step tensor is a CPU scalar: counting on the host costs no device round trip.
      const std::int64_t step = ++step_it->second.data<std::int64_t>()[0];
      counted.push_back(name);
      // set_grad keeps grad in param's dtype
      updates.push_back({variable, variable.data(), grad, slots, step, group.hyper, apply});
    }
  }
  if (apply.defined()) unsettled_ = std::move(counted);
  UpdateRule rule = [rule = update_rule()](std::span<const ParamUpdate> part) {
    const NoGradGuard no_grad;  // on the runner's thread too
    rule(part);
  };
  if (runner_) return runner_->run(std::move(updates), std::move(rule));
  place_gates(updates);
  rule(updates);
}

double Optimizer::update_seconds_per_element(Device device, std::int64_t elements) const {
  SHARDLAB_CHECK(elements > 0, "{}.update_seconds_per_element: elements must be positive, got {}", type_name_,
                 elements);
  const NoGradGuard no_grad;
  const TensorOptions f32{DType::f32, device};
  const UpdateRule rule = update_rule();
  const auto& hyper = groups_.front().hyper;
  // Seconds of one update of n elements, the device waited for.
  const auto seconds_of = [&](std::int64_t n) {
    const Tensor param = uniform({n}, RandomKey{1, 11}, -1.0, 1.0, f32);
    const Tensor grad = uniform({n}, RandomKey{2, 11}, -1e-3, 1e-3, f32);
    std::map<std::string, Tensor> state;
    std::int64_t step = 0;
    const auto update = [&] {
      const ParamUpdate one{Variable(param), param, grad, state, ++step, hyper, Tensor()};
      rule(std::span<const ParamUpdate>(&one, 1));
      if (device.is_cuda()) (void)param.narrow(0, 0, 1).to(Device::cpu());  // waits for the device
    };
    update();  // makes the state
    constexpr int kCalls = 4;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) update();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kCalls;
  };
  const auto n = static_cast<double>(elements);
  if (!device.is_cuda()) return seconds_of(elements) / n;
  // A GPU updates a million elements in about the time its launches and the wait take: the slope from
  // there to 16 times as many is the time an element adds.
  const double few = seconds_of(elements), many = seconds_of(16 * elements);
  return many > few ? (many - few) / (15 * n) : many / (16 * n);
}

void Optimizer::zero_grad(bool set_to_none) {
  // Dropping a gradient leaves the tensor to the updates that hold it; zeroing it in place does not.
  if (!set_to_none) wait_for_updates();
  for (const Group& group : groups_) {
    for (const auto& [name, variable] : group.parameters) variable.zero_grad(set_to_none);
  }
}

nn::StateDict Optimizer::state_dict() const {
  wait_for_updates();
  check_settled("state_dict");
  nn::StateDict out;
  for (const Group& group : groups_) {
    for (const auto& [name, variable] : group.parameters) {
      const auto it = state_.find(name);
      if (it == state_.end()) continue;
      for (const auto& [slot, tensor] : it->second) out.emplace_back(name + "." + slot, tensor);
    }
  }
  const auto value = [](double v) { return scalar_tensor(v, dtype(DType::f64)); };
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const std::string prefix = fmt::format("{}{}.", kGroupPrefix, g);
    for (std::size_t i = 0; i < hyper_.names.size(); ++i)
      out.emplace_back(prefix + hyper_.names[i], value(groups_[g].hyper[i]));
    if (groups_[g].initial_lr) out.emplace_back(prefix + kInitialLr, value(*groups_[g].initial_lr));
  }
  out.emplace_back(kStepSlot, step_tensor(steps_));
  return out;
}

std::optional<std::vector<std::string>> Optimizer::state_slots(const std::string& parameter) const {
  const auto group = group_of_.find(parameter);
  if (group == group_of_.end()) return std::nullopt;
  return slot_names(hyper_values(group->second));
}

void Optimizer::load_state_dict(const nn::StateDict& state) {
  wait_for_updates();
  check_settled("load_state_dict");
  const std::string where = type_name_ + ".load_state_dict";
  const auto check_shape = [&](const std::string& key, const Tensor& tensor, const Shape& expected) {
    SHARDLAB_CHECK(tensor.shape() == expected,
                   "{}: key '{}' has shape {} in the state dict but {} in the optimizer", where, key,
                   shape_str(tensor.shape()), shape_str(expected));
  };
  const auto check_count = [&](const std::string& key, const Tensor& tensor) {
    check_shape(key, tensor, {});
    SHARDLAB_CHECK(tensor.item<double>() >= 0, "{}: key '{}' holds a negative step count {}", where, key,
                   tensor.item<double>());
  };
  std::vector<std::string> group_fields = hyper_.names;
  group_fields.emplace_back(kInitialLr);

  // Validate everything before touching any member, so a failed load changes nothing.
  std::set<std::string> seen;
  const Tensor* global_step = nullptr;
  std::map<std::string, std::map<std::string, const Tensor*>> given;  // parameter -> slot -> tensor
  std::vector<std::map<std::string, double>> group_values(groups_.size());
  for (const auto& [key, tensor] : state) {
    SHARDLAB_CHECK(seen.insert(key).second, "{}: key '{}' appears twice", where, key);
    SHARDLAB_CHECK(tensor.defined(), "{}: key '{}' holds an undefined tensor", where, key);
    if (key == kStepSlot) {
      check_count(key, tensor);
      global_step = &tensor;
    } else if (key.starts_with(kGroupPrefix)) {
      const std::string_view rest = std::string_view(key).substr(kGroupPrefix.size());
      const std::size_t dot = std::min(rest.find('.'), rest.size());
      std::size_t g = 0;
      const auto [end, error] = std::from_chars(rest.data(), rest.data() + dot, g);
      SHARDLAB_CHECK(dot < rest.size() && error == std::errc() && end == rest.data() + dot,
                     "{}: unexpected key '{}' (group keys are '{}<group>.<hyper-parameter>')", where, key,
                     kGroupPrefix);
      SHARDLAB_CHECK(g < groups_.size(), "{}: unexpected key '{}': the optimizer has {} parameter groups",
                     where, key, groups_.size());
      const std::string field(rest.substr(dot + 1));
      SHARDLAB_CHECK(std::find(group_fields.begin(), group_fields.end(), field) != group_fields.end(),
                     "{}: unexpected key '{}': {} has no hyper-parameter '{}' (its hyper-parameters: {})",
                     where, key, type_name_, field, fmt::join(group_fields, ", "));
      check_shape(key, tensor, {});
      group_values[g][field] = tensor.item<double>();
    } else {
      // Parameter names may contain dots ("fc1.weight"); slot names never do.
      const std::size_t dot = key.rfind('.');
      SHARDLAB_CHECK(
          dot != std::string::npos,
          "{}: unexpected key '{}' (keys are '<parameter>.<slot>', '{}<group>.<hyper-parameter>' or "
          "'step')",
          where, key, kGroupPrefix);
      const std::string name = key.substr(0, dot);
      SHARDLAB_CHECK(group_of_.contains(name), "{}: unexpected key '{}': no parameter '{}'", where, key,
                     name);
      given[name][key.substr(dot + 1)] = &tensor;
    }
  }
  SHARDLAB_CHECK(global_step != nullptr, "{}: missing key 'step'", where);

  // Every group's hyper-parameters, complete and valid.
  std::vector<std::vector<double>> hyper(groups_.size());
  std::vector<std::optional<double>> initial_lr(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (const std::string& name : hyper_.names) {
      const auto it = group_values[g].find(name);
      SHARDLAB_CHECK(it != group_values[g].end(), "{}: missing key '{}{}.{}'", where, kGroupPrefix, g, name);
      hyper[g].push_back(it->second);
    }
    const std::string context = fmt::format("{}: {}{}", where, kGroupPrefix, g);
    check_values(hyper_, hyper[g], context);
    if (const auto it = group_values[g].find(kInitialLr); it != group_values[g].end()) {
      check_non_negative(context, kInitialLr, it->second);
      initial_lr[g] = it->second;
    }
  }

  // Every parameter's slots, as its group (with the loaded values) keeps them.
  std::map<std::string, const Variable*> by_name;
  for (const Group& group : groups_) {
    for (const auto& [name, variable] : group.parameters) by_name.emplace(name, &variable);
  }
  for (const auto& [name, present] : given) {
    std::vector<std::string> slots = slot_names(hyper[group_of_.at(name)]);
    slots.emplace_back(kStepSlot);
    std::sort(slots.begin(), slots.end());
    const Shape& shape = by_name.at(name)->data().shape();  // a shard's state is its elements'
    for (const auto& [slot, tensor] : present) {
      const std::string key = name + "." + slot;
      SHARDLAB_CHECK(std::binary_search(slots.begin(), slots.end(), slot),
                     "{}: unexpected key '{}': {} has no state slot '{}' (its slots: {})", where, key,
                     type_name_, slot, fmt::join(slots, ", "));
      if (slot == kStepSlot) {
        check_count(key, *tensor);
      } else {
        check_shape(key, *tensor, shape);
      }
    }
    for (const std::string& slot : slots) {
      SHARDLAB_CHECK(present.contains(slot), "{}: missing key '{}.{}' (expected shape {})", where, name, slot,
                     shape_str(slot == kStepSlot ? Shape{} : shape));
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
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].hyper = std::move(hyper[g]);
    groups_[g].initial_lr = initial_lr[g];
  }
}

// --- SGD -------------------------------------------------------------------------------------

namespace {

const Field<SGDOptions> kSgdFields[] = {{"lr", &SGDOptions::lr},
                                        {"momentum", &SGDOptions::momentum},
                                        {"dampening", &SGDOptions::dampening},
                                        {"weight_decay", &SGDOptions::weight_decay},
                                        {"nesterov", &SGDOptions::nesterov}};

void check_sgd(const SGDOptions& options, const std::string& context) {
  check_non_negative(context, "momentum", options.momentum);
  check_non_negative(context, "weight_decay", options.weight_decay);
  // Nesterov's look-ahead is defined on the undamped buffer (PyTorch refuses the rest too).
  SHARDLAB_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
                 "{}: nesterov needs momentum > 0 and dampening == 0 (got momentum {}, dampening {})",
                 context, options.momentum, options.dampening);
}

// g + weight_decay * p as a new tensor: the parameter's .grad() itself is never modified.
Tensor with_l2(const Tensor& grad, const Tensor& param, double weight_decay) {
  return weight_decay == 0.0 ? grad : add(grad, mul(param, weight_decay));
}

template <>
TypeInfo<SGDOptions> type_info() {
  return {"SGD", kSgdFields, check_sgd};
}

// `target` = `value`, or where the gate is defined, `value` only where it holds: the host never
// reads it.
void assign_gated(const Tensor& target, const Tensor& value, const Tensor& apply) {
  target.copy_(apply.defined() ? where(apply, value, target) : value);
}

void sgd_update(std::span<const ParamUpdate> updates) {
  for (const auto& [variable, param, grad, state, step, hyper, apply] : updates) {
    const auto o = options_from<SGDOptions>(kSgdFields, hyper);
    Tensor direction = with_l2(grad, param, o.weight_decay);
    if (o.momentum != 0.0) {
      auto it = state.find("momentum_buffer");
      if (it == state.end()) {
        // Cloned: the buffer is updated in place later and must not alias .grad(). A skipped first
        // update leaves no state (settle_step drops it).
        it = state.emplace("momentum_buffer", direction.clone()).first;
      } else {
        assign_gated(it->second, add(mul(it->second, o.momentum), mul(direction, 1.0 - o.dampening)), apply);
      }
      const Tensor& buffer = it->second;
      direction = o.nesterov ? add(direction, mul(buffer, o.momentum)) : buffer;
    }
    assign_gated(param, sub(param, mul(direction, o.lr)), apply);
  }
}

}  // namespace

std::vector<std::string> SGD::slot_names(std::span<const double> hyper_values) const {
  if (options_from<SGDOptions>(kSgdFields, hyper_values).momentum == 0.0) return {};
  return {"momentum_buffer"};
}

UpdateRule SGD::update_rule() const { return sgd_update; }

// --- Adam and AdamW --------------------------------------------------------------------------

namespace {

template <typename Options>
const Field<Options> kAdamFields[] = {{"lr", &Options::lr},
                                      {"beta1", &Options::beta1},
                                      {"beta2", &Options::beta2},
                                      {"eps", &Options::eps},
                                      {"weight_decay", &Options::weight_decay}};

template <typename Options>
void check_adam(const Options& options, const std::string& context) {
  check_beta(context, "beta1", options.beta1);
  check_beta(context, "beta2", options.beta2);
  check_non_negative(context, "eps", options.eps);
  check_non_negative(context, "weight_decay", options.weight_decay);
}

const std::vector<std::string> kAdamSlots = {"exp_avg", "exp_avg_sq"};

// A fused step over `segments` (one per update, in order): one call in all for step(); one call
// per parameter device for step_if, each with that device's gate.
template <typename Segment, void (*Step)(std::span<const Segment>, const Tensor&)>
void step_per_gate(std::span<const ParamUpdate> updates, std::span<const Segment> segments) {
  if (updates.empty() || !updates.front().apply.defined()) return Step(segments, Tensor());
  std::vector<std::pair<Tensor, std::vector<Segment>>> by_gate;
  for (std::size_t i = 0; i < updates.size(); ++i) {
    const Tensor& gate = updates[i].apply;
    auto it = std::find_if(by_gate.begin(), by_gate.end(),
                           [&](const auto& entry) { return entry.first.device() == gate.device(); });
    if (it == by_gate.end()) it = by_gate.insert(by_gate.end(), {gate, {}});
    it->second.push_back(segments[i]);
  }
  for (const auto& [gate, here] : by_gate) Step(here, gate);
}

// Adam's moment updates and parameter steps shared by Adam and AdamW, for every parameter in
// one fused pass (core's multi-segment adam_step: per element the op-by-op formula of
// torch.optim's single-tensor Adam, denom = sqrt(v) / sqrt(bc2) + eps and step_size = lr / bc1,
// so results round alike) instead of a dozen elementwise ops and their temporaries per shard.
// Decoupled (AdamW) decay shrinks the parameter itself, before and apart from the moments.
template <typename Options>
void adam_update(std::span<const ParamUpdate> updates, bool decoupled) {
  std::vector<AdamSegment> segments;
  for (const auto& [variable, param, grad, state, step, hyper, apply] : updates) {
    const auto o = options_from<Options>(kAdamFields<Options>, hyper);
    segments.push_back({.param = param,
                        .grad = grad,
                        .exp_avg = zero_slot(state, "exp_avg", param),
                        .exp_avg_sq = zero_slot(state, "exp_avg_sq", param),
                        .hyper = {.lr = o.lr,
                                  .beta1 = o.beta1,
                                  .beta2 = o.beta2,
                                  .eps = o.eps,
                                  .weight_decay = o.weight_decay,
                                  .decoupled = decoupled,
                                  .step = step}});
  }
  step_per_gate<AdamSegment, adam_step>(updates, segments);
}

template <>
TypeInfo<AdamOptions> type_info() {
  return {"Adam", kAdamFields<AdamOptions>, check_adam<AdamOptions>};
}

template <>
TypeInfo<AdamWOptions> type_info() {
  return {"AdamW", kAdamFields<AdamWOptions>, check_adam<AdamWOptions>};
}

}  // namespace

std::vector<std::string> Adam::slot_names(std::span<const double>) const { return kAdamSlots; }

UpdateRule Adam::update_rule() const {
  return [](std::span<const ParamUpdate> updates) { adam_update<AdamOptions>(updates, /*decoupled=*/false); };
}

std::vector<std::string> AdamW::slot_names(std::span<const double>) const { return kAdamSlots; }

UpdateRule AdamW::update_rule() const {
  return [](std::span<const ParamUpdate> updates) { adam_update<AdamWOptions>(updates, /*decoupled=*/true); };
}

// --- Adadelta --------------------------------------------------------------------------------

namespace {

const Field<AdadeltaOptions> kAdadeltaFields[] = {{"lr", &AdadeltaOptions::lr},
                                                  {"rho", &AdadeltaOptions::rho},
                                                  {"eps", &AdadeltaOptions::eps},
                                                  {"weight_decay", &AdadeltaOptions::weight_decay}};

void check_adadelta(const AdadeltaOptions& options, const std::string& context) {
  SHARDLAB_CHECK(options.rho >= 0 && options.rho <= 1, "{}: invalid rho {} (must be in [0, 1])", context,
                 options.rho);
  check_non_negative(context, "eps", options.eps);
  check_non_negative(context, "weight_decay", options.weight_decay);
}

template <>
TypeInfo<AdadeltaOptions> type_info() {
  return {"Adadelta", kAdadeltaFields, check_adadelta};
}

}  // namespace

std::vector<std::string> Adadelta::slot_names(std::span<const double>) const {
  return {"acc_delta", "square_avg"};
}

namespace {

void adadelta_update(std::span<const ParamUpdate> updates) {
  // One fused pass over every parameter (core's multi-segment adadelta_step) instead of a dozen
  // elementwise ops each: the update is a tenth of the CNN's training step otherwise.
  std::vector<AdadeltaSegment> segments;
  for (const auto& [variable, param, grad, state, step, hyper, apply] : updates) {
    const auto o = options_from<AdadeltaOptions>(kAdadeltaFields, hyper);
    segments.push_back({.param = param,
                        .grad = grad,
                        .square_avg = zero_slot(state, "square_avg", param),
                        .acc_delta = zero_slot(state, "acc_delta", param),
                        .hyper = {.lr = o.lr, .rho = o.rho, .eps = o.eps, .weight_decay = o.weight_decay}});
  }
  step_per_gate<AdadeltaSegment, adadelta_step>(updates, segments);
}

}  // namespace

UpdateRule Adadelta::update_rule() const { return adadelta_update; }

// --- OptimizerWith ---------------------------------------------------------------------------

template <typename Options>
OptimizerWith<Options>::OptimizerWith(nn::Named<Variable> parameters, Options options)
    : OptimizerWith(one_group(std::move(parameters)), options) {}

template <typename Options>
OptimizerWith<Options>::OptimizerWith(std::vector<ParamGroup> groups, Options options)
    : Optimizer(std::move(groups), hyper_parameters(type_info<Options>(), options),
                type_info<Options>().name) {}

template <typename Options>
Options OptimizerWith<Options>::options(std::size_t group) const {
  return options_from(type_info<Options>().fields, hyper_values(group));
}

template class OptimizerWith<SGDOptions>;
template class OptimizerWith<AdamOptions>;
template class OptimizerWith<AdamWOptions>;
template class OptimizerWith<AdadeltaOptions>;

// --- clip_grad_norm_ -------------------------------------------------------------------------

namespace {

// Where a sum over `parameters` lives: their device (the first one's), `if_none` for none.
Device device_of(const std::vector<Variable>& parameters, Device if_none) {
  return parameters.empty() ? if_none : parameters.front().data().device();
}

// `value` on `device`: a copy only for parameters spread over devices.
Tensor on(const Tensor& value, Device device) { return value.device() == device ? value : value.to(device); }

}  // namespace

Tensor gradient_sum_of_squares(const std::vector<Variable>& parameters, Device if_none) {
  const Device device = device_of(parameters, if_none);
  // The gradients by device, in the parameters' order: one foreach_sum_squares on each.
  std::vector<std::pair<Device, std::vector<Tensor>>> by_device;
  for (const Variable& variable : parameters) {
    const Tensor& grad = variable.grad();
    if (!grad.defined()) continue;
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](const auto& entry) { return entry.first == grad.device(); });
    if (it == by_device.end()) it = by_device.insert(by_device.end(), {grad.device(), {}});
    it->second.push_back(grad);
  }
  if (by_device.empty()) return zeros({}, dtype(DType::f64).with_device(device));
  Tensor sum = on(foreach_sum_squares(by_device.front().second), device);
  for (std::size_t i = 1; i < by_device.size(); ++i)
    add_(sum, on(foreach_sum_squares(by_device[i].second), device));
  return sum;
}

Tensor clip_gradients_to_norm(const std::vector<Variable>& parameters, double max_norm, const Tensor& norm) {
  SHARDLAB_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be > 0, got {}", max_norm);
  const TensorOptions options = dtype(DType::f64).with_device(norm.device());
  const Tensor coef = div(scalar_tensor(max_norm, options), add(norm, 1e-6));
  // Always applied, 1 where coef >= 1, so no host ever reads the norm to decide. !(coef >= 1) rather
  // than coef < 1: a NaN norm turns the gradients into NaN, as in PyTorch, instead of letting a
  // broken step pass unnoticed.
  const Tensor factor = where(ge(coef, 1.0), ones({}, options), coef);
  // The factor on each gradient's device in its dtype, made once for all gradients that share them:
  // mul_ would cast it for each one (a kernel call, on a GPU a launch, per parameter).
  std::vector<Tensor> factors;
  for (const Variable& variable : parameters) {
    const Tensor& grad = variable.grad();
    if (!grad.defined()) continue;
    auto it = std::find_if(factors.begin(), factors.end(), [&](const Tensor& made) {
      return made.device() == grad.device() && made.dtype() == grad.dtype();
    });
    if (it == factors.end()) it = factors.insert(factors.end(), on(factor, grad.device()).to(grad.dtype()));
    mul_(grad, *it);
  }
  return norm;
}

namespace {

// The parameters whose gradients a global sum adds: whole ones (each rank's own, combined as the
// caller says) and, per set of ranks, the shards whose parts they hold, each counted by one copy.
struct SumGroups {
  std::vector<Variable> whole;
  std::vector<std::pair<const ShardRanks*, std::vector<Variable>>> sharded;
};

SumGroups sum_groups(const std::vector<Variable>& parameters) {
  // A shard's part is summed over the ranks that hold its parameter, a replicated copy once; one
  // sum per set of ranks, in the order the parameters name them, which every rank shares.
  SumGroups groups;
  std::vector<Variable>& whole = groups.whole;
  auto& sharded = groups.sharded;
  for (const Variable& variable : parameters) {
    check_trainable("clip_grad_norm_", variable.name(), variable);
    const ShardInfo* shard = variable.shard_info();
    if (shard == nullptr) {
      whole.push_back(variable);
      continue;
    }
    auto it = std::find_if(sharded.begin(), sharded.end(),
                           [&](const auto& entry) { return entry.first == shard->ranks.get(); });
    if (it == sharded.end()) it = sharded.insert(sharded.end(), {shard->ranks.get(), {}});
    if (shard->counts_once) it->second.push_back(variable);
  }
  return groups;
}

Tensor global_sum_of_squares(const std::vector<Variable>& parameters, const SumCombiner& combine) {
  const SumGroups groups = sum_groups(parameters);
  const Device device = device_of(parameters, Device::cpu());
  Tensor local = gradient_sum_of_squares(groups.whole, device);
  Tensor global = on(combine ? combine(local) : local, device);
  for (const auto& [ranks, counted] : groups.sharded)
    global = add(global, on(ranks->sum(gradient_sum_of_squares(counted, device)), device));
  return global;
}

// The squares of the gradients of `parameters` added exactly.
ExactSum exact_sum_of_squares(const std::vector<Variable>& parameters) {
  ExactSum sum;
  for (const Variable& variable : parameters) {
    const Tensor& grad = variable.grad();
    if (!grad.defined()) continue;
    SHARDLAB_CHECK(grad.device().is_cpu(),
                   "clip_grad_norm_exact: the gradient of '{}' is on {}; exact sums are "
                   "made on the CPU",
                   variable.name(), grad.device().str());
    sum.add(grad.contiguous(), /*squares=*/true);
  }
  return sum;
}

}  // namespace

Tensor clip_grad_norm_exact(const std::vector<Variable>& parameters, double max_norm,
                            const SumCombiner& combine) {
  SHARDLAB_CHECK(max_norm > 0, "clip_grad_norm_exact: max_norm must be > 0, got {}", max_norm);
  return clip_gradients_to_norm(parameters, max_norm, gradient_norm_exact(parameters, combine));
}

Tensor gradient_norm_exact(const std::vector<Variable>& parameters, const SumCombiner& combine) {
  const SumGroups groups = sum_groups(parameters);
  const Tensor whole = exact_sum_of_squares(groups.whole).limbs();
  ExactSum total = ExactSum::from_limbs(combine ? combine(whole) : whole);
  for (const auto& [ranks, counted] : groups.sharded)
    total.add(ExactSum::from_limbs(ranks->sum(exact_sum_of_squares(counted).limbs())));
  return scalar_tensor(std::sqrt(total.value()), dtype(DType::f64));
}

Tensor clip_grad_norm_(const std::vector<Variable>& parameters, double max_norm, const SumCombiner& combine) {
  SHARDLAB_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be > 0, got {}", max_norm);
  return clip_gradients_to_norm(parameters, max_norm, sqrt(global_sum_of_squares(parameters, combine)));
}

}  // namespace shardlab::optim
