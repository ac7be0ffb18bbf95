// tests/core/test_linalg.cpp: matmul, softmax, conv2d and its gradients, max_pool2d vs naive loops.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "tests/check.h"

namespace shardlab::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const std::vector<DType> kFloatDTypes{DType::f32, DType::f64, DType::bf16, DType::f16};

// --- matmul reference ------------------------------------------------------------------------

struct Expected {
  Shape shape;
  std::vector<double> values;
};

// torch.matmul by hand: 1-D operands become [1, K] / [K, 1], batch dims broadcast from the
// right, each matrix product is a triple loop in double, and the added dims are dropped.
Expected naive_matmul(const Tensor& a, const Tensor& b) {
  Shape as = a.shape(), bs = b.shape();
  const bool a_vector = as.size() == 1, b_vector = bs.size() == 1;
  if (a_vector) as = {1, as[0]};
  if (b_vector) bs = {bs[0], 1};
  const std::int64_t m = as[as.size() - 2], k = as[as.size() - 1], n = bs[bs.size() - 1];
  REQUIRE(bs[bs.size() - 2] == k);
  const Shape a_batch(as.begin(), as.end() - 2), b_batch(bs.begin(), bs.end() - 2);
  const std::size_t rank = std::max(a_batch.size(), b_batch.size());
  Shape batch(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    const std::int64_t sa = i < rank - a_batch.size() ? 1 : a_batch[i - (rank - a_batch.size())];
    const std::int64_t sb = i < rank - b_batch.size() ? 1 : b_batch[i - (rank - b_batch.size())];
    batch[i] = std::max(sa, sb);
  }
  // Flat batch index of `shape` (right-aligned inside `batch`) for batch coordinates c.
  const auto batch_index = [&](const Shape& shape, const std::vector<std::int64_t>& c) {
    std::int64_t flat = 0;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      flat = flat * shape[d] + (shape[d] == 1 ? 0 : c[rank - shape.size() + d]);
    }
    return flat;
  };
  const std::vector<double> av = values(a), bv = values(b);
  Expected out;
  const std::int64_t batches = shape_numel(batch);
  for (std::int64_t t = 0; t < batches; ++t) {
    std::vector<std::int64_t> c(rank);
    std::int64_t rest = t;
    for (std::size_t d = rank; d-- > 0;) {
      c[d] = rest % batch[d];
      rest /= batch[d];
    }
    const std::int64_t ia = batch_index(a_batch, c), ib = batch_index(b_batch, c);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double total = 0;
        for (std::int64_t p = 0; p < k; ++p) {
          total += av[static_cast<std::size_t>((ia * m + i) * k + p)] *
                   bv[static_cast<std::size_t>((ib * k + p) * n + j)];
        }
        out.values.push_back(total);
      }
    }
  }
  out.shape = batch;
  if (!a_vector) out.shape.push_back(m);
  if (!b_vector) out.shape.push_back(n);
  return out;
}

void check_matmul(const Tensor& a, const Tensor& b) {
  INFO("matmul " << shape_str(a.shape()) << " x " << shape_str(b.shape()) << " " << dtype_name(a.dtype()));
  const Tensor y = matmul(a, b);
  const Expected e = naive_matmul(a, b);
  CHECK(y.shape() == e.shape);
  CHECK(y.dtype() == a.dtype());
  check_close(y, e.values);
}

// --- softmax reference -----------------------------------------------------------------------

// The naive formulas exp(x_i) / sum_j exp(x_j) and x_i - log(sum_j exp(x_j)) along `dim`, in
// double; fine for inputs of moderate size.
std::vector<double> naive_softmax(const std::vector<double>& x, const Shape& shape, std::int64_t dim,
                                  bool log) {
  const auto d = static_cast<std::size_t>(dim < 0 ? dim + static_cast<std::int64_t>(shape.size()) : dim);
  std::int64_t inner = 1, outer = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i < d) outer *= shape[i];
    if (i > d) inner *= shape[i];
  }
  const std::int64_t length = shape[d];
  std::vector<double> out(x.size());
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t i = 0; i < inner; ++i) {
      const auto at = [&](std::int64_t j) { return static_cast<std::size_t>((o * length + j) * inner + i); };
      double total = 0;
      for (std::int64_t j = 0; j < length; ++j) total += std::exp(x[at(j)]);
      for (std::int64_t j = 0; j < length; ++j) {
        out[at(j)] = log ? x[at(j)] - std::log(total) : std::exp(x[at(j)]) / total;
      }
    }
  }
  return out;
}

// --- convolution references ------------------------------------------------------------------

struct ConvShapes {
  Shape input, weight;
  std::int64_t stride, padding;
  std::int64_t out_h() const { return (input[2] + 2 * padding - weight[2]) / stride + 1; }
  std::int64_t out_w() const { return (input[3] + 2 * padding - weight[3]) / stride + 1; }
  Shape output() const { return {input[0], weight[0], out_h(), out_w()}; }
};

// Calls visit(n, o, oh, ow, c, h, w, kh, kw) for every (output pixel, kernel tap) pair whose
// input pixel lies inside the image (taps on the padding contribute nothing).
template <typename Visit>
void for_each_tap(const ConvShapes& s, Visit visit) {
  const std::int64_t N = s.input[0], C = s.input[1], H = s.input[2], W = s.input[3];
  const std::int64_t O = s.weight[0], KH = s.weight[2], KW = s.weight[3];
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t o = 0; o < O; ++o)
      for (std::int64_t oh = 0; oh < s.out_h(); ++oh)
        for (std::int64_t ow = 0; ow < s.out_w(); ++ow)
          for (std::int64_t c = 0; c < C; ++c)
            for (std::int64_t kh = 0; kh < KH; ++kh)
              for (std::int64_t kw = 0; kw < KW; ++kw) {
                const std::int64_t h = oh * s.stride - s.padding + kh, w = ow * s.stride - s.padding + kw;
                if (h >= 0 && h < H && w >= 0 && w < W) visit(n, o, oh, ow, c, h, w, kh, kw);
              }
}

std::size_t at4(const Shape& s, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return static_cast<std::size_t>(((a * s[1] + b) * s[2] + c) * s[3] + d);
}

std::vector<double> naive_conv(const ConvShapes& s, const std::vector<double>& x,
                               const std::vector<double>& w, const std::vector<double>& bias) {
  const Shape os = s.output();
  std::vector<double> out(static_cast<std::size_t>(shape_numel(os)), 0.0);
  if (!bias.empty()) {
    for (std::int64_t i = 0; i < shape_numel(os); ++i) {
      out[static_cast<std::size_t>(i)] = bias[static_cast<std::size_t>(i / (os[2] * os[3]) % os[1])];
    }
  }
  for_each_tap(s, [&](auto n, auto o, auto oh, auto ow, auto c, auto h, auto ww, auto kh, auto kw) {
    out[at4(os, n, o, oh, ow)] += x[at4(s.input, n, c, h, ww)] * w[at4(s.weight, o, c, kh, kw)];
  });
  return out;
}

