// tests/autograd/test_gradcheck_nn.cpp: finite-difference checks of matmul, softmax, conv2d,
// pooling, indexing, losses, norms and attention, their forward values against naive loops,
// and their errors.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "autograd/functional.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "core/call_log.h"
#include "tests/check.h"
#include "tests/cuda_compare.h"

using namespace shardlab;
using test::check_close;
using test::check_equal;
using test::values;

namespace {

Tensor random64(const Shape& shape, std::uint64_t seed) {
  return test::random_tensor(shape, seed, DType::f64);
}

Variable leaf(const Shape& shape, std::uint64_t seed, std::string name = "x") {
  return Variable(random64(shape, seed), true, std::move(name));
}

Tensor indices(const std::vector<std::int64_t>& values, Shape shape) {
  return from_vector<std::int64_t>(values, std::move(shape));
}

// gradcheck with default options (f64); the report names the failing entries.
void check_gradients(const std::string& what, const GradcheckFn& fn, const std::vector<Variable>& inputs) {
  const GradcheckResult result = gradcheck(fn, inputs);
  INFO(what << ": " << result.report);
  CHECK(result.ok);
}

// Distinct values 0.1 apart in a scrambled order (37 is coprime with the element count), so
// no pooling window has a tie and no perturbation changes its maximum.
Tensor without_ties(const Shape& shape) {
  const std::int64_t n = shape_numel(shape);
  REQUIRE(std::gcd(n, std::int64_t{37}) == 1);
  std::vector<double> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(static_cast<double>((i * 37) % n) * 0.1 - 2.0);
  return from_vector<double>(v, shape);
}

const double inf = std::numeric_limits<double>::infinity();

}  // namespace

// --- matmul -----------------------------------------------------------------------------------

TEST_CASE("matmul gradients for 1-D and 2-D operands", "[gradcheck_nn][matmul]") {
  const auto mm = [](const std::vector<Variable>& x) { return matmul(x[0], x[1]); };
  check_gradients("1-D . 1-D", mm, {leaf({5}, 1), leaf({5}, 2)});
  check_gradients("2-D . 1-D", mm, {leaf({3, 4}, 3), leaf({4}, 4)});
  check_gradients("1-D . 2-D", mm, {leaf({4}, 5), leaf({4, 3}, 6)});
  check_gradients("2-D . 2-D", mm, {leaf({3, 5}, 7), leaf({5, 2}, 8)});

  // The dot product's gradients are the other operand, exactly.
  const Variable a = leaf({3}, 9, "a"), b = leaf({3}, 10, "b");
  matmul(a, b).backward();
  check_equal(a.grad(), values(b.data()));
  check_equal(b.grad(), values(a.data()));
}

TEST_CASE("matmul gradients with batch dims, broadcast batch dims and batched 1-D",
          "[gradcheck_nn][matmul]") {
  const auto mm = [](const std::vector<Variable>& x) { return matmul(x[0], x[1]); };
  check_gradients("[2,1,3,4] x [5,4,2]", mm, {leaf({2, 1, 3, 4}, 11), leaf({5, 4, 2}, 12)});
  check_gradients("[2,3,4] x [2,4,3]", mm, {leaf({2, 3, 4}, 13), leaf({2, 4, 3}, 14)});
  // A 2-D operand against a batched one: its gradient sums over the batch.
  check_gradients("[2,3,4] x [4,2]", mm, {leaf({2, 3, 4}, 15), leaf({4, 2}, 16)});
  check_gradients("[3,4] x [2,2,4,2]", mm, {leaf({3, 4}, 17), leaf({2, 2, 4, 2}, 18)});
  check_gradients("[4] x [2,4,3]", mm, {leaf({4}, 19), leaf({2, 4, 3}, 20)});
  check_gradients("[2,3,4] x [4]", mm, {leaf({2, 3, 4}, 21), leaf({4}, 22)});
}

TEST_CASE("matmul: an operand that needs no gradient gets none", "[gradcheck_nn][matmul]") {
  const auto mm = [](const std::vector<Variable>& x) { return matmul(x[0], x[1]); };
  check_gradients("b constant", mm, {leaf({2, 3, 4}, 23), constant(random64({4, 2}, 24))});
  check_gradients("a constant", mm, {constant(random64({2, 3, 4}, 25)), leaf({4, 2}, 26)});

  // d sum(a @ b) / d a[i][k] = sum_j b[k][j]
  const Variable a = leaf({2, 3}, 27, "a"), b = constant(from_vector<double>({1, 2, 3, 4, 5, 6}, {3, 2}));
  sum(matmul(a, b)).backward();
  check_equal(a.grad(), {3, 7, 11, 3, 7, 11});
  CHECK_FALSE(b.grad().defined());
}

TEST_CASE("matmul gradients through non-contiguous operands", "[gradcheck_nn][matmul]") {
  const auto mm = [](const std::vector<Variable>& x) { return matmul(x[0], x[1]); };
  const Variable a(test::random_strided({3, 4}, 28, DType::f64), true, "a");
  const Variable b(test::random_strided({4, 5}, 29, DType::f64), true, "b");
  REQUIRE_FALSE(a.data().is_contiguous());
  REQUIRE_FALSE(b.data().is_contiguous());
  check_gradients("transposed 2-D", mm, {a, b});
  const Variable batched(test::random_strided({2, 3, 4}, 30, DType::f64), true, "batched");
  check_gradients("transposed batch x transposed 2-D", mm, {batched, b});
  const Variable column(random64({4, 2}, 31).select(1, 1), true, "column");  // stride 2
  check_gradients("strided 1-D", mm, {batched, column});
}

TEST_CASE("matmul through a transposed weight (Linear's x @ w.t()) gives the weight a contiguous gradient",
          "[gradcheck_nn][matmul]") {
  // The weight's gradient is computed in the transposed layout, so it reaches the leaf (its hooks
  // see it before accumulation) contiguous: accumulating it is a plain copy, not a transpose.
  const auto linear = [](const std::vector<Variable>& x) { return matmul(x[0], transpose(x[1], 0, 1)); };
  const auto linear_left = [](const std::vector<Variable>& x) { return matmul(transpose(x[1], 0, 1), x[0]); };
  const auto arrives_contiguous = [](const GradcheckFn& fn, const Variable& x, const Variable& w) {
    bool contiguous = false;
    w.register_hook([&](const Tensor& g) {
      contiguous = g.is_contiguous();
      return Tensor();
    });
    sum(fn({x, w})).backward();
    return contiguous;
  };
  for (const Shape& input : std::vector<Shape>{{3, 4}, {2, 3, 4}}) {
    INFO(shape_str(input));
    const Variable x = leaf(input, 32, "x"), w = leaf({5, 4}, 33, "w");
    check_gradients("x @ w.t()", linear, {x, w});
    CHECK(arrives_contiguous(linear, x, w));
    // Against the closed form: d sum(x w^T) / dw [o, i] = the sum over x's rows of x[.., i].
    const std::vector<double> xs = test::values(x.data());
    std::vector<double> expected(20, 0.0);
    for (std::size_t j = 0; j < xs.size(); ++j) {
      for (std::size_t o = 0; o < 5; ++o) expected[o * 4 + j % 4] += xs[j];
    }
    test::check_close(w.grad(), expected);
  }
  const Variable x = leaf({5, 3}, 34, "x"), w = leaf({5, 4}, 35, "w");  // the transposed operand on the left
  check_gradients("w.t() @ x", linear_left, {x, w});
  CHECK(arrives_contiguous(linear_left, x, w));
}

