// autograd/ops_nn.cpp: differentiable matmul, softmax, convolution, pooling and indexing, each
// forward next to its backward. Operands that need no gradient get none computed.
#include <algorithm>
#include <vector>

#include "autograd/batch_chunks.h"
#include "autograd/ops.h"
#include "autograd/record.h"

namespace shardlab {

using autograd::Grads;
using autograd::record;
using autograd::sum_to;

namespace {

// The sum over the batch dims of lhs[i] @ rhs[i], for lhs [..., p, q] and rhs [..., q, r] with the
// same batch dims: one [p, batch * q] x [batch * q, r] product instead of a product per batch
// entry and a sum (the weight gradient of x @ w for a batched x).
Tensor batch_summed_matmul(const Tensor& lhs, const Tensor& rhs) {
  const std::int64_t rank = lhs.dim();
  std::vector<std::int64_t> rows_first{rank - 2};
  for (std::int64_t d = 0; d < rank - 2; ++d) rows_first.push_back(d);
  rows_first.push_back(rank - 1);
  std::int64_t inner = lhs.size(-1);
  for (std::int64_t d = 0; d < rank - 2; ++d) inner *= lhs.size(d);
  return matmul(lhs.permute(rows_first).reshape({lhs.size(-2), inner}), rhs.reshape({inner, rhs.size(-1)}));
}

// Whether a 2-D operand is a transposed view of a contiguous matrix (a Linear weight used as w.t()).
bool stored_transposed(const Tensor& t) {
  return t.dim() == 2 && t.size(0) > 1 && t.size(1) > 1 && t.stride(0) == 1 && t.stride(1) == t.size(0);
}

// The gradient of a 2-D operand, lhs @ rhs summed over the batch dims, laid out like the operand:
// for one stored transposed it is computed as (rhs^T @ lhs^T)^T (BLAS takes either layout for
// free), so the gradient flowing back through the transpose arrives contiguous and accumulating
// it (or copying it into FSDP's flat buffer) is a straight copy, not a transpose.
Tensor gradient_in_layout(bool transposed, const Tensor& lhs, const Tensor& rhs) {
  if (transposed) return batch_summed_matmul(rhs.transpose(-1, -2), lhs.transpose(-1, -2)).transpose(0, 1);
  return batch_summed_matmul(lhs, rhs);
}

// Zeros of `shape` in the gradient's dtype and device.
Tensor zeros_for(const Shape& shape, const Tensor& g) {
  return zeros(shape, TensorOptions{g.dtype(), g.device()});
}

}  // namespace

namespace {

// The gradients of x @ y, given the output's gradient: the layer each operand came in, and only those
// asked for (each needs only the other operand, saved only then).
struct ProductGrads {
  ProductGrads(const Tensor& x, const Tensor& y, bool need_x, bool need_y)
      : saved_x(need_y ? x : Tensor()),
        saved_y(need_x ? y : Tensor()),
        shape_x(x.shape()),
        shape_y(y.shape()),
        x_transposed(stored_transposed(x)),
        y_transposed(stored_transposed(y)) {}

  Grads operator()(const Tensor& g) const {
    // 1-D operands as a row (x) or column (y) matrix, and g with the dims they lost restored.
    Tensor g2 = g;
    if (shape_y.size() == 1) g2 = g2.unsqueeze(-1);
    if (shape_x.size() == 1) g2 = g2.unsqueeze(-2);
    Tensor grad_x, grad_y;
    if (saved_y.defined()) {
      const Tensor y2 = shape_y.size() == 1 ? saved_y.unsqueeze(1) : saved_y;
      const Shape x2 = shape_x.size() == 1 ? Shape{1, shape_x[0]} : shape_x;
      // dX = dC Y^T, summed over the batch dims X was broadcast along.
      grad_x = x2.size() == 2 ? gradient_in_layout(x_transposed, g2, y2.transpose(-1, -2))
                              : sum_to(matmul(g2, y2.transpose(-1, -2)), x2);
      grad_x = grad_x.reshape(shape_x);
    }
    if (saved_x.defined()) {
      const Tensor x2 = shape_x.size() == 1 ? saved_x.unsqueeze(0) : saved_x;
      const Shape y2 = shape_y.size() == 1 ? Shape{shape_y[0], 1} : shape_y;
      // dY = X^T dC, summed over the batch dims Y was broadcast along.
      grad_y = y2.size() == 2 ? gradient_in_layout(y_transposed, x2.transpose(-1, -2), g2)
                              : sum_to(matmul(x2.transpose(-1, -2), g2), y2);
      grad_y = grad_y.reshape(shape_y);
    }
    return {grad_x, grad_y};
  }

