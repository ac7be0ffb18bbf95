// tests/models/test_step_costs.cpp: every kernel call of a real Llama and CNN training step (forward,
// loss, backward, clipping, the optimizer) has a cost rule in core/op_cost.h, and the Linear layers'
// operations add up to the count made from the models' weights alone: 2 x tokens x in x out per layer
// forward, twice that backward (the input's and the weight's gradients).
#include <map>
#include <string>

#include "autograd/functional.h"
#include "core/op_cost.h"
#include "models/cnn.h"
#include "models/llama.h"
#include "optim/optimizer.h"
#include "tests/check.h"

namespace shardlab {
namespace {

// Operations per op name, and whether every call has bytes to move.
struct Totals {
  std::map<std::string, double> flops;
  bool every_call_moves_bytes = true;
};
Totals totals(const std::vector<KernelCost>& costs) {
  Totals out;
  for (const KernelCost& cost : costs) {
    out.flops[cost.op] += cost.flops;
    out.every_call_moves_bytes &= cost.bytes > 0;
  }
  return out;
}

}  // namespace

TEST_CASE("every kernel call of a Llama training step has a cost; its Linears' operations by hand",
          "[models][llama][op_cost]") {
  models::Llama model(models::LlamaConfig::preset("tiny"), /*seed=*/3);
  optim::AdamW optimizer(model->named_parameters(), {.weight_decay = 0.1});
  const std::int64_t vocab = model->config.vocab_size, tokens = 2 * 24;
  const Tensor ids =
      (test::random_tensor({2, 24}, 4, DType::f64, 0.0, 1.0) * double(vocab - 1)).to(DType::i64);
  Variable logits;
  const Totals forward = totals(kernel_costs([&] { logits = model(ids); }));
  const Totals step = totals(kernel_costs([&] {
    cross_entropy(reshape(logits, {-1, vocab}), ids.reshape({-1}), -100).backward();
    (void)optim::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
  }));
  // Each projection and the head: a weight [out, in] of the parameter list (the embedding is a lookup).
  double linear_weights = 0;
  for (const auto& [name, parameter] : model->named_parameters()) {
    if (name.ends_with("proj.weight") || name == "lm_head.weight") linear_weights += parameter.numel();
  }
  REQUIRE(linear_weights > 0);
  CHECK(forward.flops.at("linear") == 2.0 * tokens * linear_weights);
  CHECK(step.flops.at("matmul") == 2 * 2.0 * tokens * linear_weights);  // dX and dW per Linear
  CHECK(forward.flops.at("attention_forward") > 0);
  CHECK(step.flops.at("attention_backward") > forward.flops.at("attention_forward"));
  CHECK(step.flops.count("adam_step") == 1);
  CHECK(forward.every_call_moves_bytes);
  CHECK(step.every_call_moves_bytes);
}

TEST_CASE("every kernel call of a CNN training step has a cost", "[models][cnn][op_cost]") {
  models::Cnn model(/*seed=*/5);
  optim::Adadelta optimizer(model->named_parameters(), optim::AdadeltaOptions{});
  const Tensor images = test::random_tensor({4, 1, 28, 28}, 6);
  const Tensor labels = from_vector(std::vector<std::int64_t>{1, 2, 3, 4}, {4});
  const Totals step = totals(kernel_costs([&] {
    nll_loss(model(constant(images)), labels).backward();
    optimizer.step();
  }));
  // conv1 [32, 1, 3, 3] over 26 x 26 outputs per image and conv2 [64, 32, 3, 3] over 24 x 24.
  const double conv_products = 4.0 * (26 * 26 * 32 * 9 + 24 * 24 * 64 * 32 * 9);
  CHECK(step.flops.at("conv2d") == 2 * conv_products + 4.0 * (26 * 26 * 32 + 24 * 24 * 64));  // with biases
  CHECK(step.flops.at("conv2d_backward_weight") == 2 * conv_products);
  CHECK(step.flops.count("adadelta_step") == 1);
  CHECK(step.every_call_moves_bytes);
}

}  // namespace shardlab