TEST_CASE("linear: gradients of input, weight and bias, and the bias added before the one rounding",
          "[gradcheck_nn][matmul]") {
  const auto with_bias = [](const std::vector<Variable>& v) { return linear(v[0], v[1], v[2]); };
  const auto without_bias = [](const std::vector<Variable>& v) { return linear(v[0], v[1]); };
  for (const Shape& input : std::vector<Shape>{{4}, {3, 4}, {2, 3, 4}}) {
    INFO(shape_str(input));
    check_gradients("linear", with_bias, {leaf(input, 36, "x"), leaf({5, 4}, 37, "w"), leaf({5}, 38, "b")});
    check_gradients("linear, no bias", without_bias, {leaf(input, 36, "x"), leaf({5, 4}, 37, "w")});
  }
  // The weight's gradient arrives contiguous, as through Linear's x @ w.t(); a bias that needs none
  // gets none.
  const Variable x = leaf({2, 3, 4}, 39, "x"), w = leaf({5, 4}, 40, "w");
  const Variable frozen_bias = constant(random64({5}, 41));
  sum(linear(x, w, frozen_bias)).backward();
  CHECK(w.grad().is_contiguous());
  CHECK_FALSE(frozen_bias.grad().defined());

  // f32: the bits of x @ w.t() + b. Halves: the f32 product plus the f32 bias, rounded once.
  const Tensor input = test::random_tensor({2, 7, 33}, 42), weight = test::random_tensor({9, 33}, 43),
               bias = test::random_tensor({9}, 44);
  CHECK(test::same_bits(linear(input, weight, bias), add(matmul(input, weight.transpose(0, 1)), bias)));
  for (const DType half : {DType::bf16, DType::f16}) {
    INFO(dtype_name(half));
    const Tensor x16 = input.to(half), w16 = weight.to(half), b16 = bias.to(half);
    const Tensor f32_sum =
        add(matmul(x16.to(DType::f32), w16.to(DType::f32).transpose(0, 1)), b16.to(DType::f32));
    CHECK(test::same_bits(linear(x16, w16, b16), f32_sum.to(half)));
  }
  CHECK_THROWS_ERROR(linear(input, weight.flatten()), "linear: weight must be [out, in], got shape [297]");
  CHECK_THROWS_ERROR(linear(input, weight.narrow(1, 0, 32)),
                     "linear: input of shape [2, 7, 33] does not end in 32");
  CHECK_THROWS_ERROR(linear(input, weight, bias.narrow(0, 0, 8)),
                     "linear: bias must be f32 [9] for weight [9, 33], got f32 [8]");
  CHECK_THROWS_ERROR(linear(input, weight, bias.to(DType::f64)),
                     "linear: bias must be f32 [9] for weight [9, 33], got f64 [9]");
  CHECK_THROWS_ERROR(linear(Tensor(), weight), "linear: input tensor is undefined");
  CHECK_THROWS_ERROR(linear(input.to(DType::f64), weight),
                     "linear: dtypes differ (f64 and f32); cast one first");
}

// --- softmax ----------------------------------------------------------------------------------

TEST_CASE("softmax and log_softmax gradients along every dim", "[gradcheck_nn][softmax]") {
  for (const std::int64_t dim : {0, 1, 2, -1, -2, -3}) {
    INFO("dim " << dim);
    check_gradients("softmax", [dim](const std::vector<Variable>& x) { return softmax(x[0], dim); },
                    {leaf({3, 4, 2}, 40)});
    check_gradients("log_softmax", [dim](const std::vector<Variable>& x) { return log_softmax(x[0], dim); },
                    {leaf({3, 4, 2}, 41)});
  }
  const Variable strided(test::random_strided({3, 4}, 42, DType::f64), true);
  check_gradients("softmax of a transposed input",
                  [](const std::vector<Variable>& x) { return softmax(x[0], 1); }, {strided});
  // A 0-d input is a one-element softmax: the constant 1 (log: 0), whose gradient is 0.
  check_gradients("0-d softmax", [](const std::vector<Variable>& x) { return softmax(x[0], 0); },
                  {Variable(scalar_tensor(0.7, dtype(DType::f64)), true)});
  check_gradients("0-d log_softmax", [](const std::vector<Variable>& x) { return log_softmax(x[0], -1); },
                  {Variable(scalar_tensor(0.7, dtype(DType::f64)), true)});
}

// --- convolution and pooling --------------------------------------------------------------------

TEST_CASE("conv2d gradients with stride, padding, with and without bias", "[gradcheck_nn][conv2d]") {
  const Conv2dParams strided{.stride = 2, .padding = 1};
  const auto with_bias = [strided](const std::vector<Variable>& x) {
    return conv2d(x[0], x[1], x[2], strided);
  };
  const auto no_bias = [strided](const std::vector<Variable>& x) { return conv2d(x[0], x[1], {}, strided); };
  const Variable input = leaf({2, 2, 5, 4}, 50, "input"), weight = leaf({3, 2, 3, 3}, 51, "weight");
  const Variable bias = leaf({3}, 52, "bias");
  check_gradients("stride 2, padding 1, bias", with_bias, {input, weight, bias});
  check_gradients("stride 2, padding 1, no bias", no_bias, {input, weight});
  check_gradients("stride 1, padding 0, 2x3 kernel",
                  [](const std::vector<Variable>& x) { return conv2d(x[0], x[1], x[2]); },
                  {leaf({1, 2, 4, 5}, 53), leaf({3, 2, 2, 3}, 54), leaf({3}, 55)});
}

TEST_CASE("conv2d: an input image that needs no gradient gets none", "[gradcheck_nn][conv2d]") {
  const Conv2dParams strided{.stride = 2, .padding = 1};
  const Variable image = constant(random64({2, 2, 5, 4}, 56));
  const Variable weight = leaf({3, 2, 3, 3}, 57, "weight"), bias = leaf({3}, 58, "bias");
  check_gradients("first layer",
                  [strided](const std::vector<Variable>& x) { return conv2d(x[0], x[1], x[2], strided); },
                  {image, weight, bias});
  // The bias gradient of sum(conv2d) is the number of output positions per channel.
  sum(conv2d(image, weight, bias, strided)).backward();
  check_equal(bias.grad(), {2 * 3 * 2, 2 * 3 * 2, 2 * 3 * 2});
  CHECK_FALSE(image.grad().defined());
  // Only the input needing a gradient: the weight gets none.
  const Variable input = leaf({2, 2, 5, 4}, 59, "input"), frozen = constant(random64({3, 2, 3, 3}, 60));
  sum(conv2d(input, frozen, {}, strided)).backward();
  CHECK(input.grad().defined());
  CHECK_FALSE(frozen.grad().defined());
}

