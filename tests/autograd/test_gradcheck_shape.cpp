// tests/autograd/test_gradcheck_shape.cpp: view and join backwards, view storage sharing, and their errors.
#include <functional>
#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "tests/check.h"

using namespace shardlab;
using test::check_close;
using test::check_equal;
using test::random_tensor;
using test::values;

namespace {

using ViewFn = std::function<Variable(const Variable&)>;

// gradcheck with the torch.autograd.gradcheck defaults (eps 1e-6, atol 1e-5, rtol 1e-3); on a
// failure the report names the first wrong Jacobian entries.
void check_gradients(const GradcheckFn& fn, const std::vector<Variable>& inputs) {
  const GradcheckResult result = gradcheck(fn, inputs);
  INFO(result.report);
  CHECK(result.ok);
}

void check_gradients(const ViewFn& fn, const Variable& input) {
  check_gradients([&fn](const std::vector<Variable>& x) { return fn(x[0]); }, {input});
}

// An f64 leaf in [-1, 1) with a contiguous tensor.
Variable leaf(const Shape& shape, std::uint64_t seed) {
  return Variable(random_tensor(shape, seed, DType::f64), true);
}

// An f64 leaf in [-1, 1) whose tensor is a non-contiguous view (test::random_strided).
Variable strided_leaf(const Shape& shape, std::uint64_t seed) {
  const Tensor t = test::random_strided(shape, seed, DType::f64);
  REQUIRE_FALSE(t.is_contiguous());
  return Variable(t, true);
}

// A non-contiguous [3, 1, 4]: a transposed [4, 3] with a size-1 dim inserted.
Variable strided_with_unit_dim(std::uint64_t seed) {
  const Tensor t = random_tensor({4, 3}, seed, DType::f64).transpose(0, 1).unsqueeze(1);
  REQUIRE_FALSE(t.is_contiguous());
  return Variable(t, true);
}

// Whether two tensors use the same bytes.
bool shares_storage(const Tensor& a, const Tensor& b) { return a.storage() == b.storage(); }

// 0, 1, 2, ... as f64 in `shape`: a seed gradient whose every element can be told apart.
Tensor counting(const Shape& shape) { return arange(shape_numel(shape), dtype(DType::f64)).reshape(shape); }

}  // namespace

TEST_CASE("gradcheck: reshape and flatten", "[gradcheck][shape]") {
  for (const Variable& x : {strided_leaf({2, 3, 4}, 1), leaf({2, 3, 4}, 2)}) {
    INFO("input contiguous: " << x.data().is_contiguous());
    check_gradients([](const Variable& v) { return reshape(v, {4, 6}); }, x);
    check_gradients([](const Variable& v) { return reshape(v, {-1}); }, x);
    check_gradients([](const Variable& v) { return reshape(v, {3, -1, 2, 1}); }, x);
    check_gradients([](const Variable& v) { return flatten(v); }, x);
    check_gradients([](const Variable& v) { return flatten(v, 1); }, x);
    check_gradients([](const Variable& v) { return flatten(v, 0, 1); }, x);
    check_gradients([](const Variable& v) { return flatten(v, -2, -1); }, x);
  }
  const Variable scalar = leaf({}, 3);
  check_gradients([](const Variable& v) { return reshape(v, {1, 1}); }, scalar);
  check_gradients([](const Variable& v) { return flatten(v); }, scalar);
}

TEST_CASE("gradcheck: squeeze, unsqueeze and contiguous", "[gradcheck][shape]") {
  const Variable x = strided_with_unit_dim(1);  // [3, 1, 4]
  check_gradients([](const Variable& v) { return squeeze(v, 1); }, x);
  check_gradients([](const Variable& v) { return squeeze(v, -2); }, x);
  check_gradients([](const Variable& v) { return squeeze(v, 0); }, x);  // size 3: unchanged
  CHECK(squeeze(x, 1).shape() == Shape{3, 4});
  CHECK(squeeze(x, 0).shape() == Shape{3, 1, 4});

  const Variable y = strided_leaf({3, 5}, 2);
  check_gradients([](const Variable& v) { return unsqueeze(v, 0); }, y);
  check_gradients([](const Variable& v) { return unsqueeze(v, 1); }, y);
  check_gradients([](const Variable& v) { return unsqueeze(v, -1); }, y);
  check_gradients([](const Variable& v) { return unsqueeze(v, 0); }, leaf({}, 3));
  CHECK(unsqueeze(y, -1).shape() == Shape{3, 5, 1});

  check_gradients([](const Variable& v) { return contiguous(v); }, y);
  check_gradients([](const Variable& v) { return contiguous(v); }, leaf({7}, 4));
  const Variable c = contiguous(y);
  CHECK(c.data().is_contiguous());
  check_equal(c.data(), values(y.data()));
}