std::vector<double> naive_conv_backward_input(const ConvShapes& s, const std::vector<double>& g,
                                              const std::vector<double>& w) {
  std::vector<double> out(static_cast<std::size_t>(shape_numel(s.input)), 0.0);
  const Shape os = s.output();
  for_each_tap(s, [&](auto n, auto o, auto oh, auto ow, auto c, auto h, auto ww, auto kh, auto kw) {
    out[at4(s.input, n, c, h, ww)] += g[at4(os, n, o, oh, ow)] * w[at4(s.weight, o, c, kh, kw)];
  });
  return out;
}

std::vector<double> naive_conv_backward_weight(const ConvShapes& s, const std::vector<double>& g,
                                               const std::vector<double>& x) {
  std::vector<double> out(static_cast<std::size_t>(shape_numel(s.weight)), 0.0);
  const Shape os = s.output();
  for_each_tap(s, [&](auto n, auto o, auto oh, auto ow, auto c, auto h, auto ww, auto kh, auto kw) {
    out[at4(s.weight, o, c, kh, kw)] += g[at4(os, n, o, oh, ow)] * x[at4(s.input, n, c, h, ww)];
  });
  return out;
}

std::vector<ConvShapes> conv_configurations() {
  std::vector<ConvShapes> configs;
  for (const Shape& kernel : std::vector<Shape>{{3, 3}, {1, 1}, {5, 2}}) {
    for (const std::int64_t stride : {1, 2}) {
      for (const std::int64_t padding : {0, 1, 2}) {
        configs.push_back({{2, 3, 7, 9}, {4, 3, kernel[0], kernel[1]}, stride, padding});
      }
    }
  }
  return configs;
}

std::string describe(const ConvShapes& s) {
  return "input " + shape_str(s.input) + " weight " + shape_str(s.weight) + " stride " +
         std::to_string(s.stride) + " padding " + std::to_string(s.padding);
}

// --- pooling reference -----------------------------------------------------------------------

struct Pooled {
  std::vector<double> values;
  std::vector<double> indices;
};

// Each window's values in row-major order (clipped to the image); the first NaN if there
// is one, else the first maximum.
Pooled naive_max_pool(const std::vector<double>& x, const Shape& s, std::int64_t kernel, std::int64_t stride,
                      std::int64_t padding) {
  const std::int64_t H = s[2], W = s[3];
  const std::int64_t OH = (H + 2 * padding - kernel) / stride + 1,
                     OW = (W + 2 * padding - kernel) / stride + 1;
  Pooled out;
  for (std::int64_t plane = 0; plane < s[0] * s[1]; ++plane) {
    for (std::int64_t oh = 0; oh < OH; ++oh) {
      for (std::int64_t ow = 0; ow < OW; ++ow) {
        std::vector<std::pair<double, std::int64_t>> window;
        for (std::int64_t h = oh * stride - padding; h < oh * stride - padding + kernel; ++h) {
          for (std::int64_t w = ow * stride - padding; w < ow * stride - padding + kernel; ++w) {
            if (h >= 0 && h < H && w >= 0 && w < W) {
              window.emplace_back(x[static_cast<std::size_t>(plane * H * W + h * W + w)], h * W + w);
            }
          }
        }
        REQUIRE_FALSE(window.empty());
        std::size_t best = 0;
        for (std::size_t i = 0; i < window.size(); ++i) {
          if (std::isnan(window[i].first)) {
            best = i;
            break;
          }
          if (window[i].first > window[best].first) best = i;
        }
        out.values.push_back(window[best].first);
        out.indices.push_back(static_cast<double>(window[best].second));
      }
    }
  }
  return out;
}

}  // namespace

// --- matmul ----------------------------------------------------------------------------------

TEST_CASE("matmul of 1-D and 2-D operands with odd sizes matches a naive triple loop", "[linalg]") {
  std::uint64_t seed = 2000;
  for (const DType dtype : kFloatDTypes) {
    const auto r = [&](const Shape& shape) { return random_tensor(shape, ++seed, dtype); };
    check_matmul(r({7}), r({7}));          // dot product -> 0-d
    check_matmul(r({5, 7}), r({7}));       // matrix-vector -> [5]
    check_matmul(r({7}), r({7, 3}));       // vector-matrix -> [3]
    check_matmul(r({7, 13}), r({13, 5}));  // 7x13x5
    check_matmul(r({1, 1}), r({1, 1}));
    check_matmul(r({13, 1}), r({1, 7}));  // outer product
    check_matmul(r({1, 13}), r({13, 1}));
    check_matmul(r({33, 65}), r({65, 17}));
  }
  CHECK(matmul(random_tensor({7}, 1), random_tensor({7}, 2)).shape() == Shape{});
}

TEST_CASE("batched matmul broadcasts batch dims", "[linalg]") {
  std::uint64_t seed = 2100;
  for (const DType dtype : kFloatDTypes) {
    const auto r = [&](const Shape& shape) { return random_tensor(shape, ++seed, dtype); };
    check_matmul(r({2, 1, 3, 4}), r({5, 4, 6}));  // -> [2, 5, 3, 6]
    check_matmul(r({3, 4}), r({2, 4, 5}));        // matrix against a batch
    check_matmul(r({2, 3, 4}), r({4, 5}));
    check_matmul(r({2, 3, 4}), r({4}));  // batch x vector -> [2, 3]
    check_matmul(r({4}), r({2, 4, 5}));  // vector x batch -> [2, 5]
    check_matmul(r({3, 1, 2, 7}), r({1, 4, 7, 2}));
  }
  CHECK(matmul(random_tensor({2, 1, 3, 4}, 1), random_tensor({5, 4, 6}, 2)).shape() == Shape{2, 5, 3, 6});
}

