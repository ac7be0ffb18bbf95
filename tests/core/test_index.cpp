// tests/core/test_index.cpp: embedding, index_select, gather/scatter/index_add, cat/stack/split, triu,
// targets.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/check.h"

namespace shardlab::test {
namespace {

// Back from coordinates to the row-major position.
std::size_t flat_index(const std::vector<std::int64_t>& c, const Shape& shape) {
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + c[d];
  return static_cast<std::size_t>(flat);
}

// Random integers in [0, high) as i64 (repeats are likely for small high).
Tensor random_indices(const Shape& shape, std::uint64_t seed, std::int64_t high) {
  return random_tensor(shape, seed, DType::f64, 0, static_cast<double>(high)).to(DType::i64);
}

// index_select by hand: out[..., j, ...] = x[..., index[j], ...] along dim.
std::vector<double> naive_index_select(const Tensor& x, std::int64_t dim, const std::vector<double>& index) {
  Shape out_shape = x.shape();
  out_shape[static_cast<std::size_t>(dim)] = static_cast<std::int64_t>(index.size());
  const std::vector<double> xv = values(x);
  std::vector<double> out;
  for (std::int64_t i = 0; i < shape_numel(out_shape); ++i) {
    std::vector<std::int64_t> c = coordinates(i, out_shape);
    c[static_cast<std::size_t>(dim)] =
        static_cast<std::int64_t>(index[static_cast<std::size_t>(c[static_cast<std::size_t>(dim)])]);
    out.push_back(xv[flat_index(c, x.shape())]);
  }
  return out;
}

// gather by hand: out[c] = x[c with c[dim] = index[c]].
std::vector<double> naive_gather(const Tensor& x, std::int64_t dim, const Tensor& index) {
  const std::vector<double> xv = values(x), iv = values(index);
  std::vector<double> out;
  for (std::int64_t i = 0; i < index.numel(); ++i) {
    std::vector<std::int64_t> c = coordinates(i, index.shape());
    c[static_cast<std::size_t>(dim)] = static_cast<std::int64_t>(iv[static_cast<std::size_t>(i)]);
    out.push_back(xv[flat_index(c, x.shape())]);
  }
  return out;
}

// scatter_add by hand: out = self; out[c with c[dim] = index[c]] += src[c] for every c of index.
std::vector<double> naive_scatter_add(const Tensor& self, std::int64_t dim, const Tensor& index,
                                      const Tensor& src) {
  std::vector<double> out = values(self);
  const std::vector<double> iv = values(index), sv = values(src);
  for (std::int64_t i = 0; i < index.numel(); ++i) {
    const std::vector<std::int64_t> c = coordinates(i, index.shape());
    std::vector<std::int64_t> target = c;
    target[static_cast<std::size_t>(dim)] = static_cast<std::int64_t>(iv[static_cast<std::size_t>(i)]);
    out[flat_index(target, self.shape())] += sv[flat_index(c, src.shape())];
  }
  return out;
}

// index_add by hand: out = self; out.select(dim, index[j]) += src.select(dim, j).
std::vector<double> naive_index_add(const Tensor& self, std::int64_t dim, const std::vector<double>& index,
                                    const Tensor& src) {
  std::vector<double> out = values(self);
  const std::vector<double> sv = values(src);
  for (std::int64_t i = 0; i < src.numel(); ++i) {
    std::vector<std::int64_t> c = coordinates(i, src.shape());
    c[static_cast<std::size_t>(dim)] =
        static_cast<std::int64_t>(index[static_cast<std::size_t>(c[static_cast<std::size_t>(dim)])]);
    out[flat_index(c, self.shape())] += sv[static_cast<std::size_t>(i)];
  }
  return out;
}

}  // namespace

// --- embedding -------------------------------------------------------------------------------

TEST_CASE("embedding picks rows for i64 and i32 indices of any shape", "[index]") {
  for (const DType dtype : {DType::f32, DType::bf16, DType::f64}) {
    const Tensor weight = random_tensor({10, 3}, 4000, dtype);
    const std::vector<double> w = values(weight);
    const std::vector<std::int64_t> ids{7, 0, 7, 9, 3, 0};
    for (const DType index_dtype : {DType::i64, DType::i32}) {
      INFO(dtype_name(dtype) << " indices " << dtype_name(index_dtype));
      const Tensor indices = from_vector<std::int64_t>(ids, {2, 3}).to(index_dtype);
      const Tensor out = embedding(weight, indices);
      CHECK(out.shape() == Shape{2, 3, 3});
      CHECK(out.dtype() == dtype);
      std::vector<double> expected;
      for (const std::int64_t id : ids) {
        for (std::int64_t d = 0; d < 3; ++d) expected.push_back(w[static_cast<std::size_t>(id * 3 + d)]);
      }
      check_equal(out, expected);
    }
  }
  // A 0-d index gives one row; no indices give no rows.
  const Tensor weight = random_tensor({4, 5}, 4001, DType::f32);
  const Tensor row = embedding(weight, scalar_tensor(2, dtype(DType::i64)));
  CHECK(row.shape() == Shape{5});
  check_equal(row, values(weight.select(0, 2)));
  CHECK(embedding(weight, empty({0}, dtype(DType::i64))).shape() == Shape{0, 5});
  // A non-contiguous weight.
  const Tensor wt = random_strided({6, 4}, 4002, DType::f32);
  check_equal(embedding(wt, from_vector<std::int32_t>({5, 1})), naive_index_select(wt, 0, {5, 1}));
}

TEST_CASE("embedding_backward sums the gradient rows of repeated indices", "[index]") {
  for (const DType index_dtype : {DType::i64, DType::i32}) {
    INFO(dtype_name(index_dtype));
    const std::vector<std::int64_t> ids{7, 0, 7, 9, 3, 7};
    const Tensor indices = from_vector<std::int64_t>(ids, {3, 2}).to(index_dtype);
    const Tensor grad = random_tensor({3, 2, 4}, 4100, DType::f64);
    const Tensor table = embedding_backward(grad, indices, 10);
    CHECK(table.shape() == Shape{10, 4});
    CHECK(table.dtype() == DType::f64);
    const std::vector<double> g = values(grad);
    std::vector<double> expected(40, 0.0);
    for (std::size_t r = 0; r < ids.size(); ++r) {
      for (std::size_t d = 0; d < 4; ++d) expected[static_cast<std::size_t>(ids[r]) * 4 + d] += g[r * 4 + d];
    }
    check_close(table, expected);
    // Rows never indexed are exactly zero.
    check_equal(table.select(0, 1), {0, 0, 0, 0});
  }
  // Adjoint of embedding: <embedding(W, i), G> == <W, embedding_backward(G, i, V)>.
  const Tensor w = random_tensor({12, 5}, 4101, DType::f64);
  const Tensor i = random_indices({4, 7}, 4102, 12);
  const Tensor g = random_tensor({4, 7, 5}, 4103, DType::f64);
  CHECK(std::abs(dot(values(embedding(w, i)), values(g)) -
                 dot(values(w), values(embedding_backward(g, i, 12)))) <= 1e-12);
}

TEST_CASE("embedding_backward and scatter_add in bf16 do not round after every addition", "[index]") {
  // 1000 gradient rows of 0.01 (0.010009765625 in bf16) for the same index: the sum is
  // 10.0098 and rounds to 10 in bf16. Accumulating in bf16 instead stalls near 4, where
  // adding 0.01 no longer changes a bf16 value (half its spacing is 0.0156).
  const Tensor grad = full({1000, 1}, 0.01, dtype(DType::bf16));
  const Tensor table = embedding_backward(grad, zeros({1000}, dtype(DType::i64)), 2);
  CHECK(table.dtype() == DType::bf16);
  check_close(table, {1000 * 0.010009765625, 0});
  const Tensor scattered =
      scatter_add(zeros({1, 1}, dtype(DType::bf16)), 1, zeros({1, 1000}, dtype(DType::i64)),
                  full({1, 1000}, 0.01, dtype(DType::bf16)));
  check_close(scattered, {1000 * 0.010009765625});
}

TEST_CASE("embedding errors", "[index]") {
  const Tensor weight = zeros({10, 3});
  // The message names the op the user called, the bad index and the table size.
  CHECK_THROWS_ERROR(embedding(weight, from_vector<std::int64_t>({1, 10}, {1, 2})),
                     "embedding: index 10 is out of range for the embedding table of size 10");
  CHECK_THROWS_ERROR(embedding(weight, from_vector<std::int32_t>({-1})),
                     "embedding: index -1 is out of range for the embedding table of size 10");
  CHECK_THROWS_ERROR(embedding(weight, from_vector<float>({1})),
                     "embedding: indices must be i64 or i32, got f32");
  CHECK_THROWS_ERROR(embedding(zeros({10}), from_vector<std::int64_t>({1})),
                     "embedding: weight must be 2-D [num_embeddings, dim], got [10]");
  CHECK_THROWS_ERROR(embedding(Tensor{}, from_vector<std::int64_t>({1})),
                     "embedding: weight tensor is undefined");
  CHECK_THROWS_ERROR(embedding(weight, Tensor{}), "embedding: indices tensor is undefined");
  CHECK_THROWS_ERROR(
      embedding_backward(zeros({2, 3, 4}), zeros({3, 2}, dtype(DType::i64)), 10),
      "embedding_backward: grad [2, 3, 4] does not match indices [3, 2] plus an embedding dim");
  CHECK_THROWS_ERROR(embedding_backward(zeros({2, 4}), from_vector<std::int64_t>({3, 10}), 10),
                     "embedding_backward: index 10 is out of range for the embedding table of size 10");
  CHECK_THROWS_ERROR(embedding_backward(zeros({2, 4}), from_vector<std::int64_t>({3, 1}), -1),
                     "embedding_backward: num_embeddings must be non-negative, got -1");
}

// --- index_select ----------------------------------------------------------------------------

TEST_CASE("index_select along dims 0, 1, 2 and negative dims", "[index]") {
  const Tensor x = random_tensor({4, 5, 6}, 4200, DType::f32);
  for (const std::int64_t dim : {0, 1, 2, -1, -3}) {
    for (const DType index_dtype : {DType::i64, DType::i32}) {
      INFO("dim " << dim << " " << dtype_name(index_dtype));
      const std::int64_t d = dim < 0 ? dim + 3 : dim;
      const std::vector<double> picks{3, 0, 3, 1};
      const Tensor index = from_vector<double>(picks).to(index_dtype);
      const Tensor y = index_select(x, dim, index);
      Shape expected_shape = x.shape();
      expected_shape[static_cast<std::size_t>(d)] = 4;
      CHECK(y.shape() == expected_shape);
      check_equal(y, naive_index_select(x, d, picks));
    }
  }
  // Non-contiguous input, integer dtype, and an empty index.
  const Tensor t = random_strided({5, 7}, 4201, DType::f64);
  check_equal(index_select(t, 1, from_vector<std::int64_t>({6, 6, 0})), naive_index_select(t, 1, {6, 6, 0}));
  const Tensor ints = arange(12).reshape({3, 4});
  const Tensor picked = index_select(ints, 0, from_vector<std::int64_t>({2, 0}));
  CHECK(picked.dtype() == DType::i64);
  check_equal(picked, {8, 9, 10, 11, 0, 1, 2, 3});
  CHECK(index_select(ints, 1, empty({0}, dtype(DType::i64))).shape() == Shape{3, 0});
}

TEST_CASE("index_select errors", "[index]") {
  const Tensor x = zeros({3, 5});
  CHECK_THROWS_ERROR(index_select(x, 1, from_vector<std::int64_t>({0, 5})),
                     "index_select: index 5 is out of range for the dimension of size 5");
  CHECK_THROWS_ERROR(index_select(x, 0, from_vector<std::int64_t>({-1})),
                     "index_select: index -1 is out of range for the dimension of size 3");
  CHECK_THROWS_ERROR(index_select(x, 0, zeros({2, 2}, dtype(DType::i64))),
                     "index_select: index must be 1-D, got shape [2, 2]");
  CHECK_THROWS_ERROR(index_select(x, 2, from_vector<std::int64_t>({0})),
                     "index_select: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(index_select(x, 0, from_vector<double>({0})),
                     "index_select: indices must be i64 or i32, got f64");
}

// --- gather and scatter_add ------------------------------------------------------------------

TEST_CASE("gather along dims 0 and 1 with an index smaller than the data", "[index]") {
  const Tensor x = random_tensor({3, 4}, 4300, DType::f32);
  // dim 1: out[i][j] = x[i][index[i][j]]; the index covers 2 of the 3 rows.
  const Tensor i1 = from_vector<std::int64_t>({3, 3, 0, 1, 2, 3}, {2, 3});
  const Tensor g1 = gather(x, 1, i1);
  CHECK(g1.shape() == Shape{2, 3});
  const std::vector<double> xv = values(x);
  check_equal(g1, {xv[3], xv[3], xv[0], xv[5], xv[6], xv[7]});
  // dim 0: out[i][j] = x[index[i][j]][j]; index longer along dim than x, narrower elsewhere.
  const Tensor i0 = from_vector<std::int32_t>({2, 0, 1, 1, 2, 2, 0, 0}, {4, 2});
  const Tensor g0 = gather(x, 0, i0);
  CHECK(g0.shape() == Shape{4, 2});
  check_equal(g0, {xv[8], xv[1], xv[4], xv[5], xv[8], xv[9], xv[0], xv[1]});
  check_equal(gather(x, -1, i1), values(g1));
  // 3-D random against the naive loop, every dim, non-contiguous data.
  const Tensor y = random_strided({3, 5, 4}, 4301, DType::f64);
  for (const std::int64_t dim : {0, 1, 2}) {
    INFO("dim " << dim);
    Shape index_shape{2, 4, 3};
    index_shape[static_cast<std::size_t>(dim)] = 6;
    const Tensor index = random_indices(index_shape, 4302 + static_cast<std::uint64_t>(dim), y.size(dim));
    const Tensor out = gather(y, dim, index);
    CHECK(out.shape() == index_shape);
    check_equal(out, naive_gather(y, dim, index));
  }
}

TEST_CASE("scatter_add accumulates repeated indices along dims 0 and 1", "[index]") {
  const Tensor self = from_vector<double>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {2, 5});
  // dim 1: row 0 adds 10 and 20 to column 4 and 30 to column 0; row 1 adds 1, 2, 3 to column 2.
  const Tensor index = from_vector<std::int64_t>({4, 4, 0, 2, 2, 2}, {2, 3});
  const Tensor src = from_vector<double>({10, 20, 30, 99, 1, 2, 3, 99}, {2, 4});  // wider than index
  const Tensor out = scatter_add(self, 1, index, src);
  CHECK(out.shape() == Shape{2, 5});
  check_equal(out, {31, 2, 3, 4, 35, 6, 7, 14, 9, 10});
  // self is unchanged.
  check_equal(self, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  // dim 0: out[index[i][j]][j] += src[i][j]: 100 goes to row 1, the rest to row 0 (column 1 twice).
  const Tensor index0 = from_vector<std::int64_t>({1, 0, 0, 0}, {2, 2});
  const Tensor src0 = from_vector<double>({100, 200, 300, 400}, {2, 2});
  check_equal(scatter_add(self, 0, index0, src0), {301, 602, 3, 4, 5, 106, 7, 8, 9, 10});
  // Random 3-D cases along every dim against the naive loop; src may be a different dtype.
  for (const std::int64_t dim : {0, 1, 2, -1}) {
    INFO("dim " << dim);
    const std::int64_t d = dim < 0 ? dim + 3 : dim;
    const Tensor base = random_tensor({3, 5, 4}, 4400 + static_cast<std::uint64_t>(d), DType::f64);
    Shape index_shape{2, 4, 3};
    index_shape[static_cast<std::size_t>(d)] = 7;
    const Tensor idx = random_indices(index_shape, 4410 + static_cast<std::uint64_t>(d), base.size(d));
    Shape src_shape{3, 5, 4};
    src_shape[static_cast<std::size_t>(d)] = 7;
    const Tensor source = random_tensor(src_shape, 4430 + static_cast<std::uint64_t>(d), DType::f32);
    const Tensor result = scatter_add(base, dim, idx, source);
    CHECK(result.dtype() == DType::f64);
    check_close(result, naive_scatter_add(base, d, idx, source));
  }
}

TEST_CASE("gather and scatter_add are adjoint", "[index]") {
  // <gather(x, d, i), y> == <x, scatter_add(zeros, d, i, y)> for every dim.
  for (const std::int64_t dim : {0, 1, 2}) {
    INFO("dim " << dim);
    const Tensor x = random_tensor({4, 5, 6}, 4500 + static_cast<std::uint64_t>(dim), DType::f64);
    Shape index_shape{3, 4, 5};
    index_shape[static_cast<std::size_t>(dim)] = 9;  // more picks than the dim: repeats
    const Tensor i = random_indices(index_shape, 4510 + static_cast<std::uint64_t>(dim), x.size(dim));
    const Tensor y = random_tensor(index_shape, 4520 + static_cast<std::uint64_t>(dim), DType::f64);
    const double left = dot(values(gather(x, dim, i)), values(y));
    const double right = dot(values(x), values(scatter_add(zeros_like(x), dim, i, y)));
    CHECK(std::abs(left) > 1e-3);
    CHECK(std::abs(left - right) <= 1e-12 * (1 + std::abs(left)));
  }
}

TEST_CASE("gather and scatter_add errors", "[index]") {
  const Tensor x = zeros({3, 4});
  CHECK_THROWS_ERROR(gather(x, 1, from_vector<std::int64_t>({0})),
                     "gather: index [1] must have the same rank as [3, 4]");
  CHECK_THROWS_ERROR(gather(x, 1, zeros({4, 2}, dtype(DType::i64))),
                     "gather: index [4, 2] is larger than [3, 4] in dimension 0");
  CHECK_THROWS_ERROR(gather(x, 1, full({1, 1}, 4, dtype(DType::i64))),
                     "gather: index 4 is out of range for the dimension of size 4");
  CHECK_THROWS_ERROR(gather(x, 2, zeros({1, 1}, dtype(DType::i64))),
                     "gather: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(gather(x, 0, zeros({1, 1}, dtype(DType::u8))),
                     "gather: indices must be i64 or i32, got u8");
  CHECK_THROWS_ERROR(scatter_add(x, 1, zeros({3, 5}, dtype(DType::i64)), zeros({3, 4})),
                     "scatter_add: index [3, 5] is larger than [3, 4] in dimension 1");
  CHECK_THROWS_ERROR(scatter_add(x, 1, zeros({4, 1}, dtype(DType::i64)), zeros({4, 1})),
                     "scatter_add: index [4, 1] is larger than [3, 4] in dimension 0");
  CHECK_THROWS_ERROR(scatter_add(x, 0, full({1, 1}, -2, dtype(DType::i64)), zeros({1, 1})),
                     "scatter_add: index -2 is out of range for the dimension of size 3");
  CHECK_THROWS_ERROR(scatter_add(x, 0, zeros({1, 1}, dtype(DType::i64)), Tensor{}),
                     "scatter_add: src tensor is undefined");
}

// --- index_add -------------------------------------------------------------------------------

TEST_CASE("index_add adds slices at repeated indices", "[index]") {
  const Tensor self = arange(15).reshape({5, 3}).to(DType::f32);
  const Tensor src = from_vector<float>({1, 1, 1, 10, 20, 30, 100, 200, 300}, {3, 3});
  const Tensor out = index_add(self, 0, from_vector<std::int64_t>({4, 0, 4}), src);
  check_equal(out, {10, 21, 32, 3, 4, 5, 6, 7, 8, 9, 10, 11, 113, 214, 315});
  check_equal(self, values(arange(15)));  // unchanged
  // Along dim 1 and a negative dim, random against the naive loop.
  for (const std::int64_t dim : {1, -1, 0, 2}) {
    INFO("dim " << dim);
    const std::int64_t d = dim < 0 ? dim + 3 : dim;
    const Tensor base = random_tensor({4, 5, 3}, 4600 + static_cast<std::uint64_t>(d), DType::f64);
    const std::vector<double> picks{2, 0, 2, 2, 1, 0};
    const std::vector<double> in_range = [&] {
      std::vector<double> v;
      for (const double p : picks)
        v.push_back(static_cast<double>(static_cast<std::int64_t>(p) % base.size(d)));
      return v;
    }();
    Shape src_shape = base.shape();
    src_shape[static_cast<std::size_t>(d)] = 6;
    const Tensor source = random_tensor(src_shape, 4610 + static_cast<std::uint64_t>(d), DType::f64);
    const Tensor result = index_add(base, dim, from_vector<double>(in_range).to(DType::i32), source);
    check_close(result, naive_index_add(base, d, in_range, source));
  }
}

TEST_CASE("index_add errors", "[index]") {
  const Tensor self = zeros({5, 3});
  CHECK_THROWS_ERROR(index_add(self, 0, from_vector<std::int64_t>({0, 1, 2}), zeros({2, 3})),
                     "index_add: src has shape [2, 3] but self [5, 3] with 3 indices needs [3, 3]");
  CHECK_THROWS_ERROR(index_add(self, 0, from_vector<std::int64_t>({5}), zeros({1, 3})),
                     "index_add: index 5 is out of range for the dimension of size 5");
  CHECK_THROWS_ERROR(index_add(self, 0, zeros({1, 1}, dtype(DType::i64)), zeros({1, 3})),
                     "index_add: index must be 1-D, got shape [1, 1]");
}

// --- cat, stack, split, chunk ----------------------------------------------------------------

TEST_CASE("cat joins along dims 0 and 1 and promotes mixed dtypes", "[index]") {
  const Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor b = from_vector<float>({7, 8, 9}, {1, 3});
  const Tensor c0 = cat({a, b}, 0);
  CHECK(c0.shape() == Shape{3, 3});
  check_equal(c0, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  const Tensor d = from_vector<float>({10, 20}, {2, 1});
  const Tensor c1 = cat({a, d, a}, 1);
  CHECK(c1.shape() == Shape{2, 7});
  check_equal(c1, {1, 2, 3, 10, 1, 2, 3, 4, 5, 6, 20, 4, 5, 6});
  check_equal(cat({a, d}, -1), {1, 2, 3, 10, 4, 5, 6, 20});
  // Mixed dtypes promote: i32 with f32 -> f32; bf16 with f16 -> f32; u8 with i64 -> i64.
  const Tensor mixed = cat({from_vector<std::int32_t>({1, 2}), from_vector<float>({0.5f})}, 0);
  CHECK(mixed.dtype() == DType::f32);
  check_equal(mixed, {1, 2, 0.5});
  const Tensor halves =
      cat({from_vector<float>({0.25f}).to(DType::bf16), from_vector<float>({1.5f}).to(DType::f16)}, 0);
  CHECK(halves.dtype() == DType::f32);
  check_equal(halves, {0.25, 1.5});
  const Tensor wide = cat({from_vector<std::uint8_t>({255}), from_vector<std::int64_t>({-1})}, 0);
  CHECK(wide.dtype() == DType::i64);
  check_equal(wide, {255, -1});
  // Empty pieces, one piece, and non-contiguous pieces.
  check_equal(cat({zeros({0, 3}), b, zeros({0, 3})}, 0), {7, 8, 9});
  check_equal(cat({a}, 1), values(a));
  const Tensor t = a.transpose(0, 1);  // [[1, 4], [2, 5], [3, 6]]
  check_equal(cat({t, t.slice(1, 1, 2)}, 1), {1, 4, 4, 2, 5, 5, 3, 6, 6});
}

TEST_CASE("cat errors", "[index]") {
  CHECK_THROWS_ERROR(
      cat({zeros({2, 3}), zeros({2, 4})}, 0),
      "cat: tensor 1 has shape [2, 4] but tensor 0 has [2, 3] (they must match except in dimension 0)");
  CHECK_THROWS_ERROR(
      cat({zeros({2, 3}), zeros({2, 3}), zeros({3})}, 1),
      "cat: tensor 2 has shape [3] but tensor 0 has [2, 3] (they must match except in dimension 1)");
  CHECK_THROWS_ERROR(cat({}, 0), "cat: needs at least one tensor");
  CHECK_THROWS_ERROR(cat({zeros({2})}, 1), "cat: dimension 1 is out of range for a tensor of rank 1");
  CHECK_THROWS_ERROR(cat({zeros({2}), Tensor{}}, 0), "cat: input tensor is undefined");
}

TEST_CASE("stack adds a new dim at the front, the middle or the end", "[index]") {
  const Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor b = from_vector<float>({10, 20, 30, 40, 50, 60}, {2, 3});
  const Tensor s0 = stack({a, b}, 0);
  CHECK(s0.shape() == Shape{2, 2, 3});
  check_equal(s0, {1, 2, 3, 4, 5, 6, 10, 20, 30, 40, 50, 60});
  const Tensor s1 = stack({a, b}, 1);
  CHECK(s1.shape() == Shape{2, 2, 3});
  check_equal(s1, {1, 2, 3, 10, 20, 30, 4, 5, 6, 40, 50, 60});
  for (const std::int64_t end : {2, -1}) {
    const Tensor s2 = stack({a, b}, end);
    CHECK(s2.shape() == Shape{2, 3, 2});
    check_equal(s2, {1, 10, 2, 20, 3, 30, 4, 40, 5, 50, 6, 60});
  }
  // 0-d tensors stack into a vector.
  const Tensor v = stack({scalar_tensor(1.0), scalar_tensor(2.0), scalar_tensor(3.0)}, 0);
  CHECK(v.shape() == Shape{3});
  check_equal(v, {1, 2, 3});
  CHECK_THROWS_ERROR(stack({a, zeros({2, 4})}, 0),
                     "stack: tensor 1 has shape [2, 4] but tensor 0 has [2, 3]");
  CHECK_THROWS_ERROR(stack({a, b}, 3), "stack: dimension 3 is out of range for a tensor of rank 3");
  CHECK_THROWS_ERROR(stack({}, 0), "stack: needs at least one tensor");
}

TEST_CASE("split and chunk give views with an uneven last piece", "[index]") {
  const Tensor x = arange(21).reshape({7, 3}).to(DType::f32);
  const std::vector<Tensor> pieces = split(x, 3, 0);
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[0].shape() == Shape{3, 3});
  CHECK(pieces[1].shape() == Shape{3, 3});
  CHECK(pieces[2].shape() == Shape{1, 3});
  check_equal(pieces[1], {9, 10, 11, 12, 13, 14, 15, 16, 17});
  check_equal(pieces[2], {18, 19, 20});
  // Views: same storage, and writes show through.
  for (const Tensor& p : pieces) CHECK(p.storage() == x.storage());
  Tensor last = pieces[2];
  last.fill_(-1.0);
  check_equal(x.select(0, 6), {-1, -1, -1});
  // Along dim 1 (and -1): widths 2 and 1.
  const std::vector<Tensor> columns = split(x, 2, -1);
  REQUIRE(columns.size() == 2);
  CHECK(columns[1].shape() == Shape{7, 1});
  check_equal(columns[1].select(0, 0), {2});
  CHECK(split(x, 7, 0).size() == 1);
  CHECK(split(x, 100, 0).size() == 1);

  // chunk: pieces of ceil(size / chunks).
  const std::vector<Tensor> three = chunk(x, 3, 0);  // 3, 3, 1
  REQUIRE(three.size() == 3);
  CHECK(three[2].shape() == Shape{1, 3});
  const std::vector<Tensor> four = chunk(x, 4, 0);  // 2, 2, 2, 1
  REQUIRE(four.size() == 4);
  CHECK(four[0].shape() == Shape{2, 3});
  CHECK(four[3].shape() == Shape{1, 3});
  check_equal(four[1], {6, 7, 8, 9, 10, 11});
  for (const Tensor& p : four) CHECK(p.storage() == x.storage());
  // As torch.chunk: 6 elements in 4 chunks are 3 chunks of 2.
  const std::vector<Tensor> fewer = chunk(arange(6), 4, 0);
  REQUIRE(fewer.size() == 3);
  CHECK(fewer[2].shape() == Shape{2});
  // More chunks than elements: one element each.
  CHECK(chunk(arange(3), 5, 0).size() == 3);
  const std::vector<Tensor> two = chunk(x, 2, 1);  // widths 2, 1
  REQUIRE(two.size() == 2);
  CHECK(two[0].shape() == Shape{7, 2});
  CHECK(two[1].shape() == Shape{7, 1});

  CHECK_THROWS_ERROR(split(x, 0, 0), "split: split_size must be positive, got 0");
  CHECK_THROWS_ERROR(split(x, 2, 2), "split: dimension 2 is out of range for a tensor of rank 2");
  CHECK_THROWS_ERROR(chunk(x, 0, 0), "chunk: number of chunks must be positive, got 0");
  CHECK_THROWS_ERROR(chunk(x, 2, -3), "chunk: dimension -3 is out of range for a tensor of rank 2");
}

// --- triu / tril -----------------------------------------------------------------------------

TEST_CASE("triu and tril keep the chosen diagonals, batched too", "[index]") {
  const Tensor x = random_tensor({2, 3, 4}, 4700, DType::f32, 1, 2);  // nonzero everywhere
  const std::vector<double> xv = values(x);
  for (const std::int64_t k : {-1, 0, 2, -5, 5}) {
    INFO("diagonal " << k);
    std::vector<double> upper, lower;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t i = 0; i < 3; ++i) {
        for (std::int64_t j = 0; j < 4; ++j) {
          const double v = xv[static_cast<std::size_t>((b * 3 + i) * 4 + j)];
          upper.push_back(j - i >= k ? v : 0.0);
          lower.push_back(j - i <= k ? v : 0.0);
        }
      }
    }
    const Tensor u = triu(x, k), l = tril(x, k);
    CHECK(u.shape() == x.shape());
    CHECK(u.dtype() == DType::f32);
    check_equal(u, upper);
    check_equal(l, lower);
    // triu(x, k) + tril(x, k - 1) == x.
    check_equal(add(u, tril(x, k - 1)), xv);
  }
  // Hand-worked 3x3 on integers: dtype kept.
  const Tensor m = arange(1, 10).reshape({3, 3});
  CHECK(triu(m).dtype() == DType::i64);
  check_equal(triu(m), {1, 2, 3, 0, 5, 6, 0, 0, 9});
  check_equal(tril(m, -1), {0, 0, 0, 4, 0, 0, 7, 8, 0});
  check_equal(triu(m, 2), {0, 0, 3, 0, 0, 0, 0, 0, 0});
  // A transposed input.
  check_equal(triu(m.transpose(0, 1)), {1, 4, 7, 0, 5, 8, 0, 0, 9});
  CHECK_THROWS_ERROR(triu(arange(4)), "triu: needs at least 2 dims, got shape [4]");
  CHECK_THROWS_ERROR(tril(Tensor{}), "tril: input tensor is undefined");
}

