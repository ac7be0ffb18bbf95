// tests/dist/test_fsdp_params.cpp (mpirun): FSDP trains every parameter as one process does,
// for every strategy: frozen parameters (one in a unit, a whole unit), a data-dependent branch
// used on some ranks only or on none, parameter groups, accumulation without sync, clipping
// (also over units of mixed strategies), the plan's memory with frozen parameters, the
// gathered-bytes count of destroyed units, and mixed precision fed f32 inputs.
#include <mpi.h>

#include <cmath>
#include <functional>
#include <set>

#include "core/allocator.h"
#include "core/host_wait.h"
#include "dist/fsdp/fsdp.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::kGlobalBatch;
using test::kSeed;
using test::mean_over_ranks;
using test::world;

namespace {

// `rows` on `device`: from pinned memory where that is a GPU, so that the host does not wait.
Tensor on_device(const Tensor& rows, Device device) {
  return device == rows.device() ? rows : rows.pin_memory().to(device, /*non_blocking=*/true);
}

// The nested model of fsdp_models.h with a branch, Linear(7, 7) in the root unit, added to the
// rows a mask selects, and not called at all when this rank has no selected row: a
// data-dependent branch, used on some ranks only, or on none in some steps.
class BranchyImpl : public nn::Module {
 public:
  BranchyImpl(std::int64_t vocab, std::uint64_t seed)
      : nn::Module("Branchy"),
        embed(vocab, 7),
        branch(nn::LinearOptions(7, 7)),
        head(nn::LinearOptions(7, vocab)) {
    register_module("embed", embed.ptr());
    register_module("blocks", blocks.ptr());
    register_module("branch", branch.ptr());
    register_module("head", head.ptr());
    for (const std::int64_t hidden : {16, 18, 16})
      blocks->push_back(std::make_shared<test::BlockImpl>(hidden));
    nn::initialize(*this, seed);
  }
  // tokens [B], selected [B, 1] (1 where the branch applies) -> logits [B, vocab].
  Variable operator()(const Tensor& tokens, const Tensor& selected) {
    return with_hooks(
        [&](const Tensor& input, const Tensor& rows) {
          Variable x = embed(input);
          for (const auto& block : *blocks) x = (*block)(x);
          // Decided on the host from the host's mask (a GPU step reads nothing back), applied on x's device.
          if (sum(rows).item<double>() > 0) x = add(x, mul(branch(x), constant(on_device(rows, x.device()))));
          return head(x);
        },
        tokens, selected);
  }
  nn::Embedding embed;
  nn::ModuleList<test::BlockImpl> blocks;
  nn::Linear branch;
  nn::Linear head;
};
using Branchy = nn::Holder<BranchyImpl>;

// What one training run does; every rank runs the same scenario.
struct Scenario {
  int steps = 6;
  int micro_steps = 1;              // > 1: accumulation, sync only on the last micro-step
  std::vector<std::string> frozen;  // parameters frozen before training (dotted names)
  // Whether global row `row` of micro-batch `batch` takes the branch.
  std::function<bool(int batch, std::int64_t row)> selected = [](int, std::int64_t) { return false; };
  bool groups = false;  // two groups: biases at lr 0.02 without decay, the rest at lr 0.01 with 0.1
  double clip = 0.0;    // clip_grad_norm_ before every step (0: none)
};

struct Outcome {
  std::vector<double> losses, norms;  // per step: the global mean loss, the norm before clipping
  nn::Named<Tensor> parameters;       // at the end, full
};

// This rank's rows of micro-batch `batch`: tokens, targets and the branch mask [rows, 1].
struct Rows {
  Tensor tokens, targets, selected;
};
Rows rows_of(const Scenario& scenario, std::int64_t vocab, int batch, int rank, int world_size) {
  const auto tokens = test::token_batch(batch, kGlobalBatch, vocab, rank, world_size);
  std::vector<float> selected;
  for (std::int64_t row = rank; row < kGlobalBatch; row += world_size)
    selected.push_back(scenario.selected(batch, row) ? 1.0f : 0.0f);
  const auto count = static_cast<std::int64_t>(selected.size());
  return {tokens.tokens, tokens.targets, from_vector(selected, {count, 1})};
}

std::unique_ptr<optim::AdamW> make_optimizer(const Scenario& scenario, nn::Named<Variable> parameters) {
  if (!scenario.groups)
    return std::make_unique<optim::AdamW>(std::move(parameters), optim::AdamWOptions{.lr = 1e-2});
  nn::Named<Variable> decayed, biases;
  for (auto& entry : parameters)
    (entry.first.ends_with("bias") ? biases : decayed).push_back(std::move(entry));
  return std::make_unique<optim::AdamW>(
      std::vector<optim::ParamGroup>{{.parameters = decayed},
                                     {.parameters = biases, .lr = 2e-2, .weight_decay = 0.0}},
      optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
}

void freeze(Branchy& model, const Scenario& scenario) {
  const std::set<std::string> frozen(scenario.frozen.begin(), scenario.frozen.end());
  for (auto [name, parameter] : model->named_parameters()) {
    if (frozen.contains(name)) parameter.set_requires_grad(false);
  }
}

// `shard` null: one process on the whole global batches. Otherwise FSDP over all ranks, each
// on its rows, the model wrapped by `shard`.
Outcome run(const Scenario& scenario, const std::function<void(Branchy&)>& shard) {
  const bool sharded = static_cast<bool>(shard);
  const int rank = sharded ? world().rank() : 0, world_size = sharded ? world().size() : 1;
  const std::int64_t vocab = 4 * world().size() + 1;
  Branchy model(vocab, kSeed);
  freeze(model, scenario);
  if (sharded) shard(model);
  auto optimizer =
      make_optimizer(scenario, sharded ? dist::sharded_parameters(*model) : model->named_parameters());
  Outcome outcome;
  for (int step = 0; step < scenario.steps; ++step) {
    double loss_sum = 0;
    for (int micro = 0; micro < scenario.micro_steps; ++micro) {
      const int batch = step * scenario.micro_steps + micro;
      const Rows rows = rows_of(scenario, vocab, batch, rank, world_size);
      if (sharded) dist::set_requires_gradient_sync(*model, micro == scenario.micro_steps - 1);
      Variable loss =
          mul(cross_entropy(model(rows.tokens, rows.selected), rows.targets), 1.0 / scenario.micro_steps);
      loss_sum += loss.data().item<float>();
      loss.backward();
    }
    outcome.losses.push_back(sharded ? mean_over_ranks(loss_sum) : loss_sum);
    if (scenario.clip > 0) {
      outcome.norms.push_back(
          sharded ? optim::clip_grad_norm_(model->parameters(), scenario.clip).item<double>()
                  : optim::clip_grad_norm_(model->parameters(), scenario.clip).item<double>());
    }
    optimizer->step();
    optimizer->zero_grad();
  }
  if (sharded) {
    outcome.parameters = dist::gather_full_parameters(*model);
  } else {
    for (const auto& [name, parameter] : model->named_parameters())
      outcome.parameters.emplace_back(name, parameter.data().clone());
  }
  return outcome;
}

// Values beyond 1e-6 + 1e-6 |expected|, summed over ranks (every rank compares its own copy).
std::int64_t differences(const Outcome& actual, const Outcome& expected) {
  const test::Tolerance tolerance{.atol = 1e-6, .rtol = 1e-6};
  std::int64_t wrong = test::count_mismatches(actual.losses, expected.losses, tolerance) +
                       test::count_mismatches(actual.norms, expected.norms, tolerance);
  if (wrong > 0) UNSCOPED_INFO(wrong << " losses or norms differ");
  REQUIRE(actual.parameters.size() == expected.parameters.size());
  for (std::size_t i = 0; i < expected.parameters.size(); ++i) {
    REQUIRE(actual.parameters[i].first == expected.parameters[i].first);
    const std::int64_t bad =
        test::count_mismatches(actual.parameters[i].second.to_vector<double>(),
                               expected.parameters[i].second.to_vector<double>(), tolerance);
    if (bad > 0) UNSCOPED_INFO(expected.parameters[i].first << ": " << bad << " elements differ");
    wrong += bad;
  }
  return test::sum_over_ranks(wrong);
}

// Every strategy, each unit (the blocks, then the root) with the same options.
std::vector<std::pair<std::string, dist::FsdpOptions>> strategies() {
  const int w = world().size(), group = w % 2 == 0 ? 2 : w;
  return {
      {"full", {.sharding = dist::Sharding::full}},
      {"grad_op", {.sharding = dist::Sharding::grad_op}},
      {"none", {.sharding = dist::Sharding::none}},
      {fmt::format("hybrid:{}", group), {.sharding = dist::Sharding::hybrid, .hybrid_group_size = group}}};
}

std::function<void(Branchy&)> uniformly(const dist::FsdpOptions& options) {
  return [options](Branchy& model) {
    for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
    dist::fully_shard(*model, options);
  };
}

// Runs `scenario` in one process and under every strategy; all must agree.
void check_every_strategy(const Scenario& scenario) {
  const Outcome alone = run(scenario, nullptr);
  for (const auto& [name, options] : strategies()) {
    INFO("sharding " << name << " at " << world().size() << " ranks");
    CHECK(differences(run(scenario, uniformly(options)), alone) == 0);
  }
}

// The branch takes rows 0 and 6 of every third micro-batch (ranks 0 and 6 % w), row 1 of the
// one after (rank 1 % w), and no row of the next: used on some ranks only, or on none.
bool some_ranks_or_none(int batch, std::int64_t row) {
  switch (batch % 3) {
    case 0:
      return row == 0 || row == 6;
    case 1:
      return false;
    default:
      return row == 1;
  }
}

}  // namespace

TEST_CASE("a frozen parameter in a trained unit, and a unit all frozen, train as in one process",
          "[dist][fsdp][params]") {
  Scenario scenario{.frozen = {"blocks.0.up.weight", "blocks.1.up.weight", "blocks.1.up.bias",
                               "blocks.1.down.weight", "blocks.1.down.bias"}};
  scenario.selected = [](int, std::int64_t row) { return row % 2 == 0; };
  check_every_strategy(scenario);

  // The frozen values are the initial ones, bit for bit, and carry no optimizer state.
  const std::int64_t vocab = 4 * world().size() + 1;
  Branchy initial(vocab, kSeed);
  for (const auto& [name, options] : strategies()) {
    INFO("sharding " << name);
    Branchy model(vocab, kSeed);
    freeze(model, scenario);
    uniformly(options)(model);
    const auto views = dist::sharded_parameters(*model);
    optim::AdamW optimizer(views, {.lr = 1e-2});
    for (int batch = 0; batch < 2; ++batch) {
      const Rows rows = rows_of(scenario, vocab, batch, world().rank(), world().size());
      cross_entropy(model(rows.tokens, rows.selected), rows.targets).backward();
      optimizer.step();
      optimizer.zero_grad();
    }
    for (const auto& [view_name, view] : views) {
      INFO(view_name);
      CHECK(view.requires_grad() ==
            (std::find(scenario.frozen.begin(), scenario.frozen.end(), view_name) == scenario.frozen.end()));
    }
    std::int64_t stateful_frozen = 0;
    for (const auto& [key, tensor] : optimizer.state_dict()) {
      for (const std::string& frozen : scenario.frozen) stateful_frozen += key.starts_with(frozen + ".");
    }
    CHECK(stateful_frozen == 0);
    const auto full = dist::gather_full_parameters(*model);
    const auto reference = initial->named_parameters();
    std::int64_t moved = 0;
    for (std::size_t i = 0; i < full.size(); ++i) {
      const bool frozen =
          std::find(scenario.frozen.begin(), scenario.frozen.end(), full[i].first) != scenario.frozen.end();
      if (frozen)
        moved += test::count_mismatches(full[i].second.to_vector<double>(),
                                        reference[i].second.data().to_vector<double>(), {0, 0});
    }
    CHECK(test::sum_over_ranks(moved) == 0);
  }
}

TEST_CASE("a data-dependent branch, used on some ranks only or on none, trains as in one process",
          "[dist][fsdp][params]") {
  // A parameter without a gradient on any rank is skipped by AdamW (no decay, no momentum), one
  // with a gradient on some ranks gets the average over all: any other rule moves the branch.
  check_every_strategy({.selected = some_ranks_or_none});
}

TEST_CASE("two parameter groups (biases without weight decay, at another lr) train as in one process",
          "[dist][fsdp][params]") {
  check_every_strategy({.selected = some_ranks_or_none, .groups = true});
}

TEST_CASE("accumulation without sync across micro-steps where the branch is unused trains as in one process",
          "[dist][fsdp][params]") {
  // 3 micro-steps per step: the branch used in the first of step 0 only, in none of step 1, ...
  check_every_strategy({.steps = 4, .micro_steps = 3, .selected = some_ranks_or_none, .clip = 0.05});
}

TEST_CASE("clip_grad_norm_ with frozen and unused parameters equals one process", "[dist][fsdp][params]") {
  check_every_strategy(
      {.frozen = {"blocks.0.up.weight", "head.bias"}, .selected = some_ranks_or_none, .clip = 0.05});
}

TEST_CASE("units of mixed strategies under one root: clipping and training as in one process",
          "[dist][fsdp][params][mixed]") {
  const int w = world().size();
  const dist::FsdpOptions full{.sharding = dist::Sharding::full}, none{.sharding = dist::Sharding::none},
      hybrid{.sharding = dist::Sharding::hybrid, .hybrid_group_size = w % 2 == 0 ? 2 : w};
  const auto mixed = [](const dist::FsdpOptions& inner, const dist::FsdpOptions& root) {
    return [inner, root](Branchy& model) {
      for (const auto& block : *model->blocks) dist::fully_shard(*block, inner);
      dist::fully_shard(*model, root);
    };
  };
  const Scenario scenario{.selected = some_ranks_or_none, .clip = 0.2};
  const Outcome alone = run(scenario, nullptr);
  const std::vector<std::tuple<std::string, dist::FsdpOptions, dist::FsdpOptions>> layouts{
      {"none under full", none, full}, {"full under none", full, none}, {"hybrid under full", hybrid, full}};
  for (const auto& [name, inner, root] : layouts) {
    INFO(name << " at " << w << " ranks");
    CHECK(differences(run(scenario, mixed(inner, root)), alone) == 0);
    Branchy model(4 * w + 1, kSeed);
    mixed(inner, root)(model);
    const dist::Plan plan = dist::explain(*model);
    CHECK(plan.sharding == "mixed");
    CHECK(plan.units[0].sharding == dist::sharding_name(root.sharding));
    CHECK(plan.units[1].shard_group_size == (inner.sharding == dist::Sharding::none ? 1
                                             : inner.sharding == dist::Sharding::hybrid
                                                 ? inner.hybrid_group_size
                                                 : w));
  }
}

TEST_CASE("the plan's persistent memory with frozen parameters is what the allocator measures",
          "[dist][fsdp][params][memory]") {
  const int w = world().size();
  // The branch runs (on some rank) in every step, so every trained parameter has its Adam state.
  const Scenario scenario{.frozen = {"blocks.0.up.weight", "blocks.1.up.weight", "blocks.1.up.bias",
                                     "blocks.1.down.weight", "blocks.1.down.bias"},
                          .selected = [](int, std::int64_t row) { return row % 2 == 0; }};
  for (const auto& [name, options] : strategies()) {
    INFO("sharding " << name << " at " << w << " ranks");
    const std::int64_t baseline = memory_stats(Device::cpu()).bytes_in_use;
    {
      Branchy model(4 * w + 1, kSeed);
      freeze(model, scenario);
      uniformly(options)(model);
      const dist::Plan plan = dist::explain(*model);
      // By hand: blocks.1 (18 hidden: 277 elements) is all frozen; blocks.0 has 112 frozen.
      CHECK(plan.units[2].frozen == 277);
      CHECK(plan.units[1].frozen == 112);
      CHECK(plan.units[2].reduce_scatters == 0);
      CHECK(plan.units[2].all_reduces == 0);
      // Shard f32, gradient shard f32 unless all frozen, Adam m and v for this rank's trained elements.
      std::int64_t expected = 0;
      const auto views = dist::sharded_parameters(*model);
      for (const auto& unit : plan.units)
        expected += unit.shard_elements * (unit.frozen < unit.parameters ? 8 : 4);
      for (const auto& [view_name, view] : views)
        expected += view.requires_grad() ? 8 * view.data().numel() : 0;
      CHECK(plan.total_persistent_bytes() == expected);
      optim::AdamW optimizer(views, {.lr = 1e-2});
      for (int batch = 0; batch < 2; ++batch) {
        const Rows rows = rows_of(scenario, 4 * w + 1, batch, world().rank(), w);
        optimizer.zero_grad();
        cross_entropy(model(rows.tokens, rows.selected), rows.targets).backward();
        optimizer.step();
      }
      std::int64_t step_counters = 0;
      for (const auto& [key, tensor] : optimizer.state_dict()) step_counters += key.ends_with(".step");
      const std::int64_t in_use = memory_stats(Device::cpu()).bytes_in_use - baseline;
      CHECK(in_use == plan.total_persistent_bytes() + 8 * step_counters);
    }
    CHECK(memory_stats(Device::cpu()).bytes_in_use == baseline);
  }
}

TEST_CASE("a unit destroyed while gathered leaves the gathered-bytes count", "[dist][fsdp][memory]") {
  const int w = world().size();
  const std::int64_t before = dist::unsharded_memory().bytes;
  {
    test::Nested model(4 * w + 1, kSeed);
    for (const auto& block : *model->blocks) dist::fully_shard(*block, {.reshard_after_forward = false});
    dist::fully_shard(*model);
    const auto batch = test::token_batch(0, kGlobalBatch, 4 * w + 1, world().rank(), w);
    const Variable logits = model(batch.tokens);  // grad mode, no backward: every unit stays gathered
    CHECK(dist::unsharded_memory().bytes > before);
  }
  CHECK(dist::unsharded_memory().bytes == before);
}

namespace {

// x [B, 7] f32 -> logits [B, 5]: a unit of two Linears; the compute dtype comes from FSDP.
class DenseImpl : public nn::Module {
 public:
  DenseImpl() : nn::Module("Dense"), first(nn::LinearOptions(7, 9)), second(nn::LinearOptions(9, 5)) {
    register_module("first", first.ptr());
    register_module("second", second.ptr());
    nn::initialize(*this, kSeed);
  }
  Variable operator()(const Variable& x) {
    return with_hooks([&](const Variable& input) { return second(relu(first(input))); }, x);
  }
  nn::Linear first, second;
};
using Dense = nn::Holder<DenseImpl>;

Variable inputs_of(int rank, int world_size) {
  const Tensor all = uniform({kGlobalBatch, 7}, RandomKey{.seed = 5, .stream = 2});
  std::vector<std::int64_t> rows;
  for (std::int64_t row = rank; row < kGlobalBatch; row += world_size) rows.push_back(row);
  return constant(index_select(all, 0, from_vector(rows, {static_cast<std::int64_t>(rows.size())})));
}

}  // namespace

TEST_CASE("bf16 units fed f32 inputs cast them, and the root's output_dtype gives f32 logits",
          "[dist][fsdp][mixed]") {
  const int r = world().rank(), w = world().size();
  const dist::MixedPrecision bf16{.param_dtype = DType::bf16, .output_dtype = DType::f32};
  // By hand, one process: the bf16 weights and the f32 inputs rounded to bf16, as FSDP does.
  Dense reference;
  const Variable x = inputs_of(0, 1);
  const auto w1 = cast(reference->first->weight, DType::bf16), b1 = cast(reference->first->bias, DType::bf16);
  const auto w2 = cast(reference->second->weight, DType::bf16),
             b2 = cast(reference->second->bias, DType::bf16);
  const Variable expected = linear(relu(linear(cast(x, DType::bf16), w1, b1)), w2, b2);

  for (const dist::Sharding sharding :
       {dist::Sharding::full, dist::Sharding::grad_op, dist::Sharding::none}) {
    INFO(dist::sharding_name(sharding));
    Dense model;
    dist::fully_shard(*model->first, {.sharding = sharding, .mixed_precision = {.param_dtype = DType::bf16}});
    dist::fully_shard(*model, {.sharding = sharding, .mixed_precision = bf16});
    const Variable mine = inputs_of(r, w);
    CHECK(mine.dtype() == DType::f32);
    const Variable logits = model(mine);
    CHECK(logits.dtype() == DType::f32);  // output_dtype
    std::vector<std::int64_t> rows;
    for (std::int64_t row = r; row < kGlobalBatch; row += w) rows.push_back(row);
    const Tensor want =
        index_select(expected.data(), 0, from_vector(rows, {static_cast<std::int64_t>(rows.size())}))
            .to(DType::f32);
    CHECK(test::sum_over_ranks(test::count_mismatches(logits.data().to_vector<double>(),
                                                      want.to_vector<double>(), {0, 0})) == 0);
    sum(logits).backward();  // gradients flow back through both casts
    optim::SGD optimizer(dist::sharded_parameters(*model), {.lr = 0.1});
    optimizer.step();
  }
}

TEST_CASE("without cast_forward_inputs a bf16 unit fed f32 throws a clear error, and the model still works",
          "[dist][fsdp][mixed][errors]") {
  const int r = world().rank(), w = world().size();
  Dense model;
  dist::fully_shard(*model, {.mixed_precision = {.param_dtype = DType::bf16, .cast_forward_inputs = false}});
  CHECK_THROWS_ERROR(model(inputs_of(r, w)), "linear: dtypes differ (f32 and bf16)");
  // The exception left every rank able to go on: the unit serves the next forward and backward.
  const Variable logits = model(cast(inputs_of(r, w), DType::bf16));
  sum(logits).backward();
  std::int64_t missing = 0;
  for (const auto& [name, view] : dist::sharded_parameters(*model)) missing += !view.grad().defined();
  CHECK(test::sum_over_ranks(missing) == 0);
}

TEST_CASE("a backward that throws leaves every strategy ready for the next step", "[dist][fsdp][errors]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  // One process trains on batches 0 and 2; the sharded runs also start batch 1, whose backward
  // throws from a gradient hook, and skip its step.
  test::Nested alone(vocab, kSeed);
  optim::AdamW reference(alone->named_parameters(), {.lr = 1e-2});
  for (const int batch : {0, 2}) {
    const auto rows = test::token_batch(batch, kGlobalBatch, vocab);
    cross_entropy(alone(rows.tokens), rows.targets).backward();
    reference.step();
    reference.zero_grad();
  }
  Outcome expected;
  for (const auto& [name, parameter] : alone->named_parameters())
    expected.parameters.emplace_back(name, parameter.data().clone());
  for (const auto& [name, options] : strategies()) {
    INFO("sharding " << name << " at " << w << " ranks");
    test::Nested model(vocab, kSeed);
    for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
    dist::fully_shard(*model, options);
    optim::AdamW optimizer(dist::sharded_parameters(*model), {.lr = 1e-2});
    for (const int batch : {0, 1, 2}) {
      const auto rows = test::token_batch(batch, kGlobalBatch, vocab, r, w);
      Variable logits = model(rows.tokens);
      if (batch == 1) {
        logits.register_hook([](const Tensor&) -> Tensor { fail("a hook refuses this batch"); });
        CHECK_THROWS_ERROR(cross_entropy(logits, rows.targets).backward(), "a hook refuses this batch");
      } else {
        cross_entropy(logits, rows.targets).backward();
        optimizer.step();
      }
      optimizer.zero_grad();
    }
    Outcome actual{.parameters = dist::gather_full_parameters(*model)};
    CHECK(differences(actual, expected) == 0);
  }
}

TEST_CASE(
    "on GPUs with NCCL, a rank that leaves a parameter without a gradient reads the agreed flags "
    "inside a step that forbids host waits, counted apart",
    "[dist][fsdp][params][cuda]") {
  if (dist::session().world().backend_name() != "nccl" || world().size() < 2) {
    WARN("needs NCCL across 2 or more GPUs; the session's world is "
         << dist::session().world().backend_name() << " at " << world().size() << " rank(s)");
    return;
  }
  const std::int64_t vocab = 4 * world().size() + 1;
  Branchy model(vocab, kSeed);
  model->to(dist::session().device());
  uniformly({})(model);
  optim::AdamW optimizer(dist::sharded_parameters(*model), {.lr = 1e-2});
  // Row 0 alone takes the branch: every rank but 0 leaves its parameters without a gradient.
  const Scenario scenario{.selected = [](int, std::int64_t row) { return row == 0; }};
  const Rows rows = rows_of(scenario, vocab, 0, world().rank(), world().size());
  const Tensor tokens = rows.tokens.to(dist::session().device()),
               targets = rows.targets.to(dist::session().device());
  reset_host_wait_counts();
  {
    HostWaitsForbidden step("FSDP step");
    cross_entropy(model(tokens, rows.selected), targets).backward();
    optimizer.step();
  }
  std::int64_t flag_reads = 0;
  for (const HostWaitCount& count : host_wait_counts())
    flag_reads += count.reason == "which parameters got a gradient on another rank" ? count.count : 0;
  CHECK(flag_reads == (world().rank() == 0 ? 0 : 1));
  // The branch got rank 0's gradient everywhere: its shards have one on every rank.
  for (const auto& [name, shard] : dist::sharded_parameters(*model)) {
    INFO(name);
    if (name.starts_with("branch.")) CHECK(shard.grad().defined());
  }
}