TEST_CASE("matmul of non-contiguous operands: transposed, sliced, expanded, permuted", "[linalg]") {
  std::uint64_t seed = 2200;
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    const auto r = [&](const Shape& shape) { return random_tensor(shape, ++seed, dtype); };
    const Tensor at = random_strided({7, 13}, ++seed, dtype);
    const Tensor bt = random_strided({13, 5}, ++seed, dtype);
    REQUIRE_FALSE(at.is_contiguous());
    check_matmul(at, bt);
    check_matmul(at, r({13, 5}));
    check_matmul(r({7, 13}), bt);
    // Every other column / row: strides BLAS cannot take directly.
    const Tensor a_sliced = r({7, 26}).slice(1, 0, 26, 2);
    const Tensor b_sliced = r({26, 5}).slice(0, 1, 26, 2);
    REQUIRE(a_sliced.shape() == Shape{7, 13});
    REQUIRE(b_sliced.shape() == Shape{13, 5});
    check_matmul(a_sliced, b_sliced);
    check_matmul(r({26}).slice(0, 0, 26, 2), b_sliced);  // strided vector on the left
    check_matmul(a_sliced, r({39}).slice(0, 2, 39, 3));  // and on the right
    // A row repeated (stride 0 inside the matrix) and a batch repeated (batch stride 0).
    check_matmul(r({1, 13}).expand({7, 13}), r({13, 5}));
    check_matmul(r({1, 7, 13}).expand({3, 7, 13}), r({3, 13, 5}));
    // Batched transposes and a permuted batch.
    const Tensor batch_a = random_strided({3, 7, 13}, ++seed, dtype);
    const Tensor batch_b = random_strided({3, 13, 5}, ++seed, dtype);
    check_matmul(batch_a, batch_b);
    check_matmul(r({7, 3, 13}).permute({1, 0, 2}), r({3, 13, 5}));
  }
}

TEST_CASE("matmul with an empty inner dimension gives zeros", "[linalg]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor y = matmul(empty({3, 0}, TensorOptions{}.with_dtype(dtype)),
                            empty({0, 4}, TensorOptions{}.with_dtype(dtype)));
    CHECK(y.shape() == Shape{3, 4});
    CHECK(y.dtype() == dtype);
    check_equal(y, std::vector<double>(12, 0.0));
    const Tensor batched = matmul(empty({2, 3, 0}, TensorOptions{}.with_dtype(dtype)),
                                  empty({0, 5}, TensorOptions{}.with_dtype(dtype)));
    CHECK(batched.shape() == Shape{2, 3, 5});
    check_equal(batched, std::vector<double>(30, 0.0));
    const Tensor inner =
        matmul(empty({0}, TensorOptions{}.with_dtype(dtype)), empty({0}, TensorOptions{}.with_dtype(dtype)));
    CHECK(inner.shape() == Shape{});
    check_equal(inner, {0.0});
  }
  // Empty M or N: an empty result.
  CHECK(matmul(empty({0, 3}), empty({3, 4})).shape() == Shape{0, 4});
  CHECK(matmul(empty({2, 3}), empty({3, 0})).shape() == Shape{2, 0});
  CHECK(matmul(empty({0, 2, 3}), empty({3, 4})).shape() == Shape{0, 2, 4});
}

TEST_CASE("matmul errors", "[linalg]") {
  CHECK_THROWS_ERROR(matmul(empty({2, 3}), empty({4, 5})),
                     "matmul: shapes [2, 3] and [4, 5] cannot be multiplied (3 != 4)");
  CHECK_THROWS_ERROR(matmul(empty({3}), empty({4})),
                     "matmul: shapes [3] and [4] cannot be multiplied (3 != 4)");
  CHECK_THROWS_ERROR(matmul(empty({2, 5, 3}), empty({4, 3})),
                     "matmul: shapes [2, 5, 3] and [4, 3] cannot be multiplied (3 != 4)");
  CHECK_THROWS_ERROR(matmul(empty({2, 3, 4}), empty({3, 4, 5})),
                     "matmul: shapes [2] and [3] cannot be broadcast (dimension 0: 2 vs 3)");
  CHECK_THROWS_ERROR(matmul(empty({2, 3}), empty({3, 4}, dtype(DType::f64))),
                     "matmul: dtypes differ (f32 and f64); cast one first");
  CHECK_THROWS_ERROR(matmul(empty({2, 3}, dtype(DType::i32)), empty({3, 4}, dtype(DType::i32))),
                     "matmul: needs a floating dtype, got i32");
  CHECK_THROWS_ERROR(matmul(empty({2, 3}, dtype(DType::i64)), empty({3, 4}, dtype(DType::i64))),
                     "matmul: needs a floating dtype, got i64");
  CHECK_THROWS_ERROR(matmul(scalar_tensor(1.0), empty({3})),
                     "matmul: both arguments need at least 1 dimension, got shapes [] and [3]");
  CHECK_THROWS_ERROR(matmul(empty({3}), scalar_tensor(1.0)),
                     "matmul: both arguments need at least 1 dimension, got shapes [3] and []");
  CHECK_THROWS_ERROR(matmul(Tensor{}, empty({3})), "matmul: first tensor is undefined");
  CHECK_THROWS_ERROR(matmul(empty({3}), Tensor{}), "matmul: second tensor is undefined");
}

// --- softmax ---------------------------------------------------------------------------------

TEST_CASE("softmax and log_softmax along every dim match the naive formulas", "[linalg]") {
  std::uint64_t seed = 2300;
  for (const DType dtype : kFloatDTypes) {
    const Tensor x = random_tensor({3, 4, 5}, ++seed, dtype, -3, 3);
    for (const std::int64_t dim : {0, 1, 2, -1, -2, -3}) {
      INFO(dtype_name(dtype) << " dim " << dim);
      const Tensor s = softmax(x, dim);
      const Tensor l = log_softmax(x, dim);
      CHECK(s.shape() == x.shape());
      CHECK(s.dtype() == dtype);
      CHECK(l.dtype() == dtype);
      check_close(s, naive_softmax(values(x), x.shape(), dim, false));
      check_close(l, naive_softmax(values(x), x.shape(), dim, true));
    }
  }
  // Odd row lengths, a non-contiguous input and a 1-long dim.
  for (const Shape& shape : std::vector<Shape>{{7}, {13}, {1}, {7, 1}, {2, 13, 7}}) {
    const Tensor x = random_tensor(shape, ++seed, DType::f32, -3, 3);
    check_close(softmax(x, -1), naive_softmax(values(x), shape, -1, false));
    check_close(log_softmax(x, 0), naive_softmax(values(x), shape, 0, true));
  }
  const Tensor t = random_strided({6, 5, 7}, ++seed, DType::f64);
  for (const std::int64_t dim : {0, 1, 2}) {
    check_close(softmax(t, dim), naive_softmax(values(t), t.shape(), dim, false));
    check_close(log_softmax(t, dim), naive_softmax(values(t), t.shape(), dim, true));
  }
}

