// nn/module.h: Module, the base of every layer and model: named parameters, buffers and
// children in registration order, train/eval, device and dtype moves, state dicts, forward
// hooks, activation checkpointing, and a printer. Holder<Impl> gives modules value syntax:
// `Linear fc(LinearOptions(9216, 128)); fc(x)`.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd/variable.h"
#include "core/random.h"

namespace shardlab::nn {

// How a parameter is filled by initialize(): a distribution, drawn from Philox keyed by
// (seed, hash of the parameter's dotted name), so values never depend on construction order,
// device, or which rank draws which range.
struct SafetensorsTensor;  // nn/safetensors.h

struct Init {
  enum class Kind : unsigned char { uniform, normal, constant, file };
  Kind kind = Kind::constant;
  double a = 0.0;  // uniform: low;  normal: mean; constant: value
  double b = 0.0;  // uniform: high; normal: std
  // Kind::file: the safetensors file and its tensor that hold the values (a pretrained model's).
  std::string path;
  std::shared_ptr<const SafetensorsTensor> tensor;

  static Init uniform(double low, double high) { return {Kind::uniform, low, high}; }
  static Init normal(double mean, double std) { return {Kind::normal, mean, std}; }
  static Init constant(double value) { return {Kind::constant, value, 0.0}; }
  // The values of `tensor` in the file at `path`: fill reads just the elements it is asked for, so
  // an owner of a parameter's shard (FSDP, a tensor-parallel piece) reads only those.
  static Init from_file(std::string path, const SafetensorsTensor& tensor);
  // PyTorch's default for Linear/Conv weights and biases: kaiming_uniform(a = sqrt(5)) reduces
  // to U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  static Init fan_in_uniform(std::int64_t fan_in);

  // Fills `out` (contiguous) with elements [first_index, first_index + numel) of the draw
  // for parameter `name` under `seed` (of the file's tensor for Kind::file: seed and name unused).
  void fill(const Tensor& out, std::uint64_t seed, const std::string& name,
            std::int64_t first_index = 0) const;
};

// The Philox stream of a dotted name (FNV-1a, 64-bit).
std::uint64_t name_stream(const std::string& name);

// While one lives on this thread, new parameters have their shapes but no bytes, and
// nn::initialize only names the modules' streams and remembers the seed: the owner of the
// parameters (FSDP's sharded initialisation) then draws just the ranges it keeps with
// Init::fill, by dotted name, and no process ever holds the whole model.
class DeferredInitGuard {
 public:
  DeferredInitGuard();
  ~DeferredInitGuard();
  DeferredInitGuard(const DeferredInitGuard&) = delete;
  DeferredInitGuard& operator=(const DeferredInitGuard&) = delete;

 private:
  bool previous_;
};

// Whether `tensor` has elements but no bytes yet (a parameter made under DeferredInitGuard).
bool deferred(const Tensor& tensor);

using StateDict = std::vector<std::pair<std::string, Tensor>>;
template <typename T>
using Named = std::vector<std::pair<std::string, T>>;

// The inputs of one forward call as its pre-hooks see them: every Variable argument, and every
// Tensor argument as a constant Variable (an undefined Tensor as an undefined Variable), in
// argument order. A hook may replace them (FSDP casts floating inputs to its compute dtype);
// the forward then runs on the replacements.
using ForwardInputs = std::vector<Variable>;

// with_hooks' conversions between a forward's arguments and the ForwardInputs hooks see.
inline void add_forward_input(ForwardInputs& inputs, const Variable& x) { inputs.push_back(x); }
inline void add_forward_input(ForwardInputs& inputs, const Tensor& x) {
  inputs.push_back(x.defined() ? constant(x) : Variable());
}
template <typename Other>
void add_forward_input(ForwardInputs&, const Other&) {}
inline void take_forward_input(const ForwardInputs& inputs, std::size_t& next, Variable& x) {
  x = inputs[next++];
}
inline void take_forward_input(const ForwardInputs& inputs, std::size_t& next, Tensor& x) {
  const Variable& given = inputs[next++];
  x = given.defined() ? given.data() : Tensor();
}
template <typename Other>
void take_forward_input(const ForwardInputs&, std::size_t&, Other&) {}

class Module : public std::enable_shared_from_this<Module> {
 public:
  using ForwardPreHook = std::function<void(Module& module, ForwardInputs& inputs)>;
  // May replace the output (FSDP's output_dtype casts it).
  using ForwardHook = std::function<void(Module& module, Variable& output)>;

  explicit Module(std::string type_name);
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& type_name() const { return type_name_; }

