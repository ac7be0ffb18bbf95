// core/scalar.h: a number passed to an op (fill value, clamp bound, scalar operand).
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"

namespace shardlab {

// Keeps integers exact (an i64 fill of 2^60 stays 2^60) and remembers whether the value
// was written as a bool, an integer or a floating number, which decides result dtypes.
class Scalar {
 public:
  enum class Kind : unsigned char { boolean, integral, floating };

  Scalar(bool value) : kind_(Kind::boolean), integer_(value), floating_(value) {}
  template <std::integral I>
  requires(!std::same_as<I, bool>) Scalar(I value)
      : kind_(Kind::integral),
        integer_(static_cast<std::int64_t>(value)),
        floating_(static_cast<double>(value)) {}
  template <std::floating_point F>
  Scalar(F value) : kind_(Kind::floating), integer_(truncate(value)), floating_(static_cast<double>(value)) {}

  Kind kind() const { return kind_; }
  bool is_floating() const { return kind_ == Kind::floating; }
  double to_double() const { return floating_; }
  std::int64_t to_int() const { return integer_; }

  // The value as an element of type T: integers take the exact integer view, floating
  // types (and bool, true when non-zero) the floating one.
  template <typename T>
  T as() const {
    if constexpr (std::is_floating_point_v<compute_t<T>> || std::is_same_v<T, bool>) {
      return narrow<T>(floating_);
    } else {
      return narrow<T>(integer_);
    }
  }

 private:
  // Integer view of a floating value; NaN and out-of-range values (UB to cast) give 0.
  static std::int64_t truncate(double value) {
    return value > -9.2e18 && value < 9.2e18 ? static_cast<std::int64_t>(value) : 0;
  }

  Kind kind_;
  std::int64_t integer_;
  double floating_;
};

}  // namespace shardlab
