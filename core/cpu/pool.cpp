// core/cpu/pool.cpp: max_pool2d with argmax indices, and its backward (zeros, then scatter by index).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/cpu/isa.h"
#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

// The common 2x2, stride 2 window (the tutorial CNN's) without clipping or loops: the first
// maximum of four, NaN winning like the general path. Selects, not branches (a window's maximum
// is data-dependent: branches mispredict about half the time), so f32 vectorises.
template <typename T>
[[gnu::always_inline]] inline void pool_2x2(const T* src, std::int64_t width, std::int64_t out_h,
                                            std::int64_t out_w, T* values, std::int64_t* where) {
  using C = compute_t<T>;
  const auto pick = [](C candidate, C& best) {
    bool take = candidate > best;
    if constexpr (std::is_floating_point_v<C>) take = take || (candidate != candidate && best == best);
    best = take ? candidate : best;
    return take;
  };
  for (std::int64_t oh = 0; oh < out_h; ++oh) {
    const T* top = src + 2 * oh * width;
    const T* bottom = top + width;
    for (std::int64_t ow = 0; ow < out_w; ++ow) {
      C best = widen(top[2 * ow]);
      std::int64_t at = 0;
      at = pick(widen(top[2 * ow + 1]), best) ? 1 : at;
      at = pick(widen(bottom[2 * ow]), best) ? width : at;
      at = pick(widen(bottom[2 * ow + 1]), best) ? width + 1 : at;
      values[oh * out_w + ow] = narrow<T>(best);
      where[oh * out_w + ow] = 2 * oh * width + 2 * ow + at;
    }
  }
}

// The f32 instance compiled for AVX-512, AVX2 and the baseline (core/cpu/isa.h).
SHARDLAB_CPU_CLONES(void, pool_2x2_f32,
                    (const float* src, std::int64_t width, std::int64_t out_h, std::int64_t out_w,
                     float* values, std::int64_t* where),
                    (src, width, out_h, out_w, values, where)) {
  pool_2x2(src, width, out_h, out_w, values, where);
}

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
        if (p.kernel_size == 2 && p.stride == 2 && p.padding == 0) {
          T* plane_values = values + plane * out_h * out_w;
          std::int64_t* plane_where = where + plane * out_h * out_w;
          if constexpr (std::is_same_v<T, float>) {
            pool_2x2_f32(src, width, out_h, out_w, plane_values, plane_where);
          } else {
            pool_2x2(src, width, out_h, out_w, plane_values, plane_where);
          }
          continue;
        }
        for (std::int64_t oh = 0; oh < out_h; ++oh) {
          // The window's rows and columns clipped to the input once per output row.
          const std::int64_t h0 = oh * p.stride - p.padding;
          const std::int64_t h_lo = std::max<std::int64_t>(h0, 0),
                             h_hi = std::min(h0 + p.kernel_size, height);
          for (std::int64_t ow = 0; ow < out_w; ++ow) {
            const std::int64_t w0 = ow * p.stride - p.padding;
            const std::int64_t w_lo = std::max<std::int64_t>(w0, 0),
                               w_hi = std::min(w0 + p.kernel_size, width);
            std::int64_t best = h_lo * width + w_lo;
            C best_value = widen(src[best]);
            for (std::int64_t h = h_lo; h < h_hi; ++h) {
              for (std::int64_t w = w_lo; w < w_hi; ++w) {
                const C v = widen(src[h * width + w]);
                // Strictly greater keeps the first maximum; a NaN wins and stays.
                bool take = v > best_value;
                if constexpr (std::is_floating_point_v<C>)
                  take = take || (v != v && best_value == best_value);
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
        // Zeroed plane by plane while it sits in L1, not as a separate pass over the whole tensor.
        std::fill_n(dst + plane * plane_in, plane_in, T{});  // zero, for bf16/f16 too
        for (std::int64_t j = 0; j < plane_out; ++j) {
          T& target = dst[plane * plane_in + where[plane * plane_out + j]];
          target = narrow<T>(widen(target) + widen(g[plane * plane_out + j]));
        }
      }
    });
  });
}

// Accumulates in f32 for 16-bit floats, rounding once at the end.
void max_pool2d_backward_f32(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in) {
  in_f32_precision(
      grad_in, [&](const Tensor& gi, const Tensor& go) { cpu::max_pool2d_backward(go, indices, gi); },
      grad_out);
}

}  // namespace

PoolKernels pool_kernels() {
  return {.max_pool2d = max_pool2d, .max_pool2d_backward = max_pool2d_backward_f32};
}

}  // namespace shardlab::cpu
