// tests/core/test_binned_sum.cpp: BinnedSum (core/binned_sum.h): the same bits in any order and any
// grouping of the terms (over simulated ranks too), the correctly rounded exact sum where no term falls
// under the window, the documented error bound against an exact sum where some do, rounding by hand
// (ties to even, subnormals, overflow), non-finite terms, halves, and every refusal.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/binned_sum.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

Tensor f32_tensor(const std::vector<float>& values) {
  return from_vector(values, {static_cast<std::int64_t>(values.size())});
}

std::vector<std::uint32_t> bits_of(const Tensor& t) {
  std::vector<std::uint32_t> bits;
  for (const float v : t.to_vector<float>()) bits.push_back(std::bit_cast<std::uint32_t>(v));
  return bits;
}

// `parts` tensors of `numel` f32 terms, random signs, exponents spread over [-spread, spread].
std::vector<Tensor> random_parts(int parts, std::int64_t numel, int spread, std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-spread, spread);
  std::vector<Tensor> result;
  for (int p = 0; p < parts; ++p) {
    std::vector<float> values(numel);
    for (float& v : values)
      v = std::ldexp(mantissa(generator), exponent(generator)) * (generator() % 2 ? -1 : 1);
    result.push_back(f32_tensor(values));
  }
  return result;
}

Tensor binned_total(const std::vector<Tensor>& parts, const std::vector<std::size_t>& order) {
  BinnedSum sum(parts.front().numel());
  for (const std::size_t i : order) sum.add(parts[i]);
  return sum.result();
}

// The parts dealt to `ranks` simulated ranks in contiguous runs of `counts`, each rank's sum in its own
// order; the tops all-reduced with max, the windows with sum, then rounded, as ranks do.
Tensor over_ranks(const std::vector<Tensor>& parts, const std::vector<int>& counts) {
  const std::int64_t numel = parts.front().numel();
  std::vector<BinnedSum> ranks;
  std::size_t next = 0;
  for (const int count : counts) {
    ranks.emplace_back(numel);
    for (int i = count - 1; i >= 0; --i) ranks.back().add(parts[next + i]);  // backwards: order is free
    next += count;
  }
  Tensor tops = ranks.front().tops().clone();
  for (const BinnedSum& rank : ranks) tops = maximum(tops, rank.tops());
  Tensor windows = zeros({numel}, dtype(DType::i64));
  for (const BinnedSum& rank : ranks) windows = add(windows, rank.window(tops));
  return round_binned(windows, tops);
}

}  // namespace

TEST_CASE("BinnedSum: the same bits in any order and grouping of the terms, over ranks too", "[binned_sum]") {
  // 200 elements (3 blocks, the last short), 12 parts over 2^-60 .. 2^60: most terms fall partly under
  // some window, so truncation happens everywhere and the orders really differ in what they drop first.
  const std::vector<Tensor> parts = random_parts(12, 200, 60, 7);
  std::vector<std::size_t> order(parts.size());
  std::iota(order.begin(), order.end(), 0);
  const std::vector<std::uint32_t> reference = bits_of(binned_total(parts, order));
  std::mt19937 shuffler(3);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(order.begin(), order.end(), shuffler);
    CHECK(bits_of(binned_total(parts, order)) == reference);
  }
  for (const std::vector<int>& counts :
       std::vector<std::vector<int>>{{12}, {6, 6}, {4, 4, 4}, {3, 3, 3, 3}, {6, 3, 3}, {1, 11}, {5, 1, 6}}) {
    CHECK(bits_of(over_ranks(parts, counts)) == reference);
  }
  // Merged sums: (a + b) + c and a + (b + c) from three groups of parts.
  BinnedSum a(200), b(200), c(200);
  for (std::size_t i = 0; i < parts.size(); ++i) (i % 3 == 0 ? a : i % 3 == 1 ? b : c).add(parts[i]);
  BinnedSum left = a.clone();
  left.add(b);
  left.add(c);
  BinnedSum right = c.clone();
  right.add(b);
  right.add(a);
  CHECK(bits_of(left.result()) == reference);
  CHECK(bits_of(right.result()) == reference);
  CHECK(left.terms() == 12);
  CHECK(a.terms() == 4);  // a clone's adds leave the original alone

  // The ordinary sum in f32 does depend on the order here: the test could tell a wrong method.
  std::vector<float> forward(200, 0.0f), backward(200, 0.0f);
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const std::vector<float> f = parts[p].to_vector<float>(),
                             r = parts[parts.size() - 1 - p].to_vector<float>();
    for (std::size_t i = 0; i < 200; ++i) forward[i] += f[i], backward[i] += r[i];
  }
  CHECK(forward != backward);
}

