// core/join.h: tensors from pieces (cat, stack), pieces of tensors (split, chunk), and triangles
// (triu, tril): compositions of other ops, the same on every device.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace shardlab {

Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim);
// Views of pieces of split_size along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& x, std::int64_t split_size, std::int64_t dim);
// `chunks` views of equal size along dim, the last smaller if needed (torch.chunk).
std::vector<Tensor> chunk(const Tensor& x, std::int64_t chunks, std::int64_t dim);

// Keep elements on and above (triu) / on and below (tril) the diagonal-th diagonal of the
// last two dims, zero elsewhere.
Tensor triu(const Tensor& x, std::int64_t diagonal = 0);
Tensor tril(const Tensor& x, std::int64_t diagonal = 0);

}  // namespace shardlab
