// core/cuda/optimizer.cu: fused optimizer updates, each element's whole update in one thread,
// computed in the parameter's compute type in the CPU kernel's operation order. nvcc may fuse a
// multiply and an add (the CPU build does not), so the last bit can differ from the CPU's.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/adam_math.h"
#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

template <typename T>
__global__ void adadelta_kernel(T* param, const T* grad, T* square_avg, T* acc_delta, Layout<4> layout,
                                AdadeltaScalars h) {
  using C = compute_t<T>;
  const C lr = static_cast<C>(h.lr), rho = static_cast<C>(h.rho), eps = static_cast<C>(h.eps);
  const C keep = static_cast<C>(1.0 - h.rho), decay = static_cast<C>(h.weight_decay);
  for_each_element(layout, [&](const Offsets<4>& at) {
    T& w = param[at.of[0]];
    T& sa = square_avg[at.of[2]];
    T& ad = acc_delta[at.of[3]];
    C g = widen(grad[at.of[1]]);
    if (h.weight_decay != 0) g = g + widen(w) * decay;
    const C square = widen(sa) * rho + g * g * keep;
    sa = narrow<T>(square);
    const C delta = sqrt(widen(ad) + eps) / sqrt(widen(sa) + eps) * g;
    ad = narrow<T>(widen(ad) * rho + delta * delta * keep);
    w = narrow<T>(widen(w) - delta * lr);
  });
}

template <typename T, typename Out>
__global__ void adam_kernel(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, Out* copy, Layout<5> layout,
                            AdamCoefficients<compute_t<T>> k) {
  for_each_element(layout, [&](const Offsets<5>& at) {
    T& w = param[at.of[0]];
    adam_element(k, w, widen(grad[at.of[1]]), exp_avg[at.of[2]], exp_avg_sq[at.of[3]]);
    copy[at.of[4]] = narrow<Out>(widen(w));
  });
}

}  // namespace

bool launch_adam_step(DType dtype, DType copy_dtype, void* param, const void* grad, void* exp_avg,
                      void* exp_avg_sq, void* copy, const Layout<5>& layout, const AdamScalars& hyper,
                      cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    return visit_dtype(copy_dtype, [&]<typename Out>() {
      if constexpr (std::is_floating_point_v<compute_t<T>> && std::is_floating_point_v<compute_t<Out>>) {
        if (layout.numel == 0) return true;
        adam_kernel<T, Out><<<grid_size(layout.numel), kBlockSize, 0, stream>>>(
            static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(exp_avg),
            static_cast<T*>(exp_avg_sq), static_cast<Out*>(copy), layout,
            adam_coefficients<compute_t<T>>(hyper));
        SHARDLAB_CUDA_CHECK_LAUNCH();
        return true;
      } else {
        return false;
      }
    });
  });
}

bool launch_adadelta_step(DType dtype, void* param, const void* grad, void* square_avg, void* acc_delta,
                          const Layout<4>& layout, const AdadeltaScalars& hyper, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      if (layout.numel == 0) return true;
      adadelta_kernel<T><<<grid_size(layout.numel), kBlockSize, 0, stream>>>(
          static_cast<T*>(param), static_cast<const T*>(grad), static_cast<T*>(square_avg),
          static_cast<T*>(acc_delta), layout, hyper);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

}  // namespace shardlab::cuda
