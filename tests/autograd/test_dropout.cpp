// tests/autograd/test_dropout.cpp: dropout's masks are a function of (seed, layer stream,
// step, global sample index), so a batch split across ranks draws the 1-rank masks.
#include "autograd/functional.h"
#include "autograd/random_context.h"
#include "core/call_log.h"
#include "tests/check.h"

using namespace shardlab;
using test::check_close;
using test::values;

namespace {

// The mask dropout applied (1 kept, 0 dropped) to a batch of `rows` rows of 5 ones.
std::vector<double> mask_of(const RandomContext& context, std::int64_t rows, double p, std::uint64_t stream) {
  const RandomContextGuard guard(context);
  const Variable x = constant(ones({rows, 5}, dtype(DType::f64)));
  std::vector<double> kept = values(dropout(x, p, true, stream).data());
  for (double& v : kept) v = v != 0 ? 1 : 0;
  return kept;
}

std::vector<double> rows_of(const std::vector<double>& mask, std::vector<std::int64_t> rows) {
  std::vector<double> out;
  for (const std::int64_t r : rows) out.insert(out.end(), mask.begin() + r * 5, mask.begin() + r * 5 + 5);
  return out;
}

}  // namespace

TEST_CASE("dropout keeps 1 - p of the elements and scales them by 1 / (1 - p)", "[dropout]") {
  const RandomContextGuard guard({.seed = 3});
  const Variable x = constant(test::random_tensor({400, 250}, 1, DType::f64, 1.0, 2.0));
  const std::vector<double> in = values(x.data()), out = values(dropout(x, 0.3, true, 11).data());
  std::int64_t dropped = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (out[i] == 0) {
      ++dropped;
    } else {
      REQUIRE(std::abs(out[i] - in[i] / 0.7) <= 1e-12);
    }
  }
  // 100000 Bernoulli(0.3) draws: standard deviation of the fraction is 0.0014.
  CHECK(std::abs(static_cast<double>(dropped) / in.size() - 0.3) < 0.007);
}

TEST_CASE("dropout masks depend on seed, stream and step, and repeat exactly", "[dropout]") {
  const RandomContext base{.seed = 1, .step = 4};
  const std::vector<double> mask = mask_of(base, 8, 0.5, 21);
  CHECK(mask == mask_of(base, 8, 0.5, 21));
  CHECK(mask != mask_of({.seed = 2, .step = 4}, 8, 0.5, 21));
  CHECK(mask != mask_of({.seed = 1, .step = 5}, 8, 0.5, 21));
  CHECK(mask != mask_of(base, 8, 0.5, 22));
  // Without sample indices, row r is sample r.
  CHECK(mask == mask_of({.seed = 1, .step = 4, .sample_indices = {0, 1, 2, 3, 4, 5, 6, 7}}, 8, 0.5, 21));
}

TEST_CASE("rows drawn on different ranks equal the rows of the 1-rank batch", "[dropout]") {
  const std::vector<double> whole = mask_of({.seed = 9, .step = 2}, 8, 0.5, 5);
  // Rank 0 holds samples 0..3, rank 1 samples 4..7 (contiguous split)...
  CHECK(mask_of({.seed = 9, .step = 2, .sample_indices = {0, 1, 2, 3}}, 4, 0.5, 5) ==
        rows_of(whole, {0, 1, 2, 3}));
  CHECK(mask_of({.seed = 9, .step = 2, .sample_indices = {4, 5, 6, 7}}, 4, 0.5, 5) ==
        rows_of(whole, {4, 5, 6, 7}));
  // ...or strided like DistributedSampler (rank 1 of 3: samples 1, 4, 7), in any order.
  CHECK(mask_of({.seed = 9, .step = 2, .sample_indices = {1, 4, 7}}, 3, 0.5, 5) == rows_of(whole, {1, 4, 7}));
  CHECK(mask_of({.seed = 9, .step = 2, .sample_indices = {6, 5, 0}}, 3, 0.5, 5) == rows_of(whole, {6, 5, 0}));
}

TEST_CASE("a shuffled batch's masks are drawn in one random call", "[dropout]") {
  // A sampler's shuffled indices are rarely consecutive: a call a row would be a kernel launch a row.
  const RandomContextGuard guard({.seed = 9, .step = 2, .sample_indices = {6, 5, 0, 1, 7}});
  const Variable x = constant(ones({5, 5}, dtype(DType::f64)));
  call_log::start();
  (void)dropout(x, 0.5, true, 5);
  std::int64_t random_calls = 0;
  for (const call_log::Call& call : call_log::stop()) random_calls += call.op == "random";
  CHECK(random_calls == 1);
}

TEST_CASE("dropout's gradient is its scaled mask; evaluation and p = 0 are the identity", "[dropout]") {
  const RandomContextGuard guard({.seed = 5});
  const Variable x(test::random_tensor({6, 7}, 2, DType::f64), true, "x");
  const Variable y = dropout(x, 0.4, true, 1);
  sum(y).backward();
  std::vector<double> expected;
  for (const double v : values(y.data())) expected.push_back(v == 0 ? 0 : 1 / 0.6);
  check_close(x.grad(), expected);

  CHECK(dropout(x, 0.4, false, 1).same(x));
  CHECK(dropout(x, 0.0, true, 1).same(x));
  test::check_equal(dropout(x, 1.0, true, 1).data(), std::vector<double>(42, 0.0));
}

TEST_CASE("dropout rejects bad arguments", "[dropout]") {
  const Variable x = constant(ones({4, 2}));
  CHECK_THROWS_ERROR(dropout(x, 1.5, true, 0), "dropout: p must be in [0, 1], got 1.5");
  CHECK_THROWS_ERROR(dropout(x, -0.1, true, 0), "dropout: p must be in [0, 1], got -0.1");
  CHECK_THROWS_ERROR(dropout(constant(ones({2}, dtype(DType::i64))), 0.5, true, 0),
                     "dropout: needs a floating input, got i64");
  const RandomContextGuard guard({.sample_indices = {0, 1, 2}});
  CHECK_THROWS_ERROR(
      dropout(x, 0.5, true, 0),
      "dropout: the random context names 3 sample indices but the input has 4 rows (shape [4, 2])");
  const RandomContextGuard negative({.sample_indices = {3, 0, -2, 1}});
  CHECK_THROWS_ERROR(dropout(x, 0.5, true, 0), "dropout: sample index -2 of row 2 is negative");
}