TEST_CASE("softmax is stable for values in the thousands", "[linalg]") {
  std::uint64_t seed = 2400;
  for (const DType dtype : {DType::f32, DType::f64}) {
    for (const double shift : {5000.0, -5000.0}) {
      for (const std::int64_t dim : {0, 1, -1}) {
        INFO(dtype_name(dtype) << " shift " << shift << " dim " << dim);
        // The naive formula overflows here; softmax is shift-invariant, so the reference is
        // the naive formula on the (exactly recovered) unshifted values.
        const Tensor x = add(random_tensor({4, 5, 6}, ++seed, dtype, -3, 3), shift);
        std::vector<double> unshifted;
        for (const double v : values(x)) unshifted.push_back(v - shift);
        check_close(softmax(x, dim), naive_softmax(unshifted, x.shape(), dim, false));
        check_close(log_softmax(x, dim), naive_softmax(unshifted, x.shape(), dim, true));
      }
    }
  }
  // Closed forms: softmax([1000, 1004, 1008]) = softmax([0, 4, 8]) (all exact in bf16 and f16);
  // equal huge values split evenly.
  const double z = 1 + std::exp(4.0) + std::exp(8.0);
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor x = from_vector<double>({1000, 1004, 1008, -1000, -1000, -1000}, {2, 3}).to(dtype);
    check_close(softmax(x, 1), {1 / z, std::exp(4.0) / z, std::exp(8.0) / z, 1.0 / 3, 1.0 / 3, 1.0 / 3});
    check_close(log_softmax(x, 1), {-std::log(z), 4 - std::log(z), 8 - std::log(z), -std::log(3.0),
                                    -std::log(3.0), -std::log(3.0)});
  }
}

TEST_CASE("softmax of rows of -inf with one finite value is one-hot", "[linalg]") {
  for (const DType dtype : kFloatDTypes) {
    INFO(dtype_name(dtype));
    const Tensor x = from_vector<double>({-kInf, 3, -kInf, -kInf,      //
                                          -kInf, -kInf, -kInf, -2000,  //
                                          0, -kInf, 1, -kInf},
                                         {3, 4})
                         .to(dtype);
    const double e = 1 / (1 + std::exp(1.0));
    check_close(softmax(x, 1), {0, 1, 0, 0, 0, 0, 0, 1, e, 0, 1 - e, 0});
    check_close(log_softmax(x, 1),
                {-kInf, 0, -kInf, -kInf, -kInf, -kInf, -kInf, 0, std::log(e), -kInf, std::log(1 - e), -kInf});
    // Along dim 0 of the transpose: the same numbers.
    check_close(softmax(x.transpose(0, 1), 0).transpose(0, 1), {0, 1, 0, 0, 0, 0, 0, 1, e, 0, 1 - e, 0});
  }
}

TEST_CASE("softmax identities, 0-d and empty inputs", "[linalg]") {
  const Tensor x = random_tensor({4, 7, 5}, 2501, DType::f64, -4, 4);
  for (const std::int64_t dim : {0, 1, 2}) {
    check_close(sum(softmax(x, dim), {dim}),
                std::vector<double>(static_cast<std::size_t>(x.numel() / x.size(dim)), 1.0),
                Tolerance{1e-14, 0});
    check_close(exp(log_softmax(x, dim)), softmax(x, dim), Tolerance{1e-15, 1e-13});
  }
  const Tensor s = softmax(scalar_tensor(3.0), 0);
  CHECK(s.shape() == Shape{});
  check_equal(s, {1.0});
  check_equal(log_softmax(scalar_tensor(-7.0), -1), {0.0});
  CHECK(softmax(empty({0, 5}), 1).shape() == Shape{0, 5});
  CHECK(log_softmax(empty({3, 0}), 0).shape() == Shape{3, 0});
}

