// tests/core/test_reduce.cpp: sum, mean, sum_squares, max, min, argmax, logsumexp vs naive loops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tests/check.h"

namespace shardlab::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const std::vector<DType> kFloatDTypes{DType::f32, DType::f64, DType::bf16, DType::f16};

enum class Op { sum, mean, sum_squares, max, min, argmax, logsumexp };

const char* name_of(Op op) {
  switch (op) {
    case Op::sum:
      return "sum";
    case Op::mean:
      return "mean";
    case Op::sum_squares:
      return "sum_squares";
    case Op::max:
      return "max";
    case Op::min:
      return "min";
    case Op::argmax:
      return "argmax";
    case Op::logsumexp:
      return "logsumexp";
  }
  return "?";
}

const std::vector<Op> kAllOps{Op::sum, Op::mean,   Op::sum_squares, Op::max,
                              Op::min, Op::argmax, Op::logsumexp};

Tensor run(Op op, const Tensor& x, const Dims& dims, bool keepdim) {
  switch (op) {
    case Op::sum:
      return sum(x, dims, keepdim);
    case Op::mean:
      return mean(x, dims, keepdim);
    case Op::sum_squares:
      return sum_squares(x, dims, keepdim);
    case Op::max:
      return max(x, dims, keepdim);
    case Op::min:
      return min(x, dims, keepdim);
    case Op::argmax:
      return argmax(x, dims, keepdim);
    case Op::logsumexp:
      return logsumexp(x, dims, keepdim);
  }
  return {};
}

// One output element from the values of its group, visited in row-major order.
double fold(Op op, const std::vector<double>& group) {
  const double n = static_cast<double>(group.size());
  switch (op) {
    case Op::sum:
    case Op::mean: {
      double total = 0;
      for (const double v : group) total += v;
      return op == Op::sum ? total : total / n;  // 0 / 0 = NaN for an empty mean
    }
    case Op::sum_squares: {
      double total = 0;
      for (const double v : group) total += v * v;
      return total;
    }
    case Op::max:
    case Op::min:
    case Op::argmax: {
      // The first NaN wins; otherwise the first strictly best value.
      std::size_t best = 0;
      for (std::size_t i = 0; i < group.size(); ++i) {
        if (std::isnan(group[i])) {
          best = i;
          break;
        }
        const bool better = op == Op::min ? group[i] < group[best] : group[i] > group[best];
        if (better) best = i;
      }
      return op == Op::argmax ? static_cast<double>(best) : group[best];
    }
    case Op::logsumexp: {
      double largest = -kInf;
      for (const double v : group) largest = v > largest ? v : largest;
      if (std::isinf(largest)) return largest;  // all -inf gives -inf; any +inf gives +inf
      double total = 0;
      for (const double v : group) total += std::exp(v - largest);
      return largest + std::log(total);
    }
  }
  return kNaN;
}

struct Expected {
  Shape shape;
  std::vector<double> values;
};

// Naive reduction: every input element goes, in row-major order, to the group of the output
// element with the same coordinates in the kept dims.
Expected reference(Op op, const Tensor& x, const Dims& dims, bool keepdim) {
  const Shape& shape = x.shape();
  const auto rank = static_cast<std::int64_t>(shape.size());
  std::vector<bool> reduced(shape.size(), dims.empty());
  for (const std::int64_t d : dims) reduced[static_cast<std::size_t>(d < 0 ? d + rank : d)] = true;
  Expected out;
  Shape kept;
  for (std::int64_t d = 0; d < rank; ++d) {
    if (!reduced[static_cast<std::size_t>(d)]) kept.push_back(shape[static_cast<std::size_t>(d)]);
    if (!reduced[static_cast<std::size_t>(d)] || keepdim) {
      out.shape.push_back(reduced[static_cast<std::size_t>(d)] ? 1 : shape[static_cast<std::size_t>(d)]);
    }
  }
  std::vector<std::vector<double>> groups(static_cast<std::size_t>(shape_numel(kept)));
  const std::vector<double> v = x.to_vector<double>();
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    std::int64_t rest = i, group = 0, scale = 1;
    for (std::int64_t d = rank - 1; d >= 0; --d) {
      const std::int64_t size = shape[static_cast<std::size_t>(d)];
      const std::int64_t c = rest % size;
      rest /= size;
      if (!reduced[static_cast<std::size_t>(d)]) {
        group += c * scale;
        scale *= size;
      }
    }
    groups[static_cast<std::size_t>(group)].push_back(v[static_cast<std::size_t>(i)]);
  }
  for (const auto& g : groups) out.values.push_back(fold(op, g));
  return out;
}

