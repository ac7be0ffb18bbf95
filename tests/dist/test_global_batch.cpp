// tests/dist/test_global_batch.cpp (mpirun): each rank's rank_loader batch, gathered over the
// ranks, is the batch one process would train on with the global batch.
#include "data/loader.h"
#include "dist/communicator.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::world;

TEST_CASE("the ranks' rank_loader batches gathered are the 1-process global batches", "[dist][data]") {
  auto& comm = world();
  const int w = comm.size();
  const std::int64_t n = 101, global_batch = 12;  // 12 divides by 1..4; 101 leaves a ragged tail
  std::vector<double> rows(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) rows[static_cast<std::size_t>(i)] = static_cast<double>(i);
  const data::TensorDataset dataset(from_vector(rows, {n, 1}), arange(n));
  const data::DataLoader mine = data::rank_loader(
      dataset, {.size = global_batch, .world_size = w, .rank = comm.rank(), .seed = 5, .drop_last = true});
  const data::DataLoader whole(dataset, global_batch, std::make_shared<data::RandomSampler>(n, 5), true);
  for (const std::int64_t epoch : {0, 3}) {
    const auto my_batches = mine.batch_indices(epoch);
    const auto global = whole.batch_indices(epoch);
    REQUIRE(test::sum_over_ranks(my_batches.size() == global.size() ? 0 : 1) == 0);
    for (std::size_t k = 0; k < global.size(); ++k) {
      // Gather every rank's row indices: [rank 0's rows, rank 1's rows, ...].
      const Tensor local = from_vector(my_batches[k], {static_cast<std::int64_t>(my_batches[k].size())});
      const Tensor gathered = empty({global_batch}, dtype(DType::i64));
      comm.all_gather_into(gathered, local, "batch indices").wait();
      const std::vector<std::int64_t> joint = gathered.to_vector<std::int64_t>();
      // Rank r's j-th row is row j * w + r of the global batch.
      const std::int64_t per_rank = global_batch / w;
      std::int64_t wrong = 0;
      for (std::int64_t rank = 0; rank < w; ++rank) {
        for (std::int64_t j = 0; j < per_rank; ++j) {
          wrong += joint[static_cast<std::size_t>(rank * per_rank + j)] !=
                   global[k][static_cast<std::size_t>(j * w + rank)];
        }
      }
      CHECK(test::sum_over_ranks(wrong) == 0);
    }
  }
}
