// core/op_codes.h: the op enums shared by the op layer, the kernel tables and the CUDA
// launchers. Free of other includes so .cu files can use them as they are.
#pragma once

namespace shardlab {

enum class UnaryOp : unsigned char {
  neg,
  abs,
  exp,
  log,
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
enum class ReduceOp : unsigned char { sum, mean, sum_squares, max, min, argmax };
enum class Distribution : unsigned char { uniform, normal, bernoulli };

// eq, ne, lt, le, gt, ge: these write bool.
constexpr bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq; }

// The ops' names, for error messages and traces.
const char* op_name(UnaryOp op);
const char* op_name(BinaryOp op);
const char* op_name(ReduceOp op);

}  // namespace shardlab
