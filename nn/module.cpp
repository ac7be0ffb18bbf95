// nn/module.cpp: Module's registry, tree walks, moves, state dicts, printer, initialize(),
// activation checkpointing by module.
#include "nn/module.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "autograd/activation_checkpoint.h"
#include "autograd/variable.h"
#include "core/ops.h"
#include "core/storage.h"
#include "nn/safetensors.h"

namespace shardlab::nn {

Init Init::fan_in_uniform(std::int64_t fan_in) {
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  return uniform(-bound, bound);
}

void Init::fill(const Tensor& out, std::uint64_t seed, const std::string& name,
                std::int64_t first_index) const {
  const RandomKey key{seed, name_stream(name)};
  switch (kind) {
    case Kind::uniform:
      fill_random(out, {Distribution::uniform, key, a, b, first_index});
      return;
    case Kind::normal:
      fill_random(out, {Distribution::normal, key, a, b, first_index});
      return;
    case Kind::constant:
      out.fill_(a);
      return;
    case Kind::file:
      read_safetensors_elements(path, *tensor, first_index, out);
      return;
  }
}

Init Init::from_file(std::string path, const SafetensorsTensor& tensor) {
  Init init{Kind::file};
  init.path = std::move(path);
  init.tensor = std::make_shared<const SafetensorsTensor>(tensor);
  return init;
}

std::uint64_t name_stream(const std::string& name) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (const unsigned char c : name) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}

void Module::check_new_name(const std::string& name, const char* what) const {
  SHARDLAB_CHECK(!name.empty() && name.find('.') == std::string::npos,
                 "{}: {} name '{}' must be non-empty and contain no '.'", type_name_, what, name);
  bool taken = false;
  for (const auto& p : parameters_) taken = taken || p.name == name;
  for (const auto& [n, b] : buffers_) taken = taken || n == name;
  for (const auto& [n, c] : children_) taken = taken || n == name;
  SHARDLAB_CHECK(!taken, "{}: the name '{}' is already registered", type_name_, name);
}

namespace {
thread_local bool deferring = false;
}  // namespace

DeferredInitGuard::DeferredInitGuard() : previous_(deferring) { deferring = true; }
DeferredInitGuard::~DeferredInitGuard() { deferring = previous_; }

bool deferred(const Tensor& tensor) { return tensor.numel() > 0 && tensor.storage()->nbytes() == 0; }

Variable Module::register_parameter(std::string name, const Shape& shape, Init init, bool requires_grad) {
  check_new_name(name, "parameter");
  // Drawn at once (seed 0, local name) so a lone layer is usable; initialize(root, seed)
  // redraws every parameter by its dotted name from the root. Deferred: shape only.
  const Tensor data = deferring ? Tensor(std::make_shared<Storage>(Device::cpu(), 0), shape,
                                         contiguous_strides(shape), 0, DType::f32)
                                : empty(shape);
  if (!deferring) init.fill(data, 0, name);
  Variable variable(data, requires_grad, name);
  parameters_.push_back({std::move(name), variable, init});
  return variable;
}

Tensor Module::register_buffer(std::string name, Tensor value, bool persistent) {
  check_new_name(name, "buffer");
  if (!persistent) transient_buffers_.push_back(name);
  buffers_.emplace_back(std::move(name), value);
  return value;
}

void Module::add_child(std::string name, std::shared_ptr<Module> child) {
  check_new_name(name, "module");
  SHARDLAB_CHECK(child != nullptr, "{}: child module '{}' is null", type_name_, name);
  children_.emplace_back(std::move(name), std::move(child));
}

namespace {
std::string join(const std::string& prefix, const std::string& name) {
  if (prefix.empty()) return name;
  return name.empty() ? prefix : prefix + "." + name;
}

// Visits (dotted name, module) depth first, parents before children.
void walk(const Module& module, const std::string& prefix,
          const std::function<void(const std::string&, const Module&)>& visit) {
  visit(prefix, module);
  for (const auto& [name, child] : module.named_children()) walk(*child, join(prefix, name), visit);
}
}  // namespace

Named<Variable> Module::named_parameters(bool recurse) const {
  Named<Variable> out;
  if (!recurse) {
    for (const auto& p : parameters_) out.emplace_back(p.name, p.variable);
    return out;
  }
  walk(*this, "", [&](const std::string& prefix, const Module& m) {
    for (const auto& [name, v] : m.named_parameters(false)) out.emplace_back(join(prefix, name), v);
  });
  return out;
}

std::vector<Variable> Module::parameters(bool recurse) const {
  std::vector<Variable> out;
  for (auto& [name, v] : named_parameters(recurse)) out.push_back(v);
  return out;
}

Named<Init> Module::named_inits() const {
  Named<Init> out;
  walk(*this, "", [&](const std::string& prefix, const Module& m) {
    for (const auto& p : m.parameters_) out.emplace_back(join(prefix, p.name), p.init);
  });
  return out;
}

