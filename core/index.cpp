// core/index.cpp: the indexing ops: every index checked on its device, outputs allocated.
#include "core/index.h"

#include <string>

#include "core/elementwise.h"
#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

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

std::span<const OpInfo> index_ops() {
  static constexpr OpInfo ops[] = {
      {"check_index", OpCategory::indexing, "index range check, read at the next host wait"},
      {"index_select", OpCategory::indexing, "row gather"},
      {"embedding", OpCategory::indexing, "row gather"},
      {"index_add", OpCategory::indexing, "sorted segments (CUB radix sort), each row's picks in order"},
      {"embedding_backward", OpCategory::indexing, "sorted segments (CUB radix sort), each row's picks in order"},
      {"gather", OpCategory::indexing},
      {"scatter_add", OpCategory::indexing}};
  return ops;
}

}  // namespace shardlab
