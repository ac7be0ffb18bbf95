// core/ops.cpp: the op layer: argument checks with clear errors, dtype promotion,
// broadcasting, output allocation, then the device's kernel (core/kernels.h). Ops that are
// compositions of others (clamp, logsumexp, triu, cat, ...) are written here once for all
// devices.
#include "core/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/call_log.h"
#include "core/kernels.h"
#include "core/profile.h"

namespace shardlab {
namespace {

template <auto Entry>
constexpr bool is_index_check() {
  if constexpr (std::is_same_v<decltype(Entry), decltype(&Kernels::check_index)>) {
    return Entry == &Kernels::check_index;
  } else {
    return false;
  }
}

// The device's kernel for `Entry`, or an Error naming the op and device; the call is timed
// under `op` while the profiler is on.
template <auto Entry>
auto kernel(Device device, const char* op) {
  auto fn = kernels_for(device).*Entry;
  SHARDLAB_CHECK(fn != nullptr, "{}: not supported on {} (no kernel for it in this build)", op, device.str());
  return [fn, op, device](auto&&... args) {
    // The call log names an index check for what it is; the profiler counts it to the op it serves.
    const call_log::Scope logged(is_index_check<Entry>() ? "check_index" : op, device, args...);
    const profile::KernelTimer timer(op, device);
    return fn(std::forward<decltype(args)>(args)...);
  };
}

void check_defined(const char* op, const Tensor& t, const char* what = "input") {
  SHARDLAB_CHECK(t.defined(), "{}: {} tensor is undefined", op, what);
}

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  SHARDLAB_CHECK(a.device() == b.device(), "{}: tensors are on different devices ({} and {})", op,
                 a.device().str(), b.device().str());
}

void check_floating(const char* op, const Tensor& t) {
  SHARDLAB_CHECK(is_floating(t.dtype()), "{}: needs a floating dtype, got {}", op, dtype_name(t.dtype()));
}

void check_index_dtype(const char* op, const Tensor& index) {
  SHARDLAB_CHECK(index.dtype() == DType::i64 || index.dtype() == DType::i32,
                 "{}: indices must be i64 or i32, got {}", op, dtype_name(index.dtype()));
}

Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b) {
  const std::size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    const std::int64_t sa = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    const std::int64_t sb = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    SHARDLAB_CHECK(sa == sb || sa == 1 || sb == 1,
                   "{}: shapes {} and {} cannot be broadcast (dimension {}: {} vs {})", op, shape_str(a),
                   shape_str(b), i, sa, sb);
    out[i] = sa == 1 ? sb : sa;
  }
  return out;
}

// A Scalar operand as a 0-d tensor next to `like`: it keeps like's dtype unless it is
// floating and like is not (then f32), or it is a number and like is bool (then i64).
Tensor wrap_scalar(const Tensor& like, Scalar value) {
  DType dtype = like.dtype();
  if (value.is_floating() && !is_floating(dtype)) dtype = DType::f32;
  if (value.kind() == Scalar::Kind::integral && dtype == DType::boolean) dtype = DType::i64;
  return scalar_tensor(value, TensorOptions{dtype, like.device()});
}

// Validated dims of a reduction: wrapped, sorted, distinct; empty means all.
Dims reduction_dims(const char* op, const Tensor& x, const Dims& dims) {
  Dims out;
  if (dims.empty()) {
    for (std::int64_t d = 0; d < x.dim(); ++d) out.push_back(d);
    return out;
  }
  for (const std::int64_t d : dims) out.push_back(wrap_dim(d, x.dim(), op));
  std::sort(out.begin(), out.end());
  SHARDLAB_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(),
                 "{}: dims {} name a dimension twice", op, shape_str(dims));
  return out;
}

// Index tensors as contiguous i64, with every value checked against [0, size) by the device
// (Kernels::check_index: on CUDA without the host waiting). op and what are string literals.
Tensor checked_index(const char* op, const Tensor& index, std::int64_t size, const char* what) {
  check_index_dtype(op, index);
  Tensor out = index.to(DType::i64).contiguous();
  if (out.numel() > 0) kernel<&Kernels::check_index>(out.device(), op)(op, out, size, what);
  return out;
}

// Class targets as contiguous i64, each checked against [0, classes) unless it is ignore_index
// (which becomes 0).
Tensor checked_targets(const char* op, const Tensor& targets, std::int64_t ignore_index,
                       std::int64_t classes) {
  check_index_dtype(op, targets);
  return checked_index(op, where(ne(targets, ignore_index), targets.to(DType::i64), 0), classes,
                       "the classes (ignore_index aside)");
}

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