std::string dims_str(const Dims& dims) { return shape_str(dims); }

// Runs op and compares shape, dtype and values with the naive reference.
void check_reduction(Op op, const Tensor& x, const Dims& dims, bool keepdim) {
  INFO(name_of(op) << " of " << dtype_name(x.dtype()) << " " << shape_str(x.shape()) << " over "
                   << dims_str(dims) << (keepdim ? " keepdim" : ""));
  const Tensor y = run(op, x, dims, keepdim);
  const Expected e = reference(op, x, dims, keepdim);
  CHECK(y.shape() == e.shape);
  const bool integral = !is_floating(x.dtype());
  DType expected_dtype = x.dtype();
  if (op == Op::argmax || (integral && (op == Op::sum || op == Op::sum_squares))) expected_dtype = DType::i64;
  CHECK(y.dtype() == expected_dtype);
  check_close(y, e.values);
}

}  // namespace

TEST_CASE("reductions over one dim, negative dims and keepdim match a naive loop", "[reduce]") {
  std::uint64_t seed = 1000;
  for (const DType dtype : kFloatDTypes) {
    const Tensor x = random_tensor({3, 4, 5}, ++seed, dtype, -2, 2);
    for (const Op op : kAllOps) {
      for (const Dims& dims : std::vector<Dims>{{0}, {1}, {2}, {-1}, {-2}, {-3}}) {
        for (const bool keepdim : {false, true}) check_reduction(op, x, dims, keepdim);
      }
    }
  }
}

TEST_CASE("reductions over several dims and over all dims", "[reduce]") {
  std::uint64_t seed = 1100;
  for (const DType dtype : kFloatDTypes) {
    const Tensor x = random_tensor({3, 4, 5}, ++seed, dtype, -2, 2);
    const Tensor x4 = random_tensor({2, 3, 4, 5}, ++seed, dtype, -2, 2);
    for (const Op op : kAllOps) {
      for (const bool keepdim : {false, true}) {
        for (const Dims& dims : std::vector<Dims>{{0, 2}, {2, 0}, {-1, 0}, {1, 2}, {0, 1}, {0, 1, 2}, {}}) {
          check_reduction(op, x, dims, keepdim);
        }
        for (const Dims& dims : std::vector<Dims>{{1, 3}, {0, 3}, {0, 1, 3}, {-3, -2}}) {
          check_reduction(op, x4, dims, keepdim);
        }
      }
    }
  }
  // All dims without keepdim is 0-d, with keepdim all ones.
  const Tensor x = random_tensor({3, 4, 5}, 1, DType::f64);
  CHECK(sum(x).shape() == Shape{});
  CHECK(sum(x, {}, true).shape() == Shape{1, 1, 1});
  CHECK(argmax(x).shape() == Shape{});
}

TEST_CASE("reductions on odd sizes and long rows split over threads", "[reduce]") {
  std::uint64_t seed = 1200;
  for (const Shape& shape : std::vector<Shape>{{1}, {7}, {13}, {1, 1}, {7, 1, 13}, {37, 1000}, {3, 20000}}) {
    const Tensor x = random_tensor(shape, ++seed, DType::f32, -1, 1);
    for (const Op op : kAllOps) {
      check_reduction(op, x, {}, false);
      check_reduction(op, x, {-1}, false);
      check_reduction(op, x, {0}, true);
    }
  }
}