TEST_CASE("softmax errors", "[linalg]") {
  CHECK_THROWS_ERROR(softmax(from_vector<std::int32_t>({1, 2}), 0),
                     "softmax: needs a floating dtype, got i32");
  CHECK_THROWS_ERROR(log_softmax(from_vector<std::int64_t>({1, 2}), 0),
                     "log_softmax: needs a floating dtype, got i64");
  CHECK_THROWS_ERROR(softmax(empty({2, 3, 4}), 3),
                     "softmax: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(log_softmax(empty({2, 3}), -3),
                     "log_softmax: dimension -3 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(softmax(Tensor{}, 0), "softmax: input tensor is undefined");
}

// --- conv2d ----------------------------------------------------------------------------------

TEST_CASE("conv2d forward matches a naive 7-loop convolution", "[linalg]") {
  std::uint64_t seed = 2600;
  for (const DType dtype : {DType::f32, DType::f64}) {
    for (const ConvShapes& s : conv_configurations()) {
      for (const bool with_bias : {false, true}) {
        INFO(describe(s) << " " << dtype_name(dtype) << (with_bias ? " with bias" : ""));
        const Tensor x = random_tensor(s.input, ++seed, dtype);
        const Tensor w = random_tensor(s.weight, ++seed, dtype);
        const Tensor b = with_bias ? random_tensor({s.weight[0]}, ++seed, dtype) : Tensor{};
        const Tensor y = conv2d(x, w, b, {s.stride, s.padding});
        CHECK(y.shape() == s.output());
        CHECK(y.dtype() == dtype);
        check_close(y, naive_conv(s, values(x), values(w), with_bias ? values(b) : std::vector<double>{}));
      }
    }
  }
}

TEST_CASE("conv2d gradients match naive adjoint loops", "[linalg]") {
  std::uint64_t seed = 2700;
  for (const DType dtype : {DType::f32, DType::f64}) {
    for (const ConvShapes& s : conv_configurations()) {
      INFO(describe(s) << " " << dtype_name(dtype));
      const Tensor x = random_tensor(s.input, ++seed, dtype);
      const Tensor w = random_tensor(s.weight, ++seed, dtype);
      const Tensor g = random_tensor(s.output(), ++seed, dtype);
      const Conv2dParams p{s.stride, s.padding};
      const Tensor gi = conv2d_backward_input(g, w, s.input, p);
      const Tensor gw = conv2d_backward_weight(g, x, s.weight, p);
      CHECK(gi.shape() == s.input);
      CHECK(gw.shape() == s.weight);
      CHECK(gi.dtype() == dtype);
      CHECK(gw.dtype() == dtype);
      check_close(gi, naive_conv_backward_input(s, values(g), values(w)));
      check_close(gw, naive_conv_backward_weight(s, values(g), values(x)));
    }
  }
}

TEST_CASE("conv2d and its gradients satisfy the adjoint identity in f64", "[linalg]") {
  // <conv(x, w), g> == <x, backward_input(g, w)> == <w, backward_weight(g, x)>.
  std::uint64_t seed = 2800;
  for (const ConvShapes& s : conv_configurations()) {
    INFO(describe(s));
    const Tensor x = random_tensor(s.input, ++seed, DType::f64);
    const Tensor w = random_tensor(s.weight, ++seed, DType::f64);
    const Tensor g = random_tensor(s.output(), ++seed, DType::f64);
    const Conv2dParams p{s.stride, s.padding};
    const double forward = dot(values(conv2d(x, w, {}, p)), values(g));
    const double through_input = dot(values(x), values(conv2d_backward_input(g, w, s.input, p)));
    const double through_weight = dot(values(w), values(conv2d_backward_weight(g, x, s.weight, p)));
    CHECK(std::abs(forward) > 1e-3);  // a meaningful (non-vanishing) inner product
    CHECK(std::abs(forward - through_input) <= 1e-12 * (1 + std::abs(forward)));
    CHECK(std::abs(forward - through_weight) <= 1e-12 * (1 + std::abs(forward)));
  }
}

TEST_CASE("conv2d on a batch large enough to be split into chunks", "[linalg]") {
  // A chunk's column buffer holds about 512 KiB (core/cpu/conv.cpp): 16 channels x 3x3 taps x
  // 20x20 pixels is 230 KB per f32 image and 460 KB per f64 one, so a batch of 5 goes in chunks
  // of 2, 2 and 1 images in f32 and of one image in f64.
  const ConvShapes s{{5, 16, 20, 20}, {3, 16, 3, 3}, 1, 1};
  std::uint64_t seed = 2900;
  for (const DType dtype : {DType::f32, DType::f64}) {
    INFO(dtype_name(dtype));
    const Tensor x = random_tensor(s.input, ++seed, dtype);
    const Tensor w = random_tensor(s.weight, ++seed, dtype);
    const Tensor b = random_tensor({3}, ++seed, dtype);
    const Tensor g = random_tensor(s.output(), ++seed, dtype);
    check_close(conv2d(x, w, b, {1, 1}), naive_conv(s, values(x), values(w), values(b)));
    check_close(conv2d_backward_input(g, w, s.input, {1, 1}),
                naive_conv_backward_input(s, values(g), values(w)));
    // Each weight gradient sums 5 x 20 x 20 products (magnitude ~45): f32 gets a wider atol.
    check_close(conv2d_backward_weight(g, x, s.weight, {1, 1}),
                naive_conv_backward_weight(s, values(g), values(x)),
                dtype == DType::f32 ? Tolerance{1e-4, 1e-5} : default_tolerance(dtype));
  }
}

TEST_CASE("conv2d split over threads: by images when the batch allows, else by GEMM blocks",
          "[linalg][threads]") {
  // Small images (many per chunk) and large ones (one per chunk), stride 2 with padding, batches
  // below and above the thread counts, and an image whose own GEMMs are cut into blocks. Split by
  // images or by GEMM blocks, the same GEMM calls run: the forward and both gradients have the
  // bits of 1 thread (checked against the naive loops too, but for the largest, to keep it short).
  const int original = num_threads();
  std::uint64_t seed = 3100;
  for (const ConvShapes& s :
       {ConvShapes{{7, 3, 9, 11}, {4, 3, 3, 3}, 2, 1}, ConvShapes{{2, 3, 9, 11}, {4, 3, 3, 3}, 1, 1},
        ConvShapes{{5, 32, 24, 24}, {8, 32, 3, 3}, 1, 1}, ConvShapes{{2, 32, 24, 24}, {64, 32, 3, 3}, 1, 1},
        ConvShapes{{1, 32, 96, 96}, {64, 32, 3, 3}, 1, 1}}) {
    INFO(describe(s));
    const Tensor x = random_tensor(s.input, ++seed, DType::f32);
    const Tensor w = random_tensor(s.weight, ++seed, DType::f32);
    const Tensor b = random_tensor({s.weight[0]}, ++seed, DType::f32);
    const Tensor g = random_tensor(s.output(), ++seed, DType::f32);
    const Conv2dParams p{s.stride, s.padding};
    std::vector<std::array<Tensor, 3>> results;
    for (const int threads : {1, 2, 3}) {
      set_num_threads(threads);
      results.push_back({conv2d(x, w, b, p), conv2d_backward_input(g, w, s.input, p),
                         conv2d_backward_weight(g, x, s.weight, p)});
    }
    set_num_threads(original);
    if (s.input[2] < 90) {  // all but the largest
      check_close(results[1][0], naive_conv(s, values(x), values(w), values(b)));
      check_close(results[1][1], naive_conv_backward_input(s, values(g), values(w)));
      check_close(results[1][2], naive_conv_backward_weight(s, values(g), values(x)), Tolerance{1e-4, 1e-5});
    }
    for (std::size_t run = 1; run < results.size(); ++run) {
      for (std::size_t i = 0; i < 3; ++i) CHECK(values(results[run][i]) == values(results[0][i]));
    }
  }
}

TEST_CASE("conv2d in bf16 and f16 agrees with f32 on the same values", "[linalg]") {
  std::uint64_t seed = 3000;
  for (const DType dtype : {DType::bf16, DType::f16}) {
    for (const ConvShapes& s :
         std::vector<ConvShapes>{{{2, 3, 7, 9}, {4, 3, 3, 3}, 1, 1}, {{2, 3, 7, 9}, {4, 3, 5, 2}, 2, 2}}) {
      INFO(describe(s) << " " << dtype_name(dtype));
      const Tensor x = random_tensor(s.input, ++seed, dtype);
      const Tensor w = random_tensor(s.weight, ++seed, dtype);
      const Tensor b = random_tensor({s.weight[0]}, ++seed, dtype);
      const Tensor g = random_tensor(s.output(), ++seed, dtype);
      const Conv2dParams p{s.stride, s.padding};
      const Tensor x32 = x.to(DType::f32), w32 = w.to(DType::f32), b32 = b.to(DType::f32),
                   g32 = g.to(DType::f32);
      const Tensor y = conv2d(x, w, b, p);
      CHECK(y.dtype() == dtype);
      check_close(y, conv2d(x32, w32, b32, p), default_tolerance(dtype));
      const Tensor gi = conv2d_backward_input(g, w, s.input, p);
      CHECK(gi.dtype() == dtype);
      check_close(gi, conv2d_backward_input(g32, w32, s.input, p), default_tolerance(dtype));
      const Tensor gw = conv2d_backward_weight(g, x, s.weight, p);
      CHECK(gw.dtype() == dtype);
      check_close(gw, conv2d_backward_weight(g32, x32, s.weight, p), default_tolerance(dtype));
    }
  }
}

TEST_CASE("conv2d with a kernel exactly as large as the padded input gives one pixel", "[linalg]") {
  const Tensor x = random_tensor({1, 2, 3, 3}, 3101, DType::f64);
  const Tensor w = random_tensor({1, 2, 5, 5}, 3102, DType::f64);
  const ConvShapes s{{1, 2, 3, 3}, {1, 2, 5, 5}, 1, 1};
  const Tensor y = conv2d(x, w, {}, {1, 1});
  CHECK(y.shape() == Shape{1, 1, 1, 1});
  check_close(y, naive_conv(s, values(x), values(w), {}));
  // Non-contiguous operands are accepted (made contiguous first).
  const Tensor xt = random_strided({2, 3, 9, 7}, 3103, DType::f64);
  const Tensor wt = random_strided({4, 3, 3, 3}, 3104, DType::f64);
  const ConvShapes st{{2, 3, 9, 7}, {4, 3, 3, 3}, 2, 1};
  check_close(conv2d(xt, wt, {}, {2, 1}), naive_conv(st, values(xt), values(wt), {}));
}

TEST_CASE("conv2d errors", "[linalg]") {
  const Tensor x = empty({2, 3, 7, 9});
  const Tensor w = empty({4, 3, 3, 3});
  CHECK_THROWS_ERROR(conv2d(empty({3, 7, 9}), w),
                     "conv2d: input [N, C, H, W] must be 4-D, got shape [3, 7, 9]");
  CHECK_THROWS_ERROR(conv2d(x, empty({4, 3, 3})),
                     "conv2d: weight [O, C, KH, KW] must be 4-D, got shape [4, 3, 3]");
  CHECK_THROWS_ERROR(conv2d(x, empty({4, 2, 3, 3})),
                     "conv2d: input [2, 3, 7, 9] has 3 channels but weight [4, 2, 3, 3] expects 2");
  CHECK_THROWS_ERROR(conv2d(empty({1, 1, 3, 3}), empty({1, 1, 5, 5})),
                     "conv2d: kernel size 5 does not fit input size 3 with padding 0");
  CHECK_THROWS_ERROR(conv2d(empty({1, 1, 8, 3}), empty({1, 1, 2, 6}), {}, {1, 1}),
                     "conv2d: kernel size 6 does not fit input size 3 with padding 1");
  CHECK_THROWS_ERROR(conv2d(x, w, {}, {0, 0}), "conv2d: stride must be at least 1, got 0");
  CHECK_THROWS_ERROR(conv2d(x, w, {}, {-2, 0}), "conv2d: stride must be at least 1, got -2");
  CHECK_THROWS_ERROR(conv2d(x, w, {}, {1, -1}), "conv2d: padding must be non-negative, got -1");
  CHECK_THROWS_ERROR(conv2d(x, w, empty({3})),
                     "conv2d: bias has shape [3] but weight [4, 3, 3, 3] needs [4]");
  CHECK_THROWS_ERROR(conv2d(x, empty({4, 3, 3, 3}, dtype(DType::f64))),
                     "conv2d: dtypes differ (f32 and f64)");
  CHECK_THROWS_ERROR(conv2d(x, w, empty({4}, dtype(DType::bf16))), "conv2d: dtypes differ (f32 and bf16)");
  CHECK_THROWS_ERROR(conv2d(empty({2, 3, 7, 9}, dtype(DType::i32)), empty({4, 3, 3, 3}, dtype(DType::i32))),
                     "conv2d: needs a floating dtype, got i32");
  CHECK_THROWS_ERROR(conv2d(Tensor{}, w), "conv2d: input tensor is undefined");
  CHECK_THROWS_ERROR(conv2d(x, Tensor{}), "conv2d: weight tensor is undefined");
  // Gradients: grad_output must have the forward output's shape ([2, 4, 5, 7] here).
  CHECK_THROWS_ERROR(
      conv2d_backward_input(empty({2, 4, 5, 5}), w, {2, 3, 7, 9}),
      "conv2d_backward_input: grad_output has shape [2, 4, 5, 5] but the forward output was [2, 4, 5, 7]");
  CHECK_THROWS_ERROR(
      conv2d_backward_weight(empty({2, 4, 5, 5}), x, {4, 3, 3, 3}),
      "conv2d_backward_weight: grad_output has shape [2, 4, 5, 5] but the forward output was [2, 4, 5, 7]");
  CHECK_THROWS_ERROR(
      conv2d_backward_input(empty({2, 4, 5, 7}), w, {2, 2, 7, 9}),
      "conv2d_backward_input: input [2, 2, 7, 9] has 2 channels but weight [4, 3, 3, 3] expects 3");
  CHECK_THROWS_ERROR(conv2d_backward_weight(empty({2, 4, 5, 7}), x, {4, 3, 3}),
                     "conv2d_backward_weight: weight [O, C, KH, KW] must be 4-D, got shape [4, 3, 3]");
  CHECK_THROWS_ERROR(conv2d_backward_input(empty({2, 4, 5, 7}, dtype(DType::f64)), w, {2, 3, 7, 9}),
                     "conv2d_backward_input: dtypes differ (f64 and f32)");
  CHECK_THROWS_ERROR(conv2d_backward_input(Tensor{}, w, {2, 3, 7, 9}),
                     "conv2d_backward_input: grad_output tensor is undefined");
  CHECK_THROWS_ERROR(conv2d_backward_weight(empty({2, 4, 5, 7}), Tensor{}, {4, 3, 3, 3}),
                     "conv2d_backward_weight: input tensor is undefined");
}

// --- max_pool2d ------------------------------------------------------------------------------

TEST_CASE("max_pool2d values and flat indices match a naive window scan", "[linalg]") {
  struct PoolCase {
    std::int64_t kernel, stride, padding;
  };
  std::uint64_t seed = 3200;
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (const PoolCase& c :
         std::vector<PoolCase>{{2, 2, 0}, {3, 2, 1}, {3, 1, 1}, {2, 1, 0}, {3, 3, 0}, {2, 2, 1}}) {
      for (const Shape& shape : std::vector<Shape>{{2, 3, 7, 9}, {1, 2, 8, 8}, {1, 1, 3, 13}}) {
        INFO(dtype_name(dtype) << " " << shape_str(shape) << " kernel " << c.kernel << " stride " << c.stride
                               << " padding " << c.padding);
        const Tensor x = random_tensor(shape, ++seed, dtype);
        const MaxPool2dResult r = max_pool2d(x, {c.kernel, c.stride, c.padding});
        const Pooled e = naive_max_pool(values(x), shape, c.kernel, c.stride, c.padding);
        const std::int64_t oh = (shape[2] + 2 * c.padding - c.kernel) / c.stride + 1;
        const std::int64_t ow = (shape[3] + 2 * c.padding - c.kernel) / c.stride + 1;
        CHECK(r.values.shape() == Shape{shape[0], shape[1], oh, ow});
        CHECK(r.indices.shape() == r.values.shape());
        CHECK(r.values.dtype() == dtype);
        CHECK(r.indices.dtype() == DType::i64);
        check_equal(r.values, e.values);
        check_equal(r.indices, e.indices);
      }
    }
  }
  // stride 0 means stride = kernel_size.
  const Tensor x = random_tensor({1, 1, 6, 6}, 3299);
  check_equal(max_pool2d(x, {3, 0, 0}).indices, values(max_pool2d(x, {3, 3, 0}).indices));
  CHECK(max_pool2d(x, {3, 0, 0}).values.shape() == Shape{1, 1, 2, 2});
  // Integer inputs pool too.
  const Tensor ints =
      from_vector<std::int32_t>({1, 5, 2, 2, 7, 0, 3, 3, 4, 4, 9, 9, 1, 8, 0, 9}, {1, 1, 4, 4});
  const MaxPool2dResult ri = max_pool2d(ints, {2, 2, 0});
  CHECK(ri.values.dtype() == DType::i32);
  check_equal(ri.values, {7, 3, 8, 9});
  check_equal(ri.indices, {4, 6, 13, 10});
}