TEST_CASE("gradcheck: permute and transpose", "[gradcheck][shape]") {
  for (const Variable& x : {strided_leaf({2, 3, 4}, 1), leaf({2, 3, 4}, 2)}) {
    INFO("input contiguous: " << x.data().is_contiguous());
    check_gradients([](const Variable& v) { return permute(v, {2, 0, 1}); }, x);
    check_gradients([](const Variable& v) { return permute(v, {1, 2, 0}); }, x);
    check_gradients([](const Variable& v) { return permute(v, {-1, -3, -2}); }, x);
    check_gradients([](const Variable& v) { return permute(v, {0, 1, 2}); }, x);
    check_gradients([](const Variable& v) { return transpose(v, 0, 2); }, x);
    check_gradients([](const Variable& v) { return transpose(v, -1, 0); }, x);
    check_gradients([](const Variable& v) { return transpose(v, 1, 1); }, x);
  }
  // The inverse permutation, by hand: the gradient of element [i, j, k] of x is seed[k, i, j].
  const Variable x = leaf({2, 3, 4}, 3);
  permute(x, {2, 0, 1}).backward(counting({4, 2, 3}));
  std::vector<double> expected;
  for (std::int64_t i = 0; i < 2; ++i) {
    for (std::int64_t j = 0; j < 3; ++j) {
      for (std::int64_t k = 0; k < 4; ++k) expected.push_back(static_cast<double>(k * 6 + i * 3 + j));
    }
  }
  check_equal(x.grad(), expected);
}

TEST_CASE("gradcheck: narrow, slice with a step, select with a negative index", "[gradcheck][shape]") {
  for (const Variable& x : {strided_leaf({5, 6}, 1), leaf({5, 6}, 2)}) {
    INFO("input contiguous: " << x.data().is_contiguous());
    check_gradients([](const Variable& v) { return narrow(v, 0, 1, 3); }, x);
    check_gradients([](const Variable& v) { return narrow(v, 1, -4, 2); }, x);
    check_gradients([](const Variable& v) { return narrow(v, -1, 0, 6); }, x);
    check_gradients([](const Variable& v) { return slice(v, 1, 1, 6, 2); }, x);
    check_gradients([](const Variable& v) { return slice(v, 0, -4, 100, 3); }, x);
    check_gradients([](const Variable& v) { return slice(v, -1, 0, 5); }, x);
    check_gradients([](const Variable& v) { return select(v, 0, -1); }, x);
    check_gradients([](const Variable& v) { return select(v, 1, -6); }, x);
    check_gradients([](const Variable& v) { return select(v, -1, 2); }, x);
    // Views of views: each backward puts its gradient where its elements came from.
    check_gradients([](const Variable& v) { return select(slice(transpose(v, 0, 1), 0, 1, 6, 2), 1, -2); },
                    x);
  }
  // By hand: slice(1, 1, 6, 2) of [2, 6] picks columns 1, 3, 5.
  const Variable x = leaf({2, 6}, 3);
  slice(x, 1, 1, 6, 2).backward(counting({2, 3}) + 1.0);
  check_equal(x.grad(), {0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6});
  x.zero_grad();
  select(x, 1, -2).backward(from_vector<double>({7, 8}));
  check_equal(x.grad(), {0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 8, 0});
}

