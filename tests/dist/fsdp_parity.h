// tests/dist/fsdp_parity.h: helpers of the mpirun FSDP tests that compare a sharded Nested with
// one process: the runs, their mismatches over all ranks, and the strategies to try.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/world.h"

namespace shardlab::test {

struct Run {
  std::vector<double> losses;
  nn::Named<Tensor> parameters;
  dist::Plan plan;
};

// One process, no FSDP: the reference every rank computes for itself.
inline Run train_alone(std::int64_t vocab, int steps) {
  Nested model(vocab, kSeed);
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
  Run run;
  for (int step = 0; step < steps; ++step) {
    const auto batch = token_batch(step, kGlobalBatch, vocab);
    Variable loss = cross_entropy(model(batch.tokens), batch.targets);
    run.losses.push_back(loss.data().item<float>());
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
  for (const auto& [name, variable] : model->named_parameters())
    run.parameters.emplace_back(name, variable.data().clone());
  return run;
}

// One step of a sharded model on this rank's rows of global batch `step`; returns this rank's loss.
inline float train_step(Nested& model, optim::Optimizer& optimizer, std::int64_t vocab, int step) {
  const auto batch = token_batch(step, kGlobalBatch, vocab, world().rank(), world().size());
  Variable loss = cross_entropy(model(batch.tokens), batch.targets);
  optimizer.zero_grad();
  loss.backward();
  optimizer.step();
  return loss.data().item<float>();
}

// Trains an already sharded model on this rank's rows of the global batches, with AdamW over
// `parameters` (the model's, after sharding).
inline Run train_sharded(Nested& model, std::int64_t vocab, int steps,
                         const nn::Named<Variable>& parameters) {
  optim::AdamW optimizer(parameters, {.lr = 1e-2});
  Run run;
  for (int step = 0; step < steps; ++step)
    run.losses.push_back(mean_over_ranks(train_step(model, optimizer, vocab, step)));
  run.parameters = dist::gather_full_parameters(*model);
  return run;
}

inline Run train_sharded(Nested& model, std::int64_t vocab, int steps) {
  return train_sharded(model, vocab, steps, dist::sharded_parameters(*model));
}

// fully_shard on each block, then on the root.
inline void shard(Nested& model, const dist::FsdpOptions& options = {}) {
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
}

inline Run train_sharded(std::int64_t vocab, int steps, const dist::FsdpOptions& options) {
  Nested model(vocab, kSeed);
  shard(model, options);
  return train_sharded(model, vocab, steps);
}

// Elements beyond atol + rtol * |expected|, summed over ranks.
inline std::int64_t mismatches_on_any_rank(const Run& actual, const Run& expected, double rtol, double atol) {
  std::int64_t wrong = 0;
  for (std::size_t k = 0; k < expected.losses.size(); ++k) {
    if (!(std::abs(actual.losses[k] - expected.losses[k]) <= atol + rtol * std::abs(expected.losses[k]))) {
      UNSCOPED_INFO("step " << k << " loss " << actual.losses[k] << " vs " << expected.losses[k]);
      ++wrong;
    }
  }
  REQUIRE(actual.parameters.size() == expected.parameters.size());
  for (std::size_t i = 0; i < expected.parameters.size(); ++i) {
    REQUIRE(actual.parameters[i].first == expected.parameters[i].first);
    const auto got = actual.parameters[i].second.to_vector<double>();
    const auto want = expected.parameters[i].second.to_vector<double>();
    const std::int64_t bad = test::count_mismatches(got, want, {.atol = atol, .rtol = rtol});
    if (bad > 0) UNSCOPED_INFO(expected.parameters[i].first << ": " << bad << " elements differ");
    wrong += bad;
  }
  return test::sum_over_ranks(wrong);
}

inline std::vector<std::pair<std::string, dist::FsdpOptions>> strategies(int world_size) {
  const int group = world_size % 2 == 0 ? 2 : world_size;
  return {{"full", {.sharding = dist::Sharding::full}},
          {"grad_op", {.sharding = dist::Sharding::grad_op}},
          {"none", {.sharding = dist::Sharding::none}},
          {"optimizer", {.sharding = dist::Sharding::optimizer}},
          {fmt::format("hybrid:{}", group), {.sharding = dist::Sharding::hybrid, .hybrid_group_size = group}},
          {"full, cpu offload (nothing to move on the CPU)", {.cpu_offload = true}},
          {"full, no prefetch, keep gathered",
           {.sharding = dist::Sharding::full, .reshard_after_forward = false, .prefetch = 0}}};
}

}  // namespace shardlab::test
