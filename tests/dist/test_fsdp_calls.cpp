// tests/dist/test_fsdp_calls.cpp (mpirun): the FSDP2 calls a training script makes besides
// fully_shard: unshard (its handle, dropped or waited) and reshard, explicit prefetch lists (the
// all-gathers follow them, the numbers do not change), each parameter's local shard and placement
// (the ranks' pieces rebuild the full parameters), and activation checkpointing of units (the
// recompute sees gathered parameters; gradients bit for bit), with every refusal's message.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include "autograd/engine.h"
#include "autograd/random_context.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::kGlobalBatch;
using test::kSeed;
using test::mean_over_ranks;
using test::Nested;
using test::token_batch;
using test::world;

namespace {

// Per step the global mean loss and every gradient shard, then the full parameters.
struct Trace {
  std::vector<double> losses;
  std::vector<std::vector<double>> gradients;
  nn::Named<Tensor> parameters;
};

// Elements of `actual` that differ at all from `expected`, summed over ranks.
std::int64_t differences(const Trace& actual, const Trace& expected) {
  std::int64_t wrong = test::count_mismatches(actual.losses, expected.losses, {0, 0});
  CHECK(actual.gradients.size() == expected.gradients.size());
  for (std::size_t i = 0; i < std::min(actual.gradients.size(), expected.gradients.size()); ++i)
    wrong += test::count_mismatches(actual.gradients[i], expected.gradients[i], {0, 0});
  CHECK(actual.parameters.size() == expected.parameters.size());
  for (std::size_t i = 0; i < std::min(actual.parameters.size(), expected.parameters.size()); ++i) {
    CHECK(actual.parameters[i].first == expected.parameters[i].first);
    wrong += test::count_mismatches(actual.parameters[i].second.to_vector<double>(),
                                    expected.parameters[i].second.to_vector<double>(), {0, 0});
  }
  return test::sum_over_ranks(wrong);
}

void shard_nested(Nested& model, const dist::FsdpOptions& options = {}) {
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
}

// Trains a sharded Nested on this rank's rows; `before_forward(step)` runs before each forward,
// `after_forward(step)` between forward and backward.
Trace train(Nested& model, int steps, const std::function<void(int)>& before_forward = {},
            const std::function<void(int)>& after_forward = {}) {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const auto views = dist::sharded_parameters(*model);
  optim::AdamW optimizer(views, {.lr = 1e-2});
  Trace trace;
  for (int step = 0; step < steps; ++step) {
    if (before_forward) before_forward(step);
    const auto batch = token_batch(step, kGlobalBatch, vocab, r, w);
    Variable loss = cross_entropy(model(batch.tokens), batch.targets);
    if (after_forward) after_forward(step);
    trace.losses.push_back(mean_over_ranks(loss.data().item<float>()));
    optimizer.zero_grad();
    loss.backward();
    for (const auto& [name, view] : views) trace.gradients.push_back(view.grad().to_vector<double>());
    optimizer.step();
  }
  trace.parameters = dist::gather_full_parameters(*model);
  return trace;
}

Trace train_plain(int steps, const dist::FsdpOptions& options = {}) {
  Nested model(4 * world().size() + 1, kSeed);
  shard_nested(model, options);
  return train(model, steps);
}

std::int64_t all_gathers() { return world().counters()[dist::Collective::all_gather].calls; }

}  // namespace

// --- unshard and reshard ---------------------------------------------------------------------------

