// tests/core/test_optimizer_kernels.cpp: fused optimizer kernels equal their op-by-op formulas, and their
// multi-segment forms equal the single-parameter calls.
#include <cmath>
#include <iterator>
#include <vector>

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

// Adam / AdamW written op by op, as optim did before the fused kernel.
void adam_by_ops(const Tensor& p, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamHyper& h) {
  Tensor g = grad;
  if (h.decoupled) {
    mul_(p, 1.0 - h.lr * h.weight_decay);
  } else if (h.weight_decay != 0) {
    g = add(grad, mul(p, h.weight_decay));
  }
  add_(mul_(m, h.beta1), mul(g, 1.0 - h.beta1));
  add_(mul_(v, h.beta2), mul(mul(g, g), 1.0 - h.beta2));
  const double correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const Tensor denom = add(div(sqrt(v), std::sqrt(correction2)), h.eps);
  sub_(p, mul(div(m, denom), h.lr / correction1));
}

}  // namespace

TEST_CASE("adam_step (Adam and AdamW) matches the op-by-op update bit for bit over three steps",
          "[optimizer-kernels]") {
  for (const DType type : {DType::f32, DType::f64}) {
    for (const bool decoupled : {false, true}) {
      for (const double decay : {0.0, 0.1}) {
        INFO(dtype_name(type) << (decoupled ? " AdamW" : " Adam") << " weight_decay " << decay);
        const Tensor p1 = test::random_strided({5, 7}, 2, type), p2 = p1.clone();
        const Tensor m1 = zeros({5, 7}, dtype(type)), v1 = zeros({5, 7}, dtype(type));
        const Tensor m2 = zeros({5, 7}, dtype(type)), v2 = zeros({5, 7}, dtype(type));
        const Tensor copy = empty({5, 7}, dtype(DType::bf16));
        for (std::int64_t step = 1; step <= 3; ++step) {
          const Tensor g = test::random_tensor({5, 7}, 20 + step, type);
          const AdamHyper h{.lr = 1e-2, .weight_decay = decay, .decoupled = decoupled, .step = step};
          adam_step(p1, g, m1, v1, h, copy);
          adam_by_ops(p2, g, m2, v2, h);
        }
        CHECK(p1.to_vector<double>() == p2.to_vector<double>());
        CHECK(m1.to_vector<double>() == m2.to_vector<double>());
        CHECK(v1.to_vector<double>() == v2.to_vector<double>());
        // The copy-out is the updated parameter rounded to bf16.
        CHECK(copy.to_vector<double>() == p1.to(DType::bf16).to_vector<double>());
      }
    }
  }
}

TEST_CASE(
    "adam_step's contiguous f32 loop (vectorised for the CPU it runs on) is the op-by-op update bit for bit",
    "[optimizer-kernels]") {
  // 1037 elements: full vectors of every width and a tail; no copy-out, as training runs. Each
  // update rule (AdamW, Adam with L2, plain Adam) is a loop of its own once compiled.
  for (const bool decoupled : {false, true}) {
    for (const double decay : {0.0, 0.1}) {
      INFO((decoupled ? "AdamW" : "Adam") << " weight_decay " << decay);
      const Tensor p1 = test::random_tensor({1037}, 5, DType::f32), p2 = p1.clone();
      const Tensor m1 = zeros({1037}), v1 = zeros({1037}), m2 = zeros({1037}), v2 = zeros({1037});
      for (std::int64_t step = 1; step <= 3; ++step) {
        const Tensor g = test::random_tensor({1037}, 30 + step, DType::f32);
        const AdamHyper h{.lr = 1e-2, .weight_decay = decay, .decoupled = decoupled, .step = step};
        adam_step(p1, g, m1, v1, h);
        adam_by_ops(p2, g, m2, v2, h);
      }
      CHECK(p1.to_vector<float>() == p2.to_vector<float>());
      CHECK(m1.to_vector<float>() == m2.to_vector<float>());
      CHECK(v1.to_vector<float>() == v2.to_vector<float>());
    }
  }
}

TEST_CASE("adam_step rejects mismatched operands and a step below 1", "[optimizer-kernels]") {
  const Tensor p = zeros({3});
  CHECK_THROWS_ERROR(adam_step(p, zeros({4}), zeros({3}), zeros({3}), {}),
                     "adam_step: every operand must match the parameter [[3] f32], got [[4] f32]");
  CHECK_THROWS_ERROR(adam_step(p, zeros({3}), zeros({3}, dtype(DType::f64)), zeros({3}), {}),
                     "adam_step: every operand must match the parameter [[3] f32], got [[3] f64]");
  CHECK_THROWS_ERROR(adam_step(p, zeros({3}), zeros({3}), zeros({3}), {.step = 0}),
                     "adam_step: step must be >= 1, got 0");
  CHECK_THROWS_ERROR(adam_step(p, zeros({3}), zeros({3}), zeros({3}), {}, zeros({2}, dtype(DType::bf16))),
                     "adam_step: copy_out [2] must have the parameter's shape [3]");
}

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