// The dtype of a row statistic saved for backward: f32 for halves.
DType logsumexp_dtype(DType logits) { return logits == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace

// --- elementwise ---------------------------------------------------------------------------

Tensor neg(const Tensor& x) { return unary_numeric(UnaryOp::neg, x); }
Tensor abs(const Tensor& x) { return unary_numeric(UnaryOp::abs, x); }
Tensor relu(const Tensor& x) { return unary_numeric(UnaryOp::relu, x); }
Tensor exp(const Tensor& x) { return unary_floating(UnaryOp::exp, x); }
Tensor log(const Tensor& x) { return unary_floating(UnaryOp::log, x); }
Tensor sqrt(const Tensor& x) { return unary_floating(UnaryOp::sqrt, x); }
Tensor rsqrt(const Tensor& x) { return unary_floating(UnaryOp::rsqrt, x); }
Tensor tanh(const Tensor& x) { return unary_floating(UnaryOp::tanh, x); }
Tensor sigmoid(const Tensor& x) { return unary_floating(UnaryOp::sigmoid, x); }
Tensor silu(const Tensor& x) { return unary_floating(UnaryOp::silu, x); }
Tensor gelu(const Tensor& x, GeluApproximation approximate) {
  return unary_floating(approximate == GeluApproximation::tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu, x);
}

Tensor erf(const Tensor& x) { return unary_floating(UnaryOp::erf, x); }

Tensor isfinite(const Tensor& x) {
  check_defined("isfinite", x);
  if (!is_floating(x.dtype())) return full(x.shape(), true, TensorOptions{DType::boolean, x.device()});
  return unary(UnaryOp::isfinite, x, DType::boolean);
}

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

// --- reductions ------------------------------------------------------------------------------

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

// --- matmul ------------------------------------------------------------------------------------

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

// --- softmax -------------------------------------------------------------------------------

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

// --- attention ---------------------------------------------------------------------------------

void check_attention_operands(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& padding) {
  for (const auto& [x, what] : {std::pair{&q, "q [B, H, T, D]"}, std::pair{&k, "k [B, Hkv, S, D]"},
                                std::pair{&v, "v [B, Hkv, S, D]"}}) {
    SHARDLAB_CHECK(x->defined(), "{}: {} is undefined", op, what);
    SHARDLAB_CHECK(x->dim() == 4, "{}: {} must be 4-D, got shape {}", op, what, shape_str(x->shape()));
  }
  const std::string shapes =
      fmt::format("q {}, k {}, v {}", shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  const std::int64_t batch = q.size(0), heads = q.size(1), kv_heads = k.size(1), keys = k.size(2);
  SHARDLAB_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "{}: dtypes differ ({}, {} and {})", op,
                 dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype()));
  SHARDLAB_CHECK(k.size(0) == batch && v.size(0) == batch, "{}: batch sizes differ ({})", op, shapes);
  SHARDLAB_CHECK(k.size(3) == q.size(3), "{}: q and k have different head dims ({} != {}; {})", op, q.size(3),
                 k.size(3), shapes);
  SHARDLAB_CHECK(v.size(1) == kv_heads, "{}: k and v have different numbers of heads ({} != {}; {})", op,
                 kv_heads, v.size(1), shapes);
  SHARDLAB_CHECK(v.size(2) == keys, "{}: k and v have different lengths ({} != {}; {})", op, keys, v.size(2),
                 shapes);
  SHARDLAB_CHECK(kv_heads > 0 && heads % kv_heads == 0,
                 "{}: {} query heads are not a multiple of {} key/value heads ({})", op, heads, kv_heads,
                 shapes);
  check_same_device(op, q, k);
  check_same_device(op, q, v);
  if (!padding.defined()) return;
  check_same_device(op, q, padding);
  SHARDLAB_CHECK(padding.dtype() == DType::boolean,
                 "{}: padding must be bool (true marks a padding token), got {}", op,
                 dtype_name(padding.dtype()));
  const Shape expected{batch, keys};
  SHARDLAB_CHECK(padding.shape() == expected, "{}: padding of shape {} is not [B, S] = {} ({})", op,
                 shape_str(padding.shape()), shape_str(expected), shapes);
}

namespace {

// The operands of a fused attention op, checked, with what the kernels expect: operands on one
// device, floating, and the scale resolved.
AttentionParams checked_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionParams& params) {
  check_attention_operands(op, q, k, v, params.padding);
  check_floating(op, q);
  AttentionParams resolved = params;
  if (params.padding.defined()) resolved.padding = params.padding.contiguous();
  resolved.scale = params.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  return resolved;
}

// Checks that `t` has `shape`, `dtype` and q's device, for attention_backward's extra operands.
void check_attention_tensor(const char* op, const char* what, const Tensor& t, const Tensor& q,
                            const Shape& shape, DType dtype) {
  SHARDLAB_CHECK(t.defined(), "{}: {} is undefined", op, what);
  check_same_device(op, q, t);
  SHARDLAB_CHECK(t.shape() == shape && t.dtype() == dtype, "{}: {} must be {} {}, got {} {}", op, what,
                 shape_str(shape), dtype_name(dtype), shape_str(t.shape()), dtype_name(t.dtype()));
}

// Whether the device's attention and rotary kernels read `t` where it lies (Kernels::strided_heads):
// a transposed view of [B, T, H, D] then needs no copy.
bool takes_heads_in_place(const Tensor& t) {
  const auto takes = kernels_for(t.device()).strided_heads;
  return takes != nullptr && takes(t);
}
// `t` as those kernels read it: where it lies, or a contiguous copy.
Tensor head_rows(const Tensor& t) { return takes_heads_in_place(t) ? t : t.contiguous(); }

// An output of `shape` for those kernels: in the layout of the operand `like` where they take strided
// heads (an output of q in [B, T, H, D] memory transposes back for free), else contiguous.
Tensor empty_for_heads(const Tensor& like, const Shape& shape) {
  const TensorOptions options{like.dtype(), like.device()};
  return takes_heads_in_place(like) ? empty_in_layout_of(like, shape, options) : empty(shape, options);
}

bool in_f32(const Tensor& q, const Tensor& v) {
  return attention_kernel(q.dtype(), q.device(), q.size(3), v.size(3)) == AttentionKernel::in_f32;
}

}  // namespace

AttentionKernel attention_kernel(DType dtype, Device device, std::int64_t head_dim, std::int64_t value_dim) {
  if (dtype != DType::bf16 && dtype != DType::f16) return AttentionKernel::fused;
  const bool flash = device.is_cuda() && head_dim == value_dim && (head_dim == 64 || head_dim == 128);
  return flash ? AttentionKernel::flash : AttentionKernel::in_f32;
}

