// core/loss.cpp: gather_targets and cross-entropy: targets checked on the device, row statistics in f32 for
// halves.
#include "core/loss.h"

#include "core/elementwise.h"
#include "core/index.h"
#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

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

}  // namespace

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

std::span<const OpInfo> loss_ops() {
  static constexpr OpInfo ops[] = {
      {"cross_entropy", OpCategory::reductions, "a block per row, online logsumexp over the vocabulary"},
      {"cross_entropy_backward", OpCategory::reductions, "elementwise from the saved logsumexp, 16-byte packs"},
      {"gather_targets", OpCategory::reductions}};
  return ops;
}

}  // namespace shardlab
