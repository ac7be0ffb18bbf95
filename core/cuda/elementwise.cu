// core/cuda/elementwise.cu: the elementwise CUDA kernels: fill, copy (with dtype conversion),
// unary, isfinite, arithmetic, comparison and where, over strided operands, and over dense ones in
// 16-byte packs (core/kernel_choice.h says which), and the family's entries (core/elementwise.h),
// which unpack Tensors into their launchers.
//
// One kernel per element type, with the op as a runtime argument: the op is the same for every
// thread, so its switch costs a uniform branch in memory-bound code, while a kernel per (op,
// dtype) pair would multiply compile time and binary size by the number of ops.
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

// --- element types -----------------------------------------------------------------------------

template <typename T>
inline constexpr bool is_floating_type = !std::is_integral_v<T>;  // f32, f64, bf16, f16

// Kernels that only move bytes (fill, same-dtype copy, where) run on the unsigned word of the
// element's size, so 8 dtypes need 4 kernels, and NaN payloads travel untouched.
template <std::size_t Size>
struct WordOf;
template <>
struct WordOf<1> {
  using type = std::uint8_t;
};
template <>
struct WordOf<2> {
  using type = std::uint16_t;
};
template <>
struct WordOf<4> {
  using type = std::uint32_t;
};
template <>
struct WordOf<8> {
  using type = std::uint64_t;
};
template <typename T>
using word_t = typename WordOf<sizeof(T)>::type;

template <typename T>
__device__ bool is_negative(T value) {
  if constexpr (std::is_signed_v<T>) {
    return value < T(0);
  } else {
    return false;
  }
}

template <typename T>
__device__ bool either_nan(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return a != a || b != b;
  } else {
    return false;
  }
}

// Only reached for floating T: either_nan is false for integers.
template <typename T>
__device__ T quiet_nan() {
  return std::numeric_limits<T>::quiet_NaN();
}

// Integer +, -, *, negate in the unsigned type: wraps modulo 2^bits instead of being undefined.
template <typename T>
__device__ T wrapping_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
}
template <typename T>
__device__ T wrapping_sub(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(a) - static_cast<U>(b));
}
template <typename T>
__device__ T wrapping_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
}

// The float or double version of each math function, so float ops never detour through double.
template <typename C>
struct Math;
template <>
struct Math<float> {
  static __device__ float abs(float x) { return fabsf(x); }
  static __device__ float exp(float x) { return expf(x); }
  static __device__ float log(float x) { return logf(x); }
  static __device__ float log1p(float x) { return log1pf(x); }
  static __device__ float sqrt(float x) { return sqrtf(x); }
  static __device__ float tanh(float x) { return tanhf(x); }
  static __device__ float erf(float x) { return erff(x); }
  static __device__ float pow(float x, float y) { return powf(x, y); }
};
template <>
struct Math<double> {
  static __device__ double abs(double x) { return ::fabs(x); }
  static __device__ double exp(double x) { return ::exp(x); }
  static __device__ double log(double x) { return ::log(x); }
  static __device__ double log1p(double x) { return ::log1p(x); }
  static __device__ double sqrt(double x) { return ::sqrt(x); }
  static __device__ double tanh(double x) { return ::tanh(x); }
  static __device__ double erf(double x) { return ::erf(x); }
  static __device__ double pow(double x, double y) { return ::pow(x, y); }
};

// --- fill and copy -----------------------------------------------------------------------------

template <typename Word>
__global__ void fill_kernel(Word* out, Word value, Layout<1> layout) {
  map_elements(
      layout, [=]() { return value; }, out);
}

template <typename Word>
__global__ void copy_kernel(const Word* src, Word* dst, Layout<2> layout) {
  map_elements(
      layout, [](Word x) { return x; }, dst, src);
}

// Between floating dtypes (a mixed-precision step's casts): typed on both sides, so packed.
template <typename Dst, typename Src>
__global__ void convert_floating_kernel(const Src* src, Dst* dst, Layout<2> layout) {
  map_elements(
      layout, [](Src x) { return narrow<Dst>(widen(x)); }, dst, src);
}