TEST_CASE("max_pool2d gradients go to each window's maximum", "[gradcheck_nn][max_pool2d]") {
  check_gradients(
      "kernel 2, stride 2",
      [](const std::vector<Variable>& x) { return max_pool2d(x[0], {.kernel_size = 2, .stride = 2}); },
      {Variable(without_ties({2, 2, 4, 6}), true)});
  check_gradients("kernel 3, stride 2, padding 1",
                  [](const std::vector<Variable>& x) {
                    return max_pool2d(x[0], {.kernel_size = 3, .stride = 2, .padding = 1});
                  },
                  {Variable(without_ties({1, 2, 5, 5}), true)});

  // One plane [[1, 5], [3, 2]] pooled to its maximum: the gradient is 1 at the 5 only.
  const Variable x(from_vector<double>({1, 5, 3, 2}, {1, 1, 2, 2}), true);
  sum(max_pool2d(x)).backward();
  check_equal(x.grad(), {0, 1, 0, 0});
}

// --- indexing -----------------------------------------------------------------------------------

TEST_CASE("embedding gradients sum over repeated indices", "[gradcheck_nn][embedding]") {
  const Tensor ids = indices({0, 2, 2, 4, 0, 2}, {2, 3});
  check_gradients("i64 ids [2, 3]", [ids](const std::vector<Variable>& x) { return embedding(x[0], ids); },
                  {leaf({5, 3}, 70)});
  const Tensor ids32 = from_vector<std::int32_t>({3, 3, 1});
  check_gradients("i32 ids [3]", [ids32](const std::vector<Variable>& x) { return embedding(x[0], ids32); },
                  {leaf({4, 2}, 71)});

  const Variable table = leaf({5, 2}, 72, "table");
  sum(embedding(table, ids)).backward();
  check_equal(table.grad(), {2, 2, 0, 0, 3, 3, 0, 0, 1, 1});  // row r: how often r was looked up
}

TEST_CASE("index_select and gather gradients", "[gradcheck_nn][index]") {
  const Tensor rows = indices({3, 0, 3}, {3});
  check_gradients("index_select dim 0",
                  [rows](const std::vector<Variable>& x) { return index_select(x[0], 0, rows); },
                  {leaf({4, 3}, 80)});
  const Tensor columns = from_vector<std::int32_t>({2, 0});
  check_gradients("index_select dim -1",
                  [columns](const std::vector<Variable>& x) { return index_select(x[0], -1, columns); },
                  {leaf({2, 4, 3}, 81)});

  const Tensor along_1 = indices({0, 0, 3, 1, 2, 1, 3, 3, 0}, {3, 3});
  check_gradients("gather dim 1",
                  [along_1](const std::vector<Variable>& x) { return gather(x[0], 1, along_1); },
                  {leaf({3, 4}, 82)});
  const Tensor along_0 = indices({2, 0, 2, 1, 1, 0}, {2, 3});  // smaller than x outside dim
  check_gradients("gather dim 0",
                  [along_0](const std::vector<Variable>& x) { return gather(x[0], 0, along_0); },
                  {leaf({3, 4}, 83)});

  const Variable x = leaf({2, 3}, 84);
  sum(gather(x, 1, indices({2, 2, 0, 1}, {2, 2}))).backward();
  check_equal(x.grad(), {0, 0, 2, 1, 1, 0});
}

TEST_CASE("scatter_add gradients: self gets g, src gets g gathered", "[gradcheck_nn][index]") {
  const Tensor index = indices({1, 1, 3, 0, 2, 0}, {2, 3});
  const auto scatter = [index](const std::vector<Variable>& x) { return scatter_add(x[0], 1, index, x[1]); };
  check_gradients("src the shape of index", scatter, {leaf({3, 4}, 90), leaf({2, 3}, 91)});
  check_gradients("src larger than index", scatter, {leaf({3, 4}, 92), leaf({3, 5}, 93)});
  check_gradients("self constant", scatter, {constant(random64({3, 4}, 94)), leaf({2, 3}, 95)});

  // Elements of src beyond index's extent were not added anywhere: their gradient is 0.
  const Variable self = leaf({3, 4}, 96, "self"), src = leaf({3, 4}, 97, "src");
  const Tensor weights = random64({3, 4}, 98);
  sum(mul(scatter_add(self, 1, index, src), constant(weights))).backward();
  check_equal(self.grad(), values(weights));
  const std::vector<double> w = values(weights);
  check_equal(src.grad(), {w[1], w[1], w[3], 0, w[4], w[6], w[4], 0, 0, 0, 0, 0});
}

TEST_CASE("gather_targets gradients, ignored rows get none", "[gradcheck_nn][index]") {
  const Tensor targets = indices({2, -100, 0, 2}, {4});
  check_gradients("ignore_index -100",
                  [targets](const std::vector<Variable>& x) { return gather_targets(x[0], targets); },
                  {leaf({4, 3}, 100)});
  const Variable scores = leaf({4, 3}, 101);
  sum(gather_targets(scores, targets)).backward();
  check_equal(scores.grad(), {0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1});

  // An ignore_index that is also a class: rows targeting it get no gradient at all.
  const Tensor zero_ignored = from_vector<std::int32_t>({0, 1, 2, 0});
  check_gradients(
      "ignore_index 0",
      [zero_ignored](const std::vector<Variable>& x) { return gather_targets(x[0], zero_ignored, 0); },
      {leaf({4, 3}, 102)});
  const Variable v = leaf({4, 3}, 103);
  sum(gather_targets(v, zero_ignored, 0)).backward();
  check_equal(v.grad(), {0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0});
}

// --- losses ------------------------------------------------------------------------------------

namespace {

// log-sum-exp(row) - row[target], per row of logits [N, C]; NaN marks an ignored row.
std::vector<double> naive_cross_entropy(const Tensor& logits, const std::vector<std::int64_t>& targets,
                                        std::int64_t ignore_index) {
  const std::vector<double> x = values(logits);
  const std::int64_t classes = logits.size(1);
  std::vector<double> losses;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] == ignore_index) {
      losses.push_back(std::nan(""));
      continue;
    }
    double total = 0;
    for (std::int64_t c = 0; c < classes; ++c) total += std::exp(x[i * classes + c]);
    losses.push_back(std::log(total) - x[i * classes + targets[i]]);
  }
  return losses;
}

}  // namespace

TEST_CASE("nll_loss and cross_entropy gradients for every reduction", "[gradcheck_nn][loss]") {
  const Tensor targets = indices({1, 3, -100, 0, 3}, {5}), targets_3 = indices({1, 3, 2, 0, 3}, {5});
  for (const Reduction reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
    INFO("reduction " << static_cast<int>(reduction));
    check_gradients("nll_loss",
                    [&](const std::vector<Variable>& x) { return nll_loss(x[0], targets, -100, reduction); },
                    {leaf({5, 4}, 110)});
    check_gradients(
        "cross_entropy",
        [&](const std::vector<Variable>& x) { return cross_entropy(x[0], targets, -100, reduction); },
        {leaf({5, 4}, 111)});
    check_gradients(
        "cross_entropy, ignore_index 3",
        [&](const std::vector<Variable>& x) { return cross_entropy(x[0], targets_3, 3, reduction); },
        {leaf({5, 4}, 112)});
  }
}

