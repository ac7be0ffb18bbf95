// autograd/node.cpp: graph nodes: sequence numbers, op backward closures, leaf accumulation.
#include "autograd/node.h"

#include <algorithm>
#include <utility>

#include "autograd/batch_chunks.h"
#include "core/ops.h"

namespace shardlab::autograd {

namespace {
std::atomic<std::uint64_t> next_sequence_nr{0};

// The op whose backward function runs on this thread, for deliver_gradient_part.
thread_local FunctionNode* applying = nullptr;

class Applying {
 public:
  explicit Applying(FunctionNode* node) : previous_(std::exchange(applying, node)) {}
  ~Applying() { applying = previous_; }
  Applying(const Applying&) = delete;
  Applying& operator=(const Applying&) = delete;

 private:
  FunctionNode* previous_;
};

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
  Grads grads;
  {
    const Applying scope(this);
    grads = backward_(grad_output);
  }
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
  SHARDLAB_CHECK(leaf.binned_grad == nullptr,
                 "backward: {} gathers its gradient by chunks (set_binned_grad), but got a whole one: an op "
                 "it enters does not cut its batch into chunks (BatchChunking); those that do: linear, "
                 "conv2d, embedding, rms_norm",
                 describe(leaf.name));
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

void AccumulateGrad::deposit(const Tensor& part) {
  VariableImpl& leaf = *leaf_;
  SHARDLAB_CHECK(leaf.binned_grad != nullptr,
                 "backward: an op cut its batch into chunks (BatchChunking) but {} has no BinnedSum for the "
                 "parts (Variable::set_binned_grad)",
                 describe(leaf.name));
  const TensorMeta meta = TensorMeta::of(leaf.data);
  const Tensor grad = run_grad_hooks(leaf.grad_hooks, part, meta, describe(leaf.name));
  SHARDLAB_CHECK(grad.shape() == meta.shape, "backward: a gradient part of shape {} for {} of shape {}",
                 shape_str(grad.shape()), describe(leaf.name), shape_str(meta.shape));
  leaf.binned_grad->add(grad.to(meta.dtype).contiguous().reshape({grad.numel()}), leaf.binned_first);
  deposited_ = true;
}

void AccumulateGrad::deposit_rows(const Tensor& rows, const Tensor& values) {
  VariableImpl& leaf = *leaf_;
  const TensorMeta meta = TensorMeta::of(leaf.data);
  Shape row_shape = meta.shape;
  if (!row_shape.empty()) row_shape[0] = rows.numel();
  SHARDLAB_CHECK(!meta.shape.empty() && rows.dim() == 1 && values.shape() == row_shape,
                 "backward: {} rows of a gradient part of shape {} for {} of shape {}", rows.numel(),
                 shape_str(values.shape()), describe(leaf.name), shape_str(meta.shape));
  if (!leaf.grad_hooks.empty() || leaf.binned_grad == nullptr) {
    // The hooks see the whole part (and a leaf without a BinnedSum is refused by deposit).
    return deposit(
        index_add(zeros(meta.shape, TensorOptions{values.dtype(), values.device()}), 0, rows, values));
  }
  const std::int64_t width = values.numel() / std::max<std::int64_t>(rows.numel(), 1);
  const Tensor flat = values.to(meta.dtype).contiguous().reshape({rows.numel(), width});
  const std::vector<std::int64_t> picked = rows.to(DType::i64).to_vector<std::int64_t>();
  std::vector<std::int64_t> sorted = picked;
  std::sort(sorted.begin(), sorted.end());
  SHARDLAB_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                     (sorted.empty() || (sorted.front() >= 0 && sorted.back() < meta.shape[0])),
                 "backward: the rows of a gradient part for {} of shape {} must be distinct rows of it",
                 describe(leaf.name), shape_str(meta.shape));
  for (std::size_t i = 0; i < picked.size(); ++i) {
    const auto at = static_cast<std::int64_t>(i);
    leaf.binned_grad->add(flat.narrow(0, at, 1).reshape({width}), leaf.binned_first + picked[i] * width);
  }
  deposited_ = true;
}

void AccumulateGrad::finish_deposits() {
  if (!std::exchange(deposited_, false)) return;
  const Variable variable = Variable::from_impl(leaf_);
  for (const auto& hook : leaf_->post_accumulate_hooks) hook(variable);
}

namespace {

// The AccumulateGrad that input `input` of the op being applied feeds, for its chunk parts.
AccumulateGrad& part_sink(std::size_t input) {
  SHARDLAB_CHECK(applying != nullptr, "deliver_gradient_part: called outside an op's backward function");
  SHARDLAB_CHECK(input < applying->next_edges().size() && applying->next_edges()[input].node != nullptr,
                 "{}: deliver_gradient_part for input {}, which needs no gradient", applying->name(), input);
  Node* next = applying->next_edges()[input].node.get();
  auto* accumulator = dynamic_cast<AccumulateGrad*>(next);
  SHARDLAB_CHECK(
      accumulator != nullptr,
      "{}: its input {} comes from {}, not from a parameter: under BatchChunking a parameter is the "
      "op's input itself, so that its gradient's chunk parts reach the parameter's BinnedSum",
      applying->name(), input, next->name());
  return *accumulator;
}

}  // namespace

void deliver_gradient_part(std::size_t input, const Tensor& part) { part_sink(input).deposit(part); }

void deliver_gradient_rows(std::size_t input, const Tensor& rows, const Tensor& values) {
  part_sink(input).deposit_rows(rows, values);
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
