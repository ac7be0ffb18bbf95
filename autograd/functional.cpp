// autograd/functional.cpp: losses, normalisations and attention, composed from the
// differentiable ops of autograd/ops.h (their backward is that of the ops they use), and
// attention also as one fused node over core's attention kernels.
#include "autograd/functional.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "autograd/batch_chunks.h"
#include "autograd/record.h"
#include "core/kernels.h"

namespace shardlab {

using autograd::Grads;
using autograd::record;

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

// Per-row losses (0 where ignored) reduced as `reduction` says.
Variable reduce_losses(const char* op, const Variable& losses, const Tensor& targets,
                       std::int64_t ignore_index, Reduction reduction) {
  switch (reduction) {
    case Reduction::none:
      return losses;
    case Reduction::sum:
      return sum(losses);
    case Reduction::mean: {
      // Divided by the rows that count, kept on the device: no rows give 0 / 0 = NaN (PyTorch).
      const Tensor counted = sum(ne(targets, ignore_index)).to(losses.dtype());
      return div(sum(losses), constant(counted));
    }
  }
  fail("{}: unknown reduction {}", op, static_cast<int>(reduction));
}

// The user's additive mask, checked against the scores [B, H, T, S], in the scores' dtype.
Tensor additive_mask(const char* op, const Tensor& mask, const Shape& scores, DType dtype) {
  SHARDLAB_CHECK(is_floating(mask.dtype()), "{}: mask must be floating (it is added to the scores), got {}",
                 op, dtype_name(mask.dtype()));
  bool fits = mask.dim() <= 4;
  for (std::int64_t i = 1; fits && i <= mask.dim(); ++i) {
    const std::int64_t size = mask.size(-i);
    fits = size == 1 || size == scores[static_cast<std::size_t>(4 - i)];
  }
  SHARDLAB_CHECK(fits, "{}: mask of shape {} does not broadcast to the scores [B, H, T, S] = {}", op,
                 shape_str(mask.shape()), shape_str(scores));
  return mask.to(dtype);
}

// a && b for bool tensors that broadcast together; an undefined operand is all true.
Tensor both(const Tensor& a, const Tensor& b) {
  if (!a.defined()) return b;
  return where(a, b, false);
}

// Where query t may attend to key s, as bool broadcastable to the scores [B, H, T, S]: not to a
// later key when causal, a padding key (nor at all as a padding query when T == S), a key of another
// document, or a key the additive mask sets to -inf. Undefined when every pair may attend.
Tensor visible_pairs(const AttentionOptions& options, const Shape& scores, Device device) {
  const std::int64_t batch = scores[0], queries = scores[2], keys = scores[3];
  Tensor visible;
  if (options.causal) {
    const TensorOptions positions{DType::i64, device};
    visible = le(arange(keys, positions).unsqueeze(0), arange(queries, positions).unsqueeze(1));  // s <= t
  }
  if (options.padding.defined()) {
    const Tensor real = eq(options.padding, false);
    visible = both(visible, real.view({batch, 1, 1, keys}));
    if (queries == keys) visible = both(visible, real.view({batch, 1, queries, 1}));
  }
  if (options.documents.defined()) {
    const Tensor& documents = options.documents;
    visible =
        both(visible, eq(documents.reshape({batch, 1, queries, 1}), documents.reshape({batch, 1, 1, keys})));
  }
  if (options.mask.defined()) {
    visible = both(visible, gt(options.mask, -std::numeric_limits<double>::infinity()));
  }
  return visible;
}

// The most negative finite value of a floating dtype: what hidden scores become.
double lowest_finite(const char* op, DType dtype) {
  switch (dtype) {
    case DType::f64:
      return std::numeric_limits<double>::lowest();
    case DType::f32:
      return std::numeric_limits<float>::lowest();
    case DType::bf16:
      return -3.3895313892515355e38;  // -(2 - 2^-7) * 2^127
    case DType::f16:
      return -65504.0;
    default:
      fail("{}: needs a floating dtype, got {}", op, dtype_name(dtype));
  }
}

constexpr const char* kAttention = "scaled_dot_product_attention";

// Checks what both attention paths need; an undefined variable is reported by name.
void check_attention(const Variable& q, const Variable& k, const Variable& v,
                     const AttentionOptions& options) {
  const auto data = [](const Variable& x) { return x.defined() ? x.data() : Tensor(); };
  check_attention_operands(kAttention, data(q), data(k), data(v), options.padding, options.documents);
}

// [B, Hkv, S, D] -> [B, Hkv * groups, S, D]: each head repeated `groups` times in a row, so
// query head h reads head h / groups. expand's backward sums the copies' gradients back
// into the shared head.
Variable repeat_heads(const Variable& x, std::int64_t groups) {
  const Shape s = x.shape();
  return reshape(expand(unsqueeze(x, 2), {s[0], s[1], groups, s[2], s[3]}),
                 {s[0], s[1] * groups, s[2], s[3]});
}

// softmax(scale q k^T + mask) v over the visible keys, from differentiable ops.
Variable naive(const Variable& q, const Variable& k, const Variable& v, const AttentionOptions& options) {
  const std::int64_t groups = q.size(1) / k.size(1);
  const Variable keys = groups == 1 ? k : repeat_heads(k, groups);
  const Variable values = groups == 1 ? v : repeat_heads(v, groups);
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  // (q * scale) k^T: the scale applied to [B, H, T, D] rather than to the larger scores.
  Variable scores = matmul(mul(q, scale), transpose(keys, -2, -1));  // [B, H, T, S]
  if (options.mask.defined()) {
    scores = add(scores, constant(additive_mask(kAttention, options.mask, scores.shape(), q.dtype())));
  }
  const Tensor visible = visible_pairs(options, scores.shape(), q.device());
  if (!visible.defined()) return matmul(softmax(scores, -1), values);
  // Hidden scores become the lowest finite value rather than -inf: a query that sees nothing then
  // gets a finite (uniform) softmax, which the 0/1 factor zeroes, where -inf would give NaN, and
  // NaN * 0 is NaN again in backward.
  const TensorOptions like{q.dtype(), q.device()};
  scores = where(visible, scores, constant(full({}, lowest_finite(kAttention, q.dtype()), like)));
  const Tensor sees_any = gt(sum(visible, {-1}, true), 0).to(q.dtype());
  return mul(matmul(softmax(scores, -1), values), constant(sees_any));
}

// One node: core's fused kernels compute the output and, in backward, all three gradients.
// Bitwise training: the backward chunk by chunk of the batch's samples, as the kernel deals its work
// (how it splits a head's dQ) by the batch it is given; each sample's gradients are its own.
AttentionGrads chunked_attention_backward(const autograd::BatchChunks& chunks, const Tensor& g,
                                          const Tensor& q, const Tensor& k, const Tensor& v,
                                          const AttentionResult& result, const AttentionParams& params) {
  const auto dense = [](const Tensor& t) { return empty(t.shape(), TensorOptions{t.dtype(), t.device()}); };
  const AttentionGrads grads{dense(q), dense(k), dense(v)};
  for (const autograd::RowRange& chunk : autograd::chunk_rows(chunks, q.size(0), kAttention)) {
    const auto part = [&](const Tensor& t) {
      return t.defined() ? t.narrow(0, chunk.start, chunk.count) : t;
    };
    const AttentionParams chunk_params{.causal = params.causal,
                                       .padding = part(params.padding),
                                       .documents = part(params.documents),
                                       .scale = params.scale};
    const AttentionGrads parts = attention_backward(part(g), part(q), part(k), part(v),
                                                    {part(result.out), part(result.logsumexp)}, chunk_params);
    part(grads.q).copy_(parts.q);
    part(grads.k).copy_(parts.k);
    part(grads.v).copy_(parts.v);
  }
  return grads;
}

Variable fused(const Variable& q, const Variable& k, const Variable& v, const AttentionOptions& options) {
  SHARDLAB_CHECK(!options.mask.defined(), "{}: the fused path takes no additive mask (got one of shape {})",
                 kAttention, shape_str(options.mask.shape()));
  const AttentionParams params{.causal = options.causal,
                               .padding = options.padding,
                               .documents = options.documents,
                               .scale = options.scale};
  const Tensor x = q.data(), y = k.data(), z = v.data();
  const AttentionResult result = attention_forward(x, y, z, params);
  const bool need_q = q.requires_grad(), need_k = k.requires_grad(), need_v = v.requires_grad();
  const std::optional<autograd::BatchChunks> chunks = autograd::batch_chunks();
  return record("attention", {q, k, v}, result.out, [=](const Tensor& g) -> Grads {
    const AttentionGrads grads = chunks ? chunked_attention_backward(*chunks, g, x, y, z, result, params)
                                        : attention_backward(g, x, y, z, result, params);
    return {need_q ? grads.q : Tensor(), need_k ? grads.k : Tensor(), need_v ? grads.v : Tensor()};
  });
}

}  // namespace

