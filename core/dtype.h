// core/dtype.h: element types, their sizes and names, promotion, and bf16/f16 rounding.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#if defined(__CUDACC__)
#define SHARDLAB_HD __host__ __device__
#else
#define SHARDLAB_HD
#endif

namespace shardlab {

enum class DType : std::uint8_t { f32, f64, bf16, f16, i64, i32, u8, boolean };
inline constexpr int kNumDTypes = 8;

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "bf16", "bool", ...
bool is_floating(DType dtype);
bool is_integral(DType dtype);  // i64, i32, u8 (bool is its own category)

// PyTorch's promotion lattice restricted to our dtypes: bool < integers < floating;
// among integers the wider wins (u8 with i32 -> i32); among floats the wider wins and
// bf16 with f16 -> f32 because neither holds the other.
DType promote_types(DType a, DType b);

// --- 16-bit floats: storage types with exact round-to-nearest-even conversions ---------
// Bit patterns only; arithmetic is done in float (see float_of/narrow below).

struct bf16 {
  std::uint16_t bits;
};
struct f16 {
  std::uint16_t bits;
};

SHARDLAB_HD inline std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  return std::bit_cast<std::uint32_t>(value);
#endif
}

SHARDLAB_HD inline float bits_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

SHARDLAB_HD inline float bf16_to_float(bf16 value) {
  return bits_float(static_cast<std::uint32_t>(value.bits) << 16);
}

SHARDLAB_HD inline bf16 float_to_bf16(float value) {
  std::uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, force a quiet NaN
    return bf16{static_cast<std::uint16_t>((bits >> 16) | 0x0040u)};
  }
  // Adding 0x7fff plus the lowest kept bit rounds to nearest with ties going to even.
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16{static_cast<std::uint16_t>(bits >> 16)};
}

SHARDLAB_HD inline float f16_to_float(f16 value) {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

SHARDLAB_HD inline f16 float_to_f16(float value) {
  std::uint32_t bits = float_bits(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  bits &= 0x7fffffffu;
  std::uint32_t half;
  if (bits >= 0x47800000u) {  // |value| >= 2^16, inf or NaN: all exponent bits set
    half = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < 0x38800000u) {
    // Result is subnormal or zero. Adding 0.5f puts the value's 2^-24 units in the low
    // mantissa bits, so the FPU's own round-to-nearest-even does the rounding.
    half = float_bits(bits_float(bits) + 0.5f) - 0x3f000000u;
  } else {
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
    // A carry out of the mantissa correctly bumps the exponent, up to infinity.
    const std::uint32_t lowest_kept = (bits >> 13) & 1u;
    bits += 0xc8000fffu + lowest_kept;  // == ((15 - 127) << 23) + 0xfff, modulo 2^32
    half = bits >> 13;
  }
  return f16{static_cast<std::uint16_t>(half | sign)};
}

// --- mapping between C++ types and DType -------------------------------------------------

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct DTypeOf<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct DTypeOf<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct DTypeOf<std::int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct DTypeOf<std::int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct DTypeOf<std::uint8_t> {
  static constexpr DType value = DType::u8;
};
template <>
struct DTypeOf<bool> {
  static constexpr DType value = DType::boolean;
};
template <typename T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

// The type arithmetic on T is carried out in: 16-bit floats compute in float.
template <typename T>
struct ComputeTypeOf {
  using type = T;
};
template <>
struct ComputeTypeOf<bf16> {
  using type = float;
};
template <>
struct ComputeTypeOf<f16> {
  using type = float;
};
template <typename T>
using compute_t = typename ComputeTypeOf<T>::type;

// Widening to the compute type and narrowing back (rounding to nearest even for halves).
template <typename T>
SHARDLAB_HD inline compute_t<T> widen(T value) {
  if constexpr (std::is_same_v<T, bf16>) {
    return bf16_to_float(value);
  } else if constexpr (std::is_same_v<T, f16>) {
    return f16_to_float(value);
  } else {
    return value;
  }
}

// A floating value as the integer type T, the same on every device: toward zero, saturating at T's
// limits, NaN to 0, as CUDA's cvt.rzi converts (C++'s static_cast is undefined out of range: g++
// gives 253 for uint8(-3.7) where CUDA gives 0).
template <typename T, typename From>
SHARDLAB_HD inline T saturating_integer(From value) {
  constexpr T lowest = std::numeric_limits<T>::lowest(), highest = std::numeric_limits<T>::max();
  if (value != value) return T(0);
  // lowest is a power of two (or 0), exact in From; highest + 1 is the first value out of range.
  if (value <= static_cast<From>(lowest)) return lowest;
  if (value >= static_cast<From>(highest) + From(1)) return highest;
  return static_cast<T>(value);
}

template <typename T, typename From>
SHARDLAB_HD inline T narrow(From value) {
  if constexpr (std::is_same_v<T, bf16>) {
    return float_to_bf16(static_cast<float>(value));
  } else if constexpr (std::is_same_v<T, f16>) {
    return float_to_f16(static_cast<float>(value));
  } else if constexpr (std::is_same_v<T, bool>) {
    return value != From(0);
  } else if constexpr (std::is_integral_v<T> && std::is_floating_point_v<From>) {
    return saturating_integer<T>(value);
  } else {
    return static_cast<T>(value);
  }
}

// visit_dtype(dtype, [&]<typename T>() { ... }) calls the lambda with T = the C++ type.
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32:
      return fn.template operator()<float>();
    case DType::f64:
      return fn.template operator()<double>();
    case DType::bf16:
      return fn.template operator()<bf16>();
    case DType::f16:
      return fn.template operator()<f16>();
    case DType::i64:
      return fn.template operator()<std::int64_t>();
    case DType::i32:
      return fn.template operator()<std::int32_t>();
    case DType::u8:
      return fn.template operator()<std::uint8_t>();
    case DType::boolean:
      return fn.template operator()<bool>();
  }
  __builtin_unreachable();  // every enumerator is handled above
}

}  // namespace shardlab