TEST_CASE("BinnedSum: where no term falls under the window, the exact sum rounded once", "[binned_sum]") {
  // Multiples of 2^-20 below 8 in magnitude: the window of a block whose largest term is near 8 reaches
  // down to 2^-37, and a sum of 30 of them is exact in a double, rounded once to f32 by the cast.
  std::mt19937 generator(11);
  std::uniform_int_distribution<std::int32_t> steps(-(8 << 20) + 1, (8 << 20) - 1);
  std::vector<std::vector<float>> parts(30, std::vector<float>(130));
  std::vector<double> exact(130, 0.0);
  for (auto& part : parts) {
    for (std::size_t i = 0; i < part.size(); ++i) {
      part[i] = std::ldexp(static_cast<float>(steps(generator)), -20);  // at most 23 bits: exact in f32
      exact[i] += part[i];
    }
  }
  BinnedSum sum(130);
  for (const auto& part : parts) sum.add(f32_tensor(part));
  std::vector<float> expected;
  for (const double e : exact) expected.push_back(static_cast<float>(e));
  CHECK(sum.result().to_vector<float>() == expected);
}

TEST_CASE("BinnedSum: within n 2^-32 max|term| + ulp/2 of the exact sum where terms fall under the window",
          "[binned_sum]") {
  // 40 parts over 2^-30 .. 2^30 (60 bits apart at most, so that an i128 of units 2^-54 holds the exact
  // sum), one element per block so that each element's own largest term sets its window.
  const int parts = 40;
  const std::vector<Tensor> terms = random_parts(parts, 64 * 50, 30, 5);
  BinnedSum sum(64 * 50);
  for (const Tensor& part : terms) sum.add(part);
  const std::vector<float> result = sum.result().to_vector<float>();
  std::int64_t checked = 0, truncated = 0;
  for (std::int64_t i = 0; i < 64 * 50; i += 64) {
    __int128 exact = 0;  // in units of 2^-54: every term's mantissa (24 bits, exponent >= -30) is whole there
    double largest = 0, f64_sum = 0;
    for (const Tensor& part : terms) {
      const float v = part.to_vector<float>()[i];
      int e = 0;
      const float m = std::frexp(v, &e);  // v = m 2^e, |m| in [0.5, 1)
      exact += static_cast<__int128>(std::ldexp(m, 24)) << (e - 24 + 54);
      largest = std::max(largest, std::abs(static_cast<double>(v)));
      f64_sum += v;
    }
    const long double exact_value = std::ldexp(static_cast<long double>(exact), -54);
    const long double bound =
        parts * std::ldexp(largest, -32) + std::ldexp(static_cast<long double>(std::abs(result[i])), -24);
    CHECK(std::abs(result[i] - exact_value) <= bound);
    // Tighter than the ordinary f32 sum's bound, and near the f64 sum.
    CHECK(std::abs(result[i] - f64_sum) <= bound + parts * std::ldexp(largest, -52));
    truncated += static_cast<float>(exact_value) != result[i];
    ++checked;
  }
  CHECK(checked == 50);
  INFO("elements not equal to the exact sum rounded once: " << truncated);
  CHECK(truncated < checked);  // mostly exact: the bound is a worst case
}

