// tests/core/test_cuda.cpp: the CUDA kernels against the CPU reference, streams and events, the CUDA
// caching allocator, and how CUDA reports itself on a machine without a usable GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/cuda/conv_shape.h"
#include "core/cuda/runtime.h"
#include "core/host_wait.h"
#include "core/kernels.h"
#include "core/pending_read.h"
#include "core/profile.h"
#include "tests/cuda_compare.h"

namespace shardlab {
namespace {

using test::compare_cuda_with_cpu;
using test::Inputs;
using test::random_tensor;
using test::Tolerance;

const Device kCuda = Device::cuda(0);
const Device kCpu = Device::cpu();
constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                DType::i64, DType::i32, DType::u8,   DType::boolean};
constexpr DType kFloatingDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};

// --- without a GPU: these run in CI ------------------------------------------------------------

TEST_CASE("cuda availability is answered without throwing") {
  bool is_available = false;
  REQUIRE_NOTHROW(is_available = cuda::available());
  if (is_available) {
    CHECK(cuda::device_count() > 0);
    CHECK(cuda::unavailable_reason().empty());
  } else {
    CHECK(cuda::device_count() == 0);
    CHECK_FALSE(cuda::unavailable_reason().empty());
  }
}

TEST_CASE("an unusable CUDA device is refused with an Error naming it and the reason") {
  if (!cuda::available()) {
    const std::string reason = cuda::unavailable_reason();
    CHECK_THROWS_ERROR(empty({2, 3}, device(kCuda)), "cuda:0");
    CHECK_THROWS_ERROR(empty({2, 3}, device(kCuda)), reason);
    CHECK_THROWS_ERROR(ones({4}).to(kCuda), reason);
    CHECK_THROWS_ERROR(cuda::Stream(0), reason);
    CHECK_THROWS_ERROR(cuda::Event(0), reason);
    CHECK_THROWS_ERROR(cuda::current_stream(0), reason);
    CHECK_THROWS_ERROR(cuda::device_allocator(0), reason);
    CHECK_THROWS_ERROR(cuda::set_current_device(0), reason);
    CHECK_THROWS_ERROR(cuda::pinned_host_allocator(), "pinned host memory needs a usable GPU: " + reason);
    CHECK_THROWS_ERROR(ones({4}).pin_memory(), reason);
    // Without bytes too: a pinned tensor that exists only where pinning works.
    CHECK_THROWS_ERROR(empty({0}, TensorOptions{}.with_pinned(true)), reason);
  }
  // With or without a GPU, an index past the last device is refused by name.
  const int missing = cuda::device_count();
  const std::string name = Device::cuda(missing).str();
  CHECK_THROWS_ERROR(cuda::Stream(missing), name);
  CHECK_THROWS_ERROR(empty({2}, device(Device::cuda(missing))), name);
}

TEST_CASE("only host memory can be pinned, and only a CPU tensor pinned") {
  CHECK_THROWS_ERROR(empty({2}, TensorOptions{DType::f32, kCuda, true}),
                     "pinned memory is host memory: it cannot be on cuda:0");
  // A tensor without elements sits on cuda:0 as pure metadata, GPU or not.
  CHECK_THROWS_ERROR(empty({0}, device(kCuda)).pin_memory(),
                     "pin_memory: the tensor is on cuda:0; only CPU tensors can be pinned");
  CHECK_THROWS_ERROR(Tensor().pin_memory(), "pin_memory: tensor is undefined");
  CHECK_FALSE(ones({3}).is_pinned());
  CHECK_FALSE(Tensor().is_pinned());
}

TEST_CASE("cuDNN is declined, naming the size, for convolutions over its int limits") {
  cuda::ConvShape shape{.batch = 64,
                        .channels = 32,
                        .height = 26,
                        .width = 26,
                        .outs = 64,
                        .kernel_h = 3,
                        .kernel_w = 3,
                        .out_h = 24,
                        .out_w = 24};
  CHECK(cuda::cudnn_size_problem(shape).empty());
  shape.batch = 60'000;  // 60000 * 64 * 24 * 24 > 2^31 - 1 output elements; the input stays under
  CHECK(cuda::cudnn_size_problem(shape) ==
        "its output elements (2211840000) exceed cuDNN's int sizes (2147483647)");
  shape.batch = 2;
  shape.height = shape.width = 40'000;  // 2 * 32 * 1.6e9 input elements
  CHECK(cuda::cudnn_size_problem(shape) ==
        "its input elements (102400000000) exceed cuDNN's int sizes (2147483647)");
  shape.height = shape.width = 26;
  shape.outs = 1 << 20;
  shape.channels = 1 << 10;  // a filter of 2^30 * 9 elements
  CHECK(cuda::cudnn_size_problem(shape).starts_with("its filter elements (9663676416)"));
}

// --- helpers ---------------------------------------------------------------------------------

// Both tensors, brought to the CPU, hold the same bytes.
void check_same_bits(const Tensor& actual, const Tensor& expected) {
  const Tensor a = actual.to(kCpu).contiguous();
  const Tensor e = expected.to(kCpu).contiguous();
  REQUIRE(a.dtype() == e.dtype());
  REQUIRE(a.shape() == e.shape());
  REQUIRE(a.numel() > 0);
  const auto nbytes = static_cast<std::size_t>(a.numel()) * a.element_size();
  CHECK(std::memcmp(a.raw_data(), e.raw_data(), nbytes) == 0);
}

// Values every conversion between our dtypes defines the same way on both devices: [0, 200),
// fractional where the dtype allows.
Tensor castable_values(const Shape& shape, DType dtype, std::uint64_t seed) {
  return random_tensor(shape, seed, DType::f64, 0.0, 200.0).to(dtype);
}

// Values of dtype in [low, high); integers truncate, bools are about half true.
Tensor values_in(const Shape& shape, DType dtype, std::uint64_t seed, double low, double high) {
  if (dtype == DType::boolean) return gt(random_tensor(shape, seed), 0.0);
  return random_tensor(shape, seed, DType::f64, low, high).to(dtype);
}

// The shape cases every elementwise op runs on: scalars, sizes below and not a multiple of
// the block size, and a [13, 257] operand used transposed (non-contiguous) on both devices.
struct ShapeCase {
  Shape a;
  Shape b;
  bool transpose_a = false;
};
const std::vector<ShapeCase> kShapeCases = {
    {{}, {}},
    {{1}, {1}},
    {{7}, {7}},
    {{7}, {1}},
    {{13, 257}, {13, 257}},
    {{3, 1, 5}, {4, 5}},
    {{257, 13}, {13, 257}, true},
};

Tensor maybe_transposed(const Tensor& t, bool transpose) { return transpose ? t.transpose(0, 1) : t; }

// --- unary -------------------------------------------------------------------------------------

bool needs_positive_input(UnaryOp op) {
  return op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt;
}

TEST_CASE("cuda matches cpu: every unary op on every floating dtype", "[cuda-vs-cpu]") {
  const std::vector<double> special = {0.0,
                                       -0.0,
                                       1.0,
                                       -2.5,
                                       1e-30,
                                       1e300,
                                       -1e300,
                                       std::numeric_limits<double>::infinity(),
                                       -std::numeric_limits<double>::infinity(),
                                       std::numeric_limits<double>::quiet_NaN()};
  for (const DType dtype : kFloatingDTypes) {
    for (const UnaryOp op : unary_ops()) {
      INFO(op_name(op) << " on " << dtype_name(dtype));
      const auto fn = [op](bool transpose) {
        return
            [op, transpose](const Inputs& x) { return apply_unary(op, maybe_transposed(x[0], transpose)); };
      };
      const double low = needs_positive_input(op) ? 0.1 : -4.0;
      std::uint64_t seed = 100;
      for (const ShapeCase& shapes : kShapeCases) {
        compare_cuda_with_cpu({values_in(shapes.a, dtype, ++seed, low, 4.0)}, fn(shapes.transpose_a));
      }
      // Infinities, NaN, signed zeros and overflow in the dtype: both devices agree on them too.
      compare_cuda_with_cpu({from_vector(special).to(dtype)}, fn(false));
    }
  }
}

