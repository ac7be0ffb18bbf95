// core/elementwise.cpp: the elementwise ops: checks, dtype promotion, broadcasting, then the kernel.
#include "core/elementwise.h"

#include <initializer_list>
#include <vector>

#include "core/op_checks.h"

namespace shardlab {

const char* op_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::neg:
      return "neg";
    case UnaryOp::abs:
      return "abs";
    case UnaryOp::exp:
      return "exp";
    case UnaryOp::log:
      return "log";
    case UnaryOp::log1p:
      return "log1p";
    case UnaryOp::sqrt:
      return "sqrt";
    case UnaryOp::rsqrt:
      return "rsqrt";
    case UnaryOp::tanh:
      return "tanh";
    case UnaryOp::sigmoid:
      return "sigmoid";
    case UnaryOp::relu:
      return "relu";
    case UnaryOp::silu:
      return "silu";
    case UnaryOp::gelu:
      return "gelu";
    case UnaryOp::erf:
      return "erf";
    case UnaryOp::gelu_tanh:
      return "gelu(tanh)";
    case UnaryOp::isfinite:
      return "isfinite";
  }
  __builtin_unreachable();
}

const char* op_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::add:
      return "add";
    case BinaryOp::sub:
      return "sub";
    case BinaryOp::mul:
      return "mul";
    case BinaryOp::div:
      return "div";
    case BinaryOp::pow:
      return "pow";
    case BinaryOp::maximum:
      return "maximum";
    case BinaryOp::minimum:
      return "minimum";
    case BinaryOp::relu_backward:
      return "relu_backward";
    case BinaryOp::eq:
      return "eq";
    case BinaryOp::ne:
      return "ne";
    case BinaryOp::lt:
      return "lt";
    case BinaryOp::le:
      return "le";
    case BinaryOp::gt:
      return "gt";
    case BinaryOp::ge:
      return "ge";
  }
  __builtin_unreachable();
}

using namespace detail;

namespace {

Tensor unary(UnaryOp op, const Tensor& x, DType out_dtype) {
  check_defined(op_name(op), x);
  Tensor out = empty(x.shape(), TensorOptions{out_dtype, x.device()});
  if (out.numel() > 0) kernel<&Kernels::unary>(x.device(), op_name(op))(op, x, out);
  return out;
}

// exp, log, ...: integers and bools compute in f32, as in PyTorch.
Tensor unary_floating(UnaryOp op, const Tensor& x) {
  check_defined(op_name(op), x);
  const Tensor input = is_floating(x.dtype()) ? x : x.to(DType::f32);
  return unary(op, input, input.dtype());
}

// neg, abs, relu: keep the dtype; meaningless on bool.
Tensor unary_numeric(UnaryOp op, const Tensor& x) {
  check_defined(op_name(op), x);
  SHARDLAB_CHECK(x.dtype() != DType::boolean, "{}: not defined for bool tensors", op_name(op));
  return unary(op, x, x.dtype());
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = op_name(op);
  check_defined(name, a, "first");
  check_defined(name, b, "second");
  check_same_device(name, a, b);
  const Shape shape = broadcast_shapes(name, a.shape(), b.shape());
  DType dtype = promote_types(a.dtype(), b.dtype());
  const bool arithmetic = !is_comparison(op) && op != BinaryOp::maximum && op != BinaryOp::minimum;
  SHARDLAB_CHECK(!(arithmetic && dtype == DType::boolean),
                 "{}: not defined for bool tensors (cast to an integer or float dtype first)", name);
  if (op == BinaryOp::div && !is_floating(dtype)) dtype = DType::f32;
  Tensor out = empty(shape, TensorOptions{is_comparison(op) ? DType::boolean : dtype, a.device()});
  if (out.numel() > 0) {
    kernel<&Kernels::binary>(a.device(), name)(op, a.to(dtype).expand(shape), b.to(dtype).expand(shape), out);
  }
  return out;
}

}  // namespace

