// core/cpu/transformer.cpp: the Llama block's fused row and elementwise kernels: RMS normalisation
// (row sums in double, as reductions are), SwiGLU (silu(gate) * up) and the rotary embedding in the
// rotate-half convention, each with its backward, computed in the compute type and rounded once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/column_sums.h"
#include "core/cpu/fast_exp.h"
#include "core/cpu/isa.h"
#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

// The sigmoids of `count` values in the compute type: f32 (f32, bf16 and f16 tensors) through
// core/cpu/fast_exp.h in three passes (the clamp, exp and the sigmoid: GCC vectorises none of them
// fused), f64 through std::exp.
template <typename C>
[[gnu::always_inline]] inline void sigmoids(const C* x, std::int64_t count, C* out) {
  if constexpr (std::is_same_v<C, float>) {
    for (std::int64_t i = 0; i < count; ++i) out[i] = negative_magnitude(x[i]);
    for (std::int64_t i = 0; i < count; ++i) out[i] = exp_from_floor(out[i]);
    for (std::int64_t i = 0; i < count; ++i) out[i] = sigmoid_from(x[i], out[i]);
  } else {
    for (std::int64_t i = 0; i < count; ++i) out[i] = C(1) / (C(1) + std::exp(-x[i]));
  }
}

// SwiGLU over n elements in blocks: a block's gates in the compute type, their sigmoids, then the
// products (forward) or the gradients (backward). The f32 spans run under the widest instruction set.
constexpr std::int64_t kSigmoidBlock = 256;

// fn(first, count, x, s) for each block of at most kSigmoidBlock gates: x the block's gates in the
// compute type, s their sigmoids.
template <typename T, typename Fn>
[[gnu::always_inline]] inline void over_sigmoid_blocks(const T* gate, std::int64_t n, Fn fn) {
  compute_t<T> x[kSigmoidBlock], s[kSigmoidBlock];
  for (std::int64_t first = 0; first < n; first += kSigmoidBlock) {
    const std::int64_t count = std::min(kSigmoidBlock, n - first);
    for (std::int64_t i = 0; i < count; ++i) x[i] = widen(gate[first + i]);
    sigmoids(x, count, s);
    fn(first, count, x, s);
  }
}

template <typename T>
[[gnu::always_inline]] inline void swiglu_span(const T* gate, const T* up, T* out, std::int64_t n) {
  using C = compute_t<T>;
  over_sigmoid_blocks(gate, n, [&](std::int64_t first, std::int64_t count, const C* x, const C* s) {
    for (std::int64_t i = 0; i < count; ++i) out[first + i] = narrow<T>(x[i] * s[i] * widen(up[first + i]));
  });
}

template <typename T>
[[gnu::always_inline]] inline void swiglu_backward_span(const T* grad_out, const T* gate, const T* up,
                                                        T* grad_gate, T* grad_up, std::int64_t n) {
  using C = compute_t<T>;
  over_sigmoid_blocks(gate, n, [&](std::int64_t first, std::int64_t count, const C* x, const C* s) {
    for (std::int64_t i = 0; i < count; ++i) {
      const C d = widen(grad_out[first + i]);
      // d/dx x s(x) = s(x) (1 + x (1 - s(x)))
      grad_gate[first + i] = narrow<T>(d * widen(up[first + i]) * (s[i] * (C(1) + x[i] * (C(1) - s[i]))));
      grad_up[first + i] = narrow<T>(d * (x[i] * s[i]));
    }
  });
}

SHARDLAB_CPU_CLONES(void, swiglu_f32, (const float* gate, const float* up, float* out, std::int64_t n),
                    (gate, up, out, n)) {
  swiglu_span(gate, up, out, n);
}

SHARDLAB_CPU_CLONES(void, swiglu_backward_f32,
                    (const float* grad_out, const float* gate, const float* up, float* grad_gate,
                     float* grad_up, std::int64_t n),
                    (grad_out, gate, up, grad_gate, grad_up, n)) {
  swiglu_backward_span(grad_out, gate, up, grad_gate, grad_up, n);
}

