// tests/data/test_loader.cpp: permutation, the samplers (DistributedSampler against a transcription
// of PyTorch's algorithm and the rank/batch-split property), DataLoader batching, TensorDataset,
// batches sent to a device.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/cuda/runtime.h"
#include "data/loader.h"
#include "tests/check.h"

using namespace shardlab;
using data::Batch;
using data::DataLoader;
using data::DistributedSampler;
using data::permutation;
using data::RandomSampler;
using data::SequentialSampler;
using data::TensorDataset;
using data::to_device;
using test::check_equal;
using Indices = std::vector<std::int64_t>;

#define CHECK_THROWS_EXACT(expr, message) CHECK_THROWS_WITH((expr), Catch::Matchers::Equals(message))

namespace {

Indices iota(std::int64_t n) {
  Indices out(static_cast<std::size_t>(n));
  std::iota(out.begin(), out.end(), std::int64_t{0});
  return out;
}

bool is_permutation_of_range(Indices order, std::int64_t n) {
  std::sort(order.begin(), order.end());
  return order == iota(n);
}

// torch.utils.data.DistributedSampler.__iter__, transcribed line by line from PyTorch (with
// Python's float ceil), applied to a given epoch order.
Indices pytorch_distributed(const Indices& order, int replicas, int rank, bool drop_last) {
  const auto n = static_cast<std::int64_t>(order.size());
  std::int64_t num_samples;
  if (drop_last && n % replicas != 0) {
    num_samples = static_cast<std::int64_t>(std::ceil(static_cast<double>(n - replicas) / replicas));
  } else {
    num_samples = static_cast<std::int64_t>(std::ceil(static_cast<double>(n) / replicas));
  }
  const std::int64_t total_size = num_samples * replicas;
  Indices indices = order;
  if (!drop_last) {
    const std::int64_t padding_size = total_size - n;
    if (padding_size <= n) {
      indices.insert(indices.end(), order.begin(), order.begin() + padding_size);
    } else {
      Indices repeated;
      const auto times = static_cast<std::int64_t>(std::ceil(static_cast<double>(padding_size) / n));
      for (std::int64_t t = 0; t < times; ++t) repeated.insert(repeated.end(), order.begin(), order.end());
      indices.insert(indices.end(), repeated.begin(), repeated.begin() + padding_size);
    }
  } else {
    indices.resize(static_cast<std::size_t>(total_size));
  }
  REQUIRE(static_cast<std::int64_t>(indices.size()) == total_size);
  Indices mine;
  for (std::int64_t i = rank; i < total_size; i += replicas)
    mine.push_back(indices[static_cast<std::size_t>(i)]);
  REQUIRE(static_cast<std::int64_t>(mine.size()) == num_samples);
  return mine;
}

// n samples: input row i is (i, 10 i, 100 i) in f32, target i is 2 i + 1 in i64.
TensorDataset numbered_dataset(std::int64_t n) {
  std::vector<float> inputs;
  std::vector<std::int64_t> targets;
  for (std::int64_t i = 0; i < n; ++i) {
    inputs.insert(inputs.end(), {static_cast<float>(i), 10.0f * i, 100.0f * i});
    targets.push_back(2 * i + 1);
  }
  return TensorDataset(from_vector(inputs, {n, 3}), from_vector(targets));
}

void check_batch_rows(const data::Batch& batch, const Indices& indices) {
  CHECK(batch.sample_indices == indices);
  const auto n = static_cast<std::int64_t>(indices.size());
  REQUIRE(batch.inputs.shape() == Shape{n, 3});
  REQUIRE(batch.targets.shape() == Shape{n});
  std::vector<double> inputs, targets;
  for (const std::int64_t i : indices) {
    inputs.insert(inputs.end(), {double(i), 10.0 * i, 100.0 * i});
    targets.push_back(2.0 * i + 1);
  }
  check_equal(batch.inputs, inputs);
  check_equal(batch.targets, targets);
}

}  // namespace

// --- permutation and the simple samplers --------------------------------------------------------

