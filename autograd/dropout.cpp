// autograd/dropout.cpp: dropout with masks keyed by (seed, layer stream, step, sample index).
#include <vector>

#include "autograd/functional.h"
#include "autograd/random_context.h"
#include "core/random.h"

namespace shardlab {
namespace {

// SplitMix64's finaliser: spreads (stream, step) over the 64-bit Philox stream id.
std::uint64_t mix(std::uint64_t value) {
  value += 0x9e3779b97f4a7c15ull;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}

// The keep-mask (1 with probability keep) of x's shape, rows drawn at their global offsets in one
// call: from one first index where the rows' samples are consecutive, else each row from its own.
Tensor keep_mask(const Tensor& x, double keep, std::uint64_t stream) {
  const RandomContext& context = random_context();
  const std::int64_t rows = x.dim() == 0 ? 1 : x.size(0);
  const std::int64_t row_size = rows == 0 ? 0 : x.numel() / rows;
  const auto& indices = context.sample_indices;
  SHARDLAB_CHECK(indices.empty() || static_cast<std::int64_t>(indices.size()) == rows,
                 "dropout: the random context names {} sample indices but the input has {} rows (shape {})",
                 indices.size(), rows, shape_str(x.shape()));
  RandomSpec spec{Distribution::bernoulli, {context.seed, mix(mix(stream) ^ static_cast<std::uint64_t>(context.step))},
                  keep, 0.0};
  std::vector<std::int64_t> row_first_indices;
  bool consecutive = true;
  for (std::size_t row = 0; row < indices.size(); ++row) {
    SHARDLAB_CHECK(indices[row] >= 0, "dropout: sample index {} of row {} is negative", indices[row], row);
    row_first_indices.push_back(indices[row] * row_size);
    consecutive = consecutive && indices[row] == indices[0] + static_cast<std::int64_t>(row);
  }
  if (consecutive) {
    spec.first_index = row_first_indices.empty() ? 0 : row_first_indices[0];
  } else {
    spec.row_first_indices = row_first_indices;
  }
  Tensor mask = empty({rows, row_size}, TensorOptions{x.dtype(), x.device()});
  fill_random(mask, spec);
  return mask.view(x.shape());
}

}  // namespace

Variable dropout(const Variable& x, double p, bool training, std::uint64_t stream) {
  SHARDLAB_CHECK(p >= 0 && p <= 1, "dropout: p must be in [0, 1], got {}", p);
  SHARDLAB_CHECK(is_floating(x.dtype()), "dropout: needs a floating input, got {}", dtype_name(x.dtype()));
  if (!training || p == 0) return x;
  if (p == 1) return mul(x, 0.0);
  const Tensor scaled_mask = keep_mask(x.data(), 1 - p, stream);
  mul_(scaled_mask, 1 / (1 - p));  // in place: one pass fewer
  return mul(x, constant(scaled_mask));
}

}  // namespace shardlab
