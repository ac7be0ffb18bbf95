// core/conv.cpp: convolution and pooling: shapes and parameters checked, outputs allocated.
#include "core/conv.h"

#include <string>

#include "core/op_checks.h"

namespace shardlab {

using namespace detail;

namespace {

std::int64_t conv_output_size(const char* op, std::int64_t input, std::int64_t kernel, std::int64_t stride,
                              std::int64_t padding) {
  const std::int64_t span = input + 2 * padding - kernel;
  SHARDLAB_CHECK(span >= 0, "{}: kernel size {} does not fit input size {} with padding {}", op, kernel,
                 input, padding);
  return span / stride + 1;
}

void check_conv_params(const char* op, Conv2dParams p) {
  SHARDLAB_CHECK(p.stride >= 1, "{}: stride must be at least 1, got {}", op, p.stride);
  SHARDLAB_CHECK(p.padding >= 0, "{}: padding must be non-negative, got {}", op, p.padding);
}

void check_rank4(const char* op, const Shape& shape, const char* what) {
  SHARDLAB_CHECK(shape.size() == 4, "{}: {} must be 4-D, got shape {}", op, what, shape_str(shape));
}

// Output shape of conv2d, after checking input [N, C, H, W] against weight [O, C, KH, KW].
Shape conv_output_shape(const char* op, const Shape& input, const Shape& weight, Conv2dParams p) {
  check_conv_params(op, p);
  check_rank4(op, input, "input [N, C, H, W]");
  check_rank4(op, weight, "weight [O, C, KH, KW]");
  SHARDLAB_CHECK(input[1] == weight[1], "{}: input {} has {} channels but weight {} expects {}", op,
                 shape_str(input), input[1], shape_str(weight), weight[1]);
  return {input[0], weight[0], conv_output_size(op, input[2], weight[2], p.stride, p.padding),
          conv_output_size(op, input[3], weight[3], p.stride, p.padding)};
}

void check_conv_operands(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, a, b);
  check_floating(op, a);
  SHARDLAB_CHECK(a.dtype() == b.dtype(), "{}: dtypes differ ({} and {})", op, dtype_name(a.dtype()),
                 dtype_name(b.dtype()));
}

void check_grad_shape(const char* op, const Tensor& grad, const Shape& expected) {
  SHARDLAB_CHECK(grad.shape() == expected, "{}: grad_output has shape {} but the forward output was {}", op,
                 shape_str(grad.shape()), shape_str(expected));
}

}  // namespace

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams params) {
  check_defined("conv2d", input);
  check_defined("conv2d", weight, "weight");
  check_conv_operands("conv2d", input, weight);
  const Shape out_shape = conv_output_shape("conv2d", input.shape(), weight.shape(), params);
  if (bias.defined()) {
    check_conv_operands("conv2d", input, bias);
    SHARDLAB_CHECK(bias.shape() == Shape{weight.size(0)},
                   "conv2d: bias has shape {} but weight {} needs [{}]", shape_str(bias.shape()),
                   shape_str(weight.shape()), weight.size(0));
  }
  Tensor out = empty(out_shape, TensorOptions{input.dtype(), input.device()});
  if (out.numel() > 0) {
    kernel<&Kernels::conv2d>(input.device(), "conv2d")(
        input.contiguous(), weight.contiguous(), bias.defined() ? bias.contiguous() : bias, params, out);
  }
  return out;
}

Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight, const Shape& input_shape,
                             Conv2dParams params) {
  const char* op = "conv2d_backward_input";
  check_defined(op, grad_output, "grad_output");
  check_defined(op, weight, "weight");
  check_conv_operands(op, grad_output, weight);
  check_grad_shape(op, grad_output, conv_output_shape(op, input_shape, weight.shape(), params));
  Tensor grad_input = zeros(input_shape, TensorOptions{weight.dtype(), weight.device()});
  if (grad_output.numel() > 0) {
    kernel<&Kernels::conv2d_backward_input>(weight.device(), op)(grad_output.contiguous(),
                                                                 weight.contiguous(), params, grad_input);
  }
  return grad_input;
}

Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, const Shape& weight_shape,
                              Conv2dParams params) {
  const char* op = "conv2d_backward_weight";
  check_defined(op, grad_output, "grad_output");
  check_defined(op, input);
  check_conv_operands(op, grad_output, input);
  check_grad_shape(op, grad_output, conv_output_shape(op, input.shape(), weight_shape, params));
  Tensor grad_weight = zeros(weight_shape, TensorOptions{input.dtype(), input.device()});
  if (grad_output.numel() > 0) {
    kernel<&Kernels::conv2d_backward_weight>(input.device(), op)(grad_output.contiguous(), input.contiguous(),
                                                                 params, grad_weight);
  }
  return grad_weight;
}

