// tests/dist/test_fsdp.cpp (mpirun): FSDP at 1-4 ranks against one process training the same
// model on the same global batches: losses at every step and the final parameters, for every
// sharding strategy; padding, communication per step against the plan, and refusals.
#include <mpi.h>

#include <array>
#include <cmath>

#include "autograd/random_context.h"
#include "core/allocator.h"
#include "core/random.h"
#include "dist/fsdp/fsdp.h"
#include "models/cnn.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/fsdp_parity.h"
#include "tests/dist/world.h"

using namespace shardlab;
using test::kGlobalBatch;
using test::kSeed;
using test::mean_over_ranks;
using test::mismatches_on_any_rank;
using test::Nested;
using test::Run;
using test::strategies;
using test::token_batch;
using test::train_alone;
using test::train_sharded;
using test::world;

TEST_CASE("FSDP training equals one process on the same global batches, for every strategy",
          "[dist][fsdp][parity]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const Run alone = train_alone(vocab, 4);
  for (const auto& [name, options] : strategies(world().size())) {
    INFO("sharding " << name << " at " << world().size() << " ranks");
    const Run sharded = train_sharded(vocab, 4, options);
    CHECK(mismatches_on_any_rank(sharded, alone, 1e-5, 1e-6) == 0);
  }
}

TEST_CASE("sharded_parameters: each parameter's piece of this rank's ceil(P / N) shard, under its own name",
          "[dist][fsdp]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  Nested alone(vocab, kSeed);
  Nested model(vocab, kSeed);
  const std::int64_t block_parameters = (*model->blocks)[0].parameter_count();  // 15 * 16 + 7 = 247
  CHECK(block_parameters == 247);
  for (const auto& block : *model->blocks) dist::fully_shard(*block);
  dist::fully_shard(*model);
  // What the layers compute with holds no bytes between steps: views of freed gathered buffers.
  const auto& block = (*model->blocks)[0];
  for (const Variable& computed_with : {block.up->weight, block.up->bias, block.down->weight}) {
    CHECK(computed_with.data().storage()->nbytes() == 0);
    CHECK(computed_with.shard_info() == nullptr);
  }
  // The module's parameters are the shards, dist::sharded_parameters an alias of them.
  const auto views = dist::sharded_parameters(*model);
  const auto registered = model->named_parameters();
  REQUIRE(registered.size() == views.size());
  for (std::size_t i = 0; i < views.size(); ++i) CHECK(registered[i].second.same(views[i].second));
  const auto originals = alone->named_parameters();
  REQUIRE(views.size() == originals.size());
  // blocks.0 flattens up.weight [16, 7], up.bias [16], down.weight [7, 16], down.bias [7]; rank r
  // holds its elements [r S, (r + 1) S), S = ceil(247 / w).
  const std::int64_t shard = (block_parameters + w - 1) / w;
  std::int64_t offset = 0, wrong = 0;
  for (std::size_t i = 0; i < views.size(); ++i) {
    const auto& [name, view] = views[i];
    INFO(name);
    REQUIRE(name == originals[i].first);
    CHECK(view.data().dim() == 1);
    CHECK(view.shape() == originals[i].second.shape());  // shape queries answer for the whole parameter
    REQUIRE(view.shard_info() != nullptr);
    CHECK(view.shard_info()->full_shape == originals[i].second.shape());
    CHECK(view.dtype() == DType::f32);
    CHECK(view.requires_grad());
    if (!name.starts_with("blocks.0.")) continue;
    const std::int64_t numel = originals[i].second.numel();
    const std::int64_t from = std::max(offset, r * shard), to = std::min(offset + numel, (r + 1) * shard);
    CHECK(view.data().numel() == std::max<std::int64_t>(0, to - from));
    CHECK(view.shard_info()->count == view.data().numel());
    if (to > from) CHECK(view.shard_info()->first == from - offset);
    if (to > from) {
      const auto expected = originals[i].second.data().view({numel}).narrow(0, from - offset, to - from);
      wrong += test::count_mismatches(view.data().to_vector<double>(), expected.to_vector<double>(), {0, 0});
    }
    offset += numel;
  }
  CHECK(test::sum_over_ranks(wrong) == 0);  // the one-process values, bit for bit
  std::int64_t total = 0;
  for (const auto& [name, view] : views) total += view.data().numel();
  CHECK(test::sum_over_ranks(total) == alone->parameter_count());  // every element on exactly one rank
  optim::AdamW optimizer(views, {.lr = 1e-2});
  std::vector<std::vector<float>> before;
  for (const auto& [name, view] : views) before.push_back(view.data().to_vector<float>());
  for (int step = 0; step < 2; ++step) (void)test::train_step(model, optimizer, vocab, step);
  std::int64_t unchanged = 0;
  for (std::size_t i = 0; i < views.size(); ++i) {
    const std::vector<float> after = views[i].second.data().to_vector<float>();
    for (std::size_t k = 0; k < after.size(); ++k) unchanged += after[k] == before[i][k];
  }
  CHECK(test::sum_over_ranks(unchanged) == 0);
  // A unit's gradients are slices of one gradient shard.
  CHECK(views[1].first == "blocks.0.up.weight");
  CHECK(views[3].first == "blocks.0.down.weight");
  CHECK(views[1].second.grad().storage() == views[3].second.grad().storage());
}

