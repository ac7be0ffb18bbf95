// tests/test_optimizer_kernels.cpp: fused optimizer kernels equal their op-by-op formulas.
#include "tests/check.h"

using namespace shardlab;

namespace {

// Adadelta written op by op (the formula the fused kernel must reproduce bit for bit).
void adadelta_by_ops(const Tensor& p, const Tensor& grad, const Tensor& sa, const Tensor& ad,
                     const AdadeltaHyper& h) {
  const Tensor g = h.weight_decay != 0 ? add(grad, mul(p, h.weight_decay)) : grad;
  add_(mul_(sa, h.rho), mul(mul(g, g), 1.0 - h.rho));
  const Tensor delta = mul(div(sqrt(add(ad, h.eps)), sqrt(add(sa, h.eps))), g);
  add_(mul_(ad, h.rho), mul(mul(delta, delta), 1.0 - h.rho));
  sub_(p, mul(delta, h.lr));
}

}  // namespace

TEST_CASE("adadelta_step matches the op-by-op update bit for bit over three steps", "[optimizer-kernels]") {
  for (const DType type : {DType::f32, DType::f64}) {
    for (const double decay : {0.0, 0.1}) {
      const AdadeltaHyper h{.lr = 1.0, .rho = 0.9, .eps = 1e-6, .weight_decay = decay};
      // A strided parameter: the kernel must follow views.
      const Tensor p1 = test::random_strided({5, 7}, 1, type), p2 = p1.clone();
      const Tensor sa1 = zeros({5, 7}, dtype(type)), ad1 = zeros({5, 7}, dtype(type));
      const Tensor sa2 = zeros({5, 7}, dtype(type)), ad2 = zeros({5, 7}, dtype(type));
      for (int step = 0; step < 3; ++step) {
        const Tensor g = test::random_tensor({5, 7}, 10 + step, type);
        adadelta_step(p1, g, sa1, ad1, h);
        adadelta_by_ops(p2, g, sa2, ad2, h);
      }
      INFO(dtype_name(type) << " weight_decay " << decay);
      CHECK(p1.to_vector<double>() == p2.to_vector<double>());
      CHECK(sa1.to_vector<double>() == sa2.to_vector<double>());
      CHECK(ad1.to_vector<double>() == ad2.to_vector<double>());
    }
  }
}

TEST_CASE("adadelta_step rejects mismatched operands", "[optimizer-kernels]") {
  const Tensor p = zeros({3});
  CHECK_THROWS_ERROR(adadelta_step(p, zeros({4}), zeros({3}), zeros({3}), {}),
                     "adadelta_step: every operand must match the parameter [[3] f32], got [[4] f32]");
  CHECK_THROWS_ERROR(adadelta_step(p, zeros({3}), zeros({3}, dtype(DType::f64)), zeros({3}), {}),
                     "adadelta_step: every operand must match the parameter [[3] f32], got [[3] f64]");
  CHECK_THROWS_ERROR(adadelta_step(zeros({3}, dtype(DType::i32)), zeros({3}), zeros({3}), zeros({3}), {}),
                     "adadelta_step: needs a floating dtype, got i32");
}