TEST_CASE("dist::unshard issues the root's all-gather before the forward, which then gathers it no more",
          "[dist][fsdp][unshard]") {
  const int w = world().size();
  const Trace expected = train_plain(3);
  Nested model(4 * w + 1, kSeed);
  shard_nested(model);
  const dist::Plan plan = dist::explain(*model);
  const std::int64_t units = static_cast<std::int64_t>(plan.units.size());
  std::optional<dist::UnshardHandle> handle;
  const Trace trace = train(
      model, 3,
      [&](int step) {
        world().reset_counters();
        const std::int64_t before = dist::unsharded_memory().bytes;
        // Step 0 waits; step 1 drops the handle unwaited; step 2 waits after the batch is made.
        if (step == 1) {
          (void)dist::unshard(*model);
        } else {
          handle = dist::unshard(*model);
        }
        CHECK(all_gathers() == (w > 1 ? 1 : 0));
        if (w > 1) {
          const auto last = world().monitor().tail(1).back();
          CHECK(last.fingerprint.op == dist::Collective::all_gather);
          CHECK(last.fingerprint.tag == "unshard (root)");  // the root's, gathered by dist::unshard
        }
        CHECK(dist::unsharded_memory().bytes - before == plan.units[0].unsharded_bytes);
        if (step == 0) handle->wait();
      },
      [&](int step) {
        if (step == 2) handle->wait();  // after the forward waited for it: returns at once
        // The forward gathered the blocks only: every unit once in all.
        CHECK(all_gathers() == (w > 1 ? units : 0));
      });
  CHECK(differences(trace, expected) == 0);
  CHECK(dist::unsharded_memory().bytes == 0);
  if (w > 1) CHECK(all_gathers() == 2 * units - 1 + units);  // the last step's, and gather_full_parameters'
}

TEST_CASE("a handle dropped unwaited, or outliving its model, leaks nothing and blocks nothing",
          "[dist][fsdp][unshard]") {
  const int w = world().size();
  const std::int64_t before = dist::unsharded_memory().bytes;
  dist::UnshardHandle outliving;
  {
    Nested model(4 * w + 1, kSeed);
    shard_nested(model);
    outliving = dist::unshard(*model);
    (void)dist::unshard((*model->blocks)[1]);  // dropped at once, never waited
    CHECK(dist::unsharded_memory().bytes > before);
  }  // the model goes with both gathers perhaps still in flight
  CHECK(dist::unsharded_memory().bytes == before);
  outliving.wait();  // its unit is gone: nothing to wait for
  // Every rank is still in step: a collective after it completes.
  const Tensor one = full({1}, 1.0, dtype(DType::f64));
  world().all_reduce(one, dist::ReduceOp::sum).wait();
  CHECK(one.item<double>() == w);
}

TEST_CASE("a unit kept gathered through backward: unshard gathers nothing, reshard frees, backward regathers",
          "[dist][fsdp][unshard]") {
  const int w = world().size();
  // The root (any strategy), and a block of grad_op and of none.
  const std::vector<std::tuple<std::string, dist::FsdpOptions, int>> cases{
      {"full, the root", {.sharding = dist::Sharding::full}, -1},
      {"grad_op, blocks.1", {.sharding = dist::Sharding::grad_op}, 1},
      {"none, blocks.1", {.sharding = dist::Sharding::none}, 1}};
  for (const auto& [name, options, block] : cases) {
    INFO(name << " at " << w << " ranks");
    const Trace expected = train_plain(2, options);
    Nested model(4 * w + 1, kSeed);
    shard_nested(model, options);
    const dist::Plan plan = dist::explain(*model);
    nn::Module& unit = block < 0 ? static_cast<nn::Module&>(*model) : (*model->blocks)[block];
    // A weight the unit's layers compute with: a view of its gathered buffer.
    const Variable computed_with = block < 0 ? model->head->weight : (*model->blocks)[block].up->weight;
    const std::int64_t unit_bytes = plan.units[block < 0 ? 0 : block + 1].unsharded_bytes;
    std::int64_t gathers_after_forward = 0;
    const Trace trace = train(
        model, 2, [&](int) { world().reset_counters(); },
        [&](int) {
          gathers_after_forward = all_gathers();
          const std::int64_t held = dist::unsharded_memory().bytes;
          dist::unshard(unit).wait();  // gathered already: nothing to do
          CHECK(all_gathers() == gathers_after_forward);
          CHECK(dist::unsharded_memory().bytes == held);
          dist::reshard(unit);
          CHECK(dist::unsharded_memory().bytes == held - unit_bytes);
          CHECK(computed_with.data().storage()->nbytes() == 0);
          dist::reshard(unit);  // twice: nothing more
          CHECK(dist::unsharded_memory().bytes == held - unit_bytes);
        });
    // The backward gathered the unit again, for the same numbers; none gathers by copying.
    CHECK(differences(trace, expected) == 0);
    if (w > 1 && options.sharding != dist::Sharding::none) {
      // The planned backward gathers and this unit's again, then gather_full_parameters' per unit.
      std::int64_t planned = 0;
      for (const auto& row : plan.units) planned += row.backward_gathers;
      CHECK(all_gathers() ==
            gathers_after_forward + planned + 1 + static_cast<std::int64_t>(plan.units.size()));
    }
  }
}