TEST_CASE("cuda matches cpu: neg, abs and relu on integers", "[cuda-vs-cpu]") {
  for (const DType dtype : {DType::i64, DType::i32, DType::u8}) {
    for (const UnaryOp op : {UnaryOp::neg, UnaryOp::abs, UnaryOp::relu}) {
      INFO(op_name(op) << " on " << dtype_name(dtype));
      const double low = dtype == DType::u8 ? 0.0 : -100.0;
      compare_cuda_with_cpu({values_in({13, 257}, dtype, 7, low, 250.0)},
                            [op](const Inputs& x) { return apply_unary(op, x[0].transpose(0, 1)); });
    }
  }
}

// --- binary ------------------------------------------------------------------------------------

constexpr BinaryOp kBinaryOps[] = {
    BinaryOp::add, BinaryOp::sub,     BinaryOp::mul,     BinaryOp::div,
    BinaryOp::pow, BinaryOp::maximum, BinaryOp::minimum, BinaryOp::relu_backward,
    BinaryOp::eq,  BinaryOp::ne,      BinaryOp::lt,      BinaryOp::le,
    BinaryOp::gt,  BinaryOp::ge};

Tensor apply_binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  switch (op) {
    case BinaryOp::add:
      return add(a, b);
    case BinaryOp::sub:
      return sub(a, b);
    case BinaryOp::mul:
      return mul(a, b);
    case BinaryOp::div:
      return div(a, b);
    case BinaryOp::pow:
      return pow(a, b);
    case BinaryOp::maximum:
      return maximum(a, b);
    case BinaryOp::minimum:
      return minimum(a, b);
    case BinaryOp::relu_backward:
      return relu_backward(a, b);
    case BinaryOp::eq:
      return eq(a, b);
    case BinaryOp::ne:
      return ne(a, b);
    case BinaryOp::lt:
      return lt(a, b);
    case BinaryOp::le:
      return le(a, b);
    case BinaryOp::gt:
      return gt(a, b);
    case BinaryOp::ge:
      return ge(a, b);
  }
  __builtin_unreachable();  // every enumerator is handled above
}

// The op layer refuses arithmetic on bools; maximum, minimum and comparisons are defined.
bool defined_on_bool(BinaryOp op) {
  return is_comparison(op) || op == BinaryOp::maximum || op == BinaryOp::minimum;
}

// Operands on which op is defined alike on both devices: positive bases for floating pow,
// small bases and exponents >= 0 for integer pow, small integers elsewhere (u8 wraps).
Tensor binary_operand(BinaryOp op, DType dtype, const Shape& shape, std::uint64_t seed, bool is_exponent) {
  double low = -20.0, high = 20.0;
  if (is_floating(dtype)) {
    low = op == BinaryOp::pow && !is_exponent ? 0.1 : -3.0;
    high = 3.0;
  } else if (op == BinaryOp::pow) {
    low = is_exponent || dtype == DType::u8 ? 0.0 : -4.0;
    high = is_exponent ? 6.0 : 5.0;
  } else if (dtype == DType::u8) {
    low = 0.0;
    high = 200.0;
  }
  return values_in(shape, dtype, seed, low, high);
}