AttentionResult attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionParams& params) {
  const char* op = "attention_forward";
  const AttentionParams resolved = checked_attention(op, q, k, v, params);
  if (in_f32(q, v)) {
    const call_log::Scope logged(op, q.device(), q, k, v,
                                 resolved);  // the call as made, not its widened parts
    const AttentionResult wide =
        attention_forward(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), resolved);
    return {wide.out.to(q.dtype()), wide.logsumexp};
  }
  AttentionResult result{
      empty_for_heads(q, {q.size(0), q.size(1), q.size(2), v.size(3)}),
      empty({q.size(0), q.size(1), q.size(2)}, TensorOptions{logsumexp_dtype(q.dtype()), q.device()})};
  if (result.logsumexp.numel() > 0) {
    kernel<&Kernels::attention_forward>(q.device(), op)(head_rows(q), head_rows(k), head_rows(v), resolved,
                                                        result);
  }
  return result;
}

AttentionGrads attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionResult& forward, const AttentionParams& params) {
  const char* op = "attention_backward";
  const AttentionParams resolved = checked_attention(op, q, k, v, params);
  const Shape out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  check_attention_tensor(op, "grad_out", grad_out, q, out_shape, q.dtype());
  check_attention_tensor(op, "out", forward.out, q, out_shape, q.dtype());
  check_attention_tensor(op, "logsumexp", forward.logsumexp, q, {q.size(0), q.size(1), q.size(2)},
                         logsumexp_dtype(q.dtype()));
  if (in_f32(q, v)) {
    const call_log::Scope logged(op, q.device(), grad_out, q, k, v, resolved);
    const auto wide = [](const Tensor& t) { return t.to(DType::f32); };
    const AttentionGrads grads = attention_backward(wide(grad_out), wide(q), wide(k), wide(v),
                                                    {wide(forward.out), forward.logsumexp}, resolved);
    return {grads.q.to(q.dtype()), grads.k.to(q.dtype()), grads.v.to(q.dtype())};
  }
  const auto zeros_as = [](const Tensor& like) {
    const Tensor grad = empty_for_heads(like, like.shape());
    if (grad.numel() > 0) grad.fill_(0);
    return grad;
  };
  AttentionGrads grads{zeros_as(q), zeros_as(k), zeros_as(v)};
  if (grad_out.numel() > 0 && k.size(2) > 0) {
    kernel<&Kernels::attention_backward>(q.device(), op)(
        head_rows(grad_out), head_rows(q), head_rows(k), head_rows(v),
        AttentionResult{head_rows(forward.out), forward.logsumexp.contiguous()}, resolved, grads);
  }
  return grads;
}

// --- convolution and pooling -------------------------------------------------------------------

namespace {

std::int64_t conv_output_size(const char* op, std::int64_t input, std::int64_t kernel, std::int64_t stride,
                              std::int64_t padding) {
  const std::int64_t span = input + 2 * padding - kernel;
  SHARDLAB_CHECK(span >= 0, "{}: kernel size {} does not fit input size {} with padding {}", op, kernel,
                 input, padding);
  return span / stride + 1;
}

void check_conv_params(const char* op, Conv2dParams p) {
  SHARDLAB_CHECK(p.stride >= 1, "{}: stride must be at least 1, got {}", op, p.stride);
  SHARDLAB_CHECK(p.padding >= 0, "{}: padding must be non-negative, got {}", op, p.padding);
}

void check_rank4(const char* op, const Shape& shape, const char* what) {
  SHARDLAB_CHECK(shape.size() == 4, "{}: {} must be 4-D, got shape {}", op, what, shape_str(shape));
}

// Output shape of conv2d, after checking input [N, C, H, W] against weight [O, C, KH, KW].
Shape conv_output_shape(const char* op, const Shape& input, const Shape& weight, Conv2dParams p) {
  check_conv_params(op, p);
  check_rank4(op, input, "input [N, C, H, W]");
  check_rank4(op, weight, "weight [O, C, KH, KW]");
  SHARDLAB_CHECK(input[1] == weight[1], "{}: input {} has {} channels but weight {} expects {}", op,
                 shape_str(input), input[1], shape_str(weight), weight[1]);
  return {input[0], weight[0], conv_output_size(op, input[2], weight[2], p.stride, p.padding),
          conv_output_size(op, input[3], weight[3], p.stride, p.padding)};
}

void check_conv_operands(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, a, b);
  check_floating(op, a);
  SHARDLAB_CHECK(a.dtype() == b.dtype(), "{}: dtypes differ ({} and {})", op, dtype_name(a.dtype()),
                 dtype_name(b.dtype()));
}

