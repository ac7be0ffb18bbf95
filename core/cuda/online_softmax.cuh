// core/cuda/online_softmax.cuh: internal to core/cuda: the online softmax recurrence, shared by softmax
// (core/cuda/softmax.cu) and cross-entropy (core/cuda/loss.cu): a running (max, sum of exp(x - max))
// pair over part of a row, merged across the warp and the block.
#pragma once

#include <cmath>

#include "core/cuda/launch.h"

namespace shardlab::cuda {

// (largest value seen, sum of exp(value - largest)) over part of a row.
template <typename C>
struct Running {
  C largest;
  C total;
};

template <typename C>
__device__ inline Running<C> merge(Running<C> a, Running<C> b) {
  const C largest = a.largest > b.largest ? a.largest : b.largest;
  if (largest == -INFINITY) return {largest, C(0)};  // both empty (or all -inf so far)
  return {largest, a.total * exp(a.largest - largest) + b.total * exp(b.largest - largest)};
}

template <typename C>
__device__ inline Running<C> merge_across_block(Running<C> mine) {
  constexpr unsigned kAll = 0xffffffffu;
  for (int offset = 16; offset > 0; offset /= 2) {
    const Running<C> other{__shfl_down_sync(kAll, mine.largest, offset),
                           __shfl_down_sync(kAll, mine.total, offset)};
    mine = merge(mine, other);
  }
  __shared__ Running<C> per_warp[kBlockSize / 32];
  __shared__ Running<C> row;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) per_warp[warp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    Running<C> all = per_warp[0];
    for (int w = 1; w < kBlockSize / 32; ++w) all = merge(all, per_warp[w]);
    row = all;
  }
  __syncthreads();
  return row;
}

}  // namespace shardlab::cuda
