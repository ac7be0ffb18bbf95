// autograd/functional.cpp: losses, normalisations and attention, composed from the
// differentiable ops of autograd/ops.h (their backward is that of the ops they use).
#include "autograd/functional.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>

namespace shardlab {
namespace {

// log_probs (or logits) [N, C] and targets [N] of class indices, checked for `op`.
void check_loss_inputs(const char* op, const char* what, const Variable& input, const Tensor& targets) {
  SHARDLAB_CHECK(input.defined(), "{}: {} is undefined", op, what);
  SHARDLAB_CHECK(targets.defined(), "{}: targets is undefined", op);
  SHARDLAB_CHECK(input.dim() == 2, "{}: {} must be 2-D [N, C], got shape {}", op, what,
                 shape_str(input.shape()));
  SHARDLAB_CHECK(targets.dim() == 1 && targets.size(0) == input.size(0),
                 "{}: targets must be 1-D [N] = [{}] for {} of shape {}, got shape {}", op, input.size(0),
                 what, shape_str(input.shape()), shape_str(targets.shape()));
  SHARDLAB_CHECK(targets.dtype() == DType::i64 || targets.dtype() == DType::i32,
                 "{}: targets must be class indices (i64 or i32), got {}", op, dtype_name(targets.dtype()));
}

// -log_probs[i, targets[i]] per row, reduced; the inputs are already checked.
Variable negative_log_likelihood(const char* op, const Variable& log_probs, const Tensor& targets,
                                 std::int64_t ignore_index, Reduction reduction) {
  const Variable losses = neg(gather_targets(log_probs, targets, ignore_index));  // 0 where ignored
  switch (reduction) {
    case Reduction::none:
      return losses;
    case Reduction::sum:
      return sum(losses);
    case Reduction::mean: {
      // Divided by the rows that count, kept on the device: no rows give 0 / 0 = NaN (PyTorch).
      const Tensor counted = sum(ne(targets, ignore_index)).to(log_probs.dtype());
      return div(sum(losses), constant(counted));
    }
  }
  fail("{}: unknown reduction {}", op, static_cast<int>(reduction));
}

// [B, Hkv, S, D] -> [B, Hkv * groups, S, D]: each head repeated `groups` times in a row, so
// query head h reads head h / groups. expand's backward sums the copies' gradients back
// into the shared head.
Variable repeat_heads(const Variable& x, std::int64_t groups) {
  const Shape s = x.shape();
  return reshape(expand(unsqueeze(x, 2), {s[0], s[1], groups, s[2], s[3]}),
                 {s[0], s[1] * groups, s[2], s[3]});
}

// The additive mask of the scores [B, H, T, S]: the user's mask plus -inf above the diagonal
// when causal (top-left aligned: query t sees keys 0..t). Undefined when there is none.
Tensor attention_mask(const char* op, const AttentionOptions& options, const Shape& scores, DType dtype,
                      Device device) {
  Tensor mask;
  if (options.mask.defined()) {
    const Tensor& user = options.mask;
    SHARDLAB_CHECK(is_floating(user.dtype()), "{}: mask must be floating (it is added to the scores), got {}",
                   op, dtype_name(user.dtype()));
    bool fits = user.dim() <= 4;
    for (std::int64_t i = 1; fits && i <= user.dim(); ++i) {
      const std::int64_t size = user.size(-i);
      fits = size == 1 || size == scores[static_cast<std::size_t>(4 - i)];
    }
    SHARDLAB_CHECK(fits, "{}: mask of shape {} does not broadcast to the scores [B, H, T, S] = {}", op,
                   shape_str(user.shape()), shape_str(scores));
    mask = user.to(dtype);
  }
  if (options.causal) {
    const TensorOptions tensor_options{dtype, device};
    const Tensor causal =
        triu(full({scores[2], scores[3]}, -std::numeric_limits<double>::infinity(), tensor_options), 1);
    mask = mask.defined() ? add(mask, causal) : causal;
  }
  return mask;
}

}  // namespace

Variable nll_loss(const Variable& log_probs, const Tensor& targets, std::int64_t ignore_index,
                  Reduction reduction) {
  check_loss_inputs("nll_loss", "log_probs", log_probs, targets);
  return negative_log_likelihood("nll_loss", log_probs, targets, ignore_index, reduction);
}

Variable cross_entropy(const Variable& logits, const Tensor& targets, std::int64_t ignore_index,
                       Reduction reduction) {
  check_loss_inputs("cross_entropy", "logits", logits, targets);
  return negative_log_likelihood("cross_entropy", log_softmax(logits, 1), targets, ignore_index, reduction);
}

Variable rms_norm(const Variable& x, const Variable& weight, double eps) {
  SHARDLAB_CHECK(x.defined(), "rms_norm: x is undefined");
  SHARDLAB_CHECK(weight.defined(), "rms_norm: weight is undefined");
  SHARDLAB_CHECK(x.dim() >= 1, "rms_norm: x must have at least 1 dimension, got shape {}",
                 shape_str(x.shape()));
  const Shape expected{x.size(-1)};
  SHARDLAB_CHECK(weight.shape() == expected, "rms_norm: weight has shape {} but x of shape {} needs {}",
                 shape_str(weight.shape()), shape_str(x.shape()), shape_str(expected));
  const Variable inv_rms = rsqrt(add(mean(mul(x, x), {-1}, true), eps));
  return mul(mul(x, inv_rms), weight);
}

Variable layer_norm(const Variable& x, const Variable& weight, const Variable& bias, double eps) {
  SHARDLAB_CHECK(x.defined(), "layer_norm: x is undefined");
  SHARDLAB_CHECK(x.dim() >= 1, "layer_norm: x must have at least 1 dimension, got shape {}",
                 shape_str(x.shape()));
  const Shape expected{x.size(-1)};
  for (const auto& [param, name] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}}) {
    SHARDLAB_CHECK(!param->defined() || param->shape() == expected,
                   "layer_norm: {} has shape {} but x of shape {} needs {}", name, shape_str(param->shape()),
                   shape_str(x.shape()), shape_str(expected));
  }
  const Variable centered = sub(x, mean(x, {-1}, true));
  const Variable variance = mean(mul(centered, centered), {-1}, true);  // biased, as PyTorch
  Variable y = mul(centered, rsqrt(add(variance, eps)));
  if (weight.defined()) y = mul(y, weight);
  if (bias.defined()) y = add(y, bias);
  return y;
}