TEST_CASE("gradcheck: expand sums the gradient over the broadcast dims", "[gradcheck][shape]") {
  const Variable x = strided_with_unit_dim(1);  // [3, 1, 4]
  check_gradients([](const Variable& v) { return expand(v, {2, 3, 5, 4}); }, x);
  check_gradients([](const Variable& v) { return expand(v, {2, -1, 5, -1}); }, x);
  check_gradients([](const Variable& v) { return expand(v, {3, 1, 4}); }, x);
  check_gradients([](const Variable& v) { return expand(v, {3, 2}); }, leaf({}, 2));

  // By hand: x [3, 1] expanded to [2, 3, 4]; x[i] collects seed[a, i, k] over a and k.
  const Variable y = leaf({3, 1}, 3);
  expand(y, {2, 3, 4}).backward(counting({2, 3, 4}));
  std::vector<double> expected(3, 0.0);
  for (std::int64_t a = 0; a < 2; ++a) {
    for (std::int64_t i = 0; i < 3; ++i) {
      for (std::int64_t k = 0; k < 4; ++k) expected[i] += static_cast<double>(a * 12 + i * 4 + k);
    }
  }
  check_equal(y.grad(), expected);
}

TEST_CASE("gradcheck: triu and tril", "[gradcheck][shape]") {
  const Variable x = strided_leaf({2, 3, 4}, 1);
  for (const std::int64_t diagonal : {0, 1, -1, 5, -5}) {
    INFO("diagonal " << diagonal);
    check_gradients([diagonal](const Variable& v) { return triu(v, diagonal); }, x);
    check_gradients([diagonal](const Variable& v) { return tril(v, diagonal); }, x);
  }
  // By hand: the gradient keeps the same triangle.
  const Variable y = leaf({3, 3}, 2);
  triu(y, 1).backward(ones({3, 3}, dtype(DType::f64)));
  check_equal(y.grad(), {0, 1, 1, 0, 0, 1, 0, 0, 0});
  y.zero_grad();
  tril(y, -1).backward(ones({3, 3}, dtype(DType::f64)));
  check_equal(y.grad(), {0, 0, 0, 1, 0, 0, 1, 1, 0});
}

TEST_CASE("gradcheck: cat of three inputs, one a constant", "[gradcheck][shape]") {
  const auto cat_along = [](std::int64_t dim) {
    return [dim](const std::vector<Variable>& xs) { return cat(xs, dim); };
  };
  // gradcheck perturbs only the inputs that require grad; the constant is still concatenated.
  check_gradients(cat_along(0),
                  {strided_leaf({2, 3}, 1), constant(random_tensor({1, 3}, 2, DType::f64)), leaf({4, 3}, 3)});
  check_gradients(cat_along(1),
                  {strided_leaf({3, 2}, 4), constant(random_tensor({3, 1}, 5, DType::f64)), leaf({3, 4}, 6)});
  check_gradients(cat_along(-1), {leaf({2, 2}, 7), strided_leaf({2, 3}, 8), leaf({2, 1}, 9)});
  check_gradients(cat_along(0), {strided_leaf({2, 3}, 10)});

  // By hand, with the forward: each input gets its own slice of the seed; the constant none.
  const Variable a = leaf({2, 3}, 11), c = leaf({2, 1}, 13);
  const Variable b = constant(random_tensor({2, 2}, 12, DType::f64));
  const Variable y = cat({a, b, c}, 1);
  REQUIRE(y.shape() == Shape{2, 6});
  const std::vector<double> av = values(a.data()), bv = values(b.data()), cv = values(c.data());
  check_equal(y.data(), {av[0], av[1], av[2], bv[0], bv[1], cv[0], av[3], av[4], av[5], bv[2], bv[3], cv[1]});
  y.backward(counting({2, 6}));
  check_equal(a.grad(), {0, 1, 2, 6, 7, 8});
  check_equal(c.grad(), {5, 11});
  CHECK_FALSE(b.grad().defined());
}

TEST_CASE("gradcheck: stack along every dim", "[gradcheck][shape]") {
  const std::vector<Variable> xs = {strided_leaf({2, 3}, 1), constant(random_tensor({2, 3}, 2, DType::f64)),
                                    leaf({2, 3}, 3)};
  for (const std::int64_t dim : {0, 1, 2, -1, -3}) {
    INFO("dim " << dim);
    check_gradients([dim](const std::vector<Variable>& v) { return stack(v, dim); }, xs);
    // Forward: slice i along the new dim is input i.
    const Variable y = stack(xs, dim);
    REQUIRE(y.dim() == 3);
    const std::int64_t d = dim < 0 ? dim + 3 : dim;
    REQUIRE(y.size(d) == 3);
    for (std::int64_t i = 0; i < 3; ++i) check_equal(y.data().select(d, i), values(xs[i].data()));
  }
}

