// core/matmul.cpp: matmul and linear: shapes checked and broadcast, batches folded, then the GEMM.
#include "core/matmul.h"

#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

namespace {

// matmul, or linear's product with `bias` (checked by the caller) added to every row before rounding.
Tensor product(const char* op, const Tensor& a, const Tensor& b, const Tensor& bias) {
  check_defined(op, a, "first");
  check_defined(op, b, "second");
  check_same_device(op, a, b);
  SHARDLAB_CHECK(a.dim() >= 1 && b.dim() >= 1,
                 "{}: both arguments need at least 1 dimension, got shapes {} and {}", op,
                 shape_str(a.shape()), shape_str(b.shape()));
  SHARDLAB_CHECK(a.dtype() == b.dtype(), "{}: dtypes differ ({} and {}); cast one first", op,
                 dtype_name(a.dtype()), dtype_name(b.dtype()));
  check_floating(op, a);
  // 1-D operands become a row (left) or column (right) matrix; the added dim is removed
  // from the result.
  const Tensor left = a.dim() == 1 ? a.unsqueeze(0) : a;
  const Tensor right = b.dim() == 1 ? b.unsqueeze(1) : b;
  const std::int64_t m = left.size(-2), k = left.size(-1), n = right.size(-1);
  SHARDLAB_CHECK(k == right.size(-2), "{}: shapes {} and {} cannot be multiplied ({} != {})", op,
                 shape_str(a.shape()), shape_str(b.shape()), k, right.size(-2));
  const Shape batch = broadcast_shapes(op, Shape(left.shape().begin(), left.shape().end() - 2),
                                       Shape(right.shape().begin(), right.shape().end() - 2));
  const std::int64_t batch_count = shape_numel(batch);
  Shape left_shape = batch, right_shape = batch, out_shape = batch;
  left_shape.insert(left_shape.end(), {m, k});
  right_shape.insert(right_shape.end(), {k, n});
  out_shape.insert(out_shape.end(), {m, n});
  Tensor out = empty({batch_count, m, n}, TensorOptions{a.dtype(), a.device()});
  if (out.numel() > 0) {
    kernel<&Kernels::matmul>(a.device(), op)(left.expand(left_shape).reshape({batch_count, m, k}),
                                             right.expand(right_shape).reshape({batch_count, k, n}),
                                             bias.defined() ? bias.contiguous() : bias, out);
  }
  out = out.view(out_shape);
  if (a.dim() == 1) out = out.squeeze(-2);
  if (b.dim() == 1) out = out.squeeze(-1);
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) { return product("matmul", a, b, Tensor()); }

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const char* op = "linear";
  check_defined(op, x, "input");
  check_defined(op, weight, "weight");
  SHARDLAB_CHECK(weight.dim() == 2, "{}: weight must be [out, in], got shape {}", op,
                 shape_str(weight.shape()));
  SHARDLAB_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "{}: input of shape {} does not end in {}", op,
                 shape_str(x.shape()), weight.size(1));
  if (bias.defined()) {
    check_same_device(op, weight, bias);
    SHARDLAB_CHECK(bias.shape() == Shape{weight.size(0)} && bias.dtype() == weight.dtype(),
                   "{}: bias must be {} [{}] for weight {}, got {} {}", op, dtype_name(weight.dtype()),
                   weight.size(0), shape_str(weight.shape()), dtype_name(bias.dtype()),
                   shape_str(bias.shape()));
  }
  return product(op, x, weight.transpose(0, 1), bias);
}

std::span<const OpInfo> matmul_ops() {
  static constexpr OpInfo ops[] = {{"matmul", OpCategory::gemm}, {"linear", OpCategory::gemm}};
  return ops;
}

}  // namespace shardlab