TEST_CASE(
    "communication per step matches the plan: FULL_SHARD moves 3(N-1)/N P, ZeRO-1 and NO_SHARD 2(N-1)/N P",
    "[dist][fsdp]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  std::map<std::string, std::int64_t> received;
  for (const dist::Sharding sharding :
       {dist::Sharding::full, dist::Sharding::optimizer, dist::Sharding::none}) {
    Nested model(vocab, kSeed);
    const std::int64_t parameters = model->parameter_count();
    for (const auto& block : *model->blocks) dist::fully_shard(*block, {.sharding = sharding});
    dist::fully_shard(*model, {.sharding = sharding});
    const dist::Plan plan = dist::explain(*model);
    const int units = static_cast<int>(plan.units.size());
    optim::AdamW optimizer(dist::sharded_parameters(*model), {});
    for (int step = 0; step < 2; ++step) {  // the second step runs with the recorded order and prefetch
      world().reset_counters();
      const auto batch = token_batch(step, kGlobalBatch, vocab, r, w);
      Variable loss = cross_entropy(model(batch.tokens), batch.targets);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      const dist::CollectiveCounters counters = world().counters();
      INFO(dist::sharding_name(sharding) << " step " << step << "\n" << plan.str());
      CHECK(counters.total().bytes_received == plan.bytes_per_step());
      CHECK(counters.total().bytes_sent == plan.bytes_per_step());
      // One all-reduce of a flag per parameter: which had a gradient on some rank.
      if (w > 1) CHECK(plan.gradient_flags == 15);
      if (sharding == dist::Sharding::full && w > 1) {
        // Forward gathers every unit, backward all but the root, which stays gathered.
        CHECK(counters[dist::Collective::all_gather].calls == 2 * units - 1);
        CHECK(counters[dist::Collective::reduce_scatter].calls == units);
        CHECK(counters[dist::Collective::all_reduce].calls == 1);
      } else if (sharding == dist::Sharding::optimizer && w > 1) {
        // The whole parameters kept, but refreshed once per step; the gradient reduce-scattered.
        CHECK(counters[dist::Collective::all_gather].calls == units);
        CHECK(counters[dist::Collective::reduce_scatter].calls == units);
        CHECK(counters[dist::Collective::all_reduce].calls == 1);
      } else if (w > 1) {
        CHECK(counters[dist::Collective::all_gather].calls == 0);
        CHECK(counters[dist::Collective::all_reduce].calls == units + 1);
      }
    }
    std::int64_t padded = 0;
    for (const auto& unit : plan.units) padded += unit.parameters + unit.padding;
    CHECK(padded - parameters < units * w);
    received[std::string(dist::sharding_name(sharding))] =
        world().counters().total().bytes_received - plan.flag_bytes;
    CHECK(plan.flag_bytes <= (w > 1 ? 2 * 15 : 0));
    // Per rank, in elements of 4 bytes: FULL_SHARD 3 (N-1)/N, NO_SHARD 2 (N-1)/N of the padded P
    // (the root's backward gather skipped: its share is subtracted).
    if (sharding == dist::Sharding::full) {
      const std::int64_t root = plan.units[0].parameters + plan.units[0].padding;
      CHECK(received["full"] == 4 * (3 * (w - 1) * padded / w - (w - 1) * root / w));
    } else if (sharding == dist::Sharding::optimizer) {
      CHECK(received["optimizer"] == 4 * 2 * (w - 1) * padded / w);  // all-gather + reduce-scatter
    } else {
      std::int64_t expected = 0;
      for (const auto& unit : plan.units) expected += 2 * (w - 1) * 4 * (unit.shard_elements) / w;
      CHECK(received["none"] == expected);
    }
  }
}

TEST_CASE("persistent memory per rank is the plan's: f32 shard, gradient shard and Adam state",
          "[dist][fsdp]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  for (const dist::Sharding sharding : {dist::Sharding::full, dist::Sharding::optimizer}) {
    INFO(dist::sharding_name(sharding) << " at " << w << " ranks");
    const std::int64_t baseline = memory_stats(Device::cpu()).bytes_in_use;
    {
      Nested model(vocab, kSeed);
      for (const auto& block : *model->blocks) dist::fully_shard(*block, {.sharding = sharding});
      dist::fully_shard(*model, {.sharding = sharding});
      const dist::Plan plan = dist::explain(*model);
      optim::AdamW optimizer(model->named_parameters(), {});
      dist::reset_unsharded_peak();
      for (int step = 0; step < 2; ++step) (void)test::train_step(model, optimizer, vocab, step);
      // f32 shard and gradient shard, padding included, and Adam's m and v for this rank's
      // elements of each parameter; ZeRO-1 keeps the whole f32 parameters and, reduced by more than
      // one rank, the whole f32 gradient too.
      std::int64_t shard_elements = 0, held = 0, padded = 0;
      for (const auto& unit : plan.units) {
        shard_elements += unit.shard_elements;
        padded += unit.parameters + unit.padding;
      }
      for (const auto& [name, shard] : model->named_parameters()) held += shard.data().numel();
      const bool zero1 = sharding == dist::Sharding::optimizer;
      const std::int64_t whole = zero1 ? 4 * padded * (w > 1 ? 2 : 1) : 0;
      CHECK(plan.total_persistent_bytes() == 8 * shard_elements + 8 * held + whole);
      // What is left after a step: the plan's bytes, plus AdamW's i64 step counter per parameter.
      const std::int64_t in_use = memory_stats(Device::cpu()).bytes_in_use - baseline;
      std::int64_t counters = 0;
      for (const auto& [key, tensor] : optimizer.state_dict()) counters += key.ends_with(".step");
      CHECK(counters == 15);
      CHECK(in_use == plan.total_persistent_bytes() + 8 * counters);
      CHECK(dist::unsharded_memory().bytes == (zero1 ? 4 * padded : 0));
      CHECK(plan.persistent_unsharded_bytes() == (zero1 ? 4 * padded : 0));
      // At most the root (kept gathered) and 1 + prefetch more units at once: the largest two
      // blocks here, 277 and 247 elements padded, and the root; ZeRO-1 keeps every unit.
      CHECK(dist::unsharded_memory().peak_bytes > 0);
      CHECK(dist::unsharded_memory().peak_bytes <= plan.peak_unsharded_bytes());
      CHECK(plan.peak_unsharded_bytes() ==
            (zero1 ? 4 * padded
                   : plan.units[0].unsharded_bytes + plan.units[2].unsharded_bytes +
                         plan.units[1].unsharded_bytes));
    }
    CHECK(memory_stats(Device::cpu()).bytes_in_use == baseline);
  }
}

