// tests/dist/test_tp.cpp (mpirun): tensor parallelism's two collectives (dist/tp/regions.h) over the
// whole world as the tensor-parallel group: an MLP split column then row gives every rank the output
// and gradients one process computes with the whole weights (each rank's gradient pieces the slices
// of the whole ones), in f64, at 1-4 ranks, with exactly one all-reduce in forward and one in backward.
#include <cmath>
#include <vector>

#include "autograd/ops.h"
#include "core/ops.h"
#include "dist/tp/regions.h"
#include "tests/dist/world.h"

using namespace shardlab;
using shardlab::test::world;

namespace {

constexpr std::int64_t kBatch = 2, kIn = 5, kHidden = 12, kOut = 3;  // kHidden divides by 1-4 ranks

// Deterministic values of `shape`, different per `seed`.
Tensor values_of(const Shape& shape, double seed) {
  std::int64_t count = 1;
  for (const std::int64_t n : shape) count *= n;
  std::vector<double> v(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(seed + 0.7 * static_cast<double>(i));
  return from_vector(v, shape);
}

struct Mlp {
  Variable x, w1, b1, w2, b2;  // w1 [hidden, in], w2 [out, hidden]: nn::Linear's layout
};

Mlp whole() {
  return {Variable(values_of({kBatch, kIn}, 1.0), true), Variable(values_of({kHidden, kIn}, 2.0), true),
          Variable(values_of({kHidden}, 3.0), true), Variable(values_of({kOut, kHidden}, 4.0), true),
          Variable(values_of({kOut}, 5.0), true)};
}

Variable loss_of(const Variable& y) { return sum(mul(y, Variable(values_of({kBatch, kOut}, 6.0), false))); }

void check_close(const Tensor& actual, const Tensor& expected) {
  REQUIRE(actual.shape() == expected.shape());
  const std::vector<double> a = actual.to_vector<double>(), e = expected.to_vector<double>();
  for (std::size_t i = 0; i < e.size(); ++i) CHECK(std::abs(a[i] - e[i]) <= 1e-13 * (1 + std::abs(e[i])));
}

}  // namespace

TEST_CASE("tensor parallel MLP, column then row: one process's output and gradients, one all-reduce each way",
          "[dist][tp]") {
  const int tp = world().size(), me = world().rank();
  const std::int64_t part = kHidden / tp, first = me * part;

  Mlp full = whole();
  const Variable full_y =
      add(matmul(relu(add(matmul(full.x, transpose(full.w1, 0, 1)), full.b1)), transpose(full.w2, 0, 1)),
          full.b2);
  loss_of(full_y).backward();

  // This rank's pieces: rows of w1 and b1 (output features), columns of w2 (input features).
  Mlp mine = whole();
  const Variable w1(mine.w1.data().narrow(0, first, part).contiguous(), true);
  const Variable b1(mine.b1.data().narrow(0, first, part).contiguous(), true);
  const Variable w2(mine.w2.data().narrow(1, first, part).contiguous(), true);
  const dist::CollectiveCounters before = world().counters();
  const Variable input = dist::copy_to_parallel_region(mine.x, world(), "mlp.in");
  const Variable hidden = relu(add(matmul(input, transpose(w1, 0, 1)), b1));
  const Variable y = add(
      dist::reduce_from_parallel_region(matmul(hidden, transpose(w2, 0, 1)), world(), "mlp.out"), mine.b2);
  const dist::CollectiveCounters forward = world().counters();
  loss_of(y).backward();
  const dist::CollectiveCounters backward = world().counters();

  check_close(y.data(), full_y.data());
  check_close(mine.x.grad(), full.x.grad());
  check_close(w1.grad(), full.w1.grad().narrow(0, first, part).contiguous());
  check_close(b1.grad(), full.b1.grad().narrow(0, first, part).contiguous());
  check_close(w2.grad(), full.w2.grad().narrow(1, first, part).contiguous());
  check_close(mine.b2.grad(), full.b2.grad());
  const auto all_reduces = [](const dist::CollectiveCounters& counters) {
    return counters[dist::Collective::all_reduce].calls;
  };
  CHECK(all_reduces(forward) - all_reduces(before) == 1);
  CHECK(all_reduces(backward) - all_reduces(forward) == 1);
  CHECK(world().counters().total().calls - before.total().calls == 2);
}