// --- gather_targets --------------------------------------------------------------------------

TEST_CASE("gather_targets picks each row's target and gives 0 for ignored rows", "[index]") {
  const Tensor v = random_tensor({4, 5}, 4800, DType::f32, 1, 2);
  const std::vector<double> vv = values(v);
  for (const DType target_dtype : {DType::i64, DType::i32}) {
    INFO(dtype_name(target_dtype));
    const Tensor targets = from_vector<std::int64_t>({1, -100, 4, 0}).to(target_dtype);
    const Tensor picked = gather_targets(v, targets);
    CHECK(picked.shape() == Shape{4});
    CHECK(picked.dtype() == DType::f32);
    check_equal(picked, {vv[1], 0, vv[14], vv[15]});
  }
  // A custom ignore_index; -100 is then an ordinary (out-of-range) target.
  check_equal(gather_targets(v, from_vector<std::int64_t>({3, 3, 2, 4}), 3), {0, 0, vv[12], vv[19]});
  CHECK_THROWS_ERROR(
      gather_targets(v, from_vector<std::int64_t>({1, -100, 4, 0}), 3),
      "gather_targets: index -100 is out of range for the classes (ignore_index aside) of size 5");
  // Every row ignored.
  check_equal(gather_targets(v, full({4}, -100, dtype(DType::i64))), {0, 0, 0, 0});
  // f64 values keep their dtype.
  const Tensor d = random_tensor({2, 3}, 4801, DType::f64);
  check_equal(gather_targets(d, from_vector<std::int64_t>({2, 1})), {values(d)[2], values(d)[4]});
}

