// tests/core/test_dtype.cpp: dtype sizes and names, promotion, bf16/f16 round-to-nearest-even, and
// float-to-integer conversion at the edges.
#include <cmath>
#include <cstring>
#include <limits>

#include "tests/check.h"

using namespace shardlab;

TEST_CASE("dtype sizes and names", "[dtype]") {
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK(dtype_size(DType::i32) == 4);
  CHECK(dtype_size(DType::u8) == 1);
  CHECK(dtype_size(DType::boolean) == 1);
  CHECK(dtype_name(DType::bf16) == "bf16");
  CHECK(dtype_name(DType::boolean) == "bool");
  CHECK(is_floating(DType::f16));
  CHECK_FALSE(is_floating(DType::i32));
  CHECK(is_integral(DType::u8));
  CHECK_FALSE(is_integral(DType::boolean));
}

TEST_CASE("promotion follows bool < integers < floats, wider wins", "[dtype]") {
  CHECK(promote_types(DType::f32, DType::f32) == DType::f32);
  CHECK(promote_types(DType::bf16, DType::f16) == DType::f32);
  CHECK(promote_types(DType::f16, DType::f64) == DType::f64);
  CHECK(promote_types(DType::i64, DType::f16) == DType::f16);
  CHECK(promote_types(DType::u8, DType::i32) == DType::i32);
  CHECK(promote_types(DType::i64, DType::i32) == DType::i64);
  CHECK(promote_types(DType::boolean, DType::u8) == DType::u8);
  CHECK(promote_types(DType::boolean, DType::bf16) == DType::bf16);
  // Symmetric for every pair.
  for (int a = 0; a < kNumDTypes; ++a) {
    for (int b = 0; b < kNumDTypes; ++b) {
      CHECK(promote_types(DType(a), DType(b)) == promote_types(DType(b), DType(a)));
    }
  }
}