template <typename Dst, typename Src>
__device__ Dst convert(const void* src, std::int64_t offset) {
  return narrow<Dst>(widen(static_cast<const Src*>(src)[offset]));
}

// Element `offset` of src converted to Dst; the switch keeps one kernel per destination type.
template <typename Dst>
__device__ Dst load_as(const void* src, DType src_dtype, std::int64_t offset) {
  switch (src_dtype) {
    case DType::f32:
      return convert<Dst, float>(src, offset);
    case DType::f64:
      return convert<Dst, double>(src, offset);
    case DType::bf16:
      return convert<Dst, bf16>(src, offset);
    case DType::f16:
      return convert<Dst, f16>(src, offset);
    case DType::i64:
      return convert<Dst, std::int64_t>(src, offset);
    case DType::i32:
      return convert<Dst, std::int32_t>(src, offset);
    case DType::u8:
      return convert<Dst, std::uint8_t>(src, offset);
    case DType::boolean:
      return convert<Dst, bool>(src, offset);
  }
  __builtin_unreachable();  // every enumerator is handled above
}

template <typename Dst>
__global__ void convert_kernel(const void* src, DType src_dtype, Dst* dst, Layout<2> layout) {
  for_each_element(layout,
                   [&](const Offsets<2>& at) { dst[at.of[1]] = load_as<Dst>(src, src_dtype, at.of[0]); });
}

// --- unary -------------------------------------------------------------------------------------

template <typename C>
__device__ C floating_unary(UnaryOp op, C x) {
  using M = Math<C>;
  switch (op) {
    case UnaryOp::neg:
      return -x;
    case UnaryOp::abs:
      return x < C(0) ? -x : x;  // keeps -0 and NaN signs, as the CPU does
    case UnaryOp::exp:
      return M::exp(x);
    case UnaryOp::log:
      return M::log(x);
    case UnaryOp::log1p:
      return M::log1p(x);
    case UnaryOp::sqrt:
      return M::sqrt(x);
    case UnaryOp::rsqrt:
      return C(1) / M::sqrt(x);
    case UnaryOp::tanh:
      return M::tanh(x);
    case UnaryOp::sigmoid:
      return C(1) / (C(1) + M::exp(-x));
    case UnaryOp::relu:
      return x < C(0) ? C(0) : x;  // NaN stays NaN, like max(x, 0)
    case UnaryOp::silu:
      return x * (C(1) / (C(1) + M::exp(-x)));
    case UnaryOp::gelu:
      return C(0.5) * x * (C(1) + M::erf(x * C(0.70710678118654752440)));
    case UnaryOp::erf:
      return M::erf(x);
    case UnaryOp::gelu_tanh: {
      const C inner = C(0.79788456080286535588) * (x + C(0.044715) * x * x * x);  // sqrt(2/pi)
      return C(0.5) * x * (C(1) + M::tanh(inner));
    }
    default:
      break;  // isfinite has its own kernel (launch_isfinite)
  }
  __builtin_unreachable();
}

template <typename T>
__device__ T integer_unary(UnaryOp op, T x) {
  switch (op) {
    case UnaryOp::neg:
      return wrapping_sub(T(0), x);
    case UnaryOp::abs:
      return is_negative(x) ? wrapping_sub(T(0), x) : x;
    case UnaryOp::relu:
      return is_negative(x) ? T(0) : x;
    default:
      __builtin_unreachable();  // launch_unary refuses the other ops on integers
  }
}

bool is_integer_unary(UnaryOp op) { return op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::relu; }

template <typename T>
__global__ void unary_kernel(UnaryOp op, const T* in, T* out, Layout<2> layout) {
  map_elements(
      layout,
      [=](T x) {
        if constexpr (is_floating_type<T>) {
          return narrow<T>(floating_unary(op, widen(x)));
        } else {
          return integer_unary(op, x);
        }
      },
      out, in);
}

