// tests/autograd/test_gradcheck_elementwise.cpp: elementwise and reduction backwards, and gradcheck itself.
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "autograd/record.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tests/check.h"

using namespace shardlab;
using test::check_close;
using test::check_equal;
using test::random_tensor;
using test::values;

namespace {

using UnaryFn = std::function<Variable(const Variable&)>;
using BinaryFn = std::function<Variable(const Variable&, const Variable&)>;

// gradcheck with the torch.autograd.gradcheck defaults (eps 1e-6, atol 1e-5, rtol 1e-3); on a
// failure the report names the first wrong Jacobian entries.
void check_gradients(const GradcheckFn& fn, const std::vector<Variable>& inputs) {
  const GradcheckResult result = gradcheck(fn, inputs);
  INFO(result.report);
  CHECK(result.ok);
}

// t's values with every value closer than `margin` to a kink moved `margin` away from it, so
// that the +-eps of finite differences never straddles a point where the function has no
// derivative (kinks must lie more than 2 * margin apart).
Tensor away_from(const Tensor& t, const std::vector<double>& kinks, double margin) {
  std::vector<double> v = values(t);
  for (double& x : v) {
    for (const double k : kinks) {
      if (std::abs(x - k) < margin) x = x < k ? k - margin : k + margin;
    }
  }
  return from_vector<double>(v, t.shape());
}

// A leaf of f64 values in [low, high) (kinks avoided) with a contiguous tensor.
Variable leaf(const Shape& shape, std::uint64_t seed, double low = -1.0, double high = 1.0,
              const std::vector<double>& kinks = {}, double margin = 0.05) {
  return Variable(away_from(random_tensor(shape, seed, DType::f64, low, high), kinks, margin), true);
}

// The same, but the leaf's tensor is a non-contiguous view: the transpose of a contiguous
// tensor whose last two dims are swapped.
Variable strided_leaf(const Shape& shape, std::uint64_t seed, double low = -1.0, double high = 1.0,
                      const std::vector<double>& kinks = {}, double margin = 0.05) {
  Shape swapped = shape;
  std::swap(swapped[swapped.size() - 1], swapped[swapped.size() - 2]);
  const Tensor t =
      away_from(random_tensor(swapped, seed, DType::f64, low, high), kinks, margin).transpose(-1, -2);
  REQUIRE_FALSE(t.is_contiguous());
  return Variable(t, true);
}

// A leaf holding exactly these values.
Variable exact_leaf(const std::vector<double>& v, const Shape& shape) {
  return Variable(from_vector<double>(v, shape), true);
}

struct UnaryCase {
  std::string name;
  UnaryFn fn;
  double low = -1.0, high = 1.0;
  std::vector<double> kinks;
};

// Each case on a non-contiguous [3, 7], a contiguous [1, 13] and a 0-d input.
void check_unary_cases(const std::vector<UnaryCase>& cases) {
  std::uint64_t seed = 100;
  for (const UnaryCase& c : cases) {
    INFO(c.name);
    const auto fn = [&c](const std::vector<Variable>& x) { return c.fn(x[0]); };
    check_gradients(fn, {strided_leaf({3, 7}, ++seed, c.low, c.high, c.kinks)});
    check_gradients(fn, {leaf({1, 13}, ++seed, c.low, c.high, c.kinks)});
    check_gradients(fn, {leaf({}, ++seed, c.low, c.high, c.kinks)});
  }
}

struct BinaryCase {
  std::string name;
  BinaryFn fn;
};

// Operand pairs in [-1.5, 1.5), b at least 0.3 from 0 (it divides). Shapes cover broadcasting
// both ways, a 0-d operand on either side, and non-contiguous operands of equal shape.
void check_binary_cases(const std::vector<BinaryCase>& cases) {
  std::uint64_t seed = 200;
  for (const BinaryCase& c : cases) {
    INFO(c.name);
    const auto fn = [&c](const std::vector<Variable>& x) { return c.fn(x[0], x[1]); };
    const auto a = [&](const Shape& s) { return leaf(s, ++seed, -1.5, 1.5); };
    const auto b = [&](const Shape& s) { return leaf(s, ++seed, -1.5, 1.5, {0.0}, 0.3); };
    check_gradients(fn, {a({3, 1, 4}), b({5, 4})});  // -> [3, 5, 4]
    check_gradients(fn, {a({5, 4}), b({3, 1, 4})});
    check_gradients(fn, {a({2, 3}), b({})});
    check_gradients(fn, {a({}), b({7})});
    check_gradients(fn, {a({}), b({})});
    const Variable sa = strided_leaf({3, 4}, ++seed, -1.5, 1.5);
    const Variable sb = strided_leaf({3, 4}, ++seed, -1.5, 1.5, {0.0}, 0.3);
    check_gradients(fn, {sa, sb});
  }
}

// Reduced dims and keepdim: one dim, several, negative, all (implicitly and by name).
struct Reduction {
  Dims dims;
  bool keepdim;
};
const std::vector<Reduction> reductions = {
    {{1}, false},     {{1}, true}, {{0, 2}, false}, {{2, 0}, true},     {{-1}, false},
    {{-3, -2}, true}, {{}, false}, {{}, true},      {{0, 1, 2}, false},
};

}  // namespace

