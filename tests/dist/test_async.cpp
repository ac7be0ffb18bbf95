// tests/dist/test_async.cpp (mpirun): Work handles complete in any wait order, and a
// collective progresses on the communication thread while the caller computes.
#include <chrono>
#include <thread>

#include "core/ops.h"
#include "dist/comm/communicator.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::pattern;
using test::world;
using test::wrong_on_any_rank;

TEST_CASE("handles may be waited in any order, twice, or only through a later one", "[dist][async]") {
  auto& comm = world();
  const int r = comm.rank(), w = comm.size();
  constexpr int kCalls = 6;
  std::vector<Tensor> tensors;
  std::vector<dist::Work> works;
  for (int k = 0; k < kCalls; ++k) {
    tensors.push_back(full({1000 + k}, (k + 1) * (r + 1), dtype(DType::f64)));
    works.push_back(comm.all_reduce(tensors.back()));
  }
  // Reverse order: the last handle completes only after the earlier ones (issue order).
  for (int k = kCalls - 1; k >= 0; k -= 2) works[static_cast<std::size_t>(k)].wait();
  for (const dist::Work& work : works) CHECK(work.completed());
  for (const dist::Work& work : works) work.wait();  // again: returns at once
  const double rank_sum = w * (w + 1) / 2.0;
  for (int k = 0; k < kCalls; ++k) {
    CHECK(wrong_on_any_rank(tensors[static_cast<std::size_t>(k)],
                            [&](std::int64_t) { return (k + 1) * rank_sum; }) == 0);
  }
  CHECK(dist::Work().completed());  // an empty handle is complete
}

TEST_CASE("a collective completes while the caller computes, without waiting on it", "[dist][async]") {
  auto& comm = world();
  const int r = comm.rank(), w = comm.size();
  // The other ranks join 300 ms late, so rank 0's all-reduce is in flight while it computes.
  if (r != 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::int64_t n = 1 << 20;
  const Tensor buffer =
      pattern(DType::f32, n, [&](std::int64_t i) { return static_cast<double>((i + r) % 8); });
  const dist::Work work = comm.all_reduce(buffer, dist::ReduceOp::sum, "overlap");
  const std::uint64_t sequence = comm.monitor().tail(1).at(0).sequence;

  // Compute in slices and look at the handle between them; never call wait() meanwhile.
  const Tensor a = full({96, 96}, 0.5f), b = full({96, 96}, 0.25f);
  const auto compute_start = dist::Clock::now();
  int slices = 0, slices_before_done = -1;
  Tensor product;
  while (slices_before_done < 0 || slices < slices_before_done + 3) {
    product = matmul(a, b);
    ++slices;
    if (slices_before_done < 0 && work.completed()) slices_before_done = slices;
    REQUIRE(dist::Clock::now() - compute_start < std::chrono::seconds(60));
  }
  const auto compute_end = dist::Clock::now();
  CHECK(product.to_vector<float>()[0] == 96 * 0.5f * 0.25f);  // exact in f32
  CHECK(slices_before_done > 0);
  work.wait();
  // Expected: sum over ranks of (i + rank) % 8.
  CHECK(wrong_on_any_rank(buffer, [&](std::int64_t i) {
          double total = 0;
          for (int other = 0; other < w; ++other) total += static_cast<double>((i + other) % 8);
          return total;
        }) == 0);
  // The ledger's timestamps put the collective inside the compute loop on rank 0.
  if (r == 0 && w > 1) {
    const auto entries = comm.monitor().tail(64);
    const auto entry = std::find_if(entries.begin(), entries.end(), [&](const dist::LedgerEntry& e) {
      return e.communicator == comm.name() && e.sequence == sequence;
    });
    REQUIRE(entry != entries.end());
    CHECK(entry->fingerprint.tag == "overlap");
    CHECK(entry->state == dist::CallState::completed);
    CHECK(entry->started < compute_end);
    CHECK(entry->finished > compute_start);
    CHECK(slices_before_done > 1);  // the reduction was still waiting for late ranks after the first slice
  }
}
