// autograd/record.h: how an op records itself: its forward result plus the closure that
// computes its inputs' gradients, written together in one place (autograd/ops*.cpp).
//
//   Variable mul(const Variable& a, const Variable& b) {
//     const Tensor x = a.data(), y = b.data();
//     return record("mul", {a, b}, mul(x, y), [=](const Tensor& g) -> Grads {
//       return {sum_to(mul(g, y), x.shape()), sum_to(mul(g, x), y.shape())};
//     });
//   }
#pragma once

#include <vector>

#include "autograd/node.h"
#include "autograd/variable.h"

namespace shardlab::autograd {

// When an op's output is part of the graph (grad mode on, in both cases):
enum class Recording : unsigned char {
  if_inputs_require_grad,  // some input requires grad (every op)
  always,                  // even if none does: the op reaches variables that are not inputs
};

// A Variable holding `output`. When recorded, it gets a node named "<name>_backward" whose
// backward returns one gradient per input (undefined for inputs that need none); otherwise
// `backward` is dropped with whatever it captured.
Variable record(const char* name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward,
                Recording when = Recording::if_inputs_require_grad);

// Sums a broadcast gradient back to `shape` (the adjoint of broadcasting).
Tensor sum_to(const Tensor& grad, const Shape& shape);

}  // namespace shardlab::autograd