template <typename T>
__global__ void isfinite_kernel(const T* in, bool* out, Layout<2> layout) {
  using C = compute_t<T>;
  // False for NaN (the comparison fails) and for infinities.
  map_elements(
      layout, [](T x) { return Math<C>::abs(widen(x)) <= std::numeric_limits<C>::max(); }, out, in);
}

// --- binary ------------------------------------------------------------------------------------

// bool computes in int, so add/mul/maximum/minimum narrow back to or/and/or/and.
template <typename T>
using arithmetic_t = std::conditional_t<std::is_same_v<T, bool>, int, compute_t<T>>;

// base^exponent by squaring, wrapping on overflow. A negative exponent gives the integer part
// of 1 / base^-exponent: 1 for base 1, +-1 for base -1, else 0.
template <typename C>
__device__ C integer_power(C base, C exponent) {
  if (is_negative(exponent)) {
    if (base == C(1)) return C(1);
    if (base == C(-1)) return (exponent & C(1)) ? C(-1) : C(1);
    return C(0);
  }
  C result = C(1);
  for (; exponent != C(0); exponent = static_cast<C>(exponent >> 1)) {
    if (exponent & C(1)) result = wrapping_mul(result, base);
    base = wrapping_mul(base, base);
  }
  return result;
}

template <typename C>
__device__ C arithmetic(BinaryOp op, C a, C b) {
  constexpr bool floating = std::is_floating_point_v<C>;
  switch (op) {
    case BinaryOp::add:
      if constexpr (floating)
        return a + b;
      else
        return wrapping_add(a, b);
    case BinaryOp::sub:
      if constexpr (floating)
        return a - b;
      else
        return wrapping_sub(a, b);
    case BinaryOp::mul:
      if constexpr (floating)
        return a * b;
      else
        return wrapping_mul(a, b);
    case BinaryOp::div:
      if constexpr (floating)
        return a / b;
      else
        __builtin_unreachable();  // refused for integers
    case BinaryOp::pow:
      if constexpr (floating)
        return Math<C>::pow(a, b);
      else
        return integer_power(a, b);
    // A NaN on either side gives NaN; ties keep a, so max(-0, +0) is -0 as on the CPU.
    case BinaryOp::maximum:
      return either_nan(a, b) ? quiet_nan<C>() : a < b ? b : a;
    case BinaryOp::minimum:
      return either_nan(a, b) ? quiet_nan<C>() : b < a ? b : a;
    case BinaryOp::relu_backward:
      return b > C(0) ? a : C(0);
    default:
      break;  // comparisons run in compare_kernel
  }
  __builtin_unreachable();
}

template <typename C>
__device__ bool compare(BinaryOp op, C a, C b) {
  switch (op) {
    case BinaryOp::eq:
      return a == b;
    case BinaryOp::ne:
      return a != b;
    case BinaryOp::lt:
      return a < b;
    case BinaryOp::le:
      return a <= b;
    case BinaryOp::gt:
      return a > b;
    case BinaryOp::ge:
      return a >= b;
    default:
      break;  // arithmetic runs in arithmetic_kernel
  }
  __builtin_unreachable();
}

template <typename T>
__global__ void arithmetic_kernel(BinaryOp op, const T* a, const T* b, T* out, Layout<3> layout) {
  using C = arithmetic_t<T>;
  map_elements(
      layout,
      [=](T x, T y) { return narrow<T>(arithmetic(op, static_cast<C>(widen(x)), static_cast<C>(widen(y)))); },
      out, a, b);
}

template <typename T>
__global__ void compare_kernel(BinaryOp op, const T* a, const T* b, bool* out, Layout<3> layout) {
  map_elements(
      layout, [=](T x, T y) { return compare(op, widen(x), widen(y)); }, out, a, b);
}

template <typename Word>
__global__ void where_kernel(const bool* condition, const Word* a, const Word* b, Word* out,
                             Layout<4> layout) {
  map_elements(
      layout, [](bool c, Word x, Word y) { return c ? x : y; }, out, condition, a, b);
}