void Module::replace_parameter(const std::string& name, Variable variable) {
  SHARDLAB_CHECK(variable.defined(), "{}: replace_parameter: the replacement for '{}' is undefined",
                 type_name_, name);
  if (const auto dot = name.find('.'); dot != std::string::npos) {
    const std::string child_name = name.substr(0, dot);
    for (const auto& [child_path, child] : children_) {
      if (child_path == child_name)
        return child->replace_parameter(name.substr(dot + 1), std::move(variable));
    }
    fail("{}: replace_parameter: no child named '{}' (for '{}')", type_name_, child_name, name);
  }
  for (auto& p : parameters_) {
    if (p.name == name) {
      p.variable = std::move(variable);
      return;
    }
  }
  fail("{}: replace_parameter: no parameter named '{}'", type_name_, name);
}

void Module::set_init(const std::string& name, Init init) {
  if (const auto dot = name.find('.'); dot != std::string::npos) {
    const std::string child_name = name.substr(0, dot);
    for (const auto& [child_path, child] : children_) {
      if (child_path == child_name) return child->set_init(name.substr(dot + 1), std::move(init));
    }
    fail("{}: set_init: no child named '{}' (for '{}')", type_name_, child_name, name);
  }
  for (auto& p : parameters_) {
    if (p.name == name) {
      p.init = init;
      return;
    }
  }
  fail("{}: set_init: no parameter named '{}'", type_name_, name);
}

Named<Tensor> Module::named_buffers(bool recurse) const {
  if (!recurse) return buffers_;
  Named<Tensor> out;
  walk(*this, "", [&](const std::string& prefix, const Module& m) {
    for (const auto& [name, b] : m.buffers_) out.emplace_back(join(prefix, name), b);
  });
  return out;
}

Named<std::shared_ptr<Module>> Module::named_children() const { return children_; }

Named<std::shared_ptr<Module>> Module::named_modules() {
  Named<std::shared_ptr<Module>> out;
  out.emplace_back("", shared_from_this());
  for (const auto& [name, child] : children_) {
    for (auto& [sub, module] : child->named_modules()) out.emplace_back(join(name, sub), module);
  }
  return out;
}

std::int64_t Module::parameter_count() const {
  std::int64_t count = 0;
  for (const auto& [name, v] : named_parameters()) count += v.numel();
  return count;
}

void Module::train(bool on) {
  training_ = on;
  for (const auto& [name, child] : children_) child->train(on);
}

namespace {

// A deferred parameter moves without bytes, as it is: its owner draws it on the new device.
Tensor moved(const Tensor& data, Device device) {
  if (!deferred(data) || data.device() == device) return data.to(device);
  return Tensor(std::make_shared<Storage>(device, 0), data.shape(), data.strides(), data.offset(),
                data.dtype());
}

// Moving or casting a shard alone would leave its owner's copy behind.
void refuse_shards(const Module& module, const char* call, const char* verb) {
  for (const auto& [name, variable] : module.named_parameters()) {
    const ShardInfo* shard = variable.shard_info();
    SHARDLAB_CHECK(shard == nullptr,
                   "{}.{}: parameter '{}' is this rank's shard ({}) and its FSDP unit holds the rest; {} the "
                   "model before dist::fully_shard",
                   module.type_name(), call, name, shard->placement, verb);
  }
}

}  // namespace

void Module::to(Device device) {
  refuse_shards(*this, "to(device)", "move");
  for (auto& p : parameters_) p.variable.set_data(moved(p.variable.data(), device));
  for (auto& [name, b] : buffers_) b = b.to(device);
  for (const auto& [name, child] : children_) child->to(device);
}

void Module::to(DType dtype) {
  SHARDLAB_CHECK(is_floating(dtype), "{}.to: parameters are cast to floating dtypes only, not {}",
                 type_name(), dtype_name(dtype));
  refuse_shards(*this, "to(dtype)", "cast");
  for (auto& p : parameters_) {
    if (is_floating(p.variable.dtype())) p.variable.set_data(p.variable.data().to(dtype));
  }
  for (auto& [name, b] : buffers_) {
    if (is_floating(b.dtype())) b = b.to(dtype);
  }
  for (const auto& [name, child] : children_) child->to(dtype);
}

