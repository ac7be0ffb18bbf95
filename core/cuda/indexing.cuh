// core/cuda/indexing.cuh: internal to core/cuda: element offsets of strided operands described by
// a Layout (launch.h), the grid-stride loop over them, and accumulation as the CPU kernels do it.
#pragma once

#include <cstdint>

#include "core/cuda/launch.h"

namespace shardlab::cuda {

// target += value in the compute type, rounded once to T: the CPU kernels' accumulation.
template <typename T>
__device__ void accumulate(T& target, T value) {
  target = narrow<T>(widen(target) + widen(value));
}

// The grid-stride loop's start and step for this thread.
__device__ inline std::int64_t first_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t thread_step() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

template <int N>
struct Offsets {
  std::int64_t of[N];
};

// Offsets of row-major element `index` in each operand: peel coordinates off from the last dim.
template <int N>
__device__ Offsets<N> offsets_of(const Layout<N>& layout, std::int64_t index) {
  Offsets<N> result{};
  for (int d = layout.rank - 1; d > 0; --d) {
    const std::int64_t coordinate = index % layout.sizes[d];
    index /= layout.sizes[d];
    for (int k = 0; k < N; ++k) result.of[k] += coordinate * layout.strides[k][d];
  }
  if (layout.rank > 0) {
    for (int k = 0; k < N; ++k) result.of[k] += index * layout.strides[k][0];
  }
  return result;
}

// Grid-stride loop: calls fn(offsets) for every element of the layout.
template <int N, typename Fn>
__device__ void for_each_element(const Layout<N>& layout, Fn&& fn) {
  for (std::int64_t i = first_thread(); i < layout.numel; i += thread_step()) {
    fn(offsets_of(layout, i));
  }
}

}  // namespace shardlab::cuda