// The cast between two floating dtypes through convert_floating_kernel; false, launching nothing,
// for any other pair.
bool launch_convert_floating(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                             const Layout<2>& layout, cudaStream_t stream) {
  bool launched = false;
  floating(dst_dtype, [&]<typename Dst>() {
    launched = floating(src_dtype, [&]<typename Src>() {
      convert_floating_kernel<Dst, Src><<<map_grid<Dst, Src>(layout), kBlockSize, 0, stream>>>(
          static_cast<const Src*>(src), static_cast<Dst*>(dst), layout);
      SHARDLAB_CUDA_CHECK_LAUNCH();
    });
  });
  return launched;
}

// --- launchers ---------------------------------------------------------------------------------

// Writes the dtype_size(dtype) bytes at host address `value` to every element of out.
void launch_fill(void* out, DType dtype, const void* value, const Layout<1>& layout, cudaStream_t stream) {
  if (layout.numel == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    using Word = word_t<T>;
    Word bits;
    std::memcpy(&bits, value, sizeof(Word));
    fill_kernel<Word>
        <<<map_grid<Word>(layout), kBlockSize, 0, stream>>>(static_cast<Word*>(out), bits, layout);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// Operands: src, dst. Converts like the CPU: narrow<Dst>(widen(src value)); equal dtypes copy bits.
void launch_copy(const void* src, DType src_dtype, void* dst, DType dst_dtype, const Layout<2>& layout,
                 cudaStream_t stream) {
  if (layout.numel == 0) return;
  if (src_dtype != dst_dtype && launch_convert_floating(src, src_dtype, dst, dst_dtype, layout, stream))
    return;
  visit_dtype(dst_dtype, [&]<typename Dst>() {
    if (src_dtype == dst_dtype) {
      using Word = word_t<Dst>;
      copy_kernel<Word><<<map_grid<Word, Word>(layout), kBlockSize, 0, stream>>>(
          static_cast<const Word*>(src), static_cast<Word*>(dst), layout);
      SHARDLAB_CUDA_CHECK_LAUNCH();
    } else {
      convert_kernel<Dst><<<grid_size(layout.numel), kBlockSize, 0, stream>>>(src, src_dtype,
                                                                              static_cast<Dst*>(dst), layout);
      SHARDLAB_CUDA_CHECK_LAUNCH();
    }
  });
}

// Operands: in, out (same dtype). Floating dtypes: every op but isfinite, computed in float (f32, bf16,
// f16) or double (f64). i64/i32/u8: neg, abs and relu, wrapping like unsigned arithmetic.
bool launch_unary(UnaryOp op, DType dtype, const void* in, void* out, const Layout<2>& layout,
                  cudaStream_t stream) {
  if (op == UnaryOp::isfinite) return false;  // writes bool: launch_isfinite
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_same_v<T, bool>) {
      return false;
    } else {
      if (!is_floating_type<T> && !is_integer_unary(op)) return false;
      if (layout.numel == 0) return true;
      unary_kernel<T><<<map_grid<T, T>(layout), kBlockSize, 0, stream>>>(op, static_cast<const T*>(in),
                                                                         static_cast<T*>(out), layout);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    }
  });
}

// Operands: in (floating), out (bool).
bool launch_isfinite(DType dtype, const void* in, bool* out, const Layout<2>& layout, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (!is_floating_type<T>) {
      return false;
    } else {
      if (layout.numel == 0) return true;
      isfinite_kernel<T>
          <<<map_grid<bool, T>(layout), kBlockSize, 0, stream>>>(static_cast<const T*>(in), out, layout);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    }
  });
}

// Operands: a, b, out, all of `dtype`. Arithmetic ops only (comparisons: launch_compare);
// every dtype and op except div on i64/i32/u8/bool (the
// op layer divides integers in f32). Integers wrap; bool computes in int and narrows (add is
// or, mul is and); integer pow is exact repeated multiplication.
bool launch_arithmetic(BinaryOp op, DType dtype, const void* a, const void* b, void* out,
                       const Layout<3>& layout, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if (!is_floating_type<T> && op == BinaryOp::div) return false;
    if (layout.numel == 0) return true;
    arithmetic_kernel<T><<<map_grid<T, T, T>(layout), kBlockSize, 0, stream>>>(
        op, static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), layout);
    SHARDLAB_CUDA_CHECK_LAUNCH();
    return true;
  });
}

