// tests/dist/test_fsdp2_habits.cpp (mpirun): after fully_shard a module's own parameters are this
// rank's shards, so the habits of PyTorch FSDP2 users work: an optimizer over named_parameters(),
// shape queries, state dicts, freezing (clipping over parameters() is in test_fsdp.cpp); and what
// cannot work on a sharded module is refused, naming the parameter and the fix.
#include <fmt/format.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "dist/fsdp/fsdp.h"
#include "models/generate.h"
#include "models/llama.h"
#include "optim/optimizer.h"
#include "tests/dist/fsdp_models.h"
#include "tests/dist/fsdp_parity.h"
#include "tests/dist/world.h"

using namespace shardlab;
using namespace shardlab::test;  // Nested, its batches, shard, and the parity runs

namespace {

// The names of the parameters a "decay the matrices" rule picks, by dim() >= 2.
std::vector<std::string> matrices(const nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& [name, parameter] : model.named_parameters()) {
    if (parameter.dim() >= 2) names.push_back(name);
  }
  return names;
}

}  // namespace

TEST_CASE("an optimizer over a sharded model's own parameters trains as dist::sharded_parameters does",
          "[dist][fsdp][fsdp2]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const Run alone = train_alone(vocab, 4);
  const Run untrained = train_alone(vocab, 0);
  for (const auto& [name, options] : strategies(world().size())) {
    INFO("sharding " << name << " at " << world().size() << " ranks");
    Nested model(vocab, kSeed);
    shard(model, options);
    const Run habit = train_sharded(model, vocab, 4, model->named_parameters());
    const Run reference = train_sharded(vocab, 4, options);
    CHECK(mismatches_on_any_rank(habit, reference, 0, 0) == 0);  // bit for bit
    CHECK(mismatches_on_any_rank(habit, alone, 1e-5, 1e-6) == 0);
    // It trains: the defect left every parameter at its initial value.
    CHECK(mismatches_on_any_rank(habit, untrained, 0, 0) > 0);
  }
}

TEST_CASE("a sharded parameter answers shape queries for the whole parameter", "[dist][fsdp][fsdp2]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested plain(vocab, kSeed);
  Nested model(vocab, kSeed);
  const std::vector<std::string> before = matrices(*model);
  shard(model);
  CHECK(matrices(*model) == before);  // decay groups made after sharding are the same groups
  CHECK(before.size() == 8);          // by hand: embed, head, and up and down of 3 blocks
  CHECK(model->parameter_count() == plain->parameter_count());
  CHECK(model->str() == plain->str());
  const auto originals = plain->named_parameters();
  const auto shards = model->named_parameters();
  REQUIRE(shards.size() == originals.size());
  for (std::size_t i = 0; i < shards.size(); ++i) {
    INFO(shards[i].first);
    const Variable& shard_variable = shards[i].second;
    CHECK(shard_variable.shape() == originals[i].second.shape());
    CHECK(shard_variable.numel() == originals[i].second.numel());
    CHECK(shard_variable.size(-1) == originals[i].second.size(-1));
    REQUIRE(shard_variable.shard_info() != nullptr);
    CHECK(shard_variable.data().numel() == shard_variable.shard_info()->count);
  }
}

TEST_CASE("a sharded module's state_dict is its shards; load_state_dict takes the full or the sharded one",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  for (const auto& [name, options] : strategies(w)) {
    INFO(name << " at " << w << " ranks");
    Nested trained(vocab, kSeed);
    shard(trained, options);
    (void)train_sharded(trained, vocab, 2, trained->named_parameters());
    const nn::StateDict sharded = trained->state_dict();
    const auto shards = trained->named_parameters();
    REQUIRE(sharded.size() == shards.size());  // Nested has no buffers
    for (std::size_t i = 0; i < shards.size(); ++i) {
      CHECK(sharded[i].first == shards[i].first);
      CHECK(sharded[i].second.storage() == shards[i].second.data().storage());  // the shard itself
    }
    const nn::Named<Tensor> full = dist::gather_full_parameters(*trained);
    const nn::StateDict full_state(full.begin(), full.end());

    Nested from_full(vocab, kSeed + 1), from_shards(vocab, kSeed + 2);
    shard(from_full, options);
    shard(from_shards, options);
    from_full->load_state_dict(full_state);
    from_shards->load_state_dict(sharded);
    std::int64_t wrong = 0;
    for (Nested* loaded : {&from_full, &from_shards}) {
      const auto mine = (*loaded)->named_parameters();
      for (std::size_t i = 0; i < mine.size(); ++i) {
        wrong += test::count_mismatches(mine[i].second.data().to_vector<double>(),
                                        shards[i].second.data().to_vector<double>(), {0, 0});
      }
    }
    CHECK(test::sum_over_ranks(wrong) == 0);
    // Neither shape: an error naming both the parameter's and the shard's, and nothing copied.
    nn::StateDict bad = full_state;
    bad.back().second = zeros({3, 3});
    const std::vector<float> untouched =
        from_full->named_parameters().front().second.data().to_vector<float>();
    CHECK_THROWS_ERROR(from_full->load_state_dict(bad), "load_state_dict: key '" + bad.back().first +
                                                            "' has shape [3, 3] in the state dict but " +
                                                            shape_str(full.back().second.shape()) +
                                                            " in the module (or [");
    CHECK(from_full->named_parameters().front().second.data().to_vector<float>() == untouched);
  }
}

