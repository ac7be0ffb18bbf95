// tests/core/test_random.cpp: Philox4x32-10 against the published known-answer vectors, the
// bit-exact math it uses, sub-range generation, rows drawn at offsets of their own, and the
// distributions' statistics.
#include <cmath>

#include "core/philox.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors", "[random]") {
  // counter {0,0,0,0}, key {0,0}
  const philox::Block zero = philox::generate(0, 0, 0);
  CHECK(zero.word[0] == 0x6627e8d5u);
  CHECK(zero.word[1] == 0xe169c58du);
  CHECK(zero.word[2] == 0xbc57ac4cu);
  CHECK(zero.word[3] == 0x9b00dbd8u);
  // counter all ones, key all ones
  const philox::Block ones = philox::generate(~0ull, ~0ull, ~0ull);
  CHECK(ones.word[0] == 0x408f276du);
  CHECK(ones.word[1] == 0x41c83b0eu);
  CHECK(ones.word[2] == 0xa20bc7c6u);
  CHECK(ones.word[3] == 0x6d5451fdu);
  // counter {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, key {0xa4093822, 0x299f31d0}
  const philox::Block pi =
      philox::generate(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull);
  CHECK(pi.word[0] == 0xd16cfe09u);
  CHECK(pi.word[1] == 0x94fdccebu);
  CHECK(pi.word[2] == 0x5001e420u);
  CHECK(pi.word[3] == 0x24126ea1u);
}

TEST_CASE("the device-independent log and cos are accurate to double precision", "[random]") {
  for (int i = 1; i <= 20000; ++i) {
    const double x = std::ldexp(static_cast<double>(i) * 0.7548776662466927, -(i % 60));
    const double u = x - std::floor(x);
    if (u == 0) continue;
    REQUIRE(std::abs(philox::log_unit(u) - std::log(u)) <= 4e-16 * std::max(1.0, std::abs(std::log(u))));
    REQUIRE(std::abs(philox::cos_two_pi(u) - std::cos(2 * M_PI * u)) <= 2e-15);
  }
  CHECK(philox::log_unit(1.0) == 0.0);
  CHECK(philox::cos_two_pi(0.0) == 1.0);
  CHECK(philox::cos_two_pi(0.5) == -1.0);
  CHECK(std::abs(philox::cos_two_pi(0.25)) <= 1e-16);
}

TEST_CASE("any sub-range of a draw equals that range of the whole tensor", "[random]") {
  const RandomKey key{2024, 7};
  for (const DType type : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const Tensor whole = uniform({1001}, key, -2.0, 3.0, dtype(type));
    const Tensor whole_normal = normal({1001}, key, 1.0, 0.5, dtype(type));
    for (const std::int64_t start : {0, 1, 3, 4, 333, 1000}) {
      const std::int64_t length = std::min<std::int64_t>(97, 1001 - start);
      test::check_equal(uniform({length}, key, -2.0, 3.0, dtype(type), start),
                        whole.narrow(0, start, length).to_vector<double>());
      test::check_equal(normal({length}, key, 1.0, 0.5, dtype(type), start),
                        whole_normal.narrow(0, start, length).to_vector<double>());
    }
  }
  // The shape is irrelevant: the same draw viewed as [7, 11] is the same elements.
  test::check_equal(bernoulli({7, 11}, key, 0.3), bernoulli({77}, key, 0.3).to_vector<double>());
}