  Tensor saved_x, saved_y;
  Shape shape_x, shape_y;
  bool x_transposed, y_transposed;
};

}  // namespace

Variable matmul(const Variable& a, const Variable& b) {
  const Tensor x = a.data(), y = b.data();
  const Tensor output = matmul(x, y);  // validates shapes and dtypes
  return record("matmul", {a, b}, output, ProductGrads(x, y, a.requires_grad(), b.requires_grad()));
}

namespace {

// Bitwise training: the weight's and the bias's gradients of a linear as one part per chunk of the batch's
// rows, each with the chunk's shapes (autograd/batch_chunks.h).
void deliver_linear_parts(const autograd::BatchChunks& chunks, const Tensor& input, const Tensor& g,
                          bool need_weight, bool need_bias) {
  const std::int64_t rows = g.numel() / std::max<std::int64_t>(g.size(-1), 1);
  const Tensor rows_g = g.reshape({rows, g.size(-1)});
  const Tensor rows_x = need_weight ? input.reshape({rows, input.size(-1)}) : Tensor();
  for (const autograd::RowRange& chunk : autograd::chunk_rows(chunks, rows, "linear")) {
    const Tensor chunk_g = rows_g.narrow(0, chunk.start, chunk.count);
    if (need_weight)
      autograd::deliver_gradient_part(
          1, matmul(chunk_g.transpose(0, 1), rows_x.narrow(0, chunk.start, chunk.count)));
    if (need_bias) autograd::deliver_gradient_part(2, sum(chunk_g, {0}));
  }
}

// Bitwise training: a convolution's weight and bias gradients as one part per chunk of the batch's
// images, each from the chunk's images alone (`input` undefined when the weight needs none).
void deliver_conv2d_parts(const autograd::BatchChunks& chunks, const Tensor& g, const Tensor& input,
                          const Shape& weight_shape, Conv2dParams params, bool need_bias) {
  for (const autograd::RowRange& chunk : autograd::chunk_rows(chunks, g.size(0), "conv2d")) {
    const Tensor chunk_g = g.narrow(0, chunk.start, chunk.count);
    if (input.defined())
      autograd::deliver_gradient_part(
          1,
          conv2d_backward_weight(chunk_g, input.narrow(0, chunk.start, chunk.count), weight_shape, params));
    if (need_bias) autograd::deliver_gradient_part(2, sum(chunk_g, {0, 2, 3}));
  }
}

}  // namespace

Variable linear(const Variable& x, const Variable& weight, const Variable& bias) {
  const Tensor input = x.data(), w = weight.data(), b = bias.defined() ? bias.data() : Tensor();
  const Tensor output = linear(input, w, b);  // validates shapes and dtypes
  const std::optional<autograd::BatchChunks> chunks = autograd::batch_chunks();
  const bool need_weight = weight.requires_grad();
  const ProductGrads product(input, w.transpose(0, 1), x.requires_grad(), need_weight && !chunks);
  const bool has_bias = bias.defined(), need_bias = has_bias && bias.requires_grad();
  const Shape bias_shape = has_bias ? b.shape() : Shape{};
  const Tensor chunked_input = chunks && need_weight ? input : Tensor();
  std::vector<Variable> inputs{x, weight};
  if (has_bias) inputs.push_back(bias);
  return record("linear", inputs, output,
                [product, has_bias, need_bias, bias_shape, chunks, chunked_input,
                 need_weight](const Tensor& g) -> Grads {
                  Grads grads = product(g);
                  if (chunks) {
                    deliver_linear_parts(*chunks, chunked_input, g, need_weight, need_bias);
                    if (has_bias) grads.emplace_back();
                    return grads;
                  }
                  if (grads[1].defined())
                    grads[1] = grads[1].transpose(0, 1);  // the weight's, not its transpose's
                  if (has_bias) grads.push_back(need_bias ? sum_to(g, bias_shape) : Tensor());
                  return grads;
                });
}

Variable softmax(const Variable& x, std::int64_t dim) {
  const Tensor y = softmax(x.data(), dim);  // validates dim
  const std::int64_t d = wrap_dim(dim, std::max<std::int64_t>(y.dim(), 1), "softmax");
  return record("softmax", {x}, y, [y, d](const Tensor& g) -> Grads {
    if (y.dim() == 0) return {zeros_for(y.shape(), g)};  // the softmax of one element is 1
    // dx = y * (g - sum(g * y)) over dim
    const Tensor gy = mul(g, y);
    return {sub(gy, mul(y, sum(gy, {d}, true)))};
  });
}

Variable log_softmax(const Variable& x, std::int64_t dim) {
  const Tensor y = log_softmax(x.data(), dim);  // validates dim
  const std::int64_t d = wrap_dim(dim, std::max<std::int64_t>(y.dim(), 1), "log_softmax");
  return record("log_softmax", {x}, y, [y, d](const Tensor& g) -> Grads {
    if (y.dim() == 0) return {zeros_for(y.shape(), g)};  // log_softmax of one element is 0
    // dx = g - softmax(x) * sum(g) over dim
    return {sub(g, mul(exp(y), sum(g, {d}, true)))};
  });
}

Variable conv2d(const Variable& input, const Variable& weight, const Variable& bias, Conv2dParams params) {
  const Tensor x = input.data(), w = weight.data();
  const Tensor output = conv2d(x, w, bias.defined() ? bias.data() : Tensor(), params);
  const bool need_input = input.requires_grad(), need_weight = weight.requires_grad(),
             need_bias = bias.requires_grad();
  // Each gradient needs only the other operand: the first layer's image needs no gradient, so
  // nothing is kept for one.
  const Tensor saved_x = need_weight ? x : Tensor(), saved_w = need_input ? w : Tensor();
  const Shape input_shape = x.shape(), weight_shape = w.shape();
  const std::optional<autograd::BatchChunks> chunks = autograd::batch_chunks();
  return record("conv2d", {input, weight, bias}, output, [=](const Tensor& g) -> Grads {
    const Tensor grad_input = need_input ? conv2d_backward_input(g, saved_w, input_shape, params) : Tensor();
    if (chunks) {
      deliver_conv2d_parts(*chunks, g, saved_x, weight_shape, params, need_bias);
      return {grad_input, Tensor(), Tensor()};
    }
    return {grad_input, need_weight ? conv2d_backward_weight(g, saved_x, weight_shape, params) : Tensor(),
            need_bias ? sum(g, {0, 2, 3}) : Tensor()};
  });
}

Variable max_pool2d(const Variable& input, MaxPool2dParams params) {
  MaxPool2dResult pooled = max_pool2d(input.data(), params);
  const Tensor indices = pooled.indices;
  const Shape shape = input.shape();
  // Each output's gradient goes to the input element that was its maximum.
  return record("max_pool2d", {input}, std::move(pooled.values), [indices, shape](const Tensor& g) -> Grads {
    return {max_pool2d_backward(g, indices, shape)};
  });
}

Variable embedding(const Variable& weight, const Tensor& indices) {
  const Tensor output = embedding(weight.data(), indices);  // validates weight and indices
  const std::int64_t rows = weight.size(0);
  const std::optional<autograd::BatchChunks> chunks = autograd::batch_chunks();
  // Rows looked up several times sum their gradients.
  return record("embedding", {weight}, output, [indices, rows, chunks](const Tensor& g) -> Grads {
    if (!chunks) return {embedding_backward(g, indices, rows)};
    // Bitwise training: one part per chunk of the batch's lookups, each a whole table's gradient.
    const Tensor picks = indices.reshape({indices.numel()});
    const Tensor picked = g.reshape({indices.numel(), g.size(-1)});
    for (const autograd::RowRange& chunk : autograd::chunk_rows(*chunks, picks.numel(), "embedding")) {
      const Tensor chunk_picks = picks.narrow(0, chunk.start, chunk.count);
      const Tensor part = embedding_backward(picked.narrow(0, chunk.start, chunk.count), chunk_picks, rows);
      // Only the rows the chunk looked up are not zero: those alone go into the sum.
      std::vector<std::int64_t> looked_up = chunk_picks.to(DType::i64).to_vector<std::int64_t>();
      std::sort(looked_up.begin(), looked_up.end());
      looked_up.erase(std::unique(looked_up.begin(), looked_up.end()), looked_up.end());
      const auto count = static_cast<std::int64_t>(looked_up.size());
      const Tensor touched = from_vector(looked_up, {count});
      autograd::deliver_gradient_rows(0, touched, index_select(part, 0, touched));
    }
    return {Tensor()};
  });
}

// index_select and gather pick elements of x: their gradient adds each picked element's
// gradient, into zeros, where the element came from (an element picked twice gets both).
Variable index_select(const Variable& x, std::int64_t dim, const Tensor& index) {
  const Shape shape = x.shape();
  return record("index_select", {x}, index_select(x.data(), dim, index),
                [shape, dim, index](const Tensor& g) -> Grads {
                  return {index_add(zeros_for(shape, g), dim, index, g)};
                });
}

Variable gather(const Variable& x, std::int64_t dim, const Tensor& index) {
  const Shape shape = x.shape();
  return record("gather", {x}, gather(x.data(), dim, index), [shape, dim, index](const Tensor& g) -> Grads {
    return {scatter_add(zeros_for(shape, g), dim, index, g)};
  });
}

Variable scatter_add(const Variable& self, std::int64_t dim, const Tensor& index, const Variable& src) {
  const Tensor output = scatter_add(self.data(), dim, index, src.data());  // validates shapes
  const Shape src_shape = src.shape();
  const bool need_src = src.requires_grad();
  return record("scatter_add", {self, src}, output, [=](const Tensor& g) -> Grads {
    if (!need_src) return {g, {}};
    // src element j went to the position index[j] names; elements of src beyond index's
    // extent were not used and get 0.
    const Tensor picked = gather(g, dim, index);
    if (picked.shape() == src_shape) return {g, picked};
    Tensor grad_src = zeros_for(src_shape, g), block = grad_src;
    for (std::int64_t d = 0; d < index.dim(); ++d) block = block.narrow(d, 0, index.size(d));
    block.copy_(picked);
    return {g, grad_src};
  });
}

Variable gather_targets(const Variable& values, const Tensor& targets, std::int64_t ignore_index) {
  const Tensor output = gather_targets(values.data(), targets, ignore_index);  // validates targets
  const std::int64_t classes = values.size(1);
  return record(
      "gather_targets", {values}, output, [targets, ignore_index, classes](const Tensor& g) -> Grads {
        // Row i's gradient goes to column targets[i]; ignored rows get none (even when
        // ignore_index is a valid class). A one-hot select needs no scatter and no index check.
        const Tensor routed = where(ne(targets, ignore_index), g, 0).unsqueeze(1);
        const Tensor hit =
            eq(arange(classes, TensorOptions{DType::i64, g.device()}).unsqueeze(0), targets.unsqueeze(1));
        return {where(hit, routed, 0)};
      });
}

}  // namespace shardlab