TEST_CASE("cuda matches cpu: every binary op on every dtype, broadcast and strided", "[cuda-vs-cpu]") {
  for (const DType dtype : kAllDTypes) {
    for (const BinaryOp op : kBinaryOps) {
      if (dtype == DType::boolean && !defined_on_bool(op)) continue;
      std::uint64_t seed = 200;
      for (const ShapeCase& shapes : kShapeCases) {
        INFO(op_name(op) << " on " << dtype_name(dtype) << ": " << shape_str(shapes.a)
                         << (shapes.transpose_a ? " transposed" : "") << " with " << shape_str(shapes.b));
        const Tensor a = binary_operand(op, dtype, shapes.a, ++seed, false);
        const Tensor b = binary_operand(op, dtype, shapes.b, ++seed, true);
        compare_cuda_with_cpu({a, b}, [op, transpose = shapes.transpose_a](const Inputs& x) {
          return apply_binary(op, maybe_transposed(x[0], transpose), x[1]);
        });
      }
    }
  }
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

SHARDLAB_CUDA_VS_CPU("maximum and minimum propagate NaN",
                     {from_vector<float>({1.0f, kNaN, -0.0f, 3.0f}),
                      from_vector<float>({kNaN, 2.0f, 0.0f, -1.0f})},
                     [](const Inputs& x) {
                       return stack({maximum(x[0], x[1]), minimum(x[0], x[1])}, 0);
                     })

SHARDLAB_CUDA_VS_CPU("binary ops with a Scalar operand", {random_tensor({13, 257}, 31, DType::bf16)},
                     [](const Inputs& x) { return add(mul(x[0], 1.5), 0.25) - pow(x[0] * x[0], 0.5); })

TEST_CASE("cuda refuses operands whose merged layout has more than 8 dims", "[cuda]") {
  // Reversed dims of a [2, ..., 2] tensor: no two neighbours merge, in the input or the output.
  const Tensor x = random_tensor(Shape(9, 2), 5).to(kCuda);
  const Tensor reversed = x.permute({8, 7, 6, 5, 4, 3, 2, 1, 0});
  CHECK_THROWS_ERROR(neg(reversed), "at most 8");
  // Dense operands of any rank merge into one dim.
  test::check_close(neg(x).to(kCpu), neg(x.to(kCpu)));
}

// --- copy, fill, where -------------------------------------------------------------------------

TEST_CASE("cuda matches cpu: casts between all pairs of dtypes, from dense and strided sources",
          "[cuda-vs-cpu]") {
  for (const DType from : kAllDTypes) {
    for (const DType to : kAllDTypes) {
      for (const bool transpose : {false, true}) {
        INFO(dtype_name(from) << " -> " << dtype_name(to) << (transpose ? " transposed" : " dense"));
        compare_cuda_with_cpu(
            {castable_values({257, 13}, from, 41)},
            [to, transpose](const Inputs& x) { return maybe_transposed(x[0], transpose).to(to); },
            Tolerance{0.0, 0.0});
      }
    }
  }
}

TEST_CASE("cuda matches cpu: elementwise ops on views that start off 16 bytes", "[cuda-vs-cpu]") {
  // A view one element in cannot move in 16-byte packs: the strided kernels take it, and dense
  // operands beside it with an odd count (a partial last pack) give the same values.
  for (const DType dtype : {DType::bf16, DType::f32, DType::f16}) {
    INFO(dtype_name(dtype));
    compare_cuda_with_cpu({values_in({3342}, dtype, 61, -3.0, 3.0), values_in({3341}, dtype, 62, -3.0, 3.0)},
                          [](const Inputs& x) {
                            const Tensor shifted = x[0].narrow(0, 1, 3341);
                            return stack(
                                {add(shifted, x[1]), exp(shifted), where(gt(x[1], 0.0), shifted, x[1]),
                                 shifted.to(DType::f32).to(x[1].dtype()), mul(x[1], 0.5)},
                                0);
                          });
  }
}

TEST_CASE("cuda copies keep every bit: cpu -> cuda -> cpu, and copies on the device", "[cuda]") {
  for (const DType dtype : kAllDTypes) {
    INFO(dtype_name(dtype));
    const Tensor host = castable_values({13, 257}, dtype, 43);
    const Tensor device_copy = host.to(kCuda);
    REQUIRE(device_copy.device() == kCuda);
    check_same_bits(device_copy.to(kCpu), host);
    check_same_bits(device_copy.transpose(0, 1).contiguous(), host.transpose(0, 1).contiguous());
    check_same_bits(device_copy.clone(), host);
  }
  // Float NaN payloads and negative zeros survive a same-dtype copy on the device.
  const Tensor special = from_vector<float>({-0.0f, kNaN});
  check_same_bits(special.to(kCuda).clone(), special);
}

TEST_CASE("cuda matches cpu: fill of strided views in every dtype", "[cuda-vs-cpu]") {
  for (const DType dtype : kAllDTypes) {
    INFO(dtype_name(dtype));
    compare_cuda_with_cpu(
        {zeros({13, 257}, TensorOptions{dtype, kCpu})},
        [](const Inputs& x) {
          Tensor t = x[0].clone();
          t.transpose(0, 1).narrow(0, 3, 100).fill_(Scalar(2.75));
          return t;
        },
        Tolerance{0.0, 0.0});
  }
}

TEST_CASE("cuda fills integers exactly beyond 2^53", "[cuda]") {
  const std::int64_t big = (std::int64_t{1} << 60) + 1;
  const Tensor filled = full({3}, big, TensorOptions{DType::i64, kCuda});
  CHECK(filled.to_vector<std::int64_t>() == std::vector<std::int64_t>(3, big));
}

TEST_CASE("cuda fills more elements than one grid covers", "[cuda]") {
  // 20M elements through a transposed view (the strided kernel) exceed kMaxBlocks * 256 threads, so
  // every thread loops; so do 67.2M dense f32 (the packed kernel: 4 elements a thread a step).
  Tensor strided = zeros({4001, 5000}, TensorOptions{DType::f32, kCuda});
  strided.transpose(0, 1).fill_(Scalar(1.5));
  CHECK(sum(ne(strided, 1.5)).item<std::int64_t>() == 0);
  const Tensor packed = full({8193, 8200}, 1.5, TensorOptions{DType::f32, kCuda});
  CHECK(sum(ne(packed, 1.5)).item<std::int64_t>() == 0);
}

SHARDLAB_CUDA_VS_CPU("where with broadcasting on f32",
                     {random_tensor({3, 1, 5}, 51), random_tensor({4, 5}, 52), random_tensor({5}, 53)},
                     [](const Inputs& x) { return where(gt(x[0], 0.0), x[1], x[2]); })

SHARDLAB_CUDA_VS_CPU("where on i64, bf16 and bool, with a Scalar branch",
                     {random_tensor({13, 257}, 54), random_tensor({257, 13}, 55)}, [](const Inputs& x) {
                       const Tensor condition = gt(x[0], 0.0);
                       const Tensor other = x[1].transpose(0, 1);
                       const Tensor integers = (other * 100.0).to(DType::i64);
                       return stack({where(condition, integers, 7).to(DType::f32),
                                     where(condition, other.to(DType::bf16), 0.5).to(DType::f32),
                                     where(condition, lt(other, 0.0), gt(other, 0.5)).to(DType::f32)},
                                    0);
                     })

// --- random ------------------------------------------------------------------------------------

TEST_CASE("cuda random draws have the CPU's bits; a sub-range drawn alone matches", "[cuda]") {
  const RandomKey key{2024, 9};
  for (const DType dtype : kFloatingDTypes) {
    INFO(dtype_name(dtype));
    const TensorOptions on_cuda{dtype, kCuda}, on_cpu{dtype, kCpu};
    const Tensor whole_uniform = uniform({1001}, key, -2.0, 3.0, on_cpu);
    const Tensor whole_normal = normal({1001}, key, 1.0, 0.5, on_cpu);
    check_same_bits(uniform({1001}, key, -2.0, 3.0, on_cuda), whole_uniform);
    check_same_bits(normal({1001}, key, 1.0, 0.5, on_cuda), whole_normal);
    for (const std::int64_t start : {1, 3, 333}) {
      check_same_bits(uniform({500}, key, -2.0, 3.0, on_cuda, start), whole_uniform.narrow(0, start, 500));
      check_same_bits(normal({500}, key, 1.0, 0.5, on_cuda, start), whole_normal.narrow(0, start, 500));
    }
  }
  for (const DType dtype : kAllDTypes) {
    INFO("bernoulli " << dtype_name(dtype));
    check_same_bits(bernoulli({7, 11}, key, 0.3, TensorOptions{dtype, kCuda}, 5),
                    bernoulli({7, 11}, key, 0.3, TensorOptions{dtype, kCpu}, 5));
  }
  // fill_random on an integer tensor runs the same kernel path as on the CPU.
  const RandomSpec spec{Distribution::uniform, key, 0.0, 1000.0, 17};
  const Tensor on_cuda = empty({257}, TensorOptions{DType::i32, kCuda});
  const Tensor on_cpu = empty({257}, TensorOptions{DType::i32, kCpu});
  fill_random(on_cuda, spec);
  fill_random(on_cpu, spec);
  check_same_bits(on_cuda, on_cpu);
  // Rows at offsets of their own (a shuffled batch's dropout masks): one launch, the CPU's bits.
  const std::vector<std::int64_t> row_first_indices{7 * 4099, 0, 3, 123457 * 4099};
  for (const DType dtype : {DType::f32, DType::bf16, DType::f64}) {
    INFO("rows " << dtype_name(dtype));
    const RandomSpec rows{Distribution::bernoulli, key, 0.4, 0.0, 0, row_first_indices};
    const Tensor rows_on_cuda = empty({4, 4099}, TensorOptions{dtype, kCuda});
    const Tensor rows_on_cpu = empty({4, 4099}, TensorOptions{dtype, kCpu});
    fill_random(rows_on_cuda, rows);
    fill_random(rows_on_cpu, rows);
    check_same_bits(rows_on_cuda, rows_on_cpu);
  }
}

TEST_CASE("cuda random draws match the CPU beyond one grid", "[cuda]") {
  const RandomKey key{7, 1};
  check_same_bits(uniform({20'000'003}, key, 0.0, 1.0, TensorOptions{DType::f32, kCuda}),
                  uniform({20'000'003}, key, 0.0, 1.0, TensorOptions{DType::f32, kCpu}));
}

// --- streams, events, allocator ------------------------------------------------------------------

TEST_CASE("an event orders work queued on two streams", "[cuda]") {
  cuda::Stream producer(0), consumer(0);
  const Tensor host = random_tensor({1 << 22}, 61);
  Tensor x;
  {
    const cuda::StreamGuard on_producer(producer);
    CHECK(&cuda::current_stream(0) == &producer);
    x = host.to(kCuda);
    for (int i = 0; i < 20; ++i) x = x * 1.0001 + 0.5;  // enough queued work to race against
  }
  CHECK(&cuda::current_stream(0) != &producer);  // the guard restored the default stream
  cuda::Event ready(0);
  ready.record(producer);
  ready.wait(consumer);
  Tensor y;
  {
    const cuda::StreamGuard on_consumer(consumer);
    y = x + 1.0;
    cuda::record_stream(x.storage()->data(), consumer);  // x is freed while y may still read it
  }
  x = Tensor();
  consumer.synchronize();
  CHECK(ready.query());
  ready.synchronize();

  Tensor expected = host;
  for (int i = 0; i < 20; ++i) expected = expected * 1.0001 + 0.5;
  test::check_close(y.to(kCpu), expected + 1.0);
}

TEST_CASE("the CUDA allocator counts a tensor's rounded bytes while it lives", "[cuda]") {
  auto& allocator = dynamic_cast<CachingAllocator&>(cuda::device_allocator(0));
  allocator.empty_cache();
  const MemoryStats before = memory_stats(kCuda);
  {
    const Tensor t = empty({1000}, TensorOptions{DType::f32, kCuda});  // 4000 -> 4096 bytes
    const MemoryStats during = memory_stats(kCuda);
    CHECK(during.bytes_in_use == before.bytes_in_use + 4096);
    CHECK(during.allocations == before.allocations + 1);
    CHECK(during.peak_bytes >= during.bytes_in_use);
  }
  const MemoryStats after = memory_stats(kCuda);
  CHECK(after.bytes_in_use == before.bytes_in_use);
  CHECK(after.bytes_cached == before.bytes_cached + 4096);
  reset_peak_memory(kCuda);
  CHECK(memory_stats(kCuda).peak_bytes == after.bytes_in_use);
}

TEST_CASE("record_stream holds a CUDA block back until the other stream's work ran", "[cuda]") {
  auto& allocator = dynamic_cast<CachingAllocator&>(cuda::device_allocator(0));
  cuda::Stream side(0);
  allocator.empty_cache();
  const Shape shape = {3, 1000, 1000};
  const std::int64_t block = static_cast<std::int64_t>(CachingAllocator::round_size(12'000'000));
  void* first = nullptr;
  {
    const Tensor t = random_tensor(shape, 71).to(kCuda);  // allocated on the default stream
    first = t.storage()->data();
    const cuda::StreamGuard on_side(side);
    const Tensor doubled = t * 2.0;  // queued on side, reading t
    cuda::record_stream(first, side);
  }                                                    // t is freed while side may still read it
  CHECK(allocator.stats().bytes_cached >= 2 * block);  // t held back, doubled idle on side
  side.synchronize();
  const Tensor again = empty(shape, TensorOptions{DType::f32, kCuda});
  CHECK(again.storage()->data() == first);  // collected once side's work completed
}

// --- pinned host memory (core/cuda/allocator.cpp) -------------------------------------------------

TEST_CASE("pin_memory copies a CPU tensor, strided too, into pinned memory", "[cuda]") {
  const Tensor source = random_tensor({6, 5}, 81).transpose(0, 1);
  const Tensor pinned = source.pin_memory();
  CHECK(pinned.is_pinned());
  CHECK(pinned.device() == kCpu);
  CHECK(pinned.is_contiguous());
  CHECK(pinned.storage() != source.storage());
  check_same_bits(pinned, source);
  CHECK(pinned.pin_memory().storage() == pinned.storage());  // already pinned: itself
  CHECK_FALSE((pinned + 1.0).is_pinned());                   // results of ops are ordinary memory
  CHECK(empty({0}, TensorOptions{}.with_pinned(true)).is_pinned());
}

TEST_CASE("a non-blocking copy from pinned memory is seen by later work on the stream", "[cuda]") {
  const Tensor host = random_tensor({1 << 20}, 82);
  const Tensor from_pinned = host.pin_memory().to(kCuda, /*non_blocking=*/true);
  const Tensor from_pageable = host.to(kCuda, /*non_blocking=*/true);  // pageable: waits, still right
  check_same_bits((from_pinned * 2.0).to(kCpu), host * 2.0);
  check_same_bits(from_pageable, host);
  check_same_bits(from_pinned.to(kCpu, /*non_blocking=*/true), host);  // to the host it always waits
}

TEST_CASE("a pinned block freed while its copy is queued is not reused until the copy ran", "[cuda]") {
  auto& allocator = dynamic_cast<CachingAllocator&>(cuda::pinned_host_allocator());
  allocator.empty_cache();
  const Shape shape = {16, 1 << 20};  // 64 MiB
  const Tensor expected = random_tensor(shape, 83);
  // Work queued ahead of the copy, long enough that the copy is still waiting below.
  Tensor busy = random_tensor({1 << 24}, 84).to(kCuda);
  for (int i = 0; i < 200; ++i) busy = busy * 1.0001 + 0.5;
  Tensor on_gpu;
  void* first = nullptr;
  {
    const Tensor pinned = expected.pin_memory();
    first = pinned.storage()->data();
    on_gpu = pinned.to(kCuda, /*non_blocking=*/true);
  }  // freed at once; the copy has not run yet
  CHECK(allocator.stats().bytes_cached >= static_cast<std::int64_t>(CachingAllocator::round_size(64 << 20)));
  {
    const Tensor scribble = full(shape, -1.0, TensorOptions{}.with_pinned(true));
    CHECK(scribble.storage()->data() != first);  // held back, not handed out while read
  }
  check_same_bits(on_gpu, expected);  // to(kCpu) waits for the stream: the copy read the values
  // Collected once the copy had run: two blocks of this size are idle now, the scribble's and
  // the first, so of two requests one gets the first (which one is the cache's address order).
  const Tensor again = empty(shape, TensorOptions{}.with_pinned(true));
  const Tensor other = empty(shape, TensorOptions{}.with_pinned(true));
  CHECK((again.storage()->data() == first || other.storage()->data() == first));
}

// --- host waits (core/host_wait.h) ---------------------------------------------------------------

TEST_CASE("values made on the host for a GPU (arange, from_vector) go up without a host wait", "[cuda]") {
  // The composed attention's mask and nll_loss's gradient make aranges inside a training step.
  Tensor counted, stepped, listed;
  reset_host_wait_counts();
  {
    HostWaitsForbidden step("training step");
    counted = arange(5, TensorOptions{DType::i64, kCuda});
    stepped = arange(1.0, 2.0, 0.25, TensorOptions{DType::f32, kCuda});
    listed = from_vector(std::vector<float>{2.5f, -1.0f}, kCuda);
  }
  CHECK(host_wait_total() == 0);
  CHECK(counted.to(kCpu).to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 1, 2, 3, 4});
  CHECK(stepped.to(kCpu).to_vector<float>() == std::vector<float>{1.0f, 1.25f, 1.5f, 1.75f});
  CHECK(listed.to(kCpu).to_vector<float>() == std::vector<float>{2.5f, -1.0f});
}

