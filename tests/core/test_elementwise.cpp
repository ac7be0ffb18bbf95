// tests/core/test_elementwise.cpp: unary/binary elementwise ops, Scalar operands, where, promotion,
// broadcasting.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "tests/check.h"

namespace shardlab::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const std::vector<DType> kFloatDTypes{DType::f32, DType::f64, DType::bf16, DType::f16};
const std::vector<Shape> kShapes{{1}, {7}, {13}, {3, 5}};

using Unary = std::function<double(double)>;
using Binary = std::function<double(double, double)>;

// The values of a tensor of `shape` (row-major `v`) broadcast NumPy-style to `out`: dims
// aligned on the right, a size-1 dim repeats its only element.
std::vector<double> broadcast_values(const std::vector<double>& v, const Shape& shape, const Shape& out) {
  const std::int64_t n = shape_numel(out);
  std::vector<double> result(static_cast<std::size_t>(n));
  const std::size_t lead = out.size() - shape.size();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::vector<std::int64_t> c = coordinates(i, out);
    std::int64_t flat = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      flat = flat * shape[d] + (shape[d] == 1 ? 0 : c[lead + d]);
    }
    result[static_cast<std::size_t>(i)] = v[static_cast<std::size_t>(flat)];
  }
  return result;
}

std::vector<double> map_values(const std::vector<double>& x, const Unary& f) {
  std::vector<double> out;
  for (const double v : x) out.push_back(f(v));
  return out;
}

// f applied to a and b broadcast to `out_shape`, all in double.
std::vector<double> reference_binary(const Tensor& a, const Tensor& b, const Shape& out_shape,
                                     const Binary& f) {
  const std::vector<double> x = broadcast_values(values(a), a.shape(), out_shape);
  const std::vector<double> y = broadcast_values(values(b), b.shape(), out_shape);
  std::vector<double> out;
  for (std::size_t i = 0; i < x.size(); ++i) out.push_back(f(x[i], y[i]));
  return out;
}

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double gelu_ref(double x) { return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2)); }
double gelu_tanh_ref(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

struct UnaryCase {
  std::string name;
  std::function<Tensor(const Tensor&)> op;
  Unary reference;
  double low, high;  // input range
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double x) { return -x; }, -3, 3},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double x) { return std::abs(x); }, -3, 3},
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, -3, 3},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, 0.05, 5},
      {"log1p", [](const Tensor& x) { return log1p(x); }, [](double x) { return std::log1p(x); }, -0.95, 5},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, 0, 5},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, 0.05, 5},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, -3, 3},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, sigmoid_ref, -6, 6},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x < 0 ? 0.0 : x; }, -3, 3},
      {"silu", [](const Tensor& x) { return silu(x); }, [](double x) { return x * sigmoid_ref(x); }, -6, 6},
      {"gelu", [](const Tensor& x) { return gelu(x); }, gelu_ref, -4, 4},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, GeluApproximation::tanh); }, gelu_tanh_ref, -4, 4},
      {"erf", [](const Tensor& x) { return erf(x); }, [](double x) { return std::erf(x); }, -3, 3},
  };
}

struct BinaryCase {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> op;
  Binary reference;
  double a_low, a_high, b_low, b_high;
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); },
       [](double x, double y) { return x + y; }, -2, 2, -2, 2},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); },
       [](double x, double y) { return x - y; }, -2, 2, -2, 2},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); },
       [](double x, double y) { return x * y; }, -2, 2, -2, 2},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); },
       [](double x, double y) { return x / y; }, -2, 2, 0.5, 2},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); },
       [](double x, double y) { return std::pow(x, y); }, 0.1, 3, -2, 2},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); },
       [](double x, double y) { return x > y ? x : y; }, -2, 2, -2, 2},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); },
       [](double x, double y) { return x < y ? x : y; }, -2, 2, -2, 2},
  };
}

}  // namespace

// --- unary -----------------------------------------------------------------------------------

TEST_CASE("unary ops match std:: math in double on every floating dtype and odd sizes", "[elementwise]") {
  std::uint64_t seed = 100;
  for (const UnaryCase& c : unary_cases()) {
    for (const DType dtype : kFloatDTypes) {
      for (const Shape& shape : kShapes) {
        INFO(c.name << " " << dtype_name(dtype) << " " << shape_str(shape));
        const Tensor x = random_tensor(shape, ++seed, dtype, c.low, c.high);
        const Tensor y = c.op(x);
        CHECK(y.dtype() == dtype);
        CHECK(y.shape() == shape);
        check_close(y, map_values(values(x), c.reference));
      }
    }
  }
}

TEST_CASE("unary ops on non-contiguous inputs: transposed, sliced with a step, expanded", "[elementwise]") {
  std::uint64_t seed = 200;
  for (const UnaryCase& c : unary_cases()) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
      INFO(c.name << " " << dtype_name(dtype));
      const double mid = (c.low + c.high) / 2, half = (c.high - c.low) / 2;
      // Inputs drawn in [-1, 1) and mapped into the op's domain.
      const auto into_domain = [&](const Tensor& t) { return add(mul(t, half), mid); };
      const Tensor transposed = into_domain(random_tensor({13, 7}, ++seed, dtype)).transpose(0, 1);
      REQUIRE_FALSE(transposed.is_contiguous());
      const Tensor sliced = into_domain(random_tensor({7, 26}, ++seed, dtype)).slice(1, 1, 26, 2);
      REQUIRE(sliced.shape() == Shape{7, 13});
      REQUIRE_FALSE(sliced.is_contiguous());
      const Tensor expanded = into_domain(random_tensor({1, 13}, ++seed, dtype)).expand({7, 13});
      REQUIRE(expanded.stride(0) == 0);
      for (const Tensor& x : {transposed, sliced, expanded}) {
        const Tensor y = c.op(x);
        CHECK(y.shape() == x.shape());
        check_close(y, map_values(values(x), c.reference));
      }
    }
  }
}

TEST_CASE("unary floating ops on integer and bool inputs compute in f32", "[elementwise]") {
  const Tensor i = from_vector<std::int32_t>({0, 1, 4, 9});
  const Tensor s = sqrt(i);
  CHECK(s.dtype() == DType::f32);
  check_equal(s, {0, 1, 2, 3});
  const Tensor e = exp(from_vector<std::int64_t>({0, 1, -1}));
  CHECK(e.dtype() == DType::f32);
  check_close(e, {1.0, std::exp(1.0), std::exp(-1.0)});
  const Tensor u = sigmoid(from_vector<std::uint8_t>({0, 2}));
  CHECK(u.dtype() == DType::f32);
  check_close(u, {0.5, sigmoid_ref(2.0)});
  const Tensor b = log(from_vector<bool>({true, false}));
  CHECK(b.dtype() == DType::f32);
  check_equal(b, {0.0, -kInf});
  CHECK(gelu(from_vector<std::int32_t>({1})).dtype() == DType::f32);
  CHECK(rsqrt(from_vector<std::int32_t>({4})).item<float>() == 0.5f);
}

