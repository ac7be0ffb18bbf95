// core/cpu/elementwise.cpp: CPU fill, copy/cast, unary, binary and where kernels.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/cpu/kernels.h"
#include "core/cpu/loops.h"

namespace shardlab::cpu {
namespace {

template <typename T>
constexpr bool is_float_like = std::is_floating_point_v<compute_t<T>>;

// Signed integer +, -, * and negation compute in the unsigned type of the same width, so an
// out-of-range result wraps modulo 2^bits (as the CUDA kernels and PyTorch do) where signed
// overflow would be undefined. Floating, unsigned and bool values compute as they are.
template <typename C, bool = std::is_integral_v<C>&& std::is_signed_v<C>>
struct Wrapping {
  using type = C;
};
template <typename C>
struct Wrapping<C, true> {
  using type = std::make_unsigned_t<C>;
};
template <typename C>
using wrapping_t = typename Wrapping<C>::type;

template <typename C>
C wrapping_add(C a, C b) {
  return static_cast<C>(static_cast<wrapping_t<C>>(a) + static_cast<wrapping_t<C>>(b));
}
template <typename C>
C wrapping_sub(C a, C b) {
  return static_cast<C>(static_cast<wrapping_t<C>>(a) - static_cast<wrapping_t<C>>(b));
}
template <typename C>
C wrapping_mul(C a, C b) {
  return static_cast<C>(static_cast<wrapping_t<C>>(a) * static_cast<wrapping_t<C>>(b));
}
template <typename C>
C wrapping_neg(C x) {
  return static_cast<C>(-static_cast<wrapping_t<C>>(x));
}

// out[i] = f(in[i]) for `In` inputs and `Out` outputs, computing on widened values.
template <typename Out, typename In, typename F>
void map1(const Tensor& out, const Tensor& in, F f) {
  for_each_row<2>(out.shape(), {&out, &in}, [&](Pointers<2> p, ByteStrides<2> s, std::int64_t n) {
    if (s[0] == sizeof(Out) && s[1] == sizeof(In)) {  // vectorisable
      Out* o = reinterpret_cast<Out*>(p[0]);
      const In* x = reinterpret_cast<const In*>(p[1]);
      for (std::int64_t i = 0; i < n; ++i) o[i] = narrow<Out>(f(widen(x[i])));
      return;
    }
    for (std::int64_t i = 0; i < n; ++i)
      at<Out>(p[0], s[0], i) = narrow<Out>(f(widen(at<In>(p[1], s[1], i))));
  });
}

template <typename Out, typename In, typename F>
void map2(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  for_each_row<3>(out.shape(), {&out, &a, &b}, [&](Pointers<3> p, ByteStrides<3> s, std::int64_t n) {
    if (s[0] == sizeof(Out) && s[1] == sizeof(In) && s[2] == sizeof(In)) {  // vectorisable
      Out* o = reinterpret_cast<Out*>(p[0]);
      const In* x = reinterpret_cast<const In*>(p[1]);
      const In* y = reinterpret_cast<const In*>(p[2]);
      for (std::int64_t i = 0; i < n; ++i) o[i] = narrow<Out>(f(widen(x[i]), widen(y[i])));
      return;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      at<Out>(p[0], s[0], i) = narrow<Out>(f(widen(at<In>(p[1], s[1], i)), widen(at<In>(p[2], s[2], i))));
    }
  });
}

template <typename C>
C gelu_exact(C x) {
  return C(0.5) * x * (C(1) + std::erf(x * C(0.70710678118654752440)));
}

template <typename C>
C gelu_tanh(C x) {
  const C inner = C(0.79788456080286535588) * (x + C(0.044715) * x * x * x);
  return C(0.5) * x * (C(1) + std::tanh(inner));
}

template <typename C>
C sigmoid_of(C x) {
  return C(1) / (C(1) + std::exp(-x));
}

template <typename T>
void unary_floating(UnaryOp op, const Tensor& in, const Tensor& out) {
  using C = compute_t<T>;
  switch (op) {
    case UnaryOp::exp:
      return map1<T, T>(out, in, [](C x) { return std::exp(x); });
    case UnaryOp::log:
      return map1<T, T>(out, in, [](C x) { return std::log(x); });
    case UnaryOp::log1p:
      return map1<T, T>(out, in, [](C x) { return std::log1p(x); });
    case UnaryOp::sqrt:
      return map1<T, T>(out, in, [](C x) { return std::sqrt(x); });
    case UnaryOp::rsqrt:
      return map1<T, T>(out, in, [](C x) { return C(1) / std::sqrt(x); });
    case UnaryOp::tanh:
      return map1<T, T>(out, in, [](C x) { return std::tanh(x); });
    case UnaryOp::sigmoid:
      return map1<T, T>(out, in, [](C x) { return sigmoid_of(x); });
    case UnaryOp::silu:
      return map1<T, T>(out, in, [](C x) { return x * sigmoid_of(x); });
    case UnaryOp::gelu:
      return map1<T, T>(out, in, [](C x) { return gelu_exact(x); });
    case UnaryOp::erf:
      return map1<T, T>(out, in, [](C x) { return std::erf(x); });
    case UnaryOp::gelu_tanh:
      return map1<T, T>(out, in, [](C x) { return gelu_tanh(x); });
    case UnaryOp::isfinite:
      return map1<bool, T>(out, in, [](C x) { return std::isfinite(x); });
    default:
      fail("{}: no CPU kernel for {}", op_name(op), dtype_name(in.dtype()));
  }
}

template <typename T>
void unary_numeric(UnaryOp op, const Tensor& in, const Tensor& out) {
  using C = compute_t<T>;
  switch (op) {
    case UnaryOp::neg:
      return map1<T, T>(out, in, [](C x) { return wrapping_neg(x); });
    case UnaryOp::abs:
      if constexpr (std::is_unsigned_v<C>) return map1<T, T>(out, in, [](C x) { return x; });
      return map1<T, T>(out, in, [](C x) { return x < C(0) ? wrapping_neg(x) : x; });
    case UnaryOp::relu:
      if constexpr (std::is_unsigned_v<C>) return map1<T, T>(out, in, [](C x) { return x; });
      return map1<T, T>(out, in, [](C x) { return x < C(0) ? C(0) : x; });
    default:
      if constexpr (is_float_like<T>) return unary_floating<T>(op, in, out);
      fail("{}: not defined for {}", op_name(op), dtype_name(in.dtype()));
  }
}

template <typename C>
C integer_power(C base, C exponent) {
  if constexpr (std::is_signed_v<C>) {
    if (exponent < C(0)) return base == C(1) ? C(1) : base == C(-1) ? (exponent % 2 ? C(-1) : C(1)) : C(0);
  }
  C result = 1;
  while (exponent > C(0)) {
    if (exponent % 2) result = wrapping_mul(result, base);
    base = wrapping_mul(base, base);
    exponent = static_cast<C>(exponent / 2);
  }
  return result;
}

template <typename C>
bool either_nan(C a, C b) {
  if constexpr (std::is_floating_point_v<C>) return std::isnan(a) || std::isnan(b);
  return false;
}

template <typename T>
void binary_typed(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  using C = compute_t<T>;
  constexpr C nan = std::numeric_limits<C>::quiet_NaN();
  switch (op) {
    case BinaryOp::add:
      return map2<T, T>(out, a, b, [](C x, C y) { return wrapping_add(x, y); });
    case BinaryOp::sub:
      return map2<T, T>(out, a, b, [](C x, C y) { return wrapping_sub(x, y); });
    case BinaryOp::mul:
      return map2<T, T>(out, a, b, [](C x, C y) { return wrapping_mul(x, y); });
    case BinaryOp::div:
      return map2<T, T>(out, a, b, [](C x, C y) { return static_cast<C>(x / y); });
    case BinaryOp::pow:
      if constexpr (std::is_floating_point_v<C>) {
        return map2<T, T>(out, a, b, [](C x, C y) { return std::pow(x, y); });
      } else {
        return map2<T, T>(out, a, b, [](C x, C y) { return integer_power(x, y); });
      }
    case BinaryOp::maximum:
      return map2<T, T>(out, a, b, [](C x, C y) { return either_nan(x, y) ? nan : (x < y ? y : x); });
    case BinaryOp::minimum:
      return map2<T, T>(out, a, b, [](C x, C y) { return either_nan(x, y) ? nan : (y < x ? y : x); });
    case BinaryOp::relu_backward:
      return map2<T, T>(out, a, b, [](C g, C y) { return y > C(0) ? g : C(0); });
    case BinaryOp::eq:
      return map2<bool, T>(out, a, b, [](C x, C y) { return x == y; });
    case BinaryOp::ne:
      return map2<bool, T>(out, a, b, [](C x, C y) { return x != y; });
    case BinaryOp::lt:
      return map2<bool, T>(out, a, b, [](C x, C y) { return x < y; });
    case BinaryOp::le:
      return map2<bool, T>(out, a, b, [](C x, C y) { return x <= y; });
    case BinaryOp::gt:
      return map2<bool, T>(out, a, b, [](C x, C y) { return x > y; });
    case BinaryOp::ge:
      return map2<bool, T>(out, a, b, [](C x, C y) { return x >= y; });
  }
}

void fill(const Tensor& out, Scalar value) {
  visit_dtype(out.dtype(), [&]<typename T>() {
    const T v = value.as<T>();
    for_each_row<1>(out.shape(), {&out}, [&](Pointers<1> p, ByteStrides<1> s, std::int64_t n) {
      for (std::int64_t i = 0; i < n; ++i) at<T>(p[0], s[0], i) = v;
    });
  });
}

void unary(UnaryOp op, const Tensor& in, const Tensor& out) {
  visit_dtype(in.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, bool>) {
      fail("{}: not defined for bool", op_name(op));
    } else {
      unary_numeric<T>(op, in, out);
    }
  });
}

