// core/cuda/pool.cpp: max pooling's entries.
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

void cuda_max_pool2d(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices) {
  const LaunchContext context(out);
  const cuda::PoolGeometry geometry{.height = input.size(2),
                                    .width = input.size(3),
                                    .out_h = out.size(2),
                                    .out_w = out.size(3),
                                    .kernel = p.kernel_size,
                                    .stride = p.stride,
                                    .padding = p.padding};
  cuda::launch_max_pool2d(input.dtype(), input.raw_data(), out.raw_data(), indices.data<std::int64_t>(),
                          input.size(0) * input.size(1), geometry, context.stream());
}

void cuda_max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in) {
  accumulate_in_f32(grad_in, grad_out, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    cuda::launch_max_pool2d_backward(sums.dtype(), terms.raw_data(), indices.data<std::int64_t>(),
                                     sums.raw_data(), sums.size(0) * sums.size(1),
                                     sums.size(2) * sums.size(3), terms.size(2) * terms.size(3),
                                     context.stream());
  });
}

}  // namespace

PoolKernels pool_kernels() {
  return {.max_pool2d = cuda_max_pool2d, .max_pool2d_backward = cuda_max_pool2d_backward};
}

}  // namespace shardlab::cuda
