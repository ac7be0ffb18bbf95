// data/loader.h: datasets, samplers and the DataLoader. Every batch carries the global
// (dataset) index of each of its rows: dropout keys its masks by it, so a batch split across
// ranks trains exactly like the whole batch on one process.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace shardlab::data {

struct Batch {
  Tensor inputs;
  Tensor targets;
  std::vector<std::int64_t> sample_indices;  // dataset index of each row
  Tensor documents;  // i64 like inputs, each input's document within its row, where the dataset has them
};

// The batch with its tensors on `device`. To a GPU each CPU tensor is copied once into pinned
// host memory and sent from there without the host waiting (Tensor::to with non_blocking): the
// copy runs on the device's current stream ahead of the step's kernels while the host goes on
// queueing them. Throws, as Tensor::to does, when the device is not usable.
Batch to_device(Batch batch, Device device);

// Samples are rows (dim 0) of `inputs` and `targets`, and of `documents` where given (i64 in inputs'
// shape: each input's document, for attention that stays within one; Batch::documents).
class TensorDataset {
 public:
  TensorDataset(Tensor inputs, Tensor targets, Tensor documents = {});
  std::int64_t size() const { return inputs_.size(0); }
  // A batch of the given rows, in that order.
  Batch gather(const std::vector<std::int64_t>& indices) const;
  // The first n samples (n <= size).
  TensorDataset head(std::int64_t n) const;

 private:
  Tensor inputs_, targets_, documents_;
};

// The order in which an epoch visits the dataset's indices.
class Sampler {
 public:
  virtual ~Sampler() = default;
  virtual std::vector<std::int64_t> indices(std::int64_t epoch) const = 0;
};

// 0, 1, ..., n-1 every epoch.
class SequentialSampler final : public Sampler {
 public:
  explicit SequentialSampler(std::int64_t size);
  std::vector<std::int64_t> indices(std::int64_t epoch) const override;

 private:
  std::int64_t size_;
};

// A permutation of 0..n-1 that depends only on (size, seed, epoch), so every rank and every
// run computes the same one: the stable argsort of n uniform f64 keys drawn from Philox with
// RandomKey{seed, epoch}.
std::vector<std::int64_t> permutation(std::int64_t size, std::uint64_t seed, std::int64_t epoch);

class RandomSampler final : public Sampler {
 public:
  RandomSampler(std::int64_t size, std::uint64_t seed);
  std::vector<std::int64_t> indices(std::int64_t epoch) const override;

 private:
  std::int64_t size_;
  std::uint64_t seed_;
};

// PyTorch's DistributedSampler: the (shuffled) order is cut to a multiple of world_size
// (drop_last) or padded with its own first indices, and rank r takes positions
// r, r + world_size, ... So with the per-rank batch B, the union of the ranks' k-th batches
// is the 1-rank k-th batch of B * world_size.
class DistributedSampler final : public Sampler {
 public:
  DistributedSampler(std::int64_t size, int world_size, int rank, bool shuffle, std::uint64_t seed,
                     bool drop_last = false);
  std::vector<std::int64_t> indices(std::int64_t epoch) const override;
  std::int64_t samples_per_rank() const;

 private:
  std::int64_t size_;
  int world_size_, rank_;
  bool shuffle_;
  std::uint64_t seed_;
  bool drop_last_;
};

// One rank's part of every batch when `world_size` ranks split it: rows rank, rank + W, ... of
// the batch. Batch sizes need not divide by W: rank r holds ceil((B - r) / W) rows of a batch of B.
// With `chunk` > 0 (bitwise training, autograd::BatchChunking) the batch is cut into chunks of that
// many consecutive rows and each rank takes consecutive whole chunks, the first ranks one more where
// the chunks do not divide by W (64 rows in chunks of 16 over 3 ranks: 32, 16, 16).
struct RankShare {
  int world_size = 1;
  int rank = 0;
  std::int64_t chunk = 0;
};

// Rows [first, first + count) of a batch of `batch_size` that a rank takes under `share`, whose
// chunk is set; throws unless the chunk divides the batch into at least W chunks.
struct ChunkShare {
  std::int64_t first = 0, count = 0;
};
ChunkShare chunk_share(std::int64_t batch_size, const RankShare& share);