void where(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_dtype(out.dtype(), [&]<typename T>() {
    for_each_row<4>(
        out.shape(), {&out, &condition, &a, &b}, [&](Pointers<4> p, ByteStrides<4> s, std::int64_t n) {
          for (std::int64_t i = 0; i < n; ++i) {
            at<T>(p[0], s[0], i) = at<bool>(p[1], s[1], i) ? at<T>(p[2], s[2], i) : at<T>(p[3], s[3], i);
          }
        });
  });
}

}  // namespace

// Shared with the other families' CPU kernels (core/cpu/kernels.h).
void copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype()) {  // bit-exact, whatever the values (NaN payloads too)
    const std::size_t size = dst.element_size();
    for_each_row<2>(dst.shape(), {&dst, &src}, [&](Pointers<2> p, ByteStrides<2> s, std::int64_t n) {
      if (s[0] == static_cast<std::int64_t>(size) && s[1] == static_cast<std::int64_t>(size)) {
        std::memcpy(p[0], p[1], static_cast<std::size_t>(n) * size);
        return;
      }
      for (std::int64_t i = 0; i < n; ++i) std::memcpy(p[0] + i * s[0], p[1] + i * s[1], size);
    });
    return;
  }
  visit_dtype(dst.dtype(), [&]<typename D>() {
    visit_dtype(src.dtype(), [&]<typename S>() {
      for_each_row<2>(dst.shape(), {&dst, &src}, [&](Pointers<2> p, ByteStrides<2> s, std::int64_t n) {
        for (std::int64_t i = 0; i < n; ++i) at<D>(p[0], s[0], i) = narrow<D>(widen(at<S>(p[1], s[1], i)));
      });
    });
  });
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_dtype(a.dtype(), [&]<typename T>() { binary_typed<T>(op, a, b, out); });
}

ElementwiseKernels elementwise_kernels() {
  return {.fill = fill, .copy = copy, .unary = unary, .binary = binary, .where = where};
}

}  // namespace shardlab::cpu
