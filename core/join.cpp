// core/join.cpp: cat, stack, split, chunk, triu and tril.
#include "core/join.h"

#include <algorithm>
#include <string>

#include "core/elementwise.h"
#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

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

}  // namespace shardlab
