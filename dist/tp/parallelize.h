// dist/tp/parallelize.h: tensor parallelism applied to an unchanged model by a plan, as PyTorch's
// parallelize_module: each module named in the plan keeps this rank's piece of its parameters and
// gets hooks that place the group's collectives (dist/tp/regions.h) around its forward.
//
//   dist::parallelize_module(*model, mesh["tp"], {
//       {"model.layers.*.self_attn", dist::ParallelStyle::region_input},  // one f for q, k and v
//       {"model.layers.*.self_attn.q_proj", dist::ParallelStyle::colwise},
//       {"model.layers.*.self_attn.o_proj", dist::ParallelStyle::rowwise},
//       {"model.embed_tokens", dist::ParallelStyle::rowwise}});         // vocabulary rows split
//
// The model's forward is untouched: a split Linear computes with its piece (its output holds this
// rank's features), and named_parameters() gives the pieces, so FSDP can shard them again over
// another dimension of a mesh and an optimizer built from them trains.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/comm/communicator.h"
#include "nn/module.h"

namespace shardlab::dist {

enum class ParallelStyle : unsigned char {
  // Linear: the output features split over the group (weight and bias by rows); the output holds
  // this rank's features. Its input enters the parallel region through f (backward: the input
  // gradient summed over the group) unless a module around it is a region_input.
  colwise,
  // Linear: the input features split (weight by columns); the input arrives split (from a colwise
  // layer) and the output is summed over the group (g); the bias, whole on every rank, is added
  // once after the sum. Embedding: the vocabulary split (weight by rows); each rank looks up the
  // tokens it holds, zeros elsewhere, and the rows are summed over the group.
  rowwise,
  // Any module: its first input enters the parallel region through f, once for every colwise
  // layer inside (q, k and v read one input: one all-reduce in backward instead of three).
  region_input,
};

// Where this rank's piece of one parameter sits in the whole: elements [offset, offset + extent)
// along `dim` of `full_shape`. A parameter not split (a norm, a rowwise bias) has no entry.
struct TensorParallelSplit {
  std::string name;  // dotted from the root given to parallelize_module
  Shape full_shape;
  int dim = 0;
  std::int64_t offset = 0, extent = 0;
};

// This rank's [offset, offset + extent) of `size` elements split over `parts` ranks as evenly as
// possible (the first size % parts ranks hold one more): vocabularies rarely divide. Throws when
// some rank would hold nothing.
std::pair<std::int64_t, std::int64_t> split_range(std::int64_t size, int parts, int index,
                                                  const std::string& what);

// Applies `plan` ((pattern, style) pairs; a pattern is a dotted module name from `root`, where
// "*" stands for one name component) over the ranks of `group`, which every rank of it calls with
// the same plan. Errors, naming the pattern or module: a pattern that matches no module, a module
// matched twice, a style on a module it does not fit (colwise on an Embedding), a module already
// sharded by FSDP or parallelised, a split that leaves a rank nothing. Parameters still deferred
// (nn::DeferredInitGuard) are drawn with nn::initialize's values: this rank's piece of a split one,
// the whole of the others (a norm's weight), so that FSDP then finds a materialised model.
// Nothing changes unless the whole plan fits. Returns the split parameters in the model's order. `group` must
// outlive the model's use.
std::vector<TensorParallelSplit> parallelize_module(
    nn::Module& root, Communicator& group, const std::vector<std::pair<std::string, ParallelStyle>>& plan);

}  // namespace shardlab::dist