Variable nll_loss(const Variable& log_probs, const Tensor& targets, std::int64_t ignore_index,
                  Reduction reduction) {
  check_loss_inputs("nll_loss", "log_probs", log_probs, targets);
  // -log_probs[i, targets[i]], 0 where ignored.
  return reduce_losses("nll_loss", neg(gather_targets(log_probs, targets, ignore_index)), targets,
                       ignore_index, reduction);
}

Variable cross_entropy(const Variable& logits, const Tensor& targets, std::int64_t ignore_index,
                       Reduction reduction) {
  check_loss_inputs("cross_entropy", "logits", logits, targets);
  // One node over core's fused kernels: no log-softmax [N, C] in memory, forward or backward.
  const Tensor x = logits.data();
  const CrossEntropyResult result = cross_entropy_forward(x, targets, ignore_index);
  const Variable losses = record("cross_entropy", {logits}, result.losses, [=](const Tensor& g) -> Grads {
    return {cross_entropy_backward(g, x, targets, ignore_index, result.logsumexp)};
  });
  return reduce_losses("cross_entropy", losses, targets, ignore_index, reduction);
}

namespace {

// Checks rms_norm's operands; true when they take the fused kernels.
bool fused_rms_norm(const char* op, const Variable& x, const Variable& weight) {
  SHARDLAB_CHECK(x.defined(), "{}: x is undefined", op);
  SHARDLAB_CHECK(weight.defined(), "{}: weight is undefined", op);
  SHARDLAB_CHECK(x.dim() >= 1, "{}: x must have at least 1 dimension, got shape {}", op,
                 shape_str(x.shape()));
  const Shape expected{x.size(-1)};
  SHARDLAB_CHECK(weight.shape() == expected, "{}: weight has shape {} but x of shape {} needs {}", op,
                 shape_str(weight.shape()), shape_str(x.shape()), shape_str(expected));
  return x.dtype() == weight.dtype() && is_floating(x.dtype());
}

// Bitwise training: the norm's backward chunk by chunk of the batch's rows, each with the chunk's
// shapes; the weight's gradient goes one part per chunk, x's (a row's own) is returned whole.
Tensor rms_norm_chunk_parts(const autograd::BatchChunks& chunks, const Tensor& g, const Tensor& input,
                            const Tensor& scale, const Tensor& rstd, bool need_weight) {
  const std::int64_t width = input.size(-1), rows = input.numel() / std::max<std::int64_t>(width, 1);
  const Tensor rows_g = g.reshape({rows, width}), rows_x = input.reshape({rows, width});
  const Tensor rows_rstd = rstd.reshape({rows});
  const Tensor grad_x = empty({rows, width}, TensorOptions{input.dtype(), input.device()});
  for (const autograd::RowRange& chunk : autograd::chunk_rows(chunks, rows, "rms_norm")) {
    const RmsNormGrads grads = rms_norm_backward(rows_g.narrow(0, chunk.start, chunk.count),
                                                 rows_x.narrow(0, chunk.start, chunk.count), scale,
                                                 rows_rstd.narrow(0, chunk.start, chunk.count));
    grad_x.narrow(0, chunk.start, chunk.count).copy_(grads.x);
    if (need_weight) autograd::deliver_gradient_part(1, grads.weight);
  }
  return grad_x.reshape(input.shape());
}

// The rms_norm node over a forward core computed from `x`'s values.
Variable record_rms_norm(const Variable& x, const Variable& weight, const RmsNormResult& result) {
  const Tensor input = x.data(), scale = weight.data(), rstd = result.rstd;
  const bool need_x = x.requires_grad(), need_weight = weight.requires_grad();
  const std::optional<autograd::BatchChunks> chunks = autograd::batch_chunks();
  return record("rms_norm", {x, weight}, result.out, [=](const Tensor& g) -> Grads {
    if (chunks) {
      const Tensor grad_x = rms_norm_chunk_parts(*chunks, g, input, scale, rstd, need_weight);
      return {need_x ? grad_x : Tensor(), Tensor()};
    }
    const RmsNormGrads grads = rms_norm_backward(g, input, scale, rstd);
    return {need_x ? grads.x : Tensor(), need_weight ? grads.weight : Tensor()};
  });
}

}  // namespace