TEST_CASE("cuda work that needs no answer on the host queues without a host wait", "[cuda]") {
  const Tensor host = random_tensor({64, 8}, 85);
  const Tensor rows = from_vector(std::vector<std::int64_t>{3, 0, 63, 3}, {4});
  const Tensor on_gpu = host.pin_memory().to(kCuda, /*non_blocking=*/true);
  const Tensor rows_on_gpu = rows.pin_memory().to(kCuda, /*non_blocking=*/true);
  Tensor picked, param = on_gpu.clone(), exp_avg = zeros_like(param), exp_avg_sq = zeros_like(param);
  reset_host_wait_counts();
  {
    HostWaitsForbidden step("training step");
    picked = embedding(on_gpu, rows_on_gpu) * 2.0;  // the index check included
    const AdamSegment segments[] = {{param, on_gpu, exp_avg, exp_avg_sq, AdamHyper{}, Tensor()}};
    adam_step(segments);  // the multi-segment table goes up through pinned memory
    CHECK_THROWS_ERROR(picked.to(kCpu), "host wait inside 'training step': copy to host memory on cuda:0");
  }
  CHECK(host_wait_total() == 0);
  check_same_bits(picked, index_select(host, 0, rows) * 2.0);
  const AdamSegment reference[] = {
      {host.clone(), host, zeros_like(host), zeros_like(host), AdamHyper{}, Tensor()}};
  adam_step(reference);
  check_same_bits(param, reference[0].param);
  CHECK(host_wait_total() == 2);  // the two copies to the host
  reset_host_wait_counts();
}

TEST_CASE(
    "PendingRead from cuda: queued inside a step without a host wait, read once the work ran without one",
    "[cuda]") {
  const Tensor x = random_tensor({1000}, 87);
  const Tensor on_gpu = x.pin_memory().to(kCuda, /*non_blocking=*/true);
  reset_host_wait_counts();
  PendingRead read;
  {
    HostWaitsForbidden step("training step");
    const Tensor loss = sum(mul(on_gpu, on_gpu)), norm = sqrt(loss);
    read = PendingRead({loss, norm, isfinite(norm)});
  }
  CHECK(host_wait_total() == 0);
  cuda::current_stream(0).synchronize();  // the step's work has run: the read finds the values there
  reset_host_wait_counts();
  const std::vector<double> values = read.take();
  CHECK(host_wait_total() == 0);
  REQUIRE(values.size() == 3);
  const double expected = sum(mul(x, x)).item<double>();
  CHECK(std::abs(values[0] - expected) <= 1e-5 * expected);  // another summation order
  CHECK(std::abs(values[1] - std::sqrt(values[0])) <= 1e-6 * values[1]);
  CHECK(values[2] == 1);
  // Taken before the work ran, the read waits, and says why.
  PendingRead early({sum(on_gpu)});
  CHECK(early.take().size() == 1);
  for (const HostWaitCount& count : host_wait_counts()) CHECK(count.reason == "read values queued earlier");
  reset_host_wait_counts();
}

TEST_CASE("an out-of-range index on cuda is reported at the next host wait, and nothing else breaks",
          "[cuda]") {
  const Tensor x = random_tensor({4, 3}, 86).to(kCuda);
  const Tensor bad = from_vector(std::vector<std::int64_t>{1, 7}, {2}).to(kCuda);
  const Tensor negative = from_vector(std::vector<std::int64_t>{-2, 0}, {2}).to(kCuda);
  Tensor out;
  REQUIRE_NOTHROW(out = index_select(x, 0, bad));  // queued: the host does not wait for the check
  CHECK_THROWS_ERROR(out.to(kCpu),
                     "index_select: index 7 is out of range for the dimension of size 4 (found on cuda:0");
  // Reported once; the kernels skipped the bad values, so the device is still sound.
  check_same_bits(index_select(x, 0, from_vector(std::vector<std::int64_t>{1}, {1}).to(kCuda)),
                  index_select(x.to(kCpu), 0, from_vector(std::vector<std::int64_t>{1}, {1})));
  CHECK_THROWS_ERROR(embedding(x, negative).to(kCpu), "embedding: index -2 is out of range");
  CHECK_THROWS_ERROR(index_add(x, 0, bad, ones({2, 3}, TensorOptions{}.with_device(kCuda))).to(kCpu),
                     "index_add: index 7 is out of range");
  const Tensor bad_gather = from_vector(std::vector<std::int64_t>{0, 5, 1}, {1, 3}).to(kCuda);
  CHECK_THROWS_ERROR(gather(x, 1, bad_gather).to(kCpu), "gather: index 5 is out of range");
  CHECK_THROWS_ERROR(scatter_add(x, 1, bad_gather, ones({1, 3}, TensorOptions{}.with_device(kCuda))).to(kCpu),
                     "scatter_add: index 5 is out of range");
  cuda::current_stream(0).synchronize();  // nothing left to report
}