void check_grad_shape(const char* op, const Tensor& grad, const Shape& expected) {
  SHARDLAB_CHECK(grad.shape() == expected, "{}: grad_output has shape {} but the forward output was {}", op,
                 shape_str(grad.shape()), shape_str(expected));
}

}  // namespace

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams params) {
  check_defined("conv2d", input);
  check_defined("conv2d", weight, "weight");
  check_conv_operands("conv2d", input, weight);
  const Shape out_shape = conv_output_shape("conv2d", input.shape(), weight.shape(), params);
  if (bias.defined()) {
    check_conv_operands("conv2d", input, bias);
    SHARDLAB_CHECK(bias.shape() == Shape{weight.size(0)},
                   "conv2d: bias has shape {} but weight {} needs [{}]", shape_str(bias.shape()),
                   shape_str(weight.shape()), weight.size(0));
  }
  Tensor out = empty(out_shape, TensorOptions{input.dtype(), input.device()});
  if (out.numel() > 0) {
    kernel<&Kernels::conv2d>(input.device(), "conv2d")(
        input.contiguous(), weight.contiguous(), bias.defined() ? bias.contiguous() : bias, params, out);
  }
  return out;
}

Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight, const Shape& input_shape,
                             Conv2dParams params) {
  const char* op = "conv2d_backward_input";
  check_defined(op, grad_output, "grad_output");
  check_defined(op, weight, "weight");
  check_conv_operands(op, grad_output, weight);
  check_grad_shape(op, grad_output, conv_output_shape(op, input_shape, weight.shape(), params));
  Tensor grad_input = zeros(input_shape, TensorOptions{weight.dtype(), weight.device()});
  if (grad_output.numel() > 0) {
    kernel<&Kernels::conv2d_backward_input>(weight.device(), op)(grad_output.contiguous(),
                                                                 weight.contiguous(), params, grad_input);
  }
  return grad_input;
}

Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, const Shape& weight_shape,
                              Conv2dParams params) {
  const char* op = "conv2d_backward_weight";
  check_defined(op, grad_output, "grad_output");
  check_defined(op, input);
  check_conv_operands(op, grad_output, input);
  check_grad_shape(op, grad_output, conv_output_shape(op, input.shape(), weight_shape, params));
  Tensor grad_weight = zeros(weight_shape, TensorOptions{input.dtype(), input.device()});
  if (grad_output.numel() > 0) {
    kernel<&Kernels::conv2d_backward_weight>(input.device(), op)(grad_output.contiguous(), input.contiguous(),
                                                                 params, grad_weight);
  }
  return grad_weight;
}

MaxPool2dResult max_pool2d(const Tensor& input, MaxPool2dParams params) {
  const char* op = "max_pool2d";
  check_defined(op, input);
  check_rank4(op, input.shape(), "input [N, C, H, W]");
  SHARDLAB_CHECK(params.kernel_size >= 1, "{}: kernel_size must be at least 1, got {}", op,
                 params.kernel_size);
  if (params.stride == 0) params.stride = params.kernel_size;
  SHARDLAB_CHECK(params.stride >= 1, "{}: stride must be at least 1, got {}", op, params.stride);
  SHARDLAB_CHECK(params.padding >= 0 && 2 * params.padding <= params.kernel_size,
                 "{}: padding must be between 0 and half the kernel size {}, got {}", op, params.kernel_size,
                 params.padding);
  SHARDLAB_CHECK(input.dtype() != DType::boolean, "{}: not defined for bool tensors", op);
  const Shape out_shape{
      input.size(0), input.size(1),
      conv_output_size(op, input.size(2), params.kernel_size, params.stride, params.padding),
      conv_output_size(op, input.size(3), params.kernel_size, params.stride, params.padding)};
  MaxPool2dResult result{empty(out_shape, TensorOptions{input.dtype(), input.device()}),
                         empty(out_shape, TensorOptions{DType::i64, input.device()})};
  if (result.values.numel() > 0) {
    kernel<&Kernels::max_pool2d>(input.device(), op)(input.contiguous(), params, result.values,
                                                     result.indices);
  }
  return result;
}

Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& indices, const Shape& input_shape) {
  const char* op = "max_pool2d_backward";
  check_defined(op, grad_output, "grad_output");
  check_defined(op, indices, "indices");
  check_same_device(op, grad_output, indices);
  check_rank4(op, input_shape, "input shape");
  SHARDLAB_CHECK(indices.dtype() == DType::i64, "{}: indices must be i64, got {}", op,
                 dtype_name(indices.dtype()));
  SHARDLAB_CHECK(grad_output.shape() == indices.shape() && grad_output.dim() == 4 &&
                     grad_output.size(0) == input_shape[0] && grad_output.size(1) == input_shape[1],
                 "{}: grad_output {} and indices {} do not match input {}", op,
                 shape_str(grad_output.shape()), shape_str(indices.shape()), shape_str(input_shape));
  // The kernel writes every element: zeros, then each window's gradient at its argmax.
  Tensor grad_input = empty(input_shape, TensorOptions{grad_output.dtype(), grad_output.device()});
  if (grad_input.numel() > 0) {
    kernel<&Kernels::max_pool2d_backward>(grad_output.device(), op)(
        grad_output.contiguous(),
        checked_index(op, indices, input_shape[2] * input_shape[3], "an input plane"), grad_input);
  }
  return grad_input;
}

// --- indexing ----------------------------------------------------------------------------------

Tensor index_select(const Tensor& x, std::int64_t dim, const Tensor& index) {
  const char* op = "index_select";
  check_defined(op, x);
  check_defined(op, index, "index");
  check_same_device(op, x, index);
  SHARDLAB_CHECK(index.dim() <= 1, "{}: index must be 1-D, got shape {}", op, shape_str(index.shape()));
  const std::int64_t d = wrap_dim(dim, x.dim(), op);
  const Tensor flat_index = checked_index(op, index.reshape({-1}), x.size(d), "the dimension");
  Shape shape = x.shape();
  shape[d] = flat_index.numel();
  Tensor out = empty(shape, TensorOptions{x.dtype(), x.device()});
  if (out.numel() > 0) kernel<&Kernels::index_select>(x.device(), op)(x.contiguous(), d, flat_index, out);
  return out;
}

namespace {
// gather/scatter_add: index has data's rank and is no larger than `bound` outside `dim`.
void check_scatter_shapes(const char* op, const Tensor& index, const Tensor& bound, std::int64_t dim,
                          bool including_dim) {
  SHARDLAB_CHECK(index.dim() == bound.dim(), "{}: index {} must have the same rank as {}", op,
                 shape_str(index.shape()), shape_str(bound.shape()));
  for (std::int64_t d = 0; d < index.dim(); ++d) {
    if (d == dim && !including_dim) continue;
    SHARDLAB_CHECK(index.size(d) <= bound.size(d), "{}: index {} is larger than {} in dimension {}", op,
                   shape_str(index.shape()), shape_str(bound.shape()), d);
  }
}
}  // namespace

