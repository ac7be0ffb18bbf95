// autograd/engine.h: the backward pass: runs every node once all gradients for its output
// have arrived, most recently created first among those ready.
#pragma once

#include <functional>
#include <vector>

#include "autograd/variable.h"

namespace shardlab::autograd {

// Backpropagates from `outputs` with the given output gradients (an undefined gradient
// means 1 for a one-element output). Grad mode is off while nodes run. Unless retain_graph,
// each node frees its saved tensors once it ran.
void backward(const std::vector<Variable>& outputs, const std::vector<Tensor>& grads, bool retain_graph);

// Queues `callback` to run once, when the outermost backward running on this thread has
// finished every node (FSDP finishes its reduce-scatters there). Throws outside backward.
void queue_callback(std::function<void()> callback);

// Whether a backward is running on this thread.
bool backward_running();

}  // namespace shardlab::autograd
