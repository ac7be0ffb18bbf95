// data/loader.cpp: TensorDataset, the samplers (sequential, Philox-shuffled, distributed) and
// the DataLoader's batching.
#include "data/loader.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/error.h"
#include "core/ops.h"
#include "core/random.h"

namespace shardlab::data {

namespace {

void check_size(const char* op, std::int64_t size) {
  SHARDLAB_CHECK(size >= 0, "{}: dataset size must be non-negative, got {}", op, size);
}

void check_epoch(const char* op, std::int64_t epoch) {
  SHARDLAB_CHECK(epoch >= 0, "{}: epoch must be non-negative, got {}", op, epoch);
}

}  // namespace

// --- TensorDataset ---------------------------------------------------------------------------

TensorDataset::TensorDataset(Tensor inputs, Tensor targets, Tensor documents)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), documents_(std::move(documents)) {
  SHARDLAB_CHECK(inputs_.defined() && targets_.defined(),
                 "TensorDataset: inputs and targets must both be defined");
  SHARDLAB_CHECK(inputs_.dim() >= 1 && targets_.dim() >= 1,
                 "TensorDataset: inputs {} and targets {} need a leading sample dimension",
                 shape_str(inputs_.shape()), shape_str(targets_.shape()));
  SHARDLAB_CHECK(inputs_.size(0) == targets_.size(0),
                 "TensorDataset: inputs have {} rows but targets have {}", inputs_.size(0), targets_.size(0));
  SHARDLAB_CHECK(
      !documents_.defined() || (documents_.shape() == inputs_.shape() && documents_.dtype() == DType::i64),
      "TensorDataset: documents must be i64 {} like the inputs, got {} {}", shape_str(inputs_.shape()),
      dtype_name(documents_.dtype()), shape_str(documents_.shape()));
}

Batch TensorDataset::gather(const std::vector<std::int64_t>& indices) const {
  for (const std::int64_t index : indices) {
    SHARDLAB_CHECK(index >= 0 && index < size(),
                   "TensorDataset::gather: index {} is out of range for {} samples", index, size());
  }
  const Tensor rows = from_vector(indices);
  const auto selected = [&](const Tensor& t) {
    return t.defined() ? index_select(t, 0, rows.to(t.device())) : t;
  };
  return Batch{selected(inputs_), selected(targets_), indices, selected(documents_)};
}

namespace {

Tensor sent_to(const Tensor& tensor, Device device) {
  if (!tensor.defined() || tensor.device() == device) return tensor;
  if (tensor.device().is_cpu() && device.is_cuda())
    return tensor.pin_memory().to(device, /*non_blocking=*/true);
  return tensor.to(device);
}

}  // namespace

Batch to_device(Batch batch, Device device) {
  batch.inputs = sent_to(batch.inputs, device);
  batch.targets = sent_to(batch.targets, device);
  batch.documents = sent_to(batch.documents, device);
  return batch;
}

TensorDataset TensorDataset::head(std::int64_t n) const {
  SHARDLAB_CHECK(n >= 0 && n <= size(), "TensorDataset::head: n = {} is outside [0, {}] (the dataset size)",
                 n, size());
  const auto first = [n](const Tensor& t) { return t.defined() ? t.narrow(0, 0, n) : t; };
  return TensorDataset(first(inputs_), first(targets_), first(documents_));
}

// --- samplers -------------------------------------------------------------------------------------

SequentialSampler::SequentialSampler(std::int64_t size) : size_(size) {
  check_size("SequentialSampler", size);
}

std::vector<std::int64_t> SequentialSampler::indices(std::int64_t epoch) const {
  check_epoch("SequentialSampler", epoch);
  std::vector<std::int64_t> order(static_cast<std::size_t>(size_));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  return order;
}

std::vector<std::int64_t> permutation(std::int64_t size, std::uint64_t seed, std::int64_t epoch) {
  check_size("permutation", size);
  check_epoch("permutation", epoch);
  // One f64 key per index from Philox stream `epoch`; sorting the keys gives a uniformly random
  // order that any rank recomputes bit for bit. The stable sort settles (unlikely) equal keys
  // by index, so the result is still a pure function of (size, seed, epoch).
  const Tensor keys = uniform({size}, RandomKey{seed, static_cast<std::uint64_t>(epoch)}, 0.0, 1.0,
                              TensorOptions{}.with_dtype(DType::f64));
  const double* key = keys.data<double>();
  std::vector<std::int64_t> order(static_cast<std::size_t>(size));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [key](std::int64_t a, std::int64_t b) { return key[a] < key[b]; });
  return order;
}

RandomSampler::RandomSampler(std::int64_t size, std::uint64_t seed) : size_(size), seed_(seed) {
  check_size("RandomSampler", size);
}

std::vector<std::int64_t> RandomSampler::indices(std::int64_t epoch) const {
  return permutation(size_, seed_, epoch);
}