StateDict Module::state_dict() const {
  StateDict out;
  walk(*this, "", [&](const std::string& prefix, const Module& m) {
    for (const auto& p : m.parameters_) out.emplace_back(join(prefix, p.name), p.variable.data());
    for (const auto& [name, b] : m.buffers_) {
      if (std::find(m.transient_buffers_.begin(), m.transient_buffers_.end(), name) ==
          m.transient_buffers_.end()) {
        out.emplace_back(join(prefix, name), b);
      }
    }
  });
  return out;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  std::map<std::string, const Tensor*> given;
  for (const auto& [name, t] : state) {
    SHARDLAB_CHECK(given.emplace(name, &t).second, "load_state_dict: key '{}' appears twice", name);
  }
  std::map<std::string, const ShardInfo*> shards;
  for (const auto& [name, variable] : named_parameters()) {
    if (variable.shard_info() != nullptr) shards.emplace(name, variable.shard_info());
  }
  const StateDict own = state_dict();
  std::vector<std::pair<Tensor, Tensor>> copies;
  for (const auto& [name, target] : own) {
    const auto it = given.find(name);
    const auto shard = shards.find(name);
    const Shape& expected = shard == shards.end() ? target.shape() : shard->second->full_shape;
    if (it == given.end()) {
      SHARDLAB_CHECK(!strict, "load_state_dict: missing key '{}' (expected shape {})", name,
                     shape_str(expected));
      continue;
    }
    const Tensor& source = *it->second;
    if (shard != shards.end() && source.shape() == expected) {
      // The whole parameter: this rank keeps its elements.
      const ShardInfo& info = *shard->second;
      copies.emplace_back(target, source.reshape({source.numel()}).narrow(0, info.first, info.count));
    } else {
      SHARDLAB_CHECK(source.shape() == target.shape(),
                     "load_state_dict: key '{}' has shape {} in the state dict but {} in the module{}", name,
                     shape_str(source.shape()), shape_str(expected),
                     shard == shards.end()
                         ? std::string()
                         : fmt::format(" (or {} as this rank's shard)", shape_str(target.shape())));
      copies.emplace_back(target, source);
    }
    given.erase(it);
  }
  SHARDLAB_CHECK(!strict || given.empty(), "load_state_dict: unexpected key '{}' (shape {})",
                 given.empty() ? "" : given.begin()->first,
                 given.empty() ? "" : shape_str(given.begin()->second->shape()));
  const NoGradGuard no_grad;
  for (const auto& [target, source] : copies) target.copy_(source);
}

void Module::render(std::string& out, const std::string& name, int depth) const {
  const std::string indent(static_cast<std::size_t>(2 * depth), ' ');
  out += indent + (name.empty() ? "" : "(" + name + "): ") + describe();
  std::int64_t own = 0;
  for (const auto& p : parameters_) own += p.variable.numel();
  if (!parameters_.empty()) out += fmt::format("  [{} parameters]", own);
  out += '\n';
  for (const auto& p : parameters_) {
    out += fmt::format("{}  {} {} {}\n", indent, p.name, shape_str(p.variable.shape()),
                       dtype_name(p.variable.dtype()));
  }
  for (const auto& [child_name, child] : children_) child->render(out, child_name, depth + 1);
}

std::string Module::str() const {
  std::string out;
  render(out, "", 0);
  out += fmt::format("total: {} parameters", parameter_count());
  return out;
}

void Module::initialize_subtree(const std::string& prefix, std::uint64_t seed) {
  stream_ = name_stream(prefix);
  for (const auto& p : parameters_) {
    const Tensor& data = p.variable.data();
    if (deferred(data)) continue;  // its owner draws the ranges it keeps
    const Tensor target =
        data.is_contiguous() ? data : empty(data.shape(), TensorOptions{data.dtype(), data.device()});
    p.init.fill(target, seed, join(prefix, p.name));
    if (!data.is_contiguous()) data.copy_(target);
  }
  for (const auto& [name, child] : children_) child->initialize_subtree(join(prefix, name), seed);
}

void initialize(Module& root, std::uint64_t seed) {
  for (const auto& [name, variable] : root.named_parameters()) {  // before anything is drawn
    SHARDLAB_CHECK(variable.shard_info() == nullptr,
                   "nn::initialize: parameter '{}' is this rank's shard ({}); initialize the model before "
                   "dist::fully_shard (a model made under DeferredInitGuard has each rank draw its own part)",
                   name, variable.shard_info()->placement);
  }
  const NoGradGuard no_grad;
  root.initialized_seed_ = seed;
  root.initialize_subtree("", seed);
}

// checkpoint() takes defined inputs only: an undefined argument (an optional Tensor) stays
// undefined in the recompute, at its place.
Variable Module::run_checkpointed(const ForwardInputs& inputs,
                                  std::function<Variable(const ForwardInputs&)> body) {
  std::vector<Variable> defined;
  std::vector<bool> is_defined;
  for (const Variable& input : inputs) {
    is_defined.push_back(input.defined());
    if (input.defined()) defined.push_back(input);
  }
  return checkpoint(
      [body = std::move(body), is_defined](const std::vector<Variable>& replayed) {
        ForwardInputs all(is_defined.size());
        std::size_t next = 0;
        for (std::size_t i = 0; i < all.size(); ++i) {
          if (is_defined[i]) all[i] = replayed[next++];
        }
        return body(all);
      },
      defined);
}

int apply_activation_checkpointing(
    Module& root, const std::function<bool(const std::string& name, Module& module)>& predicate) {
  std::vector<Module*> selected;
  std::set<const Module*> seen;
  for (const auto& [name, module] : root.named_modules()) {
    if (!seen.insert(module.get()).second || !predicate(name, *module)) continue;
    SHARDLAB_CHECK(module->has_forward(),
                   "apply_activation_checkpointing: {} has no forward of its own, so nothing of it can run "
                   "under checkpoint; select the modules in it instead",
                   name.empty() ? fmt::format("the root {}", module->type_name())
                                : fmt::format("'{}' ({})", name, module->type_name()));
    selected.push_back(module.get());
  }
  for (Module* module : selected) module->checkpointed_ = true;
  return static_cast<int>(selected.size());
}

}  // namespace shardlab::nn