TEST_CASE("cross_entropy and nll_loss forward values against the naive formula", "[gradcheck_nn][loss]") {
  const Tensor logits = test::random_tensor({6, 5}, 120, DType::f64, -3.0, 3.0);
  const std::vector<std::int64_t> t = {4, 0, 2, 7, 2, 1};  // row 3 is ignored (ignore_index 7)
  const Tensor targets = indices(t, {6});
  const std::vector<double> losses = naive_cross_entropy(logits, t, 7);
  double total = 0;
  for (const double l : losses) total += std::isnan(l) ? 0 : l;

  const Variable x = constant(logits);
  std::vector<double> per_row = losses;
  per_row[3] = 0;  // ignored rows lose 0
  check_close(cross_entropy(x, targets, 7, Reduction::none).data(), per_row);
  check_close(cross_entropy(x, targets, 7, Reduction::sum).data(), {total});
  check_close(cross_entropy(x, targets, 7, Reduction::mean).data(), {total / 5});
  // nll_loss of log_softmax is the same loss.
  check_close(nll_loss(log_softmax(x, 1), targets, 7).data(), {total / 5});
  // nll_loss takes the log-probabilities as they are: -mean of the picked entries.
  const std::vector<double> v = values(logits);
  check_close(nll_loss(x, targets, 7).data(), {-(v[4] + v[5] + v[12] + v[22] + v[26]) / 5});
}

TEST_CASE(
    "cross_entropy of bf16 and f16 logits: an f32 loss with an f32 copy's bits, its gradient rounded once",
    "[gradcheck_nn][loss]") {
  // Rows longer than a block, an ignored row, and a loss scale no half holds (1/3): a loss rounded to
  // the logits' dtype, or a gradient scale narrowed to it, changes bits.
  const Tensor targets = indices({0, 1030, -100, 5, 5, 77, 3}, {7});
  for (const DType half : {DType::bf16, DType::f16}) {
    const Tensor x = test::random_tensor({7, 1031}, 140, DType::f32, -8.0, 8.0).to(half);
    for (const Reduction reduction : {Reduction::none, Reduction::sum, Reduction::mean}) {
      INFO(dtype_name(half) << ", reduction " << static_cast<int>(reduction));
      const Variable logits(x, true, "logits"), copy(x.to(DType::f32), true, "copy");
      const Variable loss = cross_entropy(logits, targets, -100, reduction);
      const Variable expected = cross_entropy(copy, targets, -100, reduction);
      CHECK(loss.dtype() == DType::f32);
      check_equal(loss.data(), values(expected.data()));
      sum(loss * (1.0 / 3)).backward();
      sum(expected * (1.0 / 3)).backward();
      CHECK(logits.grad().dtype() == half);
      check_equal(logits.grad(), values(copy.grad().to(half)));
    }
  }
}

TEST_CASE("a mean loss over no counted rows is NaN, with zero gradients", "[gradcheck_nn][loss]") {
  const Variable logits = leaf({3, 4}, 130, "logits");
  const Tensor targets = indices({-100, -100, -100}, {3});
  const Variable loss = cross_entropy(logits, targets);
  CHECK(std::isnan(loss.data().item<double>()));
  CHECK(cross_entropy(logits, targets, -100, Reduction::sum).data().item<double>() == 0);
  loss.backward();
  check_equal(logits.grad(), std::vector<double>(12, 0.0));
}

// --- normalisations ------------------------------------------------------------------------------