TEST_CASE("neg, abs and relu keep integer dtypes", "[elementwise]") {
  const Tensor i32 = from_vector<std::int32_t>({-5, 0, 7, -2147483647});
  CHECK(neg(i32).dtype() == DType::i32);
  check_equal(neg(i32), {5, 0, -7, 2147483647});
  check_equal(abs(i32), {5, 0, 7, 2147483647});
  check_equal(relu(i32), {0, 0, 7, 0});
  const Tensor i64 = from_vector<std::int64_t>({-(std::int64_t{1} << 40), 3});
  CHECK(abs(i64).dtype() == DType::i64);
  CHECK(abs(i64).to_vector<std::int64_t>() == std::vector<std::int64_t>{std::int64_t{1} << 40, 3});
  // u8 negation wraps modulo 256 (as in C and PyTorch); abs and relu are the identity.
  const Tensor u8 = from_vector<std::uint8_t>({0, 5, 255});
  CHECK(neg(u8).dtype() == DType::u8);
  check_equal(neg(u8), {0, 251, 1});
  check_equal(abs(u8), {0, 5, 255});
  check_equal(relu(u8), {0, 5, 255});
}

TEST_CASE("unary ops at special values: infinities, NaN, zero, huge arguments", "[elementwise]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor x = from_vector<double>({0.0, -1.0, kInf, -kInf, kNaN}).to(dtype);
    // check_close passes infinities only when equal and NaN only against NaN.
    check_close(exp(x), {1.0, std::exp(-1.0), kInf, 0.0, kNaN});
    check_close(log(x), {-kInf, kNaN, kInf, kNaN, kNaN});
    check_close(sqrt(x), {0.0, kNaN, kInf, kNaN, kNaN});
    check_close(rsqrt(x), {kInf, kNaN, 0.0, kNaN, kNaN});
    check_close(tanh(x), {0.0, std::tanh(-1.0), 1.0, -1.0, kNaN});
    check_close(relu(x), {0.0, 0.0, kInf, 0.0, kNaN});
    check_close(abs(x), {0.0, 1.0, kInf, kInf, kNaN});
    check_close(neg(x), {0.0, 1.0, -kInf, kInf, kNaN});
    check_equal(isfinite(x), {1, 1, 0, 0, 0});
    CHECK(isfinite(x).dtype() == DType::boolean);
    // Saturating ends: no overflow into NaN.
    const Tensor big = from_vector<double>({-1000.0, 1000.0, -kInf, kInf}).to(dtype);
    check_equal(sigmoid(big), {0.0, 1.0, 0.0, 1.0});
    check_equal(tanh(big), {-1.0, 1.0, -1.0, 1.0});
    check_close(silu(big.narrow(0, 0, 2)), {0.0, 1000.0});
    check_close(gelu(big.narrow(0, 0, 2)), {0.0, 1000.0});
    check_close(gelu(big.narrow(0, 0, 2), GeluApproximation::tanh), {0.0, 1000.0});
  }
  // Integers are always finite.
  const Tensor ints = isfinite(from_vector<std::int32_t>({1, -2, 0}));
  CHECK(ints.dtype() == DType::boolean);
  check_equal(ints, {1, 1, 1});
}

TEST_CASE("log1p keeps the x that 1 + x rounds away, and is -inf at -1 and NaN below", "[elementwise]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    // 1 + x is 1 in the dtype: log of it is 0, log1p keeps x (x - x^2/2 + ...).
    const double small = dtype == DType::f16 ? 1e-4 : dtype == DType::f64 ? 1e-20 : 1e-10;
    const Tensor x = from_vector<double>({small, -3 * small, 5 * small}).to(dtype);
    check_close(log1p(x), map_values(values(x), [](double v) { return std::log1p(v); }));
    CHECK(values(log(add(x, 1.0)))[0] == 0.0);
    CHECK(values(log1p(x))[0] != 0.0);
    check_close(log1p(from_vector<double>({-1.0, -2.0, kInf, kNaN, 0.0}).to(dtype)),
                {-kInf, kNaN, kInf, kNaN, 0.0});
  }
  // Integers and bools compute in f32, as exp and log do.
  const Tensor ints = log1p(from_vector<std::int32_t>({0, 1, 9}));
  CHECK(ints.dtype() == DType::f32);
  check_close(ints, {0.0, std::log(2.0), std::log(10.0)});
  CHECK_THROWS_ERROR(log1p(Tensor()), "log1p: input tensor is undefined");
}

TEST_CASE("unary ops satisfy algebraic identities in f64", "[elementwise]") {
  const Tensor x = random_tensor({5, 13}, 7, DType::f64, -4, 4);
  const Tolerance tol{1e-12, 1e-12};
  // gelu(x) - gelu(-x) = x, since erf is odd.
  check_close(sub(gelu(x), gelu(neg(x))), x, tol);
  // The tanh approximation satisfies the same identity, tanh being odd.
  check_close(sub(gelu(x, GeluApproximation::tanh), gelu(neg(x), GeluApproximation::tanh)), x, tol);
  // sigmoid(x) + sigmoid(-x) = 1; tanh(x) = 2 sigmoid(2x) - 1; silu = x sigmoid(x).
  check_close(add(sigmoid(x), sigmoid(neg(x))), ones({5, 13}, dtype(DType::f64)), tol);
  check_close(tanh(x), sub(mul(sigmoid(mul(x, 2.0)), 2.0), 1.0), tol);
  check_close(silu(x), mul(x, sigmoid(x)), tol);
  // relu(x) - relu(-x) = x and relu(x) + relu(-x) = |x|.
  check_close(sub(relu(x), relu(neg(x))), x, Tolerance{0, 0});
  check_close(add(relu(x), relu(neg(x))), abs(x), Tolerance{0, 0});
  const Tensor positive = random_tensor({5, 13}, 8, DType::f64, 0.1, 10);
  check_close(exp(log(positive)), positive, tol);
  check_close(mul(rsqrt(positive), sqrt(positive)), ones({5, 13}, dtype(DType::f64)), tol);
}

TEST_CASE("unary ops on empty tensors give empty tensors of the right dtype", "[elementwise]") {
  const Tensor x = empty({2, 0, 3});
  for (const UnaryCase& c : unary_cases()) {
    INFO(c.name);
    const Tensor y = c.op(x);
    CHECK(y.shape() == Shape{2, 0, 3});
    CHECK(y.dtype() == DType::f32);
  }
  CHECK(isfinite(x).shape() == Shape{2, 0, 3});
  CHECK(isfinite(x).dtype() == DType::boolean);
  CHECK(clamp(x, 0, 1).shape() == Shape{2, 0, 3});
  CHECK(exp(empty({0}, dtype(DType::i32))).dtype() == DType::f32);
  // A tensor without elements is contiguous whatever its strides (as in PyTorch); fill_random
  // and so random_tensor() rely on it.
  CHECK(x.is_contiguous());
  CHECK_NOTHROW(random_tensor({2, 0, 3}, 1));
}