TEST_CASE("unshard and reshard refuse modules that are no unit, and reshard a unit in its backward",
          "[dist][fsdp][unshard][errors]") {
  const int r = world().rank(), w = world().size();
  Nested model(4 * w + 1, kSeed);
  shard_nested(model);
  CHECK_THROWS_ERROR(
      dist::reshard(*model->head),
      "dist::reshard: 'head' (Linear) is not an FSDP unit; call it on a module dist::fully_shard made one");
  CHECK_THROWS_ERROR(
      dist::unshard(*(*model->blocks)[0].up),
      "dist::unshard: 'blocks.0.up' (Linear) is not an FSDP unit; call it on a module dist::fully_shard made "
      "one");
  nn::Linear loose(nn::LinearOptions(2, 2));
  CHECK_THROWS_ERROR(dist::reshard(*loose), "dist::reshard: this Linear is not an FSDP unit");
  // From a gradient hook on blocks.1's output, registered after FSDP's: its backward has begun.
  int refused = 0;
  (*model->blocks)[1].register_forward_hook([&refused](nn::Module& block, Variable& output) {
    output.register_hook([&refused, unit = &block](const Tensor&) {
      CHECK_THROWS_ERROR(dist::reshard(*unit),
                         "dist::reshard: the backward of unit 'blocks.1' (Block) is running and reads its "
                         "gathered parameters; reshard it after the backward");
      ++refused;
      return Tensor();
    });
  });
  const auto batch = token_batch(0, kGlobalBatch, 4 * w + 1, r, w);
  cross_entropy(model(batch.tokens), batch.targets).backward();
  CHECK(refused == 1);
  // The refusal changed nothing: every gradient arrived, and the next step trains.
  std::int64_t missing = 0;
  for (const auto& [name, view] : dist::sharded_parameters(*model)) missing += !view.grad().defined();
  CHECK(test::sum_over_ranks(missing) == 0);
  dist::reshard((*model->blocks)[1]);  // after the backward: allowed
}

// --- explicit prefetch lists ----------------------------------------------------------------------

namespace {

// The tags of the all-gathers issued on the world communicator after ledger id `after`.
std::vector<std::string> gathers_since(std::uint64_t after) {
  std::vector<std::string> tags;
  for (const auto& entry : world().monitor().tail(256)) {
    if (entry.id > after && entry.fingerprint.op == dist::Collective::all_gather)
      tags.push_back(entry.fingerprint.tag);
  }
  return tags;
}

std::uint64_t last_ledger_id() {
  const auto last = world().monitor().tail(1);
  return last.empty() ? 0 : last.back().id;
}

}  // namespace

TEST_CASE(
    "explicit prefetch lists: the all-gathers follow them from the first step, the numbers do not change",
    "[dist][fsdp][prefetch]") {
  const int w = world().size();
  const Trace expected = train_plain(3);
  Nested model(4 * w + 1, kSeed);
  shard_nested(model);
  auto& b0 = (*model->blocks)[0];
  auto& b1 = (*model->blocks)[1];
  auto& b2 = (*model->blocks)[2];
  // Forward: the root gathers every block, last first; the blocks prefetch nothing. Backward: the
  // root prefetches blocks.2, which prefetches blocks.0 before blocks.1.
  dist::set_modules_to_forward_prefetch(*model, {&b2, &b1, &b0});
  for (nn::Module* block : {&b0, &b1, &b2}) dist::set_modules_to_forward_prefetch(*block, {});
  dist::set_modules_to_backward_prefetch(*model, {&b2});
  dist::set_modules_to_backward_prefetch(b2, {&b0, &b1});
  dist::set_modules_to_backward_prefetch(b1, {});
  dist::set_modules_to_backward_prefetch(b0, {});
  const dist::Plan plan = dist::explain(*model);
  std::int64_t all_units = 0;
  for (const auto& unit : plan.units) all_units += unit.unsharded_bytes;
  std::vector<std::vector<std::string>> issued;
  std::uint64_t mark = 0;
  const Trace trace = train(model, 3, [&](int step) {
    if (step > 0) issued.push_back(gathers_since(mark));
    mark = last_ledger_id();
    dist::reset_unsharded_peak();
  });
  // Every unit gathered at once during the forward, more than the recorded order's depth 1 allows.
  CHECK(dist::unsharded_memory().peak_bytes == all_units);
  CHECK(all_units > plan.peak_unsharded_bytes());  // which the plan says it does not account for
  CHECK(plan.note ==
        "prefetch lists (set_modules_to_*_prefetch) replace the prefetch depth on some units: the peak of "
        "unsharded parameters assumes the depth, the lists may hold more units at once");
  CHECK(differences(trace, expected) == 0);
  if (w > 1) {
    // Named for the pass each gather serves, though the lists issue them out of order.
    const std::vector<std::string> order{
        "pre-forward (root)",    "pre-forward blocks.2",  "pre-forward blocks.1", "pre-forward blocks.0",
        "pre-backward blocks.2", "pre-backward blocks.0", "pre-backward blocks.1"};
    REQUIRE(issued.size() == 2);
    CHECK(issued[0] == order);  // step 0: the lists apply before any order is recorded
    CHECK(issued[1] == order);
  }
}