namespace {

// Each row of `x` (last dim `width`) normalised by a naive loop: rms (layer = false) or
// mean/biased-variance (layer = true), then times weight and plus bias where given.
std::vector<double> naive_norm(const Tensor& x, const std::vector<double>& weight,
                               const std::vector<double>& bias, double eps, bool layer) {
  const std::vector<double> in = values(x);
  const std::size_t width = static_cast<std::size_t>(x.size(-1));
  std::vector<double> out;
  for (std::size_t row = 0; row < in.size() / width; ++row) {
    const double* r = in.data() + row * width;
    double mu = 0;
    if (layer) {
      for (std::size_t i = 0; i < width; ++i) mu += r[i] / static_cast<double>(width);
    }
    double square = 0;
    for (std::size_t i = 0; i < width; ++i) square += (r[i] - mu) * (r[i] - mu) / static_cast<double>(width);
    for (std::size_t i = 0; i < width; ++i) {
      double y = (r[i] - mu) / std::sqrt(square + eps);
      if (!weight.empty()) y *= weight[i];
      if (!bias.empty()) y += bias[i];
      out.push_back(y);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("rms_norm gradients and values", "[gradcheck_nn][norm]") {
  check_gradients("rms_norm", [](const std::vector<Variable>& x) { return rms_norm(x[0], x[1], 1e-6); },
                  {leaf({2, 3, 4}, 140, "x"), leaf({4}, 141, "weight")});
  check_gradients("rms_norm, large eps",
                  [](const std::vector<Variable>& x) { return rms_norm(x[0], x[1], 0.5); },
                  {leaf({3, 5}, 142, "x"), leaf({5}, 143, "weight")});

  const Tensor x = test::random_tensor({3, 2, 6}, 144, DType::f64, -2.0, 2.0);
  const Tensor w = random64({6}, 145);
  check_close(rms_norm(constant(x), constant(w), 1e-5).data(), naive_norm(x, values(w), {}, 1e-5, false));
}

TEST_CASE("rms_norm in f32 (lanes and a tail, several column chunks) matches f64 loops",
          "[gradcheck_nn][norm]") {
  const std::int64_t rows = 600, width = 37;  // 4 whole lanes of 8 and a tail; 3 chunks of 256 rows
  const Tensor x = test::random_tensor({rows, width}, 160, DType::f32, -2.0, 2.0);
  const Tensor w = test::random_tensor({width}, 161, DType::f32, -2.0, 2.0);
  const Tensor g = test::random_tensor({rows, width}, 162, DType::f32, -2.0, 2.0);
  const std::vector<double> vx = values(x), vw = values(w), vg = values(g);
  std::vector<double> out, grad_x, grad_w(width, 0.0);
  for (std::int64_t row = 0; row < rows; ++row) {
    double squares = 0, dot = 0;
    for (std::int64_t e = 0; e < width; ++e) {
      squares += vx[row * width + e] * vx[row * width + e];
      dot += vg[row * width + e] * vw[e] * vx[row * width + e];
    }
    const double r = 1 / std::sqrt(squares / width + 1e-6);
    for (std::int64_t e = 0; e < width; ++e) {
      const double xe = vx[row * width + e], ge = vg[row * width + e];
      out.push_back(xe * r * vw[e]);
      grad_x.push_back(r * ge * vw[e] - xe * r * r * r * dot / width);
      grad_w[e] += ge * xe * r;
    }
  }
  const RmsNormResult forward = rms_norm_forward(x, w, 1e-6);
  check_close(forward.out, out);
  const RmsNormGrads grads = rms_norm_backward(g, x, w, forward.rstd);
  check_close(grads.x, grad_x, {1e-5, 1e-5});
  check_close(grads.weight, grad_w, {1e-4, 1e-5});
}

// add_rms_norm's {sum, out} and gradients against add then rms_norm, through a loss that weighs both
// outputs (the residual stream goes on from the sum): the same bits, in every floating dtype.
void check_add_rms_norm_as_composed(DType dtype, const Shape& shape) {
  INFO(dtype_name(dtype) << " " << shape_str(shape));
  const std::int64_t width = shape.back();
  const auto operand = [&](const Shape& s, std::uint64_t seed) {
    return Variable(test::random_tensor(s, seed, DType::f64, -2.0, 2.0).to(dtype), true);
  };
  const Variable x = operand(shape, 160), y = operand(shape, 161), w = operand({width}, 162);
  const Tensor sum_weights = test::random_tensor(shape, 163).to(dtype),
               out_weights = test::random_tensor(shape, 164).to(dtype);
  const auto loss_of = [&](const Variable& sum_in, const Variable& out_in) {
    return add(sum(mul(sum_in, constant(sum_weights))), sum(mul(out_in, constant(out_weights))));
  };
  const AddRmsNorm fused = add_rms_norm(x, y, w, 1e-5);
  loss_of(fused.sum, fused.out).backward();
  const std::vector<Tensor> fused_grads = {x.grad(), y.grad(), w.grad()};
  for (const Variable& v : {x, y, w}) v.zero_grad();
  const Variable added = add(x, y), normed = rms_norm(added, w, 1e-5);
  loss_of(added, normed).backward();
  CHECK(test::same_bits(fused.sum.data(), added.data()));
  CHECK(test::same_bits(fused.out.data(), normed.data()));
  CHECK(test::same_bits(fused_grads[0], x.grad()));
  CHECK(test::same_bits(fused_grads[1], y.grad()));
  CHECK(test::same_bits(fused_grads[2], w.grad()));
}

TEST_CASE("add_rms_norm has the bits of add then rms_norm, values and gradients", "[gradcheck_nn][norm]") {
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    check_add_rms_norm_as_composed(dtype, {3, 5, 37});   // rows shorter than a vector lane set
    check_add_rms_norm_as_composed(dtype, {2, 1, 300});  // one row per batch entry
  }
  check_gradients("add_rms_norm's out",
                  [](const std::vector<Variable>& v) { return add_rms_norm(v[0], v[1], v[2]).out; },
                  {leaf({2, 3, 4}, 165, "x"), leaf({2, 3, 4}, 166, "y"), leaf({4}, 167, "weight")});
  // A y that broadcasts takes the composition: add (which broadcasts), then rms_norm.
  const Variable x = leaf({2, 3, 4}, 168, "x"), y = leaf({4}, 169, "y"), w = leaf({4}, 170, "weight");
  const AddRmsNorm broadcast = add_rms_norm(x, y, w);
  check_close(broadcast.out.data(), rms_norm(add(x, y), w).data(), {0.0, 0.0});
  const Variable same_shape = leaf({2, 3, 4}, 171, "y");
  call_log::start();
  (void)add_rms_norm(x, same_shape, w);
  const std::vector<call_log::Call> calls = call_log::stop();
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].op == "add_rms_norm");
  CHECK_THROWS_ERROR(add_rms_norm(Variable(), y, w), "add_rms_norm: x and y must be defined");
  CHECK_THROWS_ERROR(add_rms_norm(x, x, leaf({5}, 172)),
                     "add_rms_norm: weight has shape [5] but x of shape [2, 3, 4] needs [4]");
}

TEST_CASE("swiglu gradients and values, fused and composed", "[gradcheck_nn]") {
  check_gradients("swiglu", [](const std::vector<Variable>& x) { return swiglu(x[0], x[1]); },
                  {leaf({3, 7}, 146, "gate"), leaf({3, 7}, 147, "up")});
  // Broadcast operands take the composed path: silu(gate) * up.
  check_gradients("swiglu, broadcast", [](const std::vector<Variable>& x) { return swiglu(x[0], x[1]); },
                  {leaf({3, 7}, 148, "gate"), leaf({7}, 149, "up")});
  const Tensor a = random64({4, 5}, 150), b = random64({4, 5}, 151);
  const std::vector<double> va = values(a), vb = values(b);
  std::vector<double> expected;
  for (std::size_t i = 0; i < va.size(); ++i) expected.push_back(va[i] / (1 + std::exp(-va[i])) * vb[i]);
  check_close(swiglu(constant(a), constant(b)).data(), expected);
  CHECK_THROWS_ERROR(swiglu(Variable(), constant(b)), "swiglu: gate and up must be defined");
}

TEST_CASE("swiglu in f32 is within a few ulp of its f64 formula, at gates beyond exp's range too",
          "[gradcheck_nn][swiglu_f32]") {
  // 9001 elements: blocks of the vectorised sigmoid, the pool's splits and a tail. Most gates lie
  // where the sigmoid is not saturated; the last 500 reach past -87, where exp(-|x|) becomes 0.
  const Tensor gate = cat({test::random_tensor({8501}, 156, DType::f32, -12.0, 12.0),
                           test::random_tensor({500}, 159, DType::f32, -100.0, 100.0)},
                          0);
  const Tensor up = test::random_tensor({9001}, 157, DType::f32, -3.0, 3.0);
  const Tensor grad = test::random_tensor({9001}, 158, DType::f32, -3.0, 3.0);
  const std::vector<double> x = values(gate), b = values(up), d = values(grad);
  std::vector<double> out, grad_gate, grad_up;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double s = 1 / (1 + std::exp(-x[i]));
    out.push_back(x[i] * s * b[i]);
    grad_gate.push_back(d[i] * b[i] * s * (1 + x[i] * (1 - s)));
    grad_up.push_back(d[i] * x[i] * s);
  }
  const test::Tolerance ulps{1e-6, 1e-6};  // atol: grad_gate cancels near x = -1.28
  check_close(swiglu(gate, up), out, ulps);
  const SwigluGrads grads = swiglu_backward(grad, gate, up);
  check_close(grads.gate, grad_gate, ulps);
  check_close(grads.up, grad_up, ulps);
}

TEST_CASE("rotary_embedding reads heads split from [B, T, H * D] where they lie, its output in their layout",
          "[gradcheck_nn][rotary]") {
  for (const DType type : {DType::f32, DType::f64}) {
    // [B, T, H * D] split into heads [B, H, T, D]: a transposed view; and every other element of a
    // row, whose last dim is not in unit stride (read from a contiguous copy).
    const Tensor heads = test::random_tensor({2, 5, 3 * 8}, 160, type).reshape({2, 5, 3, 8}).transpose(1, 2);
    const Tensor spaced = test::random_tensor({2, 3, 5, 16}, 161, type).slice(-1, 0, 16, 2);
    const Tensor cos = test::random_tensor({5, 8}, 162, type), sin = test::random_tensor({5, 8}, 163, type);
    for (const bool transpose : {false, true}) {
      INFO(dtype_name(type) << (transpose ? ", transposed" : ""));
      const Tensor rotated = rotary(heads, cos, sin, transpose);
      CHECK(values(rotated) == values(rotary(heads.contiguous(), cos, sin, transpose)));
      CHECK(rotated.strides() == heads.strides());
      CHECK(values(rotary(spaced, cos, sin, transpose)) ==
            values(rotary(spaced.contiguous(), cos, sin, transpose)));
    }
  }
}