TEST_CASE("unary ops on a 0-d tensor give a 0-d tensor", "[elementwise]") {
  const Tensor x = scalar_tensor(-2.0);
  CHECK(abs(x).shape() == Shape{});
  CHECK(abs(x).item<float>() == 2.0f);
  CHECK(exp(x).shape() == Shape{});
  check_close(exp(x), {std::exp(-2.0)});
}

TEST_CASE("clamp with one or both bounds, NaN and dtypes", "[elementwise]") {
  const Tensor x = from_vector<float>({-3, -1, 0, 0.5f, 2, 5});
  check_equal(clamp(x, -1.0, 2.0), {-1, -1, 0, 0.5, 2, 2});
  check_equal(clamp(x, 0.0, std::nullopt), {0, 0, 0, 0.5, 2, 5});
  check_equal(clamp(x, std::nullopt, 0.0), {-3, -1, 0, 0, 0, 0});
  CHECK(clamp(x, -1.0, 2.0).dtype() == DType::f32);
  // min > max: every element becomes max (the max bound is applied last, as in PyTorch).
  check_equal(clamp(x, 3.0, 1.0), {1, 1, 1, 1, 1, 1});
  // NaN stays NaN.
  check_equal(clamp(from_vector<double>({kNaN, 7.0}), 0.0, 1.0), {kNaN, 1.0});
  // Integer tensor with integer bounds keeps its dtype; a floating bound makes it f32.
  const Tensor i = from_vector<std::int32_t>({-5, 0, 5, 10});
  const Tensor clamped = clamp(i, 0, 6);
  CHECK(clamped.dtype() == DType::i32);
  check_equal(clamped, {0, 0, 5, 6});
  const Tensor fractional = clamp(i, 0.5, std::nullopt);
  CHECK(fractional.dtype() == DType::f32);
  check_equal(fractional, {0.5, 0.5, 5, 10});
  // bf16 keeps its dtype.
  const Tensor h = clamp(from_vector<float>({-2, 0.25f, 2}).to(DType::bf16), -1.0, 1.0);
  CHECK(h.dtype() == DType::bf16);
  check_equal(h, {-1, 0.25, 1});
}

TEST_CASE("cast rounds, truncates and saturates as documented", "[elementwise]") {
  // float -> integer truncates toward zero.
  const Tensor f = from_vector<float>({2.7f, -2.7f, 0.5f, -0.5f, 100.0f});
  const Tensor i = cast(f, DType::i32);
  CHECK(i.dtype() == DType::i32);
  check_equal(i, {2, -2, 0, 0, 100});
  check_equal(cast(f, DType::i64), {2, -2, 0, 0, 100});
  // float -> bool: nonzero (NaN included) is true.
  const Tensor b = cast(from_vector<float>({0.0f, -0.0f, 0.5f, -3.0f, NAN}), DType::boolean);
  CHECK(b.dtype() == DType::boolean);
  check_equal(b, {0, 0, 1, 1, 1});
  // bool -> float and integer.
  check_equal(cast(from_vector<bool>({true, false}), DType::f32), {1, 0});
  check_equal(cast(from_vector<bool>({true, false}), DType::u8), {1, 0});
  // f32 -> bf16 rounds to nearest even: 1 + 2^-8 is a tie going down to 1, 1 + 3 * 2^-8 a
  // tie going up to 1 + 2^-6.
  check_equal(cast(from_vector<float>({1.0f + 1.0f / 256, 1.0f + 3.0f / 256}), DType::bf16),
              {1.0, 1.0 + 1.0 / 64});
  // f32 -> f16: 65504 is the largest half; 65520 is halfway to 2^16 and rounds up to inf.
  check_equal(cast(from_vector<float>({65504.0f, 65520.0f, -65520.0f, 1.0f + 1.0f / 2048}), DType::f16),
              {65504.0, kInf, -kInf, 1.0});
  // i64 -> f64 is exact up to 2^53; u8 -> i32 keeps 255.
  check_equal(cast(from_vector<std::int64_t>({std::int64_t{1} << 53, -7}), DType::f64),
              {9007199254740992.0, -7.0});
  check_equal(cast(from_vector<std::uint8_t>({255, 0}), DType::i32), {255, 0});
  // bf16 <-> f16: 1/3 in bf16 then to f16 keeps the bf16 value (it fits in 11 bits).
  const Tensor third = cast(from_vector<float>({1.0f / 3}), DType::bf16);
  check_equal(cast(third, DType::f16), values(third));
  // Casting a non-contiguous tensor gives its values in row-major order.
  const Tensor t = arange(6).reshape({2, 3}).transpose(0, 1);
  const Tensor tc = cast(t, DType::f32);
  CHECK(tc.shape() == Shape{3, 2});
  check_equal(tc, {0, 3, 1, 4, 2, 5});
  // Same dtype: same values.
  check_equal(cast(f, DType::f32), values(f));
}

// --- binary ----------------------------------------------------------------------------------

TEST_CASE("binary ops match a naive loop on every floating dtype and odd sizes", "[elementwise]") {
  std::uint64_t seed = 300;
  for (const BinaryCase& c : binary_cases()) {
    for (const DType dtype : kFloatDTypes) {
      for (const Shape& shape : kShapes) {
        INFO(c.name << " " << dtype_name(dtype) << " " << shape_str(shape));
        const Tensor a = random_tensor(shape, ++seed, dtype, c.a_low, c.a_high);
        const Tensor b = random_tensor(shape, ++seed, dtype, c.b_low, c.b_high);
        const Tensor y = c.op(a, b);
        CHECK(y.dtype() == dtype);
        CHECK(y.shape() == shape);
        check_close(y, reference_binary(a, b, shape, c.reference));
      }
    }
  }
}

TEST_CASE("binary ops broadcast [3, 1, 5] with [4, 5], scalars and 0-d tensors", "[elementwise]") {
  struct ShapePair {
    Shape a, b, out;
  };
  const std::vector<ShapePair> pairs{
      {{3, 1, 5}, {4, 5}, {3, 4, 5}}, {{4, 5}, {3, 1, 5}, {3, 4, 5}},
      {{2, 1}, {1, 3}, {2, 3}},       {{7, 13}, {13}, {7, 13}},
      {{7, 1}, {7, 13}, {7, 13}},     {{5}, {}, {5}},
      {{}, {2, 3}, {2, 3}},           {{}, {}, {}},
      {{1}, {1, 1, 1}, {1, 1, 1}},    {{1}, {0}, {0}},
      {{2, 0, 3}, {3}, {2, 0, 3}},
  };
  std::uint64_t seed = 400;
  for (const BinaryCase& c : binary_cases()) {
    for (const ShapePair& p : pairs) {
      for (const DType dtype : {DType::f32, DType::f64}) {
        INFO(c.name << " " << shape_str(p.a) << " with " << shape_str(p.b) << " " << dtype_name(dtype));
        // Empty operands are made with zeros(): they have no values to draw.
        const Tensor a = shape_numel(p.a) == 0 ? zeros(p.a, TensorOptions{}.with_dtype(dtype))
                                               : random_tensor(p.a, ++seed, dtype, c.a_low, c.a_high);
        const Tensor b = shape_numel(p.b) == 0 ? zeros(p.b, TensorOptions{}.with_dtype(dtype))
                                               : random_tensor(p.b, ++seed, dtype, c.b_low, c.b_high);
        const Tensor y = c.op(a, b);
        CHECK(y.shape() == p.out);
        CHECK(y.dtype() == dtype);
        check_close(y, reference_binary(a, b, p.out, c.reference));
      }
    }
  }
}