TEST_CASE("reductions of non-contiguous inputs: transposed, sliced with a step, permuted, expanded",
          "[reduce]") {
  std::uint64_t seed = 1300;
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    const Tensor transposed = random_strided({4, 6, 5}, ++seed, dtype);
    REQUIRE_FALSE(transposed.is_contiguous());
    const Tensor sliced = random_tensor({4, 13, 5}, ++seed, dtype).slice(1, 1, 13, 2);
    REQUIRE(sliced.shape() == Shape{4, 6, 5});
    REQUIRE_FALSE(sliced.is_contiguous());
    const Tensor permuted = random_tensor({5, 4, 6}, ++seed, dtype).permute({1, 2, 0});
    const Tensor expanded = random_tensor({4, 1, 5}, ++seed, dtype).expand({4, 6, 5});
    for (const Tensor& x : {transposed, sliced, permuted, expanded}) {
      for (const Op op : kAllOps) {
        for (const Dims& dims : std::vector<Dims>{{0}, {1}, {2}, {0, 2}, {1, 2}, {}}) {
          check_reduction(op, x, dims, false);
        }
      }
    }
  }
  // Summing an expanded dim of size 6 multiplies by 6 (exact in f64).
  const Tensor row = random_tensor({1, 5}, 7, DType::f64);
  std::vector<double> six_times;
  for (const double v : row.to_vector<double>()) six_times.push_back(6 * v);
  check_close(sum(row.expand({6, 5}), {0}), six_times, Tolerance{1e-15, 1e-15});
  // Every element of an expanded tensor ties: argmax is the first index.
  check_equal(argmax(row.expand({6, 5}), {0}), {0, 0, 0, 0, 0});
}

TEST_CASE("integer and bool sums give exact i64", "[reduce]") {
  // 3 x 2e9 overflows i32 but not the i64 result.
  const Tensor big = from_vector<std::int32_t>({2000000000, 2000000000, 2000000000});
  const Tensor s = sum(big);
  CHECK(s.dtype() == DType::i64);
  CHECK(s.item<std::int64_t>() == 6000000000);
  CHECK(sum_squares(from_vector<std::int32_t>({100000, -100000})).item<std::int64_t>() == 20000000000);
  const Tensor u = sum(from_vector<std::uint8_t>({200, 200, 200}));
  CHECK(u.dtype() == DType::i64);
  CHECK(u.item<std::int64_t>() == 600);
  // i64 values beyond 2^53 stay exact.
  const std::int64_t large = (std::int64_t{1} << 60) + 1;
  CHECK(sum(from_vector<std::int64_t>({large, 2})).item<std::int64_t>() == large + 2);
  // bool sums count the trues.
  const Tensor b = from_vector<bool>({true, false, true, true, false, true}, {2, 3});
  CHECK(sum(b).dtype() == DType::i64);
  CHECK(sum(b).item<std::int64_t>() == 4);
  check_equal(sum(b, {1}), {2, 2});
  check_equal(sum(b, {0}), {2, 0, 2});
  // Integer reductions against the naive loop on a 3-D tensor of small integers.
  const Tensor ints = random_tensor({3, 4, 5}, 31, DType::f64, -50, 50).to(DType::i64);
  for (const DType dtype : {DType::i32, DType::i64}) {
    const Tensor x = ints.to(dtype);
    for (const Op op : {Op::sum, Op::sum_squares, Op::max, Op::min, Op::argmax}) {
      for (const Dims& dims : std::vector<Dims>{{0}, {-1}, {0, 2}, {}}) check_reduction(op, x, dims, true);
    }
  }
  // Long contiguous rows: i64 min and max run a vectorised loop with a tail (i32 the general one).
  const Tensor long_ints = random_tensor({3, 20011}, 33, DType::f64, -1e9, 1e9).to(DType::i64);
  for (const DType dtype : {DType::i32, DType::i64}) {
    for (const Op op : {Op::max, Op::min}) {
      for (const Dims& dims : std::vector<Dims>{{}, {-1}, {0}})
        check_reduction(op, long_ints.to(dtype), dims, false);
    }
  }
  const Tensor bytes = random_tensor({4, 7}, 32, DType::f64, 0, 256).to(DType::u8);
  for (const Op op : {Op::sum, Op::sum_squares, Op::max, Op::min, Op::argmax}) {
    check_reduction(op, bytes, {1}, false);
    check_reduction(op, bytes, {}, false);
  }
  // max and min keep integer dtypes and exact values.
  CHECK(max(big).dtype() == DType::i32);
  CHECK(max(from_vector<std::int64_t>({large, 0, -large})).item<std::int64_t>() == large);
  CHECK(min(from_vector<std::int64_t>({large, 0, -large})).item<std::int64_t>() == -large);
}