TEST_CASE("fully_shard refuses top-down order, double sharding and ties across units",
          "[dist][fsdp][errors]") {
  Nested model(5, kSeed);
  dist::fully_shard(*model);
  CHECK_THROWS_ERROR(
      dist::fully_shard((*model->blocks)[0]),
      "fully_shard: 'blocks.0' (Block) is inside the root Nested, which is already sharded; call "
      "fully_shard on inner modules first and on the root last");
  CHECK_THROWS_ERROR(dist::fully_shard(*model), "fully_shard: this Nested is already an FSDP unit");
  Nested list_holder(5, kSeed);
  CHECK_THROWS_ERROR(
      dist::fully_shard(*list_holder->blocks),
      "fully_shard: a ModuleList has no forward of its own, so the hooks that gather its parameters "
      "would never run; shard the modules in it instead");

  // A block registered as "first" and, again as "second", either whole (one unit reached by
  // two paths: fine) or only its `up` Linear (a weight tied across units: refused).
  class Reused : public nn::Module {
   public:
    explicit Reused(bool whole) : nn::Module("Reused"), block(std::make_shared<test::BlockImpl>(16)) {
      register_module("first", block);
      if (whole) {
        register_module("second", block);
      } else {
        register_module("second", block->up.ptr());
      }
    }
    std::shared_ptr<test::BlockImpl> block;
  };
  auto tied = std::make_shared<Reused>(false);
  dist::fully_shard(*tied->block);
  CHECK_THROWS_ERROR(
      dist::fully_shard(*tied),
      "fully_shard: parameter 'second.weight' is the same tensor as 'first.up.weight', which the unit "
      "'first' holds; tied parameters must share a unit");
  CHECK_THROWS_ERROR(dist::sharded_parameters(*tied), "FSDP: the root Reused is not sharded");
  auto twice = std::make_shared<Reused>(true);
  dist::fully_shard(*twice->block);
  dist::fully_shard(*twice);
  const auto twice_views = dist::sharded_parameters(*twice);
  REQUIRE(twice_views.size() == 4);  // one module under two names: its parameters once, first name
  CHECK(twice_views[0].first == "first.up.weight");
  CHECK_THROWS_ERROR(
      dist::parse_sharding("half"),
      "sharding 'half' is not one of full, grad_op, optimizer, none, hybrid:G (G > 0 ranks per shard group)");
  CHECK_THROWS_ERROR(dist::parse_sharding("hybrid:0"), "sharding 'hybrid:0' is not one of");
  CHECK(dist::parse_sharding("hybrid:2") == std::pair{dist::Sharding::hybrid, 2});
  Nested other(5, kSeed);
  CHECK_THROWS_ERROR(
      dist::fully_shard(*other,
                        {.sharding = dist::Sharding::hybrid, .hybrid_group_size = world().size() + 1}),
      fmt::format("fully_shard: hybrid shard groups of {} ranks do not divide the {} ranks of communicator",
                  world().size() + 1, world().size()));
  CHECK_THROWS_ERROR(dist::fully_shard(*other, {.prefetch = -1}),
                     "fully_shard: prefetch must be >= 0, got -1");
  CHECK_THROWS_ERROR(
      dist::fully_shard(*other, {.mixed_precision = {.reduce_dtype = DType::i32}}),
      "fully_shard: mixed precision dtypes must be floating, got param_dtype f32, reduce_dtype i32, "
      "output_dtype none");
  CHECK_THROWS_ERROR(
      dist::fully_shard(*other,
                        {.mixed_precision = {.param_dtype = DType::bf16, .output_dtype = DType::i64}}),
      "fully_shard: mixed precision dtypes must be floating, got param_dtype bf16, reduce_dtype f32, "
      "output_dtype i64");
  Nested integral(5, kSeed);
  integral->head->bias.set_data(zeros({5}, dtype(DType::i64)));
  CHECK_THROWS_ERROR(dist::fully_shard(*integral),
                     "fully_shard: parameter 'head.bias' has dtype i64; FSDP shards floating parameters");
}

TEST_CASE("clip_grad_norm_ over the shards equals the one-process norm, for every strategy", "[dist][fsdp]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  Nested alone(vocab, kSeed);
  const auto whole = token_batch(0, kGlobalBatch, vocab);
  cross_entropy(alone(whole.tokens), whole.targets).backward();
  const double expected = optim::clip_grad_norm_(alone->parameters(), 1e9).item<double>();
  for (const auto& [name, options] : strategies(w)) {
    for (const bool fsdp2_habit : {false, true}) {
      INFO(name << " at " << w << " ranks, " << (fsdp2_habit ? "optim::" : "dist::") << "clip_grad_norm_");
      Nested model(vocab, kSeed);
      for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
      dist::fully_shard(*model, options);
      const auto mine = token_batch(0, kGlobalBatch, vocab, r, w);
      cross_entropy(model(mine.tokens), mine.targets).backward();
      // The FSDP2 habit: the model's own parameters, its shards since fully_shard.
      const double norm = (fsdp2_habit ? optim::clip_grad_norm_(model->parameters(), 0.05)
                                       : optim::clip_grad_norm_(model->parameters(), 0.05))
                              .item<double>();
      CHECK(test::sum_over_ranks(std::abs(norm - expected) <= 1e-5 * expected ? 0 : 1) == 0);
      // Clipped: the shards' global norm is now max_norm.
      CHECK(std::abs(optim::clip_grad_norm_(model->parameters(), 1e9).item<double>() - 0.05) < 1e-6);
    }
  }
}

