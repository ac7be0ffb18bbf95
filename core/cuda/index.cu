// core/cuda/index.cu: index_select, gather, scatter_add and index_add on contiguous operands with
// in-range i64 indices, and max_pool2d with its backward. Additions never race: each thread owns
// the output elements it adds into and adds in the CPU kernels' order, so results are
// deterministic and equal to the CPU's bit for bit.
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

template <typename T>
__device__ void accumulate(T& target, T value) {
  target = narrow<T>(widen(target) + widen(value));
}

// Offset, with `strides`, of the element at `position` of a contiguous tensor of geometry.shape,
// its coordinate along `dim` replaced by `along`.
__device__ std::int64_t remapped(const IndexGeometry& g, const std::int64_t* strides, std::int64_t position,
                                 std::int64_t along) {
  std::int64_t offset = 0;
  for (int d = g.rank - 1; d >= 0; --d) {
    const std::int64_t coordinate = position % g.shape[d];
    position /= g.shape[d];
    offset += (d == g.dim ? along : coordinate) * strides[d];
  }
  return offset;
}

template <typename T>
__global__ void index_select_kernel(const T* in, const std::int64_t* index, T* out, std::int64_t total,
                                    std::int64_t picks, std::int64_t size, std::int64_t inner) {
  for (std::int64_t e = first_thread(); e < total; e += thread_step()) {
    const std::int64_t o = e / (picks * inner), j = e / inner % picks, i = e % inner;
    out[e] = in[(o * size + index[j]) * inner + i];
  }
}

template <typename T>
__global__ void gather_kernel(const T* in, const std::int64_t* index, T* out, std::int64_t total,
                              IndexGeometry g) {
  for (std::int64_t p = first_thread(); p < total; p += thread_step())
    out[p] = in[remapped(g, g.in_strides, p, index[p])];
}

// One thread per line along `dim` of the index, walked in order.
template <typename T>
__global__ void scatter_add_kernel(T* out, const std::int64_t* index, const T* src, std::int64_t lines,
                                   std::int64_t length, std::int64_t inner, IndexGeometry g) {
  for (std::int64_t line = first_thread(); line < lines; line += thread_step()) {
    const std::int64_t o = line / inner, i = line % inner;
    for (std::int64_t j = 0; j < length; ++j) {
      const std::int64_t p = (o * length + j) * inner + i;
      accumulate(out[remapped(g, g.out_strides, p, index[p])], src[remapped(g, g.in_strides, p, j)]);
    }
  }
}

// One thread per (outer, inner) column, walking the picks in order.
template <typename T>
__global__ void index_add_kernel(T* out, const std::int64_t* index, const T* src, std::int64_t columns,
                                 std::int64_t picks, std::int64_t size, std::int64_t inner) {
  for (std::int64_t c = first_thread(); c < columns; c += thread_step()) {
    const std::int64_t o = c / inner, i = c % inner;
    for (std::int64_t j = 0; j < picks; ++j)
      accumulate(out[(o * size + index[j]) * inner + i], src[(o * picks + j) * inner + i]);
  }
}

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
      accumulate(grad_in[plane * plane_in + where[plane * plane_out + j]], grad_out[plane * plane_out + j]);
    }
  }
}

}  // namespace

void launch_index_select(DType dtype, const void* in, const std::int64_t* index, void* out,
                         std::int64_t outer, std::int64_t picks, std::int64_t size, std::int64_t inner,
                         cudaStream_t stream) {
  const std::int64_t total = outer * picks * inner;
  if (total == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    index_select_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(
        static_cast<const T*>(in), index, static_cast<T*>(out), total, picks, size, inner);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

void launch_gather(DType dtype, const void* in, const std::int64_t* index, void* out, std::int64_t total,
                   const IndexGeometry& geometry, cudaStream_t stream) {
  if (total == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    gather_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(static_cast<const T*>(in), index,
                                                                  static_cast<T*>(out), total, geometry);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

void launch_scatter_add(DType dtype, void* out, const std::int64_t* index, const void* src,
                        std::int64_t outer, std::int64_t length, std::int64_t inner,
                        const IndexGeometry& geometry, cudaStream_t stream) {
  const std::int64_t lines = outer * inner;
  if (lines == 0 || length == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    scatter_add_kernel<T><<<grid_size(lines), kBlockSize, 0, stream>>>(
        static_cast<T*>(out), index, static_cast<const T*>(src), lines, length, inner, geometry);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

void launch_index_add(DType dtype, void* out, const std::int64_t* index, const void* src, std::int64_t outer,
                      std::int64_t picks, std::int64_t size, std::int64_t inner, cudaStream_t stream) {
  const std::int64_t columns = outer * inner;
  if (columns == 0 || picks == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    index_add_kernel<T><<<grid_size(columns), kBlockSize, 0, stream>>>(
        static_cast<T*>(out), index, static_cast<const T*>(src), columns, picks, size, inner);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

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

}  // namespace shardlab::cuda