// --- unary -----------------------------------------------------------------------------------

TEST_CASE("gradcheck: neg, abs, exp, log, sqrt, rsqrt", "[gradcheck][elementwise]") {
  check_unary_cases({
      {"neg", [](const Variable& x) { return neg(x); }},
      {"abs", [](const Variable& x) { return abs(x); }, -1.0, 1.0, {0.0}},
      {"exp", [](const Variable& x) { return exp(x); }, -2.0, 2.0},
      {"log", [](const Variable& x) { return log(x); }, 0.2, 3.0},
      {"sqrt", [](const Variable& x) { return sqrt(x); }, 0.2, 3.0},
      {"rsqrt", [](const Variable& x) { return rsqrt(x); }, 0.2, 3.0},
  });
}

TEST_CASE("gradcheck: tanh, sigmoid, relu, silu, gelu (exact and tanh)", "[gradcheck][elementwise]") {
  check_unary_cases({
      {"tanh", [](const Variable& x) { return tanh(x); }, -2.0, 2.0},
      {"sigmoid", [](const Variable& x) { return sigmoid(x); }, -4.0, 4.0},
      {"relu", [](const Variable& x) { return relu(x); }, -1.0, 1.0, {0.0}},
      {"silu", [](const Variable& x) { return silu(x); }, -4.0, 4.0},
      {"gelu", [](const Variable& x) { return gelu(x); }, -4.0, 4.0},
      {"gelu tanh", [](const Variable& x) { return gelu(x, GeluApproximation::tanh); }, -4.0, 4.0},
  });
}

TEST_CASE("gradcheck: clamp with min only, max only and both", "[gradcheck][elementwise]") {
  check_unary_cases({
      {"clamp min", [](const Variable& x) { return clamp(x, -0.3, std::nullopt); }, -1.0, 1.0, {-0.3}},
      {"clamp max", [](const Variable& x) { return clamp(x, std::nullopt, 0.4); }, -1.0, 1.0, {0.4}},
      {"clamp both", [](const Variable& x) { return clamp(x, -0.3, 0.4); }, -1.0, 1.0, {-0.3, 0.4}},
  });
}

TEST_CASE("gradcheck: pow with a scalar exponent, integer and not", "[gradcheck][elementwise]") {
  check_unary_cases({
      {"pow 3", [](const Variable& x) { return pow(x, 3); }, -1.5, 1.5},
      {"pow 2", [](const Variable& x) { return pow(x, 2.0); }, -1.5, 1.5},
      {"pow 1", [](const Variable& x) { return pow(x, 1); }, -1.5, 1.5},
      {"pow 2.5", [](const Variable& x) { return pow(x, 2.5); }, 0.2, 2.0},
      {"pow 0.5", [](const Variable& x) { return pow(x, 0.5); }, 0.2, 2.0},
      {"pow -1.5", [](const Variable& x) { return pow(x, -1.5); }, 0.2, 2.0},
      {"pow 0", [](const Variable& x) { return pow(x, 0.0); }, 0.2, 2.0},
  });
}