TEST_CASE("permutation is a permutation and a pure function of (size, seed, epoch)", "[data][loader]") {
  for (const std::int64_t n : {0, 1, 2, 7, 1000}) {
    const Indices p = permutation(n, 42, 3);
    CHECK(is_permutation_of_range(p, n));
    CHECK(permutation(n, 42, 3) == p);
  }
  const Indices base = permutation(100, 42, 0);
  CHECK(base != iota(100));
  CHECK(permutation(100, 42, 1) != base);
  CHECK(permutation(100, 43, 0) != base);

  // It is the order that sorts the epoch's Philox keys (stream = epoch), which is what lets any
  // rank or tool recompute it.
  const std::vector<double> keys =
      uniform({100}, RandomKey{42, 0}, 0.0, 1.0, TensorOptions{}.with_dtype(DType::f64)).to_vector<double>();
  for (std::size_t i = 0; i + 1 < base.size(); ++i) {
    CHECK(keys[static_cast<std::size_t>(base[i])] < keys[static_cast<std::size_t>(base[i + 1])]);
  }
}

TEST_CASE("permutation spreads each index evenly over positions", "[data][loader]") {
  // Over 2000 epochs, how often each of 10 indices comes first: 200 expected, a binomial standard
  // deviation of about 13.4; 5 sigma either side. Fixed seed, so the outcome is deterministic.
  std::vector<int> first(10, 0);
  for (std::int64_t epoch = 0; epoch < 2000; ++epoch)
    ++first[static_cast<std::size_t>(permutation(10, 7, epoch)[0])];
  for (const int count : first) {
    CHECK(count > 133);
    CHECK(count < 267);
  }
}

TEST_CASE("SequentialSampler and RandomSampler", "[data][loader]") {
  CHECK(SequentialSampler(5).indices(0) == Indices{0, 1, 2, 3, 4});
  CHECK(SequentialSampler(5).indices(9) == Indices{0, 1, 2, 3, 4});
  CHECK(SequentialSampler(0).indices(0).empty());
  const RandomSampler sampler(50, 11);
  for (const std::int64_t epoch : {0, 1, 5}) CHECK(sampler.indices(epoch) == permutation(50, 11, epoch));
  CHECK(sampler.indices(0) != sampler.indices(1));
}

TEST_CASE("samplers and permutation refuse negative sizes and epochs", "[data][loader][errors]") {
  CHECK_THROWS_EXACT(permutation(-1, 0, 0), "permutation: dataset size must be non-negative, got -1");
  CHECK_THROWS_EXACT(permutation(3, 0, -2), "permutation: epoch must be non-negative, got -2");
  CHECK_THROWS_EXACT(SequentialSampler(-3), "SequentialSampler: dataset size must be non-negative, got -3");
  CHECK_THROWS_EXACT(SequentialSampler(3).indices(-1),
                     "SequentialSampler: epoch must be non-negative, got -1");
  CHECK_THROWS_EXACT(RandomSampler(-4, 0), "RandomSampler: dataset size must be non-negative, got -4");
  CHECK_THROWS_EXACT(RandomSampler(4, 0).indices(-1), "permutation: epoch must be non-negative, got -1");
}

// --- DistributedSampler ----------------------------------------------------------------------------

TEST_CASE("DistributedSampler pads from the start of the order or drops the tail, by hand",
          "[data][loader][distributed]") {
  // 10 samples on 4 ranks: padded to 12 with 0 and 1, rank r takes r, r + 4, r + 8.
  CHECK(DistributedSampler(10, 4, 0, false, 0).indices(0) == Indices{0, 4, 8});
  CHECK(DistributedSampler(10, 4, 1, false, 0).indices(0) == Indices{1, 5, 9});
  CHECK(DistributedSampler(10, 4, 2, false, 0).indices(0) == Indices{2, 6, 0});
  CHECK(DistributedSampler(10, 4, 3, false, 0).indices(0) == Indices{3, 7, 1});
  CHECK(DistributedSampler(10, 4, 3, false, 0).samples_per_rank() == 3);
  // drop_last cuts to 8.
  CHECK(DistributedSampler(10, 4, 2, false, 0, true).indices(0) == Indices{2, 6});
  CHECK(DistributedSampler(10, 4, 3, false, 0, true).indices(0) == Indices{3, 7});
  CHECK(DistributedSampler(10, 4, 3, false, 0, true).samples_per_rank() == 2);
  // 2 samples on 5 ranks: the order 0, 1 repeats until 5 positions are filled.
  const Indices expected = {0, 1, 0, 1, 0};
  for (int rank = 0; rank < 5; ++rank) {
    CHECK(DistributedSampler(2, 5, rank, false, 0).indices(0) ==
          Indices{expected[static_cast<std::size_t>(rank)]});
    CHECK(DistributedSampler(2, 5, rank, false, 0, true).indices(0).empty());
  }
  // Shuffled, the padding repeats the start of that epoch's permutation.
  const Indices p = permutation(10, 5, 2);
  CHECK(DistributedSampler(10, 4, 2, true, 5).indices(2) == Indices{p[2], p[6], p[0]});
  CHECK(DistributedSampler(10, 1, 0, true, 5).indices(2) == p);
}

