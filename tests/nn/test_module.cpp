// tests/nn/test_module.cpp: Module's registry, names, modes, moves, state dicts, hooks,
// printer, name-keyed initialisation and activation checkpointing by module.
#include <fmt/format.h>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/random_context.h"
#include "core/allocator.h"
#include "nn/layers.h"
#include "tests/check.h"

using namespace shardlab;
using namespace shardlab::nn;

namespace {

// A two-level model: a Linear, a Sequential with a Linear and a ReLU, and a buffer.
class TwoLevelImpl : public Module {
 public:
  TwoLevelImpl()
      : Module("TwoLevel"), head(LinearOptions(3, 4)), body(Linear(LinearOptions(4, 2).bias(false)), ReLU()) {
    register_module("head", head.ptr());
    register_module("body", body.ptr());
    scale = register_buffer("scale", full({2}, 0.5));
  }
  Variable operator()(const Variable& x) {
    return with_hooks([&](const Variable& input) { return mul(body(head(input)), constant(scale)); }, x);
  }
  // Exposes registration to the tests of its error paths.
  void add_parameter(const std::string& name) { register_parameter(name, {1}, Init::constant(0)); }

  Linear head;
  Sequential body;
  Tensor scale;
};
using TwoLevel = Holder<TwoLevelImpl>;

std::vector<std::string> names_of(const Named<Variable>& named) {
  std::vector<std::string> names;
  for (const auto& [name, v] : named) names.push_back(name);
  return names;
}

}  // namespace

TEST_CASE("parameters, buffers and modules are named with dots in registration order", "[nn][module]") {
  TwoLevel model;
  CHECK(names_of(model->named_parameters()) ==
        std::vector<std::string>{"head.weight", "head.bias", "body.0.weight"});
  CHECK(names_of(model->named_parameters(false)).empty());
  CHECK(model->parameters().size() == 3);
  CHECK(model->parameter_count() == 3 * 4 + 4 + 4 * 2);
  const auto buffers = model->named_buffers();
  REQUIRE(buffers.size() == 1);
  CHECK(buffers[0].first == "scale");
  std::vector<std::string> modules;
  for (const auto& [name, m] : model->named_modules()) modules.push_back(name + ":" + m->type_name());
  CHECK(modules == std::vector<std::string>{":TwoLevel", "head:Linear", "body:Sequential", "body.0:Linear",
                                            "body.1:ReLU"});
  std::vector<std::string> state;
  for (const auto& [name, t] : model->state_dict()) state.push_back(name);
  // PyTorch's order: a module's own parameters and buffers before its children's.
  CHECK(state == std::vector<std::string>{"scale", "head.weight", "head.bias", "body.0.weight"});
}

TEST_CASE("registering a taken or dotted name is an error", "[nn][module]") {
  TwoLevel model;
  CHECK_THROWS_ERROR(model->add_parameter("head"), "TwoLevel: the name 'head' is already registered");
  CHECK_THROWS_ERROR(model->add_parameter("a.b"),
                     "TwoLevel: parameter name 'a.b' must be non-empty and contain no '.'");
  CHECK_THROWS_ERROR(model->add_parameter(""), "TwoLevel: parameter name '' must be non-empty");
}

TEST_CASE("train and eval reach every module", "[nn][module]") {
  TwoLevel model;
  model->eval();
  for (const auto& [name, m] : model->named_modules()) CHECK_FALSE(m->is_training());
  model->train();
  for (const auto& [name, m] : model->named_modules()) CHECK(m->is_training());
}

TEST_CASE("to(dtype) converts in place: the Variables stay the same objects", "[nn][module]") {
  TwoLevel model;
  const Variable weight = model->head->weight;
  const std::vector<double> before = weight.data().to_vector<double>();
  model->to(DType::f64);
  CHECK(weight.same(model->head->weight));
  CHECK(weight.dtype() == DType::f64);
  CHECK(weight.data().to_vector<double>() == before);
  CHECK(model->named_buffers()[0].second.dtype() == DType::f64);
  // An integer dtype would turn trainable parameters into tensors no gradient can flow to.
  CHECK_THROWS_ERROR(model->to(DType::i64),
                     "TwoLevel.to: parameters are cast to floating dtypes only, not i64");
  CHECK(weight.dtype() == DType::f64);
  model->to(Device::cpu());
  CHECK(weight.device() == Device::cpu());
}