TEST_CASE("gradcheck: a variable with a scalar operand", "[gradcheck][elementwise]") {
  check_unary_cases({
      {"x + 0.5", [](const Variable& x) { return add(x, 0.5); }},
      {"x - 2", [](const Variable& x) { return sub(x, 2); }},
      {"x * -3", [](const Variable& x) { return mul(x, -3.0); }},
      {"x / 4", [](const Variable& x) { return div(x, 4.0); }},
      {"x / 0.3", [](const Variable& x) { return x / 0.3; }},
      {"-x * 1.5 + 0.25 - 1", [](const Variable& x) { return -x * 1.5 + 0.25 - 1; }},
  });
}

TEST_CASE("kinks: abs, relu and clamp at their kinks get the documented gradient",
          "[gradcheck][elementwise]") {
  // Finite differences are meaningless here; the convention is PyTorch's: sign(0) = 0, relu'(0) = 0,
  // clamp passes the gradient where min <= x <= max (bounds included).
  const Tensor g = from_vector<double>({1, 2, 3, 4, 5});
  const Variable x = exact_leaf({-0.5, 0.0, 0.25, -0.0, 2.0}, {5});
  abs(x).backward(g);
  check_equal(x.grad(), {-1, 0, 3, 0, 5});
  x.zero_grad();
  relu(x).backward(g);
  check_equal(x.grad(), {0, 0, 3, 0, 5});

  const Variable c = exact_leaf({-0.3, -0.5, 0.4, 0.5, 0.0}, {5});
  clamp(c, -0.3, 0.4).backward(g);
  check_equal(c.grad(), {1, 0, 3, 0, 5});
  c.zero_grad();
  clamp(c, -0.3, std::nullopt).backward(g);
  check_equal(c.grad(), {1, 0, 3, 4, 5});
  c.zero_grad();
  clamp(c, std::nullopt, 0.4).backward(g);
  check_equal(c.grad(), {1, 2, 3, 0, 5});
}

TEST_CASE("pow: x^0 has gradient 0 everywhere, also at 0", "[gradcheck][elementwise]") {
  // x^0 = 1 for every x (0^0 = 1, as in PyTorch): the derivative is 0, not 0 * 0^-1 = NaN.
  const Variable x = exact_leaf({0.0, -2.0, 3.0}, {3});
  const Variable y = pow(x, 0);
  check_equal(y.data(), {1, 1, 1});
  y.backward(from_vector<double>({1, 1, 1}));
  check_equal(x.grad(), {0, 0, 0});

  // The same for a tensor exponent: where it is 0 the base gets no gradient (the exponent's
  // gradient needs base > 0, so the exponent is a constant here).
  const Variable base = exact_leaf({0.0, 0.0, 2.0, 0.5}, {4});
  const Variable exponent = constant(from_vector<double>({0.0, 2.0, 0.0, 3.0}));
  pow(base, exponent).backward(from_vector<double>({1, 1, 1, 2}));
  check_equal(base.grad(), {0, 0, 0, 2 * 3 * 0.25});  // 2 * 0^1 = 0 at the second
}

// --- binary ----------------------------------------------------------------------------------

TEST_CASE("gradcheck: add, sub, mul, div with broadcasting and 0-d operands", "[gradcheck][elementwise]") {
  check_binary_cases({
      {"add", [](const Variable& a, const Variable& b) { return add(a, b); }},
      {"sub", [](const Variable& a, const Variable& b) { return sub(a, b); }},
      {"mul", [](const Variable& a, const Variable& b) { return mul(a, b); }},
      {"div", [](const Variable& a, const Variable& b) { return div(a, b); }},
  });
}

TEST_CASE("gradcheck: maximum and minimum away from ties", "[gradcheck][elementwise]") {
  // Random operands are never within eps of each other, so every element has one winner.
  check_binary_cases({
      {"maximum", [](const Variable& a, const Variable& b) { return maximum(a, b); }},
      {"minimum", [](const Variable& a, const Variable& b) { return minimum(a, b); }},
  });
}

TEST_CASE("gradcheck: pow of a tensor base and a tensor exponent", "[gradcheck][elementwise]") {
  const auto both = [](const std::vector<Variable>& x) { return pow(x[0], x[1]); };
  // Both require grad, with broadcasting either way, then each alone.
  check_gradients(both, {leaf({3, 1, 4}, 1, 0.5, 2.0), leaf({5, 4}, 2, -2.0, 2.0)});
  check_gradients(both, {strided_leaf({3, 4}, 3, 0.5, 2.0), leaf({}, 4, -2.0, 2.0)});
  check_gradients(both, {leaf({}, 5, 0.5, 2.0), strided_leaf({2, 5}, 6, -2.0, 2.0)});
  check_gradients(both, {leaf({2, 5}, 7, 0.5, 2.0), constant(random_tensor({5}, 8, DType::f64, -2, 2))});
  check_gradients(both, {constant(random_tensor({2, 5}, 9, DType::f64, 0.5, 2)), leaf({5}, 10, -2.0, 2.0)});
}

