// core/conv.h: 2-D convolution and max pooling (NCHW) with their gradients, and their kernel entries.
#pragma once

#include <cstdint>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

struct Conv2dParams {
  std::int64_t stride = 1;
  std::int64_t padding = 0;
};
// input [N, C, H, W], weight [O, C, KH, KW], optional bias [O] -> [N, O, OH, OW].
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, Conv2dParams params = {});
// The two gradients of conv2d (bias gradient is sum(grad_output, {0, 2, 3})).
Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight, const Shape& input_shape,
                             Conv2dParams params = {});
Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, const Shape& weight_shape,
                              Conv2dParams params = {});

struct MaxPool2dParams {
  std::int64_t kernel_size = 2;
  std::int64_t stride = 0;  // 0 means kernel_size, as in PyTorch
  std::int64_t padding = 0;
};
struct MaxPool2dResult {
  Tensor values;   // [N, C, OH, OW]
  Tensor indices;  // i64, flat index h * W + w of each maximum within its input plane
};
MaxPool2dResult max_pool2d(const Tensor& input, MaxPool2dParams params = {});
Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& indices, const Shape& input_shape);

// Contiguous NCHW operands.
struct ConvKernels {
  // Contiguous NCHW operands; bias may be undefined.
  void (*conv2d)(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p,
                 const Tensor& out);
  void (*conv2d_backward_input)(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                                const Tensor& grad_in);
  void (*conv2d_backward_weight)(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                                 const Tensor& grad_weight);
};

// Max pooling's kernels, over contiguous NCHW operands.
struct PoolKernels {
  void (*max_pool2d)(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices);
  // Writes every element of grad_in: zero where no window's argmax lands.
  void (*max_pool2d_backward)(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> conv_ops();

// This family's entries on each device: core/cpu/conv.cpp and pool.cpp, core/cuda/conv.cu and pool.cu.
namespace cpu {
ConvKernels conv_kernels();
PoolKernels pool_kernels();
}  // namespace cpu
namespace cuda {
ConvKernels conv_kernels();
PoolKernels pool_kernels();
}  // namespace cuda

}  // namespace shardlab
