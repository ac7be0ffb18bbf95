// tests/dist/test_fsdp2_reductions.cpp (mpirun): FSDP2's controls of the gradient reduction:
// set_gradient_divide_factor (the ranks' sum divided by a factor of the caller's),
// set_requires_all_reduce (micro-steps that reduce-scatter and leave the all-reduce over the
// replicas to the last), set_force_sum_reduction_for_comms and set_all_reduce_hook, against the
// gradients every rank computes alone for every rank's rows; and what they refuse.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "core/error.h"
#include "core/trace.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/check.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/fsdp_parity.h"
#include "tests/dist/world.h"

using namespace shardlab;
using namespace shardlab::test;  // Nested, its batches, shard, strategies

namespace {

using FlatGradients = std::map<std::string, std::vector<double>>;

// Each rank's gradient of its rows of global batches first_step, first_step + 1, ... (micro_steps of
// them), the mean loss over its rows, summed over the ranks and the batches: one process per rank's
// rows, no FSDP, every rank computing all of them. By parameter name, flattened.
FlatGradients summed_gradients(std::int64_t vocab, int micro_steps) {
  const int w = world().size();
  FlatGradients sums;
  for (int step = 0; step < micro_steps; ++step) {
    for (int rank = 0; rank < w; ++rank) {
      Nested alone(vocab, kSeed);
      const auto batch = token_batch(step, kGlobalBatch, vocab, rank, w);
      cross_entropy(alone(batch.tokens), batch.targets).backward();
      for (const auto& [name, parameter] : alone->named_parameters()) {
        const std::vector<double> grad = parameter.grad().to_vector<double>();
        std::vector<double>& sum = sums[name];
        sum.resize(grad.size(), 0.0);
        for (std::size_t i = 0; i < grad.size(); ++i) sum[i] += grad[i];
      }
    }
  }
  return sums;
}

// Over all ranks: the elements of this rank's gradient shards that differ from `expected / divisor`
// beyond `tolerance`, and the shards holding elements but no gradient.
std::int64_t wrong_gradients(Nested& model, const FlatGradients& expected, double divisor,
                             Tolerance tolerance) {
  std::int64_t wrong = 0;
  for (const auto& [name, shard] : dist::parameter_shards(*model)) {
    if (shard.count == 0) continue;
    if (!shard.local.grad().defined()) {
      UNSCOPED_INFO(name << " has no gradient");
      wrong += shard.count;
      continue;
    }
    const std::vector<double>& whole = expected.at(name);
    std::vector<double> want(whole.begin() + shard.first, whole.begin() + shard.first + shard.count);
    for (double& value : want) value /= divisor;
    const std::int64_t bad = count_mismatches(shard.local.grad().to_vector<double>(), want, tolerance);
    if (bad > 0) UNSCOPED_INFO(name << ": " << bad << " elements differ");
    wrong += bad;
  }
  return sum_over_ranks(wrong);
}

Nested sharded(std::int64_t vocab, const dist::FsdpOptions& options = {}) {
  Nested model(vocab, kSeed);
  shard(model, options);
  return model;
}

// One synced backward on this rank's rows of global batch 0.
void backward_on_first_batch(Nested& model, std::int64_t vocab) {
  const auto batch = token_batch(0, kGlobalBatch, vocab, world().rank(), world().size());
  cross_entropy(model(batch.tokens), batch.targets).backward();
}

void set_divide_factor_everywhere(Nested& model, double factor) {
  for (const auto& block : *model->blocks) dist::set_gradient_divide_factor(*block, factor);
  dist::set_gradient_divide_factor(*model, factor);
}

// The shardings whose units all-reduce over replicas at this world size: none, and hybrid with
// groups of 2 (of 1 where 2 does not divide the ranks or is all of them).
std::vector<std::pair<std::string, dist::FsdpOptions>> replicated(int world_size) {
  const int group = world_size % 2 == 0 && world_size > 2 ? 2 : 1;
  return {{"none", {.sharding = dist::Sharding::none}},
          {fmt::format("hybrid:{}", group), {.sharding = dist::Sharding::hybrid, .hybrid_group_size = group}}};
}

// The same, and hybrid reducing in bf16.
std::vector<std::pair<std::string, dist::FsdpOptions>> replicated_f32_and_bf16(int world_size) {
  auto cases = replicated(world_size);
  auto [name, options] = cases.back();
  options.mixed_precision.reduce_dtype = DType::bf16;
  cases.emplace_back(name + ", bf16 reduction", options);
  return cases;
}

// `cases` and full sharding, which has no all-reduce over replicas.
std::vector<std::pair<std::string, dist::FsdpOptions>> and_full(
    std::vector<std::pair<std::string, dist::FsdpOptions>> cases) {
  cases.emplace_back("full", dist::FsdpOptions{});
  return cases;
}

// Three micro-steps on this rank's rows of global batches 0, 1 and 2, each synced, the all-reduce
// over the replicas only in the last unless `every_micro_step`; returns the replica all-reduces the
// units waited for (the trace's "wait all_reduce" spans).
std::int64_t accumulate(Nested& model, std::int64_t vocab, bool every_micro_step) {
  trace::start();
  for (int micro = 0; micro < 3; ++micro) {
    dist::set_requires_all_reduce(*model, every_micro_step || micro == 2);
    const auto batch = token_batch(micro, kGlobalBatch, vocab, world().rank(), world().size());
    cross_entropy(model(batch.tokens), batch.targets).backward();
  }
  trace::stop();
  const auto events = trace::take();
  return std::count_if(events.begin(), events.end(),
                       [](const trace::Event& event) { return event.name.starts_with("wait all_reduce "); });
}

}  // namespace

