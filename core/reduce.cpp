// core/reduce.cpp: the reductions: dims checked and sorted, the output allocated in its dtype.
#include "core/reduce.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/elementwise.h"
#include "core/op_checks.h"

namespace shardlab {

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::mean:
      return "mean";
    case ReduceOp::sum_squares:
      return "sum_squares";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
    case ReduceOp::argmax:
      return "argmax";
  }
  __builtin_unreachable();
}

using namespace detail;

namespace {

Tensor reduce(ReduceOp op, const Tensor& x, const Dims& dims, bool keepdim, DType out_dtype) {
  const char* name = op_name(op);
  check_defined(name, x);
  const Dims reduced = reduction_dims(name, x, dims);
  Shape kept_shape = x.shape(), squeezed;
  for (std::int64_t d = 0; d < x.dim(); ++d) {
    const bool is_reduced = std::binary_search(reduced.begin(), reduced.end(), d);
    if (is_reduced) {
      const bool needs_elements = op == ReduceOp::max || op == ReduceOp::min || op == ReduceOp::argmax;
      SHARDLAB_CHECK(!(needs_elements && x.size(d) == 0),
                     "{}: cannot reduce over dimension {} of size 0 (shape {})", name, d,
                     shape_str(x.shape()));
      kept_shape[d] = 1;
    } else {
      squeezed.push_back(x.size(d));
    }
  }
  Tensor out = empty(kept_shape, TensorOptions{out_dtype, x.device()});
  if (out.numel() > 0) kernel<&Kernels::reduce>(x.device(), name)(op, x, reduced, out);
  return keepdim ? out : out.view(squeezed);
}

DType sum_dtype(DType dtype) { return is_floating(dtype) ? dtype : DType::i64; }

}  // namespace

Tensor sum(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("sum", x);
  return reduce(ReduceOp::sum, x, dims, keepdim, sum_dtype(x.dtype()));
}

Tensor sum_squares(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("sum_squares", x);
  return reduce(ReduceOp::sum_squares, x, dims, keepdim, sum_dtype(x.dtype()));
}

Tensor foreach_sum_squares(std::span<const Tensor> tensors) {
  const char* op = "foreach_sum_squares";
  SHARDLAB_CHECK(!tensors.empty(), "{}: needs at least one tensor (its device is the result's)", op);
  std::vector<Tensor> dense;  // contiguous copies of strided tensors; empty ones add nothing
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string which = fmt::format("tensor {} of {}", i, tensors.size());
    SHARDLAB_CHECK(tensors[i].defined(), "{}: {} is undefined", op, which);
    SHARDLAB_CHECK(is_floating(tensors[i].dtype()), "{}: {} has dtype {}; floating dtypes only", op, which,
                   dtype_name(tensors[i].dtype()));
    SHARDLAB_CHECK(tensors[i].device() == tensors[0].device(), "{}: {} is on {}, tensor 0 on {}", op, which,
                   tensors[i].device().str(), tensors[0].device().str());
    if (tensors[i].numel() > 0) dense.push_back(tensors[i].contiguous());
  }
  const TensorOptions options{DType::f64, tensors[0].device()};
  if (dense.empty()) return zeros({}, options);
  Tensor out = empty({}, options);  // the kernel writes it
  kernel<&Kernels::foreach_sum_squares>(out.device(), op)(dense, out);
  return out;
}

Tensor mean(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("mean", x);
  SHARDLAB_CHECK(is_floating(x.dtype()), "mean: needs a floating dtype, got {} (cast first)",
                 dtype_name(x.dtype()));
  return reduce(ReduceOp::mean, x, dims, keepdim, x.dtype());
}

Tensor max(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("max", x);
  return reduce(ReduceOp::max, x, dims, keepdim, x.dtype());
}

Tensor min(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("min", x);
  return reduce(ReduceOp::min, x, dims, keepdim, x.dtype());
}

Tensor argmax(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("argmax", x);
  return reduce(ReduceOp::argmax, x, dims, keepdim, DType::i64);
}

Tensor logsumexp(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined("logsumexp", x);
  check_floating("logsumexp", x);
  const Dims reduced = reduction_dims("logsumexp", x, dims);
  // Subtracting the max keeps exp() in range; an all -inf (or inf) row has a non-finite
  // max, which is replaced by 0 so the row gives log(0) = -inf (or inf) instead of NaN.
  const Tensor row_max = max(x, dims, true);
  const Tensor shift = where(isfinite(row_max), row_max, 0);
  Tensor out = add(log(sum(exp(sub(x, shift)), dims, true)), shift);
  if (keepdim) return out;
  Shape squeezed;
  for (std::int64_t d = 0; d < x.dim(); ++d) {
    if (!std::binary_search(reduced.begin(), reduced.end(), d)) squeezed.push_back(x.size(d));
  }
  return out.view(squeezed);
}

std::span<const OpInfo> reduction_ops() {
  static constexpr OpInfo ops[] = {
      {"sum", OpCategory::reductions},
      {"mean", OpCategory::reductions},
      {"sum_squares", OpCategory::reductions},
      {"max", OpCategory::reductions},
      {"min", OpCategory::reductions},
      {"argmax", OpCategory::reductions},
      {"foreach_sum_squares", OpCategory::reductions,
       "one launch for all tensors: a block per chunk, then a fixed-order fold"}};
  return ops;
}

}  // namespace shardlab
