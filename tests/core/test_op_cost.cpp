// tests/core/test_op_cost.cpp: kernel_cost's operations and bytes of real calls, each counted by hand:
// a batched matmul and a linear with its bias, a convolution and its two gradients, attention with and
// without its causal mask (forward and backward), a broadcast add, a reduction, an embedding and its
// gradient, an AdamW step; attention's scored pairs; the cost labels each call carries; calls it has no
// rule for are refused by name.
#include <algorithm>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/call_log.h"
#include "core/op_cost.h"
#include "core/ops.h"
#include "tests/check.h"

namespace shardlab {
namespace {

// The one call named `op` that `work` makes (other calls, e.g. copies or index checks, are skipped).
template <typename Work>
KernelCost cost_of(const std::string& op, Work&& work) {
  const std::vector<KernelCost> costs = kernel_costs(work);
  const auto count =
      std::count_if(costs.begin(), costs.end(), [&](const KernelCost& c) { return c.op == op; });
  INFO(op << " calls: " << count);
  REQUIRE(count == 1);
  return *std::find_if(costs.begin(), costs.end(), [&](const KernelCost& c) { return c.op == op; });
}

Tensor random(const Shape& shape, std::uint64_t seed) { return test::random_tensor(shape, seed); }

}  // namespace

TEST_CASE("kernel_cost: a batched matmul and a linear with its bias, by hand", "[op_cost]") {
  // [2, 3, 4] x [2, 4, 5]: 2 x 3 x 5 outputs of 4 multiply-adds; operands of 24, 40 and 30 f32.
  const KernelCost matmul_cost = cost_of("matmul", [] {
    matmul(random({2, 3, 4}, 1), random({2, 4, 5}, 2));
  });
  CHECK(matmul_cost.dense);
  CHECK(matmul_cost.flops == 2.0 * 30 * 4);
  CHECK(matmul_cost.bytes == (24 + 40 + 30) * 4.0);
  // x [3, 4] by weight [5, 4] plus bias [5]: 15 outputs of 4 multiply-adds and an add each; the
  // weight's 20, x's 12, the bias's 5 and the output's 15 elements.
  const KernelCost linear_cost = cost_of("linear", [] {
    linear(random({3, 4}, 3), random({5, 4}, 4), random({5}, 5));
  });
  CHECK(linear_cost.flops == 2.0 * 15 * 4 + 15);
  CHECK(linear_cost.bytes == (12 + 20 + 5 + 15) * 4.0);
  CHECK(linear_cost.dtype == DType::f32);
}

TEST_CASE("kernel_cost: a convolution and its two gradients, by hand", "[op_cost]") {
  // input [2, 3, 8, 8], weight [4, 3, 3, 3], padding 1: out [2, 4, 8, 8], 512 outputs of 27
  // multiply-adds (and the bias's add); the gradients make the same products.
  const Tensor input = random({2, 3, 8, 8}, 6), weight = random({4, 3, 3, 3}, 7), bias = random({4}, 8);
  const Conv2dParams params{.stride = 1, .padding = 1};
  const KernelCost forward = cost_of("conv2d", [&] { conv2d(input, weight, bias, params); });
  CHECK(forward.dense);
  CHECK(forward.flops == 2.0 * 512 * 27 + 512);
  CHECK(forward.bytes == (384 + 108 + 4 + 512) * 4.0);
  const Tensor grad_out = random({2, 4, 8, 8}, 9);
  const KernelCost input_grad = cost_of(
      "conv2d_backward_input", [&] { conv2d_backward_input(grad_out, weight, input.shape(), params); });
  CHECK(input_grad.flops == 2.0 * 512 * 27);
  CHECK(input_grad.bytes == (512 + 108 + 384) * 4.0);
  const KernelCost weight_grad = cost_of(
      "conv2d_backward_weight", [&] { conv2d_backward_weight(grad_out, input, weight.shape(), params); });
  CHECK(weight_grad.flops == 2.0 * 512 * 27);
  CHECK(weight_grad.bytes == (512 + 384 + 108) * 4.0);
}

TEST_CASE("kernel_cost: attention scores the pairs its mask lets through, forward and backward",
          "[op_cost]") {
  // Two heads of 4 queries over 4 keys, head size 8: 32 pairs, causal 2 x (1 + 2 + 3 + 4) = 20.
  const Tensor q = random({1, 2, 4, 8}, 10), k = random({1, 2, 4, 8}, 11), v = random({1, 2, 4, 8}, 12);
  const KernelCost full = cost_of("attention_forward", [&] { attention_forward(q, k, v); });
  CHECK(full.dense);
  CHECK(full.flops == 2.0 * 32 * (8 + 8));
  // q, k and v (64 elements each), the output (64) and a logsumexp of f32 per query (8).
  CHECK(full.bytes == 4 * 64 * 4.0 + 8 * 4.0);
  const AttentionParams causal{.causal = true};
  CHECK(cost_of("attention_forward", [&] { attention_forward(q, k, v, causal); }).flops == 2.0 * 20 * 16);
  const AttentionResult forward = attention_forward(q, k, v, causal);
  const Tensor grad_out = random({1, 2, 4, 8}, 13);
  const KernelCost backward =
      cost_of("attention_backward", [&] { attention_backward(grad_out, q, k, v, forward, causal); });
  // Scores again (8), then dV (8), dP (8), dQ (8) and dK (8) per pair; reads grad_out, q, k, v, the
  // output and the logsumexp, writes three gradients.
  CHECK(backward.flops == 2.0 * 20 * (3 * 8 + 2 * 8));
  CHECK(backward.bytes == (64 + 2 * 3 * 64 + 64) * 4.0 + 8 * 4.0);
  // Pairs: 6 queries over 4 keys see 1, 2, 3, 4, 4, 4; 3 over 5 see 1, 2, 3.
  CHECK(attention_pairs(6, 4, true) == 18);
  CHECK(attention_pairs(3, 5, true) == 6);
  CHECK(attention_pairs(3, 5, false) == 15);
  CHECK(attention_pairs(0, 5, true) == 0);
}

TEST_CASE("kernel_cost: attention with documents scores the pairs of the tiles the CPU kernel visits",
          "[op_cost]") {
  // One row of 130 tokens, documents of 70 and 60: the 64-tiles' documents are {0}, {0, 1} and {1}, so
  // the last query tile (2 queries) skips key tile 0 (64 keys). Causal: 130 x 131 / 2 = 8515 pairs less
  // 2 x 64 = 8387 per head; not causal: 130 x 130 less 2 x 64 and 64 x 2 = 16644.
  std::vector<std::int64_t> ids(130, 0);
  std::fill(ids.begin() + 70, ids.end(), 1);
  const AttentionParams causal{.causal = true, .documents = from_vector(ids, {1, 130})};
  const AttentionParams plain{.documents = causal.documents};
  CHECK(attention_scored_pairs(Device::cpu(), causal) == 8387);
  CHECK(attention_scored_pairs(Device::cpu(), plain) == 16644);
  CHECK(attention_scored_pairs(Device::cpu(), AttentionParams{.causal = true}) == 0);  // by the shapes
  // Two heads of 8: the forward's flops are 2 x 2 x 8387 x (8 + 8).
  const Tensor q = random({1, 2, 130, 8}, 20), k = random({1, 2, 130, 8}, 21), v = random({1, 2, 130, 8}, 22);
  const KernelCost forward = cost_of("attention_forward", [&] { attention_forward(q, k, v, causal); });
  CHECK(forward.pairs == 2 * 8387);
  CHECK(forward.flops == 2.0 * 2 * 8387 * 16);
  // Without the skipped tile (one document), the shapes' count.
  const AttentionParams one{.causal = true, .documents = zeros({1, 130}, dtype(DType::i64))};
  CHECK(cost_of("attention_forward", [&] { attention_forward(q, k, v, one); }).pairs == 2 * 8515.0);
}

TEST_CASE("kernel_cost: memory kernels count each distinct element once", "[op_cost]") {
  // [4, 3] + [3]: b is expanded, its 3 elements read once; one add per output.
  const KernelCost added = cost_of("add", [] { add(random({4, 3}, 14), random({3}, 15)); });
  CHECK_FALSE(added.dense);
  CHECK(added.flops == 12);
  CHECK(added.bytes == (12 + 3 + 12) * 4.0);
  // A row sum of [4, 6]: reads 24, writes 4.
  const KernelCost summed = cost_of("sum", [] { sum(random({4, 6}, 16), {1}); });
  CHECK(summed.flops == 24);
  CHECK(summed.bytes == (24 + 4) * 4.0);
  // An embedding of 5 rows of 8 from a table of 100: the i64 index, the 5 rows read and written (not
  // the table); its gradient reads the index and the 5 rows and adds them into 5 rows of the table.
  const Tensor indices = from_vector(std::vector<std::int64_t>{3, 1, 4, 1, 5}, {5});
  const KernelCost looked_up = cost_of("embedding", [&] { embedding(random({100, 8}, 17), indices); });
  CHECK(looked_up.bytes == 5 * 8.0 + 2 * 40 * 4.0);
  const KernelCost added_back = cost_of("embedding_backward", [&] {
    embedding_backward(random({5, 8}, 18), indices, 100);
  });
  CHECK(added_back.bytes == 5 * 8.0 + 3 * 40 * 4.0);
  CHECK(added_back.flops == 40);
  // AdamW over 10 f32: reads the parameter, gradient and two states, writes three.
  const Tensor param = random({10}, 19), grad = random({10}, 20), m = zeros({10}), v = zeros({10});
  const KernelCost stepped =
      cost_of("adam_step", [&] { adam_step(param, grad, m, v, AdamHyper{.decoupled = true}); });
  CHECK(stepped.bytes == 7 * 10 * 4.0);
}

TEST_CASE("kernel_cost: each call carries the innermost cost label its thread has open", "[op_cost]") {
  const Tensor a = random({4}, 21);
  std::string other_thread;
  const std::vector<KernelCost> costs = kernel_costs([&] {
    add(a, a);
    open_cost_label("outer");
    mul(a, a);
    open_cost_label("inner");
    sub(a, a);
    std::thread([&] { neg(a); }).join();  // another thread's calls carry its own labels: none
    close_cost_label("outer");            // out of order: "inner" stays open
    div(a, a);
    close_cost_label("inner");
    exp(a);
  });
  std::vector<std::pair<std::string, std::string>> labelled;
  for (const KernelCost& cost : costs) labelled.emplace_back(cost.op, cost.label);
  CHECK(labelled ==
        std::vector<std::pair<std::string, std::string>>{
            {"add", ""}, {"mul", "outer"}, {"sub", "inner"}, {"neg", ""}, {"div", "inner"}, {"exp", ""}});
  CHECK(innermost_cost_label().empty());
  // Closing a label that is not open names it and what is; close_cost_labels closes all.
  open_cost_label("forward a");
  open_cost_label("backward b");
  CHECK_THROWS_ERROR(
      close_cost_label("forward b"),
      "close_cost_label: no label 'forward b' is open on this thread (open: forward a, backward b)");
  CHECK(innermost_cost_label() == "backward b");
  close_cost_labels();
  CHECK(innermost_cost_label().empty());
  CHECK_THROWS_ERROR(close_cost_label("forward a"),
                     "close_cost_label: no label 'forward a' is open on this thread");
}

TEST_CASE("kernel_cost: a call it has no rule for, or one without its operands, is refused by name",
          "[op_cost]") {
  CHECK_THROWS_ERROR(kernel_cost(call_log::Call{.op = "mystery"}),
                     "kernel_cost: no rule for op 'mystery' (category 'other')");
  CHECK_THROWS_ERROR(kernel_cost(call_log::Call{.op = "matmul"}),
                     "kernel_cost: matmul needs 3 operands (the first of rank 3), got 0");
  CHECK_THROWS_ERROR(kernel_cost(call_log::Call{.op = "attention_backward"}),
                     "kernel_cost: attention_backward needs 4 operands (the first of rank 4), got 0");
  // The log is off again after work that throws.
  CHECK_THROWS(kernel_costs([] { throw Error("stop"); }));
  CHECK_FALSE(call_log::on());
}

}  // namespace shardlab
