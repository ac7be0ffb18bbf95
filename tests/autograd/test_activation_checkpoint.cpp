// tests/autograd/test_activation_checkpoint.cpp: checkpoint() keeps no activations, recomputes them in
// backward with the same randomness, and gives exactly the gradients of the plain run.
#include "autograd/activation_checkpoint.h"
#include "autograd/engine.h"
#include "autograd/functional.h"
#include "autograd/node.h"
#include "autograd/random_context.h"
#include "core/allocator.h"
#include "tests/check.h"

using namespace shardlab;
using test::values;

namespace {

// A small block with parameters it captures, several intermediates and dropout.
struct Block {
  Variable w1, w2;

  Variable operator()(const std::vector<Variable>& inputs) const {
    const Variable h = tanh(mul(inputs[0], w1));
    const Variable d = dropout(h, 0.5, true, 17);
    return add(mul(sigmoid(d), w2), exp(mul(h, 0.1)));
  }
};

Block make_block(const Shape& shape) {
  return {Variable(test::random_tensor(shape, 1, DType::f64), true, "w1"),
          Variable(test::random_tensor(shape, 2, DType::f64), true, "w2")};
}

struct Grads {
  std::vector<double> x, w1, w2;
  bool operator==(const Grads&) const = default;
};

Grads run(bool checkpointed, const Shape& shape, std::uint64_t seed = 7) {
  const Block block = make_block(shape);
  const Variable x(test::random_tensor(shape, 3, DType::f64), true, "x");
  Variable y;
  {
    const RandomContextGuard context({.seed = seed, .step = 3, .sample_indices = {10, 11, 12, 13}});
    y = checkpointed ? checkpoint(block, {x}) : block({x});
  }
  // Backward runs under another context: the recompute must restore the forward's one.
  const RandomContextGuard other({.seed = 99, .step = 100});
  sum(mul(y, y)).backward();
  return {values(x.grad()), values(block.w1.grad()), values(block.w2.grad())};
}

}  // namespace

TEST_CASE("checkpointed gradients equal the plain run's bit for bit, dropout included", "[checkpoint]") {
  const Grads plain = run(false, {4, 9});
  const Grads checkpointed = run(true, {4, 9});
  CHECK(checkpointed.x == plain.x);
  CHECK(checkpointed.w1 == plain.w1);
  CHECK(checkpointed.w2 == plain.w2);
  // Other masks would give other gradients, so equal gradients mean equal masks.
  CHECK(run(true, {4, 9}, 8).x != plain.x);
}

TEST_CASE("a checkpointed block is one node and keeps none of its intermediates", "[checkpoint]") {
  const Shape shape{256, 256};
  const Block block = make_block(shape);
  const Variable x(test::random_tensor(shape, 3, DType::f64), true, "x");
  const std::int64_t block_bytes = 256 * 256 * 8;
  const auto kept_by = [&](bool checkpointed) {
    const std::int64_t before = memory_stats(Device::cpu()).bytes_in_use;
    const Variable y = checkpointed ? checkpoint(block, {x}) : block({x});
    return (memory_stats(Device::cpu()).bytes_in_use - before) / block_bytes;
  };
  CHECK(kept_by(true) == 1);   // the output alone
  CHECK(kept_by(false) >= 5);  // mul, tanh, mask, dropout, sigmoid, ... all saved for backward
  const Variable y = checkpoint(block, {x});
  REQUIRE(y.grad_fn() != nullptr);
  CHECK(y.grad_fn()->name() == "checkpoint_backward");
  CHECK(y.grad_fn()->next_edges().size() == 1);
}

TEST_CASE("parameters inside a checkpoint fire their hooks; the callback still runs once", "[checkpoint]") {
  const Block block = make_block({3, 4});
  const Variable x(test::random_tensor({3, 4}, 3, DType::f64), true, "x");
  std::vector<std::string> events;
  block.w1.register_post_accumulate_grad_hook([&](const Variable&) {
    events.push_back("w1 accumulated");
    autograd::queue_callback([&] { events.push_back("end of backward"); });
  });
  x.register_post_accumulate_grad_hook([&](const Variable&) { events.push_back("x accumulated"); });
  const RandomContextGuard context({.seed = 1});
  sum(checkpoint(block, {x})).backward();
  CHECK(events == std::vector<std::string>{"w1 accumulated", "x accumulated", "end of backward"});
}

TEST_CASE("checkpoint passes inputs that need no gradient and nests", "[checkpoint]") {
  const Block block = make_block({2, 3});
  const Variable x = constant(test::random_tensor({2, 3}, 3, DType::f64));
  const RandomContextGuard context({.seed = 1});
  const auto inner = [&](const std::vector<Variable>& in) { return checkpoint(block, in); };
  sum(checkpoint(inner, {x})).backward();
  CHECK(block.w1.grad().defined());
  CHECK_FALSE(x.grad().defined());

  const Block same = make_block({2, 3});
  sum(same({x})).backward();
  CHECK(values(block.w1.grad()) == values(same.w1.grad()));
  CHECK_THROWS_ERROR(checkpoint(block, {Variable()}), "checkpoint: input 0 is undefined");
}
