// autograd/node.cpp: graph nodes: sequence numbers, op backward closures, leaf accumulation.
#include "autograd/node.h"

#include <utility>

#include "core/ops.h"

namespace shardlab::autograd {

namespace {
std::atomic<std::uint64_t> next_sequence_nr{0};

std::string describe(const std::string& name) { return name.empty() ? "a leaf" : "leaf '" + name + "'"; }
}  // namespace

Node::Node(std::string name, std::vector<Edge> next_edges, TensorMeta output)
    : name_(std::move(name)),
      next_edges_(std::move(next_edges)),
      output_(std::move(output)),
      sequence_nr_(next_sequence_nr++) {}

Tensor run_grad_hooks(const std::vector<Variable::GradHook>& hooks, Tensor grad, const TensorMeta& meta,
                      const std::string& owner) {
  for (const auto& hook : hooks) {
    Tensor replaced = hook(grad);
    if (!replaced.defined()) continue;
    SHARDLAB_CHECK(replaced.shape() == meta.shape,
                   "gradient hook on {} returned a gradient of shape {} for a variable of shape {}", owner,
                   shape_str(replaced.shape()), shape_str(meta.shape));
    grad = std::move(replaced);
  }
  return grad;
}

FunctionNode::FunctionNode(std::string name, std::vector<Edge> next_edges, std::vector<TensorMeta> inputs,
                           TensorMeta output, BackwardFn backward)
    : Node(std::move(name), std::move(next_edges), std::move(output)),
      inputs_(std::move(inputs)),
      backward_(std::move(backward)) {}

Grads FunctionNode::apply(const Tensor& grad_output) {
  SHARDLAB_CHECK(!released_,
                 "{}: its saved tensors were freed by an earlier backward; pass retain_graph=true to the "
                 "first backward to run backward through this graph again",
                 name());
  Grads grads = backward_(grad_output);
  SHARDLAB_CHECK(grads.size() == inputs_.size(), "{} returned {} gradients for {} inputs", name(),
                 grads.size(), inputs_.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || next_edges()[i].node == nullptr) continue;
    SHARDLAB_CHECK(grads[i].shape() == inputs_[i].shape,
                   "{} returned a gradient of shape {} for input {} of shape {}", name(),
                   shape_str(grads[i].shape()), i, shape_str(inputs_[i].shape));
    // Gradients flow in the dtype of the value they belong to (mixed precision casts).
    if (grads[i].dtype() != inputs_[i].dtype) grads[i] = grads[i].to(inputs_[i].dtype);
  }
  return grads;
}

void FunctionNode::release() {
  backward_ = nullptr;
  released_ = true;
}

AccumulateGrad::AccumulateGrad(std::shared_ptr<VariableImpl> leaf)
    : Node("AccumulateGrad", {}, TensorMeta::of(leaf->data)), leaf_(std::move(leaf)) {}

Grads AccumulateGrad::apply(const Tensor& grad_output) {
  VariableImpl& leaf = *leaf_;
  const TensorMeta meta = TensorMeta::of(leaf.data);  // current: set_data may have changed it
  Tensor grad = run_grad_hooks(leaf.grad_hooks, grad_output, meta, describe(leaf.name));
  SHARDLAB_CHECK(grad.shape() == meta.shape, "backward: gradient of shape {} for {} of shape {}",
                 shape_str(grad.shape()), describe(leaf.name), shape_str(meta.shape));
  if (!leaf.grad.defined() && leaf.grad_destination.defined()) {
    leaf.grad = std::exchange(leaf.grad_destination, Tensor());
    leaf.grad.copy_(grad);
  } else if (!leaf.grad.defined()) {
    // A copy the leaf owns: backward closures often hand the same tensor to several inputs.
    leaf.grad = grad.to(meta.dtype).clone();
  } else {
    add_(leaf.grad, grad);  // in place: .grad() may be a view into a flat buffer (FSDP)
  }
  const Variable variable = Variable::from_impl(leaf_);
  for (const auto& hook : leaf.post_accumulate_hooks) hook(variable);
  return {};
}

std::shared_ptr<Node> grad_accumulator(const std::shared_ptr<VariableImpl>& leaf) {
  std::shared_ptr<Node> accumulator = leaf->grad_accumulator.lock();
  if (accumulator == nullptr) {
    accumulator = std::make_shared<AccumulateGrad>(leaf);
    leaf->grad_accumulator = accumulator;
  }
  return accumulator;
}

}  // namespace shardlab::autograd