TEST_CASE(
    "local_gradient_sum_of_squares adds up over the ranks to the one-process sum, replicas counted once",
    "[dist][fsdp]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  Nested alone(vocab, kSeed);
  const auto whole = token_batch(0, kGlobalBatch, vocab);
  cross_entropy(alone(whole.tokens), whole.targets).backward();
  const double expected = optim::gradient_sum_of_squares(alone->parameters()).item<double>();

  // Blocks replicated on every rank (no sharding), the root sharded: both kinds in one sum.
  Nested model(vocab, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block, {.sharding = dist::Sharding::none});
  dist::fully_shard(*model);
  const auto mine = token_batch(0, kGlobalBatch, vocab, r, w);
  cross_entropy(model(mine.tokens), mine.targets).backward();
  const double local = dist::local_gradient_sum_of_squares(*model).item<double>();
  std::array<double, 1> total{local};
  MPI_Allreduce(MPI_IN_PLACE, total.data(), 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  CHECK(std::abs(total[0] - expected) <= 1e-5 * expected);
  // The norm clip_grad_norm_ reports is the square root of that sum.
  CHECK(std::abs(optim::clip_grad_norm_(model->parameters(), 1e9).item<double>() - std::sqrt(total[0])) <=
        1e-9 * std::sqrt(total[0]));
  // So does optim::clip_grad_norm_ over the model's parameters (its shards), replicas counted once.
  CHECK(std::abs(optim::clip_grad_norm_(model->parameters(), 1e9).item<double>() - std::sqrt(total[0])) <=
        1e-9 * std::sqrt(total[0]));
}

TEST_CASE("k micro-steps without gradient sync then one with equal one step on the k-times batch",
          "[dist][fsdp]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1, micro = 3;
  Nested alone(vocab, kSeed);
  optim::AdamW reference(alone->named_parameters(), {.lr = 1e-2});
  // The big batch: the micro-batches' rows together; the loss mean over all of them.
  Variable total;
  for (std::int64_t k = 0; k < micro; ++k) {
    const auto batch = token_batch(k, kGlobalBatch, vocab);
    Variable part = mul(cross_entropy(alone(batch.tokens), batch.targets), 1.0 / micro);
    total = total.defined() ? add(total, part) : part;
  }
  total.backward();
  reference.step();

  Nested model(vocab, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block);
  dist::fully_shard(*model);
  optim::AdamW optimizer(dist::sharded_parameters(*model), {.lr = 1e-2});
  world().reset_counters();
  for (std::int64_t k = 0; k < micro; ++k) {
    dist::set_requires_gradient_sync(*model, k == micro - 1);
    const auto batch = token_batch(k, kGlobalBatch, vocab, r, w);
    mul(cross_entropy(model(batch.tokens), batch.targets), 1.0 / micro).backward();
  }
  optimizer.step();
  if (w > 1) CHECK(world().counters()[dist::Collective::reduce_scatter].calls == 4);  // once per unit
  Run expected, actual;
  for (const auto& [name, variable] : alone->named_parameters())
    expected.parameters.emplace_back(name, variable.data());
  actual.parameters = dist::gather_full_parameters(*model);
  CHECK(mismatches_on_any_rank(actual, expected, 1e-5, 1e-6) == 0);
}

// Each parameter shard's gradient, as doubles, in the order of sharded_parameters.
std::vector<std::vector<double>> shard_gradients(Nested& model) {
  std::vector<std::vector<double>> out;
  for (const auto& [name, parameter] : dist::sharded_parameters(*model)) {
    const Tensor grad = parameter.grad();
    out.push_back(grad.defined() ? grad.to(DType::f64).to_vector<double>()
                                 : std::vector<double>(static_cast<std::size_t>(parameter.data().numel()), 0.0));
  }
  return out;
}

TEST_CASE("bf16 micro-steps without gradient sync add their gradients in f32, as FSDP2 upcasts them",
          "[dist][fsdp][accumulation]") {
  const int r = world().rank(), w = world().size();
  const std::int64_t vocab = 4 * w + 1, micro = 4;
  const dist::FsdpOptions bf16{.mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32}};
  const auto shard = [&](Nested& model) {
    for (const auto& block : *model->blocks) dist::fully_shard(*block, bf16);
    dist::fully_shard(*model, bf16);
  };
  // Reference: each micro-batch's reduced gradient alone, summed in f64.
  Nested apart(vocab, kSeed);
  shard(apart);
  optim::AdamW apart_optimizer(dist::sharded_parameters(*apart), {});
  std::vector<std::vector<double>> expected;
  for (std::int64_t k = 0; k < micro; ++k) {
    apart_optimizer.zero_grad();
    const auto batch = token_batch(k, kGlobalBatch, vocab, r, w);
    cross_entropy(apart(batch.tokens), batch.targets).backward();
    const std::vector<std::vector<double>> part = shard_gradients(apart);
    if (expected.empty()) expected.assign(part.size(), {});
    for (std::size_t i = 0; i < part.size(); ++i) {
      expected[i].resize(part[i].size(), 0.0);
      for (std::size_t e = 0; e < part[i].size(); ++e) expected[i][e] += part[i][e];
    }
  }
  Nested model(vocab, kSeed);
  shard(model);
  const dist::Plan plan = dist::explain(*model);
  std::int64_t padded = 0;
  for (const dist::UnitPlan& unit : plan.units) padded += unit.parameters + unit.padding;
  CHECK(plan.accumulation_bytes() == 4 * padded);  // f32 sums, not the bf16 gradients' 2 bytes
  for (std::int64_t k = 0; k < micro; ++k) {
    dist::set_requires_gradient_sync(*model, k == micro - 1);
    const auto batch = token_batch(k, kGlobalBatch, vocab, r, w);
    cross_entropy(model(batch.tokens), batch.targets).backward();
  }
  const std::vector<std::vector<double>> actual = shard_gradients(model);
  REQUIRE(actual.size() == expected.size());
  // Summed in bf16, the gradients would be off by about 2^-9 of their size; in f32 by rounding only.
  std::int64_t off = 0;
  double largest = 0;
  for (const auto& values : expected)
    for (const double value : values) largest = std::max(largest, std::abs(value));
  for (std::size_t i = 0; i < expected.size(); ++i) {
    REQUIRE(actual[i].size() == expected[i].size());
    for (std::size_t e = 0; e < expected[i].size(); ++e)
      off += std::abs(actual[i][e] - expected[i][e]) > 1e-6 * largest + 1e-5 * std::abs(expected[i][e]);
  }
  CHECK(test::sum_over_ranks(off) == 0);
}

