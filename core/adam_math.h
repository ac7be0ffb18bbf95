// core/adam_math.h: the per-element Adam / AdamW update shared by the CPU and CUDA kernels,
// in the op-by-op formula's operation order (optim's history), each step rounded to the
// compute type, so the fused kernels give the unfused ops' values.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace shardlab {

// AdamHyper (core/ops.h) in plain types, for device code.
struct AdamScalars {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled = false;
  std::int64_t step = 1;
};

// The step's constants, computed in double on the host and rounded once to the compute type,
// as the op-by-op formula's Scalar operands are.
template <typename C>
struct AdamCoefficients {
  C shrink, l2, beta1, keep1, beta2, keep2, sqrt_correction2, eps, step_size;
  bool decoupled, decay;
};

template <typename C>
AdamCoefficients<C> adam_coefficients(const AdamScalars& h) {
  const double correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  return {static_cast<C>(1.0 - h.lr * h.weight_decay),
          static_cast<C>(h.weight_decay),
          static_cast<C>(h.beta1),
          static_cast<C>(1.0 - h.beta1),
          static_cast<C>(h.beta2),
          static_cast<C>(1.0 - h.beta2),
          static_cast<C>(std::sqrt(correction2)),
          static_cast<C>(h.eps),
          static_cast<C>(h.lr / correction1),
          h.decoupled,
          h.weight_decay != 0.0};
}

// sqrt in the compute type itself (the float overload for f32), on host and device alike.
template <typename C>
SHARDLAB_HD inline C square_root(C x) {
#if defined(__CUDA_ARCH__)
  return sqrt(x);
#else
  return std::sqrt(x);
#endif
}

template <typename C, typename T>
SHARDLAB_HD inline void adam_element(const AdamCoefficients<C>& k, T& w, C g, T& m, T& v) {
  if (k.decoupled) {
    w = narrow<T>(widen(w) * k.shrink);  // AdamW: the parameter shrinks first, apart from the moments
  } else if (k.decay) {
    g = g + widen(w) * k.l2;  // Adam: L2 through the gradient
  }
  const C first = widen(m) * k.beta1;
  const C first_add = g * k.keep1;
  m = narrow<T>(first + first_add);
  const C square = g * g;
  const C second_add = square * k.keep2;
  const C second = widen(v) * k.beta2;
  v = narrow<T>(second + second_add);
  const C denom = square_root(widen(v)) / k.sqrt_correction2 + k.eps;
  const C ratio = widen(m) / denom;
  w = narrow<T>(widen(w) - ratio * k.step_size);
}

}  // namespace shardlab
