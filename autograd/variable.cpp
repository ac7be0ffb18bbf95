// autograd/variable.cpp: Variable's accessors, hooks, detach/set_data, and grad mode.
#include "autograd/variable.h"

#include <fmt/format.h>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "core/ops.h"

namespace shardlab {

namespace {
thread_local bool grad_enabled = true;
}  // namespace

bool is_grad_enabled() { return grad_enabled; }
void set_grad_enabled(bool enabled) { grad_enabled = enabled; }

Variable::Variable(Tensor data, bool requires_grad, std::string name)
    : impl_(std::make_shared<autograd::VariableImpl>()) {
  SHARDLAB_CHECK(data.defined(), "Variable: the tensor is undefined");
  impl_->data = std::move(data);
  impl_->name = std::move(name);
  set_requires_grad(requires_grad);
}

Variable Variable::from_impl(std::shared_ptr<autograd::VariableImpl> impl) {
  Variable v;
  v.impl_ = std::move(impl);
  return v;
}

void Variable::require_defined(const char* what) const {
  SHARDLAB_CHECK(impl_ != nullptr, "{}: the variable is undefined", what);
}

const Tensor& Variable::data() const {
  require_defined("data");
  return impl_->data;
}
const Tensor& Variable::grad() const {
  require_defined("grad");
  return impl_->grad;
}
const Shape& Variable::shape() const {
  require_defined("shape");
  return impl_->shard ? impl_->shard->full_shape : impl_->data.shape();
}

std::int64_t Variable::size(std::int64_t dim) const {
  const Shape& dims = shape();
  return dims[static_cast<std::size_t>(wrap_dim(dim, static_cast<std::int64_t>(dims.size()), "size"))];
}

const ShardInfo* Variable::shard_info() const { return impl_ ? impl_->shard.get() : nullptr; }

void Variable::set_shard_info(ShardInfo info) const {
  require_defined("set_shard_info");
  SHARDLAB_CHECK(is_leaf(), "set_shard_info: '{}' is not a leaf", name());
  SHARDLAB_CHECK(info.ranks != nullptr, "set_shard_info: '{}' needs the ranks that hold its parts", name());
  SHARDLAB_CHECK(
      impl_->data.dim() == 1 && impl_->data.numel() == info.count && info.first >= 0 &&
          info.first + info.count <= shape_numel(info.full_shape),
      "set_shard_info: '{}' holds {} elements of shape {}, not elements [{}, {}) of a parameter of "
      "shape {}",
      name(), impl_->data.numel(), shape_str(impl_->data.shape()), info.first, info.first + info.count,
      shape_str(info.full_shape));
  impl_->shard = std::make_shared<const ShardInfo>(std::move(info));
}

void Variable::set_not_trainable(std::string reason) const {
  require_defined("set_not_trainable");
  impl_->not_trainable = std::move(reason);
}

void Variable::clear_not_trainable() const {
  require_defined("clear_not_trainable");
  impl_->not_trainable.reset();
}

const std::string* Variable::not_trainable_reason() const {
  return impl_ && impl_->not_trainable ? &*impl_->not_trainable : nullptr;
}

bool Variable::requires_grad() const { return impl_ != nullptr && impl_->requires_grad; }
bool Variable::is_leaf() const { return impl_ == nullptr || impl_->grad_fn == nullptr; }
const std::string& Variable::name() const {
  require_defined("name");
  return impl_->name;
}
const std::shared_ptr<autograd::Node>& Variable::grad_fn() const {
  require_defined("grad_fn");
  return impl_->grad_fn;
}

Variable& Variable::set_requires_grad(bool requires_grad) {
  require_defined("set_requires_grad");
  SHARDLAB_CHECK(is_leaf(), "set_requires_grad: '{}' is computed by {}; only leaves can change it", name(),
                 impl_->grad_fn->name());
  SHARDLAB_CHECK(!requires_grad || is_floating(impl_->data.dtype()),
                 "set_requires_grad: only floating tensors can require grad, '{}' is {}", name(),
                 dtype_name(impl_->data.dtype()));
  impl_->requires_grad = requires_grad;
  return *this;
}

Variable& Variable::set_name(std::string name) {
  require_defined("set_name");
  impl_->name = std::move(name);
  return *this;
}

void Variable::set_data(Tensor data) const {
  require_defined("set_data");
  SHARDLAB_CHECK(data.defined(), "set_data: the new tensor for '{}' is undefined", name());
  impl_->data = std::move(data);
}

// A gradient buffer must match the data: the engine accumulates into it in place and optimizers
// read it beside the data, so another dtype or device would be a silent cast or a cross-device
// access later.
void Variable::check_gradient_buffer(const char* op, const Tensor& buffer) const {
  require_defined(op);
  if (!buffer.defined()) return;
  SHARDLAB_CHECK(buffer.shape() == impl_->data.shape(), "{}: gradient of shape {} for '{}' of shape {}", op,
                 shape_str(buffer.shape()), name(), shape_str(impl_->data.shape()));
  SHARDLAB_CHECK(buffer.dtype() == impl_->data.dtype() && buffer.device() == impl_->data.device(),
                 "{}: gradient of dtype {} on {} for '{}' of dtype {} on {}", op, dtype_name(buffer.dtype()),
                 buffer.device().str(), name(), dtype_name(impl_->data.dtype()), impl_->data.device().str());
}

void Variable::set_grad(Tensor grad) const {
  check_gradient_buffer("set_grad", grad);
  impl_->grad = std::move(grad);
}

void Variable::set_grad_destination(Tensor buffer) const {
  check_gradient_buffer("set_grad_destination", buffer);
  SHARDLAB_CHECK(!buffer.defined() || is_leaf(), "set_grad_destination: '{}' is not a leaf", name());
  impl_->grad_destination = std::move(buffer);
}

void Variable::set_binned_grad(std::shared_ptr<BinnedSum> sum, std::int64_t first) const {
  require_defined("set_binned_grad");
  SHARDLAB_CHECK(sum == nullptr || (is_leaf() && requires_grad()),
                 "set_binned_grad: '{}' is not a leaf that requires grad", name());
  SHARDLAB_CHECK(sum == nullptr || (first >= 0 && first + numel() <= sum->numel()),
                 "set_binned_grad: '{}' ({} elements from {}) does not fit a sum of {}", name(), numel(),
                 first, sum == nullptr ? 0 : sum->numel());
  impl_->binned_grad = std::move(sum);
  impl_->binned_first = first;
}

const std::shared_ptr<BinnedSum>& Variable::binned_grad() const {
  require_defined("binned_grad");
  return impl_->binned_grad;
}

void Variable::zero_grad(bool set_to_none) const {
  require_defined("zero_grad");
  if (set_to_none) {
    impl_->grad = Tensor();
  } else if (impl_->grad.defined()) {
    impl_->grad.fill_(0);
  }
}

Variable Variable::detach() const {
  require_defined("detach");
  Variable out(impl_->data, false, impl_->name);
  out.impl_->shard = impl_->shard;  // still a part of the same parameter
  return out;
}

void Variable::backward(const Tensor& gradient, bool retain_graph) const {
  require_defined("backward");
  autograd::backward({*this}, {gradient}, retain_graph);
}

namespace {

// A shard's gradient is written by its owner (FSDP's reduction), never by the backward engine, so
// its hooks would never run.
void refuse_shard_hook(const char* call, const Variable& variable) {
  const ShardInfo* shard = variable.shard_info();
  SHARDLAB_CHECK(shard == nullptr,
                 "{}: '{}' is this rank's shard of a parameter ({}): no backward reaches it, its gradient is "
                 "set when the unit's reduction completes, so the hook would never run; read grad() after "
                 "backward, or hook the module's forward",
                 call, variable.name(), shard->placement);
}

}  // namespace

void Variable::register_hook(GradHook hook) const {
  require_defined("register_hook");
  refuse_shard_hook("register_hook", *this);
  SHARDLAB_CHECK(requires_grad(), "register_hook: '{}' does not require grad, so no gradient will reach it",
                 name());
  if (is_leaf()) {
    impl_->grad_hooks.push_back(std::move(hook));
  } else {
    impl_->grad_fn->add_grad_hook(std::move(hook));
  }
}

void Variable::register_post_accumulate_grad_hook(PostAccumulateHook hook) const {
  require_defined("register_post_accumulate_grad_hook");
  refuse_shard_hook("register_post_accumulate_grad_hook", *this);
  SHARDLAB_CHECK(is_leaf() && requires_grad(),
                 "register_post_accumulate_grad_hook: '{}' is not a leaf that requires grad", name());
  impl_->post_accumulate_hooks.push_back(std::move(hook));
}

std::string Variable::str() const {
  if (impl_ == nullptr) return "undefined variable";
  std::string head = "Variable";
  if (!impl_->name.empty()) head += " '" + impl_->name + "'";
  if (impl_->grad_fn)
    head += " grad_fn=" + impl_->grad_fn->name();
  else if (impl_->requires_grad)
    head += " requires_grad";
  if (impl_->shard)
    head += fmt::format(" (shard of a parameter of shape {}: {})", shape_str(impl_->shard->full_shape),
                        impl_->shard->placement);
  return head + " " + impl_->data.str();
}

}  // namespace shardlab