Variable scaled_dot_product_attention(const Variable& q, const Variable& k, const Variable& v,
                                      const AttentionOptions& options) {
  const char* op = "scaled_dot_product_attention";
  for (const auto& [x, what] : {std::pair{&q, "q [B, H, T, D]"}, std::pair{&k, "k [B, Hkv, S, D]"},
                                std::pair{&v, "v [B, Hkv, S, D]"}}) {
    SHARDLAB_CHECK(x->defined(), "{}: {} is undefined", op, what);
    SHARDLAB_CHECK(x->dim() == 4, "{}: {} must be 4-D, got shape {}", op, what, shape_str(x->shape()));
  }
  const std::string shapes =
      fmt::format("q {}, k {}, v {}", shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  const std::int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), head_dim = q.size(3);
  const std::int64_t kv_heads = k.size(1), keys = k.size(2);
  SHARDLAB_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "{}: dtypes differ ({}, {} and {})", op,
                 dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype()));
  SHARDLAB_CHECK(k.size(0) == batch && v.size(0) == batch, "{}: batch sizes differ ({})", op, shapes);
  SHARDLAB_CHECK(k.size(3) == head_dim, "{}: q and k have different head dims ({} != {}; {})", op, head_dim,
                 k.size(3), shapes);
  SHARDLAB_CHECK(v.size(1) == kv_heads, "{}: k and v have different numbers of heads ({} != {}; {})", op,
                 kv_heads, v.size(1), shapes);
  SHARDLAB_CHECK(v.size(2) == keys, "{}: k and v have different lengths ({} != {}; {})", op, keys, v.size(2),
                 shapes);
  SHARDLAB_CHECK(kv_heads > 0 && heads % kv_heads == 0,
                 "{}: {} query heads are not a multiple of {} key/value heads ({})", op, heads, kv_heads,
                 shapes);

  Variable keys_per_head = k, values_per_head = v;
  if (heads != kv_heads) {
    keys_per_head = repeat_heads(k, heads / kv_heads);
    values_per_head = repeat_heads(v, heads / kv_heads);
  }
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
  // (q * scale) k^T: the scale applied to [B, H, T, D] rather than to the larger scores.
  Variable scores = matmul(mul(q, scale), transpose(keys_per_head, -2, -1));  // [B, H, T, S]
  const Tensor mask = attention_mask(op, options, {batch, heads, queries, keys}, q.dtype(), q.device());
  if (mask.defined()) scores = add(scores, constant(mask));
  return matmul(softmax(scores, -1), values_per_head);
}

}  // namespace shardlab