TEST_CASE("set_gradient_divide_factor: a unit's gradient is the ranks' sum divided by the factor, every sharding",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const FlatGradients sums = summed_gradients(vocab, 1);
  for (const double factor : {1.0, 2.5}) {
    for (const auto& [name, options] : strategies(w)) {
      INFO(name << ", factor " << factor);
      Nested model = sharded(vocab, options);
      set_divide_factor_everywhere(model, factor);
      backward_on_first_batch(model, vocab);
      CHECK(wrong_gradients(model, sums, factor, {.atol = 1e-7, .rtol = 1e-5}) == 0);
    }
  }
}

TEST_CASE("set_gradient_divide_factor on one unit leaves the others averaging", "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const FlatGradients sums = summed_gradients(vocab, 1);
  Nested model = sharded(vocab);
  dist::set_gradient_divide_factor((*model->blocks)[0], 0.5);
  backward_on_first_batch(model, vocab);
  FlatGradients in_block, elsewhere;
  for (const auto& [name, values] : sums) (name.starts_with("blocks.0.") ? in_block : elsewhere)[name] = values;
  REQUIRE(!in_block.empty());
  // The block's gradients are twice the sum, the others' the mean: each compared where it lies.
  FlatGradients scaled = elsewhere;
  for (const auto& [name, values] : in_block) {
    std::vector<double>& out = scaled[name];
    for (const double value : values) out.push_back(value * w / 0.5);
  }
  CHECK(wrong_gradients(model, scaled, w, {.atol = 1e-7, .rtol = 1e-5}) == 0);
}

TEST_CASE("set_requires_all_reduce(false) between micro-steps: one all-reduce a step, the same gradient",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const FlatGradients sums = summed_gradients(vocab, 3);
  for (const auto& [name, options] : replicated_f32_and_bf16(w)) {
    INFO(name);
    const bool bf16 = options.mixed_precision.reduce_dtype == DType::bf16;
    // bf16: each micro-step's gradient (up to about 0.1) rounded to 8 bits, summed with cancellation.
    const Tolerance tolerance = bf16 ? Tolerance{.atol = 2e-3, .rtol = 2e-2} : Tolerance{.atol = 1e-7, .rtol = 1e-5};
    Nested every = sharded(vocab, options), last = sharded(vocab, options);
    const std::int64_t all_reduces = accumulate(every, vocab, true);
    const std::int64_t fewer = accumulate(last, vocab, false);
    // The mean over the ranks of each micro-step's gradient, summed over the micro-steps, either way.
    CHECK(wrong_gradients(every, sums, w, tolerance) == 0);
    CHECK(wrong_gradients(last, sums, w, tolerance) == 0);
    const bool replicas = w / (options.sharding == dist::Sharding::none ? 1 : options.hybrid_group_size) > 1;
    // 4 units, each waiting for its all-reduce once a synced backward, or once in all.
    CHECK(all_reduces == (replicas ? 3 * 4 : 0));
    CHECK(fewer == (replicas ? 4 : 0));
  }
}

