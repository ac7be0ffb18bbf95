// core/cuda/conv.cu: the convolutions' entries: cuDNN where it takes the case (core/cuda/cudnn_conv.h),
// else im2col + GEMM (the GEMMs are cuBLAS, core/cuda/gemm.cpp), and that path's data-movement kernels:
// im2col, its adjoint col2im written as a gather (each input pixel sums its taps in a fixed order:
// deterministic, no atomics), and the bias add.
#include <cstdint>

#include "core/cuda/check.h"
#include "core/cuda/cudnn_conv.h"
#include "core/cuda/gemm.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

// cols [N, C*KH*KW, OH*OW]: row (c, kh, kw), column (oh, ow) holds input[n, c, oh*s-p+kh, ow*s-p+kw]
// (0 outside the image).
template <typename T>
__global__ void im2col_kernel(const T* input, T* cols, ConvShape g, std::int64_t total) {
  const std::int64_t pixels = g.out_h * g.out_w, patch = g.channels * g.kernel_h * g.kernel_w;
  for (std::int64_t e = first_thread(); e < total; e += thread_step()) {
    const std::int64_t pixel = e % pixels, row = e / pixels % patch, n = e / (pixels * patch);
    const std::int64_t c = row / (g.kernel_h * g.kernel_w), kh = row / g.kernel_w % g.kernel_h,
                       kw = row % g.kernel_w;
    const std::int64_t h = pixel / g.out_w * g.stride - g.padding + kh,
                       w = pixel % g.out_w * g.stride - g.padding + kw;
    const bool inside = h >= 0 && h < g.height && w >= 0 && w < g.width;
    cols[e] = inside ? input[((n * g.channels + c) * g.height + h) * g.width + w] : narrow<T>(0.0f);
  }
}

// grad_in[n, c, h, w] = the sum over taps (kh, kw), in order, of the column entries that read it.
template <typename T>
__global__ void col2im_kernel(const T* cols, T* grad_in, ConvShape g, std::int64_t total) {
  using C = compute_t<T>;
  const std::int64_t pixels = g.out_h * g.out_w, patch = g.channels * g.kernel_h * g.kernel_w;
  for (std::int64_t e = first_thread(); e < total; e += thread_step()) {
    const std::int64_t w = e % g.width, h = e / g.width % g.height, c = e / (g.width * g.height) % g.channels;
    const std::int64_t n = e / (g.width * g.height * g.channels);
    C sum = C(0);
    for (std::int64_t kh = 0; kh < g.kernel_h; ++kh) {
      const std::int64_t top = h + g.padding - kh;  // = oh * stride
      if (top < 0 || top % g.stride != 0 || top / g.stride >= g.out_h) continue;
      for (std::int64_t kw = 0; kw < g.kernel_w; ++kw) {
        const std::int64_t left = w + g.padding - kw;
        if (left < 0 || left % g.stride != 0 || left / g.stride >= g.out_w) continue;
        const std::int64_t row = (c * g.kernel_h + kh) * g.kernel_w + kw;
        sum += widen(cols[(n * patch + row) * pixels + top / g.stride * g.out_w + left / g.stride]);
      }
    }
    grad_in[e] = narrow<T>(sum);
  }
}

template <typename T>
__global__ void add_bias_kernel(T* out, const T* bias, std::int64_t channels, std::int64_t pixels,
                                std::int64_t total) {
  for (std::int64_t e = first_thread(); e < total; e += thread_step()) {
    out[e] = narrow<T>(widen(out[e]) + widen(bias[e / pixels % channels]));
  }
}