namespace {

// Nearest representable value by brute force: the candidate with the smallest distance,
// ties to the even bit pattern. `decode` maps 16-bit patterns to exact doubles.
template <typename Decode>
std::uint16_t nearest_pattern(double value, Decode decode) {
  std::uint16_t best = 0;
  double best_distance = INFINITY;
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const double candidate = decode(static_cast<std::uint16_t>(bits));
    if (std::isnan(candidate)) continue;
    const double distance = std::abs(candidate - value);
    if (distance < best_distance ||
        (distance == best_distance && (bits & 1) == 0 && std::signbit(candidate) == std::signbit(value))) {
      best = static_cast<std::uint16_t>(bits);
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace

TEST_CASE("bf16 conversion rounds to nearest even", "[dtype]") {
  // Hand-worked: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(float_to_bf16(1.0f + 1.0f / 256).bits == 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  CHECK(float_to_bf16(1.0f + 3.0f / 256).bits == 0x3f82);
  CHECK(float_to_bf16(1.0f + 1.0f / 256 + 1.0f / 65536).bits == 0x3f81);  // above half: up
  CHECK(float_to_bf16(-2.0f).bits == 0xc000);
  CHECK(float_to_bf16(INFINITY).bits == 0x7f80);
  CHECK(float_to_bf16(std::numeric_limits<float>::max()).bits == 0x7f80);  // overflows to inf
  CHECK(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  CHECK(bf16_to_float(bf16{0x3fc0}) == 1.5f);
  // Every bf16 value survives a round trip through float.
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const bf16 value{static_cast<std::uint16_t>(bits)};
    const float f = bf16_to_float(value);
    if (std::isnan(f)) continue;
    REQUIRE(float_to_bf16(f).bits == bits);
  }
  // Against the brute-force nearest pattern on random floats.
  const std::vector<float> samples =
      test::random_tensor({2000}, 3, DType::f32, -300.0, 300.0).to_vector<float>();
  for (const float f : samples) {
    REQUIRE(float_to_bf16(f).bits ==
            nearest_pattern(f, [](std::uint16_t b) { return double(bf16_to_float(bf16{b})); }));
  }
}

TEST_CASE("f16 conversion agrees with the compiler's _Float16", "[dtype]") {
  CHECK(float_to_f16(1.0f).bits == 0x3c00);
  CHECK(float_to_f16(65504.0f).bits == 0x7bff);  // largest finite
  CHECK(float_to_f16(65520.0f).bits == 0x7c00);  // halfway to 2^16: ties to even = inf
  CHECK(float_to_f16(65519.0f).bits == 0x7bff);
  CHECK(float_to_f16(std::ldexp(1.0f, -24)).bits == 0x0001);  // smallest subnormal
  CHECK(float_to_f16(std::ldexp(1.0f, -25)).bits == 0x0000);  // halfway to it: even = 0
  CHECK(float_to_f16(std::ldexp(1.5f, -25)).bits == 0x0001);
  CHECK(float_to_f16(-0.0f).bits == 0x8000);
  CHECK(f16_to_float(f16{0x0001}) == std::ldexp(1.0f, -24));
  CHECK(f16_to_float(f16{0xfc00}) == -INFINITY);
  CHECK(std::isnan(f16_to_float(float_to_f16(NAN))));
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const f16 value{static_cast<std::uint16_t>(bits)};
    const float f = f16_to_float(value);
    if (std::isnan(f)) continue;
#ifdef __FLT16_MANT_DIG__
    REQUIRE(static_cast<float>(static_cast<_Float16>(f)) == f);
#endif
    REQUIRE(float_to_f16(f).bits == bits);
    // The midpoint to the next value up must round to whichever of the two patterns is even.
    const float next = f16_to_float(f16{static_cast<std::uint16_t>(bits + 1)});
    if (std::isfinite(f) && std::isfinite(next) && (bits & 0x7fff) < 0x7bff) {
      const float mid = f + (next - f) / 2;
      REQUIRE(float_to_f16(mid).bits == ((bits & 1) != 0 ? bits + 1 : bits));
    }
  }
#ifdef __FLT16_MANT_DIG__
  // Random values over the whole range and below it, against the compiler's conversion (g++ has
  // _Float16 on x86-64; clang only from version 15).
  const std::vector<float> samples =
      test::random_tensor({5000}, 4, DType::f32, -70000.0, 70000.0).to_vector<float>();
  for (float f : samples) {
    for (const float scaled : {f, f * 1e-9f, f * 1e-6f}) {
      std::uint16_t expected;
      const _Float16 rounded = static_cast<_Float16>(scaled);
      std::memcpy(&expected, &rounded, sizeof expected);
      REQUIRE(float_to_f16(scaled).bits == expected);
    }
  }
#else
  WARN("this compiler has no _Float16: random values are not compared with it");
#endif
}

TEST_CASE("float to integer conversions go toward zero, saturate at the limits, NaN to 0", "[dtype]") {
  constexpr double inf = std::numeric_limits<double>::infinity();
  // f64 sources: every edge of every integer type, exactly representable or just past it.
  const std::vector<double> values{-inf,          -1e300,        -9223372036854775808.0,
                                   -2147483649.0, -2147483648.5, -3.7,
                                   -0.5,          -0.0,          0.5,
                                   3.7,           255.5,         256.0,
                                   2147483647.5,  2147483648.0,  9223372036854775808.0,
                                   1e300,         inf,           std::nan("")};
  const Tensor source = from_vector(values);
  const std::int64_t i64_max = std::numeric_limits<std::int64_t>::max();
  const std::int64_t i64_min = std::numeric_limits<std::int64_t>::min();
  CHECK(source.to(DType::i64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{i64_min, i64_min, i64_min, -2147483649, -2147483648, -3, 0, 0, 0, 3, 255,
                                  256, 2147483647, 2147483648, i64_max, i64_max, i64_max, 0});
  const std::int32_t i32_max = std::numeric_limits<std::int32_t>::max();
  const std::int32_t i32_min = std::numeric_limits<std::int32_t>::min();
  CHECK(source.to(DType::i32).to_vector<std::int32_t>() ==
        std::vector<std::int32_t>{i32_min, i32_min, i32_min, i32_min, i32_min, -3, 0, 0, 0, 3, 255, 256,
                                  i32_max, i32_max, i32_max, i32_max, i32_max, 0});
  CHECK(source.to(DType::u8).to_vector<std::uint8_t>() ==
        std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 255, 255, 255, 255, 255, 255, 255, 0});
  // From f32, bf16 and f16 (widened to f32 first): the same rules, where f32's rounding of the
  // limits (2^31 - 1 is 2^31 in f32) must not overflow either.
  const std::vector<float> floats{-INFINITY,     -3e38f, -2147483648.0f, -3.7f, 3.7f,
                                  2147483648.0f, 3e38f,  INFINITY,       NAN};
  CHECK(from_vector(floats).to(DType::i32).to_vector<std::int32_t>() ==
        std::vector<std::int32_t>{i32_min, i32_min, i32_min, -3, 3, i32_max, i32_max, i32_max, 0});
  for (const DType half : {DType::bf16, DType::f16}) {
    CHECK(from_vector(std::vector<float>{-INFINITY, -300.0f, -3.75f, 3.75f, 300.0f, INFINITY, NAN})
              .to(half)
              .to(DType::u8)
              .to_vector<std::uint8_t>() == std::vector<std::uint8_t>{0, 0, 0, 3, 255, 255, 0});
  }
}

TEST_CASE("devices parse and print", "[dtype]") {
  CHECK(Device::parse("cpu") == Device::cpu());
  CHECK(Device::parse("cuda") == Device::cuda(0));
  CHECK(Device::parse("cuda:3") == Device::cuda(3));
  CHECK(Device::cuda(2).str() == "cuda:2");
  CHECK_THROWS_ERROR(Device::parse("gpu"), "device: cannot parse 'gpu'");
  CHECK_THROWS_ERROR(Device::parse("cuda:x"), "device: cannot parse 'cuda:x'");
  CHECK_THROWS_ERROR(Device::parse("cuda:"), "cannot parse");
}