TEST_CASE("max_pool2d picks the first maximum on ties and NaN over everything", "[linalg]") {
  // All equal: each window's first in-image element (row-major) wins.
  const MaxPool2dResult flat = max_pool2d(zeros({1, 1, 4, 4}), {2, 2, 0});
  check_equal(flat.indices, {0, 2, 8, 10});
  const MaxPool2dResult padded = max_pool2d(zeros({1, 1, 5, 5}), {3, 2, 1});
  // Windows start at rows/cols -1, 1, 3; clipped to 0, 1, 3.
  check_equal(padded.indices, {0, 1, 3, 5, 6, 8, 15, 16, 18});
  check_equal(padded.values, std::vector<double>(9, 0.0));
  // All -inf: -inf at the first position.
  const MaxPool2dResult minus = max_pool2d(full({1, 1, 2, 2}, -kInf), {2, 2, 0});
  check_equal(minus.values, {-kInf});
  check_equal(minus.indices, {0});
  // NaN beats every number, the first NaN wins.
  for (const DType dtype : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dtype));
    const Tensor x = from_vector<double>({1, kNaN, 5, 2,        //
                                          kInf, 3, kNaN, kNaN,  //
                                          0, 0, 1, 2,           //
                                          3, 4, 5, 6},
                                         {1, 1, 4, 4})
                         .to(dtype);
    const MaxPool2dResult r = max_pool2d(x, {2, 2, 0});
    check_equal(r.values, {kNaN, kNaN, 4, 6});
    check_equal(r.indices, {1, 6, 13, 15});
  }
  // Planes wide enough for the vectorised 2x2 path (and its remainder), values from a small set so
  // that ties are everywhere, with NaNs and infinities sprinkled in.
  for (const Shape& shape : std::vector<Shape>{{1, 2, 6, 70}, {2, 1, 4, 34}}) {
    INFO(shape_str(shape));
    std::vector<double> x(static_cast<std::size_t>(shape_numel(shape)));
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::size_t r = i * 2654435761u % 97;
      x[i] = r < 3 ? kNaN : r < 5 ? kInf : r < 7 ? -kInf : static_cast<double>(r % 4);
    }
    const MaxPool2dResult r = max_pool2d(from_vector<double>(x, shape).to(DType::f32), {2, 2, 0});
    const Pooled e = naive_max_pool(x, shape, 2, 2, 0);
    check_equal(r.values, e.values);
    check_equal(r.indices, e.indices);
  }
}

