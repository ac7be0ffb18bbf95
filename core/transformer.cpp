// core/transformer.cpp: RMSNorm, SwiGLU and rotary: operands checked, outputs laid out for the heads.
#include "core/transformer.h"

#include <initializer_list>
#include <utility>

#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

namespace {

// Operands of a fused op: `reference` floating; the others defined, of its dtype and device.
void check_fused_operands(const char* op, const Tensor& reference,
                          std::initializer_list<std::pair<const Tensor*, const char*>> others) {
  check_floating(op, reference);
  for (const auto& [t, name] : others) {
    check_defined(op, *t, name);
    check_same_device(op, reference, *t);
    SHARDLAB_CHECK(t->dtype() == reference.dtype(), "{}: {} is {} but the input is {}", op, name,
                   dtype_name(t->dtype()), dtype_name(reference.dtype()));
  }
}

// rms_norm_forward, or add_rms_norm_forward with `added` defined (checked by the caller).
RmsNormResult norm_rows(const char* op, const Tensor& x, const Tensor& added, const Tensor& weight,
                        double eps) {
  SHARDLAB_CHECK(x.dim() >= 1 && weight.shape() == Shape{x.size(-1)},
                 "{}: weight {} must be [D] for x {} of last dim D", op, shape_str(weight.shape()),
                 shape_str(x.shape()));
  const Shape rows(x.shape().begin(), x.shape().end() - 1);
  const TensorOptions options{x.dtype(), x.device()};
  RmsNormResult result{empty(x.shape(), options),
                       empty(rows, TensorOptions{logsumexp_dtype(x.dtype()), x.device()}),
                       added.defined() ? empty(x.shape(), options) : Tensor()};
  if (x.numel() > 0) {
    kernel<&Kernels::rms_norm_forward>(x.device(), op)(
        x.contiguous(), added.defined() ? added.contiguous() : added, weight.contiguous(), eps, result.sum,
        result.out, result.rstd);
  }
  return result;
}

}  // namespace

RmsNormResult rms_norm_forward(const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&weight, "weight"}});
  return norm_rows(op, x, Tensor(), weight, eps);
}

RmsNormResult add_rms_norm_forward(const Tensor& x, const Tensor& y, const Tensor& weight, double eps) {
  const char* op = "add_rms_norm";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&y, "y"}, {&weight, "weight"}});
  SHARDLAB_CHECK(y.shape() == x.shape(), "{}: x {} and y {} differ in shape (add them first to broadcast)",
                 op, shape_str(x.shape()), shape_str(y.shape()));
  return norm_rows(op, x, y, weight, eps);
}

RmsNormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd) {
  const char* op = "rms_norm_backward";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&grad_out, "grad_out"}, {&weight, "weight"}});
  SHARDLAB_CHECK(grad_out.shape() == x.shape() && x.dim() >= 1 && weight.shape() == Shape{x.size(-1)},
                 "{}: grad_out {}, x {} and weight {} do not match", op, shape_str(grad_out.shape()),
                 shape_str(x.shape()), shape_str(weight.shape()));
  // The kernels write every element of both; with no rows the weight's gradient is zero.
  const TensorOptions options{x.dtype(), x.device()};
  RmsNormGrads grads{empty(x.shape(), options),
                     x.numel() > 0 ? empty(weight.shape(), options) : zeros(weight.shape(), options)};
  if (x.numel() > 0) {
    kernel<&Kernels::rms_norm_backward>(x.device(), op)(
        grad_out.contiguous(), x.contiguous(), weight.contiguous(), rstd.contiguous(), grads.x, grads.weight);
  }
  return grads;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu";
  check_defined(op, gate, "gate");
  check_fused_operands(op, gate, {{&up, "up"}});
  SHARDLAB_CHECK(gate.shape() == up.shape(), "{}: gate {} and up {} differ in shape", op,
                 shape_str(gate.shape()), shape_str(up.shape()));
  Tensor out = empty(gate.shape(), TensorOptions{gate.dtype(), gate.device()});
  if (out.numel() > 0)
    kernel<&Kernels::swiglu_forward>(gate.device(), op)(gate.contiguous(), up.contiguous(), out);
  return out;
}

SwigluGrads swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_backward";
  check_defined(op, gate, "gate");
  check_fused_operands(op, gate, {{&up, "up"}, {&grad_out, "grad_out"}});
  SHARDLAB_CHECK(gate.shape() == up.shape() && gate.shape() == grad_out.shape(),
                 "{}: grad_out {}, gate {} and up {} differ in shape", op, shape_str(grad_out.shape()),
                 shape_str(gate.shape()), shape_str(up.shape()));
  SwigluGrads grads{empty(gate.shape(), TensorOptions{gate.dtype(), gate.device()}),
                    empty(gate.shape(), TensorOptions{gate.dtype(), gate.device()})};
  if (gate.numel() > 0) {
    kernel<&Kernels::swiglu_backward>(gate.device(), op)(grad_out.contiguous(), gate.contiguous(),
                                                         up.contiguous(), grads.gate, grads.up);
  }
  return grads;
}

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose) {
  const char* op = "rotary_embedding";
  check_defined(op, x, "x");
  check_fused_operands(op, x, {{&cos, "cos"}, {&sin, "sin"}});
  SHARDLAB_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "{}: x must be [..., T, D] with D even, got {}", op,
                 shape_str(x.shape()));
  const Shape table{x.size(-2), x.size(-1)};
  SHARDLAB_CHECK(cos.shape() == table && sin.shape() == table, "{}: cos {} and sin {} must be {} for x {}",
                 op, shape_str(cos.shape()), shape_str(sin.shape()), shape_str(table), shape_str(x.shape()));
  Tensor out = empty_for_heads(x, x.shape());
  if (out.numel() > 0)
    kernel<&Kernels::rotary>(x.device(), op)(head_rows(x), cos.contiguous(), sin.contiguous(), transpose,
                                             out);
  return out;
}

std::span<const OpInfo> transformer_ops() {
  static constexpr OpInfo ops[] = {
      {"rms_norm", OpCategory::reductions, "a block per row"},
      {"add_rms_norm", OpCategory::reductions, "a block per row, the residual add's sum written on the way"},
      {"rms_norm_backward", OpCategory::reductions, "a block per row; the weight gradient in two-pass column sums"},
      {"swiglu", OpCategory::elementwise, "fused elementwise, 16-byte packs"},
      {"swiglu_backward", OpCategory::elementwise, "fused elementwise, 16-byte packs"},
      {"rotary_embedding", OpCategory::elementwise, "fused elementwise over (T, D) tables", true}};
  return ops;
}

}  // namespace shardlab