TEST_CASE("max, min and argmax propagate NaN: NaN is the maximum (and the minimum)", "[reduce]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor x = from_vector<double>({1, kNaN, 3, 5,     //
                                          kNaN, 2, 0, kNaN,  //
                                          -kInf, 4, kInf, 2},
                                         {3, 4})
                         .to(dtype);
    check_equal(max(x, {1}), {kNaN, kNaN, kInf});
    check_equal(min(x, {1}), {kNaN, kNaN, -kInf});
    check_equal(argmax(x, {1}), {1, 0, 2});
    check_equal(max(x, {0}), {kNaN, kNaN, kInf, kNaN});
    check_equal(argmax(x, {0}), {1, 0, 2, 1});
    check_equal(max(x), {kNaN});
    check_equal(argmax(x), {1});                   // the first NaN in row-major order
    check_equal(sum(x, {1}), {kNaN, kNaN, kNaN});  // -inf + inf is NaN too
    check_equal(mean(x.narrow(0, 2, 1), {1}), {kNaN});
  }
}

TEST_CASE("argmax returns the first index on ties and counts row-major over the reduced dims", "[reduce]") {
  const Tensor x = from_vector<float>({3, 1, 3,  //
                                       2, 2, 2,  //
                                       0, 5, 5},
                                      {3, 3});
  check_equal(argmax(x, {1}), {0, 0, 1});
  check_equal(argmax(x, {0}), {0, 2, 2});
  check_equal(argmax(x), {7});
  const Tensor k = argmax(x, {1}, true);
  CHECK(k.shape() == Shape{3, 1});
  CHECK(k.dtype() == DType::i64);
  // Over dims {0, 2} of [2, 3, 4] the index is i0 * 4 + i2.
  std::vector<float> values(24, 0.0f);
  values[1 * 12 + 0 * 4 + 3] = 9.0f;  // j = 0: maximum at i0 = 1, i2 = 3 -> 7
  values[0 * 12 + 1 * 4 + 2] = 9.0f;  // j = 1: at i0 = 0, i2 = 2 -> 2
  values[1 * 12 + 1 * 4 + 2] = 9.0f;  //        tie at i0 = 1, i2 = 2 -> 6 comes later
  // j = 2: all zero -> 0
  const Tensor y = from_vector<float>(values, {2, 3, 4});
  check_equal(argmax(y, {0, 2}), {7, 2, 0});
  check_equal(argmax(y, {2, 0}), {7, 2, 0});
  // Through a transposed view the logical order counts, not the memory order.
  const Tensor t = from_vector<float>({1, 7, 7, 0}, {2, 2}).transpose(0, 1);  // [[1, 7], [7, 0]]
  check_equal(argmax(t, {1}), {1, 0});
  check_equal(argmax(t), {1});
}

TEST_CASE("empty reductions: sum is 0, mean is NaN, max over a size-0 dim is an error", "[reduce]") {
  const Tensor e = empty({0});
  CHECK(sum(e).shape() == Shape{});
  check_equal(sum(e), {0});
  check_equal(sum_squares(e), {0});
  check_equal(mean(e), {kNaN});
  check_equal(sum(empty({0}, dtype(DType::i32))), {0});
  CHECK(sum(empty({0}, dtype(DType::i32))).dtype() == DType::i64);
  const Tensor rows = zeros({2, 0});
  CHECK(sum(rows, {1}).shape() == Shape{2});
  check_equal(sum(rows, {1}), {0, 0});
  check_equal(mean(rows, {1}), {kNaN, kNaN});
  CHECK(sum(rows, {1}, true).shape() == Shape{2, 1});
  // Reducing a non-empty dim of an empty tensor gives an empty result, not an error.
  CHECK(sum(rows, {0}).shape() == Shape{0});
  CHECK(max(zeros({0, 3}), {1}).shape() == Shape{0});
  CHECK(argmax(zeros({0, 3}), {1}).shape() == Shape{0});
  CHECK_THROWS_ERROR(max(e), "max: cannot reduce over dimension 0 of size 0 (shape [0])");
  CHECK_THROWS_ERROR(min(rows, {1}), "min: cannot reduce over dimension 1 of size 0 (shape [2, 0])");
  CHECK_THROWS_ERROR(argmax(rows), "argmax: cannot reduce over dimension 1 of size 0 (shape [2, 0])");
}

TEST_CASE("empty reductions of a non-contiguous view read no elements", "[reduce]") {
  // A [0, 4] view whose strides do not merge ([1, 3]): the size-0 dim comes first.
  const Tensor base = random_tensor({4, 3}, 41, DType::f32, 1, 2);
  const Tensor view = base.transpose(0, 1).slice(0, 0, 0);
  REQUIRE(view.shape() == Shape{0, 4});
  check_equal(sum(view), {0});
  check_equal(sum_squares(view), {0});
  check_equal(mean(view), {kNaN});
  check_equal(sum(view, {0}), {0, 0, 0, 0});
}

