// core/op_checks.cpp: the checks and helpers the op families share (core/op_checks.h).
#include "core/op_checks.h"

#include <algorithm>

#include "core/elementwise.h"

namespace shardlab::detail {

void check_defined(const char* op, const Tensor& t, const char* what) {
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

// The dtype of a row statistic saved for backward: f32 for halves.
DType logsumexp_dtype(DType logits) { return logits == DType::f64 ? DType::f64 : DType::f32; }

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

}  // namespace shardlab::detail
