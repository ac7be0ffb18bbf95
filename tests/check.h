// tests/check.h: tolerance checks that fail on NaN, and helpers to build test tensors.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/random.h"
#include "core/tensor.h"

namespace shardlab::test {

struct Tolerance {
  double atol;
  double rtol;
};

// Per-dtype defaults for comparing a kernel against an independent reference.
inline Tolerance default_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return {1e-12, 1e-10};
    case DType::f32:
      return {1e-5, 1e-5};
    case DType::bf16:
      return {1e-2, 1.6e-2};
    case DType::f16:
      return {1e-3, 2e-3};
    default:
      return {0.0, 0.0};
  }
}

// Number of elements where !(|actual - expected| <= atol + rtol * |expected|); a NaN on
// either side counts as wrong unless both are NaN at the same place.
inline std::int64_t count_mismatches(const std::vector<double>& actual, const std::vector<double>& expected,
                                     Tolerance tol) {
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (std::isnan(actual[i]) && std::isnan(expected[i])) continue;
    if (std::isinf(expected[i]) && actual[i] == expected[i]) continue;
    const double diff = std::abs(actual[i] - expected[i]);
    if (!(diff <= tol.atol + tol.rtol * std::abs(expected[i]))) ++wrong;
  }
  return wrong;
}

// REQUIRE-style check that `actual` matches `expected` in shape and values.
inline void check_close(const Tensor& actual, const std::vector<double>& expected, Tolerance tol) {
  REQUIRE(actual.numel() == static_cast<std::int64_t>(expected.size()));
  const std::vector<double> values = actual.to_vector<double>();
  INFO("actual: " << actual.str());
  CHECK(count_mismatches(values, expected, tol) == 0);
}
inline void check_close(const Tensor& actual, const std::vector<double>& expected) {
  check_close(actual, expected, default_tolerance(actual.dtype()));
}
inline void check_close(const Tensor& actual, const Tensor& expected, Tolerance tol) {
  INFO("expected: " << expected.str());
  REQUIRE(actual.shape() == expected.shape());
  check_close(actual, expected.to_vector<double>(), tol);
}
inline void check_close(const Tensor& actual, const Tensor& expected) {
  check_close(actual, expected, default_tolerance(actual.dtype()));
}

// Values of a tensor must equal exactly (integers, bools, copies, views).
inline void check_equal(const Tensor& actual, const std::vector<double>& expected) {
  check_close(actual, expected, Tolerance{0.0, 0.0});
}

// All values of a tensor as doubles, in row-major order.
inline std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double total = 0;
  for (std::size_t i = 0; i < a.size(); ++i) total += a[i] * b[i];
  return total;
}

// Row-major coordinates of element `flat` of `shape`.
inline std::vector<std::int64_t> coordinates(std::int64_t flat, const Shape& shape) {
  std::vector<std::int64_t> c(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    c[d] = flat % shape[d];
    flat /= shape[d];
  }
  return c;
}

// A reproducible random tensor in [low, high) for test inputs.
inline Tensor random_tensor(const Shape& shape, std::uint64_t seed, DType dtype = DType::f32,
                            double low = -1.0, double high = 1.0) {
  return uniform(shape, RandomKey{seed, 12345}, low, high, TensorOptions{}.with_dtype(dtype));
}

// A non-contiguous tensor with the given shape and the values of random_tensor: built as
// the transpose of a contiguous tensor with the last two dims swapped.
inline Tensor random_strided(const Shape& shape, std::uint64_t seed, DType dtype = DType::f32) {
  REQUIRE(shape.size() >= 2);
  Shape swapped = shape;
  std::swap(swapped[swapped.size() - 1], swapped[swapped.size() - 2]);
  const auto rank = static_cast<std::int64_t>(shape.size());
  return random_tensor(swapped, seed, dtype).transpose(rank - 1, rank - 2);
}

// Calls fn and checks it throws shardlab::Error whose message contains `fragment`.
#define CHECK_THROWS_ERROR(expr, fragment) CHECK_THROWS_WITH((expr), Catch::Matchers::Contains(fragment))

}  // namespace shardlab::test