TEST_CASE("binary ops on non-contiguous operands", "[elementwise]") {
  std::uint64_t seed = 500;
  for (const BinaryCase& c : binary_cases()) {
    for (const DType dtype : {DType::f32, DType::f16}) {
      INFO(c.name << " " << dtype_name(dtype));
      const double a_mid = (c.a_low + c.a_high) / 2, a_half = (c.a_high - c.a_low) / 2;
      const double b_mid = (c.b_low + c.b_high) / 2, b_half = (c.b_high - c.b_low) / 2;
      const auto in_a = [&](const Tensor& t) { return add(mul(t, a_half), a_mid); };
      const auto in_b = [&](const Tensor& t) { return add(mul(t, b_half), b_mid); };
      const Tensor transposed = in_a(random_tensor({13, 7}, ++seed, dtype)).transpose(0, 1);
      const Tensor sliced = in_b(random_tensor({7, 39}, ++seed, dtype)).slice(1, 2, 39, 3);
      REQUIRE(sliced.shape() == Shape{7, 13});
      const Tensor expanded = in_b(random_tensor({7, 1}, ++seed, dtype)).expand({7, 13});
      const Tensor contiguous = in_a(random_tensor({7, 13}, ++seed, dtype));
      check_close(c.op(transposed, sliced), reference_binary(transposed, sliced, {7, 13}, c.reference));
      check_close(c.op(contiguous, expanded), reference_binary(contiguous, expanded, {7, 13}, c.reference));
      check_close(c.op(transposed, expanded), reference_binary(transposed, expanded, {7, 13}, c.reference));
      // A 3-D permuted view against a broadcast row.
      const Tensor permuted = in_a(random_tensor({5, 3, 4}, ++seed, dtype)).permute({1, 2, 0});
      const Tensor row = in_b(random_tensor({5}, ++seed, dtype));
      check_close(c.op(permuted, row), reference_binary(permuted, row, {3, 4, 5}, c.reference));
    }
  }
}

TEST_CASE("integer add, sub, mul, maximum, minimum are exact and keep the dtype", "[elementwise]") {
  const Tensor a = from_vector<std::int32_t>({7, -7, 0, 100000, -3});
  const Tensor b = from_vector<std::int32_t>({2, 2, -5, 3, -3});
  CHECK(add(a, b).dtype() == DType::i32);
  check_equal(add(a, b), {9, -5, -5, 100003, -6});
  check_equal(sub(a, b), {5, -9, 5, 99997, 0});
  check_equal(mul(a, b), {14, -14, 0, 300000, 9});
  check_equal(maximum(a, b), {7, 2, 0, 100000, -3});
  check_equal(minimum(a, b), {2, -7, -5, 3, -3});
  // i64 keeps values beyond 2^53.
  const Tensor big = from_vector<std::int64_t>({(std::int64_t{1} << 60) + 1});
  const Tensor one = from_vector<std::int64_t>({1});
  CHECK(add(big, one).item<std::int64_t>() == (std::int64_t{1} << 60) + 2);
  // u8 arithmetic wraps modulo 256.
  const Tensor u = from_vector<std::uint8_t>({3, 250, 16});
  const Tensor v = from_vector<std::uint8_t>({5, 10, 16});
  CHECK(sub(u, v).dtype() == DType::u8);
  check_equal(sub(u, v), {254, 240, 0});
  check_equal(add(u, v), {8, 4, 32});
  check_equal(mul(u, v), {15, (250 * 10) % 256, 0});
}

TEST_CASE("signed integer results out of range wrap modulo 2^bits", "[elementwise]") {
  // As the CUDA kernels and PyTorch do; computed in signed arithmetic these would be undefined
  // behaviour, which the sanitizer build (scripts/test-sanitizers) reports.
  constexpr std::int32_t max32 = std::numeric_limits<std::int32_t>::max();
  constexpr std::int32_t min32 = std::numeric_limits<std::int32_t>::min();
  constexpr std::int64_t min64 = std::numeric_limits<std::int64_t>::min();
  const Tensor a = from_vector<std::int32_t>({max32, min32, 65536, min32});
  const Tensor b = from_vector<std::int32_t>({1, 1, 65536, -1});
  CHECK(add(a, b).to_vector<std::int32_t>() == std::vector<std::int32_t>{min32, min32 + 1, 131072, max32});
  CHECK(sub(a, b).to_vector<std::int32_t>() == std::vector<std::int32_t>{max32 - 1, max32, 0, min32 + 1});
  CHECK(mul(a, b).to_vector<std::int32_t>() == std::vector<std::int32_t>{max32, min32, 0, min32});
  CHECK(neg(from_vector<std::int64_t>({min64})).item<std::int64_t>() == min64);
  CHECK(abs(from_vector<std::int32_t>({min32})).item<std::int32_t>() == min32);
  // 3^21 = 10460353203 = 2 * 2^32 + 1870418611; (-2)^63 is in range though 2^64 (its last
  // square) is not; 2^64 wraps to 0.
  CHECK(pow(from_vector<std::int32_t>({3}), from_vector<std::int32_t>({21})).item<std::int32_t>() ==
        1870418611);
  CHECK(pow(from_vector<std::int64_t>({-2, 2}), from_vector<std::int64_t>({63, 64}))
            .to_vector<std::int64_t>() == std::vector<std::int64_t>{min64, 0});
}

