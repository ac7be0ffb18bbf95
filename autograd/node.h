// autograd/node.h: the backward graph: nodes, their edges to the inputs' nodes, and the two
// kinds of node: an op's backward function, and the gradient accumulator of a leaf.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/variable.h"
#include "core/binned_sum.h"
#include "core/tensor.h"

namespace shardlab::autograd {

class Node;

// Where the gradient for one input of a node goes; null when that input needs none.
struct Edge {
  std::shared_ptr<Node> node;
};

// Shape, dtype and device of a tensor a node produces or consumes, for checking gradients.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::f32;
  Device device;

  static TensorMeta of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }
};

class Node {
 public:
  Node(std::string name, std::vector<Edge> next_edges, TensorMeta output);
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const std::string& name() const { return name_; }
  // Creation order: later nodes run first among those ready (reverse of forward order).
  std::uint64_t sequence_nr() const { return sequence_nr_; }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  const TensorMeta& output() const { return output_; }

  // Gradients with respect to the inputs, one per next edge (undefined: no gradient).
  virtual std::vector<Tensor> apply(const Tensor& grad_output) = 0;
  // Frees what the node saved for backward, after a backward that does not retain the graph.
  virtual void release() {}

  // Hooks on the gradient of the node's output (Variable::register_hook on a non-leaf).
  void add_grad_hook(Variable::GradHook hook) { grad_hooks_.push_back(std::move(hook)); }
  const std::vector<Variable::GradHook>& grad_hooks() const { return grad_hooks_; }

 private:
  std::string name_;
  std::vector<Edge> next_edges_;
  TensorMeta output_;
  std::uint64_t sequence_nr_;
  std::vector<Variable::GradHook> grad_hooks_;
};

using Grads = std::vector<Tensor>;
using BackwardFn = std::function<Grads(const Tensor& grad_output)>;

// An op's backward: the closure the op wrote next to its forward (autograd/ops*.cpp).
class FunctionNode final : public Node {
 public:
  FunctionNode(std::string name, std::vector<Edge> next_edges, std::vector<TensorMeta> inputs,
               TensorMeta output, BackwardFn backward);
  Grads apply(const Tensor& grad_output) override;
  void release() override;

 private:
  std::vector<TensorMeta> inputs_;
  BackwardFn backward_;
  bool released_ = false;
};

struct VariableImpl {
  Tensor data;
  Tensor grad;
  Tensor grad_destination;  // leaves: where the first gradient is written (set_grad_destination)
  bool requires_grad = false;
  std::string name;
  std::shared_ptr<Node> grad_fn;               // null for leaves
  std::weak_ptr<Node> grad_accumulator;        // leaves: shared by every graph that uses them
  std::vector<Variable::GradHook> grad_hooks;  // leaves (non-leaf hooks live on grad_fn)
  std::vector<Variable::PostAccumulateHook> post_accumulate_hooks;
  std::shared_ptr<const ShardInfo> shard;    // set when this leaf is one rank's part of a parameter
  std::optional<std::string> not_trainable;  // why an optimizer must not take it (set_not_trainable)
  // Leaves under bitwise training: the sum that chunk parts of the gradient go to, from element
  // binned_first on (Variable::set_binned_grad).
  std::shared_ptr<BinnedSum> binned_grad;
  std::int64_t binned_first = 0;
};

// The sink of a leaf's gradient: runs the leaf's hooks, adds into .grad(), then runs its
// post-accumulate hooks. Holds the leaf, so a graph keeps its leaves alive.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<VariableImpl> leaf);
  Grads apply(const Tensor& grad_output) override;
  const std::string& leaf_name() const { return leaf_->name; }
  // One chunk's part of the gradient (autograd/batch_chunks.h), through the leaf's hooks into its
  // BinnedSum; the post-accumulate hooks wait for finish_deposits().
  void deposit(const Tensor& part);
  // A part that is zero but in some rows of the leaf's first dim: `values` [n, ...] are rows `rows`
  // (i64 [n]). Only those rows are added, the same bins as the whole part's (zeros add nothing); a
  // leaf with gradient hooks gets the whole part, for them to see.
  void deposit_rows(const Tensor& rows, const Tensor& values);
  // Once the engine reaches the node: runs the post-accumulate hooks if parts came since the last call.
  void finish_deposits();

 private:
  std::shared_ptr<VariableImpl> leaf_;
  bool deposited_ = false;
};

// The accumulator of a leaf that requires grad, created on first use.
std::shared_ptr<Node> grad_accumulator(const std::shared_ptr<VariableImpl>& leaf);

// Runs `hooks` on grad in order; each defined result replaces it and must keep `meta`'s shape.
Tensor run_grad_hooks(const std::vector<Variable::GradHook>& hooks, Tensor grad, const TensorMeta& meta,
                      const std::string& owner);

}  // namespace shardlab::autograd