TEST_CASE("set_requires_all_reduce(false) with a divide factor: the sum of every micro-step and rank over it",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const FlatGradients sums = summed_gradients(vocab, 3);
  for (const auto& [name, options] : replicated(w)) {
    INFO(name);
    Nested model = sharded(vocab, options);
    set_divide_factor_everywhere(model, 3.0);
    accumulate(model, vocab, false);
    CHECK(wrong_gradients(model, sums, 3.0, {.atol = 1e-7, .rtol = 1e-5}) == 0);
  }
}

TEST_CASE("while a sum waits for its all-reduce, stepping and clipping are refused and change nothing",
          "[dist][fsdp][fsdp2][errors]") {
  const int w = world().size();
  if (w == 1) return;  // no replicas: nothing waits
  const std::int64_t vocab = 4 * w + 1;
  Nested model = sharded(vocab, {.sharding = dist::Sharding::none});
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
  dist::set_requires_all_reduce(*model, false);
  const auto first = token_batch(0, kGlobalBatch, vocab, world().rank(), w);
  cross_entropy(model(first.tokens), first.targets).backward();
  const nn::Named<Tensor> before = dist::gather_full_parameters(*model);
  for (const auto& [name, parameter] : model->named_parameters()) CHECK(!parameter.grad().defined());
  const std::string waits = fmt::format(
      "cannot be trained here: its gradient is reduce-scattered but waits for its all-reduce over the {} "
      "replicas of unit",
      w);
  CHECK_THROWS_ERROR(optimizer.step(), waits);
  CHECK_THROWS_ERROR(optim::clip_grad_norm_(model->parameters(), 1.0), waits);
  CHECK_THROWS_ERROR(dist::set_gradient_divide_factor(*model, 2.0),
                     "dist::set_gradient_divide_factor: unit (root) holds a sum of reduce-scattered gradients "
                     "that waits for its all-reduce");
  CHECK_THROWS_ERROR(dist::set_force_sum_reduction_for_comms(*model, true),
                     "dist::set_force_sum_reduction_for_comms: unit (root) holds a sum of reduce-scattered "
                     "gradients");
  CHECK_NOTHROW(dist::set_force_sum_reduction_for_comms(*model, false));  // as it is: nothing changes
  const nn::Named<Tensor> after = dist::gather_full_parameters(*model);
  std::int64_t changed = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    changed += count_mismatches(after[i].second.to_vector<double>(), before[i].second.to_vector<double>(),
                                {.atol = 0, .rtol = 0});
  }
  CHECK(changed == 0);
  dist::set_requires_all_reduce(*model, true);
  const auto second = token_batch(1, kGlobalBatch, vocab, world().rank(), w);
  cross_entropy(model(second.tokens), second.targets).backward();
  CHECK_NOTHROW(optim::clip_grad_norm_(model->parameters(), 1.0));
  CHECK_NOTHROW(optimizer.step());
}

TEST_CASE("set_gradient_divide_factor and set_requires_all_reduce refuse what they cannot do",
          "[dist][fsdp][fsdp2][errors]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested model(vocab, kSeed);
  CHECK_THROWS_ERROR(dist::set_gradient_divide_factor(*model, 2.0),
                     "dist::set_gradient_divide_factor: this Nested is not an FSDP unit");
  CHECK_THROWS_ERROR(dist::set_requires_all_reduce(*model, false), "FSDP: the root Nested is not sharded");
  shard(model);
  for (const double factor : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                              std::numeric_limits<double>::quiet_NaN()}) {
    CHECK_THROWS_ERROR(dist::set_gradient_divide_factor(*model, factor),
                       "dist::set_gradient_divide_factor: the factor must be positive and finite, got");
  }
  CHECK_THROWS_ERROR(dist::set_gradient_divide_factor(*model->head, 2.0), "is not an FSDP unit");
  if (world().size() > 1) {
    Nested bitwise = sharded(vocab, {.sharding = dist::Sharding::none, .bitwise = true});
    CHECK_THROWS_ERROR(dist::set_requires_all_reduce(*bitwise, false),
                       "dist::set_requires_all_reduce: unit (root) reduces bitwise, in one exact reduction over "
                       "its shard group and its replicas together");
    CHECK_NOTHROW(dist::set_requires_all_reduce(*bitwise, true));
  }
  Nested full = sharded(vocab, {.bitwise = true});  // no replicas: nothing to leave out
  CHECK_NOTHROW(dist::set_requires_all_reduce(*full, false));
}

