// tests/core/test_parallel.cpp: the CPU thread pool: coverage of every index, exceptions, nesting,
// and its workers and callers found whether they spin or sleep.
#include <atomic>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <thread>
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

namespace {

// Each call's chunks counted: every index once, or the test fails (a lost wake-up hangs it instead).
void check_one_call(std::int64_t count, const std::function<void()>& inside_chunk = {}) {
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(count));
  parallel_for(0, count, 1, [&](std::int64_t first, std::int64_t last) {
    if (inside_chunk) inside_chunk();
    for (std::int64_t i = first; i < last; ++i) hits[i]++;
  });
  for (const auto& h : hits) REQUIRE(h.load() == 1);
}

}  // namespace

TEST_CASE("parallel_for finds the workers spinning, asleep, or still busy", "[parallel]") {
  // Workers spin for a while after a task and then sleep; the caller spins for its last chunk and
  // then sleeps. Back-to-back calls meet spinning workers, calls after a pause meet sleeping ones,
  // and chunks that outlast the spin make the caller sleep and be woken by the last one. A pool with
  // more threads than cores sleeps at once: on a 2-core machine 2 threads spin and 3 and 4 do not.
  const int original = num_threads();
  for (const int threads : {2, 3, 4}) {
    set_num_threads(threads);
    INFO(threads << " threads");
    for (int call = 0; call < 2000; ++call) check_one_call(threads);
    for (int call = 0; call < 5; ++call) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      check_one_call(threads * 5);
    }
    for (int call = 0; call < 3; ++call) {
      check_one_call(threads, [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); });
    }
    // A chunk that throws after the caller has gone to sleep.
    CHECK_THROWS_ERROR(parallel_for(0, threads, 1,
                                    [](std::int64_t first, std::int64_t) {
                                      if (first == 0) return;
                                      std::this_thread::sleep_for(std::chrono::milliseconds(2));
                                      throw Error("late chunk failed");
                                    }),
                       "late chunk failed");
    check_one_call(threads);  // the pool still runs after it
  }
  set_num_threads(original);
}

TEST_CASE("the pool resizes while its workers spin and while they sleep", "[parallel]") {
  const int original = num_threads();
  for (const int threads : {3, 1, 2, 4}) {
    check_one_call(8);  // workers of the previous size spinning now
    set_num_threads(threads);
    CHECK(num_threads() == threads);
    check_one_call(8);
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // now asleep
  }
  set_num_threads(original);
}
