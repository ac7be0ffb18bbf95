// tests/core/test_exact_sum.cpp: ExactSum (core/exact_sum.h): two terms give IEEE addition's correctly
// rounded sum; any order and grouping of many (over simulated ranks through the limbs) give the same bits;
// cancellation is exact; ties, subnormals, overflow and non-finite terms by hand; squares; refusals.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/exact_sum.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

double exact_sum(const std::vector<double>& terms) {
  ExactSum sum;
  for (const double t : terms) sum.add(t);
  return sum.value();
}

// Doubles of random sign whose exponents spread over [-spread, spread], some subnormal where spread is large.
std::vector<double> random_doubles(int count, int spread, std::uint32_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-spread, spread);
  std::vector<double> values(count);
  for (double& v : values)
    v = std::ldexp(mantissa(generator), exponent(generator)) * (generator() % 2 ? -1 : 1);
  return values;
}

bool same_bits(double a, double b) {
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
}

}  // namespace

TEST_CASE("ExactSum: two terms give IEEE addition's correctly rounded sum", "[exact_sum]") {
  // IEEE addition rounds the exact sum of two doubles once: the one closed form any pair must meet.
  const std::vector<double> values = random_doubles(400, 1023, 1);  // finite; subnormal below 2^-1022
  const std::vector<double> specials = {0.1,
                                        0.2,
                                        1.0,
                                        std::ldexp(1.0, -53),
                                        std::numeric_limits<double>::max(),
                                        std::numeric_limits<double>::denorm_min(),
                                        -0.0,
                                        0.0,
                                        3.5e-310,
                                        std::numeric_limits<double>::min()};
  std::int64_t wrong = 0, checked = 0;
  for (std::size_t i = 0; i + 1 < values.size(); ++i) {
    for (const double b : {values[i + 1], specials[i % specials.size()], -values[i] * 0.75}) {
      const double a = values[i];
      wrong += !same_bits(exact_sum({a, b}), a + b) && !(a + b == 0 && exact_sum({a, b}) == 0);
      ++checked;
    }
  }
  for (const double a : specials) {
    for (const double b : specials) {
      wrong += exact_sum({a, b}) != a + b;
      ++checked;
    }
  }
  CHECK(checked > 1000);
  CHECK(wrong == 0);
}

TEST_CASE("ExactSum: any order and grouping, over simulated ranks, give the same bits; cancellation is exact",
          "[exact_sum]") {
  std::vector<double> values = random_doubles(3000, 300, 2);
  const double reference = exact_sum(values);
  std::mt19937 shuffler(5);
  for (int trial = 0; trial < 5; ++trial) {
    std::shuffle(values.begin(), values.end(), shuffler);
    CHECK(same_bits(exact_sum(values), reference));
  }
  // Four ranks of unequal shares, their limbs added as an all-reduce would, in two groupings.
  for (const std::vector<std::size_t>& cuts :
       std::vector<std::vector<std::size_t>>{{0, 1000, 2000, 3000}, {0, 10, 2990, 3000}}) {
    Tensor limbs = zeros({kExactLimbs}, dtype(DType::i64));
    for (std::size_t r = 0; r + 1 < cuts.size(); ++r) {
      ExactSum rank;
      for (std::size_t i = cuts[r]; i < cuts[r + 1]; ++i) rank.add(values[i]);
      limbs = add(limbs, rank.limbs());
    }
    CHECK(same_bits(ExactSum::from_limbs(limbs).value(), reference));
  }
  ExactSum merged, half;
  for (std::size_t i = 0; i < values.size(); ++i) (i % 2 == 0 ? merged : half).add(values[i]);
  merged.add(half);
  CHECK(same_bits(merged.value(), reference));
  // The plain sum does depend on the order: the test can tell.
  double forward = 0, backward = 0;
  for (std::size_t i = 0; i < values.size(); ++i)
    forward += values[i], backward += values[values.size() - 1 - i];
  CHECK(forward != backward);

  // Every term and its negation: exactly 0, where a double sum leaves rounding behind; 1e100 + 1 - 1e100.
  std::vector<double> cancelling = values;
  for (const double v : values) cancelling.push_back(-v);
  CHECK(exact_sum(cancelling) == 0.0);
  CHECK(exact_sum({1e100, 1.0, -1e100}) == 1.0);
  CHECK(exact_sum({std::numeric_limits<double>::max(), std::numeric_limits<double>::max(),
                   -std::numeric_limits<double>::max()}) == std::numeric_limits<double>::max());
}