TEST_CASE("the profiler times a GPU kernel with timing events, not only its launch", "[cuda]") {
  const Tensor a = random_tensor({1024, 1024}, 88).to(kCuda);
  (void)matmul(a, a);  // cuBLAS's first call sets up its handle: not what is timed
  cuda::current_stream(0).synchronize();
  profile::start();
  for (int i = 0; i < 3; ++i) (void)matmul(a, a);
  profile::stop();
  const std::vector<profile::OpTotal> totals = profile::totals();  // waits for the GPU's work
  REQUIRE_FALSE(totals.empty());
  CHECK(totals.front().op == "matmul");
  CHECK(totals.front().calls == 3);
  // 3 x 2 x 1024^3 FLOPs: more than a microsecond on any GPU, less than a second.
  CHECK(totals.front().device_seconds > 1e-6);
  CHECK(totals.front().device_seconds < 1.0);
  CHECK(profile::by_category(totals, 1.0).front().category == "GEMM");
}

TEST_CASE("a cross-entropy target far out of range on cuda is the named index error, not a dead context",
          "[cuda]") {
  const Tensor logits = random_tensor({3, 5}, 87).to(kCuda);
  // 2^40 classes past the row: read unguarded it would be an illegal address.
  const Tensor targets =
      from_vector(std::vector<std::int64_t>{1, std::int64_t{1} << 40, -100}, {3}).to(kCuda);
  CrossEntropyResult result;
  REQUIRE_NOTHROW(result = cross_entropy_forward(logits, targets, -100));
  CHECK_THROWS_ERROR(result.losses.to(kCpu), "cross_entropy: index 1099511627776 is out of range");
  // The device is still sound: a good row's loss is the CPU's.
  const Tensor good = from_vector(std::vector<std::int64_t>{1, 4, -100}, {3});
  CHECK(test::count_mismatches(cross_entropy_forward(logits, good.to(kCuda), -100).losses.to_vector<double>(),
                               cross_entropy_forward(logits.to(kCpu), good, -100).losses.to_vector<double>(),
                               {1e-6, 1e-6}) == 0);
}

// --- softmax (core/cuda/softmax.cu) ---------------------------------------------------------------

// Rows longer than a block, shorter than a warp, along the last dim and along a middle one
// (strided rows), in every floating dtype.
SHARDLAB_CUDA_VS_CPU("softmax and log_softmax along the last dim, rows of 1 to 1031",
                     {random_tensor({7, 1031}, 61)}, [](const Inputs& x) {
                       return cat({softmax(x[0], -1), log_softmax(x[0].narrow(1, 0, 13), -1),
                                   softmax(x[0].narrow(1, 0, 1), -1).expand({7, 1}).contiguous()},
                                  1);
                     });
// cross_entropy_forward and _backward of logits [9, 1031] (rows longer than a block) or [9, 1032] (rows
// of whole 16-byte packs: the packed backward) in `dtype`, with ignored rows under the default
// ignore_index and a custom one: losses, logsumexp and gradient, as f32.
Tensor cross_entropy_parts(const Tensor& x, DType dtype) {
  const Device device = x.device();
  const Tensor logits = x.to(dtype), grad = full({9}, 0.5, TensorOptions{dtype, device});
  std::vector<Tensor> parts;
  for (const auto& [targets, ignore] :
       {std::pair{std::vector<std::int64_t>{0, 1030, -100, 5, 5, 77, 3, -100, 512}, std::int64_t{-100}},
        std::pair{std::vector<std::int64_t>{0, 1030, 3, 5, 5, 77, 3, 2, 512}, std::int64_t{3}}}) {
    const Tensor t = from_vector(targets, {9}).to(device);
    const CrossEntropyResult r = cross_entropy_forward(logits, t, ignore);
    parts.push_back(r.losses.to(DType::f32));
    parts.push_back(r.logsumexp.to(DType::f32));
    parts.push_back(cross_entropy_backward(grad, logits, t, ignore, r.logsumexp).to(DType::f32).flatten());
  }
  return cat(parts, 0);
}
SHARDLAB_CUDA_VS_CPU(
    "cross_entropy from logits, forward and backward, f32 and f64", {random_tensor({9, 1031}, 65)},
    [](const Inputs& x) {
      return cat({cross_entropy_parts(x[0], DType::f32), cross_entropy_parts(x[0], DType::f64)}, 0);
    });
SHARDLAB_CUDA_VS_CPU(
    "cross_entropy from logits, forward and backward, bf16", {random_tensor({9, 1031}, 66)},
    [](const Inputs& x) { return cross_entropy_parts(x[0], DType::bf16); }, Tolerance{1e-2, 1e-2});
SHARDLAB_CUDA_VS_CPU(
    "cross_entropy over rows of whole 16-byte packs, forward and backward, f32 and bf16",
    {random_tensor({9, 1032}, 64)},
    [](const Inputs& x) {
      return cat({cross_entropy_parts(x[0], DType::f32), cross_entropy_parts(x[0], DType::bf16)}, 0);
    },
    Tolerance{1e-2, 1e-2});
TEST_CASE("cuda cross_entropy of bf16 and f16 logits has an f32 copy's bits, its gradient rounded once",
          "[cuda]") {
  const Tensor targets = from_vector<std::int64_t>({0, 1030, -100, 5, 5, 77, 3, -100, 512}, {9}).to(kCuda);
  const Tensor grad = full({9}, 1.0 / 3, TensorOptions{DType::f32, kCuda});  // no half holds 1/3
  for (const DType half : {DType::bf16, DType::f16}) {
    for (const std::int64_t classes : {1031, 1032}) {  // the backward by element and by 16-byte pack
      INFO(dtype_name(half) << ", " << classes << " classes");
      const Tensor logits = random_tensor({9, classes}, 67).to(half).to(kCuda);
      const Tensor copy = logits.to(DType::f32);
      const CrossEntropyResult result = cross_entropy_forward(logits, targets);
      const CrossEntropyResult expected = cross_entropy_forward(copy, targets);
      CHECK(result.losses.dtype() == DType::f32);
      CHECK(test::same_bits(result.losses, expected.losses.to(kCpu)));
      CHECK(test::same_bits(result.logsumexp, expected.logsumexp.to(kCpu)));
      CHECK(test::same_bits(
          cross_entropy_backward(grad, logits, targets, -100, result.logsumexp),
          cross_entropy_backward(grad, copy, targets, -100, expected.logsumexp).to(half).to(kCpu)));
    }
  }
}
// rms_norm, swiglu and the rotary embedding (core/cuda/transformer.cu), forward and backward: rows
// longer than a block, in f32, f64 and bf16 (compared as f32).
Tensor transformer_parts(const Inputs& x, DType dtype) {
  const Tensor h = x[0].to(dtype), g = x[1].to(dtype), w = x[2].to(dtype);  // [3, 5, 300], [3, 5, 300], [300]
  const RmsNormResult norm = rms_norm_forward(h, w, 1e-6);
  const RmsNormGrads norm_grads = rms_norm_backward(g, h, w, norm.rstd);
  const RmsNormResult added = add_rms_norm_forward(h, g, w, 1e-6);
  const SwigluGrads gates = swiglu_backward(g, h, g * 0.5);
  const Tensor cos = w.narrow(0, 0, 60).reshape({5, 12}), sin = w.narrow(0, 60, 60).reshape({5, 12});
  const Tensor heads = h.narrow(2, 0, 36).reshape({3, 3, 5, 12});
  // Views one element in: off 16 bytes, so the element-by-element path (dense ones move in packs).
  const Tensor h_shifted = h.flatten().narrow(0, 1, h.numel() - 1),
               g_shifted = g.flatten().narrow(0, 1, g.numel() - 1);
  const SwigluGrads shifted = swiglu_backward(g_shifted, h_shifted, g_shifted);
  std::vector<Tensor> parts = {norm.out,
                               norm.rstd,
                               norm_grads.x,
                               norm_grads.weight,
                               added.sum,
                               added.out,
                               added.rstd,
                               swiglu(h, g),
                               gates.gate,
                               gates.up,
                               swiglu(h_shifted, g_shifted),
                               shifted.gate,
                               shifted.up,
                               rotary(heads, cos, sin),
                               rotary(heads, cos, sin, /*transpose=*/true)};
  for (Tensor& part : parts) part = part.to(DType::f32).flatten();
  return cat(parts, 0);
}
SHARDLAB_CUDA_VS_CPU("rms_norm, swiglu and rotary embedding forward and backward, f32 and f64",
                     {random_tensor({3, 5, 300}, 67), random_tensor({3, 5, 300}, 68),
                      random_tensor({300}, 69)},
                     [](const Inputs& x) {
                       return cat({transformer_parts(x, DType::f32), transformer_parts(x, DType::f64)}, 0);
                     });