TEST_CASE("freezing a sharded model's parameter through named_parameters() stops its training",
          "[dist][fsdp][fsdp2]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested model(vocab, kSeed);
  shard(model);
  const auto before = dist::gather_full_parameters(*model);
  for (auto& [name, parameter] : model->named_parameters()) {
    if (name == "blocks.1.up.weight") parameter.set_requires_grad(false);  // between sharding and step 1
  }
  (void)train_sharded(model, vocab, 2, model->named_parameters());
  const auto after = dist::gather_full_parameters(*model);
  for (std::size_t i = 0; i < after.size(); ++i) {
    INFO(after[i].first);
    const std::int64_t changed = test::count_mismatches(after[i].second.to_vector<double>(),
                                                        before[i].second.to_vector<double>(), {0, 0});
    if (after[i].first == "blocks.1.up.weight") {
      CHECK(changed == 0);
    } else {
      CHECK(changed > 0);
    }
  }
}

TEST_CASE("activation checkpointing applied after sharding trains as one process", "[dist][fsdp][fsdp2]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  const Run alone = train_alone(vocab, 3);
  Nested model(vocab, kSeed);
  shard(model);
  const auto is_block = [](const std::string&, nn::Module& module) { return module.type_name() == "Block"; };
  CHECK(nn::apply_activation_checkpointing(*model, is_block) == 3);
  CHECK(mismatches_on_any_rank(train_sharded(model, vocab, 3, model->named_parameters()), alone, 1e-5,
                               1e-6) == 0);
}

TEST_CASE("generate on a sharded Llama gives the one-process tokens", "[dist][fsdp][fsdp2]") {
  const models::LlamaConfig config = models::LlamaConfig::preset("tiny");
  const models::SamplingOptions sampling{.max_new_tokens = 6, .temperature = 0.8, .top_k = 5, .seed = 3};
  models::Llama alone(config, 5);
  const std::vector<std::int64_t> expected = models::generate(*alone, {1, 2, 3}, sampling);
  models::Llama model(config, 5);
  CHECK(dist::shard_by_type<models::LlamaDecoderLayerImpl>(*model) == config.num_hidden_layers + 1);
  CHECK(models::generate(*model, {1, 2, 3}, sampling) == expected);
}

TEST_CASE("reshard_after_forward_group: backward gathers inside groups from the slice kept after forward",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  if (w != 4) return;  // a group must divide the shard group and be neither 1 nor all of it: 2 of 4
  const dist::FsdpOptions grouped{.sharding = dist::Sharding::full, .reshard_after_forward_group = 2};
  Nested model(vocab, kSeed);
  shard(model, grouped);
  const dist::Plan plan = dist::explain(*model);
  REQUIRE(plan.units.size() == 4);
  // By hand: each block keeps half of its padded f32 parameters, the root all of its own.
  std::int64_t expected_held = plan.units[0].unsharded_bytes;
  for (std::size_t u = 1; u < plan.units.size(); ++u) {
    CHECK(plan.units[u].post_forward_group == 2);
    CHECK(plan.units[u].held_after_forward_bytes == plan.units[u].unsharded_bytes / 2);
    // Received in backward: half of the other group rank's slice, (2 - 1) / 2 of the unit.
    CHECK(plan.units[u].backward_gather_bytes == plan.units[u].unsharded_bytes / 2);
    expected_held += plan.units[u].unsharded_bytes / 2;
  }
  CHECK(plan.held_after_forward_bytes() == expected_held);
  CHECK(plan.str().find(fmt::format("parameters held from forward to backward: {} B per rank",
                                    expected_held)) != std::string::npos);
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
  for (int step = 0; step < 2; ++step) {
    dist::reset_collective_counters(*model);
    const auto batch = token_batch(step, kGlobalBatch, vocab, world().rank(), w);
    Variable loss = cross_entropy(model(batch.tokens), batch.targets);
    CHECK(dist::unsharded_memory().bytes == expected_held);  // measured between forward and backward
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    CHECK(dist::collective_counters(*model).total().bytes_received == plan.bytes_per_step());
    CHECK(dist::unsharded_memory().bytes == 0);
  }
  // The same numbers as resharding completely, bit for bit, and one process's within 1e-5.
  Nested again(vocab, kSeed);
  shard(again, grouped);
  const Run run = train_sharded(again, vocab, 3, again->named_parameters());
  CHECK(mismatches_on_any_rank(run, train_sharded(vocab, 3, {.sharding = dist::Sharding::full}), 0, 0) == 0);
  CHECK(mismatches_on_any_rank(run, train_alone(vocab, 3), 1e-5, 1e-6) == 0);
}