namespace {

// Segments of different sizes, dtypes and hyper-parameters (one strided, one empty), as an
// optimizer step over a model's parameters passes them.
struct SegmentCase {
  Shape shape;
  DType type;
  double lr, weight_decay;
  std::int64_t step;
  bool strided;
};
const SegmentCase kSegmentCases[] = {{{5, 7}, DType::f32, 1e-2, 0.1, 3, true},
                                     {{300}, DType::f64, 3e-3, 0.0, 1, false},
                                     {{0}, DType::f32, 1e-2, 0.1, 2, false},
                                     {{2, 3, 4}, DType::bf16, 5e-2, 0.2, 7, false}};

Tensor segment_param(const SegmentCase& c, std::uint64_t seed) {
  return c.strided ? test::random_strided(c.shape, seed, c.type) : test::random_tensor(c.shape, seed, c.type);
}

// Each tensor's values, for bitwise comparisons.
std::vector<std::vector<double>> values_of(const std::vector<Tensor>& tensors) {
  std::vector<std::vector<double>> out;
  for (const Tensor& t : tensors) out.push_back(t.to_vector<double>());
  return out;
}

}  // namespace

TEST_CASE("adam_step over segments equals the single-parameter call on each, bit for bit",
          "[optimizer-kernels]") {
  for (const bool decoupled : {false, true}) {
    INFO((decoupled ? "AdamW" : "Adam"));
    std::vector<AdamSegment> segments;
    std::vector<Tensor> single;  // param, m, v, copy of each segment, updated one call at a time
    for (std::size_t i = 0; i < std::size(kSegmentCases); ++i) {
      const SegmentCase& c = kSegmentCases[i];
      const Tensor param = segment_param(c, 30 + i), grad = test::random_tensor(c.shape, 40 + i, c.type);
      const Tensor m = test::random_tensor(c.shape, 50 + i, c.type) * 0.1;
      const Tensor v = abs(test::random_tensor(c.shape, 60 + i, c.type)) * 0.01;
      const AdamHyper hyper{
          .lr = c.lr, .weight_decay = c.weight_decay, .decoupled = decoupled, .step = c.step};
      // Only the f32 segments write a bf16 copy-out.
      const bool copied = c.type == DType::f32;
      const Tensor copy = copied ? empty(c.shape, dtype(DType::bf16)) : Tensor();
      segments.push_back({param, grad, m, v, hyper, copy});
      const Tensor p1 = param.clone(), m1 = m.clone(), v1 = v.clone();
      const Tensor copy1 = copied ? empty(c.shape, dtype(DType::bf16)) : p1;
      adam_step(p1, grad, m1, v1, hyper, copied ? copy1 : Tensor());
      single.insert(single.end(), {p1, m1, v1, copy1});
    }
    adam_step(segments);
    std::vector<Tensor> fused;
    for (const AdamSegment& s : segments)
      fused.insert(fused.end(),
                   {s.param, s.exp_avg, s.exp_avg_sq, s.copy_out.defined() ? s.copy_out : s.param});
    CHECK(values_of(fused) == values_of(single));
  }
}

TEST_CASE("adadelta_step over segments equals the single-parameter call on each, bit for bit",
          "[optimizer-kernels]") {
  std::vector<AdadeltaSegment> segments;
  std::vector<Tensor> single;
  for (std::size_t i = 0; i < std::size(kSegmentCases); ++i) {
    const SegmentCase& c = kSegmentCases[i];
    const Tensor param = segment_param(c, 70 + i), grad = test::random_tensor(c.shape, 80 + i, c.type);
    const Tensor sa = abs(test::random_tensor(c.shape, 90 + i, c.type)) * 0.01;
    const Tensor ad = abs(test::random_tensor(c.shape, 100 + i, c.type)) * 0.01;
    const AdadeltaHyper hyper{.lr = c.lr * 100, .rho = 0.8 + 0.01 * c.step, .weight_decay = c.weight_decay};
    segments.push_back({param, grad, sa, ad, hyper});
    const Tensor p1 = param.clone(), sa1 = sa.clone(), ad1 = ad.clone();
    adadelta_step(p1, grad, sa1, ad1, hyper);
    single.insert(single.end(), {p1, sa1, ad1});
  }
  adadelta_step(segments);
  std::vector<Tensor> fused;
  for (const AdadeltaSegment& s : segments) fused.insert(fused.end(), {s.param, s.square_avg, s.acc_delta});
  CHECK(values_of(fused) == values_of(single));
}