Variable rms_norm(const Variable& x, const Variable& weight, double eps) {
  if (!fused_rms_norm("rms_norm", x, weight)) {  // the composed reference promotes
    const Variable inv_rms = rsqrt(add(mean(mul(x, x), {-1}, true), eps));
    return mul(mul(x, inv_rms), weight);
  }
  return record_rms_norm(x, weight, rms_norm_forward(x.data(), weight.data(), eps));
}

AddRmsNorm add_rms_norm(const Variable& x, const Variable& y, const Variable& weight, double eps) {
  SHARDLAB_CHECK(x.defined() && y.defined(), "add_rms_norm: x and y must be defined");
  if (!fused_rms_norm("add_rms_norm", x, weight) || y.dtype() != x.dtype() || y.shape() != x.shape()) {
    const Variable sum = add(x, y);
    return {sum, rms_norm(sum, weight, eps)};
  }
  const RmsNormResult result = add_rms_norm_forward(x.data(), y.data(), weight.data(), eps);
  const bool need_x = x.requires_grad(), need_y = y.requires_grad();
  const Variable sum = record("add", {x, y}, result.sum, [=](const Tensor& g) -> Grads {
    return {need_x ? g : Tensor(), need_y ? g : Tensor()};
  });
  return {sum, record_rms_norm(sum, weight, result)};
}

