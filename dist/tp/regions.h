// dist/tp/regions.h: the two collectives of tensor parallelism (Megatron-LM's f and g), as autograd
// ops over the ranks of a tensor-parallel group. A column-parallel layer (each rank holds some of
// the output features) takes its replicated input through copy_to_parallel_region, whose backward
// sums the ranks' input gradients; a row-parallel layer (each rank holds some of the input
// features) hands its partial output to reduce_from_parallel_region, which sums it in forward. So
// an MLP split column then row costs one all-reduce in forward and one in backward.
//
//   Variable h = relu(linear(dist::copy_to_parallel_region(x, tp, "mlp.in"), w1_rows, b1_rows));
//   Variable y = add(dist::reduce_from_parallel_region(matmul(h, transpose(w2_cols, 0, 1)), tp, "mlp.out"),
//   b2);
#pragma once

#include <string>

#include "autograd/variable.h"
#include "dist/comm/communicator.h"

namespace shardlab::dist {

// Forward: `x` itself. Backward: the gradient summed over `group` (an all-reduce tagged `tag`).
// `group` must outlive the graph that records it.
Variable copy_to_parallel_region(const Variable& x, Communicator& group, std::string tag);

// Forward: `x` summed over `group` (an all-reduce tagged `tag`). Backward: the gradient itself.
Variable reduce_from_parallel_region(const Variable& x, Communicator& group, std::string tag);

}  // namespace shardlab::dist