TEST_CASE("reshard_after_forward_group refuses what it cannot do", "[dist][fsdp][fsdp2][errors]") {
  const int w = world().size();
  const auto refused = [&](dist::FsdpOptions options, const std::string& message) {
    Nested model(4 * w + 1, kSeed);
    CHECK_THROWS_ERROR(dist::fully_shard((*model->blocks)[0], options), message);
  };
  refused({.reshard_after_forward_group = 1},
          fmt::format(
              "reshard_after_forward_group 1 must divide the shard group of {} ranks and be neither 1 nor "
              "all of it",
              w));
  refused({.reshard_after_forward_group = w}, fmt::format("must divide the shard group of {} ranks", w));
  refused({.reshard_after_forward_group = 3 * w + 1}, "must divide the shard group");
  refused(
      {.sharding = dist::Sharding::grad_op, .reshard_after_forward_group = 2},
      "reshard_after_forward_group 2 needs a unit that reshards after forward (full or hybrid), not grad_op");
  refused({.sharding = dist::Sharding::optimizer, .reshard_after_forward_group = 2}, "not optimizer");
  refused({.reshard_after_forward = false, .reshard_after_forward_group = 2},
          "reshard_after_forward_group 2 with reshard_after_forward false");
}

namespace {

// Three micro-steps of this rank's rows of global batches 0, 1 and 2, gradient sync only on the last,
// then one optimizer step; with `keep`, each unit stays gathered from a micro-step's backward to the
// next forward. Returns the full parameters and the all-gathers issued.
std::pair<nn::Named<Tensor>, std::int64_t> accumulate(std::int64_t vocab, bool keep) {
  Nested model(vocab, kSeed);
  shard(model);
  optim::AdamW optimizer(model->named_parameters(), {.lr = 1e-2});
  world().reset_counters();
  for (int micro = 0; micro < 3; ++micro) {
    const bool last = micro == 2;
    dist::set_requires_gradient_sync(*model, last);
    dist::set_reshard_after_backward(*model, !keep || last);
    const auto batch = token_batch(micro, kGlobalBatch, vocab, world().rank(), world().size());
    cross_entropy(model(batch.tokens), batch.targets).backward();
  }
  optimizer.step();
  const std::int64_t gathers = world().counters()[dist::Collective::all_gather].calls;
  return {dist::gather_full_parameters(*model), gathers};
}

}  // namespace

TEST_CASE("set_reshard_after_backward(false) between micro-steps: the same step, fewer all-gathers",
          "[dist][fsdp][fsdp2]") {
  const int w = world().size();
  const std::int64_t vocab = 4 * w + 1;
  const auto [resharded, all_gathers] = accumulate(vocab, false);
  const auto [kept, fewer_gathers] = accumulate(vocab, true);
  std::int64_t wrong = 0;
  REQUIRE(kept.size() == resharded.size());
  for (std::size_t i = 0; i < kept.size(); ++i) {
    wrong += test::count_mismatches(kept[i].second.to_vector<double>(),
                                    resharded[i].second.to_vector<double>(), {0, 0});
  }
  CHECK(test::sum_over_ranks(wrong) == 0);  // bit for bit
  if (w > 1) {
    // 4 units: every forward gathers 4 and every backward the 3 blocks again (the root stays); kept
    // after the first two backwards, the units need no gather for the next two forwards.
    CHECK(all_gathers == 3 * 4 + 3 * 3);
    CHECK(fewer_gathers == all_gathers - 2 * 4);
  }
}