TEST_CASE("prefetch lists refuse modules that are no unit, null entries and units of another root",
          "[dist][fsdp][prefetch][errors]") {
  const int w = world().size();
  Nested model(4 * w + 1, kSeed);
  shard_nested(model);
  Nested other(4 * w + 1, kSeed);
  shard_nested(other);
  auto& b0 = (*model->blocks)[0];
  CHECK_THROWS_ERROR(
      dist::set_modules_to_forward_prefetch(*model->head, {&b0}),
      "dist::set_modules_to_forward_prefetch: 'head' (Linear) is not an FSDP unit; call it on a "
      "module dist::fully_shard made one");
  CHECK_THROWS_ERROR(dist::set_modules_to_backward_prefetch(b0, {&(*model->blocks)[1], b0.up.ptr().get()}),
                     "dist::set_modules_to_backward_prefetch: 'blocks.0.up' (Linear) is not an FSDP unit");
  CHECK_THROWS_ERROR(dist::set_modules_to_forward_prefetch(b0, {&(*model->blocks)[1], nullptr}),
                     "dist::set_modules_to_forward_prefetch: entry 1 of the list is null");
  CHECK_THROWS_ERROR(dist::set_modules_to_forward_prefetch(b0, {&(*other->blocks)[1]}),
                     "dist::set_modules_to_forward_prefetch: 'blocks.1' (Block) is a unit under another root "
                     "than 'blocks.0' (Block); a unit prefetches units of its own root only");
  CHECK_THROWS_ERROR(
      dist::set_modules_to_backward_prefetch(*other, {&b0}),
      "dist::set_modules_to_backward_prefetch: 'blocks.0' (Block) is a unit under another root "
      "than the root Nested");
  // The refusals set nothing: both models still train as before.
  CHECK(differences(train(model, 2), train_plain(2)) == 0);
}

// --- each parameter's shard -------------------------------------------------------------------------

