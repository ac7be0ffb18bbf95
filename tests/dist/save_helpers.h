// tests/dist/save_helpers.h: what the mpirun tests of files on disk share: a directory every
// rank knows (tests/dist/shared_dir.h), every sharding strategy over a world, the Nested model
// sharded with a frozen parameter and trained with AdamW, and errors compared across ranks.
#pragma once

#include <mpi.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/functional.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/shared_dir.h"
#include "tests/dist/world.h"

namespace shardlab::test {

inline constexpr std::int64_t kVocab = 17;

struct Strategy {
  dist::Sharding sharding;
  int group = 0;
};

// Every strategy over `size` ranks; hybrid shards over pairs when there are two pairs or more.
inline std::vector<Strategy> strategies(int size) {
  return {{dist::Sharding::full},
          {dist::Sharding::grad_op},
          {dist::Sharding::optimizer},
          {dist::Sharding::none},
          {dist::Sharding::hybrid, size % 2 == 0 && size > 2 ? 2 : 1}};
}

inline std::string describe(const Strategy& strategy) {
  if (strategy.sharding == dist::Sharding::hybrid) return fmt::format("hybrid:{}", strategy.group);
  return std::string(dist::sharding_name(strategy.sharding));
}

// The Nested model with head.bias frozen (a parameter without optimizer state), sharded over `comm`.
inline Nested make_model(dist::Communicator& comm, const Strategy& strategy, std::uint64_t seed = kSeed,
                         std::int64_t vocab = kVocab) {
  Nested model(vocab, seed);
  for (auto& [name, parameter] : model->named_parameters()) {
    if (name == "head.bias") parameter.set_requires_grad(false);
  }
  const dist::FsdpOptions options{
      .sharding = strategy.sharding, .hybrid_group_size = strategy.group, .communicator = &comm};
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
  return model;
}

// Weights decayed, the rest not: two parameter groups.
inline std::unique_ptr<optim::AdamW> make_optimizer(Nested& model, double lr = 1e-2) {
  std::vector<optim::ParamGroup> groups(2);
  for (const auto& [name, view] : dist::sharded_parameters(*model))
    groups[name.ends_with("weight") ? 0 : 1].parameters.emplace_back(name, view);
  groups[1].weight_decay = 0.0;
  return std::make_unique<optim::AdamW>(std::move(groups), optim::AdamWOptions{.lr = lr});
}

inline void train(Nested& model, optim::Optimizer& optimizer, dist::Communicator& comm, int first,
                  int steps) {
  for (int step = first; step < first + steps; ++step) {
    const auto batch = token_batch(step, kGlobalBatch, kVocab, comm.rank(), comm.size());
    Variable loss = cross_entropy(model(batch.tokens), batch.targets);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
}

// The Error `work` throws on this rank ("" when none).
inline std::string error_of(const std::function<void()>& work) {
  try {
    work();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// Whether every rank of the world holds the same text.
inline bool same_on_every_rank(const std::string& text) {
  const auto hash = static_cast<std::int64_t>(std::hash<std::string>{}(text) >> 1);
  std::int64_t low = 0, high = 0;
  MPI_Allreduce(&hash, &low, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&hash, &high, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return low == high;
}

}  // namespace shardlab::test