// Which dtypes each code takes, in one place: the ops below are its codes by name.
Tensor apply_unary(UnaryOp op, const Tensor& x) {
  switch (op) {
    case UnaryOp::neg:
    case UnaryOp::abs:
    case UnaryOp::relu:
      return unary_numeric(op, x);
    case UnaryOp::isfinite:
      check_defined("isfinite", x);
      if (!is_floating(x.dtype())) return full(x.shape(), true, TensorOptions{DType::boolean, x.device()});
      return unary(UnaryOp::isfinite, x, DType::boolean);
    case UnaryOp::exp:
    case UnaryOp::log:
    case UnaryOp::log1p:
    case UnaryOp::sqrt:
    case UnaryOp::rsqrt:
    case UnaryOp::tanh:
    case UnaryOp::sigmoid:
    case UnaryOp::silu:
    case UnaryOp::gelu:
    case UnaryOp::gelu_tanh:
    case UnaryOp::erf:
      return unary_floating(op, x);
  }
  __builtin_unreachable();
}

Tensor neg(const Tensor& x) { return apply_unary(UnaryOp::neg, x); }
Tensor abs(const Tensor& x) { return apply_unary(UnaryOp::abs, x); }
Tensor relu(const Tensor& x) { return apply_unary(UnaryOp::relu, x); }
Tensor exp(const Tensor& x) { return apply_unary(UnaryOp::exp, x); }
Tensor log(const Tensor& x) { return apply_unary(UnaryOp::log, x); }
Tensor log1p(const Tensor& x) { return apply_unary(UnaryOp::log1p, x); }
Tensor sqrt(const Tensor& x) { return apply_unary(UnaryOp::sqrt, x); }
Tensor rsqrt(const Tensor& x) { return apply_unary(UnaryOp::rsqrt, x); }
Tensor tanh(const Tensor& x) { return apply_unary(UnaryOp::tanh, x); }
Tensor sigmoid(const Tensor& x) { return apply_unary(UnaryOp::sigmoid, x); }
Tensor silu(const Tensor& x) { return apply_unary(UnaryOp::silu, x); }
Tensor gelu(const Tensor& x, GeluApproximation approximate) {
  return apply_unary(approximate == GeluApproximation::tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu, x);
}
Tensor erf(const Tensor& x) { return apply_unary(UnaryOp::erf, x); }
Tensor isfinite(const Tensor& x) { return apply_unary(UnaryOp::isfinite, x); }

Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max) {
  check_defined("clamp", x);
  SHARDLAB_CHECK(min || max, "clamp: at least one of min and max must be given");
  Tensor out = x;
  if (min) out = maximum(out, wrap_scalar(x, *min));
  if (max) out = minimum(out, wrap_scalar(x, *max));
  return out;
}