TEST_CASE("the plan table names every unit with its counts", "[dist][fsdp][explain]") {
  const int w = world().size();
  Nested model(4 * w + 1, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block);
  dist::fully_shard(*model);
  const dist::Plan plan = dist::explain(*model);
  const std::string table = plan.str();
  CHECK_THAT(table, Catch::Matchers::StartsWith(fmt::format(
                        "FSDP plan: sharding full, {} ranks, shard groups of {}, prefetch 1\n", w, w)));
  const std::int64_t shard = (247 + w - 1) / w;
  const std::int64_t held = std::min(shard, 247 - world().rank() * shard);  // padding sits on the last rank
  CHECK_THAT(table,
             Catch::Matchers::Contains(fmt::format("{:<16} {:>10} {:>7} {:>10} {:>12}", "blocks.0", 247,
                                                   shard * w - 247, shard, 8 * shard + 8 * held)));
  CHECK(plan.units[2].name == "blocks.1");
  CHECK(plan.units[2].parameters == 277);
  CHECK(plan.units[0].backward_gathers == 0);  // the root stays gathered for backward
  CHECK(plan.units[1].backward_gathers == (w > 1 ? 1 : 0));
  CHECK(plan.note.empty());
  std::int64_t padded = 0;  // every unit's flat length, padding included
  for (const auto& unit : plan.units) padded += unit.parameters + unit.padding;
  CHECK(plan.accumulation_bytes() == 4 * padded);
  CHECK_THAT(table, Catch::Matchers::Contains(fmt::format("keeps every unit's unsharded gradient between "
                                                          "micro-steps: +{} B per rank",
                                                          plan.accumulation_bytes())));

  Nested offloaded(4 * w + 1, kSeed);
  dist::fully_shard(*offloaded, {.cpu_offload = true});
  CHECK_THAT(dist::explain(*offloaded).str(),
             Catch::Matchers::Contains(
                 "cpu offload: nothing to do, parameters and optimizer state are already in host "
                 "memory\n"));
}

// One optimizer step of `micro_batches` forward and backward passes, reducing as `sync` says (the
// training programs' loop); the units' collectives of the step.
dist::CollectiveCounters accumulated_step(Nested& model, optim::Optimizer& optimizer, std::int64_t vocab,
                                          int step, const dist::Accumulation& accumulation) {
  const int r = world().rank(), w = world().size();
  dist::reset_collective_counters(*model);
  optimizer.zero_grad();
  for (int part = 0; part < accumulation.micro_batches; ++part) {
    const bool last = part + 1 == accumulation.micro_batches;
    if (accumulation.sync == dist::MicroBatchSync::last) dist::set_requires_gradient_sync(*model, last);
    if (accumulation.sync == dist::MicroBatchSync::reduce_scatter) dist::set_requires_all_reduce(*model, last);
    const auto batch = token_batch(step * accumulation.micro_batches + part, kGlobalBatch, vocab, r, w);
    cross_entropy(model(batch.tokens), batch.targets).backward();
  }
  optimizer.step();
  return dist::collective_counters(*model);
}

TEST_CASE("an accumulated step's communication matches the plan under each micro-batch sync",
          "[dist][fsdp][explain]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  constexpr int kMicroBatches = 3;
  struct Case {
    dist::Sharding sharding;
    int group;
    dist::MicroBatchSync sync;
  };
  std::vector<Case> cases;
  for (const dist::MicroBatchSync sync : {dist::MicroBatchSync::every, dist::MicroBatchSync::last}) {
    for (const dist::Sharding sharding : {dist::Sharding::full, dist::Sharding::optimizer, dist::Sharding::none})
      cases.push_back({sharding, 0, sync});
  }
  cases.push_back({dist::Sharding::none, 0, dist::MicroBatchSync::reduce_scatter});
  if (w % 2 == 0) {
    for (const dist::MicroBatchSync sync :
         {dist::MicroBatchSync::every, dist::MicroBatchSync::reduce_scatter, dist::MicroBatchSync::last})
      cases.push_back({dist::Sharding::hybrid, w / 2, sync});
  }
  for (const Case& c : cases) {
    Nested model(vocab, kSeed);
    const dist::FsdpOptions options{.sharding = c.sharding, .hybrid_group_size = c.group};
    for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
    dist::fully_shard(*model, options);
    dist::Plan plan = dist::explain(*model);
    const std::int64_t one_pass = plan.bytes_per_step();
    plan.accumulation = {.micro_batches = kMicroBatches, .sync = c.sync};
    optim::AdamW optimizer(dist::sharded_parameters(*model), {});
    for (int step = 0; step < 2; ++step) {
      const dist::CollectiveCounters counters =
          accumulated_step(model, optimizer, vocab, step, {.micro_batches = kMicroBatches, .sync = c.sync});
      INFO(dist::sharding_name(c.sharding) << " group " << c.group << " sync "
                                           << dist::micro_batch_sync_name(c.sync) << " step " << step << "\n"
                                           << plan.str());
      CHECK(counters.total().bytes_received == plan.bytes_per_step());
    }
    // By hand from the unit's rows: every micro-batch gathers; every one reduces, or the last only, or
    // (reduce-scatter) every one reduce-scatters and the last all-reduces over the replicas.
    std::int64_t gathers = 0, reduce_scatters = 0, all_reduces = 0;
    for (const dist::UnitPlan& unit : plan.units) {
      gathers += unit.forward_gather_bytes + unit.backward_gather_bytes;
      reduce_scatters += unit.reduce_bytes - unit.replica_reduce_bytes;
      all_reduces += unit.replica_reduce_bytes;
    }
    CHECK(one_pass == gathers + reduce_scatters + all_reduces + plan.flag_bytes);
    const std::int64_t expected =
        c.sync == dist::MicroBatchSync::every ? kMicroBatches * one_pass
        : c.sync == dist::MicroBatchSync::last
            ? kMicroBatches * gathers + reduce_scatters + all_reduces + plan.flag_bytes
            : kMicroBatches * (gathers + reduce_scatters + plan.flag_bytes) + all_reduces;
    CHECK(plan.bytes_per_step() == expected);
    if (c.sync == dist::MicroBatchSync::reduce_scatter && w > 1) CHECK(all_reduces > 0);
  }
}