TEST_CASE("maximum and minimum split the gradient of a tie evenly", "[gradcheck][elementwise]") {
  const Tensor g = from_vector<double>({2, 4, 6, 8});
  const Variable a = exact_leaf({1, 2, 3, -1}, {4});
  const Variable b = exact_leaf({1, 5, 0, -1}, {4});
  maximum(a, b).backward(g);
  check_equal(a.grad(), {1, 0, 6, 4});
  check_equal(b.grad(), {1, 4, 0, 4});
  a.zero_grad();
  b.zero_grad();
  minimum(a, b).backward(g);
  check_equal(a.grad(), {1, 4, 0, 4});
  check_equal(b.grad(), {1, 0, 6, 4});

  // Broadcast b [2] against a [2, 2]: its halves of the ties are summed over the rows.
  const Variable m = exact_leaf({1, 7, 3, 2}, {2, 2});
  const Variable n = exact_leaf({3, 2}, {2});
  maximum(m, n).backward(from_vector<double>({2, 4, 6, 8}, {2, 2}));
  check_equal(m.grad(), {0, 4, 3, 4});  // ties at [1, 0] (3 = 3) and [1, 1] (2 = 2)
  check_equal(n.grad(), {2 + 3, 4});
}

TEST_CASE("gradcheck: where with a broadcast condition", "[gradcheck][elementwise]") {
  const Tensor rows = gt(from_vector<double>({1, -1, -1, 1}, {4, 1}), 0.0);  // [4, 1]
  const Tensor columns = gt(from_vector<double>({1, -1, 1, 1, -1}), 0.0);    // [5]
  const auto by_rows = [&rows](const std::vector<Variable>& x) { return where(rows, x[0], x[1]); };
  const auto by_columns = [&columns](const std::vector<Variable>& x) { return where(columns, x[0], x[1]); };
  check_gradients(by_rows, {strided_leaf({4, 5}, 1), leaf({5}, 2)});
  check_gradients(by_rows, {leaf({}, 3), leaf({1, 5}, 4)});
  check_gradients(by_columns, {leaf({3, 1}, 7), strided_leaf({3, 5}, 8)});

  // The condition picks whole rows; b [5] gets the sum over the rows where it was taken.
  const Variable a = Variable(zeros({4, 5}, dtype(DType::f64)), true);
  const Variable b = exact_leaf({0, 0, 0, 0, 0}, {5});
  where(rows, a, b).backward(ones({4, 5}, dtype(DType::f64)));
  check_equal(sum(a.grad(), {1}), {5, 0, 0, 5});
  check_equal(b.grad(), {2, 2, 2, 2, 2});
}

TEST_CASE("operators compute the op they name, forward and backward", "[gradcheck][elementwise]") {
  const std::vector<double> av = {0.5, -1.25, 2.0}, bv = {4.0, 0.5, -0.25};
  const Variable a = exact_leaf(av, {3}), b = exact_leaf(bv, {3});
  const std::vector<std::pair<std::string, std::function<double(double, double)>>> expected = {
      {"+", [](double x, double y) { return x + y; }},
      {"-", [](double x, double y) { return x - y; }},
      {"*", [](double x, double y) { return x * y; }},
      {"/", [](double x, double y) { return x / y; }},
  };
  const std::vector<Variable> results = {a + b, a - b, a * b, a / b};
  const std::vector<Variable> with_scalar = {a + 0.1, a - 0.1, a * 0.1, a / 0.1};
  for (std::size_t op = 0; op < expected.size(); ++op) {
    INFO("operator " << expected[op].first);
    std::vector<double> tensor_tensor, tensor_scalar;
    for (std::size_t i = 0; i < av.size(); ++i) {
      tensor_tensor.push_back(expected[op].second(av[i], bv[i]));
      tensor_scalar.push_back(expected[op].second(av[i], 0.1));
    }
    check_close(results[op].data(), tensor_tensor);
    // The scalar becomes an f64 constant: 0.1 rounded to f32 would miss the f64 tolerance.
    CHECK(with_scalar[op].dtype() == DType::f64);
    check_close(with_scalar[op].data(), tensor_scalar);
  }
  check_close((-a).data(), {-0.5, 1.25, -2.0});

  // d/da sum(a * b - a / b + (-a)) = b - 1/b - 1, d/db = a + a / b^2.
  sum(a * b - a / b + (-a)).backward();
  std::vector<double> grad_a, grad_b;
  for (std::size_t i = 0; i < av.size(); ++i) {
    grad_a.push_back(bv[i] - 1 / bv[i] - 1);
    grad_b.push_back(av[i] + av[i] / (bv[i] * bv[i]));
  }
  check_close(a.grad(), grad_a);
  check_close(b.grad(), grad_b);

  // A scalar operand keeps an f32 variable f32.
  const Variable f(ones({2}), true);
  CHECK((f * 0.5).dtype() == DType::f32);
  CHECK((f + 1).dtype() == DType::f32);
}