TEST_CASE("rows drawn at offsets of their own in one call equal each row drawn alone", "[random]") {
  // Row lengths of one element, off a Philox block, and across the kernel's 4096-element chunks; row
  // starts off block boundaries, out of order, repeated and far apart.
  const RandomKey key{31, 4};
  const std::vector<std::int64_t> starts{7, 0, 123457, 3, 3, 9000};
  for (const std::int64_t length : {1, 5, 4099, 9216}) {
    std::vector<std::int64_t> row_first_indices;
    for (const std::int64_t start : starts) row_first_indices.push_back(start * length);
    for (const DType type : {DType::f32, DType::f64, DType::bf16, DType::boolean}) {
      for (const Distribution kind : {Distribution::uniform, Distribution::normal, Distribution::bernoulli}) {
        if (type == DType::boolean && kind != Distribution::bernoulli) continue;
        INFO("length " << length << " dtype " << dtype_name(type) << " distribution " << int(kind));
        const RandomSpec spec{kind, key, kind == Distribution::bernoulli ? 0.4 : -1.0, 2.0, 0, row_first_indices};
        const Tensor drawn = empty({static_cast<std::int64_t>(starts.size()), length}, dtype(type));
        fill_random(drawn, spec);
        std::vector<double> expected;
        for (const std::int64_t first : row_first_indices) {
          RandomSpec alone = spec;
          alone.row_first_indices = {};
          alone.first_index = first;
          const Tensor row = empty({length}, dtype(type));
          fill_random(row, alone);
          const std::vector<double> row_values = row.to_vector<double>();
          expected.insert(expected.end(), row_values.begin(), row_values.end());
        }
        REQUIRE(drawn.to_vector<double>() == expected);
      }
    }
  }
}

TEST_CASE("draws depend on seed and stream; values match their definition", "[random]") {
  const Tensor a = uniform({64}, {1, 0});
  CHECK(a.to_vector<float>() != uniform({64}, {2, 0}).to_vector<float>());
  CHECK(a.to_vector<float>() != uniform({64}, {1, 1}).to_vector<float>());
  CHECK(a.to_vector<float>() == uniform({64}, {1, 0}).to_vector<float>());
  // Element i of an f32 uniform is word i % 4 of block i / 4, top 24 bits over 2^24.
  const std::vector<float> values = uniform({8}, {5, 9}, 0.0, 1.0).to_vector<float>();
  for (std::uint64_t i = 0; i < 8; ++i) {
    const philox::Block block = philox::generate(5, 9, i / 4);
    CHECK(values[i] == static_cast<float>((block.word[i % 4] >> 8) / 16777216.0));
  }
}

TEST_CASE("distributions have the right moments", "[random]") {
  const std::int64_t n = 200000;
  const Tensor u = uniform({n}, {11, 0}, 2.0, 6.0, dtype(DType::f64));
  const double u_mean = mean(u).item<double>();
  const double u_var = mean(pow(sub(u, u_mean), 2.0)).item<double>();
  // Standard error of the mean: sqrt(var / n) = sqrt(16/12 / 2e5) ~ 0.0026; allow 5 sigma.
  CHECK(std::abs(u_mean - 4.0) < 0.013);
  CHECK(std::abs(u_var - 16.0 / 12.0) < 0.02);
  CHECK(min(u).item<double>() >= 2.0);
  CHECK(max(u).item<double>() < 6.0);

  const Tensor z = normal({n}, {12, 0}, -1.0, 3.0);
  const double z_mean = mean(z.to(DType::f64)).item<double>();
  const double z_std = std::sqrt(mean(pow(sub(z.to(DType::f64), z_mean), 2.0)).item<double>());
  CHECK(std::abs(z_mean + 1.0) < 5 * 3.0 / std::sqrt(double(n)));
  CHECK(std::abs(z_std - 3.0) < 0.05);
  // About 68.27% within one sigma.
  const double inside = mean(le(abs(sub(z, -1.0)), 3.0).to(DType::f64)).item<double>();
  CHECK(std::abs(inside - 0.6827) < 0.005);

  const Tensor b = bernoulli({n}, {13, 0}, 0.25, dtype(DType::boolean));
  CHECK(b.dtype() == DType::boolean);
  CHECK(std::abs(sum(b).item<double>() / n - 0.25) < 0.005);
  CHECK(sum(bernoulli({100}, {1, 1}, 0.0)).item<double>() == 0);
  CHECK(sum(bernoulli({100}, {1, 1}, 1.0)).item<double>() == 100);
}

