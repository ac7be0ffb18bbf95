// tests/autograd/test_engine.cpp: the backward engine: graph shapes (diamonds, reuse),
// retain_graph, grad mode, accumulation, hooks and their order, callbacks, and bad input.
#include <string>
#include <thread>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "tests/check.h"

using namespace shardlab;
using test::check_close;
using test::check_equal;

namespace {
Variable leaf(std::vector<double> values, std::string name = "x") {
  return Variable(from_vector<double>(values), true, std::move(name));
}
}  // namespace

TEST_CASE("a variable used twice gets both gradients (x * x)", "[engine]") {
  const Variable x = leaf({1, -2, 3});
  sum(mul(x, x)).backward();
  check_equal(x.grad(), {2, -4, 6});
}

TEST_CASE("diamonds and shared subexpressions sum every path", "[engine]") {
  // y = sum(2x * exp(x)): dy/dx = 2 exp(x) + 2x exp(x)
  const Variable x = leaf({0.5, -1.0, 2.0});
  const Variable a = mul(x, 2.0), b = exp(x);
  sum(mul(a, b)).backward();
  std::vector<double> expected;
  for (const double v : {0.5, -1.0, 2.0}) expected.push_back(2 * std::exp(v) + 2 * v * std::exp(v));
  check_close(x.grad(), expected);

  // z = x^2 used three times: y = sum(z + z * z) -> dy/dx = 2x + 4x^3
  const Variable u = leaf({1.5, -0.5});
  const Variable z = mul(u, u);
  sum(add(z, mul(z, z))).backward();
  check_close(u.grad(), {2 * 1.5 + 4 * 1.5 * 1.5 * 1.5, 2 * -0.5 + 4 * -0.125});
}

TEST_CASE("gradients accumulate across backward calls until zeroed", "[engine]") {
  const Variable x = leaf({1, 2});
  sum(mul(x, 3.0)).backward();
  sum(mul(x, 3.0)).backward();
  check_equal(x.grad(), {6, 6});
  const Tensor kept = x.grad();
  x.zero_grad(/*set_to_none=*/false);
  check_equal(kept, {0, 0});  // zeroed in place
  x.zero_grad();
  CHECK_FALSE(x.grad().defined());
  sum(x).backward();
  check_equal(x.grad(), {1, 1});
}

TEST_CASE("retain_graph allows a second backward; without it the graph is freed", "[engine]") {
  const Variable x = leaf({2});
  const Variable y = sum(mul(exp(x), x));
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  const double once = std::exp(2.0) * 3;  // d/dx x e^x = e^x (1 + x)
  check_close(x.grad(), {2 * once});
  CHECK_THROWS_ERROR(y.backward(), "sum_backward: its saved tensors were freed by an earlier backward");
}

TEST_CASE("double backward is refused: a gradient is not part of any graph", "[engine]") {
  const Variable x = leaf({1, 2});
  sum(mul(x, x)).backward();
  const Variable grad(x.grad());
  CHECK_FALSE(grad.requires_grad());
  CHECK_THROWS_ERROR(sum(grad).backward(), "backward: the output does not require grad and has no grad_fn");
}

TEST_CASE("no graph is recorded under NoGradGuard, and grad mode is per thread", "[engine]") {
  const Variable x = leaf({1});
  {
    const NoGradGuard no_grad;
    CHECK_FALSE(is_grad_enabled());
    const Variable y = mul(x, x);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.grad_fn() == nullptr);
    bool other_thread_enabled = false;
    std::thread([&] { other_thread_enabled = is_grad_enabled(); }).join();
    CHECK(other_thread_enabled);
  }
  CHECK(is_grad_enabled());
  CHECK(mul(x, x).requires_grad());
  // Constants do not require grad, so an op on constants records nothing.
  CHECK_FALSE(mul(constant(ones({2})), constant(ones({2}))).requires_grad());
}

TEST_CASE("detach and set_data leave the graph alone", "[engine]") {
  const Variable x = leaf({1, 2});
  const Variable d = mul(x, 2.0).detach();
  CHECK(d.is_leaf());
  CHECK_FALSE(d.requires_grad());
  CHECK(d.data().storage() != nullptr);

  // set_data swaps the tensor: the next forward uses it, gradients still accumulate.
  const Variable w = leaf({1, 1}, "w");
  w.set_data(from_vector<double>({3, 4}));
  sum(mul(w, w)).backward();
  check_equal(w.grad(), {6, 8});
}

