// autograd/activation_checkpoint.cpp: checkpoint(): forward without a graph, recompute in backward.
#include "autograd/activation_checkpoint.h"

#include <optional>

#include "autograd/batch_chunks.h"
#include "autograd/engine.h"
#include "autograd/random_context.h"
#include "autograd/record.h"

namespace shardlab {

Variable checkpoint(const CheckpointFn& fn, const std::vector<Variable>& inputs) {
  // Keep the inputs' tensors and flags, not the Variables: the node must not hold their graphs.
  std::vector<Tensor> tensors;
  std::vector<bool> requires_grad;
  for (const Variable& input : inputs) {
    SHARDLAB_CHECK(input.defined(), "checkpoint: input {} is undefined", tensors.size());
    tensors.push_back(input.data());
    requires_grad.push_back(input.requires_grad());
  }
  const RandomContext context = random_context();
  // The recompute cuts its batch as the forward did (bitwise training's chunks), for the same parts.
  const std::optional<autograd::BatchChunks> chunks = autograd::batch_chunks();
  Tensor output;
  {
    const NoGradGuard no_grad;
    output = fn(inputs).data();
  }
  return autograd::record(
      "checkpoint", inputs, output,
      [fn, tensors, requires_grad, context, chunks](const Tensor& g) -> autograd::Grads {
        const RandomContextGuard same_randomness(context);
        const GradModeGuard recording(true);
        std::optional<autograd::BatchChunking> chunking;
        if (chunks) chunking.emplace(*chunks);
        std::vector<Variable> leaves;
        for (std::size_t i = 0; i < tensors.size(); ++i) {
          leaves.emplace_back(tensors[i], requires_grad[i]);
        }
        const Variable recomputed = fn(leaves);
        if (recomputed.requires_grad()) autograd::backward({recomputed}, {g}, false);
        autograd::Grads grads;
        for (const Variable& leaf : leaves) grads.push_back(leaf.grad());
        return grads;
      },
      // Parameters fn uses are reached through the recompute, not the inputs.
      autograd::Recording::always);
}

}  // namespace shardlab
