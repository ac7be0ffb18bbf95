// core/cpu/pool.cpp: max_pool2d with argmax indices, and its backward (scatter by index).
#include <cmath>
#include <type_traits>

#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {

void max_pool2d(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices) {
  const std::int64_t planes = input.size(0) * input.size(1);
  const std::int64_t height = input.size(2), width = input.size(3);
  const std::int64_t out_h = out.size(2), out_w = out.size(3);
  visit_dtype(input.dtype(), [&]<typename T>() {
    using C = compute_t<T>;
    const T* in = static_cast<const T*>(input.raw_data());
    T* values = static_cast<T*>(out.raw_data());
    std::int64_t* where = static_cast<std::int64_t*>(indices.raw_data());
    parallel_for(0, planes, 1, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t plane = first; plane < last; ++plane) {
        const T* src = in + plane * height * width;
        for (std::int64_t oh = 0; oh < out_h; ++oh) {
          for (std::int64_t ow = 0; ow < out_w; ++ow) {
            const std::int64_t h0 = oh * p.stride - p.padding, w0 = ow * p.stride - p.padding;
            std::int64_t best = -1;
            C best_value{};
            for (std::int64_t h = std::max<std::int64_t>(h0, 0); h < std::min(h0 + p.kernel_size, height);
                 ++h) {
              for (std::int64_t w = std::max<std::int64_t>(w0, 0); w < std::min(w0 + p.kernel_size, width);
                   ++w) {
                const C v = widen(src[h * width + w]);
                bool take = best < 0 || v > best_value;
                if constexpr (std::is_floating_point_v<C>)
                  take = take || (std::isnan(v) && !std::isnan(best_value));
                if (take) {
                  best = h * width + w;
                  best_value = v;
                }
              }
            }
            const std::int64_t o = plane * out_h * out_w + oh * out_w + ow;
            values[o] = narrow<T>(best_value);
            where[o] = best;
          }
        }
      }
    });
  });
}

void max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in) {
  const std::int64_t planes = grad_in.size(0) * grad_in.size(1);
  const std::int64_t plane_in = grad_in.size(2) * grad_in.size(3);
  const std::int64_t plane_out = grad_out.size(2) * grad_out.size(3);
  visit_dtype(grad_out.dtype(), [&]<typename T>() {
    const T* g = static_cast<const T*>(grad_out.raw_data());
    const std::int64_t* where = static_cast<const std::int64_t*>(indices.raw_data());
    T* dst = static_cast<T*>(grad_in.raw_data());
    parallel_for(0, planes, 1, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t plane = first; plane < last; ++plane) {
        for (std::int64_t j = 0; j < plane_out; ++j) {
          T& target = dst[plane * plane_in + where[plane * plane_out + j]];
          target = narrow<T>(widen(target) + widen(g[plane * plane_out + j]));
        }
      }
    });
  });
}

}  // namespace shardlab::cpu