TEST_CASE("cast: f64 -> f32 -> f64 passes the gradient back in each dtype", "[gradcheck][elementwise]") {
  // Finite differences through f32 round x + eps to 6e-8 (3% of eps): checked by hand instead.
  const Variable x = strided_leaf({3, 5}, 11);
  const Variable x32 = cast(x, DType::f32);
  CHECK(x32.dtype() == DType::f32);
  check_close(x32.data(), values(x.data()), {1e-7, 1e-7});
  const Variable back = cast(x32, DType::f64);
  CHECK(back.dtype() == DType::f64);

  const Tensor w = random_tensor({3, 5}, 12, DType::f64, -2, 2);
  sum(mul(back, constant(w))).backward();
  REQUIRE(x.grad().defined());
  CHECK(x.grad().dtype() == DType::f64);
  // The weights go through f32 on the way back: equal to w rounded to f32.
  check_equal(x.grad(), values(w.to(DType::f32)));

  // The gradient reaching the f32 value is f32, the one reaching x is f64.
  const Variable y = Variable(random_tensor({4}, 13, DType::f64), true);
  Tensor seen;
  const Variable y32 = cast(y, DType::f32);
  y32.register_hook([&seen](const Tensor& g) {
    seen = g;
    return Tensor();
  });
  y32.backward(from_vector<float>({1.5f, -2.0f, 0.25f, 3.0f}));
  REQUIRE(seen.defined());
  CHECK(seen.dtype() == DType::f32);
  CHECK(y.grad().dtype() == DType::f64);
  check_equal(y.grad(), {1.5, -2.0, 0.25, 3.0});

  // A cast that keeps the dtype is the identity, gradcheck included.
  check_gradients([](const std::vector<Variable>& v) { return cast(v[0], DType::f64); },
                  {strided_leaf({2, 3}, 14)});
}

// --- reductions --------------------------------------------------------------------------------

TEST_CASE("gradcheck: sum, mean, sum_squares, max, min, logsumexp over any dims", "[gradcheck][reduce]") {
  using ReduceFn = std::function<Variable(const Variable&, const Dims&, bool)>;
  const std::vector<std::pair<std::string, ReduceFn>> ops = {
      {"sum", [](const Variable& x, const Dims& d, bool k) { return sum(x, d, k); }},
      {"mean", [](const Variable& x, const Dims& d, bool k) { return mean(x, d, k); }},
      {"sum_squares", [](const Variable& x, const Dims& d, bool k) { return sum_squares(x, d, k); }},
      {"max", [](const Variable& x, const Dims& d, bool k) { return max(x, d, k); }},
      {"min", [](const Variable& x, const Dims& d, bool k) { return min(x, d, k); }},
      {"logsumexp", [](const Variable& x, const Dims& d, bool k) { return logsumexp(x, d, k); }},
  };
  std::uint64_t seed = 300;
  for (const auto& entry : ops) {
    const std::string& name = entry.first;
    const ReduceFn& op = entry.second;
    for (const Reduction& r : reductions) {
      INFO(name << " over " << shape_str(r.dims) << " keepdim " << r.keepdim);
      // Random values are distinct, so max and min have one winner per output.
      const Variable x = strided_leaf({3, 4, 5}, ++seed, -2.0, 2.0);
      const auto fn = [&](const std::vector<Variable>& v) { return op(v[0], r.dims, r.keepdim); };
      Shape expected;
      for (std::int64_t d = 0; d < 3; ++d) {
        bool reduced = r.dims.empty();
        for (const std::int64_t k : r.dims) reduced = reduced || (k + 3) % 3 == d;
        if (!reduced) expected.push_back(x.size(d));
        if (reduced && r.keepdim) expected.push_back(1);
      }
      CHECK(fn({x}).shape() == expected);
      check_gradients(fn, {x});
    }
    INFO(name << " of 1-D and 0-d inputs");
    const auto over = [&op](Dims dims) {
      return [&op, dims](const std::vector<Variable>& v) { return op(v[0], dims, false); };
    };
    check_gradients(over({0}), {leaf({13}, ++seed, -2.0, 2.0)});
    check_gradients(over({-1}), {leaf({7}, ++seed, -2.0, 2.0)});
    check_gradients(over({}), {leaf({}, ++seed, -2.0, 2.0)});
  }
}

