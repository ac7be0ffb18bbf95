// tests/core/test_pending_read.cpp: PendingRead hands back the values it was given, once, in order,
// as doubles; its refusals name what is wrong. (tests/core/test_cuda.cpp reads from a GPU.)
#include <cmath>
#include <limits>

#include "core/host_wait.h"
#include "core/ops.h"
#include "core/pending_read.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("PendingRead gives the values of any dtype as doubles, in order, once", "[pending_read]") {
  reset_host_wait_counts();
  const Tensor loss = scalar_tensor(2.5, dtype(DType::f32));
  const Tensor norm = full({1, 1}, std::numeric_limits<double>::infinity(), dtype(DType::f64));
  const Tensor finite = isfinite(norm).reshape({});
  PendingRead read({loss, norm, finite, scalar_tensor(7, dtype(DType::i64))});
  loss.fill_(-1.0);  // read from a copy made when queued: a later write does not show
  CHECK_FALSE(read.empty());
  const std::vector<double> values = read.take();
  REQUIRE(values.size() == 4);
  CHECK(values[0] == 2.5);
  CHECK(std::isinf(values[1]));
  CHECK(values[2] == 0);
  CHECK(values[3] == 7);
  CHECK(read.empty());
  CHECK(host_wait_total() == 0);  // CPU values: nothing to wait for
  CHECK_THROWS_ERROR(read.take(), "PendingRead::take: nothing to read (read once, or never queued)");
  CHECK_THROWS_ERROR(PendingRead().take(), "PendingRead::take: nothing to read");
}

TEST_CASE("PendingRead refuses no values, undefined ones and more than one element", "[pending_read]") {
  CHECK_THROWS_ERROR(PendingRead(std::vector<Tensor>{}), "PendingRead: no values to read");
  CHECK_THROWS_ERROR(PendingRead({zeros({}), Tensor()}),
                     "PendingRead: value 1 is undefined, not one element");
  CHECK_THROWS_ERROR(PendingRead({zeros({2})}), "PendingRead: value 0 is [2], not one element");
}