TEST_CASE("the plan's accumulation line and gradient term follow the micro-batch sync", "[dist][fsdp][explain]") {
  const int w = world().size();
  Nested model(4 * w + 1, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block, {.sharding = dist::Sharding::none});
  dist::fully_shard(*model, {.sharding = dist::Sharding::none});
  dist::Plan plan = dist::explain(*model);
  const std::int64_t in_flight = plan.gradient_buffer_bytes();
  CHECK(plan.accumulated_gradient_bytes() == in_flight);
  std::int64_t shards = 0;  // NO_SHARD: each unit's whole gradient, replicated on every rank
  for (const dist::UnitPlan& unit : plan.units) shards += unit.shard_elements;
  plan.accumulation = {.micro_batches = 4, .sync = dist::MicroBatchSync::reduce_scatter};
  CHECK(plan.partial_sum_bytes() == (w > 1 ? 4 * shards : 0));
  CHECK(plan.accumulated_gradient_bytes() == in_flight + plan.partial_sum_bytes());
  CHECK_THAT(plan.str(), Catch::Matchers::EndsWith(fmt::format(
                             "gradient accumulation: 4 micro-batches a step, a forward and backward each; each "
                             "reduce-scatters, the all-reduce over the replicas waits for the last "
                             "(set_requires_all_reduce(false)): +{} B per rank of partial sums\n",
                             plan.partial_sum_bytes())));
  plan.accumulation.sync = dist::MicroBatchSync::last;  // f32, no cast: the sums are the buffers written
  CHECK(plan.accumulated_gradient_bytes() == plan.accumulation_bytes());
  plan.accumulation.sync = dist::MicroBatchSync::every;
  CHECK(plan.accumulated_gradient_bytes() == in_flight);
  CHECK(dist::parse_micro_batch_sync("reduce-scatter") == dist::MicroBatchSync::reduce_scatter);
  CHECK_THROWS_ERROR(dist::parse_micro_batch_sync("never"),
                     "micro-batch sync 'never' is not one of every, reduce-scatter, last");
}

TEST_CASE("the plan at another world size is what rank 0's plan is when sharded over that many ranks",
          "[dist][fsdp][explain]") {
  const int w = world().size();
  const std::unique_ptr<dist::Communicator> alone = world().split(world().rank(), 0, "alone");
  auto cases = strategies(w);
  cases.emplace_back(
      "full, bf16 gathers, f32 reductions",
      dist::FsdpOptions{.mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32}});
  if (w == 4)
    cases.emplace_back("full, resharded to pairs after forward",
                       dist::FsdpOptions{.reshard_after_forward_group = 2});
  const auto sharded = [&](dist::FsdpOptions options, dist::Communicator& over) {
    options.communicator = &over;
    auto model = std::make_unique<Nested>(4 * w + 1, kSeed);
    for (auto [name, parameter] : (*model)->named_parameters())
      if (name == "blocks.1.up.weight") parameter.set_requires_grad(false);  // frozen: no gradient, no state
    for (const auto& block : *(*model)->blocks) dist::fully_shard(*block, options);
    dist::fully_shard(**model, options);
    return model;
  };
  for (const auto& [name, options] : cases) {
    INFO(name << " at " << w << " ranks");
    const auto live = sharded(options, world());
    // Alone, each rank cannot shard hybrid groups or post-forward groups of more ranks: fully, and the
    // strategy given to explain. The other options (precision, prefetch, offload, resharding) stay.
    dist::FsdpOptions here = options;
    here.sharding = dist::Sharding::full, here.hybrid_group_size = 0, here.reshard_after_forward_group = 0;
    const auto one = sharded(here, *alone);
    const dist::Plan measured = dist::explain(**live, 8);
    const dist::Plan planned =
        dist::explain(**one, 8,
                      {.world_size = w,
                       .sharding = options.sharding,
                       .hybrid_group_size = options.hybrid_group_size,
                       .reshard_after_forward_group = options.reshard_after_forward_group});
    CHECK(planned.world_size == w);
    if (world().rank() != 0) continue;
    CHECK(planned.str() == measured.str());
    CHECK(planned.units == measured.units);
    CHECK(planned.flag_bytes == measured.flag_bytes);
    CHECK(planned.peak_unsharded_bytes() == measured.peak_unsharded_bytes());
    CHECK(planned.gradient_buffer_bytes() == measured.gradient_buffer_bytes());
    // Without a strategy the units keep their own: the fully sharded plan at w ranks.
    if (options.sharding == dist::Sharding::full && !options.reshard_after_forward &&
        options.reshard_after_forward_group == 0)
      CHECK(dist::explain(**one, 8, {.world_size = w}).units == measured.units);
  }
}

TEST_CASE("the plan at another world size names a strategy that does not fit it",
          "[dist][fsdp][explain][errors]") {
  const std::unique_ptr<dist::Communicator> alone = world().split(world().rank(), 0, "alone");
  Nested model(9, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block, {.communicator = alone.get()});
  dist::fully_shard(*model, {.communicator = alone.get()});
  CHECK_THROWS_WITH(
      dist::explain(*model, 8, {.world_size = 3, .sharding = dist::Sharding::hybrid, .hybrid_group_size = 2}),
      "explain: hybrid shard groups of 2 ranks do not divide a world of 3 ranks");
  CHECK_THROWS_WITH(
      dist::explain(*model, 8,
                    {.world_size = 2, .sharding = dist::Sharding::full, .reshard_after_forward_group = 2}),
      "explain: reshard_after_forward_group 2 must divide the shard group of 2 ranks at a world of 2 and be "
      "neither 1 nor all of it");
  CHECK_THROWS_WITH(dist::explain(*model, 8, {.world_size = 0}), "explain: a world of 0 ranks");
}

namespace {

// Trains the nested model with FSDP over `comm` (all ranks, or each rank alone) under a bf16
// policy with SGD, returning the global-mean losses and the final full parameters.
Run train_bf16(dist::Communicator& comm, std::int64_t vocab, int steps) {
  const dist::FsdpOptions options{.mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32},
                                  .communicator = &comm};
  Nested model(vocab, kSeed);
  for (const auto& block : *model->blocks) dist::fully_shard(*block, options);
  dist::fully_shard(*model, options);
  optim::SGD optimizer(dist::sharded_parameters(*model), {.lr = 0.1});
  Run run;
  for (int step = 0; step < steps; ++step) {
    const auto batch = token_batch(step, kGlobalBatch, vocab, comm.rank(), comm.size());
    const Variable logits = model(batch.tokens);
    CHECK(logits.dtype() == DType::bf16);  // the compute ran in bf16
    Variable loss = cross_entropy(logits, batch.targets);
    CHECK(loss.dtype() == DType::f32);  // taken in f32 from the bf16 logits
    const Tensor local = full({1}, loss.data().to(DType::f32).item<float>(), dtype(DType::f64));
    comm.all_reduce(local, dist::ReduceOp::avg).wait();
    run.losses.push_back(local.item<double>());
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
  for (const auto& [name, shard] : dist::sharded_parameters(*model))
    CHECK(shard.dtype() == DType::f32);  // the master
  run.plan = dist::explain(*model);
  run.parameters = dist::gather_full_parameters(*model);
  return run;
}

}  // namespace