TEST_CASE("load_state_dict copies values; strict checks name every problem", "[nn][module]") {
  TwoLevel source, target;
  initialize(*source, 5);
  initialize(*target, 6);
  target->load_state_dict(source->state_dict());
  for (const auto& [name, t] : source->state_dict()) {
    const auto own = target->state_dict();
    const auto it =
        std::find_if(own.begin(), own.end(), [&key = name](const auto& entry) { return entry.first == key; });
    REQUIRE(it != own.end());
    CHECK(it->second.to_vector<double>() == t.to_vector<double>());
  }
  const auto without = [](StateDict state, const std::string& key) {
    std::erase_if(state, [&](const auto& entry) { return entry.first == key; });
    return state;
  };
  const auto position = [](const StateDict& state, const std::string& key) {
    return static_cast<std::size_t>(
        std::find_if(state.begin(), state.end(), [&](const auto& entry) { return entry.first == key; }) -
        state.begin());
  };
  StateDict missing = without(source->state_dict(), "head.bias");
  CHECK_THROWS_ERROR(target->load_state_dict(missing),
                     "load_state_dict: missing key 'head.bias' (expected shape [4])");
  StateDict extra = source->state_dict();
  extra.emplace_back("head.gain", ones({4}));
  CHECK_THROWS_ERROR(target->load_state_dict(extra),
                     "load_state_dict: unexpected key 'head.gain' (shape [4])");
  StateDict misshaped = source->state_dict();
  misshaped[position(misshaped, "head.weight")].second = zeros({4, 2});
  CHECK_THROWS_ERROR(
      target->load_state_dict(misshaped),
      "load_state_dict: key 'head.weight' has shape [4, 2] in the state dict but [4, 3] in the module");
  StateDict twice = source->state_dict();
  twice.push_back(twice[position(twice, "head.weight")]);
  CHECK_THROWS_ERROR(target->load_state_dict(twice), "load_state_dict: key 'head.weight' appears twice");
  // Nothing was copied by the failed loads: an error loses nothing.
  const std::vector<double> kept = target->head->weight.data().to_vector<double>();
  misshaped[position(misshaped, "head.bias")].second = full({4}, 9.0);
  CHECK_THROWS(target->load_state_dict(misshaped));
  CHECK(target->head->bias.data().to_vector<double>() != std::vector<double>(4, 9.0));
  CHECK(target->head->weight.data().to_vector<double>() == kept);
  // Non-strict skips missing and unexpected keys but still refuses wrong shapes.
  target->load_state_dict(extra, false);
  target->load_state_dict(missing, false);
}

namespace {

class AloneRanks final : public ShardRanks {
 public:
  Tensor sum(const Tensor& value) const override { return value; }
};

// Registers, in place of head.weight [4, 3], a shard holding its elements [first, first + count),
// as FSDP does; the layer keeps computing with its own member.
Variable shard_head_weight(TwoLevel& model, std::int64_t first, std::int64_t count) {
  const Tensor whole = model->head->weight.data().reshape({12});
  const Variable shard(whole.narrow(0, first, count).clone(), true, "head.weight");
  shard.set_shard_info({.full_shape = {4, 3},
                        .first = first,
                        .count = count,
                        .placement = fmt::format("Shard(flat) elements [{}, {}) of 12", first, first + count),
                        .ranks = std::make_shared<AloneRanks>()});
  model->replace_parameter("head.weight", shard);
  return shard;
}

}  // namespace

