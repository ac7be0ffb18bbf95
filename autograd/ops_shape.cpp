// autograd/ops_shape.cpp: differentiable views and joins. A view's backward puts the
// gradient back where the view's elements came from.
#include <numeric>

#include "autograd/record.h"
#include "autograd/ops.h"

namespace shardlab {

using autograd::Grads;
using autograd::record;
using autograd::sum_to;

namespace {

// The gradient of a view that picks some of x's elements: zeros with g written where the
// picked elements live (`pick` maps a tensor of x's shape to the same view of it).
Variable picking_view(const char* name, const Variable& x, Tensor view,
                      std::function<Tensor(const Tensor&)> pick) {
  const Shape shape = x.shape();
  return record(name, {x}, std::move(view), [shape, pick = std::move(pick)](const Tensor& g) -> Grads {
    const Tensor grad = zeros(shape, TensorOptions{g.dtype(), g.device()});
    pick(grad).copy_(g);
    return {grad};
  });
}

// The gradient of a view that rearranges all of x's elements: reshape g back.
Variable reshaping_view(const char* name, const Variable& x, Tensor view) {
  const Shape shape = x.shape();
  return record(name, {x}, std::move(view), [shape](const Tensor& g) -> Grads { return {g.reshape(shape)}; });
}

}  // namespace

Variable reshape(const Variable& x, Shape shape) {
  return reshaping_view("reshape", x, x.data().reshape(std::move(shape)));
}

Variable flatten(const Variable& x, std::int64_t start_dim, std::int64_t end_dim) {
  return reshaping_view("flatten", x, x.data().flatten(start_dim, end_dim));
}

Variable squeeze(const Variable& x, std::int64_t dim) {
  return reshaping_view("squeeze", x, x.data().squeeze(dim));
}

Variable unsqueeze(const Variable& x, std::int64_t dim) {
  return reshaping_view("unsqueeze", x, x.data().unsqueeze(dim));
}

Variable contiguous(const Variable& x) { return reshaping_view("contiguous", x, x.data().contiguous()); }

Variable permute(const Variable& x, const std::vector<std::int64_t>& dims) {
  const Tensor view = x.data().permute(dims);
  // The inverse permutation puts every dim back: inverse[dims[i]] = i.
  std::vector<std::int64_t> inverse(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    inverse[static_cast<std::size_t>(wrap_dim(dims[i], x.dim(), "permute"))] = static_cast<std::int64_t>(i);
  }
  return record("permute", {x}, view, [inverse](const Tensor& g) -> Grads { return {g.permute(inverse)}; });
}

Variable transpose(const Variable& x, std::int64_t dim0, std::int64_t dim1) {
  return record("transpose", {x}, x.data().transpose(dim0, dim1),
                [dim0, dim1](const Tensor& g) -> Grads { return {g.transpose(dim0, dim1)}; });
}

Variable narrow(const Variable& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  return picking_view("narrow", x, x.data().narrow(dim, start, length),
                      [=](const Tensor& t) { return t.narrow(dim, start, length); });
}

Variable slice(const Variable& x, std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step) {
  return picking_view("slice", x, x.data().slice(dim, start, end, step),
                      [=](const Tensor& t) { return t.slice(dim, start, end, step); });
}

Variable select(const Variable& x, std::int64_t dim, std::int64_t index) {
  return picking_view("select", x, x.data().select(dim, index),
                      [=](const Tensor& t) { return t.select(dim, index); });
}

Variable expand(const Variable& x, Shape shape) {
  const Shape original = x.shape();
  return record("expand", {x}, x.data().expand(std::move(shape)),
                [original](const Tensor& g) -> Grads { return {sum_to(g, original)}; });
}

Variable triu(const Variable& x, std::int64_t diagonal) {
  return record("triu", {x}, triu(x.data(), diagonal),
                [diagonal](const Tensor& g) -> Grads { return {triu(g, diagonal)}; });
}

Variable tril(const Variable& x, std::int64_t diagonal) {
  return record("tril", {x}, tril(x.data(), diagonal),
                [diagonal](const Tensor& g) -> Grads { return {tril(g, diagonal)}; });
}

Variable cat(const std::vector<Variable>& xs, std::int64_t dim) {
  std::vector<Tensor> tensors;
  for (const Variable& x : xs) {
    SHARDLAB_CHECK(x.defined(), "cat: tensor {} is undefined", tensors.size());
    tensors.push_back(x.data());
  }
  const Tensor output = cat(tensors, dim);  // validates shapes and the dim
  const std::int64_t d = wrap_dim(dim, output.dim(), "cat");
  std::vector<std::int64_t> sizes;
  for (const Tensor& t : tensors) sizes.push_back(t.size(d));
  return record("cat", xs, output, [d, sizes](const Tensor& g) -> Grads {
    Grads grads;
    std::int64_t offset = 0;
    for (const std::int64_t size : sizes) {
      grads.push_back(g.narrow(d, offset, size));
      offset += size;
    }
    return grads;
  });
}

Variable stack(const std::vector<Variable>& xs, std::int64_t dim) {
  SHARDLAB_CHECK(!xs.empty(), "stack: needs at least one tensor");
  // Checked before the shapes are read: an undefined Variable would throw a message that names no op.
  for (std::size_t i = 0; i < xs.size(); ++i) {
    SHARDLAB_CHECK(xs[i].defined(), "stack: tensor {} is undefined", i);
  }
  const std::int64_t d = wrap_dim(dim, xs.front().dim() + 1, "stack");
  std::vector<Variable> expanded;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    SHARDLAB_CHECK(xs[i].shape() == xs.front().shape(), "stack: tensor {} has shape {} but tensor 0 has {}",
                   i, shape_str(xs[i].shape()), shape_str(xs.front().shape()));
    expanded.push_back(unsqueeze(xs[i], d));
  }
  return cat(expanded, d);
}

namespace {
// Views of x along dim with the sizes of core's pieces (core validated the arguments).
std::vector<Variable> pieces_like(const Variable& x, std::int64_t dim, const std::vector<Tensor>& pieces) {
  std::vector<Variable> out;
  std::int64_t start = 0;
  for (const Tensor& piece : pieces) {
    out.push_back(narrow(x, dim, start, piece.size(dim)));
    start += piece.size(dim);
  }
  return out;
}
}  // namespace

std::vector<Variable> split(const Variable& x, std::int64_t split_size, std::int64_t dim) {
  const std::int64_t d = wrap_dim(dim, x.dim(), "split");
  return pieces_like(x, d, split(x.data(), split_size, d));
}

std::vector<Variable> chunk(const Variable& x, std::int64_t chunks, std::int64_t dim) {
  const std::int64_t d = wrap_dim(dim, x.dim(), "chunk");
  return pieces_like(x, d, chunk(x.data(), chunks, d));
}

}  // namespace shardlab