// Operands: a, b (both `dtype`, any of the 8), out (bool). Comparison ops only.
void launch_compare(BinaryOp op, DType dtype, const void* a, const void* b, bool* out,
                    const Layout<3>& layout, cudaStream_t stream) {
  if (layout.numel == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    compare_kernel<T><<<map_grid<bool, T, T>(layout), kBlockSize, 0, stream>>>(
        op, static_cast<const T*>(a), static_cast<const T*>(b), out, layout);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// Operands: condition (bool), a, b, out (a, b and out all of `dtype`).
void launch_where(const bool* condition, DType dtype, const void* a, const void* b, void* out,
                  const Layout<4>& layout, cudaStream_t stream) {
  if (layout.numel == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    using Word = word_t<T>;
    where_kernel<Word><<<map_grid<Word, bool, Word, Word>(layout), kBlockSize, 0, stream>>>(
        condition, static_cast<const Word*>(a), static_cast<const Word*>(b), static_cast<Word*>(out), layout);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// --- entries --------------------------------------------------------------------------------------

void cuda_fill(const Tensor& out, Scalar value) {
  const LaunchContext context(out);
  visit_dtype(out.dtype(), [&]<typename T>() {
    const T element = value.as<T>();
    launch_fill(out.raw_data(), out.dtype(), &element, layout_of<1>("fill", {&out}), context.stream());
  });
}

void cuda_copy(const Tensor& dst, const Tensor& src) {
  const LaunchContext context(dst);
  launch_copy(src.raw_data(), src.dtype(), dst.raw_data(), dst.dtype(), layout_of<2>("copy", {&src, &dst}),
              context.stream());
}

// False when the op has no kernel for the dtype.
bool launch_unary_op(UnaryOp op, DType dtype, const void* in, void* out, const Layout<2>& layout,
                     cudaStream_t stream) {
  if (op == UnaryOp::isfinite) {
    return launch_isfinite(dtype, in, static_cast<bool*>(out), layout, stream);
  }
  return launch_unary(op, dtype, in, out, layout, stream);
}

void cuda_unary(UnaryOp op, const Tensor& in, const Tensor& out) {
  const LaunchContext context(out);
  const bool launched = launch_unary_op(op, in.dtype(), in.raw_data(), out.raw_data(),
                                        layout_of<2>(op_name(op), {&in, &out}), context.stream());
  SHARDLAB_CHECK(launched, "{}: no CUDA kernel for dtype {}", op_name(op), dtype_name(in.dtype()));
}

// False when the op has no kernel for the dtype.
bool launch_binary_op(BinaryOp op, DType dtype, const void* a, const void* b, void* out,
                      const Layout<3>& layout, cudaStream_t stream) {
  if (!is_comparison(op)) return launch_arithmetic(op, dtype, a, b, out, layout, stream);
  launch_compare(op, dtype, a, b, static_cast<bool*>(out), layout, stream);
  return true;
}

void cuda_binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const LaunchContext context(out);
  const bool launched = launch_binary_op(op, a.dtype(), a.raw_data(), b.raw_data(), out.raw_data(),
                                         layout_of<3>(op_name(op), {&a, &b, &out}), context.stream());
  SHARDLAB_CHECK(launched, "{}: no CUDA kernel for dtype {}", op_name(op), dtype_name(a.dtype()));
}

void cuda_where(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out) {
  const LaunchContext context(out);
  launch_where(condition.data<bool>(), out.dtype(), a.raw_data(), b.raw_data(), out.raw_data(),
               layout_of<4>("where", {&condition, &a, &b, &out}), context.stream());
}

}  // namespace

ElementwiseKernels elementwise_kernels() {
  return {
      .fill = cuda_fill, .copy = cuda_copy, .unary = cuda_unary, .binary = cuda_binary, .where = cuda_where};
}

}  // namespace shardlab::cuda