TEST_CASE("split and chunk: views along a dim, the last piece smaller", "[gradcheck][shape]") {
  const Variable x = strided_leaf({5, 3}, 1);
  const std::vector<Variable> pieces = split(x, 2, 0);
  REQUIRE(pieces.size() == 3);
  const std::vector<double> xv = values(x.data());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const std::int64_t rows = i < 2 ? 2 : 1;
    CHECK(pieces[i].shape() == Shape{rows, 3});
    CHECK(shares_storage(pieces[i].data(), x.data()));
    const auto first = xv.begin() + static_cast<std::ptrdiff_t>(i * 6);
    check_equal(pieces[i].data(), std::vector<double>(first, first + rows * 3));
  }
  // Pieces combined non-trivially: products across pieces, the last one broadcast.
  check_gradients(
      [](const std::vector<Variable>& v) {
        const std::vector<Variable> p = split(v[0], 2, 0);
        return mul(mul(p[0], p[1]), p[2]);
      },
      {x});
  check_gradients(
      [](const std::vector<Variable>& v) {
        const std::vector<Variable> p = split(v[0], 2, -1);  // [3, 2], [3, 2], [3, 1]
        return cat({mul(p[0], p[1]), exp(p[2])}, 1);
      },
      {strided_leaf({3, 5}, 2)});

  const Variable y = leaf({7, 4}, 3);
  const std::vector<Variable> chunks = chunk(y, 3, 0);
  REQUIRE(chunks.size() == 3);
  CHECK(chunks[0].shape() == Shape{3, 4});
  CHECK(chunks[1].shape() == Shape{3, 4});
  CHECK(chunks[2].shape() == Shape{1, 4});
  check_equal(chunks[2].data(), values(y.data().select(0, 6)));
  check_gradients(
      [](const std::vector<Variable>& v) {
        const std::vector<Variable> c = chunk(v[0], 3, 0);
        return mul(mul(c[0], c[1]), c[2]);
      },
      {y});
  check_gradients(
      [](const std::vector<Variable>& v) {
        const std::vector<Variable> c = chunk(v[0], 3, -1);  // [3, 3], [3, 3], [3, 1]
        return sub(mul(c[0], c[2]), c[1]);
      },
      {strided_leaf({3, 7}, 4)});

  // By hand: the middle piece unused, the others scaled differently.
  const Variable z = leaf({5}, 5);
  const std::vector<Variable> parts = chunk(z, 3, 0);  // [2], [2], [1]
  sum(add(sum(parts[0]), mul(parts[2], 3.0))).backward();
  check_equal(z.grad(), {1, 1, 0, 0, 3});
}

TEST_CASE("view outputs share the input's storage exactly where core's views do", "[gradcheck][shape]") {
  const Variable x = leaf({2, 3, 4}, 1);
  const Tensor& t = x.data();
  struct Case {
    std::string name;
    Variable view;
    Tensor core;
  };
  const std::vector<Case> views = {
      {"reshape", reshape(x, {6, 4}), t.reshape({6, 4})},
      {"flatten", flatten(x, 1), t.flatten(1)},
      {"permute", permute(x, {2, 0, 1}), t.permute({2, 0, 1})},
      {"transpose", transpose(x, 0, 2), t.transpose(0, 2)},
      {"narrow", narrow(x, 1, 1, 2), t.narrow(1, 1, 2)},
      {"slice", slice(x, 2, 1, 4, 2), t.slice(2, 1, 4, 2)},
      {"select", select(x, 1, -1), t.select(1, -1)},
      {"expand", expand(unsqueeze(x, 0), {5, 2, 3, 4}), t.unsqueeze(0).expand({5, 2, 3, 4})},
      {"squeeze", squeeze(narrow(x, 0, 1, 1), 0), t.narrow(0, 1, 1).squeeze(0)},
      {"unsqueeze", unsqueeze(x, 1), t.unsqueeze(1)},
      {"contiguous", contiguous(x), t.contiguous()},
  };
  for (const Case& c : views) {
    INFO(c.name);
    CHECK(shares_storage(c.view.data(), t));
    CHECK(c.view.shape() == c.core.shape());
    CHECK(c.view.data().strides() == c.core.strides());
    CHECK(c.view.data().offset() == c.core.offset());
    CHECK(c.view.grad_fn()->name() == c.name + "_backward");
  }

  // Where core copies, so does the autograd op: reshape and flatten of a transposed input,
  // contiguous of a non-contiguous one, and every join.
  const Variable s = strided_leaf({3, 4}, 2);
  CHECK_FALSE(shares_storage(reshape(s, {12}).data(), s.data()));
  CHECK_FALSE(shares_storage(flatten(s).data(), s.data()));
  CHECK_FALSE(shares_storage(contiguous(s).data(), s.data()));
  // Splitting one dim needs no copy, even of a non-contiguous input.
  CHECK(shares_storage(reshape(s, {3, 2, 2}).data(), s.data()));
  CHECK_FALSE(shares_storage(cat({x}, 0).data(), t));
  CHECK_FALSE(shares_storage(stack({x}, 0).data(), t));

  // The gradient of a view is a fresh tensor: writing into it leaves the input alone.
  const std::vector<double> before = values(t);
  const Variable v = reshape(x, {24});
  v.backward(ones({24}, dtype(DType::f64)));
  x.grad().fill_(5.0);
  check_equal(t, before);
}