TEST_CASE("max and min split the gradient of a tie evenly among the extremes", "[gradcheck][reduce]") {
  const Variable x = exact_leaf({1, 3, 3, 2, 2, 2}, {2, 3});
  max(x, {1}).backward(from_vector<double>({2, 3}));
  check_equal(x.grad(), {0, 1, 1, 1, 1, 1});
  x.zero_grad();
  min(x, {-1}, true).backward(from_vector<double>({2, 3}, {2, 1}));
  check_equal(x.grad(), {2, 0, 0, 1, 1, 1});
  x.zero_grad();
  max(x, {0}).backward(from_vector<double>({4, 6, 8}));
  check_equal(x.grad(), {0, 6, 8, 4, 0, 0});  // column 0: 2 wins alone; no ties across rows

  // Over all dims: the three 3s share one gradient.
  const Variable z = exact_leaf({1, 3, 3, 3, 0, 2}, {2, 3});
  max(z).backward(scalar_tensor(3.0, dtype(DType::f64)));
  check_equal(z.grad(), {0, 1, 1, 1, 0, 0});
  z.zero_grad();
  min(z, {}, true).backward(full({1, 1}, 5.0, dtype(DType::f64)));
  check_equal(z.grad(), {0, 0, 0, 0, 5, 0});
}