TEST_CASE("max_pool2d_backward scatters and accumulates gradients at the maxima", "[linalg]") {
  // Overlapping windows (kernel 3, stride 2) on a 5x5 plane whose maximum is the centre:
  // all four windows pick it, so it receives the sum of their gradients.
  std::vector<float> plane(25, 0.0f);
  for (std::size_t i = 0; i < plane.size(); ++i) plane[i] = static_cast<float>(i % 7) * 0.1f;
  plane[12] = 10.0f;
  const Tensor x = from_vector<float>(plane, {1, 1, 5, 5});
  const MaxPool2dResult r = max_pool2d(x, {3, 2, 0});
  check_equal(r.indices, {12, 12, 12, 12});
  const Tensor g = from_vector<float>({1, 2, 3, 4.5f}, {1, 1, 2, 2});
  const Tensor gi = max_pool2d_backward(g, r.indices, {1, 1, 5, 5});
  CHECK(gi.shape() == Shape{1, 1, 5, 5});
  CHECK(gi.dtype() == DType::f32);
  std::vector<double> expected(25, 0.0);
  expected[12] = 10.5;
  check_equal(gi, expected);

  // In bf16 the sum must not be rounded after every addition: with kernel 3, stride 1,
  // padding 1 the centre of a 5x5 plane is picked by 9 windows whose gradients are 256,
  // seven 1s and -256 (in that order). Their sum, 7, is exact in bf16, but 256 + 1 rounds
  // back to 256 in bf16, so accumulating in bf16 gives 0. matmul and conv accumulate
  // 16-bit floats in f32; this should too.
  const Tensor peak = from_vector<float>(plane, {1, 1, 5, 5}).to(DType::bf16);
  const MaxPool2dResult all_nine = max_pool2d(peak, {3, 1, 1});
  std::vector<float> window_grads(25, 0.0f);
  const std::vector<std::size_t> centre_windows{6, 7, 8, 11, 12, 13, 16, 17, 18};  // output (1..3, 1..3)
  for (const std::size_t j : centre_windows) window_grads[j] = 1.0f;
  window_grads[6] = 256.0f;
  window_grads[18] = -256.0f;
  for (const std::size_t j : centre_windows) REQUIRE(all_nine.indices.to_vector<std::int64_t>()[j] == 12);
  const Tensor bf16_grad = max_pool2d_backward(from_vector<float>(window_grads, {1, 1, 5, 5}).to(DType::bf16),
                                               all_nine.indices, {1, 1, 5, 5});
  CHECK(bf16_grad.to_vector<double>()[12] == 7.0);

  // Random inputs: the gradient is the naive scatter-sum at the naive argmax positions.
  std::uint64_t seed = 3300;
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    for (const MaxPool2dParams p :
         {MaxPool2dParams{3, 2, 1}, MaxPool2dParams{2, 2, 0}, MaxPool2dParams{3, 1, 1}}) {
      INFO(dtype_name(dtype) << " kernel " << p.kernel_size << " stride " << p.stride << " padding "
                             << p.padding);
      const Shape shape{2, 3, 7, 9};
      const Tensor input = random_tensor(shape, ++seed, dtype);
      const MaxPool2dResult pooled = max_pool2d(input, p);
      const Tensor grad = random_tensor(pooled.values.shape(), ++seed, dtype);
      const Pooled e = naive_max_pool(values(input), shape, p.kernel_size, p.stride, p.padding);
      const std::vector<double> gv = values(grad);
      std::vector<double> scattered(static_cast<std::size_t>(shape_numel(shape)), 0.0);
      const std::int64_t per_plane = pooled.values.size(2) * pooled.values.size(3);
      for (std::size_t j = 0; j < gv.size(); ++j) {
        const auto plane_index = static_cast<std::int64_t>(j) / per_plane;
        scattered[static_cast<std::size_t>(plane_index * 63 + static_cast<std::int64_t>(e.indices[j]))] +=
            gv[j];
      }
      const Tensor result = max_pool2d_backward(grad, pooled.indices, shape);
      CHECK(result.dtype() == dtype);
      check_close(result, scattered);
    }
  }
}