Tensor gather(const Tensor& x, std::int64_t dim, const Tensor& index) {
  const char* op = "gather";
  check_defined(op, x);
  check_defined(op, index, "index");
  check_same_device(op, x, index);
  const std::int64_t d = wrap_dim(dim, x.dim(), op);
  check_scatter_shapes(op, index, x, d, false);
  const Tensor checked = checked_index(op, index, x.size(d), "the dimension");
  Tensor out = empty(index.shape(), TensorOptions{x.dtype(), x.device()});
  if (out.numel() > 0) kernel<&Kernels::gather>(x.device(), op)(x.contiguous(), d, checked, out);
  return out;
}

Tensor scatter_add(const Tensor& self, std::int64_t dim, const Tensor& index, const Tensor& src) {
  const char* op = "scatter_add";
  check_defined(op, self);
  check_defined(op, index, "index");
  check_defined(op, src, "src");
  check_same_device(op, self, index);
  check_same_device(op, self, src);
  const std::int64_t d = wrap_dim(dim, self.dim(), op);
  check_scatter_shapes(op, index, self, d, false);
  check_scatter_shapes(op, index, src, d, true);
  const Tensor checked = checked_index(op, index, self.size(d), "the dimension");
  Tensor out = self.clone();
  if (checked.numel() > 0) {
    kernel<&Kernels::scatter_add>(self.device(), op)(out, d, checked, src.to(self.dtype()).contiguous());
  }
  return out;
}

Tensor index_add(const Tensor& self, std::int64_t dim, const Tensor& index, const Tensor& src) {
  const char* op = "index_add";
  check_defined(op, self);
  check_defined(op, index, "index");
  check_defined(op, src, "src");
  check_same_device(op, self, index);
  check_same_device(op, self, src);
  SHARDLAB_CHECK(index.dim() <= 1, "{}: index must be 1-D, got shape {}", op, shape_str(index.shape()));
  const std::int64_t d = wrap_dim(dim, self.dim(), op);
  Shape expected = self.shape();
  expected[d] = index.numel();
  SHARDLAB_CHECK(src.shape() == expected, "{}: src has shape {} but self {} with {} indices needs {}", op,
                 shape_str(src.shape()), shape_str(self.shape()), index.numel(), shape_str(expected));
  const Tensor checked = checked_index(op, index.reshape({-1}), self.size(d), "the dimension");
  Tensor out = self.clone();
  if (src.numel() > 0) {
    kernel<&Kernels::index_add>(self.device(), op)(out, d, checked, src.to(self.dtype()).contiguous());
  }
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  const char* op = "embedding";
  check_defined(op, weight, "weight");
  check_defined(op, indices, "indices");
  check_same_device(op, weight, indices);
  SHARDLAB_CHECK(weight.dim() == 2, "{}: weight must be 2-D [num_embeddings, dim], got {}", op,
                 shape_str(weight.shape()));
  // Checked once, as embedding's: the row gather below reads them as they are.
  const Tensor rows = checked_index(op, indices.reshape({-1}), weight.size(0), "the embedding table");
  Shape shape = indices.shape();
  shape.push_back(weight.size(1));
  Tensor out = empty({rows.numel(), weight.size(1)}, TensorOptions{weight.dtype(), weight.device()});
  if (out.numel() > 0) kernel<&Kernels::index_select>(weight.device(), op)(weight.contiguous(), 0, rows, out);
  return out.view(shape);
}

Tensor embedding_backward(const Tensor& grad, const Tensor& indices, std::int64_t num_embeddings) {
  const char* op = "embedding_backward";
  check_defined(op, grad, "grad");
  check_defined(op, indices, "indices");
  SHARDLAB_CHECK(grad.dim() == indices.dim() + 1 &&
                     Shape(grad.shape().begin(), grad.shape().end() - 1) == indices.shape(),
                 "{}: grad {} does not match indices {} plus an embedding dim", op, shape_str(grad.shape()),
                 shape_str(indices.shape()));
  check_same_device(op, grad, indices);
  SHARDLAB_CHECK(num_embeddings >= 0, "{}: num_embeddings must be non-negative, got {}", op, num_embeddings);
  const Tensor rows = checked_index(op, indices.reshape({-1}), num_embeddings, "the embedding table");
  const std::int64_t width = grad.size(-1);
  // The rows' gradients added into a zero table in place: no second check, no copy of the table.
  const Tensor table = zeros({num_embeddings, width}, TensorOptions{grad.dtype(), grad.device()});
  if (rows.numel() > 0 && width > 0) {
    kernel<&Kernels::index_add>(grad.device(), op)(table, 0, rows, grad.reshape({-1, width}).contiguous());
  }
  return table;
}

// --- joining and splitting -------------------------------------------------------------------

Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim) {
  SHARDLAB_CHECK(!tensors.empty(), "cat: needs at least one tensor");
  const Tensor& first = tensors.front();
  check_defined("cat", first);
  const std::int64_t d = wrap_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  shape[d] = 0;
  DType dtype = first.dtype();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    check_defined("cat", t);
    check_same_device("cat", first, t);
    bool matches = t.dim() == first.dim();
    for (std::int64_t k = 0; matches && k < t.dim(); ++k) matches = k == d || t.size(k) == first.size(k);
    SHARDLAB_CHECK(matches,
                   "cat: tensor {} has shape {} but tensor 0 has {} (they must match except in dimension {})",
                   i, shape_str(t.shape()), shape_str(first.shape()), d);
    shape[d] += t.size(d);
    dtype = promote_types(dtype, t.dtype());
  }
  Tensor out = empty(shape, TensorOptions{dtype, first.device()});
  std::int64_t offset = 0;
  for (const Tensor& t : tensors) {
    out.narrow(d, offset, t.size(d)).copy_(t);
    offset += t.size(d);
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim) {
  SHARDLAB_CHECK(!tensors.empty(), "stack: needs at least one tensor");
  check_defined("stack", tensors.front());
  const std::int64_t d = wrap_dim(dim, tensors.front().dim() + 1, "stack");
  std::vector<Tensor> expanded;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_defined("stack", tensors[i]);
    SHARDLAB_CHECK(tensors[i].shape() == tensors.front().shape(),
                   "stack: tensor {} has shape {} but tensor 0 has {}", i, shape_str(tensors[i].shape()),
                   shape_str(tensors.front().shape()));
    expanded.push_back(tensors[i].unsqueeze(d));
  }
  return cat(expanded, d);
}