TEST_CASE("set_reshard_after_backward(false) with gradient sync on is refused",
          "[dist][fsdp][fsdp2][errors]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested model(vocab, kSeed);
  CHECK_THROWS_ERROR(
      dist::set_reshard_after_backward(*model, false),
      "dist::set_reshard_after_backward: no FSDP unit in this Nested; call it after dist::fully_shard");
  shard(model);
  dist::set_reshard_after_backward(*model, false);
  const auto batch = token_batch(0, kGlobalBatch, vocab, world().rank(), world().size());
  CHECK_THROWS_ERROR(model(batch.tokens),
                     "FSDP: unit (root) has set_reshard_after_backward(false) while gradient sync is on");
  dist::set_reshard_after_backward(*model, true);
  CHECK_NOTHROW(model(batch.tokens));
}

TEST_CASE("what cannot work on a sharded module is refused, naming the parameter and the fix",
          "[dist][fsdp][fsdp2][errors]") {
  const std::int64_t vocab = 4 * world().size() + 1;
  Nested model(vocab, kSeed);
  // An optimizer built before sharding holds what the layers now only compute with.
  optim::AdamW early(model->named_parameters(), {.lr = 1e-2});
  shard(model);
  Variable head_weight;
  for (const auto& [name, parameter] : model->named_parameters()) {
    if (name == "head.weight") head_weight = parameter;
  }
  REQUIRE(head_weight.shard_info() != nullptr);
  REQUIRE(head_weight.name() == "head.weight");

  SECTION("an op on a shard") {
    CHECK_THROWS_ERROR(sum(head_weight), "sum: 'head.weight' is this rank's shard of a parameter of shape [" +
                                             std::to_string(vocab) + ", 7]");
    CHECK_THROWS_ERROR(mul(head_weight, head_weight),
                       "its module's forward computes with the gathered whole");
    CHECK_THROWS_ERROR(sum(head_weight.detach()), "'head.weight' is this rank's shard");  // still a part
  }
  SECTION("moving or casting the sharded module") {
    CHECK_THROWS_ERROR(model->to(Device::cpu()), "parameter 'embed.weight' is this rank's shard");
    CHECK_THROWS_ERROR(model->to(Device::cpu()), "move the model before dist::fully_shard");
    CHECK_THROWS_ERROR(model->to(DType::bf16), "cast the model before dist::fully_shard");
    CHECK(head_weight.dtype() == DType::f32);
  }
  SECTION("initializing the sharded module") {
    const std::vector<float> kept = head_weight.data().to_vector<float>();
    CHECK_THROWS_ERROR(nn::initialize(*model, 7),
                       "nn::initialize: parameter 'embed.weight' is this rank's shard");
    CHECK(head_weight.data().to_vector<float>() == kept);
  }
  SECTION("an optimizer built before sharding: its first step") {
    const auto batch = token_batch(0, kGlobalBatch, vocab, world().rank(), world().size());
    cross_entropy(model(batch.tokens), batch.targets).backward();
    CHECK_THROWS_ERROR(early.step(), "AdamW.step: parameter 'embed.weight' cannot be trained here");
    CHECK_THROWS_ERROR(early.step(), "build the optimizer from named_parameters() after sharding");
  }
  SECTION("an optimizer or clipping over a layer's own member after sharding") {
    CHECK_THROWS_ERROR(optim::AdamW({{"w", model->head->weight}}, {}),
                       "AdamW: parameter 'w' cannot be trained here: it is what the layers compute with");
    CHECK_THROWS_ERROR(optim::clip_grad_norm_({model->head->weight}, 1.0), "clip_grad_norm_: parameter");
  }
  SECTION("a layer's member given other memory instead of the parameter's values") {
    model->head->weight.set_data(zeros({vocab, 7}));
    const auto batch = token_batch(0, kGlobalBatch, vocab, world().rank(), world().size());
    CHECK_THROWS_ERROR(model(batch.tokens),
                       "FSDP: the Variable the layers compute with for 'head.weight' was given other memory");
  }
  SECTION("requires_grad changed on a layer's member instead of the parameter") {
    model->head->weight.set_requires_grad(false);
    const auto batch = token_batch(0, kGlobalBatch, vocab, world().rank(), world().size());
    CHECK_THROWS_ERROR(model(batch.tokens),
                       "FSDP: requires_grad of 'head.weight' was changed on the Variable");
  }
}
