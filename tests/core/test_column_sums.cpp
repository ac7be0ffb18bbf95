// tests/core/test_column_sums.cpp: the order of per-column sums over rows (core/column_sums.h) that
// the CPU and the GPU share: its chunks cover every row once, in order, whatever the row count, and
// rms_norm's weight gradient taken in that order equals a naive sum over the rows.
#include <cmath>
#include <vector>

#include "core/column_sums.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("column sums: the chunks cover the rows once, in order, for any row count", "[column_sums]") {
  for (const std::int64_t rows : {0, 1, 255, 256, 257, 1000}) {
    INFO(rows << " rows");
    std::int64_t next = 0;
    for (std::int64_t chunk = 0; chunk < column_chunks(rows); ++chunk) {
      const RowRange range = chunk_rows(chunk, rows);
      CHECK(range.begin == next);
      CHECK(range.end > range.begin);
      CHECK(range.end - range.begin <= kRowsPerColumnChunk);
      next = range.end;
    }
    CHECK(next == rows);
  }
  const std::vector<double> partials = {1, 2, 3, 10, 20, 30};  // 2 chunks of 3 columns
  CHECK(sum_of_partials(partials.data(), 2, 3, 0) == 11);
  CHECK(sum_of_partials(partials.data(), 2, 3, 2) == 33);
  CHECK(sum_of_partials(partials.data(), 0, 3, 1) == 0);
}

TEST_CASE("rms_norm's weight gradient over chunks of rows equals the naive sum over all rows",
          "[column_sums]") {
  // 1000 rows: three whole chunks of 256 and a last one of 232; 7 columns.
  const Tensor x = test::random_tensor({1000, 7}, 91, DType::f64),
               w = test::random_tensor({7}, 92, DType::f64),
               g = test::random_tensor({1000, 7}, 93, DType::f64);
  const RmsNormResult forward = rms_norm_forward(x, w, 1e-6);
  const RmsNormGrads grads = rms_norm_backward(g, x, w, forward.rstd);
  const std::vector<double> xs = x.to_vector<double>(), gs = g.to_vector<double>(),
                            rstd = forward.rstd.to_vector<double>();
  std::vector<double> expected(7, 0.0);
  for (std::size_t row = 0; row < 1000; ++row) {
    for (std::size_t e = 0; e < 7; ++e) expected[e] += gs[row * 7 + e] * xs[row * 7 + e] * rstd[row];
  }
  test::check_close(grads.weight, expected, {1e-12, 1e-12});
}