TEST_CASE("integer binary ops broadcast and take non-contiguous operands", "[elementwise]") {
  // u8 results wrap modulo 256 (mul stays below 256 with operands under 16).
  struct IntCase {
    std::string name;
    std::function<Tensor(const Tensor&, const Tensor&)> op;
    Binary reference;
  };
  const std::vector<IntCase> cases{
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); },
       [](double x, double y) { return x + y; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); },
       [](double x, double y) { return x - y; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); },
       [](double x, double y) { return x * y; }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); },
       [](double x, double y) { return x > y ? x : y; }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); },
       [](double x, double y) { return x < y ? x : y; }},
  };
  std::uint64_t seed = 700;
  for (const IntCase& c : cases) {
    for (const DType dtype : {DType::i32, DType::i64, DType::u8}) {
      INFO(c.name << " " << dtype_name(dtype));
      const double low = dtype == DType::u8 ? 0 : -50, high = dtype == DType::u8 ? 16 : 50;
      const auto ints = [&](const Shape& shape) {
        return random_tensor(shape, ++seed, DType::f64, low, high).to(DType::i64).to(dtype);
      };
      const auto wrapped = [&](double x, double y) {
        const double v = c.reference(x, y);
        return dtype == DType::u8 ? std::fmod(std::fmod(v, 256) + 256, 256) : v;
      };
      const Tensor a = ints({3, 1, 5});
      const Tensor b = ints({4, 5});
      const Tensor y = c.op(a, b);
      CHECK(y.dtype() == dtype);
      CHECK(y.shape() == Shape{3, 4, 5});
      check_equal(y, reference_binary(a, b, {3, 4, 5}, wrapped));
      const Tensor transposed = ints({13, 7}).transpose(0, 1);
      const Tensor sliced = ints({7, 26}).slice(1, 0, 26, 2);
      check_equal(c.op(transposed, sliced), reference_binary(transposed, sliced, {7, 13}, wrapped));
      const Tensor scalar = ints({});
      check_equal(c.op(sliced, scalar), reference_binary(sliced, scalar, {7, 13}, wrapped));
    }
  }
}

TEST_CASE("integer div is true division with an f32 result", "[elementwise]") {
  const Tensor a = from_vector<std::int32_t>({7, -7, 1, 0, 6});
  const Tensor b = from_vector<std::int32_t>({2, 2, 0, 0, 3});
  const Tensor q = div(a, b);
  CHECK(q.dtype() == DType::f32);
  check_equal(q, {3.5, -3.5, kInf, kNaN, 2.0});
  const Tensor u = div(from_vector<std::uint8_t>({1}), from_vector<std::uint8_t>({4}));
  CHECK(u.dtype() == DType::f32);
  check_equal(u, {0.25});
  const Tensor l = div(from_vector<std::int64_t>({10}), from_vector<std::int64_t>({4}));
  CHECK(l.dtype() == DType::f32);
  check_equal(l, {2.5});
  // Integer divided by a float keeps the float dtype.
  const Tensor mixed = div(from_vector<std::int32_t>({1}), from_vector<double>({8.0}));
  CHECK(mixed.dtype() == DType::f64);
  check_equal(mixed, {0.125});
}

TEST_CASE("integer pow is exact repeated multiplication", "[elementwise]") {
  const Tensor base = from_vector<std::int64_t>({3, 2, -2, 0, 5, 1, -1, -1, 7, 2});
  const Tensor exponent = from_vector<std::int64_t>({4, 10, 3, 0, 0, -5, -3, -2, 1, 62});
  const Tensor p = pow(base, exponent);
  CHECK(p.dtype() == DType::i64);
  // 1^-5 = 1, (-1)^-3 = -1, (-1)^-2 = 1 are the only negative powers with integer values.
  CHECK(p.to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{81, 1024, -8, 1, 1, 1, -1, 1, 7, std::int64_t{1} << 62});
  const Tensor i = pow(from_vector<std::int32_t>({3, -3}), from_vector<std::int32_t>({19, 3}));
  CHECK(i.dtype() == DType::i32);
  check_equal(i, {1162261467, -27});
  const Tensor u = pow(from_vector<std::uint8_t>({3, 2}), from_vector<std::uint8_t>({5, 7}));
  CHECK(u.dtype() == DType::u8);
  check_equal(u, {243, 128});
  // Scalar exponents.
  check_equal(pow(from_vector<std::int32_t>({2, 3, -4}), 2), {4, 9, 16});
  CHECK(pow(from_vector<std::int32_t>({2}), 2).dtype() == DType::i32);
}

TEST_CASE("floating pow at special points", "[elementwise]") {
  const Tensor a = from_vector<double>({2.0, -2.0, 0.0, 4.0, -8.0, 1.0, kNaN});
  const Tensor b = from_vector<double>({-1.0, 3.0, 0.0, 0.5, 1.0 / 3, kNaN, 0.0});
  // std::pow: (-8)^(1/3) is NaN (negative base, non-integer exponent); 1^NaN = 1; NaN^0 = 1.
  check_equal(pow(a, b), {0.5, -8.0, 1.0, 2.0, kNaN, 1.0, 1.0});
  check_equal(pow(from_vector<float>({4.0f, 9.0f}), 0.5), {2.0, 3.0});
  check_equal(pow(from_vector<float>({2.0f}), -2), {0.25});
}

TEST_CASE("maximum and minimum propagate NaN from either side", "[elementwise]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor a = from_vector<double>({kNaN, 1.0, kNaN, -kInf, 3.0}).to(dtype);
    const Tensor b = from_vector<double>({1.0, kNaN, kNaN, 2.0, kInf}).to(dtype);
    check_equal(maximum(a, b), {kNaN, kNaN, kNaN, 2.0, kInf});
    check_equal(minimum(a, b), {kNaN, kNaN, kNaN, -kInf, 3.0});
  }
  // On bool they are logical or / and.
  const Tensor p = from_vector<bool>({true, true, false, false});
  const Tensor q = from_vector<bool>({true, false, true, false});
  CHECK(maximum(p, q).dtype() == DType::boolean);
  check_equal(maximum(p, q), {1, 1, 1, 0});
  check_equal(minimum(p, q), {1, 0, 0, 0});
}

TEST_CASE("relu_backward passes the gradient where the output is positive, as where(gt(y, 0), g, 0)",
          "[elementwise]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor g = from_vector<double>({1.5, -2.0, 3.0, 4.0, kNaN, 6.0, 7.0}).to(dtype);
    const Tensor y = from_vector<double>({2.0, 0.5, 0.0, -0.0, 1.0, kNaN, kInf}).to(dtype);
    check_equal(relu_backward(g, y), {1.5, -2.0, 0.0, 0.0, kNaN, 0.0, 7.0});
    // Broadcast and strided operands, against the composition it replaces.
    const Tensor gs = test::random_tensor({6, 5}, 3, dtype).transpose(0, 1);
    const Tensor ys = test::random_tensor({5, 1}, 4, dtype);
    check_equal(relu_backward(gs, ys), values(where(gt(ys, 0), gs, 0)));
  }
  const Tensor gi = from_vector<std::int32_t>({5, -6, 7});
  check_equal(relu_backward(gi, from_vector<std::int32_t>({1, 2, 0})), {5, -6, 0});
  CHECK_THROWS_ERROR(relu_backward(from_vector<bool>({true}), from_vector<bool>({true})),
                     "relu_backward: not defined for bool tensors");
}