// Runs fn<T>() for the floating dtypes; the ops let no other reach a kernel.
template <typename Fn>
void floating(DType dtype, Fn&& fn) {
  visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) fn.template operator()<T>();
  });
}

// RMSNorm's rows: each row's sum (of x^2, or of g w x) in double over 8 interleaved lanes added in a
// fixed order, as the reductions' rows (core/cpu/reduce.cpp), where one chain of double adds per row
// took most of the time; then the row's elementwise pass in the compute type. The f32 rows run under
// the widest instruction set.
constexpr std::int64_t kNormLanes = 8;

template <typename Term>
[[gnu::always_inline]] inline double row_total(std::int64_t width, Term term) {
  double partial[kNormLanes] = {};
  const std::int64_t whole = width / kNormLanes * kNormLanes;
  for (std::int64_t e = 0; e < whole; e += kNormLanes) {
    for (std::int64_t lane = 0; lane < kNormLanes; ++lane) partial[lane] += term(e + lane);
  }
  double total = 0;
  for (const double p : partial) total += p;
  for (std::int64_t e = whole; e < width; ++e) total += term(e);
  return total;
}

template <typename T>
[[gnu::always_inline]] inline void rms_norm_rows(const T* in, const T* w, std::int64_t width,
                                                 std::int64_t first, std::int64_t last, double eps, T* y,
                                                 compute_t<T>* rstd) {
  using C = compute_t<T>;
  for (std::int64_t row = first; row < last; ++row) {
    const T* x = in + row * width;
    const double squares = row_total(width, [&](std::int64_t e) {
      const double v = widen(x[e]);
      return v * v;
    });
    const auto r = static_cast<C>(1.0 / std::sqrt(squares / static_cast<double>(width) + eps));
    rstd[row] = r;
    for (std::int64_t e = 0; e < width; ++e) y[row * width + e] = narrow<T>(widen(x[e]) * r * widen(w[e]));
  }
}

// grad_x = rstd (g w) - x rstd^3 mean((g w) x), per row.
template <typename T>
[[gnu::always_inline]] inline void rms_norm_backward_rows(const T* grad, const T* in, const T* w,
                                                          const compute_t<T>* rstd, std::int64_t width,
                                                          std::int64_t first, std::int64_t last, T* grad_x) {
  using C = compute_t<T>;
  for (std::int64_t row = first; row < last; ++row) {
    const T *g = grad + row * width, *x = in + row * width;
    const double dot =
        row_total(width, [&](std::int64_t e) { return double(widen(g[e])) * widen(w[e]) * widen(x[e]); });
    const C r = rstd[row];
    const C correction = static_cast<C>(dot / static_cast<double>(width)) * r * r * r;
    for (std::int64_t e = 0; e < width; ++e)
      grad_x[row * width + e] = narrow<T>(r * (widen(g[e]) * widen(w[e])) - widen(x[e]) * correction);
  }
}

// One chunk's column partials of RMSNorm's weight gradient, sum over its rows of g x rstd.
template <typename T>
[[gnu::always_inline]] inline void rms_norm_weight_partials(const T* grad, const T* in,
                                                            const compute_t<T>* rstd, std::int64_t width,
                                                            RowRange range, double* partial) {
  for (std::int64_t row = range.begin; row < range.end; ++row) {
    for (std::int64_t e = 0; e < width; ++e)
      partial[e] += double(widen(grad[row * width + e])) * widen(in[row * width + e]) * rstd[row];
  }
}

SHARDLAB_CPU_CLONES(void, rms_norm_rows_f32,
                    (const float* in, const float* w, std::int64_t width, std::int64_t first,
                     std::int64_t last, double eps, float* y, float* rstd),
                    (in, w, width, first, last, eps, y, rstd)) {
  rms_norm_rows(in, w, width, first, last, eps, y, rstd);
}

SHARDLAB_CPU_CLONES(void, rms_norm_backward_rows_f32,
                    (const float* grad, const float* in, const float* w, const float* rstd,
                     std::int64_t width, std::int64_t first, std::int64_t last, float* grad_x),
                    (grad, in, w, rstd, width, first, last, grad_x)) {
  rms_norm_backward_rows(grad, in, w, rstd, width, first, last, grad_x);
}