TEST_CASE("DistributedSampler matches PyTorch's algorithm for 1 to 4 ranks", "[data][loader][distributed]") {
  for (int world = 1; world <= 4; ++world) {
    for (std::int64_t n = 0; n <= 13; ++n) {
      for (const bool shuffle : {false, true}) {
        for (const bool drop_last : {false, true}) {
          for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
            INFO("world " << world << " n " << n << " shuffle " << shuffle << " drop_last " << drop_last
                          << " epoch " << epoch);
            const Indices order = shuffle ? permutation(n, 9, epoch) : iota(n);
            Indices all;
            for (int rank = 0; rank < world; ++rank) {
              const DistributedSampler sampler(n, world, rank, shuffle, 9, drop_last);
              const Indices mine = sampler.indices(epoch);
              CHECK(mine == pytorch_distributed(order, world, rank, drop_last));
              CHECK(static_cast<std::int64_t>(mine.size()) == sampler.samples_per_rank());
              all.insert(all.end(), mine.begin(), mine.end());
            }
            std::sort(all.begin(), all.end());
            if (!drop_last) {
              // Every sample is seen; only padding repeats.
              Indices distinct = all;
              distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
              CHECK(distinct == iota(n));
            } else {
              // No sample twice, and only the ragged tail is missing.
              CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
              CHECK(static_cast<std::int64_t>(all.size()) == n / world * world);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("rank_loader: the ranks' k-th batches together are the 1-rank k-th batch of the global batch",
          "[data][loader][distributed]") {
  const auto dataset = numbered_dataset(60);
  for (const bool drop_last : {false, true}) {
    for (int world = 1; world <= 4; ++world) {
      for (const std::int64_t n : {24, 23, 13}) {  // 24 divides by 1..4; 23 and 13 need padding
        // Global batches that W divides and ones it does not (5 over 2, 3 and 4; 7 over 2..4).
        for (const std::int64_t global_batch : {std::int64_t{world}, std::int64_t{5}, std::int64_t{7},
                                                std::int64_t{2 * world}, std::int64_t{12}}) {
          if (global_batch < world) continue;
          INFO("drop_last " << drop_last << " world " << world << " n " << n << " global batch "
                            << global_batch);
          const std::int64_t epoch = 4;
          const DataLoader whole(dataset.head(n), global_batch, std::make_shared<RandomSampler>(n, 77),
                                 drop_last);
          const auto global = whole.batch_indices(epoch);
          std::vector<std::vector<Indices>> ranks;
          for (int rank = 0; rank < world; ++rank) {
            const DataLoader loader = data::rank_loader(dataset.head(n), {.size = global_batch,
                                                                          .world_size = world,
                                                                          .rank = rank,
                                                                          .seed = 77,
                                                                          .drop_last = drop_last});
            ranks.push_back(loader.batch_indices(epoch));
            CHECK(static_cast<std::int64_t>(ranks.back().size()) == loader.batches_per_epoch());
          }
          // Every rank has as many batches as the 1-rank loader (what keeps collectives in step),
          // and none is empty.
          for (const auto& batches : ranks) {
            REQUIRE(batches.size() == global.size());
            for (const Indices& batch : batches) CHECK(!batch.empty());
          }
          const Indices p = permutation(n, 77, epoch);
          for (std::size_t k = 0; k < global.size(); ++k) {
            // Position i of the joint batch is rank i % W's (i / W)-th row.
            std::int64_t rows = 0;
            for (const auto& batches : ranks) rows += static_cast<std::int64_t>(batches[k].size());
            Indices joint;
            for (std::int64_t i = 0; i < rows; ++i) {
              const Indices& mine = ranks[static_cast<std::size_t>(i % world)][k];
              REQUIRE(static_cast<std::size_t>(i / world) < mine.size());
              joint.push_back(mine[static_cast<std::size_t>(i / world)]);
            }
            if (static_cast<std::int64_t>(global[k].size()) == global_batch) {
              CHECK(joint == global[k]);  // a complete global batch
              for (int rank = 0; rank < world; ++rank) {
                CHECK(static_cast<std::int64_t>(ranks[static_cast<std::size_t>(rank)][k].size()) ==
                      data::rank_batch_size(global_batch, world, rank));
              }
              continue;
            }
            // The incomplete last batch (without drop_last) is the global one followed by padding to a
            // multiple of W, at most the global batch: position q >= n of the epoch order repeats p[q - n].
            REQUIRE(!drop_last);
            REQUIRE(joint.size() >= global[k].size());
            CHECK(static_cast<std::int64_t>(joint.size()) ==
                  std::min(global_batch, (n % global_batch + world - 1) / world * world));
            CHECK(Indices(joint.begin(), joint.begin() + static_cast<std::ptrdiff_t>(global[k].size())) ==
                  global[k]);
            for (std::size_t i = global[k].size(); i < joint.size(); ++i) {
              const auto q = static_cast<std::int64_t>(k) * global_batch + static_cast<std::int64_t>(i);
              REQUIRE(q >= n);
              CHECK(joint[i] == p[static_cast<std::size_t>(q - n)]);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("rank_loader splits a global batch W divides as DistributedSampler does",
          "[data][loader][distributed]") {
  // What runs saved before uneven shares existed continue from: the same rows on the same ranks.
  const auto dataset = numbered_dataset(23);
  for (const bool drop_last : {false, true}) {
    for (int world = 1; world <= 4; ++world) {
      for (int rank = 0; rank < world; ++rank) {
        const std::int64_t per_rank = 2;
        const DataLoader loader = data::rank_loader(
            dataset,
            {.size = per_rank * world, .world_size = world, .rank = rank, .seed = 3, .drop_last = drop_last});
        const DataLoader reference(dataset, per_rank,
                                   std::make_shared<DistributedSampler>(23, world, rank, true, 3, drop_last),
                                   drop_last);
        INFO("drop_last " << drop_last << " world " << world << " rank " << rank);
        CHECK(loader.batch_indices(1) == reference.batch_indices(1));
      }
    }
  }
}

TEST_CASE(
    "rank_loader with chunks: each rank's whole chunks in order, every batch padded to the global batch",
    "[data][loader][distributed]") {
  // 23 samples in global batches of 8, chunks of 2: the third batch is 7 samples, padded with the
  // order's first one; 4 chunks a batch, over 3 ranks 2, 1, 1.
  const auto dataset = numbered_dataset(23);
  const std::int64_t epoch = 2;
  const Indices p = permutation(23, 5, epoch);
  for (int world = 1; world <= 4; ++world) {
    std::vector<std::vector<Indices>> ranks;
    for (int rank = 0; rank < world; ++rank) {
      const DataLoader loader =
          data::rank_loader(dataset, {.size = 8, .world_size = world, .rank = rank, .seed = 5, .chunk = 2});
      ranks.push_back(loader.batch_indices(epoch));
      CHECK(static_cast<std::int64_t>(ranks.back().size()) == loader.batches_per_epoch());
    }
    for (std::size_t k = 0; k < 3; ++k) {
      INFO("world " << world << " batch " << k);
      Indices joint;  // the ranks' rows one after another
      for (const auto& batches : ranks) joint.insert(joint.end(), batches[k].begin(), batches[k].end());
      Indices expected;
      for (std::size_t i = 0; i < 8; ++i) expected.push_back(p[(k * 8 + i) % 23]);
      CHECK(joint == expected);
    }
  }
  // 64 in chunks of 16 over 3 ranks: 32, 16, 16 rows from 0, 32 and 48.
  const std::vector<data::ChunkShare> shares = {
      data::chunk_share(64, {.world_size = 3, .rank = 0, .chunk = 16}),
      data::chunk_share(64, {.world_size = 3, .rank = 1, .chunk = 16}),
      data::chunk_share(64, {.world_size = 3, .rank = 2, .chunk = 16})};
  CHECK((shares[0].first == 0 && shares[0].count == 32));
  CHECK((shares[1].first == 32 && shares[1].count == 16));
  CHECK((shares[2].first == 48 && shares[2].count == 16));
  CHECK_THROWS_EXACT(data::chunk_share(64, {.world_size = 2, .rank = 0, .chunk = 24}),
                     "global batch: 64 does not cut into chunks of 24");
  CHECK_THROWS_EXACT(
      data::rank_loader(dataset, {.size = 8, .world_size = 3, .rank = 0, .chunk = 4}),
      "global batch: 8 in chunks of 4 makes 2 chunks, fewer than the 3 ranks (every rank needs a "
      "whole chunk per step)");
}

TEST_CASE("rank_batch_size: ceil((G - r) / W) rows, refusing fewer rows than ranks",
          "[data][loader][distributed][errors]") {
  CHECK(data::rank_batch_size(64, 4, 3) == 16);
  CHECK(data::rank_batch_size(3, 1, 0) == 3);
  // 64 over 3 ranks: 22, 21, 21.
  CHECK(data::rank_batch_size(64, 3, 0) == 22);
  CHECK(data::rank_batch_size(64, 3, 1) == 21);
  CHECK(data::rank_batch_size(64, 3, 2) == 21);
  CHECK(data::rank_batch_size(3, 3, 2) == 1);
  CHECK_THROWS_EXACT(data::rank_batch_size(2, 3, 0),
                     "global batch: 2 is smaller than the 3 ranks (every rank needs a sample per step)");
  CHECK_THROWS_EXACT(data::rank_batch_size(0, 1, 0),
                     "global batch: 0 is smaller than the 1 ranks (every rank needs a sample per step)");
  CHECK_THROWS_EXACT(data::rank_batch_size(8, 0, 0), "global batch: world_size must be positive, got 0");
  CHECK_THROWS_EXACT(data::rank_batch_size(8, 2, 2), "global batch: rank 2 is outside [0, 2)");
  CHECK_THROWS_EXACT(data::rank_loader(numbered_dataset(10), {.size = 3, .world_size = 4}),
                     "global batch: 3 is smaller than the 4 ranks (every rank needs a sample per step)");
  CHECK_THROWS_EXACT(DataLoader(numbered_dataset(10), 4, std::make_shared<SequentialSampler>(10), false,
                                {.world_size = 2, .rank = -1}),
                     "global batch: rank -1 is outside [0, 2)");
}

TEST_CASE("DistributedSampler refuses bad world sizes, ranks and sizes",
          "[data][loader][distributed][errors]") {
  CHECK_THROWS_EXACT(DistributedSampler(10, 0, 0, false, 0),
                     "DistributedSampler: world_size must be positive, got 0");
  CHECK_THROWS_EXACT(DistributedSampler(10, -2, 0, false, 0),
                     "DistributedSampler: world_size must be positive, got -2");
  CHECK_THROWS_EXACT(DistributedSampler(10, 4, 4, false, 0), "DistributedSampler: rank 4 is outside [0, 4)");
  CHECK_THROWS_EXACT(DistributedSampler(10, 4, -1, false, 0),
                     "DistributedSampler: rank -1 is outside [0, 4)");
  CHECK_THROWS_EXACT(DistributedSampler(-1, 4, 0, false, 0),
                     "DistributedSampler: dataset size must be non-negative, got -1");
  CHECK_THROWS_EXACT(DistributedSampler(10, 4, 0, true, 0).indices(-1),
                     "DistributedSampler: epoch must be non-negative, got -1");
}

// --- DataLoader and TensorDataset --------------------------------------------------------------------

TEST_CASE("DataLoader cuts the sampler's order into batches", "[data][loader]") {
  const TensorDataset dataset = numbered_dataset(10);
  const DataLoader loader(dataset, 4, std::make_shared<SequentialSampler>(10));
  CHECK(loader.batch_indices(0) == std::vector<Indices>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}});
  CHECK(loader.batches_per_epoch() == 3);
  const DataLoader dropping(dataset, 4, std::make_shared<SequentialSampler>(10), true);
  CHECK(dropping.batch_indices(0) == std::vector<Indices>{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(dropping.batches_per_epoch() == 2);
  // An exact multiple has no partial batch to drop.
  const DataLoader exact(dataset, 5, std::make_shared<SequentialSampler>(10), true);
  CHECK(exact.batch_indices(0) == std::vector<Indices>{{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}});
  CHECK(exact.batches_per_epoch() == 2);
  // A batch larger than the epoch: one partial batch, or none with drop_last.
  CHECK(DataLoader(dataset, 16, std::make_shared<SequentialSampler>(10)).batch_indices(0).size() == 1);
  CHECK(DataLoader(dataset, 16, std::make_shared<SequentialSampler>(10), true).batch_indices(0).empty());
  CHECK(DataLoader(dataset, 16, std::make_shared<SequentialSampler>(10), true).batches_per_epoch() == 0);

  const DataLoader shuffled(dataset, 3, std::make_shared<RandomSampler>(10, 21));
  const auto batches = shuffled.batch_indices(1);
  Indices flat;
  for (const auto& b : batches) flat.insert(flat.end(), b.begin(), b.end());
  CHECK(flat == permutation(10, 21, 1));
  CHECK(batches.back().size() == 1);
  for (const auto& b : batches) check_batch_rows(shuffled.batch(b), b);
}

TEST_CASE("TensorDataset gathers rows in the order asked, and head keeps the first n", "[data][loader]") {
  const TensorDataset dataset = numbered_dataset(10);
  CHECK(dataset.size() == 10);
  check_batch_rows(dataset.gather({7, 2, 2, 9, 0}), {7, 2, 2, 9, 0});
  check_batch_rows(dataset.gather({}), {});
  const TensorDataset head = dataset.head(3);
  CHECK(head.size() == 3);
  check_batch_rows(head.gather({2, 0, 1}), {2, 0, 1});
  CHECK(dataset.head(0).size() == 0);
  CHECK(dataset.head(10).size() == 10);
}

namespace {

// The documents of the given rows of dataset_with_documents, in order.
std::vector<std::int64_t> documents_of_rows(const Indices& rows) {
  std::vector<std::int64_t> documents;
  for (const std::int64_t i : rows) documents.insert(documents.end(), {1000 * i, 1000 * i + 1, 1000 * i + 2});
  return documents;
}

// Row i of `n`: inputs i, 10 i, 100 i as above, documents 1000 i + 0, 1, 2.
TensorDataset dataset_with_documents(std::int64_t n) {
  Indices rows(static_cast<std::size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  const Batch all = numbered_dataset(n).gather(rows);
  return TensorDataset(all.inputs, all.targets, from_vector(documents_of_rows(rows), {n, 3}));
}

}  // namespace

TEST_CASE("a TensorDataset's documents follow its rows: gather, head, rows_of and to_device",
          "[data][loader]") {
  const TensorDataset dataset = dataset_with_documents(6);
  const Batch batch = dataset.gather({4, 1, 5, 0});
  check_batch_rows(batch, {4, 1, 5, 0});
  CHECK(batch.documents.to_vector<std::int64_t>() == documents_of_rows({4, 1, 5, 0}));
  CHECK(dataset.head(2).gather({1}).documents.to_vector<std::int64_t>() == documents_of_rows({1}));
  const Batch middle = data::rows_of(batch, {.first = 1, .count = 2});
  CHECK(middle.documents.to_vector<std::int64_t>() == documents_of_rows({1, 5}));
  CHECK(to_device(batch, Device::cpu()).documents.storage() == batch.documents.storage());
  CHECK_FALSE(numbered_dataset(3).gather({0}).documents.defined());
  CHECK_FALSE(
      data::rows_of(numbered_dataset(3).gather({0, 1}), {.first = 0, .count = 1}).documents.defined());
  CHECK_THROWS_EXACT(TensorDataset(zeros({2, 3}), zeros({2}), zeros({2, 3}, dtype(DType::i32))),
                     "TensorDataset: documents must be i64 [2, 3] like the inputs, got i32 [2, 3]");
  CHECK_THROWS_EXACT(TensorDataset(zeros({2, 3}), zeros({2}), zeros({2, 4}, dtype(DType::i64))),
                     "TensorDataset: documents must be i64 [2, 3] like the inputs, got i64 [2, 4]");
}

TEST_CASE("to_device keeps a batch already there as it is", "[data][loader]") {
  const Batch batch = numbered_dataset(6).gather({4, 1});
  const Batch same = to_device(batch, Device::cpu());
  CHECK(same.inputs.storage() == batch.inputs.storage());
  CHECK(same.targets.storage() == batch.targets.storage());
  CHECK(same.sample_indices == batch.sample_indices);
}

TEST_CASE("to_device sends a batch to a GPU through pinned host memory", "[data][loader][cuda]") {
  const Batch batch = numbered_dataset(6).gather({4, 1, 5});
  const Batch sent = to_device(batch, Device::cuda(0));
  CHECK(sent.inputs.device() == Device::cuda(0));
  CHECK(sent.targets.device() == Device::cuda(0));
  CHECK(sent.sample_indices == batch.sample_indices);
  CHECK(sent.inputs.to(Device::cpu()).to_vector<float>() == batch.inputs.to_vector<float>());
  CHECK(sent.targets.to(Device::cpu()).to_vector<std::int64_t>() == batch.targets.to_vector<std::int64_t>());
  check_batch_rows(to_device(sent, Device::cpu()), {4, 1, 5});
  CHECK_FALSE(sent.documents.defined());
  const Batch documented = to_device(dataset_with_documents(6).gather({4, 1}), Device::cuda(0));
  CHECK(documented.documents.device() == Device::cuda(0));
  CHECK(documented.documents.to(Device::cpu()).to_vector<std::int64_t>() == documents_of_rows({4, 1}));
}

TEST_CASE("DataLoader and TensorDataset refuse bad arguments", "[data][loader][errors]") {
  const TensorDataset dataset = numbered_dataset(10);
  CHECK_THROWS_EXACT(DataLoader(dataset, 0, std::make_shared<SequentialSampler>(10)),
                     "DataLoader: batch_size must be positive, got 0");
  CHECK_THROWS_EXACT(DataLoader(dataset, -3, std::make_shared<SequentialSampler>(10)),
                     "DataLoader: batch_size must be positive, got -3");
  CHECK_THROWS_EXACT(DataLoader(dataset, 2, nullptr), "DataLoader: sampler must not be null");
  // A sampler made for a bigger dataset is caught before any batch is built.
  const DataLoader mismatched(dataset, 4, std::make_shared<SequentialSampler>(12));
  CHECK_THROWS_EXACT(mismatched.batch_indices(0),
                     "DataLoader: the sampler yields index 10 but the dataset has 10 samples");

  CHECK_THROWS_EXACT(TensorDataset(zeros({10, 3}), zeros({9})),
                     "TensorDataset: inputs have 10 rows but targets have 9");
  CHECK_THROWS_EXACT(TensorDataset(scalar_tensor(1.0), zeros({1})),
                     "TensorDataset: inputs [] and targets [1] need a leading sample dimension");
  CHECK_THROWS_EXACT(TensorDataset(Tensor(), zeros({1})),
                     "TensorDataset: inputs and targets must both be defined");
  CHECK_THROWS_EXACT(dataset.gather({1, 10}),
                     "TensorDataset::gather: index 10 is out of range for 10 samples");
  CHECK_THROWS_EXACT(dataset.gather({-1}), "TensorDataset::gather: index -1 is out of range for 10 samples");
  CHECK_THROWS_EXACT(dataset.head(11), "TensorDataset::head: n = 11 is outside [0, 10] (the dataset size)");
  if (!cuda::available()) {
    CHECK_THROWS_ERROR(to_device(dataset.gather({1}), Device::cuda(0)), cuda::unavailable_reason());
  }
  CHECK_THROWS_EXACT(dataset.head(-1), "TensorDataset::head: n = -1 is outside [0, 10] (the dataset size)");
}

TEST_CASE("micro_batch_rows: consecutive parts, the first ones larger, whole chunks, fewer for a short batch",
          "[data][loader][accumulation][errors]") {
  using Parts = std::vector<std::pair<std::int64_t, std::int64_t>>;  // (first, count)
  const auto parts = [](std::int64_t rows, int count, std::int64_t chunk) {
    Parts out;
    for (const data::ChunkShare& part : data::micro_batch_rows(rows, count, chunk))
      out.emplace_back(part.first, part.count);
    return out;
  };
  CHECK(parts(10, 1, 0) == Parts{{0, 10}});
  CHECK(parts(10, 4, 0) == Parts{{0, 3}, {3, 3}, {6, 2}, {8, 2}});
  CHECK(parts(2, 4, 0) == Parts{{0, 1}, {1, 1}});           // a padded last batch: one row each
  CHECK(parts(12, 3, 3) == Parts{{0, 6}, {6, 3}, {9, 3}});  // 4 chunks of 3 in 3 parts
  CHECK(parts(6, 4, 3) == Parts{{0, 3}, {3, 3}});
  CHECK_THROWS_EXACT(
      data::micro_batch_rows(10, 0, 0),
      "micro-batches: 0 of a batch of 10 rows in chunks of 1: need at least one micro-batch and "
      "whole chunks");
  CHECK_THROWS_EXACT(
      data::micro_batch_rows(10, 2, 4),
      "micro-batches: 2 of a batch of 10 rows in chunks of 4: need at least one micro-batch and "
      "whole chunks");

  // rows_of: the rows, their targets and their dataset indices.
  const data::Batch batch{.inputs = from_vector(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7}, Shape{4, 2}),
                          .targets = from_vector(std::vector<std::int64_t>{10, 11, 12, 13}),
                          .sample_indices = {40, 41, 42, 43}};
  const data::Batch middle = data::rows_of(batch, {.first = 1, .count = 2});
  CHECK((middle.inputs.size(0) == 2 && middle.inputs.size(1) == 2));
  CHECK(middle.inputs.to_vector<float>() == std::vector<float>{2, 3, 4, 5});
  CHECK(middle.targets.to_vector<std::int64_t>() == std::vector<std::int64_t>{11, 12});
  CHECK(middle.sample_indices == std::vector<std::int64_t>{41, 42});
  CHECK_THROWS_EXACT(data::rows_of(batch, {.first = 3, .count = 2}), "rows_of: rows [3, 5) of a batch of 4");
}

TEST_CASE("evaluation_forwards: consecutive rows per rank in forwards of a batch, or a forward per chunk",
          "[data][loader][evaluation][errors]") {
  using Parts = std::vector<std::pair<std::int64_t, std::int64_t>>;  // (first, count)
  const auto forwards = [](std::int64_t rows, int ranks, int rank, std::int64_t batch, std::int64_t chunk) {
    const data::EvaluationForwards out =
        data::evaluation_forwards(rows, {.world_size = ranks, .rank = rank, .chunk = chunk}, batch);
    Parts parts;
    for (const data::ChunkShare& part : out.mine) parts.emplace_back(part.first, part.count);
    return std::pair{parts, out.every_rank};
  };
  // 10 rows over 3 ranks: 4, 3 and 3 consecutive rows, in forwards of 2 rows: two forwards each.
  CHECK(forwards(10, 3, 0, 2, 0) == std::pair{Parts{{0, 2}, {2, 2}}, std::int64_t{2}});
  CHECK(forwards(10, 3, 1, 2, 0) == std::pair{Parts{{4, 2}, {6, 1}}, std::int64_t{2}});
  CHECK(forwards(10, 3, 2, 2, 0) == std::pair{Parts{{7, 2}, {9, 1}}, std::int64_t{2}});
  // Forwards of 3: rank 0 needs two, the others one each and run a second uncounted.
  CHECK(forwards(10, 3, 0, 3, 0) == std::pair{Parts{{0, 3}, {3, 1}}, std::int64_t{2}});
  CHECK(forwards(10, 3, 2, 3, 0) == std::pair{Parts{{7, 3}}, std::int64_t{2}});
  // 2 rows over 3 ranks: the last rank has none and forwards once uncounted.
  CHECK(forwards(2, 3, 1, 4, 0) == std::pair{Parts{{1, 1}}, std::int64_t{1}});
  CHECK(forwards(2, 3, 2, 4, 0) == std::pair{Parts{}, std::int64_t{1}});
  // Bitwise, 10 rows in chunks of 4 (4, 4 and a last one of 2) over 2 ranks: chunks 0 and 1, then 2; a
  // forward per chunk whatever the batch.
  CHECK(forwards(10, 2, 0, 8, 4) == std::pair{Parts{{0, 4}, {4, 4}}, std::int64_t{2}});
  CHECK(forwards(10, 2, 1, 8, 4) == std::pair{Parts{{8, 2}}, std::int64_t{2}});
  // One rank: every chunk; 8 rows in 2 chunks over 3 ranks: the last rank none.
  CHECK(forwards(10, 1, 0, 1, 4) == std::pair{Parts{{0, 4}, {4, 4}, {8, 2}}, std::int64_t{3}});
  CHECK(forwards(8, 3, 2, 8, 4) == std::pair{Parts{}, std::int64_t{1}});
  CHECK_THROWS_EXACT(data::evaluation_forwards(0, {.world_size = 2, .rank = 0}, 4),
                     "evaluation_forwards: 0 rows in forwards of 4 (chunks of 0) over rank 0 of 2");
  CHECK_THROWS_EXACT(data::evaluation_forwards(5, {.world_size = 2, .rank = 1}, 0),
                     "evaluation_forwards: 5 rows in forwards of 0 (chunks of 0) over rank 1 of 2");
}