TEST_CASE("comparisons give bool and treat NaN as unordered", "[elementwise]") {
  std::uint64_t seed = 600;
  struct CompareCase {
    std::string name;
    std::function<Tensor(const Tensor&, const Tensor&)> op;
    std::function<bool(double, double)> reference;
  };
  const std::vector<CompareCase> cases{
      {"eq", [](const Tensor& a, const Tensor& b) { return eq(a, b); },
       [](double x, double y) { return x == y; }},
      {"ne", [](const Tensor& a, const Tensor& b) { return ne(a, b); },
       [](double x, double y) { return x != y; }},
      {"lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); },
       [](double x, double y) { return x < y; }},
      {"le", [](const Tensor& a, const Tensor& b) { return le(a, b); },
       [](double x, double y) { return x <= y; }},
      {"gt", [](const Tensor& a, const Tensor& b) { return gt(a, b); },
       [](double x, double y) { return x > y; }},
      {"ge", [](const Tensor& a, const Tensor& b) { return ge(a, b); },
       [](double x, double y) { return x >= y; }},
  };
  for (const CompareCase& c : cases) {
    for (const DType dtype :
         {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
      INFO(c.name << " " << dtype_name(dtype));
      // Truncating uniform [0, 4) gives 0..3, exact in every dtype, so ties occur.
      const Tensor a = random_tensor({3, 1, 5}, ++seed, DType::f64, 0, 4).to(DType::i64).to(dtype);
      const Tensor b = random_tensor({4, 5}, ++seed, DType::f64, 0, 4).to(DType::i64).to(dtype);
      const Tensor y = c.op(a, b);
      CHECK(y.dtype() == DType::boolean);
      CHECK(y.shape() == Shape{3, 4, 5});
      check_equal(y, reference_binary(a, b, {3, 4, 5},
                                      [&](double x, double z) { return c.reference(x, z) ? 1.0 : 0.0; }));
    }
    const Tensor n = from_vector<float>({NAN, NAN, 1.0f});
    const Tensor m = from_vector<float>({NAN, 1.0f, NAN});
    INFO(c.name << " NaN");
    const double expect = c.name == "ne" ? 1.0 : 0.0;
    check_equal(c.op(n, m), {expect, expect, expect});
  }
  // Mixed dtypes compare after promotion: i32 3 equals f32 3.0 and is less than 3.5.
  const Tensor i = from_vector<std::int32_t>({3, 4});
  const Tensor f = from_vector<float>({3.0f, 3.5f});
  check_equal(eq(i, f), {1, 0});
  check_equal(gt(i, f), {0, 1});
  // bool compares as 0/1.
  check_equal(eq(from_vector<bool>({true, false}), from_vector<bool>({true, true})), {1, 0});
  // Empty inputs give an empty bool tensor.
  const Tensor e = lt(empty({0, 3}), empty({3}));
  CHECK(e.shape() == Shape{0, 3});
  CHECK(e.dtype() == DType::boolean);
}

TEST_CASE("comparisons with a Scalar operand", "[elementwise]") {
  const Tensor i = from_vector<std::int32_t>({1, 2, 3});
  // A floating Scalar with an integer tensor compares in f32: 2 < 2.5 holds.
  check_equal(lt(i, 2.5), {1, 1, 0});
  check_equal(le(i, 2), {1, 1, 0});
  check_equal(gt(i, 2), {0, 0, 1});
  check_equal(ge(i, 2.5), {0, 0, 1});
  check_equal(eq(i, 2), {0, 1, 0});
  check_equal(ne(i, 2), {1, 0, 1});
  CHECK(eq(i, 2).dtype() == DType::boolean);
  const Tensor f = from_vector<float>({0.5f, NAN, -1.0f});
  check_equal(eq(f, 0.5), {1, 0, 0});
  check_equal(ne(f, 0.5), {0, 1, 1});
  check_equal(lt(f, 0), {0, 0, 1});
}

// --- Scalar operands and promotion -----------------------------------------------------------

TEST_CASE("Scalar operand takes the tensor's dtype unless floating with a non-floating tensor",
          "[elementwise]") {
  SECTION("integer Scalar keeps the tensor's dtype") {
    const Tensor i = add(from_vector<std::int32_t>({1, -2}), 3);
    CHECK(i.dtype() == DType::i32);
    check_equal(i, {4, 1});
    const Tensor h = mul(from_vector<float>({1.5f, -2.0f}).to(DType::f16), 3);
    CHECK(h.dtype() == DType::f16);
    check_equal(h, {4.5, -6.0});
    const Tensor b = add(from_vector<float>({1.0f}).to(DType::bf16), 2);
    CHECK(b.dtype() == DType::bf16);
    check_equal(b, {3.0});
    const Tensor l = add(from_vector<std::int64_t>({std::int64_t{1} << 40}), std::int64_t{1} << 41);
    CHECK(l.dtype() == DType::i64);
    CHECK(l.item<std::int64_t>() == (std::int64_t{3} << 40));
  }
  SECTION("floating Scalar with an integer tensor gives f32") {
    const Tensor i = mul(from_vector<std::int32_t>({3, -1}), 2.5);
    CHECK(i.dtype() == DType::f32);
    check_equal(i, {7.5, -2.5});
    const Tensor u = add(from_vector<std::uint8_t>({255}), 1.5);
    CHECK(u.dtype() == DType::f32);
    check_equal(u, {256.5});
    const Tensor p = pow(from_vector<std::int32_t>({4, 9}), 0.5);
    CHECK(p.dtype() == DType::f32);
    check_equal(p, {2, 3});
    const Tensor d = div(from_vector<std::int32_t>({7}), 2);
    CHECK(d.dtype() == DType::f32);
    check_equal(d, {3.5});
  }
  SECTION("floating Scalar with a floating tensor keeps the tensor's dtype and precision") {
    // In f64 the Scalar 0.1 must stay a double: an f32 0.1 would be off by 1.5e-9.
    const Tensor d = add(from_vector<double>({1.0}), 0.1);
    CHECK(d.dtype() == DType::f64);
    check_close(d, {1.1}, Tolerance{1e-15, 0});
    const Tensor h = mul(from_vector<float>({2.0f}).to(DType::bf16), 0.25);
    CHECK(h.dtype() == DType::bf16);
    check_equal(h, {0.5});
  }
  SECTION("bool tensor: integer Scalar gives i64, floating Scalar gives f32, bool Scalar is an error") {
    const Tensor b = from_vector<bool>({true, false});
    const Tensor i = add(b, 2);
    CHECK(i.dtype() == DType::i64);
    check_equal(i, {3, 2});
    const Tensor f = mul(b, 0.5);
    CHECK(f.dtype() == DType::f32);
    check_equal(f, {0.5, 0});
    CHECK_THROWS_ERROR(add(b, true), "add: not defined for bool tensors");
  }
  SECTION("sub and div with a Scalar keep the operand order") {
    check_equal(sub(from_vector<float>({1, 5}), 2.0), {-1, 3});
    check_equal(div(from_vector<float>({1, 5}), 2.0), {0.5, 2.5});
    check_equal(sub(from_vector<std::int32_t>({1, 5}), 2), {-1, 3});
  }
}

TEST_CASE("mixed-dtype inputs promote before computing", "[elementwise]") {
  struct PromotionCase {
    Tensor a, b;
    DType expected;
    std::vector<double> sum;
  };
  const std::vector<PromotionCase> cases{
      // i32 + f16 -> f16
      {from_vector<std::int32_t>({3, -100}),
       from_vector<float>({0.5f, 0.25f}).to(DType::f16),
       DType::f16,
       {3.5, -99.75}},
      // u8 + i64 -> i64: 200 + 100 = 300 does not wrap at 256.
      {from_vector<std::uint8_t>({200, 255}),
       from_vector<std::int64_t>({100, std::int64_t{1} << 40}),
       DType::i64,
       {300, 255 + 1099511627776.0}},
      // bf16 + f16 -> f32: 1/3 in bf16 and 1/3 in f16 added in f32.
      {from_vector<float>({1.0f / 3}).to(DType::bf16),
       from_vector<float>({1.0f / 3}).to(DType::f16),
       DType::f32,
       {0.333984375 + 0.333251953125}},
      // u8 + i32 -> i32
      {from_vector<std::uint8_t>({255}), from_vector<std::int32_t>({-300}), DType::i32, {-45}},
      // bool + u8 -> u8
      {from_vector<bool>({true, false}), from_vector<std::uint8_t>({7, 7}), DType::u8, {8, 7}},
      // i64 + f32 -> f32
      {from_vector<std::int64_t>({5}), from_vector<float>({0.5f}), DType::f32, {5.5}},
      // f32 + f64 -> f64: the f32 value is widened exactly.
      {from_vector<float>({0.1f}), from_vector<double>({1.0}), DType::f64, {1.0 + static_cast<double>(0.1f)}},
      // bool + bf16 -> bf16
      {from_vector<bool>({true}), from_vector<float>({0.5f}).to(DType::bf16), DType::bf16, {1.5}},
  };
  for (const PromotionCase& c : cases) {
    INFO(dtype_name(c.a.dtype()) << " + " << dtype_name(c.b.dtype()));
    const Tensor ab = add(c.a, c.b);
    const Tensor ba = add(c.b, c.a);
    CHECK(ab.dtype() == c.expected);
    CHECK(ba.dtype() == c.expected);
    check_close(ab, c.sum, Tolerance{0, 0});
    check_close(ba, c.sum, Tolerance{0, 0});
  }
  // Promotion combines with broadcasting: [3, 1] i32 * [4] f64 -> [3, 4] f64.
  const Tensor a = from_vector<std::int32_t>({1, 2, 3}, {3, 1});
  const Tensor b = from_vector<double>({0.5, 1.5, -1, 0});
  const Tensor y = mul(a, b);
  CHECK(y.dtype() == DType::f64);
  CHECK(y.shape() == Shape{3, 4});
  check_equal(y, {0.5, 1.5, -1, 0, 1, 3, -2, 0, 1.5, 4.5, -3, 0});
  // Comparisons promote too: u8 200 > i32 -1 (in u8, -1 would wrap to 255 and compare false).
  check_equal(gt(from_vector<std::uint8_t>({200}), from_vector<std::int32_t>({-1})), {1});
}

// --- where -----------------------------------------------------------------------------------

TEST_CASE("where selects elementwise with all three operands broadcast", "[elementwise]") {
  const Tensor condition = random_tensor({3, 1, 5}, 11, DType::f32).to(DType::f64);
  const Tensor mask = gt(condition, 0.0);
  const Tensor a = random_tensor({4, 5}, 12, DType::f32);
  const Tensor b = random_tensor({3, 4, 1}, 13, DType::f32);
  const Tensor y = where(mask, a, b);
  CHECK(y.shape() == Shape{3, 4, 5});
  CHECK(y.dtype() == DType::f32);
  const Shape out{3, 4, 5};
  const std::vector<double> m = broadcast_values(values(mask), mask.shape(), out);
  const std::vector<double> x = broadcast_values(values(a), a.shape(), out);
  const std::vector<double> z = broadcast_values(values(b), b.shape(), out);
  std::vector<double> expected;
  for (std::size_t i = 0; i < m.size(); ++i) expected.push_back(m[i] != 0 ? x[i] : z[i]);
  check_equal(y, expected);
  // The mask must have both values somewhere, or the test would not tell a from b.
  const std::vector<double> mv = values(mask);
  CHECK(std::count(mv.begin(), mv.end(), 1.0) > 0);
  CHECK(std::count(mv.begin(), mv.end(), 0.0) > 0);
}

TEST_CASE("where promotes a and b, accepts a Scalar, keeps NaN, handles views and empties", "[elementwise]") {
  const Tensor mask = from_vector<bool>({true, false, true});
  const Tensor y = where(mask, from_vector<float>({0.5f, 0.5f, NAN}), from_vector<std::int32_t>({7, 8, 9}));
  CHECK(y.dtype() == DType::f32);
  check_equal(y, {0.5, 8, kNaN});
  const Tensor s = where(mask, from_vector<double>({1, 2, 3}), -1.5);
  CHECK(s.dtype() == DType::f64);
  check_equal(s, {1, -1.5, 3});
  const Tensor si = where(mask, from_vector<std::int32_t>({1, 2, 3}), 0);
  CHECK(si.dtype() == DType::i32);
  check_equal(si, {1, 0, 3});
  // A transposed mask and a sliced operand.
  const Tensor grid = from_vector<bool>({true, false, false, true, true, false}, {2, 3}).transpose(0, 1);
  const Tensor data = arange(12).reshape({3, 4}).slice(1, 0, 4, 2);  // [[0, 2], [4, 6], [8, 10]]
  check_equal(where(grid, data, neg(data)), {0, 2, -4, 6, -8, -10});
  // Empty.
  CHECK(where(empty({0}, dtype(DType::boolean)), empty({0}), empty({0})).shape() == Shape{0});
  // 0-d condition.
  check_equal(where(scalar_tensor(false, dtype(DType::boolean)), from_vector<float>({1, 2}), 9.0), {9, 9});
}

// --- operators -------------------------------------------------------------------------------

TEST_CASE("operators are the named ops", "[elementwise]") {
  const Tensor a = random_tensor({7, 13}, 21, DType::f64);
  const Tensor b = random_tensor({13}, 22, DType::f64, 0.5, 2);
  const Shape s{7, 13};
  check_close(-a, map_values(values(a), [](double x) { return -x; }));
  check_close(a + b, reference_binary(a, b, s, [](double x, double y) { return x + y; }));
  check_close(a - b, reference_binary(a, b, s, [](double x, double y) { return x - y; }));
  check_close(a * b, reference_binary(a, b, s, [](double x, double y) { return x * y; }));
  check_close(a / b, reference_binary(a, b, s, [](double x, double y) { return x / y; }));
  check_close(a + 2.5, map_values(values(a), [](double x) { return x + 2.5; }));
  check_close(a - 2.5, map_values(values(a), [](double x) { return x - 2.5; }));
  check_close(a * 2.5, map_values(values(a), [](double x) { return x * 2.5; }));
  check_close(a / 2.5, map_values(values(a), [](double x) { return x / 2.5; }));
  const Tensor i = from_vector<std::int32_t>({6, -3});
  CHECK((i + 1).dtype() == DType::i32);
  check_equal(i + 1, {7, -2});
  check_equal(i - 1, {5, -4});
  check_equal(i * 2, {12, -6});
  check_equal(i / 4, {1.5, -0.75});
  check_equal(-i, {-6, 3});
}

// --- errors ----------------------------------------------------------------------------------

TEST_CASE("elementwise errors name the op and the offending values", "[elementwise]") {
  SECTION("broadcast mismatch") {
    CHECK_THROWS_ERROR(add(empty({2, 3}), empty({4})),
                       "add: shapes [2, 3] and [4] cannot be broadcast (dimension 1: 3 vs 4)");
    CHECK_THROWS_ERROR(mul(empty({2, 3}), empty({3, 2})),
                       "mul: shapes [2, 3] and [3, 2] cannot be broadcast (dimension 0: 2 vs 3)");
    CHECK_THROWS_ERROR(lt(empty({0}), empty({2})),
                       "lt: shapes [0] and [2] cannot be broadcast (dimension 0: 0 vs 2)");
    CHECK_THROWS_ERROR(empty({5}) - empty({4}), "sub: shapes [5] and [4] cannot be broadcast");
  }
  SECTION("arithmetic on bool") {
    const Tensor b = from_vector<bool>({true, false});
    const char* hint = "not defined for bool tensors (cast to an integer or float dtype first)";
    CHECK_THROWS_ERROR(add(b, b), std::string("add: ") + hint);
    CHECK_THROWS_ERROR(sub(b, b), std::string("sub: ") + hint);
    CHECK_THROWS_ERROR(mul(b, b), std::string("mul: ") + hint);
    CHECK_THROWS_ERROR(div(b, b), std::string("div: ") + hint);
    CHECK_THROWS_ERROR(pow(b, b), std::string("pow: ") + hint);
    CHECK_THROWS_ERROR(neg(b), "neg: not defined for bool tensors");
    CHECK_THROWS_ERROR(abs(b), "abs: not defined for bool tensors");
    CHECK_THROWS_ERROR(relu(b), "relu: not defined for bool tensors");
  }
  SECTION("where with a non-bool condition or mismatched shapes") {
    CHECK_THROWS_ERROR(where(from_vector<float>({1, 0}), empty({2}), empty({2})),
                       "where: condition must be bool, got f32");
    CHECK_THROWS_ERROR(where(from_vector<std::int32_t>({1}), empty({1}), 0.0),
                       "where: condition must be bool, got i32");
    CHECK_THROWS_ERROR(where(from_vector<bool>({true, false, true}), empty({2}), empty({2})),
                       "where: shapes [3] and [2] cannot be broadcast (dimension 0: 3 vs 2)");
  }
  SECTION("clamp with neither bound") {
    CHECK_THROWS_ERROR(clamp(empty({2}), std::nullopt, std::nullopt),
                       "clamp: at least one of min and max must be given");
  }
  SECTION("undefined tensors") {
    const Tensor undefined;
    const Tensor x = empty({2});
    CHECK_THROWS_ERROR(add(undefined, x), "add: first tensor is undefined");
    CHECK_THROWS_ERROR(mul(x, undefined), "mul: second tensor is undefined");
    CHECK_THROWS_ERROR(add(undefined, 1), "add: input tensor is undefined");
    CHECK_THROWS_ERROR(eq(undefined, x), "eq: first tensor is undefined");
    CHECK_THROWS_ERROR(exp(undefined), "exp: input tensor is undefined");
    CHECK_THROWS_ERROR(neg(undefined), "neg: input tensor is undefined");
    CHECK_THROWS_ERROR(gelu(undefined), "gelu: input tensor is undefined");
    CHECK_THROWS_ERROR(gelu(undefined, GeluApproximation::tanh), "gelu(tanh): input tensor is undefined");
    CHECK_THROWS_ERROR(isfinite(undefined), "isfinite: input tensor is undefined");
    CHECK_THROWS_ERROR(clamp(undefined, 0, 1), "clamp: input tensor is undefined");
    CHECK_THROWS_ERROR(cast(undefined, DType::f32), "cast: input tensor is undefined");
    CHECK_THROWS_ERROR(where(undefined, x, x), "where: condition tensor is undefined");
    CHECK_THROWS_ERROR(where(from_vector<bool>({true, false}), undefined, x),
                       "where: first tensor is undefined");
    CHECK_THROWS_ERROR(where(from_vector<bool>({true, false}), x, undefined),
                       "where: second tensor is undefined");
  }
}

}  // namespace shardlab::test