  // --- the tree --------------------------------------------------------------------------------
  // Recursive, in registration order, names dotted from this module ("conv1.weight").
  Named<Variable> named_parameters(bool recurse = true) const;
  std::vector<Variable> parameters(bool recurse = true) const;
  Named<Tensor> named_buffers(bool recurse = true) const;
  Named<std::shared_ptr<Module>> named_children() const;
  // This module (named "") and every descendant, depth first.
  Named<std::shared_ptr<Module>> named_modules();
  std::int64_t parameter_count() const;
  // The Init of each parameter, by the same dotted names.
  Named<Init> named_inits() const;
  // Makes `variable` what named_parameters(), parameters() and state_dict() give under the
  // parameter `name` (dotted: "fc1.weight" names fc1's own `weight`); the forward keeps computing
  // with the Variable register_parameter returned. FSDP registers each parameter's shard so
  // (dist/fsdp/fsdp.h), as FSDP2 registers DTensors. An unknown name is an error.
  void replace_parameter(const std::string& name, Variable variable);
  // Replaces how initialize() draws parameter `name` (dotted for a descendant's: a model's N(0, 0.02)
  // in place of a layer's default, a pretrained file's values); an unknown name is an error.
  void set_init(const std::string& name, Init init);

  // --- modes and moves -------------------------------------------------------------------------
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves every parameter and buffer (set_data: the Variables stay the same objects). Deferred
  // parameters (made under DeferredInitGuard) stay deferred, on `device`: their owner draws them there.
  // Both moves refuse a module with sharded parameters (move it before sharding).
  void to(Device device);
  // Casts floating parameters and buffers.
  void to(DType dtype);

  // --- state dicts -----------------------------------------------------------------------------
  // Each module's parameters, then its persistent buffers, then its children's, depth first
  // (PyTorch's order), as tensors (not copies); a sharded parameter (Variable::shard_info) gives
  // this rank's elements, 1-D.
  StateDict state_dict() const;
  // Copies values in. Strict: every key must exist on both sides. Any mismatch of shape is an
  // error naming the key and both shapes; nothing is copied unless everything matches. A sharded
  // parameter takes either the whole parameter (this rank's elements are copied) or its shard.
  void load_state_dict(const StateDict& state, bool strict = true);

  // --- hooks -------------------------------------------------------------------------------------
  void register_forward_pre_hook(ForwardPreHook hook) { pre_hooks_.push_back(std::move(hook)); }
  void register_forward_hook(ForwardHook hook) { post_hooks_.push_back(std::move(hook)); }

  // The Philox stream random layers (dropout) use: the hash of this module's dotted name,
  // set by initialize(); 0 before.
  std::uint64_t stream() const { return stream_; }
  // The seed nn::initialize(*this, seed) drew (or, deferred, will draw) the parameters with.
  std::optional<std::uint64_t> initialized_seed() const { return initialized_seed_; }

  // The tree with each module's description and parameter shapes.
  std::string str() const;
  // One line about this module, e.g. "Linear(in=9216, out=128, bias=true)".
  virtual std::string describe() const { return type_name_; }
  // False for containers without a forward of their own (ModuleList): their forward hooks
  // never run, so wrappers such as FSDP must not hook them.
  virtual bool has_forward() const { return true; }
  // Whether apply_activation_checkpointing made this module's forward run under checkpoint().
  bool checkpointed() const { return checkpointed_; }

 protected:
  // A new parameter, filled from `init` with seed 0 (initialize() redraws it).
  Variable register_parameter(std::string name, const Shape& shape, Init init, bool requires_grad = true);
  // A non-persistent buffer (derived tables such as rotary cos/sin) moves with the module but is
  // not part of its state dict, as in PyTorch.
  Tensor register_buffer(std::string name, Tensor value, bool persistent = true);
  template <typename M>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> child) {
    add_child(std::move(name), child);
    return child;
  }

  // Whether with_hooks would call a forward as it is (no hooks, not checkpointed): a fused path
  // that also does its caller's work (RMSNormImpl::add_then_norm) may run only then.
  bool forward_is_plain() const { return pre_hooks_.empty() && post_hooks_.empty() && !checkpointed_; }