TEST_CASE("reductions reject bad dims with the op's name", "[gradcheck][reduce][errors]") {
  const Variable x = leaf({2, 3, 4}, 1);
  CHECK_THROWS_ERROR(sum(x, {3}), "sum: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(mean(x, {-4}), "mean: dimension -4 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(sum_squares(x, {5}), "sum_squares: dimension 5 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(max(x, {3}), "max: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(min(x, {3}), "min: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(logsumexp(x, {3}), "logsumexp: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(mean(x, {0, -3}), "mean: dims [0, -3] name a dimension twice");
}

// --- gradcheck itself ------------------------------------------------------------------------------

TEST_CASE("gradcheck catches a wrong backward and passes the right one", "[gradcheck][self]") {
  // y = 2x recorded with the backward of 3x: every diagonal entry of the Jacobian is off by 1.
  const auto doubled = [](double factor) {
    return [factor](const std::vector<Variable>& v) {
      return autograd::record("doubled", {v[0]}, mul(v[0].data(), 2.0),
                              [factor](const Tensor& g) -> autograd::Grads { return {mul(g, factor)}; });
    };
  };
  const Variable x = leaf({3}, 1);
  const GradcheckResult wrong = gradcheck(doubled(3.0), {x});
  CHECK_FALSE(wrong.ok);
  CHECK_THAT(wrong.report, Catch::Matchers::Contains("gradcheck: 3 of 9 Jacobian entries differ"));
  CHECK_THAT(wrong.report, Catch::Matchers::Contains("input 0 element 1 -> output element 1: analytical 3,"));
  const GradcheckResult right = gradcheck(doubled(2.0), {x});
  CHECK(right.ok);
  CHECK(right.report == "gradcheck: 9 Jacobian entries agree");

  // The tolerance is atol + rtol * |numerical|: an error of 1e-4 relative passes rtol 1e-3 only.
  CHECK(gradcheck(doubled(2.0002), {x}).ok);
  CHECK_FALSE(gradcheck(doubled(2.0002), {x}, {.eps = 1e-6, .atol = 1e-5, .rtol = 1e-5}).ok);

  // A wrong gradient for one input of two: the report names that input.
  const auto half_wrong = [](const std::vector<Variable>& v) {
    return autograd::record("mul", {v[0], v[1]}, mul(v[0].data(), v[1].data()),
                            [b = v[1].data()](const Tensor& g) -> autograd::Grads {
                              return {mul(g, b), mul(g, b)};  // should be g * a
                            });
  };
  const GradcheckResult one = gradcheck(half_wrong, {leaf({2}, 2, 1.0, 2.0), leaf({2}, 3, 3.0, 4.0)});
  CHECK_FALSE(one.ok);
  CHECK_THAT(one.report, Catch::Matchers::Contains("gradcheck: 2 of 8 Jacobian entries differ"));
  CHECK_THAT(one.report, Catch::Matchers::Contains("input 1 element 0"));
  CHECK_THAT(one.report, !Catch::Matchers::Contains("input 0"));
}

TEST_CASE("gradcheck fails on NaN on either side, whatever the tolerance", "[gradcheck][self]") {
  const GradcheckOptions loose{.eps = 1e-6, .atol = 1e30, .rtol = 1e30};
  // NaN analytical: a backward that returns NaN.
  const auto nan_backward = [](const std::vector<Variable>& v) {
    return autograd::record("nan", {v[0]}, mul(v[0].data(), 2.0), [](const Tensor& g) -> autograd::Grads {
      return {mul(g, std::numeric_limits<double>::quiet_NaN())};
    });
  };
  const Variable x = leaf({2}, 1);
  const GradcheckResult a = gradcheck(nan_backward, {x}, loose);
  CHECK_FALSE(a.ok);
  CHECK_THAT(a.report, Catch::Matchers::Contains("analytical nan"));

  // NaN numerical: log of a negative element is NaN; its analytical gradient 1/x is finite.
  const Variable y = exact_leaf({-1.0, 2.0}, {2});
  const GradcheckResult n = gradcheck([](const std::vector<Variable>& v) { return log(v[0]); }, {y}, loose);
  CHECK_FALSE(n.ok);
  // Element 0's output is NaN whichever element moves: entries (0, 0) and (0, 1) fail.
  CHECK_THAT(n.report, Catch::Matchers::Contains("gradcheck: 2 of 4 Jacobian entries differ"));
  // The sign of a NaN from NaN - NaN is unspecified: "nan" or "-nan".
  CHECK_THAT(n.report,
             Catch::Matchers::Matches(
                 R"([\s\S]*input 0 element 0 -> output element 0: analytical -1, numerical -?nan\n[\s\S]*)"));
}

TEST_CASE("gradcheck needs f64 inputs and an output that requires grad", "[gradcheck][self][errors]") {
  const auto product = [](const std::vector<Variable>& v) { return mul(v[0], v[1]); };
  const Variable x64 = leaf({3}, 1);
  const Variable x32(random_tensor({3}, 2), true);
  CHECK_THROWS_ERROR(gradcheck(product, {x32, x64}),
                     "gradcheck: input 0 is f32; finite differences need f64");
  CHECK_THROWS_ERROR(gradcheck(product, {x64, x32}),
                     "gradcheck: input 1 is f32; finite differences need f64");
  CHECK_THROWS_ERROR(gradcheck(product, {constant(x64.data()), constant(x32.data())}),
                     "gradcheck: the output does not require grad (no input requires grad)");
  // An f32 input that needs no gradient is only a constant: accepted.
  CHECK(gradcheck(product, {x64, constant(x32.data())}).ok);
}

TEST_CASE("gradcheck restores every input element it perturbed", "[gradcheck][self]") {
  const Variable x = strided_leaf({3, 4}, 1);
  const Variable y = leaf({4}, 2);
  const std::vector<double> before_x = values(x.data()), before_y = values(y.data());
  CHECK(gradcheck([](const std::vector<Variable>& v) { return mul(exp(v[0]), v[1]); }, {x, y}).ok);
  check_equal(x.data(), before_x);
  check_equal(y.data(), before_y);
  CHECK_FALSE(x.grad().defined());  // and leaves no gradient behind
}
