// core/cpu/kernels.h: internal to core/cpu: the CPU reference kernels that fill the CPU entries of
// core/kernels.h.
#pragma once

#include "core/kernels.h"

namespace shardlab::cpu {

void fill(const Tensor& out, Scalar value);
void copy(const Tensor& dst, const Tensor& src);
void unary(UnaryOp op, const Tensor& in, const Tensor& out);
void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
void where(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out);
void reduce(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out);
void foreach_sum_squares(std::span<const Tensor> tensors, const Tensor& out);
void matmul(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out);
void softmax(const Tensor& in, std::int64_t dim, bool log, const Tensor& out);
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                           const Tensor& losses, const Tensor& logsumexp);
void cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                            std::int64_t ignore_index, const Tensor& logsumexp, const Tensor& grad_logits);
void rms_norm_forward(const Tensor& x, const Tensor& added, const Tensor& weight, double eps,
                      const Tensor& sum, const Tensor& out, const Tensor& rstd);
void rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                       const Tensor& grad_x, const Tensor& grad_weight);
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out);
void swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up, const Tensor& grad_gate,
                     const Tensor& grad_up);
void rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const Tensor& out);
void conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p, const Tensor& out);
void conv2d_backward_input(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                           const Tensor& grad_in);
void conv2d_backward_weight(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                            const Tensor& grad_weight);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                       const AttentionResult& result);
void attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionResult& forward, const AttentionParams& params,
                        const AttentionGrads& grads);
void max_pool2d(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices);
void max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in);
void check_index(const char* op, const Tensor& index, std::int64_t size, const char* what);
void index_select(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out);
void gather(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out);
void scatter_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src);
void index_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src);
void random(const RandomSpec& spec, const Tensor& out);
void adam_step(std::span<const AdamSegment> segments, const Tensor& apply);
void adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply);

inline Tensor as_f32(const Tensor& t) { return t.defined() ? t.to(DType::f32) : t; }

// Runs fn(out32, inputs32...) on f32 copies when `out` is bf16/f16 and writes the result
// back rounded once; runs fn(out, inputs...) otherwise. GEMM-based kernels use it because
// OpenBLAS has no 16-bit GEMM (products accumulate in f32, as cuBLAS does for halves), and
// accumulating kernels so that a sum is not rounded to 8 or 11 bits after every addition.
template <typename Fn, typename... Inputs>
void in_f32_precision(const Tensor& out, Fn fn, const Inputs&... inputs) {
  if (out.dtype() != DType::bf16 && out.dtype() != DType::f16) return fn(out, inputs...);
  const Tensor out32 = out.to(DType::f32);
  fn(out32, as_f32(inputs)...);
  copy(out, out32);
}

}  // namespace shardlab::cpu
