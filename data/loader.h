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
};

// Samples are rows (dim 0) of `inputs` and `targets`.
class TensorDataset {
 public:
  TensorDataset(Tensor inputs, Tensor targets);
  std::int64_t size() const { return inputs_.size(0); }
  // A batch of the given rows, in that order.
  Batch gather(const std::vector<std::int64_t>& indices) const;
  // The first n samples (n <= size).
  TensorDataset head(std::int64_t n) const;

 private:
  Tensor inputs_, targets_;
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

class DataLoader {
 public:
  DataLoader(const TensorDataset& dataset, std::int64_t batch_size, std::shared_ptr<const Sampler> sampler,
             bool drop_last = false);
  // The batches of one epoch, in order (the last may be smaller unless drop_last).
  std::vector<std::vector<std::int64_t>> batch_indices(std::int64_t epoch) const;
  std::int64_t batches_per_epoch() const;
  Batch batch(const std::vector<std::int64_t>& indices) const { return dataset_.gather(indices); }

 private:
  TensorDataset dataset_;
  std::int64_t batch_size_;
  std::shared_ptr<const Sampler> sampler_;
  bool drop_last_;
};

// --- Global batches over ranks -------------------------------------------------------------------

// A run is described by its global batch G (what one process would train on); on W ranks each
// rank takes G / W rows of every global batch.
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
};

// G / W; throws naming both unless G is a positive multiple of W.
std::int64_t per_rank_batch_size(std::int64_t global_batch, int world_size);

// Rank `rank`'s loader: DistributedSampler(shuffle, seed) and batches of G / W. The union of
// the ranks' k-th batches is the k-th batch of DataLoader(dataset, G, RandomSampler(seed) (or
// SequentialSampler)) on one process, for every complete global batch; rank r holds rows
// r, r + W, r + 2W, ... of it.
DataLoader rank_loader(const TensorDataset& dataset, const GlobalBatch& batch);

}  // namespace shardlab::data