TEST_CASE("a gradient buffer set with set_grad is accumulated into in place", "[engine]") {
  // FSDP points each parameter's grad at a slice of one flat buffer before backward.
  const Variable a = leaf({1, 2}, "a"), b = leaf({3, 4, 5}, "b");
  const Tensor flat = zeros({5}, dtype(DType::f64));
  a.set_grad(flat.narrow(0, 0, 2));
  b.set_grad(flat.narrow(0, 2, 3));
  add(sum(mul(a, 2.0)), sum(mul(b, b))).backward();
  check_equal(flat, {2, 2, 6, 8, 10});
  CHECK_THROWS_ERROR(a.set_grad(zeros({3}, dtype(DType::f64))),
                     "set_grad: gradient of shape [3] for 'a' of shape [2]");
  CHECK_THROWS_ERROR(a.set_grad(zeros({2}, dtype(DType::f32))),
                     "set_grad: gradient of dtype f32 on cpu for 'a' of dtype f64 on cpu");
  CHECK(a.grad().dtype() == DType::f64);  // the refused gradient left the buffer in place
}

TEST_CASE("a grad destination receives the first gradient as written, later ones add to it", "[engine]") {
  // FSDP's flat gradient buffer is not zeroed: whatever it holds is overwritten by the first
  // gradient, and a leaf used twice in one graph still sums both uses.
  const Variable a = leaf({1, 2}, "a"), b = leaf({3, 4, 5}, "b"), unused = leaf({7}, "unused");
  const Tensor flat = full({6}, 99.0, dtype(DType::f64));
  a.set_grad_destination(flat.narrow(0, 0, 2));
  b.set_grad_destination(flat.narrow(0, 2, 3));
  unused.set_grad_destination(flat.narrow(0, 5, 1));
  add(sum(mul(a, 2.0)), sum(mul(b, b))).backward();
  check_equal(flat, {2, 2, 6, 8, 10, 99});
  CHECK(a.grad().raw_data() == flat.raw_data());  // the grad is the destination, not a copy
  CHECK_FALSE(unused.grad().defined());           // no gradient reached it: the slot is untouched

  // The next backward accumulates: the destination was used up by the first.
  add(sum(mul(a, 2.0)), sum(mul(a, a))).backward();  // d/da = 2 + 2a
  check_equal(flat, {6, 8, 6, 8, 10, 99});

  CHECK_THROWS_ERROR(a.set_grad_destination(zeros({3}, dtype(DType::f64))),
                     "set_grad_destination: gradient of shape [3] for 'a' of shape [2]");
  CHECK_THROWS_ERROR(a.set_grad_destination(zeros({2}, dtype(DType::f32))),
                     "set_grad_destination: gradient of dtype f32 on cpu for 'a' of dtype f64 on cpu");
  const Variable not_leaf = mul(a, 2.0);
  CHECK_THROWS_ERROR(not_leaf.set_grad_destination(zeros({2}, dtype(DType::f64))),
                     "set_grad_destination: '' is not a leaf");
}

TEST_CASE("saved tensors follow their Storage when its bytes are freed and refilled", "[engine]") {
  // The FSDP reshard trick: free a parameter's bytes after forward, gather back into the same
  // Storage before backward; the tensors autograd saved see the gathered values.
  const Variable w = leaf({1, 2, 3}, "w");
  const Variable x = leaf({4, 5, 6}, "x");
  const Variable y = sum(mul(x, w));
  const auto storage = w.data().storage();
  storage->reallocate(0);
  storage->reallocate(3 * sizeof(double));
  w.data().copy_(from_vector<double>({1, 2, 3}));
  y.backward();
  check_equal(x.grad(), {1, 2, 3});
  check_equal(w.grad(), {4, 5, 6});
}

