// tests/data/test_random_tokens.cpp: the random token data set: its shapes, the shift between inputs
// and targets, ids in range and about equally frequent, one seed one data set, and its refusals.
#include <cmath>
#include <numeric>
#include <vector>

#include "data/random_tokens.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

std::vector<std::int64_t> all_rows(const data::TensorDataset& set) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(set.size()));
  std::iota(rows.begin(), rows.end(), 0);
  return rows;
}

}  // namespace

TEST_CASE("random tokens: inputs and targets are one row of seq + 1 ids shifted by one", "[data]") {
  const data::TensorDataset set = data::random_token_dataset(5, 9, 50000, 7);
  REQUIRE(set.size() == 5);
  const data::Batch batch = set.gather(all_rows(set));
  REQUIRE(batch.inputs.shape() == Shape{5, 9});
  REQUIRE(batch.targets.shape() == Shape{5, 9});
  CHECK(batch.inputs.dtype() == DType::i64);
  const std::vector<std::int64_t> inputs = batch.inputs.to_vector<std::int64_t>();
  const std::vector<std::int64_t> targets = batch.targets.to_vector<std::int64_t>();
  std::int64_t unshifted = 0;
  for (std::size_t r = 0; r < 5; ++r) {
    for (std::size_t t = 0; t + 1 < 9; ++t) unshifted += targets[r * 9 + t] != inputs[r * 9 + t + 1];
  }
  CHECK(unshifted == 0);
}

TEST_CASE("random tokens: every id in [0, vocab), about equally often, the same for the same seed",
          "[data]") {
  constexpr std::int64_t kVocab = 7, kRows = 1000, kSeq = 20;
  const data::TensorDataset set = data::random_token_dataset(kRows, kSeq, kVocab, 11);
  const data::Batch batch = set.gather(all_rows(set));
  std::vector<double> counts(kVocab, 0.0);
  std::int64_t outside = 0;
  for (const std::int64_t id : batch.inputs.to_vector<std::int64_t>()) {
    if (id < 0 || id >= kVocab) {
      ++outside;
      continue;
    }
    ++counts[static_cast<std::size_t>(id)];
  }
  CHECK(outside == 0);
  // Pearson's chi-square over 7 cells (6 degrees of freedom): above 22.46 one time in a thousand.
  const double expected = static_cast<double>(kRows * kSeq) / kVocab;
  double chi_square = 0;
  for (const double count : counts) chi_square += (count - expected) * (count - expected) / expected;
  CHECK(chi_square < 22.46);

  const data::Batch again = data::random_token_dataset(kRows, kSeq, kVocab, 11).gather(all_rows(set));
  CHECK(again.inputs.to_vector<std::int64_t>() == batch.inputs.to_vector<std::int64_t>());
  const data::Batch other = data::random_token_dataset(kRows, kSeq, kVocab, 12).gather(all_rows(set));
  CHECK(other.inputs.to_vector<std::int64_t>() != batch.inputs.to_vector<std::int64_t>());
}

TEST_CASE("random tokens: a size below 1 is refused by name", "[data][errors]") {
  CHECK_THROWS_ERROR(data::random_token_dataset(0, 4, 10, 1),
                     "random_token_dataset: sequences must be at least 1, got 0");
  CHECK_THROWS_ERROR(data::random_token_dataset(2, -1, 10, 1),
                     "random_token_dataset: seq must be at least 1, got -1");
  CHECK_THROWS_ERROR(data::random_token_dataset(2, 4, 0, 1),
                     "random_token_dataset: vocab must be at least 1, got 0");
}