namespace {

struct HookCalls {
  int calls = 0;
  double largest = 0;  // the largest magnitude the hook saw
  std::vector<DType> dtypes;
};

// A hook on every unit that counts its calls, notes what it got and doubles it.
std::shared_ptr<HookCalls> hook_every_unit(Nested& model) {
  auto seen = std::make_shared<HookCalls>();
  const auto hook = [seen](const Tensor& reduced) {
    ++seen->calls;
    seen->dtypes.push_back(reduced.dtype());
    for (const double value : reduced.to_vector<double>()) seen->largest = std::max(seen->largest, std::abs(value));
    mul_(reduced, 2.0);
  };
  for (const auto& block : *model->blocks) dist::set_all_reduce_hook(*block, hook);
  dist::set_all_reduce_hook(*model, hook);
  return seen;
}

}  // namespace

TEST_CASE("set_all_reduce_hook: each unit's hook gets its reduced shard once a synced backward, and what it does stays",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const FlatGradients sums = summed_gradients(vocab, 1);
  for (const auto& [name, options] : and_full(replicated_f32_and_bf16(w))) {
    INFO(name);
    Nested model = sharded(vocab, options);
    const std::shared_ptr<HookCalls> seen = hook_every_unit(model);
    backward_on_first_batch(model, vocab);
    CHECK(seen->calls == 4);
    for (const DType dtype : seen->dtypes) CHECK(dtype == options.mixed_precision.reduce_dtype);
    const bool bf16 = options.mixed_precision.reduce_dtype == DType::bf16;
    const Tolerance tolerance = bf16 ? Tolerance{.atol = 1e-3, .rtol = 1e-2} : Tolerance{.atol = 1e-7, .rtol = 1e-5};
    CHECK(wrong_gradients(model, sums, w / 2.0, tolerance) == 0);  // twice the mean
  }
}

TEST_CASE("set_all_reduce_hook with set_requires_all_reduce(false): called once, with the all-reduce",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const auto [name, options] = replicated(w).front();  // none
  Nested model = sharded(vocab, options);
  const std::shared_ptr<HookCalls> seen = hook_every_unit(model);
  accumulate(model, vocab, false);
  CHECK(seen->calls == (w > 1 ? 4 : 3 * 4));  // one rank: no all-reduce to leave out
  CHECK(wrong_gradients(model, summed_gradients(vocab, 3), w / 2.0, {.atol = 1e-7, .rtol = 1e-5}) == 0);
}

TEST_CASE("set_force_sum_reduction_for_comms: sums on the wire, the same gradient; a hook sees the sum",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const FlatGradients sums = summed_gradients(vocab, 1);
  for (const auto& [name, options] : and_full(replicated(w))) {
    INFO(name);
    std::array<double, 2> largest{};
    for (const bool force_sum : {false, true}) {
      Nested model = sharded(vocab, options);
      dist::set_force_sum_reduction_for_comms(*model, force_sum);
      for (const auto& block : *model->blocks) dist::set_force_sum_reduction_for_comms(*block, force_sum);
      const std::shared_ptr<HookCalls> seen = hook_every_unit(model);
      backward_on_first_batch(model, vocab);
      CHECK(wrong_gradients(model, sums, w / 2.0, {.atol = 1e-7, .rtol = 1e-5}) == 0);
      largest[force_sum] = max_over_ranks(seen->largest);
    }
    CHECK(largest[1] == Approx(w * largest[0]).epsilon(1e-5));  // the sum, not the mean
  }
}

TEST_CASE("a hook that throws fails the backward, and the next one trains without it",
          "[dist][fsdp][fsdp2][errors]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  Nested model = sharded(vocab);
  dist::set_all_reduce_hook(*model, [](const Tensor&) { throw Error("the hook refuses"); });
  CHECK_THROWS_ERROR(backward_on_first_batch(model, vocab), "the hook refuses");
  dist::set_all_reduce_hook(*model, {});
  backward_on_first_batch(model, vocab);
  CHECK(wrong_gradients(model, summed_gradients(vocab, 1), w, {.atol = 1e-7, .rtol = 1e-5}) == 0);
  CHECK_THROWS_ERROR(dist::set_all_reduce_hook(*model->head, {}),
                     "dist::set_all_reduce_hook: 'head' (Linear) is not an FSDP unit");
  CHECK_THROWS_ERROR(dist::set_force_sum_reduction_for_comms(*model->head, true),
                     "dist::set_force_sum_reduction_for_comms: 'head' (Linear) is not an FSDP unit");
}