TEST_CASE("round_binned: ties to even, subnormals, the largest f32 and overflow, by hand", "[binned_sum]") {
  // A window at top bin T counts units of 2^(16 (T - 2) - 149). 1.0 = 2^149 units lies in bin 9, so at
  // T = 9 a window counts 2^-37: 1.0 is 2^37, 2^-24 (half of f32's step at 1) is 2^13.
  const auto round_one = [](std::int64_t window, std::uint8_t top) {
    return round_binned(from_vector(std::vector<std::int64_t>{window}, {1}),
                        from_vector(std::vector<std::uint8_t>{top}, {1}))
        .to_vector<float>()[0];
  };
  const std::int64_t one = std::int64_t{1} << 37, half_step = std::int64_t{1} << 13;
  CHECK(round_one(one, 9) == 1.0f);
  CHECK(round_one(one + half_step, 9) == 1.0f);                                    // a tie: to even
  CHECK(round_one(one + 3 * half_step, 9) == 1.0f + std::ldexp(1.0f, -22));        // a tie: to even
  CHECK(round_one(one + half_step + 1, 9) == 1.0f + std::ldexp(1.0f, -23));        // above the tie
  CHECK(round_one(-(one + half_step + 1), 9) == -(1.0f + std::ldexp(1.0f, -23)));  // sign
  CHECK(round_one(2 * one - 1, 9) == 2.0f);                                        // rounds up a power
  CHECK(round_one(5, 2) == std::ldexp(5.0f, -149));                                // subnormal, exact
  CHECK(round_one((std::int64_t{1} << 24) - 1, 2) == std::ldexp(float((1 << 24) - 1), -149));
  CHECK(round_one(0, 17) == 0.0f);
  // T = 17 counts 2^(240 - 149) = 2^91: the largest f32, (2^24 - 1) 2^104, is (2^24 - 1) 2^13 of them.
  CHECK(round_one(((std::int64_t{1} << 24) - 1) << 13, 17) == std::numeric_limits<float>::max());
  CHECK(round_one((((std::int64_t{1} << 24) - 1) << 13) + (std::int64_t{1} << 12), 17) ==
        std::numeric_limits<float>::infinity());  // the tie above the largest rounds to 2^128
  CHECK(round_one(-(std::int64_t{1} << 40), 17) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(round_one(0, kNonFiniteTop)));
  // Windows of every size up to 2^62 (the sums of many terms) at every top, mixed within blocks (a block
  // shares its top): the exact value (a long double holds 64 bits of it, and its power of two) rounded
  // once to f32.
  std::mt19937_64 random(5);
  constexpr std::int64_t kWindows = 4000;
  std::vector<std::int64_t> windows;
  std::vector<std::uint8_t> block_tops(static_cast<std::size_t>(binned_blocks(kWindows)));
  for (auto& top : block_tops) top = static_cast<std::uint8_t>(2 + random() % 16);
  for (std::int64_t k = 0; k < kWindows; ++k) {
    const int bits = 1 + static_cast<int>(random() % 62);
    windows.push_back(static_cast<std::int64_t>(random() >> (64 - bits)) * (k % 2 == 0 ? 1 : -1));
  }
  const std::vector<float> rounded =
      round_binned(from_vector(windows, {kWindows}), from_vector(block_tops, {binned_blocks(kWindows)}))
          .to_vector<float>();
  for (std::int64_t k = 0; k < kWindows; ++k) {
    const int top = block_tops[static_cast<std::size_t>(k / kBinBlock)];
    const long double exact = static_cast<long double>(windows[k]) * std::ldexp(1.0L, 16 * (top - 2) - 149);
    INFO("window " << windows[k] << " at top " << top);
    CHECK(std::bit_cast<std::uint32_t>(rounded[k]) ==
          std::bit_cast<std::uint32_t>(static_cast<float>(exact)));
  }
  // A shard: element i of the windows is element first + i of the sum whose blocks the tops cover.
  const Tensor tops = from_vector(std::vector<std::uint8_t>{2, 9}, {2});
  const Tensor shard = round_binned(from_vector(std::vector<std::int64_t>{one, one}, {2}), tops, 63);
  CHECK(shard.to_vector<float>() == std::vector<float>{std::ldexp(1.0f, 37 - 149), 1.0f});
}

TEST_CASE("BinnedSum: a non-finite term makes its block NaN, and only its block", "[binned_sum]") {
  std::vector<float> first(130, 1.0f), second(130, 2.0f);
  second[70] = std::numeric_limits<float>::infinity();
  BinnedSum sum(130), other(130);
  sum.add(f32_tensor(first));
  other.add(f32_tensor(second));
  sum.add(other);
  sum.add(f32_tensor(first));
  const std::vector<float> result = sum.result().to_vector<float>();
  for (std::size_t i = 0; i < 130; ++i) {
    INFO("element " << i);
    if (i / 64 == 1)
      CHECK(std::isnan(result[i]));
    else
      CHECK(result[i] == 4.0f);
  }
  CHECK(sum.tops().to_vector<double>()[1] == kNonFiniteTop);
}

TEST_CASE("BinnedSum: bf16 and f16 terms add as their f32 values", "[binned_sum]") {
  const Tensor f32_terms = test::random_tensor({300}, 21);
  for (const DType half : {DType::bf16, DType::f16}) {
    const Tensor halves = f32_terms.to(half);
    BinnedSum from_halves(300), from_f32(300);
    from_halves.add(halves);
    from_halves.add(halves);
    from_f32.add(halves.to(DType::f32));
    from_f32.add(halves.to(DType::f32));
    CHECK(bits_of(from_halves.result()) == bits_of(from_f32.result()));
    CHECK(from_halves.result().to_vector<float>() == mul(halves.to(DType::f32), 2.0).to_vector<float>());
  }
}