TEST_CASE("the fused rms_norm, swiglu and rotary_embedding match their composed forms in bf16",
          "[gradcheck_nn][norm]") {
  const Tensor x = test::random_tensor({2, 3, 8}, 152).to(DType::bf16);
  const Tensor w = test::random_tensor({8}, 153).to(DType::bf16);
  const test::Tolerance bf16{2e-2, 2e-2};
  const Tensor x32 = x.to(DType::f32);
  const Tensor composed_norm =
      mul(mul(x32, rsqrt(add(mean(mul(x32, x32), {-1}, true), 1e-6))), w.to(DType::f32));
  test::check_close(rms_norm(constant(x), constant(w), 1e-6).data().to(DType::f64),
                    composed_norm.to(DType::f64), bf16);
  // A weight of another dtype takes the composed path, which promotes.
  CHECK(rms_norm(constant(x), constant(w.to(DType::f32)), 1e-6).dtype() == DType::f32);
  test::check_close(swiglu(constant(x), constant(x * 0.5)).data().to(DType::f64),
                    mul(silu(constant(x)), constant(x * 0.5)).data().to(DType::f64), bf16);
  const Tensor cos = test::random_tensor({3, 8}, 154).to(DType::bf16),
               sin = test::random_tensor({3, 8}, 155).to(DType::bf16);
  const Tensor rotated = cat({neg(x.narrow(-1, 4, 4)), x.narrow(-1, 0, 4)}, -1);
  test::check_close(rotary_embedding(constant(x), cos, sin).data().to(DType::f64),
                    add(mul(x, cos), mul(rotated, sin)).to(DType::f64), bf16);
  CHECK_THROWS_ERROR(rotary(x, cos.to(DType::f32), sin),
                     "rotary_embedding: cos is f32 but the input is bf16");
  CHECK_THROWS_ERROR(rms_norm_forward(x, ones({8}), 1e-6), "rms_norm: weight is f32 but the input is bf16");
  CHECK_THROWS_ERROR(swiglu(x, x.narrow(-1, 0, 4)),
                     "swiglu: gate [2, 3, 8] and up [2, 3, 4] differ in shape");
}

TEST_CASE("the fused ops refuse operands that do not fit, naming them", "[gradcheck_nn][errors]") {
  const Tensor x = zeros({2, 3, 8}), w = zeros({8}), rstd = zeros({2, 3});
  CHECK_THROWS_ERROR(rms_norm_forward(x, zeros({4}), 1e-6),
                     "rms_norm: weight [4] must be [D] for x [2, 3, 8]");
  CHECK_THROWS_ERROR(rms_norm_forward(zeros({2, 8}, dtype(DType::i64)), w, 1e-6),
                     "rms_norm: needs a floating dtype, got i64");
  CHECK_THROWS_ERROR(add_rms_norm_forward(x, zeros({3, 8}), w, 1e-6),
                     "add_rms_norm: x [2, 3, 8] and y [3, 8] differ in shape (add them first to broadcast)");
  CHECK_THROWS_ERROR(add_rms_norm_forward(x, zeros({2, 3, 8}, dtype(DType::f64)), w, 1e-6),
                     "add_rms_norm: y is f64 but the input is f32");
  CHECK_THROWS_ERROR(add_rms_norm_forward(x, Tensor(), w, 1e-6), "add_rms_norm: y tensor is undefined");
  CHECK_THROWS_ERROR(add_rms_norm_forward(x, x, zeros({4}), 1e-6),
                     "add_rms_norm: weight [4] must be [D] for x [2, 3, 8]");
  CHECK_THROWS_ERROR(rms_norm_backward(zeros({2, 3, 4}), x, w, rstd),
                     "rms_norm_backward: grad_out [2, 3, 4], x [2, 3, 8] and weight [8] do not match");
  CHECK_THROWS_ERROR(swiglu_backward(zeros({2, 3, 4}), x, x),
                     "swiglu_backward: grad_out [2, 3, 4], gate [2, 3, 8] and up [2, 3, 8] differ in shape");
  CHECK_THROWS_ERROR(swiglu(x, Tensor()), "swiglu: up tensor is undefined");
  CHECK_THROWS_ERROR(rotary(zeros({2, 3, 7}), zeros({3, 7}), zeros({3, 7})),
                     "rotary_embedding: x must be [..., T, D] with D even, got [2, 3, 7]");
  CHECK_THROWS_ERROR(rotary(x, zeros({2, 8}), zeros({3, 8})),
                     "rotary_embedding: cos [2, 8] and sin [3, 8] must be [3, 8] for x [2, 3, 8]");
  const Tensor logits = zeros({4, 5}), targets = from_vector<std::int64_t>({0, 1, 2, 3});
  CHECK_THROWS_ERROR(cross_entropy_forward(zeros({4, 5}, dtype(DType::i32)), targets),
                     "cross_entropy: needs a floating dtype, got i32");
  CHECK_THROWS_ERROR(cross_entropy_forward(logits, from_vector<std::int64_t>({0, 1})),
                     "cross_entropy: targets must be 1-D [N] = [4] for logits [4, 5], got [2]");
  const CrossEntropyResult forward = cross_entropy_forward(logits, targets);
  CHECK_THROWS_ERROR(cross_entropy_backward(zeros({3}), logits, targets, -100, forward.logsumexp),
                     "cross_entropy_backward: grad_losses [3] and logsumexp [4] must be [N] = [4]");
  CHECK_THROWS_ERROR(
      cross_entropy_backward(zeros({4}), logits, targets, -100, forward.logsumexp.to(DType::f64)),
      "cross_entropy_backward: logsumexp must be f32 for f32 logits, got f64");
}

TEST_CASE("layer_norm gradients and values, weight and bias optional", "[gradcheck_nn][norm]") {
  check_gradients("layer_norm", [](const std::vector<Variable>& x) { return layer_norm(x[0], x[1], x[2]); },
                  {leaf({2, 3, 4}, 150, "x"), leaf({4}, 151, "weight"), leaf({4}, 152, "bias")});
  check_gradients("layer_norm without affine",
                  [](const std::vector<Variable>& x) { return layer_norm(x[0], {}, {}); },
                  {leaf({3, 5}, 153, "x")});
  check_gradients("layer_norm, weight only, eps 0.1",
                  [](const std::vector<Variable>& x) { return layer_norm(x[0], x[1], {}, 0.1); },
                  {leaf({3, 5}, 154, "x"), leaf({5}, 155, "weight")});

  const Tensor x = test::random_tensor({4, 7}, 156, DType::f64, -2.0, 3.0);
  const Tensor w = random64({7}, 157), b = random64({7}, 158);
  check_close(layer_norm(constant(x), constant(w), constant(b)).data(),
              naive_norm(x, values(w), values(b), 1e-5, true));
  check_close(layer_norm(constant(x), {}, {}, 1e-3).data(), naive_norm(x, {}, {}, 1e-3, true));
  check_close(layer_norm(constant(x), {}, constant(b)).data(), naive_norm(x, {}, values(b), 1e-5, true));
}

// --- attention ----------------------------------------------------------------------------------