TEST_CASE("parameter_shards: the ranks' local pieces at [first, first + count) rebuild every parameter",
          "[dist][fsdp][shards]") {
  const int r = world().rank(), w = world().size();
  const int group = w % 2 == 0 ? 2 : w;
  const std::vector<std::tuple<std::string, dist::FsdpOptions, int>> strategies{
      {"full", {.sharding = dist::Sharding::full}, w},
      {"grad_op", {.sharding = dist::Sharding::grad_op}, w},
      {"none", {.sharding = dist::Sharding::none}, 1},
      {"hybrid", {.sharding = dist::Sharding::hybrid, .hybrid_group_size = group}, group}};
  for (const auto& [name, options, shard_group] : strategies) {
    INFO(name << " at " << w << " ranks");
    Nested model(4 * w + 1, kSeed);
    shard_nested(model, options);
    (void)train(model, 1);  // values that are no longer the initial ones
    const auto shards = dist::parameter_shards(*model);
    const auto views = dist::sharded_parameters(*model);
    const auto full = dist::gather_full_parameters(*model);
    REQUIRE(shards.size() == full.size());
    const int replicas = w / shard_group;
    std::int64_t wrong = 0;
    for (std::size_t i = 0; i < shards.size(); ++i) {
      const auto& [parameter, shard] = shards[i];
      INFO(parameter);
      CHECK(parameter == full[i].first);
      CHECK(shard.full_shape == full[i].second.shape());
      CHECK(shard.local.impl() == views[i].second.impl());  // the optimizer's view itself
      CHECK(shard.local.data().numel() == shard.count);
      CHECK(shard.local.numel() == full[i].second.numel());  // the shard answers for the whole
      CHECK(shard.first >= 0);
      CHECK(shard.first + shard.count <= full[i].second.numel());
      // Each rank writes its piece into zeros; the sum over ranks, divided by how many ranks
      // wrote each element (the replicas, in f64: exact), is the full parameter.
      const std::int64_t numel = full[i].second.numel();
      std::vector<double> values(static_cast<std::size_t>(numel), 0.0), writers(values.size(), 0.0);
      const std::vector<double> local = shard.local.data().to_vector<double>();
      for (std::int64_t k = 0; k < shard.count; ++k) {
        values[static_cast<std::size_t>(shard.first + k)] = local[static_cast<std::size_t>(k)];
        writers[static_cast<std::size_t>(shard.first + k)] = 1;
      }
      MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(numel), MPI_DOUBLE, MPI_SUM,
                    MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, writers.data(), static_cast<int>(numel), MPI_DOUBLE, MPI_SUM,
                    MPI_COMM_WORLD);
      for (std::size_t k = 0; k < values.size(); ++k) values[k] /= writers[k];
      wrong += test::count_mismatches(values, full[i].second.to_vector<double>(), {0, 0});
      wrong += test::count_mismatches(writers, std::vector<double>(values.size(), replicas), {0, 0});
    }
    CHECK(test::sum_over_ranks(wrong) == 0);
    // blocks.0.down.bias: the 7 elements at 240 of the unit's 247, S = ceil(247 / G) per rank.
    const auto& bias = std::find_if(shards.begin(), shards.end(), [](const auto& entry) {
                         return entry.first == "blocks.0.down.bias";
                       })->second;
    if (options.sharding == dist::Sharding::none) {
      CHECK(bias.placement == "Replicate");
    } else {
      const std::int64_t s = (247 + shard_group - 1) / shard_group, rank = r % shard_group;
      const std::int64_t first = std::clamp<std::int64_t>(rank * s - 240, 0, 7),
                         last = std::clamp<std::int64_t>(rank * s + s - 240, 0, 7);
      std::string placement =
          fmt::format("Shard(flat) elements [{}, {}) of 7, rank {} of {}", first, last, rank, shard_group);
      if (replicas > 1) placement += fmt::format(", replicated over {} groups", replicas);
      CHECK(bias.placement == placement);
      CHECK(bias.first == first);
      CHECK(bias.count == last - first);
    }
  }
}

// --- activation checkpointing of units ----------------------------------------------------------------

