// core/cuda/conv.cu: the data-movement kernels of conv2d as im2col + GEMM (the GEMMs are
// cuBLAS, core/cuda/gemm.cpp): im2col, its adjoint col2im written as a gather (each input
// pixel sums its taps in a fixed order: deterministic, no atomics), and the bias add.
#include <cstdint>

#include "core/cuda/check.h"
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

}  // namespace

bool launch_im2col(DType dtype, const void* input, void* cols, const ConvShape& g, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.channels * g.kernel_h * g.kernel_w * g.out_h * g.out_w;
  return floating(dtype, [&]<typename T>() {
    if (total == 0) return;
    im2col_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(static_cast<const T*>(input),
                                                                  static_cast<T*>(cols), g, total);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

bool launch_col2im(DType dtype, const void* cols, void* grad_in, const ConvShape& g, cudaStream_t stream) {
  const std::int64_t total = g.batch * g.channels * g.height * g.width;
  return floating(dtype, [&]<typename T>() {
    if (total == 0) return;
    col2im_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(static_cast<const T*>(cols),
                                                                  static_cast<T*>(grad_in), g, total);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

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

}  // namespace shardlab::cuda