TEST_CASE("ExactSum: ties to even, sticky bits, subnormals, overflow and non-finite terms, by hand",
          "[exact_sum]") {
  const double tie = std::ldexp(1.0, -53);  // half of the step at 1
  CHECK(exact_sum({1.0, tie}) == 1.0);
  CHECK(exact_sum({1.0, tie, std::ldexp(1.0, -1000)}) == 1.0 + std::ldexp(1.0, -52));  // above the tie
  CHECK(exact_sum({1.0 + std::ldexp(1.0, -52), tie}) == 1.0 + std::ldexp(1.0, -51));   // tie to even, up
  CHECK(exact_sum({-1.0, -tie, -std::ldexp(1.0, -1074)}) == -(1.0 + std::ldexp(1.0, -52)));
  CHECK(exact_sum({std::ldexp(3.0, -1074), std::ldexp(4.0, -1074)}) == std::ldexp(7.0, -1074));
  CHECK(exact_sum({std::numeric_limits<double>::max(), std::ldexp(1.0, 970)}) ==
        std::numeric_limits<double>::infinity());
  CHECK(exact_sum({}) == 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(exact_sum({1.0, inf, 2.0}) == inf);
  CHECK(exact_sum({-inf, 1.0}) == -inf);
  CHECK(std::isnan(exact_sum({inf, 1.0, -inf})));
  CHECK(std::isnan(exact_sum({1.0, std::numeric_limits<double>::quiet_NaN()})));
}

TEST_CASE("ExactSum: tensors of every floating dtype, and squares", "[exact_sum]") {
  ExactSum sum;
  sum.add(from_vector(std::vector<float>{3.0f, 4.0f}), /*squares=*/true);
  CHECK(sum.value() == 25.0);
  // Each f32 squared in a double (exact), added one by one; a plain f64 sum of them lies within rounding.
  const Tensor values = test::random_tensor({500}, 4);
  ExactSum squares, by_hand;
  squares.add(values, true);
  double naive = 0;
  for (const float v : values.to_vector<float>()) {
    by_hand.add(static_cast<double>(v) * v);
    naive += static_cast<double>(v) * v;
  }
  CHECK(same_bits(squares.value(), by_hand.value()));
  CHECK(std::abs(squares.value() - naive) <= 500 * std::ldexp(naive, -53));
  for (const DType half : {DType::bf16, DType::f16, DType::f64}) {
    ExactSum of_tensor, of_doubles;
    const Tensor terms = values.to(half);
    of_tensor.add(terms);
    for (const double v : terms.to_vector<double>()) of_doubles.add(v);
    CHECK(same_bits(of_tensor.value(), of_doubles.value()));
  }
  // Squares over f32's whole range (the smallest subnormal to the largest finite) and of halves, each
  // against its square added as a double; the square of an infinity is +infinity, of a NaN a NaN.
  const std::vector<float> wide = {std::numeric_limits<float>::denorm_min(), 3e-40f, 1e-20f, -1.5f, 2.0f,
                                   std::numeric_limits<float>::max(),        -3e38f, 0.0f};
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    INFO(dtype_name(dtype));
    const Tensor terms = from_vector(wide).to(dtype);
    ExactSum fast, slow;
    fast.add(terms, true);
    for (const double v : terms.to_vector<double>()) slow.add(v * v);
    CHECK(same_bits(fast.value(), slow.value()));
  }
  ExactSum infinite, not_a_number;
  infinite.add(from_vector(std::vector<float>{-std::numeric_limits<float>::infinity(), 1.0f}), true);
  not_a_number.add(from_vector(std::vector<float>{std::numeric_limits<float>::quiet_NaN(), 1.0f}), true);
  CHECK(infinite.value() == std::numeric_limits<double>::infinity());
  CHECK(std::isnan(not_a_number.value()));
}

TEST_CASE("ExactSum: refusals name what is wrong", "[exact_sum]") {
  ExactSum sum;
  sum.add(2.0);
  CHECK_THROWS_ERROR(sum.add(arange(4)), "ExactSum::add: the terms must be f64, f32, bf16 or f16, got i64");
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({4, 4}, 1).transpose(0, 1)),
                     "ExactSum::add: the terms must be contiguous on the CPU, got cpu (not contiguous)");
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({4}, 1, DType::f64), true),
                     "ExactSum::add: the square of an f64 term is not exact in a double");
  CHECK_THROWS_ERROR(ExactSum::from_limbs(zeros({3}, dtype(DType::i64))),
                     "ExactSum::from_limbs: expected 71 i64 limbs, got [3] i64");
  CHECK(sum.value() == 2.0);
}