Tensor cast(const Tensor& x, DType dtype) {
  check_defined("cast", x);
  return x.to(dtype);
}

Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::add, a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::sub, a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::mul, a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::div, a, b); }
Tensor pow(const Tensor& a, const Tensor& b) { return binary(BinaryOp::pow, a, b); }
Tensor maximum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::minimum, a, b); }
Tensor relu_backward(const Tensor& grad, const Tensor& output) {
  return binary(BinaryOp::relu_backward, grad, output);
}
Tensor eq(const Tensor& a, const Tensor& b) { return binary(BinaryOp::eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary(BinaryOp::ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary(BinaryOp::le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary(BinaryOp::gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary(BinaryOp::ge, a, b); }

#define SHARDLAB_SCALAR_OPERAND(name)      \
  Tensor name(const Tensor& a, Scalar b) { \
    check_defined(#name, a);               \
    return name(a, wrap_scalar(a, b));     \
  }
SHARDLAB_SCALAR_OPERAND(add)
SHARDLAB_SCALAR_OPERAND(sub)
SHARDLAB_SCALAR_OPERAND(mul)
SHARDLAB_SCALAR_OPERAND(div)
SHARDLAB_SCALAR_OPERAND(pow)
SHARDLAB_SCALAR_OPERAND(eq)
SHARDLAB_SCALAR_OPERAND(ne)
SHARDLAB_SCALAR_OPERAND(lt)
SHARDLAB_SCALAR_OPERAND(le)
SHARDLAB_SCALAR_OPERAND(gt)
SHARDLAB_SCALAR_OPERAND(ge)
#undef SHARDLAB_SCALAR_OPERAND

Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b) {
  check_defined("where", condition, "condition");
  check_defined("where", a, "first");
  check_defined("where", b, "second");
  SHARDLAB_CHECK(condition.dtype() == DType::boolean, "where: condition must be bool, got {}",
                 dtype_name(condition.dtype()));
  check_same_device("where", condition, a);
  check_same_device("where", a, b);
  const Shape shape =
      broadcast_shapes("where", condition.shape(), broadcast_shapes("where", a.shape(), b.shape()));
  const DType dtype = promote_types(a.dtype(), b.dtype());
  Tensor out = empty(shape, TensorOptions{dtype, a.device()});
  if (out.numel() > 0) {
    kernel<&Kernels::where>(a.device(), "where")(condition.expand(shape), a.to(dtype).expand(shape),
                                                 b.to(dtype).expand(shape), out);
  }
  return out;
}

Tensor where(const Tensor& condition, const Tensor& a, Scalar b) {
  check_defined("where", a, "first");
  return where(condition, a, wrap_scalar(a, b));
}

namespace {
const Tensor& binary_in_place(BinaryOp op, const Tensor& self, const Tensor& other) {
  const char* name = op_name(op);
  check_defined(name, self, "self");
  check_defined(name, other, "other");
  check_same_device(name, self, other);
  SHARDLAB_CHECK(self.dtype() != DType::boolean, "{}_: not defined for bool tensors", name);
  SHARDLAB_CHECK(!(op == BinaryOp::div && !is_floating(self.dtype())),
                 "{}_: true division cannot be written into {} (use a floating tensor)", name,
                 dtype_name(self.dtype()));
  // Elementwise kernels read element i before writing it, so self may be input and output.
  const Tensor operand = other.to(self.dtype()).expand(self.shape());
  if (self.numel() > 0) kernel<&Kernels::binary>(self.device(), name)(op, self, operand, self);
  return self;
}
}  // namespace

const Tensor& add_(const Tensor& self, const Tensor& other) {
  return binary_in_place(BinaryOp::add, self, other);
}
const Tensor& sub_(const Tensor& self, const Tensor& other) {
  return binary_in_place(BinaryOp::sub, self, other);
}
const Tensor& mul_(const Tensor& self, const Tensor& other) {
  return binary_in_place(BinaryOp::mul, self, other);
}
const Tensor& div_(const Tensor& self, const Tensor& other) {
  return binary_in_place(BinaryOp::div, self, other);
}
const Tensor& add_(const Tensor& self, Scalar other) {
  return add_(self, scalar_tensor(other, {DType::f64, self.device()}));
}
const Tensor& sub_(const Tensor& self, Scalar other) {
  return sub_(self, scalar_tensor(other, {DType::f64, self.device()}));
}
const Tensor& mul_(const Tensor& self, Scalar other) {
  return mul_(self, scalar_tensor(other, {DType::f64, self.device()}));
}
const Tensor& div_(const Tensor& self, Scalar other) {
  return div_(self, scalar_tensor(other, {DType::f64, self.device()}));
}

Tensor operator-(const Tensor& x) { return neg(x); }
Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, Scalar b) { return add(a, b); }
Tensor operator-(const Tensor& a, Scalar b) { return sub(a, b); }
Tensor operator*(const Tensor& a, Scalar b) { return mul(a, b); }
Tensor operator/(const Tensor& a, Scalar b) { return div(a, b); }

namespace {
template <typename Code>
std::vector<Code> codes_up_to(Code last) {
  std::vector<Code> codes;
  for (int code = 0; code <= static_cast<int>(last); ++code) codes.push_back(static_cast<Code>(code));
  return codes;
}
}  // namespace

std::span<const UnaryOp> unary_ops() {
  static const std::vector<UnaryOp> codes = codes_up_to(kLastUnaryOp);
  return codes;
}

std::span<const BinaryOp> binary_ops() {
  static const std::vector<BinaryOp> codes = codes_up_to(kLastBinaryOp);
  return codes;
}

std::span<const OpInfo> elementwise_ops() {
  static const std::vector<OpInfo> ops = [] {
    std::vector<OpInfo> all;
    for (const UnaryOp op : unary_ops()) all.push_back({op_name(op), OpCategory::elementwise});
    for (const BinaryOp op : binary_ops()) all.push_back({op_name(op), OpCategory::elementwise});
    for (const char* name : {"where", "fill", "copy", "cast"}) all.push_back({name, OpCategory::elementwise});
    return all;
  }();
  return ops;
}

}  // namespace shardlab