TEST_CASE("replace_parameter changes what a name registers; the forward keeps its member", "[nn][module]") {
  TwoLevel model;
  const Variable member = model->head->weight;
  const Variable replacement(zeros({4, 3}), true, "other");
  model->replace_parameter("head.weight", replacement);
  CHECK(model->named_parameters()[0].second.same(replacement));
  CHECK(model->head->named_parameters()[0].second.same(replacement));
  CHECK(model->head->weight.same(member));  // the forward still computes with the member
  CHECK(model->state_dict()[1].second.storage() == replacement.data().storage());
  model->head->replace_parameter("bias", Variable(ones({4}), true));
  CHECK(model->named_parameters()[1].second.data().to_vector<float>() == std::vector<float>(4, 1.0f));
  CHECK_THROWS_ERROR(model->replace_parameter("head.nothing", replacement),
                     "Linear: replace_parameter: no parameter named 'nothing'");
  CHECK_THROWS_ERROR(model->replace_parameter("tail.weight", replacement),
                     "TwoLevel: replace_parameter: no child named 'tail' (for 'tail.weight')");
  CHECK_THROWS_ERROR(model->replace_parameter("head.weight", Variable()),
                     "TwoLevel: replace_parameter: the replacement for 'head.weight' is undefined");
}

TEST_CASE("a module with a sharded parameter: state dicts of its shard, whole or sharded loads",
          "[nn][module][shard]") {
  TwoLevel model;
  const Variable shard = shard_head_weight(model, 5, 4);
  CHECK(model->state_dict()[1].second.shape() == Shape{4});  // this rank's elements
  CHECK(model->parameter_count() == 3 * 4 + 4 + 4 * 2);      // counted whole
  CHECK(model->str().find("weight [4, 3] f32") != std::string::npos);

  TwoLevel source;
  nn::StateDict whole = source->state_dict();
  model->load_state_dict(whole);  // the whole parameter: elements [5, 9) kept
  CHECK(shard.data().to_vector<float>() ==
        source->head->weight.data().reshape({12}).narrow(0, 5, 4).to_vector<float>());
  whole[1].second = from_vector<float>({1, 2, 3, 4});  // this rank's shard itself
  model->load_state_dict(whole);
  CHECK(shard.data().to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  whole[1].second = zeros({12});
  CHECK_THROWS_ERROR(model->load_state_dict(whole),
                     "load_state_dict: key 'head.weight' has shape [12] in the state dict but [4, 3] in the "
                     "module (or [4] as this rank's shard)");
  CHECK(shard.data().to_vector<float>() == std::vector<float>{1, 2, 3, 4});  // nothing copied
  whole.erase(whole.begin() + 1);
  CHECK_THROWS_ERROR(model->load_state_dict(whole),
                     "load_state_dict: missing key 'head.weight' (expected shape [4, 3])");
}

TEST_CASE("to() and initialize refuse a module with a sharded parameter, changing nothing",
          "[nn][module][shard][errors]") {
  TwoLevel model;
  const Variable shard = shard_head_weight(model, 0, 12);
  const std::vector<float> kept = shard.data().to_vector<float>();
  CHECK_THROWS_ERROR(
      model->to(Device::cpu()),
      "TwoLevel.to(device): parameter 'head.weight' is this rank's shard (Shard(flat) elements [0, "
      "12) of 12) and its FSDP unit holds the rest; move the model before dist::fully_shard");
  CHECK_THROWS_ERROR(model->to(DType::f64),
                     "TwoLevel.to(dtype): parameter 'head.weight' is this rank's shard");
  CHECK_THROWS_ERROR(model->to(DType::f64), "cast the model before dist::fully_shard");
  CHECK(model->head->bias.dtype() == DType::f32);  // refused before anything moved
  CHECK_THROWS_ERROR(nn::initialize(*model, 3),
                     "nn::initialize: parameter 'head.weight' is this rank's shard");
  CHECK(shard.data().to_vector<float>() == kept);
  CHECK(model->initialized_seed() != std::optional<std::uint64_t>(3));
}

TEST_CASE("forward hooks run before and after every call, in registration order", "[nn][module][hooks]") {
  TwoLevel model;
  std::vector<std::string> events;
  model->register_forward_pre_hook(
      [&](Module& m, ForwardInputs&) { events.push_back("pre " + m.type_name()); });
  model->body->register_forward_pre_hook(
      [&](Module& m, ForwardInputs&) { events.push_back("pre " + m.type_name()); });
  model->register_forward_hook(
      [&](Module&, Variable& out) { events.push_back("post " + shape_str(out.shape())); });
  (void)model(constant(ones({5, 3})));
  CHECK(events == std::vector<std::string>{"pre TwoLevel", "pre Sequential", "post [5, 2]"});
}

TEST_CASE("the printer shows the tree, shapes and counts", "[nn][module]") {
  TwoLevel model;
  const std::string text = model->str();
  CHECK(text.find("TwoLevel\n") == 0);
  CHECK(text.find("  (head): Linear(in=3, out=4, bias=true)  [16 parameters]\n") != std::string::npos);
  CHECK(text.find("    weight [4, 3] f32\n") != std::string::npos);
  CHECK(text.find("    (0): Linear(in=4, out=2, bias=false)  [8 parameters]") != std::string::npos);
  CHECK(text.find("    (1): ReLU") != std::string::npos);
  CHECK(text.find("total: 24 parameters") != std::string::npos);
}

TEST_CASE("initial values depend only on the seed and the dotted name", "[nn][init]") {
  TwoLevel a, b;
  initialize(*a, 3);
  initialize(*b, 3);
  const Tensor expected = empty({4, 3});
  Init::fan_in_uniform(3).fill(expected, 3, "head.weight");
  CHECK(a->head->weight.data().to_vector<float>() == expected.to_vector<float>());
  CHECK(b->head->weight.data().to_vector<float>() == expected.to_vector<float>());
  // A range of a parameter drawn alone equals that range of the whole (sharded init).
  const Tensor tail = empty({5});
  Init::fan_in_uniform(3).fill(tail, 3, "head.weight", 7);
  CHECK(tail.to_vector<float>() == expected.reshape({-1}).narrow(0, 7, 5).to_vector<float>());
  initialize(*b, 4);
  CHECK(b->head->weight.data().to_vector<float>() != expected.to_vector<float>());
  // Different names draw different streams.
  CHECK(name_stream("head.weight") != name_stream("head.bias"));
}

TEST_CASE("default initialisation matches PyTorch's distributions", "[nn][init]") {
  Linear big(LinearOptions(400, 300));
  initialize(*big, 1);
  const double bound = 1 / std::sqrt(400.0);
  const Tensor w = big->weight.data().to(DType::f64);
  CHECK(max(abs(w)).item<double>() <= bound);
  CHECK(max(abs(w)).item<double>() > 0.99 * bound);
  CHECK(std::abs(mean(w).item<double>()) < 0.01 * bound);
  // U(-b, b) has variance b^2 / 3; 120000 samples give about 0.4% relative error.
  CHECK(std::abs(mean(mul(w, w)).item<double>() / (bound * bound / 3) - 1) < 0.02);
  CHECK(max(abs(big->bias.data())).item<double>() <= bound);
  Embedding table(1000, 64);
  initialize(*table, 1);
  const Tensor e = table->weight.data().to(DType::f64);
  CHECK(std::abs(mean(e).item<double>()) < 0.02);
  CHECK(std::abs(mean(mul(e, e)).item<double>() - 1) < 0.03);
  RMSNorm norm(8);
  initialize(*norm, 1);
  test::check_equal(norm->weight.data(), std::vector<double>(8, 1.0));
}

TEST_CASE("DeferredInitGuard: parameters without bytes; initialize names streams and remembers the seed",
          "[nn][module][deferred]") {
  std::shared_ptr<nn::SequentialImpl> model;
  {
    const nn::DeferredInitGuard deferred;
    model = std::make_shared<nn::SequentialImpl>(nn::Linear(nn::LinearOptions(3, 4)),
                                                 nn::Linear(nn::LinearOptions(4, 2)));
  }
  CHECK_FALSE(model->initialized_seed().has_value());
  nn::initialize(*model, 9);
  CHECK(model->initialized_seed() == std::optional<std::uint64_t>(9));
  for (const auto& [name, variable] : model->named_parameters()) {
    INFO(name);
    CHECK(nn::deferred(variable.data()));
    CHECK(variable.shape() == (name == "0.weight"   ? Shape{4, 3}
                               : name == "0.bias"   ? Shape{4}
                               : name == "1.weight" ? Shape{2, 4}
                                                    : Shape{2}));
  }
  CHECK(model->named_modules().at(2).second->stream() == nn::name_stream("1"));
  // Outside the guard, parameters have their bytes again.
  const nn::Linear real(nn::LinearOptions(3, 4));
  CHECK_FALSE(nn::deferred(real->weight.data()));
  CHECK_FALSE(nn::deferred(empty({0})));
}

TEST_CASE("to(device) keeps deferred parameters without bytes, on the new device",
          "[cuda][module][deferred]") {
  std::shared_ptr<nn::SequentialImpl> model;
  {
    const nn::DeferredInitGuard deferred;
    model = std::make_shared<nn::SequentialImpl>(nn::Linear(nn::LinearOptions(3, 4)));
  }
  model->to(Device::cuda(0));
  for (const auto& [name, variable] : model->named_parameters()) {
    INFO(name);
    CHECK(nn::deferred(variable.data()));
    CHECK(variable.device() == Device::cuda(0));
    CHECK(variable.shape() == (name == "0.weight" ? Shape{4, 3} : Shape{4}));
  }
}

namespace {

// x + scale * fc2(dropout(gelu(fc1(x)))) (+ shift where given): a block with an optional Tensor
// argument and a plain one, which a checkpoint recompute must replay.
class ResidualImpl : public Module {
 public:
  explicit ResidualImpl(std::int64_t width)
      : Module("Residual"), fc1(LinearOptions(width, 2 * width)), fc2(LinearOptions(2 * width, width)) {
    register_module("fc1", fc1.ptr());
    register_module("drop", drop.ptr());
    register_module("fc2", fc2.ptr());
  }
  Variable operator()(const Variable& x, const Tensor& shift, double scale) {
    return with_hooks(
        [this](const Variable& input, const Tensor& offset, double factor) {
          Variable y = add(input, mul(fc2(drop(gelu(fc1(input)))), factor));
          return offset.defined() ? add(y, constant(offset)) : y;
        },
        x, shift, scale);
  }
  Linear fc1, fc2;
  Dropout drop{0.4};
};

class StackImpl : public Module {
 public:
  explicit StackImpl(std::int64_t width) : Module("Stack"), head(LinearOptions(width, 3)) {
    register_module("blocks", blocks.ptr());
    register_module("head", head.ptr());
    for (int i = 0; i < 3; ++i) blocks->push_back(std::make_shared<ResidualImpl>(width));
    initialize(*this, 5);
  }
  Variable operator()(const Variable& x, const Tensor& shift) {
    return with_hooks(
        [this](const Variable& input, const Tensor& offset) {
          Variable y = input;
          for (std::size_t i = 0; i < blocks->size(); ++i)
            y = (*blocks)[i](y, i == 1 ? offset : Tensor(), 0.5);
          return head(y);
        },
        x, shift);
  }
  ModuleList<ResidualImpl> blocks;
  Linear head;
};
using Stack = Holder<StackImpl>;

bool is_residual(const std::string&, Module& module) {
  return dynamic_cast<ResidualImpl*>(&module) != nullptr;
}

// The gradients of every parameter and of the input after one forward under one random context
// and a backward under another (the recompute must restore the forward's).
std::vector<std::vector<double>> gradients(bool checkpointed, std::uint64_t seed = 9) {
  Stack model(6);
  if (checkpointed) CHECK(apply_activation_checkpointing(*model, is_residual) == 3);
  const Variable x(test::random_tensor({4, 6}, 1), true, "x");
  const Tensor shift = test::random_tensor({4, 6}, 2);
  Variable y;
  {
    const RandomContextGuard context({.seed = seed, .step = 2, .sample_indices = {20, 21, 22, 23}});
    y = model(x, shift);
  }
  const RandomContextGuard other({.seed = 99, .step = 7});
  sum(mul(y, y)).backward();
  std::vector<std::vector<double>> grads{test::values(x.grad())};
  for (const auto& [name, parameter] : model->named_parameters())
    grads.push_back(test::values(parameter.grad()));
  return grads;
}

}  // namespace

TEST_CASE("apply_activation_checkpointing: the same gradients bit for bit, dropout masks replayed",
          "[nn][module][checkpoint]") {
  const auto plain = gradients(false);
  CHECK(gradients(true) == plain);
  CHECK(gradients(false, 10) != plain);  // other masks, other gradients: the masks count
  CHECK(gradients(true, 10) == gradients(false, 10));
}

TEST_CASE("a checkpointed module: its hooks see one call and the checkpoint node, inner modules rerun",
          "[nn][module][checkpoint]") {
  Stack model(6);
  CHECK(apply_activation_checkpointing(*model, [](const std::string& name, Module&) {
          return name == "blocks.0" || name == "blocks.2";
        }) == 2);
  CHECK((*model->blocks)[0].checkpointed());
  CHECK(!(*model->blocks)[1].checkpointed());
  CHECK(!model->checkpointed());
  std::vector<std::string> events;
  auto& block = (*model->blocks)[0];
  block.register_forward_pre_hook([&](Module&, ForwardInputs& inputs) {
    events.push_back(fmt::format("pre, {} inputs", inputs.size()));
  });
  block.register_forward_hook([&](Module&, Variable& output) {
    events.push_back("post " + (output.grad_fn() ? output.grad_fn()->name() : std::string("leaf")));
  });
  block.fc1->register_forward_pre_hook([&](Module&, ForwardInputs&) {
    events.push_back(autograd::backward_running() ? "fc1 in backward" : "fc1");
  });
  const Variable x(test::random_tensor({4, 6}, 1), true, "x");
  sum(model(x, Tensor())).backward();
  // The block's hooks run once, around the checkpoint; the recompute runs its body, fc1 included.
  CHECK(events ==
        std::vector<std::string>{"pre, 2 inputs", "fc1", "post checkpoint_backward", "fc1 in backward"});
  // Without grad mode there is nothing to recompute: the forward runs as it is.
  events.clear();
  {
    const NoGradGuard no_grad;
    CHECK(!model(x, Tensor()).requires_grad());
  }
  CHECK(events == std::vector<std::string>{"pre, 2 inputs", "fc1", "post leaf"});
}

TEST_CASE("checkpointed blocks keep only their outputs", "[nn][module][checkpoint]") {
  const auto kept = [](bool checkpointed) {
    Stack model(64);
    if (checkpointed) apply_activation_checkpointing(*model, is_residual);
    const Variable x(test::random_tensor({256, 64}, 1), true, "x");
    const std::int64_t before = memory_stats(Device::cpu()).bytes_in_use;
    const Variable y = model(x, Tensor());
    return memory_stats(Device::cpu()).bytes_in_use - before;
  };
  const std::int64_t activation = 256 * 64 * 4, logits = 256 * 3 * 4;
  // The three blocks' outputs and the logits, against every block's fc1, gelu, mask, dropout, ...
  CHECK(kept(true) == 3 * activation + logits);
  CHECK(kept(false) > 20 * activation);
}

TEST_CASE("apply_activation_checkpointing refuses a module without a forward and wraps nothing then",
          "[nn][module][checkpoint][errors]") {
  Stack model(6);
  CHECK_THROWS_ERROR(
      apply_activation_checkpointing(
          *model, [](const std::string& name, Module&) { return name.starts_with("blocks"); }),
      "apply_activation_checkpointing: 'blocks' (ModuleList) has no forward of its own, so nothing of it can "
      "run under checkpoint; select the modules in it instead");
  for (const auto& [name, module] : model->named_modules()) CHECK(!module->checkpointed());
  CHECK(apply_activation_checkpointing(*model, [](const std::string&, Module&) { return false; }) == 0);
  CHECK(apply_activation_checkpointing(*model,
                                       [](const std::string& name, Module&) { return name.empty(); }) == 1);
  CHECK(model->checkpointed());
}