TEST_CASE("bf16 mixed precision: gathers and computes in bf16, reduces in f32, keeps f32 master shards",
          "[dist][fsdp][mixed]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  // The 1-process run with the same casts: FSDP over a communicator of this rank alone.
  auto alone_comm = world().split(world().rank(), 0, "alone");
  const Run alone = train_bf16(*alone_comm, vocab, 3);
  world().reset_counters();
  const Run sharded = train_bf16(world(), vocab, 3);
  // Batch rows split over ranks change the bf16 rounding of the gradients: bf16 tolerance.
  CHECK(mismatches_on_any_rank(sharded, alone, 2e-2, 2e-3) == 0);
  if (w > 1) {
    // Gathers carry 2-byte elements, reductions 4-byte ones: bf16 all-gathers move half the
    // bytes of the f32 reduce-scatters of the same padded buffers.
    const auto counters = world().counters();
    const auto gathered = counters[dist::Collective::all_gather].bytes_received;
    const auto reduced = counters[dist::Collective::reduce_scatter].bytes_received;
    CHECK(gathered > 0);
    // 3 steps of forward and backward gathers in bf16, then the f32 gather of the final
    // parameters; 3 reduce-scatters per unit in f32.
    std::int64_t expected_gathered = 0, expected_reduced = 0;
    for (const dist::UnitPlan& unit : sharded.plan.units) {
      CHECK(2 * unit.forward_gather_bytes == unit.reduce_bytes);  // 2-byte gathers, 4-byte reductions
      expected_gathered +=
          3 * (unit.forward_gather_bytes + unit.backward_gather_bytes) + 2 * unit.forward_gather_bytes;
      expected_reduced += 3 * unit.reduce_bytes;
    }
    CHECK(gathered == expected_gathered);
    CHECK(reduced == expected_reduced);
  }
}

TEST_CASE("the CNN with dropout: N ranks reproduce the 1-process losses, masks keyed by global sample index",
          "[dist][fsdp][cnn]") {
  const int r = world().rank(), w = world().size();
  constexpr std::int64_t kSteps = 3;
  const Tensor images = uniform({kSteps * kGlobalBatch, 1, 28, 28}, RandomKey{.seed = 3, .stream = 1});
  std::vector<std::int64_t> label_values;
  for (std::int64_t i = 0; i < kSteps * kGlobalBatch; ++i) label_values.push_back(i * 7 % 10);
  const Tensor labels = from_vector(label_values, {kSteps * kGlobalBatch});
  // Rows of step k's global batch on `rank` of `world_size`, by global sample index.
  const auto rows = [&](std::int64_t step, int rank, int world_size) {
    std::vector<std::int64_t> indices;
    for (std::int64_t i = rank; i < kGlobalBatch; i += world_size) indices.push_back(step * kGlobalBatch + i);
    return indices;
  };
  const auto train = [&](models::Cnn& model, optim::Optimizer& optimizer, int rank, int world_size) {
    std::vector<double> losses;
    for (std::int64_t step = 0; step < kSteps; ++step) {
      const std::vector<std::int64_t> indices = rows(step, rank, world_size);
      const Tensor index = from_vector(indices, {static_cast<std::int64_t>(indices.size())});
      const RandomContextGuard context({.seed = 11, .step = step, .sample_indices = indices});
      Variable loss =
          nll_loss(model(constant(index_select(images, 0, index))), index_select(labels, 0, index));
      losses.push_back(world_size == 1 ? loss.data().item<float>()
                                       : mean_over_ranks(loss.data().item<float>()));
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
    }
    return losses;
  };
  models::Cnn alone(1);
  optim::Adadelta alone_optimizer(alone->named_parameters(), {.lr = 1.0});
  const std::vector<double> expected = train(alone, alone_optimizer, 0, 1);

  models::Cnn model(1);
  dist::fully_shard(*model->conv2);
  dist::fully_shard(*model->fc1);
  dist::fully_shard(*model);
  optim::Adadelta optimizer(dist::sharded_parameters(*model), {.lr = 1.0});
  const std::vector<double> losses = train(model, optimizer, r, w);
  std::int64_t wrong = 0;
  for (std::size_t k = 0; k < expected.size(); ++k) {
    UNSCOPED_INFO("step " << k << ": " << losses[k] << " vs " << expected[k]);
    wrong += !(std::abs(losses[k] - expected[k]) <= 1e-5 * std::abs(expected[k]));
  }
  // Different masks would change the losses by far more than 1e-5: the dropout rows match.
  CHECK(test::sum_over_ranks(wrong) == 0);
}

TEST_CASE("sharded initialisation: each rank draws only its shard, the values one process draws",
          "[dist][fsdp][init]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  Nested whole(vocab, kSeed);
  const std::int64_t full_bytes = 4 * whole->parameter_count();

  const std::int64_t baseline = memory_stats(Device::cpu()).bytes_in_use;
  reset_peak_memory(Device::cpu());
  std::optional<Nested> model;
  {
    const nn::DeferredInitGuard deferred;
    model.emplace(vocab, kSeed);
  }
  for (const auto& [name, variable] : (*model)->named_parameters()) {
    INFO(name);
    CHECK(nn::deferred(variable.data()));  // shapes only
  }
  CHECK(memory_stats(Device::cpu()).bytes_in_use == baseline);
  for (const auto& block : *(*model)->blocks) dist::fully_shard(*block);
  dist::fully_shard(**model);
  const dist::Plan plan = dist::explain(**model);
  std::int64_t shard_bytes = 0;
  for (const auto& unit : plan.units) shard_bytes += 4 * unit.shard_elements;
  // Nothing but the f32 shards was ever allocated.
  CHECK(memory_stats(Device::cpu()).peak_bytes - baseline == shard_bytes);
  if (w > 2) CHECK(shard_bytes < full_bytes / 2);

  const nn::Named<Tensor> drawn = dist::gather_full_parameters(**model);
  const nn::Named<Variable> expected = whole->named_parameters();
  REQUIRE(drawn.size() == expected.size());
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < drawn.size(); ++i) {
    REQUIRE(drawn[i].first == expected[i].first);
    wrong += test::count_mismatches(drawn[i].second.to_vector<double>(),
                                    expected[i].second.data().to_vector<double>(), {.atol = 0, .rtol = 0});
  }
  CHECK(test::sum_over_ranks(wrong) == 0);  // bit-identical
}