namespace {

// out[b, h, t] = sum_s p[s] v[b, h / G, s] with p = softmax over s of
// scale * q[b, h, t] . k[b, h / G, s] + mask(h, t, s), keys after t skipped when causal.
// `mask` is [H, T, S] flattened (empty: none).
std::vector<double> naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    const std::vector<double>& mask, double scale) {
  const std::int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const std::int64_t Hkv = k.size(1), S = k.size(2), G = H / Hkv;
  const std::vector<double> qv = values(q), kv = values(k), vv = values(v);
  std::vector<double> out;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t j = h / G;
      for (std::int64_t t = 0; t < T; ++t) {
        std::vector<double> logits;
        for (std::int64_t s = 0; s < S; ++s) {
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            dot += qv[((b * H + h) * T + t) * D + d] * kv[((b * Hkv + j) * S + s) * D + d];
          }
          double logit = scale * dot + (mask.empty() ? 0.0 : mask[(h * T + t) * S + s]);
          if (causal && s > t) logit = -inf;
          logits.push_back(logit);
        }
        double top = -inf, total = 0;
        for (const double l : logits) top = std::max(top, l);
        for (const double l : logits) total += std::exp(l - top);
        for (std::int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (std::int64_t s = 0; s < S; ++s) {
            acc += std::exp(logits[s] - top) / total * vv[((b * Hkv + j) * S + s) * D + d];
          }
          out.push_back(acc);
        }
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("attention gradients: causal, additive mask, grouped-query", "[gradcheck_nn][attention]") {
  const auto attend = [](AttentionOptions options) {
    return [options](const std::vector<Variable>& x) {
      return scaled_dot_product_attention(x[0], x[1], x[2], options);
    };
  };
  check_gradients("causal, T = S", attend({.causal = true}),
                  {leaf({1, 2, 3, 2}, 160, "q"), leaf({1, 2, 3, 2}, 161, "k"), leaf({1, 2, 3, 2}, 162, "v")});
  check_gradients("causal, T < S", attend({.causal = true}),
                  {leaf({2, 1, 2, 3}, 163, "q"), leaf({2, 1, 4, 3}, 164, "k"), leaf({2, 1, 4, 3}, 165, "v")});
  check_gradients("additive mask [1, H, 1, S]", attend({.mask = random64({1, 2, 1, 4}, 166)}),
                  {leaf({1, 2, 3, 2}, 167, "q"), leaf({1, 2, 4, 2}, 168, "k"), leaf({1, 2, 4, 2}, 169, "v")});
  check_gradients("GQA H = 4, Hkv = 2", attend({}),
                  {leaf({1, 4, 2, 2}, 170, "q"), leaf({1, 2, 3, 2}, 171, "k"), leaf({1, 2, 3, 2}, 172, "v")});
  check_gradients("GQA, causal, mask, scale",
                  attend({.causal = true, .mask = random64({3, 3}, 173), .scale = 0.8}),
                  {leaf({1, 4, 3, 2}, 174, "q"), leaf({1, 2, 3, 2}, 175, "k"), leaf({1, 2, 3, 2}, 176, "v")});
}

TEST_CASE("attention forward values against a naive loop", "[gradcheck_nn][attention]") {
  const Tensor q = random64({2, 4, 3, 5}, 180), k = random64({2, 2, 6, 5}, 181),
               v = random64({2, 2, 6, 5}, 182);
  const Variable qv = constant(q), kv = constant(k), vv = constant(v);
  const double scale = 1 / std::sqrt(5.0);
  check_close(scaled_dot_product_attention(qv, kv, vv).data(), naive_attention(q, k, v, false, {}, scale));
  check_close(scaled_dot_product_attention(qv, kv, vv, {.causal = true}).data(),
              naive_attention(q, k, v, true, {}, scale));
  // A mask [H, 1, S] broadcast over B and T, with a custom scale.
  const Tensor mask = test::random_tensor({4, 1, 6}, 183, DType::f64, -2.0, 2.0);
  std::vector<double> full_mask;
  for (std::int64_t h = 0; h < 4; ++h) {
    for (std::int64_t t = 0; t < 3; ++t) {
      for (std::int64_t s = 0; s < 6; ++s) full_mask.push_back(values(mask)[h * 6 + s]);
    }
  }
  check_close(scaled_dot_product_attention(qv, kv, vv, {.causal = true, .mask = mask, .scale = 0.3}).data(),
              naive_attention(q, k, v, true, full_mask, 0.3));
  // More queries than keys, top-left aligned: query t sees keys 0..min(t, S - 1).
  const Tensor q_long = random64({1, 2, 5, 3}, 184), k_short = random64({1, 2, 3, 3}, 185),
               v_short = random64({1, 2, 3, 3}, 186);
  check_close(
      scaled_dot_product_attention(constant(q_long), constant(k_short), constant(v_short), {.causal = true})
          .data(),
      naive_attention(q_long, k_short, v_short, true, {}, 1 / std::sqrt(3.0)));
  // A causal first query sees only key 0: its output is v[..., 0, :].
  const Tensor first = scaled_dot_product_attention(qv, kv, vv, {.causal = true}).data().select(2, 0);
  check_close(first.select(1, 0), v.select(1, 0).select(1, 0));
}

// --- errors ------------------------------------------------------------------------------------

TEST_CASE("nll_loss and cross_entropy reject bad inputs", "[gradcheck_nn][errors]") {
  const Variable log_probs = constant(zeros({2, 3}, dtype(DType::f64)));
  const Tensor targets = indices({0, 2}, {2});
  CHECK_THROWS_ERROR(nll_loss(Variable(), targets), "nll_loss: log_probs is undefined");
  CHECK_THROWS_ERROR(nll_loss(log_probs, Tensor()), "nll_loss: targets is undefined");
  CHECK_THROWS_ERROR(nll_loss(constant(zeros({3})), targets),
                     "nll_loss: log_probs must be 2-D [N, C], got shape [3]");
  CHECK_THROWS_ERROR(
      nll_loss(log_probs, indices({0, 2}, {2, 1})),
      "nll_loss: targets must be 1-D [N] = [2] for log_probs of shape [2, 3], got shape [2, 1]");
  CHECK_THROWS_ERROR(nll_loss(log_probs, indices({0, 2, 1}, {3})),
                     "nll_loss: targets must be 1-D [N] = [2] for log_probs of shape [2, 3], got shape [3]");
  CHECK_THROWS_ERROR(nll_loss(log_probs, from_vector<double>({0, 2})),
                     "nll_loss: targets must be class indices (i64 or i32), got f64");
  CHECK_THROWS_ERROR(nll_loss(log_probs, targets, -100, static_cast<Reduction>(7)),
                     "nll_loss: unknown reduction 7");
  CHECK_THROWS_ERROR(
      nll_loss(log_probs, indices({0, 3}, {2})),
      "gather_targets: index 3 is out of range for the classes (ignore_index aside) of size 3");

  CHECK_THROWS_ERROR(cross_entropy(Variable(), targets), "cross_entropy: logits is undefined");
  CHECK_THROWS_ERROR(cross_entropy(log_probs, Tensor()), "cross_entropy: targets is undefined");
  CHECK_THROWS_ERROR(cross_entropy(constant(zeros({2, 3, 1})), targets),
                     "cross_entropy: logits must be 2-D [N, C], got shape [2, 3, 1]");
  CHECK_THROWS_ERROR(
      cross_entropy(log_probs, indices({0}, {1})),
      "cross_entropy: targets must be 1-D [N] = [2] for logits of shape [2, 3], got shape [1]");
  CHECK_THROWS_ERROR(cross_entropy(log_probs, from_vector<float>({0, 2})),
                     "cross_entropy: targets must be class indices (i64 or i32), got f32");
  CHECK_THROWS_ERROR(cross_entropy(log_probs, targets, -100, static_cast<Reduction>(9)),
                     "cross_entropy: unknown reduction 9");
  CHECK_THROWS_ERROR(cross_entropy(log_probs, indices({0, 3}, {2})),
                     "cross_entropy: index 3 is out of range for the classes (ignore_index aside) of size 3");
  CHECK_THROWS_ERROR(
      cross_entropy(log_probs, indices({-1, 0}, {2}), 2),
      "cross_entropy: index -1 is out of range for the classes (ignore_index aside) of size 3");
}

TEST_CASE("the fused cross_entropy gives log_softmax + nll_loss's values and gradients, halves included",
          "[gradcheck_nn][loss]") {
  const Tensor targets = indices({2, -100, 0, 6, 6, 1}, {6});
  for (const DType type : {DType::f32, DType::bf16, DType::f16}) {
    INFO(dtype_name(type));
    // A row of large logits too: the shift by the largest keeps exp finite.
    Tensor raw = test::random_tensor({6, 7}, 131).to(type);
    raw.narrow(0, 4, 1).fill_(60.0);
    const Variable fused_logits(raw.clone(), true), composed_logits(raw.clone(), true);
    const Variable fused = cross_entropy(fused_logits, targets, -100, Reduction::sum);
    const Variable composed = nll_loss(log_softmax(composed_logits, 1), targets, -100, Reduction::sum);
    const test::Tolerance tolerance =
        type == DType::f32 ? test::Tolerance{1e-6, 1e-5} : test::Tolerance{2e-2, 2e-2};
    test::check_close(fused.data().to(DType::f64), composed.data().to(DType::f64), tolerance);
    fused.backward();
    composed.backward();
    test::check_close(fused_logits.grad().to(DType::f64), composed_logits.grad().to(DType::f64), tolerance);
    check_equal(fused_logits.grad().narrow(0, 1, 1).to(DType::f64),
                std::vector<double>(7, 0.0));  // ignored row
  }
}

TEST_CASE("rms_norm and layer_norm reject bad shapes", "[gradcheck_nn][errors]") {
  const Variable x = constant(zeros({2, 4}));
  CHECK_THROWS_ERROR(rms_norm(x, constant(ones({5}))),
                     "rms_norm: weight has shape [5] but x of shape [2, 4] needs [4]");
  CHECK_THROWS_ERROR(rms_norm(x, constant(ones({1, 4}))),
                     "rms_norm: weight has shape [1, 4] but x of shape [2, 4] needs [4]");
  CHECK_THROWS_ERROR(rms_norm(Variable(), constant(ones({4}))), "rms_norm: x is undefined");
  CHECK_THROWS_ERROR(rms_norm(x, Variable()), "rms_norm: weight is undefined");
  CHECK_THROWS_ERROR(rms_norm(constant(scalar_tensor(1.0)), constant(ones({1}))),
                     "rms_norm: x must have at least 1 dimension, got shape []");

  CHECK_THROWS_ERROR(layer_norm(x, constant(ones({3})), {}),
                     "layer_norm: weight has shape [3] but x of shape [2, 4] needs [4]");
  CHECK_THROWS_ERROR(layer_norm(x, {}, constant(ones({2}))),
                     "layer_norm: bias has shape [2] but x of shape [2, 4] needs [4]");
  CHECK_THROWS_ERROR(layer_norm(Variable(), {}, {}), "layer_norm: x is undefined");
  CHECK_THROWS_ERROR(layer_norm(constant(scalar_tensor(1.0)), {}, {}),
                     "layer_norm: x must have at least 1 dimension, got shape []");
}

TEST_CASE("scaled_dot_product_attention rejects mismatched shapes", "[gradcheck_nn][errors]") {
  const auto var = [](const Shape& shape, DType type = DType::f32) {
    return constant(zeros(shape, dtype(type)));
  };
  const Variable q = var({2, 4, 3, 8}), k = var({2, 2, 5, 8}), v = var({2, 2, 5, 8});
  const char* prefix = "scaled_dot_product_attention: ";
  const auto message = [prefix](const std::string& rest) { return std::string(prefix) + rest; };
  CHECK_THROWS_ERROR(scaled_dot_product_attention(var({4, 3, 8}), k, v),
                     message("q [B, H, T, D] must be 4-D, got shape [4, 3, 8]"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, var({2, 2, 5, 8, 1}), v),
                     message("k [B, Hkv, S, D] must be 4-D, got shape [2, 2, 5, 8, 1]"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, k, var({5, 8})),
                     message("v [B, Hkv, S, D] must be 4-D, got shape [5, 8]"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, Variable(), v),
                     message("k [B, Hkv, S, D] is undefined"));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, var({2, 2, 5, 6}), v),
      message("q and k have different head dims (8 != 6; q [2, 4, 3, 8], k [2, 2, 5, 6], v [2, 2, 5, 8])"));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, var({2, 3, 5, 8}), var({2, 3, 5, 8})),
      message("4 query heads are not a multiple of 3 key/value heads (q [2, 4, 3, 8], k [2, 3, 5, 8], "
              "v [2, 3, 5, 8])"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, var({1, 2, 5, 8}), v),
                     message("batch sizes differ (q [2, 4, 3, 8], k [1, 2, 5, 8], v [2, 2, 5, 8])"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, k, var({3, 2, 5, 8})),
                     message("batch sizes differ (q [2, 4, 3, 8], k [2, 2, 5, 8], v [3, 2, 5, 8])"));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, var({2, 2, 4, 8})),
      message("k and v have different lengths (5 != 4; q [2, 4, 3, 8], k [2, 2, 5, 8], v [2, 2, 4, 8])"));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, var({2, 1, 5, 8})),
      message("k and v have different numbers of heads (2 != 1; q [2, 4, 3, 8], k [2, 2, 5, 8], "
              "v [2, 1, 5, 8])"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, k, var({2, 2, 5, 8}, DType::f64)),
                     message("dtypes differ (f32, f32 and f64)"));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, v, {.mask = zeros({3, 4})}),
      message("mask of shape [3, 4] does not broadcast to the scores [B, H, T, S] = [2, 4, 3, 5]"));
  CHECK_THROWS_ERROR(
      scaled_dot_product_attention(q, k, v, {.mask = zeros({1, 2, 4, 3, 5})}),
      message("mask of shape [1, 2, 4, 3, 5] does not broadcast to the scores [B, H, T, S] = [2, 4, 3, 5]"));
  CHECK_THROWS_ERROR(scaled_dot_product_attention(q, k, v, {.mask = zeros({3, 5}, dtype(DType::boolean))}),
                     message("mask must be floating (it is added to the scores), got bool"));
  // A mask that does broadcast is accepted.
  CHECK(scaled_dot_product_attention(q, k, v, {.mask = zeros({2, 1, 3, 1})}).shape() == Shape{2, 4, 3, 8});
}

TEST_CASE("the differentiable ops pass on the core ops' shape errors", "[gradcheck_nn][errors]") {
  const Variable a = leaf({2, 3}, 190, "a");
  CHECK_THROWS_ERROR(matmul(a, leaf({2, 3}, 191)),
                     "matmul: shapes [2, 3] and [2, 3] cannot be multiplied (3 != 2)");
  CHECK_THROWS_ERROR(softmax(a, 2), "softmax: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(conv2d(a, leaf({1, 1, 1, 1}, 192)),
                     "conv2d: input [N, C, H, W] must be 4-D, got shape [2, 3]");
  CHECK_THROWS_ERROR(embedding(a, indices({2}, {1})),
                     "embedding: index 2 is out of range for the embedding table of size 2");
  CHECK_THROWS_ERROR(gather_targets(a, indices({0}, {1})),
                     "gather_targets: values [2, 3] and targets [1] disagree on the batch size (2 != 1)");
}