// Floating dtypes (false for others). cols is [batch, channels*kernel_h*kernel_w, out_h*out_w].
bool launch_im2col(DType dtype, const void* input, void* cols, const ConvShape& g, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w;
  return floating(dtype, [&]<typename T>() {
    if (total == 0) return;
    im2col_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(static_cast<const T*>(input),
                                                                  static_cast<T*>(cols), g, total);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// grad_in (overwritten) = the adjoint of im2col applied to cols.
bool launch_col2im(DType dtype, const void* cols, void* grad_in, const ConvShape& g, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.channels * g.height * g.width;
  return floating(dtype, [&]<typename T>() {
    if (total == 0) return;
    col2im_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(static_cast<const T*>(cols),
                                                                  static_cast<T*>(grad_in), g, total);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// out [batch, channels, pixels] += bias [channels].
bool launch_add_bias(DType dtype, void* out, const void* bias, std::int64_t batch, std::int64_t channels,
                     std::int64_t pixels, cudaStream_t stream) {
  const std::int64_t total = batch * channels * pixels;
  return floating(dtype, [&]<typename T>() {
    if (total == 0) return;
    add_bias_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(bias), channels, pixels, total);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// --- entries --------------------------------------------------------------------------------------

// Builds that found cuDNN convolve through it (core/cuda/cudnn_conv.h); the others, and the cases cuDNN
// declines, take im2col + cuBLAS.
#ifdef SHARDLAB_CUDNN
constexpr bool kCudnn = true;
#else
constexpr bool kCudnn = false;
#endif

ConvShape conv_shape(const Shape& input, const Shape& weight, const Shape& output, Conv2dParams p) {
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

std::int64_t patch_of(const ConvShape& g) { return g.channels * g.kernel_h * g.kernel_w; }
std::int64_t pixels_of(const ConvShape& g) { return g.out_h * g.out_w; }

Tensor im2col(const char* op, const Tensor& input, const ConvShape& g, cudaStream_t stream) {
  Tensor cols = empty({g.batch, patch_of(g), pixels_of(g)}, TensorOptions{input.dtype(), input.device()});
  SHARDLAB_CHECK(launch_im2col(input.dtype(), input.raw_data(), cols.raw_data(), g, stream),
                 "{}: no CUDA kernel for {}", op, dtype_name(input.dtype()));
  return cols;
}

// Per image: out[n] [O, pixels] = W [O, patch] cols[n] [patch, pixels], the column-major
// out^T = cols^T W^T; then the bias.
void cuda_conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p,
                 const Tensor& out) {
  const LaunchContext context(out);
  const ConvShape g = conv_shape(input.shape(), weight.shape(), out.shape(), p);
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
    SHARDLAB_CHECK(launch_add_bias(out.dtype(), out.raw_data(), bias.raw_data(), g.batch, outs, pixels,
                                   context.stream()),
                   "conv2d: no CUDA kernel for {}", dtype_name(out.dtype()));
  }
}

// Per image: cols[n] [patch, pixels] = W^T grad_out[n], then col2im sums the taps of each pixel.
void cuda_conv2d_backward_input(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                                const Tensor& grad_in) {
  const LaunchContext context(grad_in);
  const ConvShape g = conv_shape(grad_in.shape(), weight.shape(), grad_out.shape(), p);
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
  SHARDLAB_CHECK(launch_col2im(grad_in.dtype(), cols.raw_data(), grad_in.raw_data(), g, context.stream()),
                 "conv2d_backward_input: no CUDA kernel for {}", dtype_name(grad_in.dtype()));
}

// Per image: products[n] [O, patch] = grad_out[n] cols[n]^T; then the sum over images, in a fixed
// order (the reduction kernel), written into grad_weight, which the op layer hands over zeroed.
void cuda_conv2d_backward_weight(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                                 const Tensor& grad_weight) {
  const LaunchContext context(grad_weight);
  const ConvShape g = conv_shape(input.shape(), grad_weight.shape(), grad_out.shape(), p);
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
  reduction_kernels().reduce(ReduceOp::sum, per_weight, Dims{1}, grad_weight);
}

}  // namespace

ConvKernels conv_kernels() {
  return {.conv2d = cuda_conv2d,
          .conv2d_backward_input = cuda_conv2d_backward_input,
          .conv2d_backward_weight = cuda_conv2d_backward_weight};
}

}  // namespace shardlab::cuda