TEST_CASE("random factories reject bad arguments", "[random]") {
  CHECK_THROWS_ERROR(uniform({2}, {}, 0, 1, dtype(DType::i32)), "uniform: needs a floating dtype, got i32");
  CHECK_THROWS_ERROR(uniform({2}, {}, 3, 1), "uniform: low 3 is above high 1");
  CHECK_THROWS_ERROR(normal({2}, {}, 0, -1), "normal: std must be non-negative, got -1");
  CHECK_THROWS_ERROR(bernoulli({2}, {}, 1.5), "bernoulli: p must be in [0, 1], got 1.5");
  CHECK_THROWS_ERROR(uniform({2}, {}, 0, 1, {}, -4), "uniform: first_index must be non-negative, got -4");
  CHECK_THROWS_ERROR(fill_random(zeros({2, 3}).transpose(0, 1), {}),
                     "fill_random: output must be contiguous");
  CHECK_THROWS_ERROR(fill_random(zeros({2}), RandomSpec{.first_index = -1}),
                     "fill_random: first_index must be non-negative, got -1");
  const std::vector<std::int64_t> three_rows{0, 8, 16}, negative_row{0, -8};
  CHECK_THROWS_ERROR(fill_random(zeros({10}), RandomSpec{.row_first_indices = three_rows}),
                     "fill_random: 3 rows do not divide the output's 10 elements (shape [10])");
  CHECK_THROWS_ERROR(fill_random(zeros({3, 2}), RandomSpec{.first_index = 5, .row_first_indices = three_rows}),
                     "fill_random: first_index 5 and row_first_indices both place the draws; give one");
  CHECK_THROWS_ERROR(fill_random(zeros({2, 2}), RandomSpec{.row_first_indices = negative_row}),
                     "fill_random: row 1 starts at draw -8; draw numbers are non-negative");
}

TEST_CASE("f32 Bernoulli draws, 16 Philox blocks at a time, are the per-element definition", "[random]") {
  // Starts off a block boundary, lengths around whole groups of 64 values, probabilities whose
  // thresholds are exact (0.5 * 2^24), tiny, and the ends.
  const RandomKey key{0xfeedull, 0x1234567890ull};
  for (const double p : {0.0, 1e-7, 0.3, 0.5, 0.75, 1.0}) {
    for (const std::int64_t first : {0, 1, 3, 4}) {
      for (const std::int64_t n : {1, 5, 63, 64, 65, 1000, 5003}) {
        INFO("p " << p << " first " << first << " n " << n);
        const std::vector<float> drawn = bernoulli({n}, key, p, {}, first).to_vector<float>();
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const bool kept = philox::bernoulli(key.seed, key.stream, static_cast<std::uint64_t>(first + i), p);
          wrong += drawn[static_cast<std::size_t>(i)] != (kept ? 1.0f : 0.0f);
        }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("every dtype's draws follow the definition, element by element", "[random]") {
  // f64 Bernoulli and uniform masks take their own paths in the CPU kernel; each must equal
  // the per-element definition in core/philox.h.
  const RandomKey key{17, 3};
  for (const DType type : {DType::f32, DType::f64, DType::bf16, DType::boolean}) {
    const std::vector<double> drawn = bernoulli({37}, key, 0.4, dtype(type), 5).to_vector<double>();
    for (std::uint64_t i = 0; i < drawn.size(); ++i) {
      REQUIRE(drawn[i] == (philox::bernoulli(17, 3, 5 + i, 0.4) ? 1.0 : 0.0));
    }
  }
  const std::vector<double> u64 = uniform({9}, key, -1, 2, dtype(DType::f64), 2).to_vector<double>();
  const std::vector<double> n64 = normal({9}, key, 1, 2, dtype(DType::f64), 2).to_vector<double>();
  for (std::uint64_t i = 0; i < 9; ++i) {
    CHECK(u64[i] == philox::uniform53(17, 3, 2 + i, -1, 2));
    CHECK(n64[i] == philox::normal(17, 3, 2 + i, 1, 2));
  }
}
