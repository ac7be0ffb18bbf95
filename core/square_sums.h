// core/square_sums.h: internal to core: the order in which sum_of_squares (the square of a gradient
// norm over many tensors) adds, written once for the CPU and the GPU (SHARDLAB_HD), so both devices
// give the same bits every run: each tensor cut into chunks of kSquareChunk elements; a chunk's
// elements dealt to kSquareLanes lanes (element i to lane i % kSquareLanes), each lane adding its
// squares in order in f64, the lanes folded pairwise (fold_lanes); the chunks' partials, all tensors'
// in order, dealt to lanes and folded the same way. A GPU takes every chunk at once, a block a chunk
// and a thread a lane, in one launch for all the tensors.
#pragma once

#include <cstdint>

#include "core/dtype.h"  // SHARDLAB_HD

namespace shardlab {

inline constexpr std::int64_t kSquareChunk = 32768;
inline constexpr int kSquareLanes = 256;

SHARDLAB_HD inline std::int64_t square_chunks(std::int64_t numel) { return (numel + kSquareChunk - 1) / kSquareChunk; }

// acc + x * x, rounded after the product and after the sum on both devices: nvcc would otherwise
// fuse them into one rounding (the CPU build does not).
SHARDLAB_HD inline double add_square(double acc, double x) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(acc, __dmul_rn(x, x));
#else
  return acc + x * x;
#endif
}

// The lanes folded pairwise, each step s = kSquareLanes / 2, ..., 2, 1 adding lane i + s into lane i
// for i < s (a GPU: the threads i < s of a step at once); the total ends in lane 0.
SHARDLAB_HD inline void fold_step(double* lanes, int s, int i) { lanes[i] = lanes[i] + lanes[i + s]; }

inline double fold_lanes(double* lanes) {
  for (int s = kSquareLanes / 2; s > 0; s /= 2) {
    for (int i = 0; i < s; ++i) fold_step(lanes, s, i);
  }
  return lanes[0];
}

}  // namespace shardlab