TEST_CASE("sharded initialisation refuses a root that was never initialised", "[dist][fsdp][init][errors]") {
  class Bare : public nn::Module {
   public:
    Bare() : nn::Module("Bare"), fc(nn::LinearOptions(3, 2)) { register_module("fc", fc.ptr()); }
    nn::Linear fc;
  };
  std::shared_ptr<Bare> bare;
  {
    const nn::DeferredInitGuard deferred;
    bare = std::make_shared<Bare>();
  }
  dist::fully_shard(*bare);
  CHECK_THROWS_ERROR(
      dist::sharded_parameters(*bare),
      "FSDP: unit (root)'s parameters were made under nn::DeferredInitGuard, but nn::initialize(root, "
      "seed) was not called on the root Bare");
}

TEST_CASE("a unit's parameters are all deferred or none", "[dist][fsdp][init][errors]") {
  class Mixed : public nn::Module {
   public:
    Mixed(nn::Linear deferred_layer, nn::Linear real_layer)
        : nn::Module("Mixed"), a(std::move(deferred_layer)), b(std::move(real_layer)) {
      register_module("a", a.ptr());
      register_module("b", b.ptr());
    }
    nn::Linear a, b;
  };
  std::optional<nn::Linear> shapes_only;
  {
    const nn::DeferredInitGuard deferred;
    shapes_only.emplace(nn::LinearOptions(3, 2));
  }
  auto mixed = std::make_shared<Mixed>(*shapes_only, nn::Linear(nn::LinearOptions(2, 2)));
  CHECK_THROWS_ERROR(
      dist::fully_shard(*mixed),
      "fully_shard: parameter 'b.weight' has its bytes but 'a.weight' has none; a unit's parameters are "
      "all made under nn::DeferredInitGuard or none");
}

TEST_CASE("prefetch issues the next unit's all-gather before that unit runs; depth 0 does not",
          "[dist][fsdp][prefetch]") {
  const int r = world().rank(), w = world().size();
  if (w == 1) return;  // one rank gathers nothing
  const std::int64_t vocab = 4 * w + 1;
  for (const int depth : {0, 1, 2}) {
    INFO("prefetch " << depth);
    Nested model(vocab, kSeed);
    for (const auto& block : *model->blocks) dist::fully_shard(*block, {.prefetch = depth});
    dist::fully_shard(*model, {.prefetch = depth});
    // Registered after FSDP's hook, so it runs once blocks.0 is gathered: what has been issued
    // for blocks.1 and blocks.2 by then?
    std::vector<std::string> issued_before_block0;
    (*model->blocks)[0].register_forward_pre_hook([&](nn::Module&, nn::ForwardInputs&) {
      issued_before_block0.clear();
      for (const auto& entry : world().monitor().tail(8))
        issued_before_block0.push_back(entry.fingerprint.tag);
    });
    optim::AdamW optimizer(dist::sharded_parameters(*model), {});
    for (int step = 0; step < 2; ++step) {  // the first step records the order
      const auto batch = token_batch(step, kGlobalBatch, vocab, r, w);
      Variable loss = cross_entropy(model(batch.tokens), batch.targets);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
    }
    const auto issued = [&](const std::string& tag) {
      return std::count(issued_before_block0.end() - 3, issued_before_block0.end(), tag) > 0;
    };
    CHECK(issued("pre-forward blocks.0"));
    CHECK(issued("pre-forward blocks.1") == (depth >= 1));
    CHECK(issued("pre-forward blocks.2") == (depth >= 2));
  }
}

TEST_CASE("shard_by_type and shard_by_size wrap in one call, innermost first and the root last",
          "[dist][fsdp][wrap]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  Nested by_type(vocab, kSeed);
  CHECK(dist::shard_by_type<test::BlockImpl>(*by_type) == 4);
  std::vector<std::string> names;
  for (const auto& unit : dist::explain(*by_type).units) names.push_back(unit.name);
  CHECK(names == std::vector<std::string>{"", "blocks.0", "blocks.1", "blocks.2"});

  // At least 250 parameters not taken by an inner unit: blocks.1 (277) qualifies, blocks.0 and
  // blocks.2 (247 each) do not; the ModuleList holding them has no forward and is skipped, so
  // they stay with the root.
  Nested by_size(vocab, kSeed);
  CHECK(dist::shard_by_size(*by_size, 250) == 2);
  names.clear();
  std::vector<std::int64_t> counts;
  for (const auto& unit : dist::explain(*by_size).units) {
    names.push_back(unit.name);
    counts.push_back(unit.parameters);
  }
  CHECK(names == std::vector<std::string>{"", "blocks.1"});
  CHECK(counts == std::vector<std::int64_t>{15 * vocab + 494, 277});
  // Trained like the hand-wrapped model: the same numbers as one process.
  CHECK(mismatches_on_any_rank(train_sharded(by_size, vocab, 2), train_alone(vocab, 2), 1e-5, 1e-6) == 0);
}

TEST_CASE("a module inside a unit that runs without the unit's forward is refused, not fed freed bytes",
          "[dist][fsdp][errors]") {
  Nested model(5, kSeed);
  dist::fully_shard(*model);
  Variable x = Variable(full({2, 7}, 0.5f));
  CHECK_THROWS_ERROR(
      (*model->blocks)[1](x),
      "FSDP: Linear 'blocks.1.up' ran while its parameters, held by the unit the root Nested, were not "
      "gathered: the unit's own forward did not run first");
  // Through the unit's own forward all is well.
  CHECK(model(from_vector(std::vector<std::int64_t>{1, 2}, {2})).shape() == Shape{2, 5});
}
