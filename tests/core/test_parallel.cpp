// tests/core/test_parallel.cpp: the CPU thread pool: coverage of every index, exceptions, nesting.
#include <atomic>
#include <stdexcept>
#include <vector>

#include "core/parallel.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("parallel_for covers every index exactly once", "[parallel]") {
  const int original = num_threads();
  for (const int threads : {1, 2, 3}) {
    set_num_threads(threads);
    CHECK(num_threads() == threads);
    for (const std::int64_t count : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(count));
      parallel_for(0, count, 1, [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t i = first; i < last; ++i) hits[i]++;
      });
      for (const auto& h : hits) REQUIRE(h.load() == 1);
    }
  }
  set_num_threads(original);
}

TEST_CASE("parallel_for rethrows a worker's exception and nested calls run serially", "[parallel]") {
  const int original = num_threads();
  set_num_threads(3);
  CHECK_THROWS_ERROR(parallel_for(0, 300, 1,
                                  [](std::int64_t first, std::int64_t) {
                                    if (first > 0) throw Error("chunk failed");
                                  }),
                     "chunk failed");
  std::atomic<int> total{0};
  parallel_for(0, 10, 1, [&](std::int64_t first, std::int64_t last) {
    parallel_for(0, 10, 1, [&](std::int64_t a, std::int64_t b) {
      total += static_cast<int>((last - first) * (b - a));
    });
  });
  CHECK(total.load() == 100);
  CHECK_THROWS_ERROR(set_num_threads(0), "set_num_threads: need at least 1 thread, got 0");
  // Results of a kernel do not depend on the thread count (deterministic reductions).
  const Tensor x = test::random_tensor({301, 77}, 5);
  set_num_threads(1);
  const std::vector<double> one = sum(x, {0}).to_vector<double>();
  set_num_threads(3);
  CHECK(sum(x, {0}).to_vector<double>() == one);
  set_num_threads(original);
}