MaxPool2dResult max_pool2d(const Tensor& input, MaxPool2dParams params) {
  const char* op = "max_pool2d";
  check_defined(op, input);
  check_rank4(op, input.shape(), "input [N, C, H, W]");
  SHARDLAB_CHECK(params.kernel_size >= 1, "{}: kernel_size must be at least 1, got {}", op,
                 params.kernel_size);
  if (params.stride == 0) params.stride = params.kernel_size;
  SHARDLAB_CHECK(params.stride >= 1, "{}: stride must be at least 1, got {}", op, params.stride);
  SHARDLAB_CHECK(params.padding >= 0 && 2 * params.padding <= params.kernel_size,
                 "{}: padding must be between 0 and half the kernel size {}, got {}", op, params.kernel_size,
                 params.padding);
  SHARDLAB_CHECK(input.dtype() != DType::boolean, "{}: not defined for bool tensors", op);
  const Shape out_shape{
      input.size(0), input.size(1),
      conv_output_size(op, input.size(2), params.kernel_size, params.stride, params.padding),
      conv_output_size(op, input.size(3), params.kernel_size, params.stride, params.padding)};
  MaxPool2dResult result{empty(out_shape, TensorOptions{input.dtype(), input.device()}),
                         empty(out_shape, TensorOptions{DType::i64, input.device()})};
  if (result.values.numel() > 0) {
    kernel<&Kernels::max_pool2d>(input.device(), op)(input.contiguous(), params, result.values,
                                                     result.indices);
  }
  return result;
}

Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& indices, const Shape& input_shape) {
  const char* op = "max_pool2d_backward";
  check_defined(op, grad_output, "grad_output");
  check_defined(op, indices, "indices");
  check_same_device(op, grad_output, indices);
  check_rank4(op, input_shape, "input shape");
  SHARDLAB_CHECK(indices.dtype() == DType::i64, "{}: indices must be i64, got {}", op,
                 dtype_name(indices.dtype()));
  SHARDLAB_CHECK(grad_output.shape() == indices.shape() && grad_output.dim() == 4 &&
                     grad_output.size(0) == input_shape[0] && grad_output.size(1) == input_shape[1],
                 "{}: grad_output {} and indices {} do not match input {}", op,
                 shape_str(grad_output.shape()), shape_str(indices.shape()), shape_str(input_shape));
  // The kernel writes every element: zeros, then each window's gradient at its argmax.
  Tensor grad_input = empty(input_shape, TensorOptions{grad_output.dtype(), grad_output.device()});
  if (grad_input.numel() > 0) {
    kernel<&Kernels::max_pool2d_backward>(grad_output.device(), op)(
        grad_output.contiguous(),
        checked_index(op, indices, input_shape[2] * input_shape[3], "an input plane"), grad_input);
  }
  return grad_input;
}

std::span<const OpInfo> conv_ops() {
  static constexpr OpInfo ops[] = {{"conv2d", OpCategory::gemm},
                                   {"conv2d_backward_input", OpCategory::gemm},
                                   {"conv2d_backward_weight", OpCategory::gemm},
                                   {"max_pool2d", OpCategory::reductions},
                                   {"max_pool2d_backward", OpCategory::reductions}};
  return ops;
}

}  // namespace shardlab
