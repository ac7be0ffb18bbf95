// core/transformer.h: the Llama block's fused ops (RMSNorm, residual add + RMSNorm, SwiGLU, rotary) and
// their kernel entries.
#pragma once

#include <cstdint>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// The Llama block's fused ops, each one kernel forward and one backward (autograd's rms_norm, swiglu
// and rotary_embedding use them): operands of one floating dtype on one device.
// x [..., D] * rsqrt(mean(x^2 over D) + eps) * weight [D]; rstd [...] (f32 for bf16/f16) for backward.
struct RmsNormResult {
  Tensor out, rstd;
  Tensor sum;  // add_rms_norm_forward's x + y, the rows it normalised; undefined for rms_norm_forward
};
RmsNormResult rms_norm_forward(const Tensor& x, const Tensor& weight, double eps);
// The residual stream's add and the norm of its result in one pass: sum = x + y (the bits of
// add(x, y)), out and rstd those rms_norm_forward(sum, ...) gives, x and y of one shape.
RmsNormResult add_rms_norm_forward(const Tensor& x, const Tensor& y, const Tensor& weight, double eps);
struct RmsNormGrads {
  Tensor x, weight;
};
RmsNormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd);
// silu(gate) * up, gate and up of one shape.
Tensor swiglu(const Tensor& gate, const Tensor& up);
struct SwigluGrads {
  Tensor gate, up;
};
SwigluGrads swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up);
// x [..., T, D] * cos + rotate_half(x) * sin, cos and sin [T, D] (D even); transpose: the map's
// transpose, which is its backward.
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose = false);

// The Llama block's fused kernels (core/transformer.h), over contiguous operands of one floating dtype.
struct TransformerKernels {
  // RMS normalisation over the last dim of x with weight [D]: out and rstd [rows] (compute dtype).
  // With `added` defined (x's shape), the rows normalised are those of x + added, written to sum
  // with the bits of binary add.
  void (*rms_norm_forward)(const Tensor& x, const Tensor& added, const Tensor& weight, double eps,
                           const Tensor& sum, const Tensor& out, const Tensor& rstd);
  void (*rms_norm_backward)(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            const Tensor& grad_x, const Tensor& grad_weight);
  // silu(gate) * up, and its gradients.
  void (*swiglu_forward)(const Tensor& gate, const Tensor& up, const Tensor& out);
  void (*swiglu_backward)(const Tensor& grad_out, const Tensor& gate, const Tensor& up,
                          const Tensor& grad_gate, const Tensor& grad_up);
  // Rotary embedding of x [..., T, D] by cos, sin [T, D]; transpose: its transpose (the backward).
  // x and out contiguous, or as strided_heads says.
  void (*rotary)(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const Tensor& out);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> transformer_ops();

// This family's entries on each device: core/cpu/transformer.cpp, core/cuda/transformer.cu.
namespace cpu {
TransformerKernels transformer_kernels();
}
namespace cuda {
TransformerKernels transformer_kernels();
}

}  // namespace shardlab
