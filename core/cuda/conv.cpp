// core/cuda/conv.cpp: the convolutions' entries: cuDNN where it takes the case, else im2col + cuBLAS GEMM.
#include "core/cuda/cudnn_conv.h"
#include "core/cuda/gemm.h"
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

// Builds that found cuDNN convolve through it (core/cuda/cudnn_conv.h); the others, and the cases cuDNN
// declines, take im2col + cuBLAS.
#ifdef SHARDLAB_CUDNN
constexpr bool kCudnn = true;
#else
constexpr bool kCudnn = false;
#endif

cuda::ConvShape conv_shape(const Shape& input, const Shape& weight, const Shape& output, Conv2dParams p) {
  return {.batch = input[0],
          .channels = input[1],
          .height = input[2],
          .width = input[3],
          .outs = weight[0],
          .kernel_h = weight[2],
          .kernel_w = weight[3],
          .out_h = output[2],
          .out_w = output[3],
          .stride = p.stride,
          .padding = p.padding};
}

std::int64_t patch_of(const cuda::ConvShape& g) { return g.channels * g.kernel_h * g.kernel_w; }
std::int64_t pixels_of(const cuda::ConvShape& g) { return g.out_h * g.out_w; }

Tensor im2col(const char* op, const Tensor& input, const cuda::ConvShape& g, cudaStream_t stream) {
  Tensor cols = empty({g.batch, patch_of(g), pixels_of(g)}, TensorOptions{input.dtype(), input.device()});
  SHARDLAB_CHECK(cuda::launch_im2col(input.dtype(), input.raw_data(), cols.raw_data(), g, stream),
                 "{}: no CUDA kernel for {}", op, dtype_name(input.dtype()));
  return cols;
}

// Per image: out[n] [O, pixels] = W [O, patch] cols[n] [patch, pixels], the column-major
// out^T = cols^T W^T; then the bias.
void cuda_conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p,
                 const Tensor& out) {
  const LaunchContext context(out);
  const cuda::ConvShape g = conv_shape(input.shape(), weight.shape(), out.shape(), p);
  const std::int64_t patch = patch_of(g), pixels = pixels_of(g), outs = weight.size(0);
  bool by_cudnn = false;
  if constexpr (kCudnn)
    by_cudnn = cuda::cudnn::conv2d(out.dtype(), input.raw_data(), weight.raw_data(), out.raw_data(), g,
                                   out.device().index, context.stream());
  if (!by_cudnn) {
    const Tensor cols = im2col("conv2d", input, g, context.stream());
    cuda::gemm_batched(out.dtype(), g.batch, pixels, outs, patch,
                       {cols.raw_data(), false, pixels, patch * pixels}, {weight.raw_data(), false, patch, 0},
                       out.raw_data(), pixels, outs * pixels, out.device().index, context.stream());
  }
  if (bias.defined()) {
    SHARDLAB_CHECK(cuda::launch_add_bias(out.dtype(), out.raw_data(), bias.raw_data(), g.batch, outs, pixels,
                                         context.stream()),
                   "conv2d: no CUDA kernel for {}", dtype_name(out.dtype()));
  }
}

// Per image: cols[n] [patch, pixels] = W^T grad_out[n], then col2im sums the taps of each pixel.
void cuda_conv2d_backward_input(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                                const Tensor& grad_in) {
  const LaunchContext context(grad_in);
  const cuda::ConvShape g = conv_shape(grad_in.shape(), weight.shape(), grad_out.shape(), p);
  if constexpr (kCudnn) {
    if (cuda::cudnn::conv2d_backward_input(grad_in.dtype(), grad_out.raw_data(), weight.raw_data(),
                                           grad_in.raw_data(), g, grad_in.device().index, context.stream()))
      return;
  }
  const std::int64_t patch = patch_of(g), pixels = pixels_of(g), outs = weight.size(0);
  const Tensor cols = empty({g.batch, patch, pixels}, TensorOptions{grad_in.dtype(), grad_in.device()});
  cuda::gemm_batched(grad_in.dtype(), g.batch, pixels, patch, outs,
                     {grad_out.raw_data(), false, pixels, outs * pixels}, {weight.raw_data(), true, patch, 0},
                     cols.raw_data(), pixels, patch * pixels, grad_in.device().index, context.stream());
  SHARDLAB_CHECK(
      cuda::launch_col2im(grad_in.dtype(), cols.raw_data(), grad_in.raw_data(), g, context.stream()),
      "conv2d_backward_input: no CUDA kernel for {}", dtype_name(grad_in.dtype()));
}

// Per image: products[n] [O, patch] = grad_out[n] cols[n]^T; then the sum over images, in a fixed
// order (the reduction kernel), written into grad_weight, which the op layer hands over zeroed.
void cuda_conv2d_backward_weight(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                                 const Tensor& grad_weight) {
  const LaunchContext context(grad_weight);
  const cuda::ConvShape g = conv_shape(input.shape(), grad_weight.shape(), grad_out.shape(), p);
  if constexpr (kCudnn) {
    if (cuda::cudnn::conv2d_backward_weight(grad_weight.dtype(), grad_out.raw_data(), input.raw_data(),
                                            grad_weight.raw_data(), g, grad_weight.device().index,
                                            context.stream()))
      return;
  }
  const std::int64_t patch = patch_of(g), pixels = pixels_of(g), outs = grad_weight.size(0);
  const Tensor cols = im2col("conv2d_backward_weight", input, g, context.stream());
  const Tensor products =
      empty({g.batch, outs * patch}, TensorOptions{grad_weight.dtype(), grad_weight.device()});
  cuda::gemm_batched(grad_weight.dtype(), g.batch, patch, outs, pixels,
                     {cols.raw_data(), true, pixels, patch * pixels},
                     {grad_out.raw_data(), false, pixels, outs * pixels}, products.raw_data(), patch,
                     outs * patch, grad_weight.device().index, context.stream());
  const Tensor per_weight = products.transpose(0, 1).contiguous();  // [O * patch, batch]
  SHARDLAB_CHECK(reduce_rows(ReduceOp::sum, per_weight, grad_weight, outs * patch, g.batch, context.stream()),
                 "conv2d_backward_weight: no CUDA kernel for {}", dtype_name(grad_weight.dtype()));
}

}  // namespace

ConvKernels conv_kernels() {
  return {.conv2d = cuda_conv2d,
          .conv2d_backward_input = cuda_conv2d_backward_input,
          .conv2d_backward_weight = cuda_conv2d_backward_weight};
}

}  // namespace shardlab::cuda
