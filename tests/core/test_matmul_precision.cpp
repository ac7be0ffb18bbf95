// tests/core/test_matmul_precision.cpp: the f32 matmul precision setting: its names, its refusal, and
// on a GPU what "high" (TF32) changes in a product and what it leaves alone.
#include "core/matmul_precision.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

// Restores "highest" whatever the test did, so that no other test runs on TF32.
struct HighestAfterwards {
  ~HighestAfterwards() { set_float32_matmul_precision("highest"); }
};

}  // namespace

TEST_CASE("the f32 matmul precision takes highest and high, and refuses other names", "[matmul_precision]") {
  const HighestAfterwards restore;
  CHECK(float32_matmul_precision() == MatmulPrecision::highest);
  set_float32_matmul_precision("high");
  CHECK(float32_matmul_precision() == MatmulPrecision::high);
  CHECK(matmul_precision_name(float32_matmul_precision()) == "high");
  CHECK_THROWS_ERROR(
      set_float32_matmul_precision("medium"),
      "set_float32_matmul_precision: 'medium' is not one of highest (f32), high (TF32 on a GPU)");
  CHECK(float32_matmul_precision() == MatmulPrecision::high);  // a refused name changes nothing
  set_float32_matmul_precision("highest");
  CHECK(matmul_precision_name(float32_matmul_precision()) == "highest");
}

TEST_CASE("on a GPU, high rounds f32 products' inputs to TF32 and leaves f64 alone",
          "[matmul_precision][cuda]") {
  const HighestAfterwards restore;
  const Device gpu = Device::cuda(0);
  const Tensor a = test::random_tensor({256, 512}, 97), b = test::random_tensor({512, 256}, 98);
  const Tensor exact = matmul(a.to(DType::f64), b.to(DType::f64));
  const auto worst = [&](const Tensor& product) {
    return max(abs(product.to(DType::f64).to(Device::cpu()) - exact), {}).item<double>();
  };
  const double f32 = worst(matmul(a.to(gpu), b.to(gpu)));
  set_float32_matmul_precision("high");
  const double tf32 = worst(matmul(a.to(gpu), b.to(gpu)));
  // 512 products of values below 1: f32 stays near 2^-24 per product, TF32's 10-bit inputs near 2^-11.
  CHECK(f32 < 1e-4);
  CHECK(tf32 > 10 * f32);
  CHECK(tf32 < 0.1);
  CHECK(worst(matmul(a.to(DType::f64).to(gpu), b.to(DType::f64).to(gpu))) < 1e-12);
}