TEST_CASE("views and joins report core's errors and their own", "[gradcheck][shape][errors]") {
  const Variable x = leaf({2, 5}, 1);
  CHECK_THROWS_ERROR(narrow(x, 1, 3, 4), "narrow: start 3 and length 4 do not fit dimension 1 of size 5");
  CHECK_THROWS_ERROR(slice(x, 0, 0, 2, 0), "slice: step must be positive, got 0");
  CHECK_THROWS_ERROR(select(x, 0, -3), "select: index -3 is out of range for dimension 0 of size 2");
  CHECK_THROWS_ERROR(reshape(x, {3, 3}), "reshape: shape [3, 3] is invalid for a tensor of 10 elements");
  CHECK_THROWS_ERROR(flatten(x, 1, 0), "flatten: start_dim 1 comes after end_dim 0");
  CHECK_THROWS_ERROR(permute(x, {0}), "permute: got 1 dims [0] for a tensor of rank 2");
  CHECK_THROWS_ERROR(permute(x, {1, 1}), "permute: dims [1, 1] repeat dimension 1");
  CHECK_THROWS_ERROR(transpose(x, 0, 2), "transpose: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(expand(x, {2, 4}), "expand: cannot expand shape [2, 5] to [2, 4] (dimension 1: 5 vs 4)");
  CHECK_THROWS_ERROR(unsqueeze(x, 3), "unsqueeze: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(triu(leaf({4}, 2)), "triu: needs at least 2 dims, got shape [4]");
  CHECK_THROWS_ERROR(tril(leaf({4}, 2)), "tril: needs at least 2 dims, got shape [4]");

  const Variable y = leaf({3, 5}, 3);
  CHECK_THROWS_ERROR(
      cat({x, y}, 1),
      "cat: tensor 1 has shape [3, 5] but tensor 0 has [2, 5] (they must match except in dimension 1)");
  CHECK_THROWS_ERROR(cat({x, Variable()}, 0), "cat: tensor 1 is undefined");
  CHECK_THROWS_ERROR(cat(std::vector<Variable>{}, 0), "cat: needs at least one tensor");
  CHECK_THROWS_ERROR(cat({x, y}, 2), "cat: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(stack({x, x, y}, 0), "stack: tensor 2 has shape [3, 5] but tensor 0 has [2, 5]");
  CHECK_THROWS_ERROR(stack({x, Variable()}, 0), "stack: tensor 1 is undefined");
  CHECK_THROWS_ERROR(stack(std::vector<Variable>{}, 0), "stack: needs at least one tensor");
  CHECK_THROWS_ERROR(stack({x, x}, 3), "stack: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(split(x, 0, 1), "split: split_size must be positive, got 0");
  CHECK_THROWS_ERROR(split(x, 2, 2), "split: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(chunk(x, 0, 1), "chunk: number of chunks must be positive, got 0");
  CHECK_THROWS_ERROR(chunk(x, 2, -3), "chunk: dimension -3 is out of range for a tensor of rank 2");
}