SHARDLAB_CPU_CLONES(void, rms_norm_weight_partials_f32,
                    (const float* grad, const float* in, const float* rstd, std::int64_t width,
                     RowRange range, double* partial),
                    (grad, in, rstd, width, range, partial)) {
  rms_norm_weight_partials(grad, in, rstd, width, range, partial);
}

// `count` consecutive positions of the rotary embedding, rows `x_stride` and `y_stride` apart, each
// over its two halves in the compute type: forward y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; transpose
// (the backward) y1 = x1 c1 + x2 s2, y2 = x2 c2 - x1 s1. c and s are the tables' rows of the first.
template <typename T>
[[gnu::always_inline]] inline void rotate_rows(const T* __restrict x, std::int64_t x_stride,
                                               const T* __restrict c, const T* __restrict s, T* __restrict y,
                                               std::int64_t y_stride, std::int64_t count, std::int64_t width,
                                               bool transpose) {
  const std::int64_t half = width / 2;
  const auto w = [](T v) { return widen(v); };
  for (std::int64_t i = 0; i < count; ++i, x += x_stride, y += y_stride, c += width, s += width) {
    const T *x2 = x + half, *c2 = c + half, *s2 = s + half;
    T* y2 = y + half;
    if (transpose) {
      for (std::int64_t e = 0; e < half; ++e) y[e] = narrow<T>(w(x[e]) * w(c[e]) + w(x2[e]) * w(s2[e]));
      for (std::int64_t e = 0; e < half; ++e) y2[e] = narrow<T>(w(x2[e]) * w(c2[e]) - w(x[e]) * w(s[e]));
    } else {
      for (std::int64_t e = 0; e < half; ++e) y[e] = narrow<T>(w(x[e]) * w(c[e]) - w(x2[e]) * w(s[e]));
      for (std::int64_t e = 0; e < half; ++e) y2[e] = narrow<T>(w(x2[e]) * w(c2[e]) + w(x[e]) * w(s2[e]));
    }
  }
}

SHARDLAB_CPU_CLONES(void, rotate_rows_f32,
                    (const float* x, std::int64_t x_stride, const float* c, const float* s, float* y,
                     std::int64_t y_stride, std::int64_t count, std::int64_t width, bool transpose),
                    (x, x_stride, c, s, y, y_stride, count, width, transpose)) {
  rotate_rows(x, x_stride, c, s, y, y_stride, count, width, transpose);
}

// Element offset of matrix `index` of t [..., T, D]: its dims before the last two in row-major order.
std::int64_t matrix_offset(const Tensor& t, std::int64_t index) {
  std::int64_t offset = 0;
  for (std::int64_t d = t.dim() - 3; d >= 0; --d) {
    offset += index % t.size(d) * t.stride(d);
    index /= t.size(d);
  }
  return offset;
}

void rms_norm_forward(const Tensor& x, const Tensor& added, const Tensor& weight, double eps,
                      const Tensor& sum, const Tensor& out, const Tensor& rstd) {
  floating(x.dtype(), [&]<typename T>() {
    using C = compute_t<T>;
    const std::int64_t width = x.size(-1), rows = x.numel() / width;
    const T *in = added.defined() ? sum.data<T>() : x.data<T>(), *w = weight.data<T>();
    T* y = out.data<T>();
    C* r = rstd.data<C>();
    parallel_for(0, rows, 16, [&](std::int64_t first, std::int64_t last) {
      // The rows' sum as binary add computes it (in the compute type, rounded once), normalised
      // below while it is still in cache.
      if (added.defined()) {
        const T *a = x.data<T>(), *b = added.data<T>();
        T* s = sum.data<T>();
        for (std::int64_t i = first * width; i < last * width; ++i)
          s[i] = narrow<T>(widen(a[i]) + widen(b[i]));
      }
      if constexpr (std::is_same_v<T, float>) return rms_norm_rows_f32(in, w, width, first, last, eps, y, r);
      rms_norm_rows(in, w, width, first, last, eps, y, r);
    });
  });
}

void rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                       const Tensor& grad_x, const Tensor& grad_weight) {
  floating(x.dtype(), [&]<typename T>() {
    using C = compute_t<T>;
    const std::int64_t width = x.size(-1), rows = x.numel() / width;
    const T *g = grad_out.data<T>(), *in = x.data<T>(), *w = weight.data<T>();
    const C* r = rstd.data<C>();
    T *gx = grad_x.data<T>(), *gw = grad_weight.data<T>();
    parallel_for(0, rows, 16, [&](std::int64_t first, std::int64_t last) {
      if constexpr (std::is_same_v<T, float>)
        return rms_norm_backward_rows_f32(g, in, w, r, width, first, last, gx);
      rms_norm_backward_rows(g, in, w, r, width, first, last, gx);
    });
    // grad_weight = sum over rows of g x rstd per column, in core/column_sums.h's order (the GPU's).
    const std::int64_t chunks = column_chunks(rows);
    std::vector<double> partials(static_cast<std::size_t>(chunks * width), 0.0);
    parallel_for(0, chunks, 1, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t chunk = first; chunk < last; ++chunk) {
        const RowRange range = chunk_rows(chunk, rows);
        double* partial = partials.data() + chunk * width;
        if constexpr (std::is_same_v<T, float>) {
          rms_norm_weight_partials_f32(g, in, r, width, range, partial);
        } else {
          rms_norm_weight_partials(g, in, r, width, range, partial);
        }
      }
    });
    parallel_for(0, width, 256, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t e = first; e < last; ++e)
        gw[e] = narrow<T>(static_cast<C>(sum_of_partials(partials.data(), chunks, width, e)));
    });
  });
}

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  floating(gate.dtype(), [&]<typename T>() {
    const T *a = gate.data<T>(), *b = up.data<T>();
    T* y = out.data<T>();
    parallel_for(0, gate.numel(), 4096, [&](std::int64_t first, std::int64_t last) {
      if constexpr (std::is_same_v<T, float>)
        return swiglu_f32(a + first, b + first, y + first, last - first);
      swiglu_span(a + first, b + first, y + first, last - first);
    });
  });
}

void swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up, const Tensor& grad_gate,
                     const Tensor& grad_up) {
  floating(gate.dtype(), [&]<typename T>() {
    const T *g = grad_out.data<T>(), *a = gate.data<T>(), *b = up.data<T>();
    T *ga = grad_gate.data<T>(), *gb = grad_up.data<T>();
    parallel_for(0, gate.numel(), 4096, [&](std::int64_t first, std::int64_t last) {
      if constexpr (std::is_same_v<T, float>) {
        return swiglu_backward_f32(g + first, a + first, b + first, ga + first, gb + first, last - first);
      }
      swiglu_backward_span(g + first, a + first, b + first, ga + first, gb + first, last - first);
    });
  });
}

void rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const Tensor& out) {
  floating(x.dtype(), [&]<typename T>() {
    const std::int64_t width = x.size(-1), length = x.size(-2), rows = x.numel() / width;
    const std::int64_t x_stride = x.stride(-2), y_stride = out.stride(-2);
    const T *in = x.data<T>(), *c = cos.data<T>(), *s = sin.data<T>();
    T* y = out.data<T>();
    // Each piece of rows in runs of consecutive positions of one [T, D] matrix.
    parallel_for(0, rows, 64, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t row = first; row < last;) {
        const std::int64_t matrix = row / length, t = row % length, count = std::min(last - row, length - t);
        const T* from = in + matrix_offset(x, matrix) + t * x_stride;
        T* to = y + matrix_offset(out, matrix) + t * y_stride;
        if constexpr (std::is_same_v<T, float>) {
          rotate_rows_f32(from, x_stride, c + t * width, s + t * width, to, y_stride, count, width,
                          transpose);
        } else {
          rotate_rows(from, x_stride, c + t * width, s + t * width, to, y_stride, count, width, transpose);
        }
        row += count;
      }
    });
  });
}

}  // namespace

TransformerKernels transformer_kernels() {
  return {.rms_norm_forward = rms_norm_forward,
          .rms_norm_backward = rms_norm_backward,
          .swiglu_forward = swiglu_forward,
          .swiglu_backward = swiglu_backward,
          .rotary = rotary};
}

}  // namespace shardlab::cpu
