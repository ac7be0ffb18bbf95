// core/cuda/pool.cu: max_pool2d and its backward (core/cpu/pool.cpp's CUDA side). The backward
// never races: one thread owns a plane and adds in the CPU kernel's order, so its results equal the
// CPU's bit for bit. Then the entries (core/conv.h's PoolKernels).
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

struct PoolGeometry {
  std::int64_t height = 0, width = 0, out_h = 0, out_w = 0;
  std::int64_t kernel = 2, stride = 2, padding = 0;
};

// One thread per output: the first maximum of the window clipped to the input; a NaN wins and stays.
template <typename T>
__global__ void max_pool2d_kernel(const T* in, T* out, std::int64_t* where, std::int64_t total,
                                  PoolGeometry g) {
  using C = compute_t<T>;
  for (std::int64_t e = first_thread(); e < total; e += thread_step()) {
    const std::int64_t plane = e / (g.out_h * g.out_w), oh = e / g.out_w % g.out_h, ow = e % g.out_w;
    const T* src = in + plane * g.height * g.width;
    const std::int64_t h0 = oh * g.stride - g.padding, w0 = ow * g.stride - g.padding;
    const std::int64_t h_lo = h0 > 0 ? h0 : 0, w_lo = w0 > 0 ? w0 : 0;
    const std::int64_t h_hi = h0 + g.kernel < g.height ? h0 + g.kernel : g.height;
    const std::int64_t w_hi = w0 + g.kernel < g.width ? w0 + g.kernel : g.width;
    std::int64_t best = h_lo * g.width + w_lo;
    C best_value = widen(src[best]);
    for (std::int64_t h = h_lo; h < h_hi; ++h) {
      for (std::int64_t w = w_lo; w < w_hi; ++w) {
        const C v = widen(src[h * g.width + w]);
        bool take = v > best_value;
        if constexpr (std::is_floating_point_v<C>) take = take || (v != v && best_value == best_value);
        if (take) {
          best = h * g.width + w;
          best_value = v;
        }
      }
    }
    out[e] = narrow<T>(best_value);
    where[e] = best;
  }
}

// One thread per plane, adding in output order (overlapping windows may pick one input twice).
template <typename T>
__global__ void max_pool2d_backward_kernel(const T* grad_out, const std::int64_t* where, T* grad_in,
                                           std::int64_t planes, std::int64_t plane_in,
                                           std::int64_t plane_out) {
  for (std::int64_t plane = first_thread(); plane < planes; plane += thread_step()) {
    for (std::int64_t j = 0; j < plane_out; ++j) {
      const std::int64_t at = where[plane * plane_out + j];
      if (at >= 0 && at < plane_in)
        accumulate(grad_in[plane * plane_in + at], grad_out[plane * plane_out + j]);
    }
  }
}

// in [planes, height, width] -> out, indices [planes, out_h, out_w] (flat h * width + w).
void launch_max_pool2d(DType dtype, const void* in, void* out, std::int64_t* indices, std::int64_t planes,
                       const PoolGeometry& geometry, cudaStream_t stream) {
  const std::int64_t total = planes * geometry.out_h * geometry.out_w;
  if (total == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    max_pool2d_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(
        static_cast<const T*>(in), static_cast<T*>(out), indices, total, geometry);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// grad_in (zeroed by the caller) += grad_out at indices, per plane.
void launch_max_pool2d_backward(DType dtype, const void* grad_out, const std::int64_t* indices, void* grad_in,
                                std::int64_t planes, std::int64_t plane_in, std::int64_t plane_out,
                                cudaStream_t stream) {
  if (planes == 0) return;
  SHARDLAB_CUDA_CHECK(cudaMemsetAsync(grad_in, 0, planes * plane_in * dtype_size(dtype), stream));
  if (plane_out == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    max_pool2d_backward_kernel<T><<<grid_size(planes), kBlockSize, 0, stream>>>(
        static_cast<const T*>(grad_out), indices, static_cast<T*>(grad_in), planes, plane_in, plane_out);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// --- entries --------------------------------------------------------------------------------------

void cuda_max_pool2d(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices) {
  const LaunchContext context(out);
  const PoolGeometry geometry{.height = input.size(2),
                              .width = input.size(3),
                              .out_h = out.size(2),
                              .out_w = out.size(3),
                              .kernel = p.kernel_size,
                              .stride = p.stride,
                              .padding = p.padding};
  launch_max_pool2d(input.dtype(), input.raw_data(), out.raw_data(), indices.data<std::int64_t>(),
                    input.size(0) * input.size(1), geometry, context.stream());
}

void cuda_max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in) {
  accumulate_in_f32(grad_in, grad_out, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    launch_max_pool2d_backward(sums.dtype(), terms.raw_data(), indices.data<std::int64_t>(), sums.raw_data(),
                               sums.size(0) * sums.size(1), sums.size(2) * sums.size(3),
                               terms.size(2) * terms.size(3), context.stream());
  });
}

}  // namespace

PoolKernels pool_kernels() {
  return {.max_pool2d = cuda_max_pool2d, .max_pool2d_backward = cuda_max_pool2d_backward};
}

}  // namespace shardlab::cuda