SHARDLAB_CUDA_VS_CPU(
    "rms_norm, swiglu and rotary embedding forward and backward, bf16",
    {random_tensor({3, 5, 300}, 70), random_tensor({3, 5, 300}, 71), random_tensor({300}, 72)},
    [](const Inputs& x) { return transformer_parts(x, DType::bf16); }, Tolerance{1e-2, 1e-2});
TEST_CASE("cuda add_rms_norm has the bits of add then rms_norm on the GPU", "[cuda]") {
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const std::int64_t width : {300, 768}) {  // rows longer than a block, and the Llama's
      INFO(dtype_name(dtype) << ", width " << width);
      const auto operand = [&](const Shape& shape, std::uint64_t seed) {
        return random_tensor(shape, seed, DType::f32, -2, 2).to(dtype).to(kCuda);
      };
      const Tensor x = operand({7, width}, 76), y = operand({7, width}, 77), w = operand({width}, 78);
      const RmsNormResult fused = add_rms_norm_forward(x, y, w, 1e-5);
      const Tensor sum = add(x, y);
      const RmsNormResult composed = rms_norm_forward(sum, w, 1e-5);
      CHECK(test::same_bits(fused.sum, sum.to(kCpu)));
      CHECK(test::same_bits(fused.out, composed.out.to(kCpu)));
      CHECK(test::same_bits(fused.rstd, composed.rstd.to(kCpu)));
    }
  }
}
// The weight gradient over 1000 rows: three whole chunks of 256 rows and a partial one, summed in the
// same order on both devices (core/column_sums.h): f64 to the last bits.
SHARDLAB_CUDA_VS_CPU(
    "rms_norm's weight gradient over several chunks of rows, f64",
    {random_tensor({1000, 300}, 73, DType::f64), random_tensor({1000, 300}, 74, DType::f64),
     random_tensor({300}, 75, DType::f64)},
    [](const Inputs& x) {
      return rms_norm_backward(x[1], x[0], x[2], rms_norm_forward(x[0], x[2], 1e-6).rstd).weight;
    },
    Tolerance{1e-13, 1e-13});
SHARDLAB_CUDA_VS_CPU("log_softmax along a middle dim of a strided input",
                     {test::random_strided({3, 37, 5}, 62)},
                     [](const Inputs& x) { return log_softmax(x[0], 1); });
SHARDLAB_CUDA_VS_CPU("softmax in f64", {random_tensor({4, 300}, 63, DType::f64)},
                     [](const Inputs& x) { return softmax(x[0], 1); });
SHARDLAB_CUDA_VS_CPU(
    "softmax in bf16 and f16", {random_tensor({5, 129}, 64, DType::bf16)}, [](const Inputs& x) {
      return cat({softmax(x[0], -1).to(DType::f32), log_softmax(x[0].to(DType::f16), -1).to(DType::f32)}, 1);
    });
// Rows that are all -inf, or hold +-inf among finite values, keep the CPU's NaN/-inf pattern.
SHARDLAB_CUDA_VS_CPU("softmax of rows with infinities",
                     {from_vector<float>({-INFINITY, -INFINITY, -INFINITY, 1.0f, -INFINITY, 2.0f}, {2, 3})},
                     [](const Inputs& x) {
                       return cat({softmax(x[0], 1), log_softmax(x[0], 1)}, 1);
                     });

// --- reductions (core/cuda/reduce.cu) -------------------------------------------------------------

// Every op over one dim, two non-adjacent dims, all dims and none, keepdim or not; rows longer
// than a block; f32 (accumulated in double on both sides), bf16, integers to i64.
SHARDLAB_CUDA_VS_CPU("sum, mean and sum_squares over any dims", {test::random_strided({5, 37, 300}, 71)},
                     [](const Inputs& x) {
                       return cat({sum(x[0], {1}).flatten(), mean(x[0], {0, 2}, true).flatten(),
                                   sum_squares(x[0]).flatten(), sum(x[0], {}).flatten()},
                                  0);
                     });
// Few long rows, which a GPU sums in two passes (a block per chunk of 32768, then the chunks): a
// whole tensor, 3 rows with a partial last chunk, and bf16 and integer inputs; f64 sums on both sides.
SHARDLAB_CUDA_VS_CPU("sum, mean and sum_squares of few rows longer than a chunk",
                     {random_tensor({3, 70001}, 76)}, [](const Inputs& x) {
                       const Tensor integers = (x[0] * 100.0).to(DType::i64);
                       return cat({sum(x[0], {1}), mean(x[0], {1}), sum_squares(x[0], {1}),
                                   sum(x[0], {}).reshape({1}),
                                   sum_squares(x[0].to(DType::bf16), {}).to(DType::f32).reshape({1}),
                                   sum(integers, {1}).to(DType::f32)},
                                  0);
                     });
SHARDLAB_CUDA_VS_CPU("max, min and argmax, ties to the first index", {random_tensor({6, 513}, 72)},
                     [](const Inputs& x) {
                       const Tensor rounded = (x[0] * 4.0).to(DType::i32).to(DType::f32);  // many ties
                       return cat({max(rounded, {1}), min(rounded, {0}), argmax(rounded, {1}).to(DType::f32),
                                   argmax(rounded, {0, 1}).flatten().to(DType::f32)},
                                  0);
                     });
SHARDLAB_CUDA_VS_CPU("integer sums to i64 and bf16 sums", {random_tensor({9, 260}, 73)}, [](const Inputs& x) {
  const Tensor integers = (x[0] * 100.0).to(DType::i32);
  return cat({sum(integers, {1}).to(DType::f32), sum(x[0].to(DType::bf16), {1}).to(DType::f32),
              sum((x[0] * 10.0).to(DType::u8), {0}).to(DType::f32)},
             0);
});
// One launch for many tensors, in core/square_sums.h's order on both devices: the same bits.
SHARDLAB_CUDA_VS_CPU(
    "foreach_sum_squares over mixed dtypes, odd sizes and more chunks than lanes: the same bits",
    {random_tensor({70001}, 77, DType::f32, -3.0, 3.0), random_tensor({257 * 32768 + 5}, 78, DType::bf16),
     random_tensor({3, 5}, 79, DType::f16, -8.0, 8.0), random_tensor({300, 200}, 80, DType::f64, -1e3, 1e3),
     empty({0})},
    [](const Inputs& x) {
      const std::vector<Tensor> tensors = {x[0], x[1], x[2], x[3].transpose(0, 1), x[4]};
      return foreach_sum_squares(tensors);
    },
    Tolerance{0.0, 0.0})
SHARDLAB_CUDA_VS_CPU("max and argmax keep the first NaN",
                     {from_vector<float>({1.0f, NAN, 3.0f, NAN, 2.0f, 5.0f}, {2, 3})}, [](const Inputs& x) {
                       return cat({max(x[0], {1}), argmax(x[0], {1}).to(DType::f32), min(x[0], {0})}, 0);
                     });

// --- matmul (core/cuda/gemm.cpp) --------------------------------------------------------------------

