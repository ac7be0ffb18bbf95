// autograd/ops.h: differentiable ops on Variables. Each mirrors the core op of the same
// name (core/ops.h) and defines its backward right next to its forward (autograd/ops_*.cpp).
// Broadcast operands get gradients summed back to their own shapes.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "autograd/variable.h"
#include "core/ops.h"

namespace shardlab {

// --- elementwise (autograd/ops_elementwise.cpp) ------------------------------------------------
Variable neg(const Variable& x);
Variable abs(const Variable& x);  // gradient sign(x), 0 at 0
Variable exp(const Variable& x);
Variable log(const Variable& x);
Variable sqrt(const Variable& x);
Variable rsqrt(const Variable& x);
Variable tanh(const Variable& x);
Variable sigmoid(const Variable& x);
Variable relu(const Variable& x);  // gradient 0 at 0
Variable silu(const Variable& x);
Variable gelu(const Variable& x, GeluApproximation approximate = GeluApproximation::none);
// Gradient passes where min <= x <= max.
Variable clamp(const Variable& x, std::optional<Scalar> min, std::optional<Scalar> max);
Variable pow(const Variable& x, Scalar exponent);
Variable pow(const Variable& base, const Variable& exponent);  // base > 0 for the exponent's gradient
Variable cast(const Variable& x, DType dtype);                 // gradient cast back

Variable add(const Variable& a, const Variable& b);
Variable sub(const Variable& a, const Variable& b);
Variable mul(const Variable& a, const Variable& b);
Variable div(const Variable& a, const Variable& b);
// The larger (smaller) operand gets the gradient; ties split it evenly.
Variable maximum(const Variable& a, const Variable& b);
Variable minimum(const Variable& a, const Variable& b);
Variable add(const Variable& a, Scalar b);
Variable sub(const Variable& a, Scalar b);
Variable mul(const Variable& a, Scalar b);
Variable div(const Variable& a, Scalar b);
// condition (bool, no gradient) ? a : b.
Variable where(const Tensor& condition, const Variable& a, const Variable& b);

Variable operator-(const Variable& x);
Variable operator+(const Variable& a, const Variable& b);
Variable operator-(const Variable& a, const Variable& b);
Variable operator*(const Variable& a, const Variable& b);
Variable operator/(const Variable& a, const Variable& b);
Variable operator+(const Variable& a, Scalar b);
Variable operator-(const Variable& a, Scalar b);
Variable operator*(const Variable& a, Scalar b);
Variable operator/(const Variable& a, Scalar b);

// --- reductions (autograd/ops_reduce.cpp) ------------------------------------------------------
Variable sum(const Variable& x, const Dims& dims = {}, bool keepdim = false);
Variable mean(const Variable& x, const Dims& dims = {}, bool keepdim = false);
Variable sum_squares(const Variable& x, const Dims& dims = {}, bool keepdim = false);
// Ties share the gradient evenly.
Variable max(const Variable& x, const Dims& dims = {}, bool keepdim = false);
Variable min(const Variable& x, const Dims& dims = {}, bool keepdim = false);
Variable logsumexp(const Variable& x, const Dims& dims, bool keepdim = false);

// --- views and joins (autograd/ops_shape.cpp) -----------------------------------------------
Variable reshape(const Variable& x, Shape shape);
Variable flatten(const Variable& x, std::int64_t start_dim = 0, std::int64_t end_dim = -1);
Variable permute(const Variable& x, const std::vector<std::int64_t>& dims);
Variable transpose(const Variable& x, std::int64_t dim0, std::int64_t dim1);
Variable narrow(const Variable& x, std::int64_t dim, std::int64_t start, std::int64_t length);
Variable slice(const Variable& x, std::int64_t dim, std::int64_t start, std::int64_t end,
               std::int64_t step = 1);
Variable select(const Variable& x, std::int64_t dim, std::int64_t index);
Variable expand(const Variable& x, Shape shape);
Variable squeeze(const Variable& x, std::int64_t dim);
Variable unsqueeze(const Variable& x, std::int64_t dim);
Variable contiguous(const Variable& x);
Variable cat(const std::vector<Variable>& xs, std::int64_t dim);
Variable stack(const std::vector<Variable>& xs, std::int64_t dim);
std::vector<Variable> split(const Variable& x, std::int64_t split_size, std::int64_t dim);
std::vector<Variable> chunk(const Variable& x, std::int64_t chunks, std::int64_t dim);
Variable triu(const Variable& x, std::int64_t diagonal = 0);
Variable tril(const Variable& x, std::int64_t diagonal = 0);

// --- linear algebra, indexing, convolution (autograd/ops_nn.cpp) -------------------------------
Variable matmul(const Variable& a, const Variable& b);  // bmm is matmul on 3-D operands
// torch.nn.functional.linear: x [..., in] W^T + b with W [out, in] and b [out] (may be undefined), the
// bias added before the product is rounded (core's linear).
Variable linear(const Variable& x, const Variable& weight, const Variable& bias = {});
Variable softmax(const Variable& x, std::int64_t dim);
Variable log_softmax(const Variable& x, std::int64_t dim);
Variable conv2d(const Variable& input, const Variable& weight, const Variable& bias = {},
                Conv2dParams params = {});
Variable max_pool2d(const Variable& input, MaxPool2dParams params = {});
Variable embedding(const Variable& weight, const Tensor& indices);
Variable index_select(const Variable& x, std::int64_t dim, const Tensor& index);
Variable gather(const Variable& x, std::int64_t dim, const Tensor& index);
Variable scatter_add(const Variable& self, std::int64_t dim, const Tensor& index, const Variable& src);
Variable gather_targets(const Variable& values, const Tensor& targets, std::int64_t ignore_index = -100);

}  // namespace shardlab
