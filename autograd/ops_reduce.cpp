// autograd/ops_reduce.cpp: differentiable reductions: the gradient of each output element
// spreads back over the elements it reduced.
#include <algorithm>

#include "autograd/record.h"
#include "autograd/ops.h"

namespace shardlab {

using autograd::Grads;
using autograd::record;

namespace {

// The reduced dims, wrapped and sorted (empty: all), as core's reductions read them.
Dims normalized(const char* op, const Tensor& x, const Dims& dims) {
  Dims out;
  if (dims.empty()) {
    for (std::int64_t d = 0; d < x.dim(); ++d) out.push_back(d);
  }
  for (const std::int64_t d : dims) out.push_back(wrap_dim(d, x.dim(), op));
  std::sort(out.begin(), out.end());
  return out;
}

// x's shape with the reduced dims kept as size 1.
Shape keepdim_shape(const Tensor& x, const Dims& reduced) {
  Shape shape = x.shape();
  for (const std::int64_t d : reduced) shape[static_cast<std::size_t>(d)] = 1;
  return shape;
}

// A reduction's output gradient (or value) viewed with keepdim, ready to broadcast over x.
Tensor unreduce(const Tensor& t, const Tensor& x, const Dims& reduced) {
  return t.reshape(keepdim_shape(x, reduced));
}

std::int64_t reduced_count(const Tensor& x, const Dims& reduced) {
  std::int64_t count = 1;
  for (const std::int64_t d : reduced) count *= x.size(d);
  return count;
}

// max/min: elements equal to the extreme share the gradient of their output evenly.
Variable extreme(const char* name, const Variable& x, const Dims& dims, bool keepdim, bool largest) {
  const Tensor input = x.data();
  const Dims reduced = normalized(name, input, dims);
  const Tensor y = largest ? max(input, dims, keepdim) : min(input, dims, keepdim);
  return record(name, {x}, y, [input, reduced, y](const Tensor& g) -> Grads {
    const Tensor hit = eq(input, unreduce(y, input, reduced)).to(g.dtype());
    const Tensor share = div(unreduce(g, input, reduced), sum(hit, reduced, true));
    return {mul(hit, share)};
  });
}

}  // namespace

Variable sum(const Variable& x, const Dims& dims, bool keepdim) {
  const Tensor input = x.data();
  const Dims reduced = normalized("sum", input, dims);
  return record("sum", {x}, sum(input, dims, keepdim), [input, reduced](const Tensor& g) -> Grads {
    return {unreduce(g, input, reduced).expand(input.shape())};
  });
}

Variable mean(const Variable& x, const Dims& dims, bool keepdim) {
  const Tensor input = x.data();
  const Dims reduced = normalized("mean", input, dims);
  const double count = static_cast<double>(reduced_count(input, reduced));
  return record("mean", {x}, mean(input, dims, keepdim), [input, reduced, count](const Tensor& g) -> Grads {
    return {div(unreduce(g, input, reduced), count).expand(input.shape())};
  });
}

Variable sum_squares(const Variable& x, const Dims& dims, bool keepdim) {
  const Tensor input = x.data();
  const Dims reduced = normalized("sum_squares", input, dims);
  return record("sum_squares", {x}, sum_squares(input, dims, keepdim),
                [input, reduced](const Tensor& g) -> Grads {
                  return {mul(mul(unreduce(g, input, reduced), input), 2.0)};
                });
}

Variable max(const Variable& x, const Dims& dims, bool keepdim) {
  return extreme("max", x, dims, keepdim, true);
}
Variable min(const Variable& x, const Dims& dims, bool keepdim) {
  return extreme("min", x, dims, keepdim, false);
}

Variable logsumexp(const Variable& x, const Dims& dims, bool keepdim) {
  const Tensor input = x.data();
  const Dims reduced = normalized("logsumexp", input, dims);
  const Tensor y = logsumexp(input, dims, keepdim);
  // d/dx log sum exp x = softmax over the reduced elements = exp(x - y)
  return record("logsumexp", {x}, y, [input, reduced, y](const Tensor& g) -> Grads {
    return {mul(unreduce(g, input, reduced), exp(sub(input, unreduce(y, input, reduced))))};
  });
}

}  // namespace shardlab
