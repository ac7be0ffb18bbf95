// autograd/engine.cpp: the backward pass over the graph, and end-of-backward callbacks.
#include "autograd/engine.h"

#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "autograd/anomaly.h"
#include "autograd/node.h"
#include "core/ops.h"

namespace shardlab::autograd {
namespace {

// Callbacks queued during one backward; a stack because checkpoint() runs a backward
// inside a backward (the callbacks belong to the outermost one).
thread_local std::vector<std::vector<std::function<void()>>*> running_backwards;

class RunningBackward {
 public:
  RunningBackward() { running_backwards.push_back(&callbacks_); }
  ~RunningBackward() { running_backwards.pop_back(); }
  RunningBackward(const RunningBackward&) = delete;
  RunningBackward& operator=(const RunningBackward&) = delete;

  bool outermost() const { return running_backwards.size() == 1; }
  // Runs the queued callbacks in order, including ones they queue themselves.
  void finish() {
    for (std::size_t i = 0; i < callbacks_.size(); ++i) {
      auto callback = std::move(callbacks_[i]);
      callback();
    }
    callbacks_.clear();
  }

 private:
  std::vector<std::function<void()>> callbacks_;
};

std::string describe(const Variable& v) { return v.name().empty() ? "the output" : "'" + v.name() + "'"; }

// The node a root's gradient enters, after checking the gradient.
std::pair<std::shared_ptr<Node>, Tensor> root(const Variable& output, Tensor grad) {
  SHARDLAB_CHECK(output.defined(), "backward: the output variable is undefined");
  SHARDLAB_CHECK(output.requires_grad(),
                 "backward: {} does not require grad and has no grad_fn (no input of the computation "
                 "requires grad, or it ran under NoGradGuard)",
                 describe(output));
  if (!grad.defined()) {
    SHARDLAB_CHECK(output.numel() == 1,
                   "backward: a gradient can be implied only for a one-element output; {} has shape {}, "
                   "so pass its gradient",
                   describe(output), shape_str(output.shape()));
    grad = ones(output.shape(), TensorOptions{output.dtype(), output.device()});
  }
  SHARDLAB_CHECK(grad.shape() == output.shape() && grad.device() == output.device(),
                 "backward: gradient [{} on {}] does not match {} [{} on {}]", shape_str(grad.shape()),
                 grad.device().str(), describe(output), shape_str(output.shape()), output.device().str());
  return {output.is_leaf() ? grad_accumulator(output.impl()) : output.grad_fn(), grad};
}

// Number of gradients each reachable node waits for (edges into it from reachable nodes).
std::unordered_map<Node*, int> count_dependencies(const std::vector<std::shared_ptr<Node>>& roots) {
  std::unordered_map<Node*, int> dependencies;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (const auto& node : roots) {
    if (seen.insert(node.get()).second) stack.push_back(node.get());
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const Edge& edge : node->next_edges()) {
      if (edge.node == nullptr) continue;
      dependencies[edge.node.get()] += 1;
      if (seen.insert(edge.node.get()).second) stack.push_back(edge.node.get());
    }
  }
  return dependencies;
}

struct LaterFirst {
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

void accumulate(std::unordered_map<Node*, Tensor>& buffers, Node* node, const Tensor& grad) {
  Tensor& buffer = buffers[node];
  buffer = buffer.defined() ? add(buffer, grad) : grad;
}

}  // namespace

void backward(const std::vector<Variable>& outputs, const std::vector<Tensor>& grads, bool retain_graph) {
  SHARDLAB_CHECK(outputs.size() == grads.size(), "backward: {} outputs but {} gradients", outputs.size(),
                 grads.size());
  std::vector<std::shared_ptr<Node>> roots;
  std::unordered_map<Node*, Tensor> buffers;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    auto [node, grad] = root(outputs[i], grads[i]);
    accumulate(buffers, node.get(), grad);
    roots.push_back(std::move(node));
  }
  std::unordered_map<Node*, int> dependencies = count_dependencies(roots);

  const NoGradGuard no_grad;
  RunningBackward running;
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, LaterFirst> ready;
  std::unordered_set<Node*> queued;
  for (const auto& node : roots) {
    if (dependencies[node.get()] == 0 && queued.insert(node.get()).second) ready.push(node);
  }
  while (!ready.empty()) {
    const std::shared_ptr<Node> node = ready.top();
    ready.pop();
    // A node all of whose contributions were undefined gets none, and passes none on.
    Grads input_grads(node->next_edges().size());
    if (auto it = buffers.find(node.get()); it != buffers.end()) {
      const Tensor grad =
          run_grad_hooks(node->grad_hooks(), std::move(it->second), node->output(), node->name());
      buffers.erase(it);
      input_grads = node->apply(grad);
      if (anomaly_detection_on()) {
        for (std::size_t i = 0; i < input_grads.size(); ++i) check_gradient(*node, i, input_grads[i]);
      }
      if (!retain_graph) node->release();
    } else if (auto* accumulator = dynamic_cast<AccumulateGrad*>(node.get())) {
      accumulator->finish_deposits();  // its gradient came as chunk parts (autograd/batch_chunks.h)
    }
    for (std::size_t i = 0; i < node->next_edges().size(); ++i) {
      const std::shared_ptr<Node>& next = node->next_edges()[i].node;
      if (next == nullptr) continue;
      if (i < input_grads.size() && input_grads[i].defined()) accumulate(buffers, next.get(), input_grads[i]);
      if (--dependencies[next.get()] == 0) ready.push(next);
    }
  }
  if (running.outermost()) running.finish();
}

void queue_callback(std::function<void()> callback) {
  SHARDLAB_CHECK(!running_backwards.empty(), "queue_callback: no backward is running on this thread");
  running_backwards.front()->push_back(std::move(callback));
}

bool backward_running() { return !running_backwards.empty(); }

}  // namespace shardlab::autograd
