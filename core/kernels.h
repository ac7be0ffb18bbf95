// core/kernels.h: the dispatch table: one Kernels table per device type, each entry a
// function that computes into outputs the op layer (core/ops.cpp) has already validated
// and allocated. A device without a kernel for an entry leaves it null; supports() says so.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/op_codes.h"
#include "core/ops.h"
#include "core/random.h"
#include "core/tensor.h"

namespace shardlab {

const char* op_name(UnaryOp op);
const char* op_name(BinaryOp op);
const char* op_name(ReduceOp op);

// Conventions for every entry: inputs and outputs are on the table's device; elementwise
// inputs are already broadcast (expanded views) to the output shape and share one dtype
// (comparisons write bool); outputs are freshly allocated and contiguous unless noted.
struct Kernels {
  void (*fill)(const Tensor& out, Scalar value);  // out may be strided
  // dst may be strided; src has dst's shape (possibly expanded), any dtype.
  void (*copy)(const Tensor& dst, const Tensor& src);
  void (*unary)(UnaryOp op, const Tensor& in, const Tensor& out);
  void (*binary)(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
  void (*where)(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out);
  // out has the keepdim shape (reduced dims of size 1); dims are sorted and distinct.
  void (*reduce)(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out);
  // out (f64 scalar) = the sum of every element's square over `tensors` (contiguous, floating, not
  // empty; dtypes may differ), in core/square_sums.h's order.
  void (*foreach_sum_squares)(std::span<const Tensor> tensors, const Tensor& out);
  // a [B, M, K], b [B, K, N] (any strides, batch stride may be 0) -> out [B, M, N]; bias undefined, or
  // [N] (contiguous) added to every row of each product in the compute type before it is rounded.
  void (*matmul)(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out);
  void (*softmax)(const Tensor& in, std::int64_t dim, bool log, const Tensor& out);
  // Cross-entropy from contiguous logits [N, C] and i64 targets [N] (checked: in [0, C) or
  // ignore_index): losses [N] in the logits' dtype, 0 where ignored; logsumexp [N] in their compute
  // dtype (f32 for halves). Backward: grad_logits [N, C] = grad_losses[i] * (softmax(logits)[i] -
  // onehot(targets[i])), 0 in ignored rows. No softmax [N, C] in memory.
  void (*cross_entropy_forward)(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                                const Tensor& losses, const Tensor& logsumexp);
  void (*cross_entropy_backward)(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                                 std::int64_t ignore_index, const Tensor& logsumexp,
                                 const Tensor& grad_logits);
  // The Llama block's fused kernels (core/ops.h), over contiguous operands of one floating dtype.
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
  // Contiguous NCHW operands; bias may be undefined.
  void (*conv2d)(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p,
                 const Tensor& out);
  void (*conv2d_backward_input)(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                                const Tensor& grad_in);
  void (*conv2d_backward_weight)(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                                 const Tensor& grad_weight);
  void (*max_pool2d)(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices);
  // Writes every element of grad_in: zero where no window's argmax lands.
  void (*max_pool2d_backward)(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in);
  // Fused attention (core/ops.h): q, k, v, grad_out, the forward's out and the gradients contiguous
  // (or as strided_heads says) and of one dtype (f32 or f64); logsumexp and params.padding (undefined
  // or) contiguous; params.scale set. The gradients arrive zero-filled.
  void (*attention_forward)(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                            const AttentionResult& result);
  void (*attention_backward)(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionResult& forward, const AttentionParams& params,
                             const AttentionGrads& grads);
  // Checks every value of `index` (contiguous i64, not empty) against [0, size); `op` and `what`
  // are string literals. The CPU throws at once. CUDA does not make the host wait for the answer:
  // a kernel records the first bad value, the next host wait (core/host_wait.h) on any device
  // throws the Error, and the index kernels meanwhile skip out-of-range values.
  void (*check_index)(const char* op, const Tensor& index, std::int64_t size, const char* what);
  // Index tensors are contiguous i64 and checked by check_index; data operands contiguous.
  void (*index_select)(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out);
  void (*gather)(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out);
  // out already holds a copy of self; these add src into it.
  void (*scatter_add)(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src);
  void (*index_add)(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src);
  // out is contiguous; element i receives draw number first_index + i.
  void (*random)(const RandomSpec& spec, const Tensor& out);
  // Non-empty segments on the table's device, each valid as in core/ops.h (operands of one
  // segment share shape, dtype (floating) and device, any strides; copy_out is undefined or has
  // param's shape, any floating dtype); segments may differ in dtype and do not share memory.
  // `apply`: undefined, or a one-element bool on the same device that gates every write.
  void (*adadelta_step)(std::span<const AdadeltaSegment> segments, const Tensor& apply);
  void (*adam_step)(std::span<const AdamSegment> segments, const Tensor& apply);
  // Whether rotary and attention read operand t where it lies (rows in unit stride along the last
  // dim, the other dims through their strides) and take outputs and gradients laid out as t (dense,
  // core/tensor.h's empty_in_layout_of): then q, k and v split from a [B, T, H * D] projection, and
  // the output merged back into one, need no copies. Where it says no, t is made contiguous.
  bool (*strided_heads)(const Tensor& t) = nullptr;
};

const Kernels& kernels_for(Device device);
const Kernels& cpu_kernels();
const Kernels& cuda_kernels();  // entries are null for ops without a CUDA kernel yet

// Whether `device` has a kernel for the entry, e.g. supports<&Kernels::softmax>(device).
template <auto Entry>
bool supports(Device device) {
  return kernels_for(device).*Entry != nullptr;
}

}  // namespace shardlab