namespace {

bool is_block(const std::string&, nn::Module& module) {
  return dynamic_cast<test::BlockImpl*>(&module) != nullptr;
}

struct Recomputes {
  int runs = 0, ungathered = 0;  // of the blocks' `up` inside a backward; of those, without bytes
};

// Trains Nested with dropout 0.3 in its blocks, sharded with `options` (null: one process on the whole
// batches), masks keyed by global sample index; each backward runs under another random context, so a
// recompute that did not restore the forward's would draw other masks.
Trace train_dropout(const std::optional<dist::FsdpOptions>& options, bool checkpointed, int steps,
                    Recomputes* recomputes = nullptr, bool root_checkpointed = false) {
  const int r = options ? world().rank() : 0, w = options ? world().size() : 1;
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested model(vocab, kSeed, 0.3);
  if (checkpointed) CHECK(nn::apply_activation_checkpointing(*model, is_block) == 3);
  if (root_checkpointed)
    CHECK(nn::apply_activation_checkpointing(
              *model, [](const std::string& name, nn::Module&) { return name.empty(); }) == 1);
  if (options) {
    for (const auto& block : *model->blocks) dist::fully_shard(*block, *options);
    dist::fully_shard(*model, *options);
  }
  if (recomputes) {
    for (const auto& block : *model->blocks) {
      block->up->register_forward_pre_hook([recomputes, &up = *block->up](nn::Module&, nn::ForwardInputs&) {
        if (!autograd::backward_running()) return;
        ++recomputes->runs;
        recomputes->ungathered += up.weight.data().storage()->nbytes() == 0;
      });
    }
  }
  const auto views = options ? dist::sharded_parameters(*model) : model->named_parameters();
  optim::AdamW optimizer(views, {.lr = 1e-2});
  Trace trace;
  for (int step = 0; step < steps; ++step) {
    const auto batch = token_batch(step, kGlobalBatch, vocab, r, w);
    std::vector<std::int64_t> rows;
    for (std::int64_t i = r; i < kGlobalBatch; i += w) rows.push_back(i);
    Variable loss;
    {
      const RandomContextGuard context({.seed = 11, .step = step, .sample_indices = rows});
      loss = cross_entropy(model(batch.tokens), batch.targets);
    }
    if (options && options->reshard_after_forward.value_or(true) && options->sharding == dist::Sharding::full)
      CHECK((*model->blocks)[0].up->weight.data().storage()->nbytes() == 0);  // freed after forward
    trace.losses.push_back(options ? mean_over_ranks(loss.data().item<float>()) : loss.data().item<float>());
    optimizer.zero_grad();
    {
      const RandomContextGuard other({.seed = 12345, .step = 99});
      loss.backward();
    }
    if (options) {
      for (const auto& [name, view] : views) trace.gradients.push_back(view.grad().to_vector<double>());
    }
    optimizer.step();
  }
  if (options) {
    trace.parameters = dist::gather_full_parameters(*model);
  } else {
    for (const auto& [name, parameter] : model->named_parameters())
      trace.parameters.emplace_back(name, parameter.data().clone());
  }
  return trace;
}

}  // namespace

TEST_CASE("checkpointed units with dropout: the recompute sees gathered parameters, gradients bit for bit",
          "[dist][fsdp][checkpoint]") {
  const int w = world().size(), group = w % 2 == 0 ? 2 : w;
  constexpr int kSteps = 3;
  const std::vector<std::pair<std::string, dist::FsdpOptions>> strategies{
      {"full", {.sharding = dist::Sharding::full}},
      {"full, keep gathered", {.sharding = dist::Sharding::full, .reshard_after_forward = false}},
      {"grad_op", {.sharding = dist::Sharding::grad_op}},
      {"none", {.sharding = dist::Sharding::none}},
      {"hybrid", {.sharding = dist::Sharding::hybrid, .hybrid_group_size = group}}};
  const Trace alone = train_dropout(std::nullopt, false, kSteps);
  for (const auto& [name, options] : strategies) {
    INFO(name << " at " << w << " ranks");
    Recomputes recomputes;
    const Trace plain = train_dropout(options, false, kSteps);
    const Trace checkpointed = train_dropout(options, true, kSteps, &recomputes);
    CHECK(differences(checkpointed, plain) == 0);
    CHECK(recomputes.runs == 3 * kSteps);  // every block recomputed in every backward ...
    CHECK(recomputes.ungathered == 0);     // ... with its parameters gathered
    // And the masks are the one process's, by global sample index.
    std::int64_t wrong = test::count_mismatches(checkpointed.losses, alone.losses, {1e-6, 1e-5});
    for (std::size_t i = 0; i < alone.parameters.size(); ++i) {
      wrong += test::count_mismatches(checkpointed.parameters[i].second.to_vector<double>(),
                                      alone.parameters[i].second.to_vector<double>(), {1e-6, 1e-5});
    }
    CHECK(test::sum_over_ranks(wrong) == 0);
  }
  {
    INFO("the root checkpointed around its block units");
    const dist::FsdpOptions options{.sharding = dist::Sharding::full};
    Recomputes recomputes;
    const Trace plain = train_dropout(options, false, kSteps);
    const Trace checkpointed = train_dropout(options, false, kSteps, &recomputes, true);
    CHECK(differences(checkpointed, plain) == 0);
    CHECK(recomputes.runs == 3 * kSteps);
    CHECK(recomputes.ungathered == 0);
  }
}
