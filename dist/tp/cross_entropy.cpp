// dist/tp/cross_entropy.cpp: cross-entropy over vocabulary-split logits (dist/tp/cross_entropy.h).
#include "dist/tp/cross_entropy.h"

#include "autograd/record.h"
#include "core/ops.h"

namespace shardlab::dist {

namespace {

// `value` reduced over `group` in place.
const Tensor& reduced(const Tensor& value, Communicator& group, ReduceOp op, const char* tag) {
  group.all_reduce(value, op, tag).wait();
  return value;
}

void check_operands(const Variable& logits, const Tensor& targets, VocabPiece piece) {
  const char* op = "vocab_parallel_cross_entropy";
  SHARDLAB_CHECK(logits.defined() && targets.defined(), "{}: logits and targets must be defined", op);
  SHARDLAB_CHECK(is_floating(logits.dtype()), "{}: logits must be floating, got {}", op,
                 dtype_name(logits.dtype()));
  SHARDLAB_CHECK(logits.dim() == 2, "{}: logits must be 2-D [N, V_r], got {}", op, shape_str(logits.shape()));
  SHARDLAB_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
                 "{}: targets must be [{}] like the logits' rows, got {}", op, logits.size(0),
                 shape_str(targets.shape()));
  SHARDLAB_CHECK(targets.dtype() == DType::i64 || targets.dtype() == DType::i32,
                 "{}: targets must be i64 or i32, got {}", op, dtype_name(targets.dtype()));
  SHARDLAB_CHECK(
      piece.offset >= 0 && logits.size(1) >= 1 && piece.offset + logits.size(1) <= piece.vocabulary,
      "{}: this rank's {} columns from entry {} do not lie in a vocabulary of {}", op, logits.size(1),
      piece.offset, piece.vocabulary);
}

}  // namespace

Variable vocab_parallel_cross_entropy(const Variable& logits, const Tensor& targets, VocabPiece piece,
                                      Communicator& group, std::int64_t ignore_index, Reduction reduction) {
  check_operands(logits, targets, piece);
  const TensorOptions on{.dtype = DType::f32, .device = logits.device()};
  const Tensor wanted = targets.to(DType::i64);
  const Tensor kept = ne(wanted, ignore_index);
  // Every target in the vocabulary: an index_select over it checks them on the device, no host wait.
  index_select(zeros({piece.vocabulary}, on), 0, where(kept, wanted, Scalar(0)));
  const std::int64_t width = logits.size(1);
  const Tensor local = sub(wanted, piece.offset);
  const Tensor column = clamp(local, Scalar(0), Scalar(width - 1)).unsqueeze(1);  // [N, 1]
  // f32 at least, as cross_entropy_forward accumulates.
  const DType compute = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor counted = cast(kept, compute);
  const Tensor mine = mul(cast(eq(column.squeeze(1), local), compute), counted);  // the target is in my piece
  const Tensor x = logits.data().to(compute);
  const Tensor row_max = reduced(max(x, {1}, true).contiguous(), group, ReduceOp::max, "cross-entropy max");
  const Tensor exp_sum = reduced(sum(exp(sub(x, row_max)), {1}, true).contiguous(), group, ReduceOp::sum,
                                 "cross-entropy sum of exponentials");
  const Tensor logsumexp = add(log(exp_sum), row_max);  // [N, 1]
  const Tensor target_logit = reduced(mul(gather(x, 1, column), mine.unsqueeze(1)).contiguous(), group,
                                      ReduceOp::sum, "cross-entropy target logit");
  const Tensor losses = mul(sub(logsumexp, target_logit).squeeze(1), counted);  // [N]
  const Tensor rows = sum(counted);
  Tensor output = reduction == Reduction::none  ? losses
                  : reduction == Reduction::sum ? sum(losses)
                                                : div(sum(losses), rows);
  return autograd::record("vocab_parallel_cross_entropy", {logits}, output,
                          [x, logsumexp, column, mine, counted, rows, reduction,
                           dtype = logits.dtype()](const Tensor& g) -> autograd::Grads {
                            // d loss_i / d x_ij = softmax_ij - [j is the target]: this rank's columns only.
                            Tensor per_row =
                                mul(counted, g.to(x.dtype()));  // g is [N] for none, one value otherwise
                            if (reduction == Reduction::mean) per_row = div(per_row, rows);
                            const Tensor softmax = exp(sub(x, logsumexp));
                            const Tensor target = scatter_add(zeros_like(x), 1, column, mine.unsqueeze(1));
                            return {mul(sub(softmax, target), per_row.unsqueeze(1)).to(dtype)};
                          });
}

}  // namespace shardlab::dist