  // Runs the forward pre-hooks on the inputs, fn(inputs...) on what they leave (as one
  // checkpoint() node when the module is checkpointed and grad mode is on), then the forward
  // hooks on its output. Every module's operator() goes through it, passing its
  // Variable and Tensor arguments (other arguments pass through untouched), so hooks see every
  // call:  return with_hooks([&](const Variable& x) { return relu(x); }, x);
  template <typename Fn, typename... Inputs>
  Variable with_hooks(Fn&& fn, Inputs... inputs) {
    if (!pre_hooks_.empty()) {
      ForwardInputs seen;
      (add_forward_input(seen, inputs), ...);
      const std::size_t count = seen.size();
      for (const auto& hook : pre_hooks_) hook(*this, seen);
      SHARDLAB_CHECK(seen.size() == count,
                     "{}: a forward pre-hook changed the number of inputs from {} to {}", type_name_, count,
                     seen.size());
      std::size_t next = 0;
      (take_forward_input(seen, next, inputs), ...);
    }
    Variable output =
        checkpointed_ && is_grad_enabled() ? checkpointed_forward(fn, inputs...) : fn(inputs...);
    for (const auto& hook : post_hooks_) hook(*this, output);
    return output;
  }

 private:
  friend void initialize(Module& root, std::uint64_t seed);
  friend int apply_activation_checkpointing(
      Module& root, const std::function<bool(const std::string& name, Module& module)>& predicate);
  // fn(inputs...) as one checkpoint() node: the Variable and Tensor arguments are its inputs, and
  // the recompute in backward calls a copy of fn on them again with copies of the other
  // arguments, so fn must not refer to the caller's locals by reference.
  template <typename Fn, typename... Inputs>
  Variable checkpointed_forward(const Fn& fn, const Inputs&... inputs) {
    ForwardInputs given;
    (add_forward_input(given, inputs), ...);
    return run_checkpointed(given, [fn, inputs...](const ForwardInputs& replayed) {
      std::tuple<Inputs...> arguments(inputs...);
      std::apply(
          [&](auto&... argument) {
            std::size_t next = 0;
            (take_forward_input(replayed, next, argument), ...);
          },
          arguments);
      return std::apply(fn, arguments);
    });
  }
  static Variable run_checkpointed(const ForwardInputs& inputs,
                                   std::function<Variable(const ForwardInputs&)> body);
  void initialize_subtree(const std::string& prefix, std::uint64_t seed);
  void add_child(std::string name, std::shared_ptr<Module> child);
  void check_new_name(const std::string& name, const char* what) const;
  void render(std::string& out, const std::string& name, int depth) const;

  struct Parameter {
    std::string name;
    Variable variable;
    Init init;
  };
  std::string type_name_;
  bool training_ = true;
  std::uint64_t stream_ = 0;
  std::optional<std::uint64_t> initialized_seed_;
  std::vector<Parameter> parameters_;
  Named<Tensor> buffers_;
  std::vector<std::string> transient_buffers_;  // names of the non-persistent ones
  Named<std::shared_ptr<Module>> children_;
  std::vector<ForwardPreHook> pre_hooks_;
  std::vector<ForwardHook> post_hooks_;
  bool checkpointed_ = false;
};

// Fills every parameter of `root` from its Init, keyed by (seed, dotted name from root), and
// gives every module its stream. Call it once the model tree is complete.
void initialize(Module& root, std::uint64_t seed);

// Activation checkpointing by module, as PyTorch's apply_activation_checkpointing: every module
// under `root` (itself included, each module once) for which predicate(dotted name, module) is
// true runs its forward, in grad mode, under autograd's checkpoint(): after its forward pre-hooks
// (FSDP's gather), its activations are not kept but recomputed in its backward, with the same
// random masks; its forward hooks see the checkpoint node's output. Gradients are bit-identical.
// The recompute calls the module's forward lambda again during backward, with copies of its
// arguments: it must not hold the caller's locals by reference (members through `this` are fine).
// Returns the number of modules wrapped; selecting a module without a forward of its own
// (ModuleList) is an error, and then none is wrapped.
//   nn::apply_activation_checkpointing(*model, [](const std::string&, nn::Module& m) {
//     return dynamic_cast<BlockImpl*>(&m) != nullptr;
//   });
int apply_activation_checkpointing(
    Module& root, const std::function<bool(const std::string& name, Module& module)>& predicate);

// Value-like handle to a module: `Linear fc(LinearOptions(4, 2)); Variable y = fc(x);`.
template <typename Impl>
class Holder {
 public:
  template <typename... Args>
  requires std::constructible_from<Impl, Args...>
  explicit Holder(Args&&... args) : impl_(std::make_shared<Impl>(std::forward<Args>(args)...)) {}
  Holder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  Impl* operator->() const { return impl_.get(); }
  Impl& operator*() const { return *impl_; }
  const std::shared_ptr<Impl>& ptr() const { return impl_; }
  operator std::shared_ptr<Module>() const { return impl_; }

  template <typename... Args>
  decltype(auto) operator()(Args&&... args) const {
    return (*impl_)(std::forward<Args>(args)...);
  }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace shardlab::nn