// Shapes off every tile size; row-major, transposed (column-major) and strided operands; a
// broadcast batch; f32 (f32 accumulation on both sides), f64, bf16 and f16.
SHARDLAB_CUDA_VS_CPU("matmul of row-major, transposed and broadcast operands",
                     {random_tensor({3, 37, 61}, 81), random_tensor({61, 45}, 82),
                      random_tensor({45, 61}, 83)},
                     [](const Inputs& x) {
                       return cat(
                           {matmul(x[0], x[1]).flatten(), matmul(x[0], x[2].transpose(0, 1)).flatten(),
                            matmul(x[0].narrow(2, 0, 30), x[1].narrow(0, 0, 30).narrow(1, 1, 40)).flatten()},
                           0);
                     });
SHARDLAB_CUDA_VS_CPU("matmul in f64",
                     {random_tensor({17, 33}, 84, DType::f64), random_tensor({33, 9}, 85, DType::f64)},
                     [](const Inputs& x) { return matmul(x[0], x[1]); });
// Both devices accumulate the 130 products in f32, in other orders, then round to bf16 (f16): each
// result lies within half a bf16 step of the f64 product plus the f32 sums' difference, at most
// 130 * 2^-24 * sum |a b| < 1e-3 (|a|, |b| <= 1); so they may differ by one bf16 step, 2^-7 of
// the value, and by 1e-3 near zero. Under the f32 tolerance an H100 failed on 1 of the 1596 outputs.
constexpr Tolerance kHalfGemmTolerance{1e-3, 0x1p-7};
SHARDLAB_CUDA_VS_CPU(
    "matmul in bf16 and f16 with f32 accumulation",
    {random_tensor({2, 19, 130}, 86, DType::bf16), random_tensor({130, 21}, 87, DType::bf16)},
    [](const Inputs& x) {
      return cat({matmul(x[0], x[1]).to(DType::f32).flatten(),
                  matmul(x[0].to(DType::f16), x[1].to(DType::f16)).to(DType::f32).flatten()},
                 0);
    },
    kHalfGemmTolerance);
// linear's bias: in cuBLASLt's epilogue over one GEMM of all the rows and over a batch of GEMMs (rows
// of a view that do not follow one another), with a weight and bias that start 4 bytes into their
// storage (as inside FSDP's gathered buffer), and added after the GEMM in f64.
SHARDLAB_CUDA_VS_CPU(
    "linear with a bias, folded and batched, f32 and f64",
    {random_tensor({3, 37, 61}, 94), random_tensor({45, 61}, 95), random_tensor({45}, 96)},
    [](const Inputs& x) {
      const Tensor spaced = x[0].narrow(1, 0, 30);  // batches 37 rows apart, 30 used
      const Tensor offset_weight = x[1].flatten().narrow(0, 1, 44 * 61).reshape({44, 61});
      return cat(
          {linear(x[0], x[1], x[2]).flatten(), linear(spaced, x[1], x[2]).flatten(),
           linear(x[0].select(0, 1), x[1], x[2]).flatten(),
           linear(x[0], offset_weight, x[2].narrow(0, 1, 44)).flatten(),
           linear(x[0].to(DType::f64), x[1].to(DType::f64), x[2].to(DType::f64)).to(DType::f32).flatten()},
          0);
    });
SHARDLAB_CUDA_VS_CPU(
    "linear with a bias in bf16 and f16, added before the one rounding",
    {random_tensor({2, 19, 130}, 97), random_tensor({21, 130}, 98), random_tensor({21}, 99)},
    [](const Inputs& x) {
      std::vector<Tensor> parts;
      for (const DType half : {DType::bf16, DType::f16})
        parts.push_back(linear(x[0].to(half), x[1].to(half), x[2].to(half)).to(DType::f32).flatten());
      return cat(parts, 0);
    },
    kHalfGemmTolerance);
SHARDLAB_CUDA_VS_CPU("matmul with an empty inner dimension gives zeros",
                     {random_tensor({4, 0}, 88), random_tensor({0, 3}, 89)},
                     [](const Inputs& x) { return matmul(x[0], x[1]); });

// --- index and pooling kernels (core/cuda/index.cu, core/cuda/pool.cu) ---------------------------

namespace {
Tensor indices(const std::vector<std::int64_t>& values, const Shape& shape) {
  return from_vector(values, shape);
}
}  // namespace

SHARDLAB_CUDA_VS_CPU(
    "index_select and gather along a middle dim", {random_tensor({4, 9, 33}, 91)}, [](const Inputs& x) {
      const Tensor picks = indices({8, 0, 3, 3, 5}, {5}).to(x[0].device());
      const Tensor where = indices(std::vector<std::int64_t>(4 * 2 * 33, 7), {4, 2, 33}).to(x[0].device());
      return cat({index_select(x[0], 1, picks).flatten(), gather(x[0], 1, where).flatten()}, 0);
    });
// Repeated indices add in order on both sides, 16-bit floats in f32 rounded once: the sums match
// bit for bit.
SHARDLAB_CUDA_VS_CPU(
    "index_add and scatter_add with repeated indices, and the embedding backward",
    {random_tensor({6, 300}, 92), random_tensor({5, 300}, 93)},
    [](const Inputs& x) {
      const Device device = x[0].device();
      const Tensor rows = indices({1, 4, 1, 1, 0}, {5}).to(device);
      std::vector<std::int64_t> targets;
      for (int i = 0; i < 5 * 300; ++i) targets.push_back(i * 7 % 6);
      const Tensor where = indices(targets, {5, 300}).to(device);
      std::vector<Tensor> sums;
      for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        const Tensor self = x[0].to(dtype), src = x[1].to(dtype);
        for (const Tensor& sum : {index_add(self, 0, rows, src), scatter_add(self, 0, where, src),
                                  embedding_backward(src, rows, 6)})
          sums.push_back(sum.to(DType::f32).flatten());
      }
      return cat(sums, 0);
    },
    Tolerance{0.0, 0.0});
// Many picks per row (a batch's tokens over a small vocabulary): segments of up to ~30 picks, along a
// middle dim (3 outer slices), onto nonzero rows; bit for bit, as both add each row's picks in order.
SHARDLAB_CUDA_VS_CPU(
    "index_add of 700 picks over 50 rows along a middle dim",
    {random_tensor({3, 50, 40}, 95), random_tensor({3, 700, 40}, 96)},
    [](const Inputs& x) {
      std::vector<std::int64_t> picks;
      for (std::int64_t j = 0; j < 700; ++j) picks.push_back(j * j % 47 + j % 3);
      return index_add(x[0], 1, indices(picks, {700}).to(x[0].device()), x[1]);
    },
    Tolerance{0.0, 0.0});
SHARDLAB_CUDA_VS_CPU("max_pool2d and its backward: 2x2 windows, and 3x3 stride 2 padded overlapping ones",
                     {random_tensor({2, 3, 13, 11}, 94)}, [](const Inputs& x) {
                       const MaxPool2dResult plain = max_pool2d(x[0], {.kernel_size = 2});
                       const MaxPool2dResult padded =
                           max_pool2d(x[0], {.kernel_size = 3, .stride = 2, .padding = 1});
                       const Tensor back = max_pool2d_backward(padded.values, padded.indices, x[0].shape());
                       const Tensor back_bf16 =
                           max_pool2d_backward(padded.values.to(DType::bf16), padded.indices, x[0].shape());
                       return cat(
                           {plain.values.flatten(), plain.indices.to(DType::f32).flatten(),
                            padded.values.flatten(), back.flatten(), back_bf16.to(DType::f32).flatten()},
                           0);
                     });

// --- fused optimizer steps (core/cuda/optimizer.cu) ----------------------------------------------

// Three steps with weight decay on strided f32 operands, and a bf16 run: parameter and both
// state tensors after the steps.
SHARDLAB_CUDA_VS_CPU("adadelta_step over three steps, strided operands, f32 and bf16",
                     {test::random_strided({37, 41}, 101), random_tensor({37, 41}, 102)},
                     [](const Inputs& x) {
                       std::vector<Tensor> results;
                       for (const DType dtype : {DType::f32, DType::bf16}) {
                         // A fresh copy, strided like x[0]: for f32, to() and contiguous() would
                         // hand back x[0] itself, and the steps would write into the input.
                         const Tensor param = x[0].to(dtype).transpose(0, 1).clone().transpose(0, 1);
                         const Tensor square_avg = zeros_like(param), acc_delta = zeros_like(param);
                         for (int step = 0; step < 3; ++step) {
                           adadelta_step(param, x[1].to(dtype) * (step + 1.0), square_avg, acc_delta,
                                         {.lr = 1.0, .rho = 0.9, .eps = 1e-6, .weight_decay = 0.01});
                         }
                         for (const Tensor& t : {param, square_avg, acc_delta})
                           results.push_back(t.to(DType::f32).flatten());
                       }
                       return cat(results, 0);
                     });

