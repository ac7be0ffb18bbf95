// tests/nn/test_layers.cpp: every standard layer's forward against an independent
// computation, its options, and its argument errors.
#include "nn/layers.h"
#include "tests/check.h"

using namespace shardlab;
using namespace shardlab::nn;
using test::check_close;
using test::random_tensor;
using test::values;

TEST_CASE("Linear computes x W^T + b", "[nn][layers]") {
  Linear fc(LinearOptions(3, 2));
  initialize(*fc, 1);
  const Tensor x = random_tensor({4, 3}, 2);
  const auto w = values(fc->weight.data()), b = values(fc->bias.data()), xv = values(x);
  std::vector<double> expected;
  for (int i = 0; i < 4; ++i) {
    for (int o = 0; o < 2; ++o) {
      double acc = b[o];
      for (int k = 0; k < 3; ++k) acc += xv[i * 3 + k] * w[o * 3 + k];
      expected.push_back(acc);
    }
  }
  check_close(fc(constant(x)).data(), expected);
  Linear no_bias(LinearOptions(3, 2).bias(false));
  CHECK_FALSE(no_bias->bias.defined());
  CHECK(no_bias->named_parameters().size() == 1);
  CHECK_THROWS_ERROR(fc(constant(ones({4, 5}))), "Linear: input of shape [4, 5] does not end in 3");
  CHECK_THROWS_ERROR(Linear(LinearOptions(0, 2)), "Linear: in and out must be positive, got 0 and 2");
}

TEST_CASE("Conv2d and MaxPool2d apply the core ops with their options", "[nn][layers]") {
  Conv2d conv(Conv2dOptions(2, 3, 3).stride(2).padding(1));
  initialize(*conv, 1);
  const Tensor x = random_tensor({2, 2, 7, 6}, 3);
  check_close(conv(constant(x)).data(), conv2d(x, conv->weight.data(), conv->bias.data(), {2, 1}));
  CHECK(conv->weight.shape() == Shape{3, 2, 3, 3});
  MaxPool2d pool(MaxPool2dParams{.kernel_size = 2});
  check_close(pool(constant(x)).data(), max_pool2d(x, {.kernel_size = 2}).values);
  CHECK(pool->describe() == "MaxPool2d(kernel_size=2, stride=2, padding=0)");
  CHECK_THROWS_ERROR(Conv2d(Conv2dOptions(0, 3, 3)), "Conv2d: channels and kernel size must be positive");
}

TEST_CASE("Dropout drops only in training mode", "[nn][layers]") {
  Dropout drop(0.5);
  const Variable x = constant(ones({50, 40}));
  const auto trained = values(drop(x).data());
  CHECK(std::count(trained.begin(), trained.end(), 0.0) > 500);
  drop->eval();
  CHECK(drop(x).same(x));
  CHECK_THROWS_ERROR(Dropout(2.0), "Dropout: p must be in [0, 1], got 2");
}

