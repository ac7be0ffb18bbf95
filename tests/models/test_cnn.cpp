// tests/models/test_cnn.cpp: the tutorial CNN's structure (PyTorch's names and sizes), output, and
// that training steps lower the loss.
#include "autograd/functional.h"
#include "models/cnn.h"
#include "optim/optimizer.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("the CNN has the tutorial's layers, names and 1,199,882 parameters", "[models][cnn]") {
  models::Cnn model;
  CHECK(model->parameter_count() == 1199882);
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  for (const auto& [name, p] : model->named_parameters()) {
    names.push_back(name);
    shapes.push_back(p.shape());
  }
  CHECK(names == std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                          "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"});
  CHECK(shapes ==
        std::vector<Shape>{{32, 1, 3, 3}, {32}, {64, 32, 3, 3}, {64}, {128, 9216}, {128}, {10, 128}, {10}});
}

TEST_CASE("the CNN maps images to log-probabilities; eval is deterministic", "[models][cnn]") {
  models::Cnn model(3);
  const Tensor images = test::random_tensor({5, 1, 28, 28}, 1);
  model->eval();
  const Variable out = model(constant(images));
  CHECK(out.shape() == Shape{5, 10});
  test::check_close(sum(exp(out.data()), {1}), std::vector<double>(5, 1.0));
  CHECK(model(constant(images)).data().to_vector<float>() == out.data().to_vector<float>());
  CHECK_THROWS_ERROR(model(constant(zeros({2, 3, 28, 28}))),
                     "Cnn: expected images [N, 1, 28, 28], got [2, 3, 28, 28]");
}

TEST_CASE("a few Adadelta steps on one batch lower its loss", "[models][cnn]") {
  models::Cnn model(1);
  const Tensor images = test::random_tensor({16, 1, 28, 28}, 2);
  const Tensor labels = arange(16).to(DType::i64);
  const Tensor targets = sub(labels, mul(div(labels, 10).to(DType::i64), 10));  // labels % 10
  optim::Adadelta optimizer(model->named_parameters(), {.lr = 1.0});
  model->eval();  // no dropout: the loss must fall monotonically-ish on a fixed batch
  double first = 0, last = 0;
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    const Variable loss = nll_loss(model(constant(images)), targets, -100, Reduction::sum);
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.data().item<double>();
  }
  CHECK(last < first);
}