// Multi-segment steps as an optimizer issues them, on parameters of `dtype`: slices of one flat
// shard with sizes around the block size and the kernel's chunk (and an empty one), a strided
// parameter (the strided kernel), each with its own lr, weight decay and step; f32 slices also
// write a bf16 copy-out. Every operand after two steps and a third one gated off, in f32.
Tensor segmented_steps(const Inputs& x, DType dtype) {
  const std::int64_t sizes[] = {1, 255, 257, 0, 1023, 1025, 2389};
  const Tensor flat = x[0].to(dtype).clone(), flat_grad = x[1].to(dtype);
  std::vector<AdamSegment> adam;
  std::vector<AdadeltaSegment> adadelta;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    const Tensor param = flat.narrow(0, offset, sizes[i]), grad = flat_grad.narrow(0, offset, sizes[i]);
    offset += sizes[i];
    const double lr = 1e-3 * static_cast<double>(i + 1), decay = 0.05 * static_cast<double>(i % 3);
    const Tensor copy =
        dtype == DType::f32 ? empty(param.shape(), TensorOptions{DType::bf16, param.device()}) : Tensor();
    const AdamHyper adam_hyper{
        .lr = lr, .weight_decay = decay, .decoupled = i % 2 == 0, .step = static_cast<std::int64_t>(i) + 1};
    adam.push_back({param, grad, zeros_like(param), zeros_like(param), adam_hyper, copy});
    const AdadeltaHyper adadelta_hyper{
        .lr = 100 * lr, .rho = 0.9 - 0.01 * static_cast<double>(i), .weight_decay = decay};
    const Tensor other = param.clone();
    adadelta.push_back({other, grad, zeros_like(other), zeros_like(other), adadelta_hyper});
  }
  const Tensor grad = x[3].to(dtype);
  const auto strided = [&] { return x[2].to(dtype).transpose(0, 1).clone().transpose(0, 1); };
  adam.push_back({strided(), grad, zeros_like(grad), zeros_like(grad), {.lr = 1e-2, .step = 2}, {}});
  adadelta.push_back({strided(), grad, zeros_like(grad), zeros_like(grad), {.weight_decay = 0.1}});
  // The second step gated open, a third gated shut (which must write nothing): gates on the device.
  const TensorOptions on_device{DType::f32, flat.device()};
  const Tensor open = isfinite(zeros({}, on_device)), shut = isfinite(full({}, NAN, on_device));
  for (int step = 0; step < 3; ++step) {
    const Tensor apply = step == 0 ? Tensor() : step == 1 ? open : shut;
    adam_step(adam, apply);
    adadelta_step(adadelta, apply);
    for (AdamSegment& s : adam) ++s.hyper.step;
  }
  std::vector<Tensor> results;
  for (const AdamSegment& s : adam) {
    for (const Tensor& t : {s.param, s.exp_avg, s.exp_avg_sq, s.copy_out}) {
      if (t.defined()) results.push_back(t.to(DType::f32).flatten());
    }
  }
  for (const AdadeltaSegment& s : adadelta) {
    for (const Tensor& t : {s.param, s.square_avg, s.acc_delta})
      results.push_back(t.to(DType::f32).flatten());
  }
  return cat(results, 0);
}
const Inputs kSegmentInputs = {random_tensor({5000}, 121), random_tensor({5000}, 122),
                               random_tensor({19, 23}, 123), random_tensor({19, 23}, 124)};
SHARDLAB_CUDA_VS_CPU("adam_step and adadelta_step over f32 segments with their own hyper-parameters",
                     kSegmentInputs, [](const Inputs& x) { return segmented_steps(x, DType::f32); });
// nvcc's fused multiply-adds can move a bf16 result by one rounding step.
SHARDLAB_CUDA_VS_CPU(
    "adam_step and adadelta_step over bf16 segments with their own hyper-parameters", kSegmentInputs,
    [](const Inputs& x) { return segmented_steps(x, DType::bf16); }, test::default_tolerance(DType::bf16));

// --- conv2d (core/cuda/cudnn_conv.cpp where cuDNN was found, else core/cuda/conv.cu + cuBLAS) --------

// Odd sizes, padding and stride 2 (taps that skip pixels), with bias; both gradients.
SHARDLAB_CUDA_VS_CPU("conv2d forward with bias, and both gradients, stride 2 and padding 1",
                     {random_tensor({3, 5, 13, 11}, 111), random_tensor({7, 5, 3, 3}, 112),
                      random_tensor({7}, 113)},
                     [](const Inputs& x) {
                       const Conv2dParams p{.stride = 2, .padding = 1};
                       const Tensor out = conv2d(x[0], x[1], x[2], p);
                       const Tensor grad = out * 0.5;
                       return cat(
                           {out.flatten(), conv2d_backward_input(grad, x[1], x[0].shape(), p).flatten(),
                            conv2d_backward_weight(grad, x[0], x[1].shape(), p).flatten()},
                           0);
                     });
SHARDLAB_CUDA_VS_CPU("conv2d forward and both gradients in f64",
                     {random_tensor({2, 3, 9, 8}, 116, DType::f64),
                      random_tensor({4, 3, 3, 3}, 117, DType::f64)},
                     [](const Inputs& x) {
                       const Conv2dParams p{.stride = 1, .padding = 1};
                       const Tensor out = conv2d(x[0], x[1], {}, p);
                       return cat({out.flatten(), conv2d_backward_input(out, x[1], x[0].shape(), p).flatten(),
                                   conv2d_backward_weight(out, x[0], x[1].shape(), p).flatten()},
                                  0);
                     });
// 288 products per output, accumulated in f32 on both devices and rounded to bf16 once: the
// argument of the bf16 matmul above, with 288 * 2^-24 * 288 < 5e-3 near zero.
SHARDLAB_CUDA_VS_CPU(
    "conv2d of the tutorial CNN's second layer shape in bf16",
    {random_tensor({2, 32, 26, 26}, 114, DType::bf16), random_tensor({64, 32, 3, 3}, 115, DType::bf16)},
    [](const Inputs& x) { return conv2d(x[0], x[1]).to(DType::f32); }, Tolerance{5e-3, 0x1p-7});
// Both gradients in bf16 at stride 2 and padding 1: at most 54 (input) and 50 (weight) products per
// value, accumulated in f32 on both devices and rounded to bf16 once, so one bf16 ulp apart at most.
SHARDLAB_CUDA_VS_CPU(
    "conv2d's two gradients in bf16, stride 2 and padding 1",
    {random_tensor({2, 8, 9, 10}, 118, DType::bf16), random_tensor({6, 8, 3, 3}, 119, DType::bf16),
     random_tensor({2, 6, 5, 5}, 120, DType::bf16)},
    [](const Inputs& x) {
      const Conv2dParams p{.stride = 2, .padding = 1};
      return cat({conv2d_backward_input(x[2], x[1], x[0].shape(), p).flatten(),
                  conv2d_backward_weight(x[2], x[0], x[1].shape(), p).flatten()},
                 0)
          .to(DType::f32);
    },
    Tolerance{1e-2, 0x1p-7});

// Adam and AdamW over three steps on a flat f32 shard with a bf16 copy-out, as FSDP uses it.
SHARDLAB_CUDA_VS_CPU("adam_step (Adam and AdamW) on a flat f32 shard with bf16 copy-out",
                     {random_tensor({1001}, 103), random_tensor({1001}, 104)}, [](const Inputs& x) {
                       std::vector<Tensor> results;
                       for (const bool decoupled : {false, true}) {
                         const Tensor param = x[0].clone(), m = zeros_like(param), v = zeros_like(param);
                         const Tensor copy = empty({1001}, TensorOptions{DType::bf16, param.device()});
                         for (std::int64_t step = 1; step <= 3; ++step) {
                           adam_step(param, x[1] * static_cast<double>(step), m, v,
                                     {.lr = 1e-2, .weight_decay = 0.1, .decoupled = decoupled, .step = step},
                                     copy);
                         }
                         for (const Tensor& t : {param, m, v, copy.to(DType::f32)}) results.push_back(t);
                       }
                       return cat(results, 0);
                     });

}  // namespace
}  // namespace shardlab