TEST_CASE("max_pool2d errors", "[linalg]") {
  const Tensor x = empty({2, 3, 7, 9});
  CHECK_THROWS_ERROR(max_pool2d(empty({3, 7, 9})),
                     "max_pool2d: input [N, C, H, W] must be 4-D, got shape [3, 7, 9]");
  CHECK_THROWS_ERROR(max_pool2d(x, {3, 2, 2}),
                     "max_pool2d: padding must be between 0 and half the kernel size 3, got 2");
  CHECK_THROWS_ERROR(max_pool2d(x, {2, 2, -1}),
                     "max_pool2d: padding must be between 0 and half the kernel size 2, got -1");
  CHECK_THROWS_ERROR(max_pool2d(x, {0, 1, 0}), "max_pool2d: kernel_size must be at least 1, got 0");
  CHECK_THROWS_ERROR(max_pool2d(x, {2, -1, 0}), "max_pool2d: stride must be at least 1, got -1");
  CHECK_THROWS_ERROR(max_pool2d(empty({1, 1, 2, 5}), {3, 1, 0}),
                     "max_pool2d: kernel size 3 does not fit input size 2 with padding 0");
  CHECK_THROWS_ERROR(max_pool2d(empty({1, 1, 2, 2}, dtype(DType::boolean))),
                     "max_pool2d: not defined for bool tensors");
  CHECK_THROWS_ERROR(max_pool2d(Tensor{}), "max_pool2d: input tensor is undefined");
  // Backward: grad_output and indices must match each other and the input's N and C.
  const Tensor idx = zeros({1, 1, 2, 2}, dtype(DType::i64));
  CHECK_THROWS_ERROR(
      max_pool2d_backward(empty({1, 1, 2, 2}), zeros({1, 1, 3, 3}, dtype(DType::i64)), {1, 1, 4, 4}),
      "max_pool2d_backward: grad_output [1, 1, 2, 2] and indices [1, 1, 3, 3] do not match input [1, 1, 4, "
      "4]");
  CHECK_THROWS_ERROR(max_pool2d_backward(empty({1, 1, 2, 2}), idx, {1, 2, 4, 4}),
                     "max_pool2d_backward: grad_output [1, 1, 2, 2] and indices [1, 1, 2, 2] do not match "
                     "input [1, 2, 4, 4]");
  CHECK_THROWS_ERROR(
      max_pool2d_backward(empty({1, 1, 2, 2}), zeros({1, 1, 2, 2}, dtype(DType::i32)), {1, 1, 4, 4}),
      "max_pool2d_backward: indices must be i64, got i32");
  CHECK_THROWS_ERROR(
      max_pool2d_backward(empty({1, 1, 2, 2}), full({1, 1, 2, 2}, 16, dtype(DType::i64)), {1, 1, 4, 4}),
      "max_pool2d_backward: index 16 is out of range for an input plane of size 16");
  CHECK_THROWS_ERROR(
      max_pool2d_backward(empty({1, 1, 2, 2}), full({1, 1, 2, 2}, -1, dtype(DType::i64)), {1, 1, 4, 4}),
      "max_pool2d_backward: index -1 is out of range for an input plane of size 16");
  CHECK_THROWS_ERROR(max_pool2d_backward(empty({1, 1, 2, 2}), idx, {1, 4, 4}),
                     "max_pool2d_backward: input shape must be 4-D, got shape [1, 4, 4]");
  CHECK_THROWS_ERROR(max_pool2d_backward(Tensor{}, idx, {1, 1, 4, 4}),
                     "max_pool2d_backward: grad_output tensor is undefined");
}

}  // namespace shardlab::test

namespace shardlab::test {

TEST_CASE("large matmuls split over threads match a naive product in every layout",
          "[linalg][matmul][threads]") {
  // Big enough for core/cpu/gemm.h to cut C into row blocks (m >= n) or column blocks.
  const int original = num_threads();
  set_num_threads(3);
  for (const auto& [m, k, n] : std::vector<std::array<std::int64_t, 3>>{{300, 70, 130}, {90, 40, 330}}) {
    for (const bool transpose_a : {false, true}) {
      for (const bool transpose_b : {false, true}) {
        const Tensor a = transpose_a ? random_tensor({k, m}, 1, DType::f64).transpose(0, 1)
                                     : random_tensor({m, k}, 1, DType::f64);
        const Tensor b = transpose_b ? random_tensor({n, k}, 2, DType::f64).transpose(0, 1)
                                     : random_tensor({k, n}, 2, DType::f64);
        const std::vector<double> av = values(a), bv = values(b);
        std::vector<double> expected(static_cast<std::size_t>(m * n), 0.0);
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j)
            for (std::int64_t p = 0; p < k; ++p) expected[i * n + j] += av[i * k + p] * bv[p * n + j];
        INFO("m=" << m << " k=" << k << " n=" << n << " ta=" << transpose_a << " tb=" << transpose_b);
        check_close(matmul(a, b), expected);
      }
    }
  }
  set_num_threads(original);
}

TEST_CASE("matmul gives the same bits on any number of threads", "[linalg][matmul][threads]") {
  // Cut into 4 row blocks, 3 column blocks, and one call; both operand layouts. OpenBLAS's kernels
  // for some processors round a row differently inside a larger call, so this fails wherever the
  // blocks follow the thread count.
  const int original = num_threads();
  for (const auto& [m, k, n] :
       std::vector<std::array<std::int64_t, 3>>{{600, 130, 300}, {90, 200, 700}, {40, 30, 50}}) {
    for (const bool transpose_b : {false, true}) {
      INFO("m=" << m << " k=" << k << " n=" << n << " tb=" << transpose_b);
      const Tensor a = random_tensor({m, k}, 11, DType::f32);
      const Tensor b = transpose_b ? random_tensor({n, k}, 12, DType::f32).transpose(0, 1)
                                   : random_tensor({k, n}, 12, DType::f32);
      std::vector<std::vector<double>> products;
      for (const int threads : {1, 2, 3, 5}) {
        set_num_threads(threads);
        products.push_back(values(matmul(a, b)));
      }
      set_num_threads(original);
      for (std::size_t i = 1; i < products.size(); ++i) CHECK(products[i] == products[0]);
    }
  }
}

}  // namespace shardlab::test
