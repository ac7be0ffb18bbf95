// core/elementwise.h: elementwise ops: unary, binary (broadcasting like NumPy, promoting dtypes), where, in
// place; their kernel entries (fill, copy, unary, binary, where).
#pragma once

#include <cstdint>
#include <optional>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// The op codes of the unary and binary entries.
enum class UnaryOp : unsigned char {
  neg,
  abs,
  exp,
  log,
  log1p,
  sqrt,
  rsqrt,
  tanh,
  sigmoid,
  relu,
  silu,
  gelu,
  gelu_tanh,
  erf,
  isfinite
};
inline constexpr UnaryOp kLastUnaryOp = UnaryOp::isfinite;  // the enum's last: unary_ops() counts up to it
// relu_backward(g, y) = y > 0 ? g : 0, ReLU's gradient from its output in one pass.
enum class BinaryOp : unsigned char {
  add,
  sub,
  mul,
  div,
  pow,
  maximum,
  minimum,
  relu_backward,
  eq,
  ne,
  lt,
  le,
  gt,
  ge
};
inline constexpr BinaryOp kLastBinaryOp = BinaryOp::ge;  // the enum's last: binary_ops() counts up to it
// eq, ne, lt, le, gt, ge: these write bool.
constexpr bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq; }

// The ops' names, for error messages and traces.
const char* op_name(UnaryOp op);
const char* op_name(BinaryOp op);
// Every code, in the enum's order.
std::span<const UnaryOp> unary_ops();
std::span<const BinaryOp> binary_ops();

// --- elementwise: unary --------------------------------------------------------------------
// Integer and bool inputs of exp/log/sqrt/rsqrt/tanh/sigmoid/silu/gelu compute in f32.
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor log1p(const Tensor& x);  // log(1 + x), exact where 1 + x would round away most of x
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor silu(const Tensor& x);
enum class GeluApproximation : unsigned char { none, tanh };
Tensor gelu(const Tensor& x, GeluApproximation approximate = GeluApproximation::none);
Tensor erf(const Tensor& x);
Tensor isfinite(const Tensor& x);  // bool
// The unary op of `op`: exp(x) for UnaryOp::exp, gelu(x, GeluApproximation::tanh) for gelu_tanh, ...
Tensor apply_unary(UnaryOp op, const Tensor& x);
Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max);
Tensor cast(const Tensor& x, DType dtype);

// --- elementwise: binary (broadcasting) ----------------------------------------------------
// div of integers is true division (result f32), as in PyTorch.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);  // NaN propagates
Tensor minimum(const Tensor& a, const Tensor& b);
// ReLU's input gradient from its output: output > 0 ? grad : 0 (NaN outputs pass nothing), one pass.
Tensor relu_backward(const Tensor& grad, const Tensor& output);
Tensor add(const Tensor& a, Scalar b);
Tensor sub(const Tensor& a, Scalar b);
Tensor mul(const Tensor& a, Scalar b);
Tensor div(const Tensor& a, Scalar b);
Tensor pow(const Tensor& a, Scalar exponent);
// Comparisons give bool.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, Scalar b);
Tensor ne(const Tensor& a, Scalar b);
Tensor lt(const Tensor& a, Scalar b);
Tensor le(const Tensor& a, Scalar b);
Tensor gt(const Tensor& a, Scalar b);
Tensor ge(const Tensor& a, Scalar b);
// condition ? a : b, elementwise; condition is bool; all three broadcast together.
Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& condition, const Tensor& a, Scalar b);

// In place: self = self op other, other broadcast to self's shape and cast to self's dtype
// (self keeps its shape and dtype). other must not partially overlap self. Returns self.
const Tensor& add_(const Tensor& self, const Tensor& other);
const Tensor& sub_(const Tensor& self, const Tensor& other);
const Tensor& mul_(const Tensor& self, const Tensor& other);
const Tensor& div_(const Tensor& self, const Tensor& other);
const Tensor& add_(const Tensor& self, Scalar other);
const Tensor& sub_(const Tensor& self, Scalar other);
const Tensor& mul_(const Tensor& self, Scalar other);
const Tensor& div_(const Tensor& self, Scalar other);

Tensor operator-(const Tensor& x);
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, Scalar b);
Tensor operator-(const Tensor& a, Scalar b);
Tensor operator*(const Tensor& a, Scalar b);
Tensor operator/(const Tensor& a, Scalar b);

// Elementwise inputs arrive broadcast (expanded views) to the output shape in one dtype (comparisons
// write bool); outputs are freshly allocated and contiguous unless noted.
struct ElementwiseKernels {
  void (*fill)(const Tensor& out, Scalar value);  // out may be strided
  // dst may be strided; src has dst's shape (possibly expanded), any dtype.
  void (*copy)(const Tensor& dst, const Tensor& src);
  void (*unary)(UnaryOp op, const Tensor& in, const Tensor& out);
  void (*binary)(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
  void (*where)(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> elementwise_ops();

// This family's entries on each device: core/cpu/elementwise.cpp, core/cuda/elementwise.cu.
namespace cpu {
ElementwiseKernels elementwise_kernels();
}
namespace cuda {
ElementwiseKernels elementwise_kernels();
}

}  // namespace shardlab
