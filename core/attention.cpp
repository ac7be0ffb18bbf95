// core/attention.cpp: attention: operands checked, the kernel chosen (fused, flash, or in f32), outputs laid
// out for the heads.
#include "core/attention.h"

#include <cmath>
#include <string>

#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

namespace {

void check_documents(const char* op, const Tensor& q, const Tensor& k, const Tensor& documents,
                     const std::string& shapes) {
  check_same_device(op, q, documents);
  SHARDLAB_CHECK(documents.dtype() == DType::i64, "{}: documents must be i64 (a document per token), got {}",
                 op, dtype_name(documents.dtype()));
  SHARDLAB_CHECK(q.size(2) == k.size(2),
                 "{}: documents need queries and keys of the same tokens (T == S), got T {} and S {} ({})",
                 op, q.size(2), k.size(2), shapes);
  const Shape expected{q.size(0), q.size(2)};
  SHARDLAB_CHECK(documents.shape() == expected, "{}: documents of shape {} are not [B, T] = {} ({})", op,
                 shape_str(documents.shape()), shape_str(expected), shapes);
}

}  // namespace

void check_attention_operands(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& padding, const Tensor& documents) {
  for (const auto& [x, what] : {std::pair{&q, "q [B, H, T, D]"}, std::pair{&k, "k [B, Hkv, S, D]"},
                                std::pair{&v, "v [B, Hkv, S, D]"}}) {
    SHARDLAB_CHECK(x->defined(), "{}: {} is undefined", op, what);
    SHARDLAB_CHECK(x->dim() == 4, "{}: {} must be 4-D, got shape {}", op, what, shape_str(x->shape()));
  }
  const std::string shapes =
      fmt::format("q {}, k {}, v {}", shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  const std::int64_t batch = q.size(0), heads = q.size(1), kv_heads = k.size(1), keys = k.size(2);
  SHARDLAB_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "{}: dtypes differ ({}, {} and {})", op,
                 dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype()));
  SHARDLAB_CHECK(k.size(0) == batch && v.size(0) == batch, "{}: batch sizes differ ({})", op, shapes);
  SHARDLAB_CHECK(k.size(3) == q.size(3), "{}: q and k have different head dims ({} != {}; {})", op, q.size(3),
                 k.size(3), shapes);
  SHARDLAB_CHECK(v.size(1) == kv_heads, "{}: k and v have different numbers of heads ({} != {}; {})", op,
                 kv_heads, v.size(1), shapes);
  SHARDLAB_CHECK(v.size(2) == keys, "{}: k and v have different lengths ({} != {}; {})", op, keys, v.size(2),
                 shapes);
  SHARDLAB_CHECK(kv_heads > 0 && heads % kv_heads == 0,
                 "{}: {} query heads are not a multiple of {} key/value heads ({})", op, heads, kv_heads,
                 shapes);
  check_same_device(op, q, k);
  check_same_device(op, q, v);
  if (documents.defined()) check_documents(op, q, k, documents, shapes);
  if (!padding.defined()) return;
  check_same_device(op, q, padding);
  SHARDLAB_CHECK(padding.dtype() == DType::boolean,
                 "{}: padding must be bool (true marks a padding token), got {}", op,
                 dtype_name(padding.dtype()));
  const Shape expected{batch, keys};
  SHARDLAB_CHECK(padding.shape() == expected, "{}: padding of shape {} is not [B, S] = {} ({})", op,
                 shape_str(padding.shape()), shape_str(expected), shapes);
}

namespace {

// The operands of a fused attention op, checked, with what the kernels expect: operands on one
// device, floating, and the scale resolved.
AttentionParams checked_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionParams& params) {
  check_attention_operands(op, q, k, v, params.padding, params.documents);
  check_floating(op, q);
  AttentionParams resolved = params;
  if (params.padding.defined()) resolved.padding = params.padding.contiguous();
  if (params.documents.defined()) resolved.documents = params.documents.contiguous();
  resolved.scale = params.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  return resolved;
}

// Checks that `t` has `shape`, `dtype` and q's device, for attention_backward's extra operands.
void check_attention_tensor(const char* op, const char* what, const Tensor& t, const Tensor& q,
                            const Shape& shape, DType dtype) {
  SHARDLAB_CHECK(t.defined(), "{}: {} is undefined", op, what);
  check_same_device(op, q, t);
  SHARDLAB_CHECK(t.shape() == shape && t.dtype() == dtype, "{}: {} must be {} {}, got {} {}", op, what,
                 shape_str(shape), dtype_name(dtype), shape_str(t.shape()), dtype_name(t.dtype()));
}

