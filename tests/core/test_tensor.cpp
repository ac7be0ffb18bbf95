// tests/core/test_tensor.cpp: Tensor metadata, views (no copies), copies, casts, factories,
// the printer, Storage and the CPU allocator's statistics.
#include "core/allocator.h"
#include "tests/check.h"

using namespace shardlab;
using test::check_equal;

namespace {
Tensor iota(const Shape& shape, DType type = DType::f32) {
  return arange(shape_numel(shape)).to(type).reshape(shape);
}
}  // namespace

TEST_CASE("factories fill shape, dtype and values", "[tensor]") {
  const Tensor z = zeros({2, 3});
  CHECK(z.shape() == Shape{2, 3});
  CHECK(z.strides() == Strides{3, 1});
  CHECK(z.dtype() == DType::f32);
  CHECK(z.device() == Device::cpu());
  check_equal(z, {0, 0, 0, 0, 0, 0});
  check_equal(ones({2}, dtype(DType::i32)), {1, 1});
  check_equal(full({3}, 2.5, dtype(DType::f64)), {2.5, 2.5, 2.5});
  check_equal(full({2}, std::int64_t{1} << 60, dtype(DType::i64)),
              {double(std::int64_t{1} << 60), double(std::int64_t{1} << 60)});
  CHECK(full({1}, std::int64_t{(1LL << 60) + 1}, dtype(DType::i64)).item<std::int64_t>() == (1LL << 60) + 1);
  check_equal(arange(5), {0, 1, 2, 3, 4});
  CHECK(arange(5).dtype() == DType::i64);
  check_equal(arange(2, 11, 3), {2, 5, 8});
  check_equal(arange(5, 0, -2), {5, 3, 1});
  check_equal(arange(0.0, 1.0, 0.25, dtype(DType::f32)), {0, 0.25, 0.5, 0.75});
  CHECK(arange(3, 3).numel() == 0);
  check_equal(from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}), {1, 2, 3, 4, 5, 6});
  CHECK(from_vector<bool>({true, false}).dtype() == DType::boolean);
  CHECK(scalar_tensor(4).dim() == 0);
  CHECK(scalar_tensor(4).item<int>() == 4);
  CHECK(empty({0, 3}).numel() == 0);
  CHECK_THROWS_ERROR(from_vector<float>({1, 2, 3}, {2, 2}), "from_vector: 3 values do not fill shape [2, 2]");
  CHECK_THROWS_ERROR(empty({2, -1}), "empty: negative size in shape [2, -1]");
  // Empty, yet its strides would overflow; and a count of elements that fits whose bytes do not.
  CHECK_THROWS_ERROR(
      empty({0, std::int64_t{1} << 32, std::int64_t{1} << 32}),
      "empty: shape [0, 4294967296, 4294967296] of f32 has more elements or bytes than int64 can "
      "count");
  CHECK_THROWS_ERROR(
      empty({std::int64_t{1} << 62}, dtype(DType::f64)),
      "empty: shape [4611686018427387904] of f64 has more elements or bytes than int64 can count");
  CHECK(shape_addressable({0, std::numeric_limits<std::int64_t>::max()}));
  CHECK_FALSE(shape_addressable({2, std::numeric_limits<std::int64_t>::max()}));
  CHECK_THROWS_ERROR(arange(0, 3, 0), "arange: step must be non-zero");
}

TEST_CASE("view and reshape share storage or copy only when they must", "[tensor][view]") {
  const Tensor x = iota({2, 3, 4});
  const Tensor v = x.view({6, 4});
  CHECK(v.storage() == x.storage());
  CHECK(v.strides() == Strides{4, 1});
  CHECK(x.view({-1}).shape() == Shape{24});
  CHECK(x.view({4, -1}).shape() == Shape{4, 6});
  // A transposed tensor cannot be flattened without a copy: view refuses, reshape copies.
  const Tensor t = x.transpose(1, 2);
  CHECK_THROWS_ERROR(t.view({24}), "view: cannot view a tensor of shape [2, 4, 3]");
  const Tensor r = t.reshape({24});
  CHECK(r.storage() != x.storage());
  std::vector<double> expected;
  for (int a = 0; a < 2; ++a)
    for (int c = 0; c < 4; ++c)
      for (int b = 0; b < 3; ++b) expected.push_back(a * 12 + b * 4 + c);
  check_equal(r, expected);
  // Splitting a dim of a transposed tensor is still a view.
  const Tensor split = t.view({2, 2, 2, 3});
  CHECK(split.storage() == x.storage());
  check_equal(split, expected);
  // Views of expanded tensors that keep the broadcast dim separate stay views.
  const Tensor e = from_vector<float>({1, 2, 3}).expand({4, 3});
  CHECK(e.view({2, 2, 3}).storage() == e.storage());
  CHECK_THROWS_ERROR(x.view({5, -1}), "view: shape [5, -1] is invalid for a tensor of 24 elements");
  CHECK_THROWS_ERROR(x.view({-1, -1}), "view: only one dimension can be -1");
  CHECK_THROWS_ERROR(x.reshape({7}), "reshape: shape [7] is invalid for a tensor of 24 elements");
}