TEST_CASE("activation layers, Flatten, Embedding and the norms", "[nn][layers]") {
  const Tensor x = random_tensor({2, 3, 4}, 4, DType::f32, -2, 2);
  check_close(ReLU()(constant(x)).data(), relu(x));
  check_close(SiLU()(constant(x)).data(), silu(x));
  check_close(GELU(GeluApproximation::tanh)(constant(x)).data(), gelu(x, GeluApproximation::tanh));
  CHECK(Flatten()(constant(x)).shape() == Shape{2, 12});
  CHECK(Flatten(0, 1)(constant(x)).shape() == Shape{6, 4});

  Embedding table(10, 3);
  initialize(*table, 1);
  const Tensor ids = from_vector<std::int64_t>({7, 0, 7}, {3, 1});
  const Variable rows = table(ids);
  CHECK(rows.shape() == Shape{3, 1, 3});
  check_close(rows.data().select(0, 0).select(0, 0), table->weight.data().select(0, 7));
  CHECK_THROWS_ERROR(Embedding(0, 3), "Embedding: sizes must be positive, got 0 and 3");

  // RMSNorm by hand on one row: x / sqrt(mean(x^2) + eps) * w.
  RMSNorm rms(4, 1e-6);
  const Tensor row = from_vector<float>({1, -2, 3, 4}, {1, 4});
  const double scale = 1 / std::sqrt((1 + 4 + 9 + 16) / 4.0 + 1e-6);
  check_close(rms(constant(row)).data(), {scale, -2 * scale, 3 * scale, 4 * scale});
  LayerNorm ln(4, 1e-5);
  const double mu = 1.5, var = ((1 - mu) * (1 - mu) + (-2 - mu) * (-2 - mu) + (3 - mu) * (3 - mu) +
                                (4 - mu) * (4 - mu)) /
                               4;
  const double inv = 1 / std::sqrt(var + 1e-5);
  check_close(ln(constant(row)).data(), {(1 - mu) * inv, (-2 - mu) * inv, (3 - mu) * inv, (4 - mu) * inv});
  LayerNorm plain(4, 1e-5, false);
  CHECK(plain->named_parameters().empty());
  CHECK_THROWS_ERROR(LayerNorm(0), "LayerNorm: dim must be positive, got 0");
  CHECK_THROWS_ERROR(RMSNorm(-3), "RMSNorm: dim must be positive, got -3");
}

TEST_CASE("RMSNorm's add_then_norm fuses the residual add only where its forward has no hooks",
          "[nn][layers]") {
  RMSNorm norm(4, 1e-6);
  const Tensor x = random_tensor({2, 4}, 5, DType::f32, -2, 2),
               y = random_tensor({2, 4}, 6, DType::f32, -2, 2);
  const Tensor sum = add(x, y);
  const auto [fused_sum, fused_out] = norm->add_then_norm(constant(x), constant(y));
  check_close(fused_sum.data(), sum, {0.0, 0.0});
  check_close(fused_out.data(), norm(constant(sum)).data(), {0.0, 0.0});
  // A hook sees the norm's own input and output: the add runs first, then the forward through them.
  Tensor seen_input, seen_output;
  norm->register_forward_pre_hook([&](Module&, ForwardInputs& inputs) { seen_input = inputs.at(0).data(); });
  norm->register_forward_hook([&](Module&, Variable& output) {
    seen_output = output.data();
    output = mul(output, 2.0);
  });
  const auto [hooked_sum, hooked_out] = norm->add_then_norm(constant(x), constant(y));
  check_close(seen_input, sum, {0.0, 0.0});
  check_close(seen_output, fused_out.data(), {0.0, 0.0});
  check_close(hooked_sum.data(), sum, {0.0, 0.0});
  check_close(hooked_out.data(), mul(fused_out.data(), 2.0), {0.0, 0.0});
}

TEST_CASE("Sequential applies its layers in order; ModuleList names and indexes them", "[nn][layers]") {
  Sequential net(Linear(LinearOptions(3, 5)), ReLU(), Linear(LinearOptions(5, 2)));
  initialize(*net, 2);
  CHECK(net->size() == 3);
  const Tensor x = random_tensor({4, 3}, 5);
  const auto& params = net->named_parameters();
  REQUIRE(params.size() == 4);
  CHECK(params[0].first == "0.weight");
  CHECK(params[2].first == "2.weight");
  const Tensor hidden =
      relu(add(matmul(x, params[0].second.data().transpose(0, 1)), params[1].second.data()));
  const Tensor expected =
      add(matmul(hidden, params[2].second.data().transpose(0, 1)), params[3].second.data());
  check_close(net(constant(x)).data(), expected);

  ModuleList<LinearImpl> list;
  list->push_back(std::make_shared<LinearImpl>(LinearOptions(2, 2)));
  list->push_back(std::make_shared<LinearImpl>(LinearOptions(2, 3)));
  CHECK(list->size() == 2);
  CHECK((*list)[1].options.out() == 3);
  CHECK(list->named_parameters()[2].first == "1.weight");
}