TEST_CASE("hooks run in the documented order; the callback runs once at the end", "[engine][hooks]") {
  std::vector<std::string> order;
  const Variable x = leaf({1, 2}, "x");
  const Variable h = mul(x, 3.0);
  x.register_hook([&](const Tensor& g) {
    order.push_back("x grad hook");
    return mul(g, 10.0);  // replaces the gradient that gets accumulated
  });
  x.register_post_accumulate_grad_hook([&](const Variable& v) {
    order.push_back("x post-accumulate (grad " + std::to_string(v.grad().to_vector<double>()[0]) + ")");
    autograd::queue_callback([&] { order.push_back("callback A"); });
  });
  h.register_hook([&](const Tensor&) {
    order.push_back("h grad hook");
    CHECK(autograd::backward_running());
    autograd::queue_callback([&] {
      order.push_back("callback B");
      autograd::queue_callback([&] { order.push_back("callback queued by a callback"); });
    });
    return Tensor();  // keeps the gradient
  });
  sum(h).backward();
  check_equal(x.grad(), {30, 30});
  const std::vector<std::string> expected = {
      "h grad hook", "x grad hook", "x post-accumulate (grad 30.000000)",
      "callback B",  "callback A",  "callback queued by a callback"};
  CHECK(order == expected);
  CHECK_FALSE(autograd::backward_running());
  CHECK_THROWS_ERROR(autograd::queue_callback([] {}),
                     "queue_callback: no backward is running on this thread");
}

TEST_CASE("nodes run after all their consumers, latest first", "[engine][hooks]") {
  std::vector<std::string> order;
  const Variable x = leaf({1}, "x");
  const Variable a = mul(x, 2.0);
  const Variable b = mul(a, 3.0);
  const Variable c = add(a, b);  // a feeds b and c: a's node must wait for both
  for (const auto& [v, name] : std::vector<std::pair<Variable, std::string>>{{a, "a"}, {b, "b"}, {c, "c"}}) {
    v.register_hook([&order, name = name](const Tensor& g) {
      order.push_back(name);
      return g;
    });
  }
  sum(c).backward();
  CHECK(order == std::vector<std::string>{"c", "b", "a"});
  check_equal(x.grad(), {8});  // d/dx (2x + 6x)
}

TEST_CASE("backward rejects bad input with clear errors", "[engine][errors]") {
  const Variable x = leaf({1, 2}, "x");
  Variable y = mul(x, 2.0);
  CHECK_THROWS_ERROR(
      y.backward(),
      "backward: a gradient can be implied only for a one-element output; the output has shape [2]");
  CHECK_THROWS_ERROR(y.backward(ones({3}, dtype(DType::f64))),
                     "backward: gradient [[3] on cpu] does not match the output [[2] on cpu]");
  const Variable c = constant(ones({1}));
  CHECK_THROWS_ERROR(c.backward(), "backward: the output does not require grad and has no grad_fn");
  CHECK_THROWS_ERROR(Variable().backward(), "backward: the variable is undefined");

  const Variable z = leaf({1, 2}, "z");
  z.register_hook([](const Tensor&) { return zeros({3}, dtype(DType::f64)); });
  CHECK_THROWS_ERROR(
      sum(z).backward(),
      "gradient hook on leaf 'z' returned a gradient of shape [3] for a variable of shape [2]");
  const Variable w = mul(leaf({1, 2}), 1.0);
  w.register_hook([](const Tensor&) { return zeros({1}, dtype(DType::f64)); });
  CHECK_THROWS_ERROR(
      sum(w).backward(),
      "gradient hook on mul_backward returned a gradient of shape [1] for a variable of shape [2]");

  CHECK_THROWS_ERROR(y.set_requires_grad(false),
                     "set_requires_grad: '' is computed by mul_backward; only leaves can change it");
  CHECK_THROWS_ERROR(Variable(ones({2}, dtype(DType::i64)), true, "ids"),
                     "set_requires_grad: only floating tensors can require grad, 'ids' is i64");
  CHECK_THROWS_ERROR(constant(ones({1})).register_hook([](const Tensor& g) { return g; }),
                     "register_hook: '' does not require grad");
  CHECK_THROWS_ERROR(y.register_post_accumulate_grad_hook([](const Variable&) {}),
                     "register_post_accumulate_grad_hook: '' is not a leaf that requires grad");
}

TEST_CASE("backward from several outputs at once", "[engine]") {
  const Variable x = leaf({1, 2}, "x");
  const Variable y1 = mul(x, 2.0), y2 = mul(x, x);
  autograd::backward({y1, y2}, {ones({2}, dtype(DType::f64)), from_vector<double>({1, 10})}, false);
  check_equal(x.grad(), {2 + 2, 2 + 40});
  CHECK_THROWS_ERROR(autograd::backward({y1}, {}, false), "backward: 1 outputs but 0 gradients");
}
