// dist/tp/regions.cpp: tensor parallelism's f and g (dist/tp/regions.h).
#include "dist/tp/regions.h"

#include "autograd/record.h"
#include "core/ops.h"

namespace shardlab::dist {

namespace {

// `value` summed over `group`, in a new tensor (the collective works in place).
Tensor summed(const Tensor& value, Communicator& group, const std::string& tag) {
  Tensor total = value.contiguous().clone();
  group.all_reduce(total, ReduceOp::sum, tag).wait();
  return total;
}

}  // namespace

Variable copy_to_parallel_region(const Variable& x, Communicator& group, std::string tag) {
  return autograd::record("copy_to_parallel_region", {x}, x.data(),
                          [&group, tag = std::move(tag)](const Tensor& grad) -> autograd::Grads {
                            return {summed(grad, group, tag + " (input gradient)")};
                          });
}

Variable reduce_from_parallel_region(const Variable& x, Communicator& group, std::string tag) {
  return autograd::record("reduce_from_parallel_region", {x}, summed(x.data(), group, tag),
                          [](const Tensor& grad) -> autograd::Grads { return {grad}; });
}

}  // namespace shardlab::dist
