// autograd/activation_checkpoint.h: activation checkpointing: trade compute for memory by recomputing a
// piece of the forward pass during backward instead of keeping its activations.
#pragma once

#include <functional>
#include <vector>

#include "autograd/variable.h"

namespace shardlab {

using CheckpointFn = std::function<Variable(const std::vector<Variable>&)>;

// Runs fn(inputs) without recording a graph, so none of its intermediate tensors is kept,
// and returns its output as one node. That node's backward reruns fn with grad enabled,
// under the random context (autograd/random_context.h) of the first run so dropout draws
// the same masks, and backpropagates through the rerun: inputs get their gradients through
// the node, variables fn uses directly (parameters) get theirs during the rerun's backward.
// The gradients equal those of calling fn directly, bit for bit. With grad mode on, the
// output requires grad even when no input does (fn may use parameters that do).
Variable checkpoint(const CheckpointFn& fn, const std::vector<Variable>& inputs);

}  // namespace shardlab