std::vector<Tensor> split(const Tensor& x, std::int64_t split_size, std::int64_t dim) {
  check_defined("split", x);
  const std::int64_t d = wrap_dim(dim, x.dim(), "split");
  SHARDLAB_CHECK(split_size > 0, "split: split_size must be positive, got {}", split_size);
  std::vector<Tensor> pieces;
  for (std::int64_t start = 0; start < x.size(d); start += split_size) {
    pieces.push_back(x.narrow(d, start, std::min(split_size, x.size(d) - start)));
  }
  return pieces;
}

std::vector<Tensor> chunk(const Tensor& x, std::int64_t chunks, std::int64_t dim) {
  check_defined("chunk", x);
  SHARDLAB_CHECK(chunks > 0, "chunk: number of chunks must be positive, got {}", chunks);
  const std::int64_t size = x.size(wrap_dim(dim, x.dim(), "chunk"));
  return split(x, std::max<std::int64_t>(1, (size + chunks - 1) / chunks), dim);
}

namespace {
// Keeps x where (column - row) compares true against `diagonal` in the last two dims.
Tensor triangle(const char* op, const Tensor& x, std::int64_t diagonal, bool upper) {
  check_defined(op, x);
  SHARDLAB_CHECK(x.dim() >= 2, "{}: needs at least 2 dims, got shape {}", op, shape_str(x.shape()));
  const TensorOptions options{DType::i64, x.device()};
  const Tensor rows = arange(x.size(-2), options).unsqueeze(1);
  const Tensor columns = arange(x.size(-1), options).unsqueeze(0);
  const Tensor offset = sub(columns, rows);
  const Tensor keep = upper ? ge(offset, diagonal) : le(offset, diagonal);
  return where(keep, x, zeros({}, TensorOptions{x.dtype(), x.device()}));
}
}  // namespace

Tensor triu(const Tensor& x, std::int64_t diagonal) { return triangle("triu", x, diagonal, true); }
Tensor tril(const Tensor& x, std::int64_t diagonal) { return triangle("tril", x, diagonal, false); }

// --- optimizer steps -----------------------------------------------------------------------------

namespace {
// A fused optimizer step's parameter is floating; its gradient and state tensors match it.
void check_optimizer_operands(const char* op, const Tensor& param,
                              std::initializer_list<const Tensor*> others) {
  check_defined(op, param, "param");
  check_floating(op, param);
  for (const Tensor* t : others) {
    check_defined(op, *t, "state");
    check_same_device(op, param, *t);
    SHARDLAB_CHECK(t->shape() == param.shape() && t->dtype() == param.dtype(),
                   "{}: every operand must match the parameter [{} {}], got [{} {}]", op,
                   shape_str(param.shape()), dtype_name(param.dtype()), shape_str(t->shape()),
                   dtype_name(t->dtype()));
  }
}

// What an error about segment `index` starts with: the op alone for a single segment (the
// single-parameter call), "<op>: segment <index>" among several.
std::string segment_context(const char* op, std::size_t index, std::size_t count) {
  return count == 1 ? std::string(op) : fmt::format("{}: segment {}", op, index);
}

// The gate of a multi-segment step: undefined, or one bool on the device of every segment.
template <typename Segment>
void check_apply(const char* op, std::span<const Segment> segments, const Tensor& apply) {
  if (!apply.defined()) return;
  SHARDLAB_CHECK(apply.dtype() == DType::boolean && apply.numel() == 1,
                 "{}: apply must be one bool, got [{} {}]", op, shape_str(apply.shape()),
                 dtype_name(apply.dtype()));
  for (std::size_t i = 0; i < segments.size(); ++i) {
    SHARDLAB_CHECK(segments[i].param.device() == apply.device(),
                   "{}: apply is on {} but segment {} is on {}: the gate must be on the device it gates", op,
                   apply.device().str(), i, segments[i].param.device().str());
  }
}

// Calls the kernel of each device the segments are on once, with that device's non-empty
// segments in their given order.
template <auto Entry, typename Segment>
void run_per_device(const char* op, std::span<const Segment> segments, const Tensor& apply) {
  std::vector<Segment> pending;
  for (const Segment& segment : segments) {
    if (segment.param.numel() > 0) pending.push_back(segment);
  }
  while (!pending.empty()) {
    const Device device = pending.front().param.device();
    std::vector<Segment> here, elsewhere;
    for (Segment& segment : pending) (segment.param.device() == device ? here : elsewhere).push_back(segment);
    kernel<Entry>(device, op)(here, apply);
    pending = std::move(elsewhere);
  }
}
}  // namespace

void adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply) {
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const AdadeltaSegment& s = segments[i];
    check_optimizer_operands(segment_context("adadelta_step", i, segments.size()).c_str(), s.param,
                             {&s.grad, &s.square_avg, &s.acc_delta});
  }
  check_apply("adadelta_step", segments, apply);
  run_per_device<&Kernels::adadelta_step>("adadelta_step", segments, apply);
}