TEST_CASE(
    "BinnedSum: parts added at their offsets are their concatenation added whole; terms count per block",
    "[binned_sum]") {
  // A flat buffer of three parameters (70, 30 and 100 elements: blocks shared across their edges).
  const std::vector<Tensor> first = random_parts(3, 200, 40, 17), second = random_parts(3, 200, 40, 18);
  BinnedSum whole(200), pieces(200);
  for (const auto* parts : {&first, &second}) {
    for (const Tensor& part : *parts) {
      whole.add(part);
      pieces.add(part.narrow(0, 100, 100).contiguous(), 100);
      pieces.add(part.narrow(0, 0, 70).contiguous(), 0);
      pieces.add(part.narrow(0, 70, 30).contiguous(), 70);
    }
  }
  CHECK(bits_of(pieces.result()) == bits_of(whole.result()));
  BinnedSum counted(200);
  counted.add(ones({10}), 0);
  counted.add(ones({10}), 5);
  counted.add(ones({36}), 64);
  counted.add(ones({0}), 199);  // nothing: counts nothing
  CHECK(counted.terms() == 2);
  CHECK(counted.result().to_vector<float>()[7] == 2.0f);
  CHECK(counted.result().to_vector<float>()[64] == 1.0f);
  // Elements no part reached read as zero (in a block another reached, and in blocks none did); a sum
  // merged into one that had nothing, or an empty one into it, is the same sum.
  const std::vector<float> reached = counted.result().to_vector<float>();
  CHECK(std::all_of(reached.begin() + 15, reached.begin() + 64, [](float v) { return v == 0.0f; }));
  CHECK(std::all_of(reached.begin() + 100, reached.end(), [](float v) { return v == 0.0f; }));
  BinnedSum into_empty(200), empty_into = counted.clone();
  into_empty.add(counted);
  empty_into.add(BinnedSum(200));
  CHECK(bits_of(into_empty.result()) == bits_of(counted.result()));
  CHECK(bits_of(empty_into.result()) == bits_of(counted.result()));
  CHECK(bits_of(BinnedSum(200).result()) == bits_of(zeros({200})));
}

TEST_CASE("BinnedSum: refusals name what is wrong and change nothing", "[binned_sum]") {
  BinnedSum sum(100);
  sum.add(test::random_tensor({100}, 1));
  const std::vector<float> before = sum.result().to_vector<float>();
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({100}, 2, DType::f64)),
                     "BinnedSum::add: the terms must be f32, bf16 or f16, got f64");
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({101}, 2)),
                     "BinnedSum::add: expected contiguous terms for elements [0, 0 + n) of 100, got [101]");
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({10}, 2), 91),
                     "BinnedSum::add: expected contiguous terms for elements [91, 91 + n) of 100, got [10]");
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({10}, 2), -1),
                     "BinnedSum::add: expected contiguous terms for elements [-1, -1 + n) of 100, got [10]");
  CHECK_THROWS_ERROR(sum.add(test::random_tensor({10, 10}, 2).transpose(0, 1)),
                     "BinnedSum::add: expected contiguous terms for elements [0, 0 + n) of 100, got [10, 10] "
                     "(not contiguous)");
  CHECK_THROWS_ERROR(sum.add(BinnedSum(101)), "BinnedSum::add: a sum of 101 elements added to one of 100");
  CHECK_THROWS_ERROR(sum.window(zeros({2}, dtype(DType::u8))), "BinnedSum::window: block 0's top 0 is below");
  CHECK_THROWS_ERROR(sum.window(sum.tops().to(DType::i32)),
                     "BinnedSum::window: the tops must be a contiguous u8 tensor on the CPU, got i32 on cpu");
  CHECK_THROWS_ERROR(sum.window(full({1}, 20, dtype(DType::u8))),
                     "BinnedSum::window: 1 tops for 2 blocks of 64");
  CHECK_THROWS_ERROR(round_binned(zeros({100}), sum.tops()),
                     "round_binned: the windows must be a contiguous i64 tensor on the CPU, got f32 on cpu");
  CHECK_THROWS_ERROR(round_binned(zeros({100}, dtype(DType::i64)), sum.tops(), 40),
                     "round_binned: 2 tops for 3 blocks of 64");
  CHECK_THROWS_ERROR(BinnedSum(-1), "BinnedSum: a negative element count (-1)");
  CHECK(sum.result().to_vector<float>() == before);
  CHECK(sum.terms() == 1);

  BinnedSum many(1);
  const Tensor term = ones({1});
  for (std::int64_t i = 0; i < kMostBinnedTerms; ++i) many.add(term);
  CHECK(many.result().to_vector<float>()[0] == static_cast<float>(kMostBinnedTerms));
  CHECK_THROWS_ERROR(many.add(term), "BinnedSum::add: more than 32767 terms per element");
  BinnedSum one(1);
  one.add(term);
  CHECK_THROWS_ERROR(many.add(one), "BinnedSum::add: more than 32767 terms per element");
  CHECK(many.terms() == kMostBinnedTerms);
}
