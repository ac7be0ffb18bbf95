// tests/dist/test_global_batch.cpp (mpirun): each rank's rank_loader batch, gathered over the
// ranks, is the batch one process would train on with the global batch.
#include "data/loader.h"
#include "dist/comm/communicator.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::world;

TEST_CASE("the ranks' rank_loader batches gathered are the 1-process global batches", "[dist][data]") {
  auto& comm = world();
  const int w = comm.size();
  std::vector<double> rows(101);  // 101 leaves a ragged tail for every global batch below
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<double>(i);
  const auto n = static_cast<std::int64_t>(rows.size());
  const data::TensorDataset dataset(from_vector(rows, {n, 1}), arange(n));
  // 12 divides by 1..4; 10 splits unevenly over 3 and 4 ranks.
  for (const std::int64_t global_batch : {12, 10}) {
    INFO("global batch " << global_batch);
    const data::DataLoader mine = data::rank_loader(
        dataset, {.size = global_batch, .world_size = w, .rank = comm.rank(), .seed = 5, .drop_last = true});
    const data::DataLoader whole(dataset, global_batch, std::make_shared<data::RandomSampler>(n, 5), true);
    const std::int64_t most = data::rank_batch_size(global_batch, w, 0);  // rank 0 holds the most rows
    for (const std::int64_t epoch : {0, 3}) {
      const auto my_batches = mine.batch_indices(epoch);
      const auto global = whole.batch_indices(epoch);
      REQUIRE(test::sum_over_ranks(my_batches.size() == global.size() ? 0 : 1) == 0);
      for (std::size_t k = 0; k < global.size(); ++k) {
        // Gather every rank's row indices, each padded with -1 to rank 0's count.
        std::vector<std::int64_t> padded = my_batches[k];
        padded.resize(static_cast<std::size_t>(most), -1);
        const Tensor gathered = empty({most * w}, dtype(DType::i64));
        comm.all_gather_into(gathered, from_vector(padded, {most}), "batch indices").wait();
        const std::vector<std::int64_t> joint = gathered.to_vector<std::int64_t>();
        // Rank r's j-th row is row j * w + r of the global batch.
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < global_batch; ++i) {
          wrong += joint[static_cast<std::size_t>((i % w) * most + i / w)] !=
                   global[k][static_cast<std::size_t>(i)];
        }
        CHECK(test::sum_over_ranks(wrong) == 0);
      }
    }
  }
}