Variable swiglu(const Variable& gate, const Variable& up) {
  SHARDLAB_CHECK(gate.defined() && up.defined(), "swiglu: gate and up must be defined");
  if (gate.dtype() != up.dtype() || gate.shape() != up.shape() || !is_floating(gate.dtype()))
    return mul(silu(gate), up);  // promotes and broadcasts
  const Tensor a = gate.data(), b = up.data();
  const bool need_gate = gate.requires_grad(), need_up = up.requires_grad();
  return record("swiglu", {gate, up}, swiglu(a, b), [=](const Tensor& g) -> Grads {
    const SwigluGrads grads = swiglu_backward(g, a, b);
    return {need_gate ? grads.gate : Tensor(), need_up ? grads.up : Tensor()};
  });
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
  check_attention(q, k, v, options);
  // bf16 and f16 fuse where flash attention takes them (a GPU, head dims 64 or 128); elsewhere the
  // composed path keeps them in their own dtype rather than in f32.
  const bool fusable =
      !options.mask.defined() && supports<&Kernels::attention_forward>(q.device()) &&
      attention_kernel(q.dtype(), q.device(), q.size(-1), v.size(-1)) != AttentionKernel::in_f32;
  return fusable ? fused(q, k, v, options) : naive(q, k, v, options);
}

namespace detail {

Variable naive_attention(const Variable& q, const Variable& k, const Variable& v,
                         const AttentionOptions& options) {
  check_attention(q, k, v, options);
  return naive(q, k, v, options);
}

Variable fused_attention(const Variable& q, const Variable& k, const Variable& v,
                         const AttentionOptions& options) {
  check_attention(q, k, v, options);
  return fused(q, k, v, options);
}

}  // namespace detail

Variable rotary_embedding(const Variable& x, const Tensor& cos, const Tensor& sin) {
  SHARDLAB_CHECK(x.defined() && x.dim() >= 2, "rotary_embedding: x must be [..., T, D], got {}",
                 x.defined() ? shape_str(x.shape()) : "undefined");
  const std::int64_t length = x.size(-2), dim = x.size(-1);
  SHARDLAB_CHECK(dim % 2 == 0, "rotary_embedding: the last dim of x {} must be even", shape_str(x.shape()));
  const Shape table{length, dim};
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    SHARDLAB_CHECK(t->defined() && t->shape() == table, "rotary_embedding: {} must be {} for x {}, got {}",
                   name, shape_str(table), shape_str(x.shape()),
                   t->defined() ? shape_str(t->shape()) : "undefined");
    SHARDLAB_CHECK(t->dtype() == x.dtype(), "rotary_embedding: {} is {} but x is {}", name,
                   dtype_name(t->dtype()), dtype_name(x.dtype()));
  }
  // One node over core's fused kernel; its transpose is the backward.
  return record("rotary_embedding", {x}, rotary(x.data(), cos, sin),
                [cos, sin](const Tensor& g) -> Grads { return {rotary(g, cos, sin, /*transpose=*/true)}; });
}

}  // namespace shardlab