DistributedSampler::DistributedSampler(std::int64_t size, int world_size, int rank, bool shuffle,
                                       std::uint64_t seed, bool drop_last)
    : size_(size),
      world_size_(world_size),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  check_size("DistributedSampler", size);
  SHARDLAB_CHECK(world_size > 0, "DistributedSampler: world_size must be positive, got {}", world_size);
  SHARDLAB_CHECK(rank >= 0 && rank < world_size, "DistributedSampler: rank {} is outside [0, {})", rank,
                 world_size);
}

std::int64_t DistributedSampler::samples_per_rank() const {
  // PyTorch: ceil((n - w) / w) when dropping a ragged tail, which is floor(n / w); else ceil(n / w).
  const std::int64_t world = world_size_;
  return drop_last_ ? size_ / world : (size_ + world - 1) / world;
}

std::vector<std::int64_t> DistributedSampler::indices(std::int64_t epoch) const {
  check_epoch("DistributedSampler", epoch);
  std::vector<std::int64_t> order =
      shuffle_ ? permutation(size_, seed_, epoch) : SequentialSampler(size_).indices(0);
  const std::int64_t per_rank = samples_per_rank();
  const std::int64_t total = per_rank * world_size_;
  // Padding repeats the order from its start, as often as needed (PyTorch's
  // `(indices * ceil(pad / len(indices)))[:pad]`), so every rank gets per_rank samples.
  for (std::int64_t i = size_; i < total; ++i) order.push_back(order[static_cast<std::size_t>(i % size_)]);
  std::vector<std::int64_t> mine;
  mine.reserve(static_cast<std::size_t>(per_rank));
  for (std::int64_t i = rank_; i < total; i += world_size_)
    mine.push_back(order[static_cast<std::size_t>(i)]);
  return mine;
}

// --- DataLoader -----------------------------------------------------------------------------------

DataLoader::DataLoader(const TensorDataset& dataset, std::int64_t batch_size,
                       std::shared_ptr<const Sampler> sampler, bool drop_last, RankShare share)
    : dataset_(dataset),
      batch_size_(batch_size),
      sampler_(std::move(sampler)),
      drop_last_(drop_last),
      share_(share) {
  SHARDLAB_CHECK(batch_size > 0, "DataLoader: batch_size must be positive, got {}", batch_size);
  SHARDLAB_CHECK(sampler_ != nullptr, "DataLoader: sampler must not be null");
  rank_batch_size(batch_size, share.world_size, share.rank);  // checks the share
  if (share.chunk != 0) chunk_share(batch_size, share);
}

std::vector<std::vector<std::int64_t>> DataLoader::batch_indices(std::int64_t epoch) const {
  std::vector<std::int64_t> order = sampler_->indices(epoch);
  for (const std::int64_t index : order) {
    SHARDLAB_CHECK(index >= 0 && index < dataset_.size(),
                   "DataLoader: the sampler yields index {} but the dataset has {} samples", index,
                   dataset_.size());
  }
  const auto count = static_cast<std::int64_t>(order.size());
  const std::int64_t world = share_.world_size, tail = count % batch_size_;
  if ((world > 1 || share_.chunk > 0) && !drop_last_ && tail > 0) {
    // Capped at batch_size: a last batch padded past it would be two batches, one rank short.
    const std::int64_t padded =
        share_.chunk > 0 ? batch_size_ : std::min(batch_size_, (tail + world - 1) / world * world);
    for (std::int64_t i = count; i < count - tail + padded; ++i)
      order.push_back(order[static_cast<std::size_t>(i % count)]);
  }
  const auto total = static_cast<std::int64_t>(order.size());
  std::vector<std::vector<std::int64_t>> batches;
  for (std::int64_t start = 0; start < total; start += batch_size_) {
    const std::int64_t end = std::min(total, start + batch_size_);
    if (drop_last_ && end - start < batch_size_) break;
    std::vector<std::int64_t>& batch = batches.emplace_back();
    if (share_.chunk > 0) {
      const ChunkShare mine = chunk_share(batch_size_, share_);
      batch.assign(order.begin() + start + mine.first, order.begin() + start + mine.first + mine.count);
      continue;
    }
    for (std::int64_t i = start + share_.rank; i < end; i += world)
      batch.push_back(order[static_cast<std::size_t>(i)]);
  }
  return batches;
}

std::int64_t DataLoader::batches_per_epoch() const {
  // Samplers do not expose their length, and every epoch of every sampler has the same one.
  const auto count = static_cast<std::int64_t>(sampler_->indices(0).size());
  return drop_last_ ? count / batch_size_ : (count + batch_size_ - 1) / batch_size_;
}

// --- Global batches over ranks -------------------------------------------------------------------

std::int64_t rank_batch_size(std::int64_t global_batch, int world_size, int rank) {
  SHARDLAB_CHECK(world_size > 0, "global batch: world_size must be positive, got {}", world_size);
  SHARDLAB_CHECK(rank >= 0 && rank < world_size, "global batch: rank {} is outside [0, {})", rank,
                 world_size);
  SHARDLAB_CHECK(global_batch >= world_size,
                 "global batch: {} is smaller than the {} ranks (every rank needs a sample per step)",
                 global_batch, world_size);
  return (global_batch - rank + world_size - 1) / world_size;
}