namespace shardlab::test {

TEST_CASE("in-place arithmetic writes into self, broadcasting and casting other", "[elementwise][inplace]") {
  Tensor x = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  const void* before = x.raw_data();
  add_(x, from_vector<double>({10, 20, 30}));
  CHECK(x.raw_data() == before);
  check_equal(x, {11, 22, 33, 14, 25, 36});
  mul_(x, 2);
  check_equal(x, {22, 44, 66, 28, 50, 72});
  sub_(x.select(0, 1), 8);  // a strided view of self
  check_equal(x, {22, 44, 66, 20, 42, 64});
  div_(x, from_vector<float>({2, 4}, {2, 1}));
  check_equal(x, {11, 22, 33, 5, 10.5, 16});
  Tensor counts = zeros({3}, dtype(DType::i64));
  add_(counts, from_vector<std::int64_t>({1, 2, 3}));
  add_(counts, 1.9);  // cast to self's dtype: 1.9 -> 1
  check_equal(counts, {2, 3, 4});
  Tensor t = zeros({2, 2});
  add_(t.transpose(0, 1), from_vector<float>({1, 2, 3, 4}, {2, 2}));
  check_equal(t, {1, 3, 2, 4});
  CHECK_THROWS_ERROR(add_(zeros({2}), zeros({3})), "expand: cannot expand shape [3] to [2]");
  CHECK_THROWS_ERROR(div_(counts, 2), "div_: true division cannot be written into i64");
  CHECK_THROWS_ERROR(add_(zeros({2}, dtype(DType::boolean)), 1), "add_: not defined for bool tensors");
  CHECK_THROWS_ERROR(add_(Tensor(), zeros({1})), "add: self tensor is undefined");
}

}  // namespace shardlab::test

namespace shardlab::test {

TEST_CASE("long contiguous rows are cut into pieces across threads without a gap", "[elementwise][threads]") {
  const int original = num_threads();
  set_num_threads(3);
  const std::int64_t n = 100003;  // several 16384-element pieces plus a ragged one
  const Tensor x = random_tensor({n}, 8, DType::f32, -1, 1);
  const std::vector<double> xv = values(x), rv = values(relu(x)), sv = values(add(x, x));
  for (std::int64_t i = 0; i < n; ++i) {
    REQUIRE(rv[i] == (xv[i] < 0 ? 0.0 : xv[i]));
    REQUIRE(sv[i] == static_cast<double>(static_cast<float>(xv[i]) + static_cast<float>(xv[i])));
  }
  set_num_threads(original);
}

}  // namespace shardlab::test
