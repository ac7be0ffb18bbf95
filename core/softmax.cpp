// core/softmax.cpp: softmax and log_softmax.
#include "core/softmax.h"

#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

namespace {
Tensor softmax_impl(const char* op, const Tensor& x, std::int64_t dim, bool log) {
  check_defined(op, x);
  check_floating(op, x);
  if (x.dim() == 0) return softmax_impl(op, x.view({1}), dim, log).view({});
  const std::int64_t d = wrap_dim(dim, x.dim(), op);
  Tensor out = empty(x.shape(), TensorOptions{x.dtype(), x.device()});
  if (out.numel() > 0) kernel<&Kernels::softmax>(x.device(), op)(x, d, log, out);
  return out;
}
}  // namespace

Tensor softmax(const Tensor& x, std::int64_t dim) { return softmax_impl("softmax", x, dim, false); }
Tensor log_softmax(const Tensor& x, std::int64_t dim) { return softmax_impl("log_softmax", x, dim, true); }

std::span<const OpInfo> softmax_ops() {
  static constexpr OpInfo ops[] = {{"softmax", OpCategory::reductions, "a block per row"},
                                   {"log_softmax", OpCategory::reductions, "a block per row"}};
  return ops;
}

}  // namespace shardlab