bool in_f32(const Tensor& q, const Tensor& v) {
  return attention_kernel(q.dtype(), q.device(), q.size(3), v.size(3)) == AttentionKernel::in_f32;
}

}  // namespace

AttentionKernel attention_kernel(DType dtype, Device device, std::int64_t head_dim, std::int64_t value_dim) {
  if (dtype != DType::bf16 && dtype != DType::f16) return AttentionKernel::fused;
  const bool flash = device.is_cuda() && head_dim == value_dim && (head_dim == 64 || head_dim == 128);
  return flash ? AttentionKernel::flash : AttentionKernel::in_f32;
}

AttentionResult attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionParams& params) {
  const char* op = "attention_forward";
  const AttentionParams resolved = checked_attention(op, q, k, v, params);
  if (in_f32(q, v)) {
    const call_log::Scope logged(op, q.device(), q, k, v,
                                 resolved);  // the call as made, not its widened parts
    const AttentionResult wide =
        attention_forward(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), resolved);
    return {wide.out.to(q.dtype()), wide.logsumexp};
  }
  AttentionResult result{
      empty_for_heads(q, {q.size(0), q.size(1), q.size(2), v.size(3)}),
      empty({q.size(0), q.size(1), q.size(2)}, TensorOptions{logsumexp_dtype(q.dtype()), q.device()})};
  if (result.logsumexp.numel() > 0) {
    kernel<&Kernels::attention_forward>(q.device(), op)(head_rows(q), head_rows(k), head_rows(v), resolved,
                                                        result);
  }
  return result;
}

AttentionGrads attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionResult& forward, const AttentionParams& params) {
  const char* op = "attention_backward";
  const AttentionParams resolved = checked_attention(op, q, k, v, params);
  const Shape out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  check_attention_tensor(op, "grad_out", grad_out, q, out_shape, q.dtype());
  check_attention_tensor(op, "out", forward.out, q, out_shape, q.dtype());
  check_attention_tensor(op, "logsumexp", forward.logsumexp, q, {q.size(0), q.size(1), q.size(2)},
                         logsumexp_dtype(q.dtype()));
  if (in_f32(q, v)) {
    const call_log::Scope logged(op, q.device(), grad_out, q, k, v, resolved);
    const auto wide = [](const Tensor& t) { return t.to(DType::f32); };
    const AttentionGrads grads = attention_backward(wide(grad_out), wide(q), wide(k), wide(v),
                                                    {wide(forward.out), forward.logsumexp}, resolved);
    return {grads.q.to(q.dtype()), grads.k.to(q.dtype()), grads.v.to(q.dtype())};
  }
  // The kernels write every element (no zero-fill first: on a GPU, three launches and their bytes);
  // without queries or keys, every gradient is zero.
  const auto grad_for = [](const Tensor& like) { return empty_for_heads(like, like.shape()); };
  const AttentionGrads grads{grad_for(q), grad_for(k), grad_for(v)};
  if (grad_out.numel() > 0 && k.size(2) > 0) {
    kernel<&Kernels::attention_backward>(q.device(), op)(
        head_rows(grad_out), head_rows(q), head_rows(k), head_rows(v),
        AttentionResult{head_rows(forward.out), forward.logsumexp.contiguous()}, resolved, grads);
    return grads;
  }
  for (const Tensor& grad : {grads.q, grads.k, grads.v}) {
    if (grad.numel() > 0) grad.fill_(0);
  }
  return grads;
}

double attention_scored_pairs(Device device, const AttentionParams& params) {
  if (!params.documents.defined()) return 0;
  // Not through kernel<>: the call log asks this while it records the attention call.
  const auto scored_pairs = kernels_for(device).scored_pairs;
  SHARDLAB_CHECK(scored_pairs != nullptr, "attention: not supported on {} (no kernel for it in this build)",
                 device.str());
  return scored_pairs(params.documents.contiguous(), params.causal);
}

std::span<const OpInfo> attention_ops() {
  static constexpr OpInfo ops[] = {{"attention_forward", OpCategory::attention, {}, true},
                                   {"attention_backward", OpCategory::attention, {}, true}};
  return ops;
}

}  // namespace shardlab
