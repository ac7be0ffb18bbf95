// autograd/shard_info.h: what a Variable holding one rank's part of a parameter knows of the whole
// (FSDP's shards, as PyTorch's DTensor), so that the layers below dist/ (optim's gradient norm,
// state dicts, checkpoints) can treat a shard as the parameter it is part of.
//
// One parameter is two Variables after dist::fully_shard:
//   - the layer's own member (`Linear::weight`), with the whole shape, which forward and backward
//     compute with: the unit's all-gather makes it a view of the gathered buffer for the forward
//     (and again for the backward), and resharding frees those bytes, so that between steps it
//     holds none (unless resharding is turned off);
//   - the shard, which the module registers under the parameter's name in its place
//     (nn::Module::replace_parameter): this rank's f32 elements, 1-D, with a ShardInfo. It is what
//     named_parameters(), the optimizer, clipping and checkpoints see, and where the reduce-scatter
//     leaves this rank's part of the gradient.
// dist/fsdp/unit.h holds both for each parameter of a unit (its slots and sharded_parameters()).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "core/tensor.h"

namespace shardlab {

// The ranks that hold the parts of a sharded parameter (dist implements it over a communicator).
class ShardRanks {
 public:
  virtual ~ShardRanks() = default;
  // `value` (a one-element tensor, or an exact sum's limbs) summed elementwise over those ranks, on
  // the ranks' device: a collective, which each of them calls in the same order. No host wait on a
  // GPU with NCCL.
  virtual Tensor sum(const Tensor& value) const = 0;
};

// What a Variable holding one rank's part of a larger parameter knows of the whole: FSDP's
// parameters after fully_shard (dist/fsdp/fsdp.h), as PyTorch's DTensor. Its data() and grad()
// are this rank's elements, 1-D, while shape(), dim(), size() and numel() answer for the whole.
struct ShardInfo {
  Shape full_shape;
  std::int64_t first = 0, count = 0;  // elements [first, first + count) of the flattened parameter
  // "Shard(flat) elements [12, 40) of 64, rank 1 of 2", or "Replicate" (every rank holds all).
  std::string placement;
  // Whether this rank's elements are the copy that counts in sums over the ranks (replicated
  // parts are held by several).
  bool counts_once = true;
  std::shared_ptr<const ShardRanks> ranks;  // never null
  // When the parameter is itself one piece of a larger one (tensor parallelism's split, which FSDP
  // then shards): the whole's shape, and the piece's place in it, along `dim` from `offset`,
  // full_shape[dim] long. None: full_shape is the whole.
  struct Piece {
    Shape whole;
    int dim = 0;
    std::int64_t offset = 0;
  };
  std::optional<Piece> piece;
};

}  // namespace shardlab