TEST_CASE("multi-segment steps name the segment an error is in and change nothing", "[optimizer-kernels]") {
  const Tensor p = ones({3});
  const Tensor z3 = zeros({3});
  const std::vector<AdamSegment> adam = {{p, z3, z3.clone(), z3.clone(), {.step = 1}, {}},
                                         {ones({2}), zeros({2}), zeros({2}), zeros({2}), {.step = 0}, {}}};
  CHECK_THROWS_ERROR(adam_step(adam), "adam_step: segment 1: step must be >= 1, got 0");
  const std::vector<AdamSegment> bad_copy = {
      {p, z3, z3.clone(), z3.clone(), {}, {}},
      {ones({2}), zeros({2}), zeros({2}), zeros({2}), {}, zeros({3}, dtype(DType::bf16))}};
  CHECK_THROWS_ERROR(adam_step(bad_copy),
                     "adam_step: segment 1: copy_out [3] must have the parameter's shape [2]");
  const std::vector<AdadeltaSegment> adadelta = {{ones({2}), zeros({2}), zeros({2}), zeros({2}), {}},
                                                 {p, zeros({4}), z3.clone(), z3.clone(), {}}};
  CHECK_THROWS_ERROR(
      adadelta_step(adadelta),
      "adadelta_step: segment 1: every operand must match the parameter [[3] f32], got [[4] f32]");
  // Segment 0 was valid, but the whole call was refused before any update.
  CHECK(p.to_vector<double>() == std::vector<double>{1.0, 1.0, 1.0});
  CHECK(adam[1].param.to_vector<double>() == std::vector<double>{1.0, 1.0});
}

TEST_CASE("adam_step and adadelta_step gated by apply: false writes nothing, true is the ungated step",
          "[optimizer-kernels]") {
  const Tensor open = isfinite(zeros({})), shut = isfinite(full({}, NAN, dtype(DType::f32)));
  for (const bool applied : {false, true}) {
    INFO("apply " << applied);
    // An f32 contiguous segment (the vectorised loop) and a strided f64 one with a bf16 copy-out.
    const Tensor p32 = test::random_tensor({9}, 1, DType::f32),
                 p64 = test::random_strided({3, 4}, 2, DType::f64);
    const Tensor g32 = test::random_tensor({9}, 3, DType::f32),
                 g64 = test::random_tensor({3, 4}, 4, DType::f64);
    const Tensor copy = zeros({3, 4}, dtype(DType::bf16));
    // Parameters and moments, then the copy-out: fresh operands for each side.
    const auto operands = [&] {
      const TensorOptions f64 = dtype(DType::f64);
      return std::vector<Tensor>{p32.clone(),        zeros({9}),         zeros({9}),  p64.clone(),
                                 zeros({3, 4}, f64), zeros({3, 4}, f64), copy.clone()};
    };
    std::vector<Tensor> gated = operands(), plain = operands();
    const auto segments = [&](std::vector<Tensor>& t) {
      return std::vector<AdamSegment>{
          {.param = t[0], .grad = g32, .exp_avg = t[1], .exp_avg_sq = t[2], .hyper = {.lr = 0.1}},
          {.param = t[3],
           .grad = g64,
           .exp_avg = t[4],
           .exp_avg_sq = t[5],
           .hyper = {.lr = 0.2},
           .copy_out = t[6]}};
    };
    adam_step(segments(gated), applied ? open : shut);
    if (applied) adam_step(segments(plain));
    for (std::size_t i = 0; i < gated.size(); ++i) {
      INFO("operand " << i);
      CHECK(gated[i].to_vector<double>() == plain[i].to_vector<double>());
    }

    const Tensor sa = zeros({9}), ad = zeros({9}), sa2 = zeros({9}), ad2 = zeros({9});
    const Tensor q = p32.clone(), q2 = p32.clone();
    const AdadeltaSegment one{q, g32, sa, ad, {}};
    adadelta_step(std::span(&one, 1), applied ? open : shut);
    if (applied) adadelta_step(q2, g32, sa2, ad2, {});
    CHECK(q.to_vector<double>() == q2.to_vector<double>());
    CHECK(sa.to_vector<double>() == sa2.to_vector<double>());
    CHECK(ad.to_vector<double>() == ad2.to_vector<double>());
  }
}

TEST_CASE("the optimizer kernels' gate must be one bool on the segments' device", "[optimizer-kernels]") {
  const Tensor p = zeros({3});
  const AdamSegment adam{.param = p, .grad = zeros({3}), .exp_avg = zeros({3}), .exp_avg_sq = zeros({3})};
  CHECK_THROWS_ERROR(adam_step(std::span(&adam, 1), ones({})),
                     "adam_step: apply must be one bool, got [[] f32]");
  CHECK_THROWS_ERROR(adam_step(std::span(&adam, 1), isfinite(zeros({2}))),
                     "adam_step: apply must be one bool, got [[2] bool]");
  const AdadeltaSegment adadelta{p, zeros({3}), zeros({3}), zeros({3}), {}};
  CHECK_THROWS_ERROR(adadelta_step(std::span(&adadelta, 1), zeros({1}, dtype(DType::i64))),
                     "adadelta_step: apply must be one bool, got [[1] i64]");
  CHECK(p.to_vector<double>() == std::vector<double>{0, 0, 0});
}