void adadelta_step(const Tensor& param, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                   const AdadeltaHyper& hyper) {
  const AdadeltaSegment segment{param, grad, square_avg, acc_delta, hyper};
  adadelta_step(std::span(&segment, 1));
}

void adam_step(std::span<const AdamSegment> segments, const Tensor& apply) {
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const AdamSegment& s = segments[i];
    const std::string context = segment_context("adam_step", i, segments.size());
    const char* op = context.c_str();
    check_optimizer_operands(op, s.param, {&s.grad, &s.exp_avg, &s.exp_avg_sq});
    SHARDLAB_CHECK(s.hyper.step >= 1, "{}: step must be >= 1, got {}", op, s.hyper.step);
    if (s.copy_out.defined()) {
      check_same_device(op, s.param, s.copy_out);
      check_floating(op, s.copy_out);
      SHARDLAB_CHECK(s.copy_out.shape() == s.param.shape(),
                     "{}: copy_out {} must have the parameter's shape {}", op, shape_str(s.copy_out.shape()),
                     shape_str(s.param.shape()));
    }
  }
  check_apply("adam_step", segments, apply);
  run_per_device<&Kernels::adam_step>("adam_step", segments, apply);
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const AdamHyper& hyper, const Tensor& copy_out) {
  const AdamSegment segment{param, grad, exp_avg, exp_avg_sq, hyper, copy_out};
  adam_step(std::span(&segment, 1));
}

// --- loss building blocks ----------------------------------------------------------------------

Tensor gather_targets(const Tensor& values, const Tensor& targets, std::int64_t ignore_index) {
  const char* op = "gather_targets";
  check_defined(op, values, "values");
  check_defined(op, targets, "targets");
  SHARDLAB_CHECK(values.dim() == 2, "{}: values must be 2-D [N, C], got {}", op, shape_str(values.shape()));
  SHARDLAB_CHECK(targets.dim() == 1, "{}: targets must be 1-D [N], got {}", op, shape_str(targets.shape()));
  check_index_dtype(op, targets);
  SHARDLAB_CHECK(values.size(0) == targets.size(0),
                 "{}: values {} and targets {} disagree on the batch size ({} != {})", op,
                 shape_str(values.shape()), shape_str(targets.shape()), values.size(0), targets.size(0));
  const Tensor kept = ne(targets, ignore_index);
  const Tensor safe = checked_targets(op, targets, ignore_index, values.size(1));
  const Tensor picked = gather(values, 1, safe.unsqueeze(1)).squeeze(1);
  return where(kept, picked, zeros({}, TensorOptions{values.dtype(), values.device()}));
}

namespace {
void check_cross_entropy_operands(const char* op, const Tensor& logits, const Tensor& targets) {
  check_defined(op, logits, "logits");
  check_defined(op, targets, "targets");
  check_floating(op, logits);
  check_same_device(op, logits, targets);
  SHARDLAB_CHECK(logits.dim() == 2, "{}: logits must be 2-D [N, C], got {}", op, shape_str(logits.shape()));
  SHARDLAB_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
                 "{}: targets must be 1-D [N] = [{}] for logits {}, got {}", op, logits.size(0),
                 shape_str(logits.shape()), shape_str(targets.shape()));
}

// Operands of a fused op: `reference` floating; the others defined, of its dtype and device.
void check_fused_operands(const char* op, const Tensor& reference,
                          std::initializer_list<std::pair<const Tensor*, const char*>> others) {
  check_floating(op, reference);
  for (const auto& [t, name] : others) {
    check_defined(op, *t, name);
    check_same_device(op, reference, *t);
    SHARDLAB_CHECK(t->dtype() == reference.dtype(), "{}: {} is {} but the input is {}", op, name,
                   dtype_name(t->dtype()), dtype_name(reference.dtype()));
  }
}
}  // namespace

namespace {

// rms_norm_forward, or add_rms_norm_forward with `added` defined (checked by the caller).
RmsNormResult norm_rows(const char* op, const Tensor& x, const Tensor& added, const Tensor& weight,
                        double eps) {
  SHARDLAB_CHECK(x.dim() >= 1 && weight.shape() == Shape{x.size(-1)},
                 "{}: weight {} must be [D] for x {} of last dim D", op, shape_str(weight.shape()),
                 shape_str(x.shape()));
  const Shape rows(x.shape().begin(), x.shape().end() - 1);
  const TensorOptions options{x.dtype(), x.device()};
  RmsNormResult result{empty(x.shape(), options),
                       empty(rows, TensorOptions{logsumexp_dtype(x.dtype()), x.device()}),
                       added.defined() ? empty(x.shape(), options) : Tensor()};
  if (x.numel() > 0) {
    kernel<&Kernels::rms_norm_forward>(x.device(), op)(
        x.contiguous(), added.defined() ? added.contiguous() : added, weight.contiguous(), eps, result.sum,
        result.out, result.rstd);
  }
  return result;
}

}  // namespace

RmsNormResult rms_norm_forward(const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&weight, "weight"}});
  return norm_rows(op, x, Tensor(), weight, eps);
}

RmsNormResult add_rms_norm_forward(const Tensor& x, const Tensor& y, const Tensor& weight, double eps) {
  const char* op = "add_rms_norm";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&y, "y"}, {&weight, "weight"}});
  SHARDLAB_CHECK(y.shape() == x.shape(), "{}: x {} and y {} differ in shape (add them first to broadcast)",
                 op, shape_str(x.shape()), shape_str(y.shape()));
  return norm_rows(op, x, y, weight, eps);
}

RmsNormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd) {
  const char* op = "rms_norm_backward";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&grad_out, "grad_out"}, {&weight, "weight"}});
  SHARDLAB_CHECK(grad_out.shape() == x.shape() && x.dim() >= 1 && weight.shape() == Shape{x.size(-1)},
                 "{}: grad_out {}, x {} and weight {} do not match", op, shape_str(grad_out.shape()),
                 shape_str(x.shape()), shape_str(weight.shape()));
  // The kernels write every element of both; with no rows the weight's gradient is zero.
  const TensorOptions options{x.dtype(), x.device()};
  RmsNormGrads grads{empty(x.shape(), options),
                     x.numel() > 0 ? empty(weight.shape(), options) : zeros(weight.shape(), options)};
  if (x.numel() > 0) {
    kernel<&Kernels::rms_norm_backward>(x.device(), op)(
        grad_out.contiguous(), x.contiguous(), weight.contiguous(), rstd.contiguous(), grads.x, grads.weight);
  }
  return grads;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu";
  check_defined(op, gate, "gate");
  check_fused_operands(op, gate, {{&up, "up"}});
  SHARDLAB_CHECK(gate.shape() == up.shape(), "{}: gate {} and up {} differ in shape", op,
                 shape_str(gate.shape()), shape_str(up.shape()));
  Tensor out = empty(gate.shape(), TensorOptions{gate.dtype(), gate.device()});
  if (out.numel() > 0)
    kernel<&Kernels::swiglu_forward>(gate.device(), op)(gate.contiguous(), up.contiguous(), out);
  return out;
}

SwigluGrads swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_backward";
  check_defined(op, gate, "gate");
  check_fused_operands(op, gate, {{&up, "up"}, {&grad_out, "grad_out"}});
  SHARDLAB_CHECK(gate.shape() == up.shape() && gate.shape() == grad_out.shape(),
                 "{}: grad_out {}, gate {} and up {} differ in shape", op, shape_str(grad_out.shape()),
                 shape_str(gate.shape()), shape_str(up.shape()));
  SwigluGrads grads{empty(gate.shape(), TensorOptions{gate.dtype(), gate.device()}),
                    empty(gate.shape(), TensorOptions{gate.dtype(), gate.device()})};
  if (gate.numel() > 0) {
    kernel<&Kernels::swiglu_backward>(gate.device(), op)(grad_out.contiguous(), gate.contiguous(),
                                                         up.contiguous(), grads.gate, grads.up);
  }
  return grads;
}

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  const char* op = "rotary_embedding";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&cos, "cos"}, {&sin, "sin"}});
  SHARDLAB_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "{}: x must be [..., T, D] with D even, got {}", op,
                 shape_str(x.shape()));
  const Shape table{x.size(-2), x.size(-1)};
  SHARDLAB_CHECK(cos.shape() == table && sin.shape() == table, "{}: cos {} and sin {} must be {} for x {}",
                 op, shape_str(cos.shape()), shape_str(sin.shape()), shape_str(table), shape_str(x.shape()));
  Tensor out = empty_for_heads(x, x.shape());
  if (out.numel() > 0)
    kernel<&Kernels::rotary>(x.device(), op)(head_rows(x), cos.contiguous(), sin.contiguous(), transpose,
                                             out);
  return out;
}

CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                         std::int64_t ignore_index) {
  const char* op = "cross_entropy";
  check_cross_entropy_operands(op, logits, targets);
  const Tensor checked = checked_targets(op, targets, ignore_index, logits.size(1));
  const Tensor rows = targets.to(DType::i64).contiguous();  // checked above, ignore_index kept
  CrossEntropyResult result{
      empty({logits.size(0)}, TensorOptions{logsumexp_dtype(logits.dtype()), logits.device()}),
      empty({logits.size(0)}, TensorOptions{logsumexp_dtype(logits.dtype()), logits.device()})};
  if (logits.numel() > 0) {
    kernel<&Kernels::cross_entropy_forward>(logits.device(), op)(logits.contiguous(), rows, ignore_index,
                                                                 result.losses, result.logsumexp);
  } else {
    result.losses.fill_(0);
    result.logsumexp.fill_(-std::numeric_limits<double>::infinity());
  }
  return result;
}

Tensor cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                              std::int64_t ignore_index, const Tensor& logsumexp) {
  const char* op = "cross_entropy_backward";
  check_cross_entropy_operands(op, logits, targets);
  check_defined(op, grad_losses, "grad_losses");
  check_defined(op, logsumexp, "logsumexp");
  const Shape rows_shape{logits.size(0)};
  SHARDLAB_CHECK(grad_losses.shape() == rows_shape && logsumexp.shape() == rows_shape,
                 "{}: grad_losses {} and logsumexp {} must be [N] = {}", op, shape_str(grad_losses.shape()),
                 shape_str(logsumexp.shape()), shape_str(rows_shape));
  SHARDLAB_CHECK(logsumexp.dtype() == logsumexp_dtype(logits.dtype()),
                 "{}: logsumexp must be {} for {} logits, got {}", op,
                 dtype_name(logsumexp_dtype(logits.dtype())), dtype_name(logits.dtype()),
                 dtype_name(logsumexp.dtype()));
  const Tensor rows = targets.to(DType::i64).contiguous();  // the forward checked them
  Tensor grad = empty(logits.shape(), TensorOptions{logits.dtype(), logits.device()});
  if (grad.numel() > 0) {
    kernel<&Kernels::cross_entropy_backward>(logits.device(), op)(
        grad_losses.to(logsumexp.dtype()).contiguous(), logits.contiguous(), rows, ignore_index,
        logsumexp.contiguous(), grad);
  }
  return grad;
}

}  // namespace shardlab
