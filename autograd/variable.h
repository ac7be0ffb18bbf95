// autograd/variable.h: Variable, a Tensor that remembers how it was computed, and grad mode.
//
//   Variable w(uniform({3, 2}, key), /*requires_grad=*/true, "w");
//   Variable loss = sum(mul(matmul(x, w), y));
//   loss.backward();                 // w.grad() now holds d loss / d w
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "autograd/shard_info.h"
#include "core/tensor.h"

namespace shardlab {

class BinnedSum;

namespace autograd {
class Node;
struct VariableImpl;
}  // namespace autograd

class Variable {
 public:
  // Runs when the gradient with respect to this variable has been computed, before it is
  // passed on (or accumulated, for a leaf). Returning a defined tensor replaces the
  // gradient; it must have the variable's shape.
  using GradHook = std::function<Tensor(const Tensor& grad)>;
  // Runs on a leaf right after its .grad() was accumulated.
  using PostAccumulateHook = std::function<void(const Variable& leaf)>;

  Variable() = default;
  // A leaf holding `data`. With requires_grad, backward() accumulates into grad().
  explicit Variable(Tensor data, bool requires_grad = false, std::string name = "");

  bool defined() const { return impl_ != nullptr; }
  const Tensor& data() const;
  // The accumulated gradient of a leaf; undefined until a backward reaches it.
  const Tensor& grad() const;
  bool requires_grad() const;
  bool is_leaf() const;
  const std::string& name() const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;

  // The variable's shape: the whole parameter's for a shard (shard_info()), else data()'s.
  const Shape& shape() const;
  std::int64_t dim() const { return static_cast<std::int64_t>(shape().size()); }
  std::int64_t size(std::int64_t dim) const;
  std::int64_t numel() const { return shape_numel(shape()); }
  DType dtype() const { return data().dtype(); }
  Device device() const { return data().device(); }

  // Leaves only: whether gradients are accumulated for this variable.
  Variable& set_requires_grad(bool requires_grad);
  Variable& set_name(std::string name);
  // Null unless this variable is one rank's part of a larger parameter. A shard takes part in no
  // op (they throw, naming it): its values are computed with inside its module's forward, where
  // the owner gathers the whole; data() and grad() are for elementwise updates.
  const ShardInfo* shard_info() const;
  // Leaves only: marks this variable as a shard (its data() must hold info.count elements, 1-D).
  void set_shard_info(ShardInfo info) const;
  // Marks a Variable a module computes with but that is not the parameter to train: FSDP's
  // gathered parameters, whose shard is the parameter; or one not to train now: a shard whose
  // gradient waits for a collective. Optimizers and clipping refuse it, giving `reason` (what it
  // is and what to do instead).
  void set_not_trainable(std::string reason) const;
  // Makes it trainable again (the collective came).
  void clear_not_trainable() const;
  // The reason given to set_not_trainable, or null.
  const std::string* not_trainable_reason() const;
  // Swaps the tensor behind this variable without touching the graph or the gradient
  // (FSDP points parameters at gathered buffers and back).
  void set_data(Tensor data) const;
  // Replaces the accumulated gradient (undefined clears it); later backwards accumulate
  // into this tensor in place, so it may be a view into a larger buffer.
  void set_grad(Tensor grad) const;
  // Where the next gradient goes while grad() is undefined: the engine writes it into `buffer`
  // (copied, not added, so the buffer need not be zeroed) and makes `buffer` the grad(). FSDP
  // gathers its parameters' gradients into one flat buffer this way. Undefined clears it.
  void set_grad_destination(Tensor buffer) const;
  // Bitwise training (autograd/batch_chunks.h): every chunk's part of this leaf's gradient is added into
  // `sum` at elements [first, first + numel()) instead of into grad(); a whole gradient is refused. Null
  // clears it.
  void set_binned_grad(std::shared_ptr<BinnedSum> sum, std::int64_t first = 0) const;
  const std::shared_ptr<BinnedSum>& binned_grad() const;
  // Clears the gradient: drops it (set_to_none) or fills it with zeros in place.
  void zero_grad(bool set_to_none = true) const;

  // A new leaf sharing this variable's tensor, outside any graph.
  Variable detach() const;

  // Backpropagates from this variable. Without `gradient` it must have one element (the
  // gradient is then 1). The graph is freed afterwards unless retain_graph.
  void backward(const Tensor& gradient = {}, bool retain_graph = false) const;

  void register_hook(GradHook hook) const;
  void register_post_accumulate_grad_hook(PostAccumulateHook hook) const;

  // Whether both refer to the same variable (not merely equal values).
  bool same(const Variable& other) const { return impl_ == other.impl_; }
  const std::shared_ptr<autograd::VariableImpl>& impl() const { return impl_; }
  std::string str() const;

  // Wraps a computed tensor: used by autograd ops (autograd/record.h).
  static Variable from_impl(std::shared_ptr<autograd::VariableImpl> impl);

 private:
  void check_gradient_buffer(const char* op, const Tensor& buffer) const;
  void require_defined(const char* what) const;
  std::shared_ptr<autograd::VariableImpl> impl_;
};

// A tensor used in an op as a constant: no gradient flows to it.
inline Variable constant(Tensor data) { return Variable(std::move(data), false); }

// --- grad mode ---------------------------------------------------------------------------------
// Thread-local: while disabled, ops record no graph (inference, optimizer steps, backward).
bool is_grad_enabled();
void set_grad_enabled(bool enabled);

class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : previous_(is_grad_enabled()) { set_grad_enabled(enabled); }
  ~GradModeGuard() { set_grad_enabled(previous_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

// RAII: no graph is recorded in this scope.
class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};

}  // namespace shardlab
