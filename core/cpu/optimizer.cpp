// core/cpu/optimizer.cpp: fused optimizer updates: every element's whole update in one pass,
// computed in the parameter's compute type with the same operation order as the op-by-op
// formula, so results round the same way; a multi-segment call is that pass over each segment.
#include <cmath>
#include <type_traits>

#include "core/adam_math.h"
#include "core/cpu/isa.h"
#include "core/cpu/kernels.h"
#include "core/cpu/loops.h"

namespace shardlab::cpu {
namespace {

void adadelta_segment(const AdadeltaSegment& segment) {
  // References, not a structured binding: clang before 16 cannot capture one (the fuzz build uses 14).
  const Tensor &param = segment.param, &grad = segment.grad;
  const Tensor &square_avg = segment.square_avg, &acc_delta = segment.acc_delta;
  const AdadeltaHyper& h = segment.hyper;
  visit_dtype(param.dtype(), [&]<typename T>() {
    using C = compute_t<T>;
    if constexpr (std::is_floating_point_v<C>) {
      const C lr = static_cast<C>(h.lr), rho = static_cast<C>(h.rho), eps = static_cast<C>(h.eps);
      const C keep = static_cast<C>(1.0 - h.rho), decay = static_cast<C>(h.weight_decay);
      for_each_row<4>(param.shape(), {&param, &grad, &square_avg, &acc_delta},
                      [&](Pointers<4> p, ByteStrides<4> s, std::int64_t n) {
                        for (std::int64_t i = 0; i < n; ++i) {
                          T& w = at<T>(p[0], s[0], i);
                          T& sa = at<T>(p[2], s[2], i);
                          T& ad = at<T>(p[3], s[3], i);
                          C g = widen(at<T>(p[1], s[1], i));
                          if (h.weight_decay != 0) g = g + widen(w) * decay;
                          const C square = widen(sa) * rho + g * g * keep;
                          sa = narrow<T>(square);
                          const C delta = std::sqrt(widen(ad) + eps) / std::sqrt(widen(sa) + eps) * g;
                          ad = narrow<T>(widen(ad) * rho + delta * delta * keep);
                          w = narrow<T>(widen(w) - delta * lr);
                        }
                      });
    } else {
      fail("adadelta_step: no CPU kernel for {}", dtype_name(param.dtype()));
    }
  });
}

// The contiguous f32 rows training runs, as a plain loop the compiler vectorises, built for
// AVX-512, AVX2 and the baseline (core/cpu/isa.h). Vector lanes do the scalar
// loop's operations in its order (no FMA contraction: -ffp-contract=off; sqrt and division are
// exact), so every build rounds alike. The coefficients are read from a local copy, which the
// arrays cannot alias: read through the reference, its update-rule flags were not loop-invariant
// and the compiler left the loop scalar.
SHARDLAB_CPU_CLONES(void, adam_rows_f32,
                    (const AdamCoefficients<float>& k, float* w, const float* g, float* m, float* v,
                     std::int64_t n),
                    (k, w, g, m, v, n)) {
  const AdamCoefficients<float> c = k;
  for (std::int64_t i = 0; i < n; ++i) adam_element(c, w[i], g[i], m[i], v[i]);
}

void adam_segment(const AdamSegment& segment) {
  // References, not a structured binding: clang before 16 cannot capture one (the fuzz build uses 14).
  const Tensor &param = segment.param, &grad = segment.grad;
  const Tensor &exp_avg = segment.exp_avg, &exp_avg_sq = segment.exp_avg_sq;
  const AdamHyper& h = segment.hyper;
  const Tensor& copy_out = segment.copy_out;
  // copy_out's dtype is the outer switch; without it the parameter is copied onto itself.
  const Tensor& copy = copy_out.defined() ? copy_out : param;
  visit_dtype(param.dtype(), [&]<typename T>() {
    visit_dtype(copy.dtype(), [&]<typename Out>() {
      using C = compute_t<T>;
      if constexpr (!std::is_floating_point_v<C> || !std::is_floating_point_v<compute_t<Out>>) {
        fail("adam_step: no CPU kernel for {} to {}", dtype_name(param.dtype()), dtype_name(copy.dtype()));
      } else {
        const AdamCoefficients<C> k = adam_coefficients<C>(adam_scalars(h));
        for_each_row<5>(param.shape(), {&param, &grad, &exp_avg, &exp_avg_sq, &copy},
                        [&](Pointers<5> p, ByteStrides<5> s, std::int64_t n) {
                          if constexpr (std::is_same_v<T, float>) {
                            const bool contiguous = s[0] == 4 && s[1] == 4 && s[2] == 4 && s[3] == 4;
                            if (contiguous && p[4] == p[0]) {  // no copy out: the parameter is its own copy
                              adam_rows_f32(
                                  k, reinterpret_cast<float*>(p[0]), reinterpret_cast<const float*>(p[1]),
                                  reinterpret_cast<float*>(p[2]), reinterpret_cast<float*>(p[3]), n);
                              return;
                            }
                          }
                          for (std::int64_t i = 0; i < n; ++i) {
                            T& w = at<T>(p[0], s[0], i);
                            T& m = at<T>(p[2], s[2], i);
                            T& v = at<T>(p[3], s[3], i);
                            adam_element(k, w, widen(at<T>(p[1], s[1], i)), m, v);
                            at<Out>(p[4], s[4], i) = narrow<Out>(widen(w));
                          }
                        });
      }
    });
  });
}

// The gate is in host memory here: reading it costs nothing.
bool gate_open(const Tensor& apply) { return !apply.defined() || apply.data<bool>()[0]; }

void adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply) {
  if (!gate_open(apply)) return;
  for (const AdadeltaSegment& segment : segments) adadelta_segment(segment);
}

void adam_step(std::span<const AdamSegment> segments, const Tensor& apply) {
  if (!gate_open(apply)) return;
  for (const AdamSegment& segment : segments) adam_segment(segment);
}

}  // namespace

OptimizerKernels optimizer_kernels() { return {.adadelta_step = adadelta_step, .adam_step = adam_step}; }

}  // namespace shardlab::cpu