TEST_CASE("permute, transpose, narrow, slice and select are views with the right values", "[tensor][view]") {
  const Tensor x = iota({2, 3, 4});
  const Tensor p = x.permute({2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  CHECK(p.strides() == Strides{1, 12, 4});
  CHECK(p.storage() == x.storage());
  CHECK(p.is_contiguous() == false);
  std::vector<double> expected;
  for (int c = 0; c < 4; ++c)
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 3; ++b) expected.push_back(a * 12 + b * 4 + c);
  check_equal(p, expected);
  check_equal(x.narrow(2, 1, 2), {1, 2, 5, 6, 9, 10, 13, 14, 17, 18, 21, 22});
  check_equal(x.narrow(-1, -1, 1), {3, 7, 11, 15, 19, 23});
  check_equal(x.slice(1, 0, 3, 2), {0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23});
  check_equal(x.slice(2, -2, 100), {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23});
  CHECK(x.slice(2, 3, 1).size(2) == 0);
  check_equal(x.select(0, 1).select(0, 2), {20, 21, 22, 23});
  check_equal(x.select(2, -1), {3, 7, 11, 15, 19, 23});
  CHECK_THROWS_ERROR(x.permute({0, 0, 1}), "permute: dims [0, 0, 1] repeat dimension 0");
  CHECK_THROWS_ERROR(x.permute({0, 1}), "permute: got 2 dims [0, 1] for a tensor of rank 3");
  CHECK_THROWS_ERROR(x.narrow(1, 2, 2), "narrow: start 2 and length 2 do not fit dimension 1 of size 3");
  CHECK_THROWS_ERROR(x.select(1, 3), "select: index 3 is out of range for dimension 1 of size 3");
  CHECK_THROWS_ERROR(x.slice(0, 0, 1, 0), "slice: step must be positive, got 0");
  CHECK_THROWS_ERROR(x.transpose(0, 3), "transpose: dimension 3 is out of range for a tensor of rank 3");
}

TEST_CASE("expand, squeeze, unsqueeze and flatten", "[tensor][view]") {
  const Tensor row = from_vector<float>({1, 2, 3}, {1, 3});
  const Tensor e = row.expand({2, 2, 3});
  CHECK(e.strides() == Strides{0, 0, 1});
  check_equal(e, {1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3});
  CHECK(row.expand({-1, 3}).shape() == Shape{1, 3});
  CHECK_THROWS_ERROR(row.expand({2, 4}),
                     "expand: cannot expand shape [1, 3] to [2, 4] (dimension 1: 3 vs 4)");
  CHECK_THROWS_ERROR(row.expand({3}), "expand: cannot expand shape [1, 3] to fewer dims [3]");
  CHECK(row.broadcast_to({5, 3}).shape() == Shape{5, 3});
  const Tensor s = zeros({1, 3, 1, 2});
  CHECK(s.squeeze().shape() == Shape{3, 2});
  CHECK(s.squeeze(2).shape() == Shape{1, 3, 2});
  CHECK(s.squeeze(1).shape() == Shape{1, 3, 1, 2});
  CHECK(s.unsqueeze(0).shape() == Shape{1, 1, 3, 1, 2});
  CHECK(s.unsqueeze(-1).shape() == Shape{1, 3, 1, 2, 1});
  CHECK(s.unsqueeze(4).strides().back() == 1);
  CHECK(iota({2, 3, 4}).flatten(1).shape() == Shape{2, 12});
  CHECK(iota({2, 3, 4}).flatten().shape() == Shape{24});
  CHECK(scalar_tensor(1.0).flatten().shape() == Shape{1});
  CHECK_THROWS_ERROR(s.unsqueeze(6), "unsqueeze: dimension 6 is out of range for a tensor of rank 5");
}

TEST_CASE("contiguous, clone, copy_ and casts", "[tensor]") {
  const Tensor x = iota({3, 4});
  CHECK(x.contiguous().storage() == x.storage());
  const Tensor t = x.transpose(0, 1);
  const Tensor c = t.contiguous();
  CHECK(c.storage() != x.storage());
  CHECK(c.is_contiguous());
  check_equal(c, {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  const Tensor cl = x.clone();
  CHECK(cl.storage() != x.storage());
  check_equal(cl, x.to_vector<double>());

  // copy_ into a strided destination, broadcasting the source and converting its dtype.
  Tensor dst = zeros({4, 3}, dtype(DType::f64));
  dst.transpose(0, 1).copy_(from_vector<std::int32_t>({1, 2, 3, 4}));
  check_equal(dst, {1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4});
  Tensor part = zeros({2, 5});
  part.slice(1, 0, 5, 2).copy_(from_vector<float>({7, 8}, {2, 1}));
  check_equal(part, {7, 0, 7, 0, 7, 8, 0, 8, 0, 8});
  CHECK_THROWS_ERROR(part.copy_(zeros({3})), "expand: cannot expand shape [3] to [2, 5]");

  // Casts: float to int truncates toward zero, to bool tests non-zero, halves round.
  const Tensor f = from_vector<float>({-1.7f, -0.2f, 0.0f, 0.5f, 2.9f, 300.0f});
  check_equal(f.to(DType::i32), {-1, 0, 0, 0, 2, 300});
  check_equal(f.to(DType::boolean), {1, 1, 0, 1, 1, 1});
  check_equal(from_vector<bool>({true, false}).to(DType::f32), {1, 0});
  check_equal(from_vector<float>({1.0f + 1.0f / 256, 3.14159f}).to(DType::bf16), {1.0, 3.140625});
  check_equal(from_vector<float>({0.1f}).to(DType::f16), {0.0999755859375});
  check_equal(from_vector<std::int64_t>({-3, 7}).to(DType::f64), {-3, 7});
  check_equal(from_vector<std::int64_t>({258}).to(DType::u8), {2});  // wraps like C++
  CHECK(f.to(DType::f32).storage() == f.storage());                  // same dtype: no copy
}

TEST_CASE("fill_ writes through strided views only", "[tensor]") {
  Tensor x = zeros({3, 4}, dtype(DType::i32));
  x.select(1, 2).fill_(5);
  check_equal(x, {0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 5, 0});
  Tensor h = zeros({2}, dtype(DType::bf16));
  h.fill_(0.1);
  check_equal(h, {0.10009765625, 0.10009765625});
  Tensor b = zeros({2}, dtype(DType::boolean));
  b.fill_(true);
  check_equal(b, {1, 1});
}

TEST_CASE("item and to_vector read values back", "[tensor]") {
  CHECK(from_vector<double>({2.5}).item<double>() == 2.5);
  CHECK(from_vector<float>({2.5f}).item<std::int64_t>() == 2);
  CHECK(full({1, 1}, 3, dtype(DType::u8)).item<int>() == 3);
  CHECK(from_vector<bool>({true}).item<bool>());
  CHECK_THROWS_ERROR(zeros({2}).item<float>(), "item: tensor of shape [2] has 2 elements, not 1");
  CHECK_THROWS_ERROR(zeros({2}).data<double>(), "data<f64>(): tensor has dtype f32");
  const Tensor undefined;
  CHECK_FALSE(undefined.defined());
  CHECK_THROWS_ERROR(undefined.raw_data(), "raw_data: tensor is undefined");
  CHECK_THROWS_ERROR(add(undefined, zeros({1})), "add: first tensor is undefined");
}

TEST_CASE("the printer shows shape, dtype, device and values", "[tensor][print]") {
  CHECK(from_vector<float>({0, 1, 2, 3, 4, 5}, {2, 3}).str() ==
        "[2, 3] f32 cpu\n[[0.0000, 1.0000, 2.0000],\n [3.0000, 4.0000, 5.0000]]");
  CHECK(from_vector<std::int64_t>({-3, 10}).str() == "[2] i64 cpu\n[-3, 10]");
  CHECK(from_vector<bool>({true, false}).str() == "[2] bool cpu\n[ true, false]");
  CHECK(scalar_tensor(1.5).str() == "[] f32 cpu\n1.5000");
  CHECK(zeros({0, 2}).str() == "[0, 2] f32 cpu\n[]");
  CHECK(from_vector<double>({1e-6, 2.0}).str() == "[2] f64 cpu\n[1.0000e-06, 2.0000e+00]");
  CHECK(from_vector<float>({NAN, -INFINITY}).str() == "[2] f32 cpu\n[ nan, -inf]");
  // Large tensors show the first and last three entries along each dimension.
  const std::string big = arange(2000).reshape({40, 50}).str();
  CHECK(big.rfind("[40, 50] i64 cpu\n[[   0,    1,    2, ...,   47,   48,   49],", 0) == 0);
  CHECK(big.find("...,\n") != std::string::npos);
  CHECK(big.find("1999]]") != std::string::npos);
  CHECK(Tensor().str() == "undefined tensor");
}

TEST_CASE("storage reallocation keeps tensors attached; allocator statistics add up", "[tensor][memory]") {
  const MemoryStats before = memory_stats(Device::cpu());
  reset_peak_memory(Device::cpu());
  {
    Tensor a = zeros({1000});
    const MemoryStats during = memory_stats(Device::cpu());
    CHECK(during.bytes_in_use - before.bytes_in_use == 4000);
    CHECK(during.allocations - before.allocations == 1);
    Tensor view = a.narrow(0, 10, 5);
    // Free the bytes (FSDP's reshard) and bring them back: the view follows the Storage.
    a.storage()->reallocate(0);
    CHECK(a.storage()->nbytes() == 0);
    CHECK(memory_stats(Device::cpu()).bytes_in_use == before.bytes_in_use);
    a.storage()->reallocate(4000);
    a.fill_(3);
    CHECK(view.to_vector<float>() == std::vector<float>(5, 3.0f));
  }
  const MemoryStats after = memory_stats(Device::cpu());
  CHECK(after.bytes_in_use == before.bytes_in_use);
  CHECK(after.peak_bytes >= before.bytes_in_use + 4000);
  CHECK(after.largest_allocation >= 4000);
  reset_peak_memory(Device::cpu());
  CHECK(memory_stats(Device::cpu()).peak_bytes == after.bytes_in_use);
  CHECK(memory_stats(Device::cpu()).largest_allocation == 0);
  { const Tensor small = zeros({10}), large = zeros({300}), medium = zeros({20}); }
  CHECK(memory_stats(Device::cpu()).largest_allocation == 1200);  // the largest of the three
}

TEST_CASE("ops name both devices when their inputs live on different ones", "[tensor][device]") {
  // A tensor with no elements owns no bytes, so it can sit on cuda:0 even without a GPU.
  const Tensor on_gpu = empty({0}, device(Device::cuda(0)));
  CHECK(on_gpu.device() == Device::cuda(0));
  const Tensor on_cpu = zeros({0});
  CHECK_THROWS_ERROR(add(on_cpu, on_gpu), "add: tensors are on different devices (cpu and cuda:0)");
  CHECK_THROWS_ERROR(matmul(zeros({0, 2}), empty({2, 0}, device(Device::cuda(0)))),
                     "matmul: tensors are on different devices (cpu and cuda:0)");
  CHECK_THROWS_ERROR(where(empty({0}, dtype(DType::boolean)), on_cpu, on_gpu),
                     "where: tensors are on different devices (cpu and cuda:0)");
  const Tensor no_ids = empty({0}, TensorOptions{DType::i64, Device::cuda(0)});
  CHECK_THROWS_ERROR(embedding(zeros({0, 4}), no_ids),
                     "embedding: tensors are on different devices (cpu and cuda:0)");
  CHECK_THROWS_ERROR(embedding_backward(zeros({0, 4}), no_ids, 3),
                     "embedding_backward: tensors are on different devices (cpu and cuda:0)");
  const std::vector<Tensor> spread = {on_cpu, on_gpu};
  CHECK_THROWS_ERROR(foreach_sum_squares(spread),
                     "foreach_sum_squares: tensor 1 of 2 is on cuda:0, tensor 0 on cpu");
  CHECK_THROWS_ERROR(on_gpu.to(Device::cuda(1)), "to: copies between cuda:0 and cuda:1 go through the host");
}

TEST_CASE("large CPU blocks are cached and handed out again", "[tensor][memory]") {
  void* first = nullptr;
  {
    const Tensor big = empty({1 << 18});  // 1 MiB
    first = big.raw_data();
  }
  const MemoryStats idle = memory_stats(Device::cpu());
  CHECK(idle.bytes_cached >= (1 << 20));
  const Tensor again = empty({1 << 18});
  CHECK(again.raw_data() == first);
  CHECK(memory_stats(Device::cpu()).bytes_cached == idle.bytes_cached - (1 << 20));
}

TEST_CASE("empty_in_layout_of lays dims out in memory in the order of another tensor's strides", "[tensor]") {
  const TensorOptions f32{DType::f32, Device::cpu()};
  CHECK(empty_in_layout_of(zeros({2, 3, 4}), {2, 3, 5}, f32).strides() == Strides{15, 5, 1});
  // Heads split from [B, T, H * D]: [B, H, T, D] with T's stride above H's. An output with another
  // last dim keeps that order, dense: [B, T, H, 6] in memory.
  const Tensor heads = zeros({2, 5, 3, 8}).transpose(1, 2);
  const Tensor out = empty_in_layout_of(heads, {2, 3, 5, 6}, f32);
  CHECK(out.shape() == Shape{2, 3, 5, 6});
  CHECK(out.strides() == Strides{90, 6, 18, 1});
  CHECK(out.transpose(1, 2).is_contiguous());
  CHECK(empty_in_layout_of(heads, heads.shape(), dtype(DType::f64)).strides() == heads.strides());
  CHECK_THROWS_ERROR(
      empty_in_layout_of(heads, {2, 3}, f32),
      "empty_in_layout_of: shape [2, 3] has rank 2, but the tensor whose layout it takes is [2, 3, 5, 8]");
}