TEST_CASE("logsumexp is stable for large values and gives -inf for rows of -inf", "[reduce]") {
  for (const DType dtype : {DType::f32, DType::f64}) {
    INFO(dtype_name(dtype));
    const Tensor x = from_vector<double>({-kInf, -kInf, -kInf,  //
                                          1000, 1000, -kInf,    //
                                          -1000, -1000, -1000,  //
                                          10000, 0, -kInf,      //
                                          kInf, 1, -kInf,       //
                                          0, 0, 0},
                                         {6, 3})
                         .to(dtype);
    const Tensor y = logsumexp(x, {1});
    CHECK(y.dtype() == dtype);
    CHECK(y.shape() == Shape{6});
    check_close(y, {-kInf, 1000 + std::log(2.0), -1000 + std::log(3.0), 10000, kInf, std::log(3.0)});
    check_close(logsumexp(x, {1}, true),
                {-kInf, 1000 + std::log(2.0), -1000 + std::log(3.0), 10000, kInf, std::log(3.0)});
    CHECK(logsumexp(x, {1}, true).shape() == Shape{6, 1});
  }
  // Shifting every value by c shifts the result by c, at any magnitude.
  const Tensor x = random_tensor({3, 4, 5}, 51, DType::f64, -3, 3);
  const Tensor base = logsumexp(x, {0, 2});
  std::vector<double> shifted;
  for (const double v : base.to_vector<double>()) shifted.push_back(v + 5000);
  check_close(logsumexp(add(x, 5000.0), {0, 2}), shifted, Tolerance{1e-10, 1e-12});
  // logsumexp of n equal values c is c + log(n).
  check_close(logsumexp(full({7, 13}, -3.5, dtype(DType::f32)), {}), {-3.5 + std::log(91.0)});
}

TEST_CASE("reductions of 0-d tensors return the value", "[reduce]") {
  const Tensor x = scalar_tensor(-2.5, dtype(DType::f64));
  for (const Op op : kAllOps) {
    for (const bool keepdim : {false, true}) {
      INFO(name_of(op) << (keepdim ? " keepdim" : ""));
      const Tensor y = run(op, x, {}, keepdim);
      CHECK(y.shape() == Shape{});
      const double expected = op == Op::argmax ? 0.0 : op == Op::sum_squares ? 6.25 : -2.5;
      check_equal(y, {expected});
    }
  }
  CHECK(sum(scalar_tensor(3, dtype(DType::i32))).item<std::int64_t>() == 3);
}