TEST_CASE("gather_targets errors", "[index]") {
  const Tensor v = zeros({3, 5});
  CHECK_THROWS_ERROR(
      gather_targets(v, from_vector<std::int64_t>({0, 5, 1})),
      "gather_targets: index 5 is out of range for the classes (ignore_index aside) of size 5");
  CHECK_THROWS_ERROR(
      gather_targets(v, from_vector<std::int64_t>({0, -3, 1})),
      "gather_targets: index -3 is out of range for the classes (ignore_index aside) of size 5");
  CHECK_THROWS_ERROR(gather_targets(v, from_vector<std::int64_t>({0, 1})),
                     "gather_targets: values [3, 5] and targets [2] disagree on the batch size (3 != 2)");
  CHECK_THROWS_ERROR(gather_targets(zeros({5}), from_vector<std::int64_t>({0})),
                     "gather_targets: values must be 2-D [N, C], got [5]");
  CHECK_THROWS_ERROR(gather_targets(v, zeros({3, 1}, dtype(DType::i64))),
                     "gather_targets: targets must be 1-D [N], got [3, 1]");
  CHECK_THROWS_ERROR(gather_targets(v, from_vector<float>({0, 1, 2})),
                     "gather_targets: indices must be i64 or i32, got f32");
  CHECK_THROWS_ERROR(gather_targets(Tensor{}, from_vector<std::int64_t>({0})),
                     "gather_targets: values tensor is undefined");
}

}  // namespace shardlab::test
