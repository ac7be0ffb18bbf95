// autograd/record.cpp: recording an op into the graph, and sum_to for broadcast gradients.
#include "autograd/record.h"

#include "autograd/anomaly.h"
#include "core/ops.h"

namespace shardlab::autograd {

Variable record(const char* name, const std::vector<Variable>& inputs, Tensor output, BackwardFn backward,
                Recording when) {
  for (const Variable& input : inputs) {
    const ShardInfo* shard = input.shard_info();
    SHARDLAB_CHECK(shard == nullptr,
                   "{}: '{}' is this rank's shard of a parameter of shape {} ({}), not the parameter: its "
                   "module's forward computes with the gathered whole; outside it, gather the values "
                   "(dist::gather_full_parameters) or update the shard's elements through data()",
                   name, input.name(), shape_str(shard->full_shape), shard->placement);
  }
  if (anomaly_detection_on()) check_forward(name, output);
  auto impl = std::make_shared<VariableImpl>();
  impl->data = std::move(output);
  bool any_requires_grad = false;
  for (const Variable& input : inputs) any_requires_grad = any_requires_grad || input.requires_grad();
  if (is_grad_enabled() && (any_requires_grad || when == Recording::always)) {
    std::vector<Edge> edges;
    std::vector<TensorMeta> metas;
    for (const Variable& input : inputs) {
      if (!input.requires_grad()) {
        edges.push_back({});
      } else {
        edges.push_back({input.is_leaf() ? grad_accumulator(input.impl()) : input.grad_fn()});
      }
      metas.push_back(input.defined() ? TensorMeta::of(input.data()) : TensorMeta{});
    }
    impl->grad_fn =
        std::make_shared<FunctionNode>(std::string(name) + "_backward", std::move(edges), std::move(metas),
                                       TensorMeta::of(impl->data), std::move(backward));
    impl->requires_grad = true;
  }
  return Variable::from_impl(std::move(impl));
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const std::int64_t lead = grad.dim() - static_cast<std::int64_t>(shape.size());
  SHARDLAB_CHECK(lead >= 0, "sum_to: gradient of shape {} has fewer dims than {}", shape_str(grad.shape()),
                 shape_str(shape));
  Dims dims;
  for (std::int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && grad.size(d) != 1)) dims.push_back(d);
  }
  const Tensor summed = dims.empty() ? grad : sum(grad, dims, true);
  return summed.reshape(shape);
}

}  // namespace shardlab::autograd
