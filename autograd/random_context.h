// autograd/random_context.h: where random ops (dropout) take their randomness from: a
// thread-local context naming the seed, the training step and each batch row's global
// sample index. The data layer sets it per batch; checkpoint() restores it on recompute.
#pragma once

#include <cstdint>
#include <vector>

namespace shardlab {

struct RandomContext {
  std::uint64_t seed = 0;
  std::int64_t step = 0;
  // Global index of each row of the current batch; empty means "row position".
  std::vector<std::int64_t> sample_indices;
};

const RandomContext& random_context();

// Makes `context` current on this thread for the guard's lifetime.
class RandomContextGuard {
 public:
  explicit RandomContextGuard(RandomContext context);
  ~RandomContextGuard();
  RandomContextGuard(const RandomContextGuard&) = delete;
  RandomContextGuard& operator=(const RandomContextGuard&) = delete;

 private:
  RandomContext previous_;
};

}  // namespace shardlab