TEST_CASE("reduction errors name the op and the offending dims", "[reduce]") {
  const Tensor x = empty({2, 3});
  CHECK_THROWS_ERROR(sum(x, {3}), "sum: dimension 3 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(sum(x, {-3}), "sum: dimension -3 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(max(x, {0, 2}), "max: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(logsumexp(x, {5}), "logsumexp: dimension 5 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(sum(x, {1, 1}), "sum: dims [1, 1] name a dimension twice");
  CHECK_THROWS_ERROR(mean(x, {0, -2}), "mean: dims [0, -2] name a dimension twice");
  CHECK_THROWS_ERROR(argmax(x, {-1, 1}), "argmax: dims [-1, 1] name a dimension twice");
  CHECK_THROWS_ERROR(mean(from_vector<std::int32_t>({1, 2})),
                     "mean: needs a floating dtype, got i32 (cast first)");
  CHECK_THROWS_ERROR(mean(from_vector<bool>({true})), "mean: needs a floating dtype, got bool");
  CHECK_THROWS_ERROR(logsumexp(from_vector<std::int64_t>({1}), {0}),
                     "logsumexp: needs a floating dtype, got i64");
  const Tensor undefined;
  CHECK_THROWS_ERROR(sum(undefined), "sum: input tensor is undefined");
  CHECK_THROWS_ERROR(mean(undefined), "mean: input tensor is undefined");
  CHECK_THROWS_ERROR(max(undefined), "max: input tensor is undefined");
  CHECK_THROWS_ERROR(argmax(undefined), "argmax: input tensor is undefined");
  CHECK_THROWS_ERROR(logsumexp(undefined, {0}), "logsumexp: input tensor is undefined");
}

// --- foreach_sum_squares ----------------------------------------------------------------------

// The order core/square_sums.h documents, spelled out with the test's own loops: 32768-element chunks
// of each tensor, element i of a chunk to lane i % 256, the lanes folded pairwise (lane i += lane i + s
// for s = 128, ..., 1), then the chunks' partials dealt to lanes and folded alike.
double fold_pairwise(std::vector<double> lanes) {
  for (std::size_t s = lanes.size() / 2; s > 0; s /= 2) {
    for (std::size_t i = 0; i < s; ++i) lanes[i] = lanes[i] + lanes[i + s];
  }
  return lanes[0];
}

double squares_in_documented_order(const std::vector<Tensor>& tensors) {
  std::vector<double> partials;
  for (const Tensor& t : tensors) {
    const std::vector<double> values = t.contiguous().to(DType::f64).to_vector<double>();
    for (std::size_t begin = 0; begin < values.size(); begin += 32768) {
      std::vector<double> lanes(256, 0.0);
      for (std::size_t i = begin; i < std::min(values.size(), begin + 32768); ++i) {
        lanes[(i - begin) % 256] += values[i] * values[i];
      }
      partials.push_back(fold_pairwise(lanes));
    }
  }
  std::vector<double> lanes(256, 0.0);
  for (std::size_t p = 0; p < partials.size(); ++p) lanes[p % 256] += partials[p];
  return fold_pairwise(lanes);
}

TEST_CASE("foreach_sum_squares adds in its documented order over mixed dtypes and odd sizes",
          "[reduce][foreach]") {
  // A partial last chunk, exactly one chunk, a few elements, an empty tensor, a transposed view,
  // halves and f64 together. f32 and f64 squares carry 48 and more significant bits, so their sums
  // round, and another order (other chunks, lanes or fold) gives other bits.
  const std::vector<Tensor> tensors = {random_tensor({70001}, 1, DType::f32, -3.0, 3.0),
                                       random_tensor({32768}, 2, DType::bf16, -1.0, 1.0),
                                       random_tensor({3, 5}, 3, DType::f16, -8.0, 8.0),
                                       empty({0, 4}, dtype(DType::f64)),
                                       random_tensor({300, 200}, 4, DType::f64, -3.0, 3.0).transpose(0, 1),
                                       random_tensor({1}, 5, DType::f32, 10.0, 20.0)};
  const Tensor total = foreach_sum_squares(tensors);
  CHECK(total.dtype() == DType::f64);
  CHECK(total.dim() == 0);
  CHECK(total.item<double>() == squares_in_documented_order(tensors));
  // And the plain sum of every square, to rounding.
  double naive = 0.0;
  for (const Tensor& t : tensors) naive += sum_squares(t.to(DType::f64)).item<double>();
  CHECK_THAT(total.item<double>(), Catch::Matchers::WithinRel(naive, 1e-12));
}

TEST_CASE("foreach_sum_squares over more chunks than lanes, and of single tensors", "[reduce][foreach]") {
  // 300 chunks of f32 (squares that round when summed): partials 256 and beyond share lanes with the
  // first ones.
  const std::vector<Tensor> many = {random_tensor({300 * 32768 - 7}, 6, DType::f32)};
  CHECK(foreach_sum_squares(many).item<double>() == squares_in_documented_order(many));
  const std::vector<Tensor> one = {from_vector<double>({3.0, -4.0})};
  CHECK(foreach_sum_squares(one).item<double>() == 25.0);
  const std::vector<Tensor> nothing = {empty({0})};
  CHECK(foreach_sum_squares(nothing).item<double>() == 0.0);
}

TEST_CASE("foreach_sum_squares refuses an empty list, undefined and non-floating tensors", "[reduce][foreach]") {
  CHECK_THROWS_ERROR(foreach_sum_squares({}), "foreach_sum_squares: needs at least one tensor");
  const std::vector<Tensor> with_undefined = {empty({2}), Tensor()};
  CHECK_THROWS_ERROR(foreach_sum_squares(with_undefined), "foreach_sum_squares: tensor 1 of 2 is undefined");
  const std::vector<Tensor> with_integers = {empty({2}), from_vector<std::int64_t>({1})};
  CHECK_THROWS_ERROR(foreach_sum_squares(with_integers),
                     "foreach_sum_squares: tensor 1 of 2 has dtype i64; floating dtypes only");
}

}  // namespace shardlab::test