// Gradient accumulation's micro-batches of a rank's batch of `rows` rows: `count` parts of consecutive
// rows, whole chunks of `chunk` rows each where chunk > 0 (bitwise training), as equal as that allows
// and the first ones larger; fewer parts where the batch holds fewer rows (or chunks) than `count` (an
// epoch's padded last batch, which every rank holds alike). `rows` must be whole chunks, `count` >= 1.
std::vector<ChunkShare> micro_batch_rows(std::int64_t rows, int count, std::int64_t chunk);

// An evaluation's forwards over a held-out set of `rows` samples that `share.world_size` ranks split:
// each rank's consecutive rows (rank_batch_size's counts, the first ranks one more, none for the last
// ranks of a set smaller than the world) in parts of at most `batch` rows. With `share.chunk` > 0
// (bitwise training) the set is cut into chunks of that many rows (the last one shorter where they do not
// divide it), each rank takes consecutive whole chunks (chunk_share's split) and a forward per chunk: every
// chunk is computed in a forward of its own shape, whatever the world size. `every_rank` is the most
// forwards any rank runs: FSDP's gathers are collectives, so a rank with fewer runs the rest again
// without counting them.
struct EvaluationForwards {
  std::vector<ChunkShare> mine;  // this rank's rows, a part per forward (none where it has no rows)
  std::int64_t every_rank = 0;
};
EvaluationForwards evaluation_forwards(std::int64_t rows, const RankShare& share, std::int64_t batch);

// Rows [part.first, part.first + part.count) of `batch`, a batch of their own (views of its tensors).
Batch rows_of(const Batch& batch, const ChunkShare& part);

class DataLoader {
 public:
  // Batches of `batch_size` consecutive samples of the sampler's order, or with a RankShare of
  // W > 1, this rank's rows of them. Then, without drop_last, the incomplete last batch is padded
  // with the order's first samples to a multiple of W (at most batch_size), as DistributedSampler
  // pads, so that every rank has as many batches as one process and none is empty. With a chunk,
  // at any W, it is padded to batch_size: every batch is cut into the same chunks.
  DataLoader(const TensorDataset& dataset, std::int64_t batch_size, std::shared_ptr<const Sampler> sampler,
             bool drop_last = false, RankShare share = {});
  // The batches of one epoch, in order (the last may be smaller unless drop_last).
  std::vector<std::vector<std::int64_t>> batch_indices(std::int64_t epoch) const;
  std::int64_t batches_per_epoch() const;
  Batch batch(const std::vector<std::int64_t>& indices) const { return dataset_.gather(indices); }

 private:
  TensorDataset dataset_;
  std::int64_t batch_size_;
  std::shared_ptr<const Sampler> sampler_;
  bool drop_last_;
  RankShare share_;
};

// --- Global batches over ranks -------------------------------------------------------------------

// A run is described by its global batch G (what one process would train on); on W ranks rank r
// takes rows r, r + W, ... of every global batch: G / W of them when W divides G, else
// ceil((G - r) / W). Losses summed over each rank's rows and scaled by W before FSDP averages
// the gradients are the global batch's, whatever the shares.
struct GlobalBatch {
  std::int64_t size = 0;  // G
  int world_size = 1;     // W
  int rank = 0;
  bool shuffle = true;
  std::uint64_t seed = 0;
  // Drop an incomplete last global batch. Without it, the last batch is completed to a
  // multiple of W with samples from the start of the epoch's order (DistributedSampler's
  // padding), so every rank trains the same number of batches of equal size.
  bool drop_last = false;
  std::int64_t chunk = 0;  // RankShare::chunk: whole chunks of G per rank
};

// Rank `rank`'s rows of each complete global batch, ceil((G - rank) / W); throws naming G and W
// unless every rank gets at least one (G >= W).
std::int64_t rank_batch_size(std::int64_t global_batch, int world_size, int rank);

// Rank `rank`'s loader: DataLoader(dataset, G, RandomSampler(seed) (or SequentialSampler),
// drop_last, {W, rank}). The union of the ranks' k-th batches is the k-th batch of that loader on
// one process, for every complete global batch. When W divides G this is DistributedSampler's split
// with batches of G / W.
DataLoader rank_loader(const TensorDataset& dataset, const GlobalBatch& batch);

}  // namespace shardlab::data