ChunkShare chunk_share(std::int64_t batch_size, const RankShare& share) {
  SHARDLAB_CHECK(share.chunk > 0 && batch_size % share.chunk == 0,
                 "global batch: {} does not cut into chunks of {}", batch_size, share.chunk);
  const std::int64_t chunks = batch_size / share.chunk;
  SHARDLAB_CHECK(
      chunks >= share.world_size,
      "global batch: {} in chunks of {} makes {} chunks, fewer than the {} ranks (every rank needs a "
      "whole chunk per step)",
      batch_size, share.chunk, chunks, share.world_size);
  const std::int64_t base = chunks / share.world_size, extra = chunks % share.world_size;
  const std::int64_t before = share.rank * base + std::min<std::int64_t>(share.rank, extra);
  return {before * share.chunk, (base + (share.rank < extra ? 1 : 0)) * share.chunk};
}

std::vector<ChunkShare> micro_batch_rows(std::int64_t rows, int count, std::int64_t chunk) {
  const std::int64_t unit = chunk > 0 ? chunk : 1;
  SHARDLAB_CHECK(count >= 1 && rows >= unit && rows % unit == 0,
                 "micro-batches: {} of a batch of {} rows in chunks of {}: need at least one micro-batch and "
                 "whole chunks",
                 count, rows, unit);
  const int parts = static_cast<int>(std::min<std::int64_t>(count, rows / unit));
  std::vector<ChunkShare> out;
  for (int part = 0; part < parts; ++part)
    out.push_back(chunk_share(rows, {.world_size = parts, .rank = part, .chunk = unit}));
  return out;
}

namespace {

// Rank `rank`'s parts under evaluation_forwards.
std::vector<ChunkShare> evaluation_parts(std::int64_t rows, const RankShare& share, int rank,
                                         std::int64_t batch) {
  std::vector<ChunkShare> parts;
  if (share.chunk > 0) {
    const std::int64_t chunks = (rows + share.chunk - 1) / share.chunk;
    const std::int64_t base = chunks / share.world_size, extra = chunks % share.world_size;
    const std::int64_t first = rank * base + std::min<std::int64_t>(rank, extra);
    for (std::int64_t c = first; c < first + base + (rank < extra ? 1 : 0); ++c)
      parts.push_back({c * share.chunk, std::min(share.chunk, rows - c * share.chunk)});
    return parts;
  }
  // rank_batch_size's counts, where a set smaller than the world leaves the last ranks none.
  const auto count = [&](int r) {
    return std::max<std::int64_t>(0, (rows - r + share.world_size - 1) / share.world_size);
  };
  std::int64_t first = 0;
  for (int before = 0; before < rank; ++before) first += count(before);
  const std::int64_t end = first + count(rank);
  for (std::int64_t start = first; start < end; start += batch)
    parts.push_back({start, std::min(batch, end - start)});
  return parts;
}

}  // namespace

EvaluationForwards evaluation_forwards(std::int64_t rows, const RankShare& share, std::int64_t batch) {
  SHARDLAB_CHECK(rows >= 1 && batch >= 1 && share.chunk >= 0 && share.world_size >= 1 && share.rank >= 0 &&
                     share.rank < share.world_size,
                 "evaluation_forwards: {} rows in forwards of {} (chunks of {}) over rank {} of {}", rows,
                 batch, share.chunk, share.rank, share.world_size);
  EvaluationForwards out{.mine = evaluation_parts(rows, share, share.rank, batch)};
  for (int rank = 0; rank < share.world_size; ++rank) {
    out.every_rank = std::max<std::int64_t>(
        out.every_rank, static_cast<std::int64_t>(evaluation_parts(rows, share, rank, batch).size()));
  }
  return out;
}

Batch rows_of(const Batch& batch, const ChunkShare& part) {
  SHARDLAB_CHECK(part.first >= 0 && part.count >= 1 && part.first + part.count <= batch.inputs.size(0),
                 "rows_of: rows [{}, {}) of a batch of {}", part.first, part.first + part.count,
                 batch.inputs.size(0));
  const auto begin = batch.sample_indices.begin() + part.first;
  const auto rows = [&](const Tensor& t) {
    return t.defined() ? t.narrow(0, part.first, part.count).contiguous() : t;
  };
  return {.inputs = rows(batch.inputs),
          .targets = rows(batch.targets),
          .sample_indices = {begin, begin + part.count},
          .documents = rows(batch.documents)};
}

DataLoader rank_loader(const TensorDataset& dataset, const GlobalBatch& batch) {
  std::shared_ptr<const Sampler> sampler;
  if (batch.shuffle) {
    sampler = std::make_shared<RandomSampler>(dataset.size(), batch.seed);
  } else {
    sampler = std::make_shared<SequentialSampler>(dataset.size());
  }
  return DataLoader(dataset, batch.size, std::move(sampler), batch.drop_last,
                    {.world_size = batch.world_size, .rank = batch.rank, .chunk = batch.chunk});
}

}  // namespace shardlab::data
