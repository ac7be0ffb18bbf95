// tests/optim/test_optimizers.cpp: SGD, Adam, AdamW and Adadelta against naive per-element
// re-implementations, their state dicts, argument errors, and clip_grad_norm_.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "core/call_log.h"
#include "core/exact_sum.h"
#include "optim/optimizer.h"
#include "tests/check.h"
#include "tests/cuda_compare.h"

namespace shardlab {
namespace {

using test::check_close;
using test::check_equal;
using test::values;
using Vec = std::vector<double>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const Vec kStart = {0.5, -1.25, 2.0};
const test::Tolerance kF64{1e-13, 1e-11};

// The gradient of a made-up loss that depends on the parameter and the step, so that every
// step feeds the update rule a different gradient.
Vec test_grad(const Vec& p, int t) {
  const Vec a = {1.5, -0.5, 2.0};
  const Vec b = {0.3, -0.7, 0.05};
  Vec g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) g[i] = a[i] * p[i] + b[i] * t;
  return g;
}

// --- naive references: one double at a time, written from the papers / PyTorch docs ---------

struct SgdRef {
  double lr, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  Vec buf;
  void step(Vec& p, const Vec& grad) {
    const bool first = buf.empty();
    buf.resize(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      double d = grad[i] + weight_decay * p[i];
      if (momentum != 0) {
        buf[i] = first ? d : momentum * buf[i] + (1 - dampening) * d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
};

// Kingma & Ba with bias-corrected moments; decoupled = AdamW (Loshchilov & Hutter).
struct AdamRef {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled = false;
  Vec m, v;
  int t = 0;
  void step(Vec& p, const Vec& grad) {
    ++t;
    m.resize(p.size());
    v.resize(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = grad[i];
      if (decoupled) {
        p[i] = p[i] - lr * weight_decay * p[i];
      } else {
        g += weight_decay * p[i];
      }
      m[i] = beta1 * m[i] + (1 - beta1) * g;
      v[i] = beta2 * v[i] + (1 - beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(beta1, t));
      const double v_hat = v[i] / (1 - std::pow(beta2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

// Zeiler's Adadelta with PyTorch's lr factor.
struct AdadeltaRef {
  double lr, rho, eps, weight_decay;
  Vec square_avg, acc_delta;
  void step(Vec& p, const Vec& grad) {
    square_avg.resize(p.size());
    acc_delta.resize(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] + weight_decay * p[i];
      square_avg[i] = rho * square_avg[i] + (1 - rho) * g * g;
      const double delta = std::sqrt(acc_delta[i] + eps) / std::sqrt(square_avg[i] + eps) * g;
      acc_delta[i] = rho * acc_delta[i] + (1 - rho) * delta * delta;
      p[i] -= lr * delta;
    }
  }
};

// Three steps of `Opt` on a 3-element parameter, compared with `ref` after each, next to a
// parameter that never gets a gradient and must be left alone (values and state).
template <typename Opt, typename Options, typename Ref>
void check_three_steps(Options options, Ref ref, DType dtype = DType::f64) {
  Vec p = kStart;
  Variable w(from_vector<double>(p).to(dtype), true, "w");
  Variable frozen(from_vector<double>({3.0, -4.0}).to(dtype), true, "frozen");
  Opt opt({{"w", w}, {"frozen", frozen}}, options);
  const test::Tolerance tol = dtype == DType::f64 ? kF64 : test::default_tolerance(dtype);
  for (int t = 1; t <= 3; ++t) {
    INFO("step " << t);
    const Vec g = test_grad(p, t);
    w.set_grad(from_vector<double>(g).to(dtype));
    opt.step();
    ref.step(p, g);
    check_close(w.data(), p, tol);
  }
  CHECK(opt.steps() == 3);
  check_equal(frozen.data(), {3.0, -4.0});
  CHECK_FALSE(frozen.grad().defined());
  for (const auto& [key, tensor] : opt.state_dict()) {
    INFO(key);
    CHECK(key.rfind("frozen.", 0) != 0);
    // State lives in the parameter's dtype; the step counters are i64, the group's values f64.
    const bool counter = key == "step" || key == "w.step";
    CHECK(tensor.dtype() == (counter ? DType::i64 : key.starts_with("param_groups.") ? DType::f64 : dtype));
  }
}

TEST_CASE("SGD: plain, momentum with dampening, nesterov, weight decay", "[optim]") {
  SECTION("plain") { check_three_steps<optim::SGD>(optim::SGDOptions{.lr = 0.1}, SgdRef{.lr = 0.1}); }
  SECTION("weight decay") {
    check_three_steps<optim::SGD>(optim::SGDOptions{.lr = 0.1, .weight_decay = 0.2},
                                  SgdRef{.lr = 0.1, .weight_decay = 0.2});
  }
  SECTION("momentum, dampening and weight decay") {
    check_three_steps<optim::SGD>(
        optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.25, .weight_decay = 0.01},
        SgdRef{.lr = 0.05, .momentum = 0.9, .dampening = 0.25, .weight_decay = 0.01});
  }
  SECTION("nesterov") {
    check_three_steps<optim::SGD>(
        optim::SGDOptions{.lr = 0.05, .momentum = 0.8, .weight_decay = 0.01, .nesterov = true},
        SgdRef{.lr = 0.05, .momentum = 0.8, .weight_decay = 0.01, .nesterov = true});
  }
  SECTION("f32 parameter") {
    check_three_steps<optim::SGD>(optim::SGDOptions{.lr = 0.05, .momentum = 0.9},
                                  SgdRef{.lr = 0.05, .momentum = 0.9}, DType::f32);
  }
}

TEST_CASE("Adam: moments, bias correction and L2 weight decay", "[optim]") {
  SECTION("defaults") {
    check_three_steps<optim::Adam>(
        optim::AdamOptions{},
        AdamRef{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0});
  }
  SECTION("large eps and weight decay") {
    // eps = 0.1 is large next to sqrt(v_hat): placing it inside the bias correction, or
    // leaving the correction out, moves the result far beyond the tolerance.
    check_three_steps<optim::Adam>(
        optim::AdamOptions{.lr = 0.1, .beta1 = 0.8, .beta2 = 0.95, .eps = 0.1, .weight_decay = 0.05},
        AdamRef{.lr = 0.1, .beta1 = 0.8, .beta2 = 0.95, .eps = 0.1, .weight_decay = 0.05});
  }
  SECTION("f32 parameter") {
    check_three_steps<optim::Adam>(
        optim::AdamOptions{.lr = 0.1, .eps = 0.01},
        AdamRef{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 0.01, .weight_decay = 0}, DType::f32);
  }
}

TEST_CASE("AdamW: decoupled weight decay", "[optim]") {
  SECTION("defaults") {
    check_three_steps<optim::AdamW>(
        optim::AdamWOptions{},
        AdamRef{
            .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2, .decoupled = true});
  }
  SECTION("strong decay, large eps") {
    check_three_steps<optim::AdamW>(
        optim::AdamWOptions{.lr = 0.1, .beta1 = 0.7, .beta2 = 0.9, .eps = 0.1, .weight_decay = 0.5},
        AdamRef{.lr = 0.1, .beta1 = 0.7, .beta2 = 0.9, .eps = 0.1, .weight_decay = 0.5, .decoupled = true});
  }
}

TEST_CASE("Adadelta: running averages of squared gradients and updates", "[optim]") {
  SECTION("defaults (the FSDP tutorial's optimizer)") {
    check_three_steps<optim::Adadelta>(optim::AdadeltaOptions{},
                                       AdadeltaRef{.lr = 1.0, .rho = 0.9, .eps = 1e-6, .weight_decay = 0});
  }
  SECTION("weight decay, large eps") {
    check_three_steps<optim::Adadelta>(
        optim::AdadeltaOptions{.lr = 0.5, .rho = 0.8, .eps = 0.01, .weight_decay = 0.1},
        AdadeltaRef{.lr = 0.5, .rho = 0.8, .eps = 0.01, .weight_decay = 0.1});
  }
}

TEST_CASE("optimizer options default to PyTorch's", "[optim]") {
  const optim::SGDOptions sgd;
  CHECK(sgd.lr == 1e-3);
  CHECK(sgd.momentum == 0.0);
  CHECK(sgd.dampening == 0.0);
  CHECK(sgd.weight_decay == 0.0);
  CHECK_FALSE(sgd.nesterov);
  const optim::AdamOptions adam;
  CHECK(adam.lr == 1e-3);
  CHECK(adam.beta1 == 0.9);
  CHECK(adam.beta2 == 0.999);
  CHECK(adam.eps == 1e-8);
  CHECK(adam.weight_decay == 0.0);
  const optim::AdamWOptions adamw;
  CHECK(adamw.lr == 1e-3);
  CHECK(adamw.beta1 == 0.9);
  CHECK(adamw.beta2 == 0.999);
  CHECK(adamw.eps == 1e-8);
  CHECK(adamw.weight_decay == 1e-2);
  const optim::AdadeltaOptions adadelta;
  CHECK(adadelta.lr == 1.0);
  CHECK(adadelta.rho == 0.9);
  CHECK(adadelta.eps == 1e-6);
  CHECK(adadelta.weight_decay == 0.0);
}

TEST_CASE("Adam: bias correction counts each parameter's own updates", "[optim]") {
  // As torch's per-parameter state["step"]: a parameter first updated at the optimizer's
  // second step gets the first-step correction.
  Vec pa = kStart;
  Vec pb = {1.0, -2.0, 0.25};
  Variable a(from_vector<double>(pa), true, "a");
  Variable b(from_vector<double>(pb), true, "b");
  const optim::AdamOptions options{.lr = 0.1, .beta1 = 0.8, .beta2 = 0.9, .eps = 0.1};
  optim::Adam opt({{"a", a}, {"b", b}}, options);
  AdamRef ref_a{.lr = 0.1, .beta1 = 0.8, .beta2 = 0.9, .eps = 0.1, .weight_decay = 0};
  AdamRef ref_b = ref_a;

  a.set_grad(from_vector<double>(test_grad(pa, 1)));
  opt.step();
  ref_a.step(pa, test_grad(pa, 1));
  check_equal(b.data(), pb);

  const Vec ga = test_grad(pa, 2);
  const Vec gb = test_grad(pb, 2);
  a.set_grad(from_vector<double>(ga));
  b.set_grad(from_vector<double>(gb));
  opt.step();
  ref_a.step(pa, ga);
  ref_b.step(pb, gb);
  check_close(a.data(), pa, kF64);
  check_close(b.data(), pb, kF64);

  std::map<std::string, std::int64_t> steps;
  for (const auto& [key, tensor] : opt.state_dict()) {
    if (key == "step" || key.ends_with(".step")) steps[key] = tensor.item<std::int64_t>();
  }
  CHECK(steps == std::map<std::string, std::int64_t>{{"a.step", 2}, {"b.step", 1}, {"step", 2}});
}

TEST_CASE("SGD: set_lr changes the next update; zero_grad clears or zeroes", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w");
  optim::SGD opt({{"w", w}}, {.lr = 0.1});
  opt.set_lr(0.5);
  CHECK(opt.lr() == 0.5);
  CHECK(opt.options().lr == 0.5);
  w.set_grad(from_vector<double>({1.0, 2.0, -4.0}));
  opt.step();
  check_close(w.data(), {0.5 - 0.5, -1.25 - 1.0, 2.0 + 2.0}, kF64);

  opt.zero_grad(/*set_to_none=*/false);
  REQUIRE(w.grad().defined());
  check_equal(w.grad(), {0.0, 0.0, 0.0});
  opt.zero_grad();
  CHECK_FALSE(w.grad().defined());
  // Without gradients a step changes nothing but still counts.
  opt.step();
  check_close(w.data(), {0.0, -2.25, 4.0}, kF64);
  CHECK(opt.steps() == 2);
}

// --- state dicts ------------------------------------------------------------------------------

void set_test_grads(const Variable& w, const Variable& b, int t) {
  w.set_grad(from_vector<double>(test_grad(values(w.data()), t)));
  b.set_grad(from_vector<double>({0.5 * t, -0.25 * t}));
}

// Builds an optimizer over a weight and a bias (named "layer.weight" and "layer.bias").
using Build = std::function<std::unique_ptr<optim::Optimizer>(const Variable& w, const Variable& b)>;

template <typename Opt, typename Options>
Build one_group(Options options) {
  return [options](const Variable& w, const Variable& b) {
    return std::make_unique<Opt>(nn::Named<Variable>{{"layer.weight", w}, {"layer.bias", b}}, options);
  };
}

// The weight in the options' group, the bias in a group with its own lr and weight decay.
template <typename Opt, typename Options>
Build two_groups(Options options, double bias_lr, double bias_decay) {
  return [=](const Variable& w, const Variable& b) {
    return std::make_unique<Opt>(
        std::vector<optim::ParamGroup>{
            {.parameters = {{"layer.weight", w}}},
            {.parameters = {{"layer.bias", b}}, .lr = bias_lr, .weight_decay = bias_decay}},
        options);
  };
}

// Saves after 2 steps, loads into a fresh optimizer over equal parameters built by `build_fresh`
// (whose hyper-parameters the load replaces), and steps both: they must agree exactly, while an
// optimizer that did not load must not.
void check_round_trip(const Build& build, const Build& build_fresh) {
  // Dotted names, as a model gives them: the key splits at the last dot.
  Variable w(from_vector<double>(kStart), true, "layer.weight");
  Variable b(from_vector<double>({0.1, -0.2}), true, "layer.bias");
  const auto first = build(w, b);
  for (int t = 1; t <= 2; ++t) {
    set_test_grads(w, b, t);
    first->step();
  }
  const nn::StateDict saved = first->state_dict();

  Variable w2(w.data().clone(), true), b2(b.data().clone(), true);
  const auto second = build_fresh(w2, b2);
  second->load_state_dict(saved);
  CHECK(second->steps() == 2);
  for (std::size_t g = 0; g < first->num_groups(); ++g) CHECK(second->lr(g) == first->lr(g));
  Variable w3(w.data().clone(), true), b3(b.data().clone(), true);
  const auto control = build(w3, b3);

  for (int t = 3; t <= 4; ++t) {
    // `first` steps before `second`: `saved` holds first's live state, so a load that kept
    // those tensors instead of copying them would see them advance and diverge here.
    set_test_grads(w, b, t);
    first->step();
    set_test_grads(w2, b2, t);
    second->step();
    set_test_grads(w3, b3, t);
    control->step();
    check_equal(w2.data(), values(w.data()));
    check_equal(b2.data(), values(b.data()));
  }
  CHECK(test::count_mismatches(values(w3.data()), values(w.data()), kF64) > 0);

  std::vector<std::string> keys_first, keys_second;
  for (const auto& [key, tensor] : first->state_dict()) keys_first.push_back(key);
  for (const auto& [key, tensor] : second->state_dict()) keys_second.push_back(key);
  CHECK(keys_first == keys_second);
}

TEST_CASE("state_dict round trip gives identical continued training", "[optim]") {
  SECTION("SGD with momentum") {
    const auto build =
        one_group<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
    check_round_trip(build, build);
  }
  SECTION("Adam") {
    const auto build = one_group<optim::Adam>(optim::AdamOptions{.lr = 0.1, .eps = 0.01});
    check_round_trip(build, build);
  }
  SECTION("AdamW") {
    const auto build = one_group<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1});
    check_round_trip(build, build);
  }
  SECTION("Adadelta") {
    const auto build = one_group<optim::Adadelta>(optim::AdadeltaOptions{.rho = 0.8});
    check_round_trip(build, build);
  }
}

// --- step_if: the update gated on the device --------------------------------------------------

// The gate as a training step computes it: isfinite of a value on the parameters' device.
Tensor gate(bool applied) { return isfinite(scalar_tensor(applied ? 0.0 : kNaN, dtype(DType::f64))); }

void set_nan_grads(const Variable& w, const Variable& b) {
  w.set_grad(full({3}, kNaN, dtype(DType::f64)));
  b.set_grad(full({2}, kNaN, dtype(DType::f64)));
}

// Four steps through step_if, the first and the third skipped (NaN gradients, the gate false, then
// settle_step(false)), against step() on the kept steps alone: parameters, state and counts equal
// bit for bit, as if the skipped steps never happened. `reference` (default: `build`) makes the
// optimizer that steps the kept steps alone.
void check_gated_steps(const Build& build, const Build& reference = {}) {
  Variable w(from_vector<double>(kStart), true, "layer.weight");
  Variable b(from_vector<double>({0.1, -0.2}), true, "layer.bias");
  Variable w2(w.data().clone(), true), b2(b.data().clone(), true);
  const auto gated = build(w, b);
  const auto plain = (reference ? reference : build)(w2, b2);

  set_nan_grads(w, b);
  gated->step_if(gate(false));
  gated->settle_step(false);
  check_equal(w.data(), kStart);
  CHECK(gated->steps() == 0);
  CHECK(gated->state_dict().size() == plain->state_dict().size());  // no parameter state left

  for (int t = 2; t <= 4; ++t) {
    INFO("step " << t);
    const bool applied = t != 3;
    if (applied) {
      set_test_grads(w, b, t);
    } else {
      set_nan_grads(w, b);
    }
    gated->step_if(gate(applied));
    gated->settle_step(applied);
    if (applied) {
      set_test_grads(w2, b2, t);
      plain->step();
    }
    check_equal(w.data(), values(w2.data()));
    check_equal(b.data(), values(b2.data()));
  }
  CHECK(gated->steps() == 2);
  const nn::StateDict mine = gated->state_dict(), theirs = plain->state_dict();
  REQUIRE(mine.size() == theirs.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    INFO(mine[i].first);
    CHECK(mine[i].first == theirs[i].first);
    check_equal(mine[i].second, values(theirs[i].second));
  }
}

TEST_CASE("step_if: a step skipped on the device leaves parameters, state and counts as if never taken",
          "[optim]") {
  SECTION("SGD with nesterov momentum and weight decay") {
    check_gated_steps(one_group<optim::SGD>(
        optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}));
  }
  SECTION("Adam (the bias correction counts the applied steps only)") {
    check_gated_steps(
        one_group<optim::Adam>(optim::AdamOptions{.lr = 0.1, .eps = 0.01, .weight_decay = 0.1}));
  }
  SECTION("AdamW in two groups") {
    check_gated_steps(
        two_groups<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1}, 0.05, 0.0));
  }
  SECTION("Adadelta") { check_gated_steps(one_group<optim::Adadelta>(optim::AdadeltaOptions{.rho = 0.8})); }
}

TEST_CASE("step_if: an unsettled step refuses the calls that would see it, and the gate is checked",
          "[optim]") {
  Variable w(from_vector<double>(kStart), true, "layer.weight");
  Variable b(from_vector<double>({0.1, -0.2}), true, "layer.bias");
  optim::AdamW opt({{"layer.weight", w}, {"layer.bias", b}}, {.lr = 0.1});
  CHECK_THROWS_ERROR(opt.settle_step(true), "AdamW.settle_step: no step_if to settle");
  CHECK_THROWS_ERROR(opt.step_if(Tensor()), "AdamW.step_if: apply must be one bool, got an undefined tensor");
  CHECK_THROWS_ERROR(opt.step_if(scalar_tensor(1.0, dtype(DType::f64))),
                     "AdamW.step_if: apply must be one bool, got [[] f64]");
  CHECK_THROWS_ERROR(opt.step_if(isfinite(zeros({2}))),
                     "AdamW.step_if: apply must be one bool, got [[2] bool]");
  CHECK(opt.steps() == 0);

  set_test_grads(w, b, 1);
  opt.step_if(gate(true));
  const char* unsettled = "step 1 came from step_if and is not settled: call settle_step(applied) first";
  CHECK_THROWS_ERROR(opt.step(), std::string("AdamW.step: ") + unsettled);
  CHECK_THROWS_ERROR(opt.step_if(gate(true)), std::string("AdamW.step_if: ") + unsettled);
  CHECK_THROWS_ERROR(opt.state_dict(), std::string("AdamW.state_dict: ") + unsettled);
  CHECK_THROWS_ERROR(opt.load_state_dict({}), std::string("AdamW.load_state_dict: ") + unsettled);
  opt.settle_step(true);
  CHECK(opt.steps() == 1);
  CHECK_THROWS_ERROR(opt.settle_step(true), "AdamW.settle_step: no step_if to settle");
  CHECK_NOTHROW(opt.state_dict());
}

// --- update runners: a step's updates applied later ---------------------------------------------

// Holds each step's updates until wait(), as a runner on another thread may leave them for a while:
// shows which of the optimizer's calls wait for them, and that they keep the values they were
// taken with.
class HoldingRunner final : public optim::UpdateRunner {
 public:
  void run(std::vector<optim::ParamUpdate> updates, optim::UpdateRule rule) override {
    held_.emplace_back(std::move(updates), std::move(rule));
  }
  void wait() override {
    for (auto& [updates, rule] : held_) {
      optim::place_gates(updates);
      rule(updates);
    }
    held_.clear();
  }
  bool holding() const { return !held_.empty(); }
  std::size_t steps_held() const { return held_.size(); }

 private:
  std::vector<std::pair<std::vector<optim::ParamUpdate>, optim::UpdateRule>> held_;
};

// `build`'s optimizer with its updates held by a runner (returned through `runner`).
Build held_by(const Build& build, std::shared_ptr<HoldingRunner>& runner) {
  return [&runner, build](const Variable& w, const Variable& b) {
    auto optimizer = build(w, b);
    runner = std::make_shared<HoldingRunner>();
    optimizer->set_update_runner(runner);
    return optimizer;
  };
}

TEST_CASE("an update runner: the optimizer's calls that read or write the state wait for its updates",
          "[optim]") {
  const Build build = one_group<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1});
  std::shared_ptr<HoldingRunner> runner;
  Variable w(from_vector<double>(kStart), true, "layer.weight");
  Variable b(from_vector<double>({0.1, -0.2}), true, "layer.bias");
  Variable w2(w.data().clone(), true), b2(b.data().clone(), true);
  const auto held = held_by(build, runner)(w, b);
  const auto plain = build(w2, b2);

  set_test_grads(w, b, 1);
  held->step();
  CHECK(runner->holding());
  check_equal(w.data(), kStart);
  // Neither changes what the held update does: it took the lr of its step, and holds the gradient.
  held->set_lr(0.5);
  held->zero_grad();
  CHECK(runner->holding());
  held->wait_for_updates();
  CHECK_FALSE(runner->holding());
  set_test_grads(w2, b2, 1);
  plain->step();
  plain->set_lr(0.5);
  check_equal(w.data(), values(w2.data()));
  check_equal(b.data(), values(b2.data()));

  set_test_grads(w, b, 2);
  held->step();
  held->step();  // applies the first before it hands over the second
  CHECK(runner->steps_held() == 1);
  const std::vector<std::pair<const char*, std::function<void()>>> waiting_calls = {
      {"zero_grad(set_to_none = false)", [&] { held->zero_grad(false); }},
      {"state_dict", [&] { (void)held->state_dict(); }},
      {"load_state_dict", [&] { held->load_state_dict(plain->state_dict()); }},
      {"set_update_runner", [&] { held->set_update_runner(runner); }}};
  for (const auto& [what, call] : waiting_calls) {
    INFO(what);
    set_test_grads(w, b, 2);
    held->step();
    REQUIRE(runner->holding());
    call();
    CHECK_FALSE(runner->holding());
  }
}

TEST_CASE("an update runner: the optimizer waits for it before it goes", "[optim]") {
  auto runner = std::make_shared<HoldingRunner>();
  Variable w(from_vector<double>(kStart), true, "layer.weight");
  {
    optim::SGD optimizer({{"layer.weight", w}}, {.lr = 0.5, .momentum = 0.9});
    optimizer.set_update_runner(runner);
    w.set_grad(from_vector<double>({1.0, 2.0, -4.0}));
    optimizer.step();
    REQUIRE(runner->holding());
  }
  CHECK_FALSE(runner->holding());
  check_equal(w.data(), {0.0, -2.25, 4.0});  // p - 0.5 g: the first step's buffer is g
}

TEST_CASE("step_if through an update runner: skipped steps leave no trace", "[optim]") {
  std::shared_ptr<HoldingRunner> runner;
  const auto check = [&](const Build& build) { check_gated_steps(held_by(build, runner), build); };
  SECTION("SGD with nesterov momentum") {
    check(one_group<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true}));
  }
  SECTION("AdamW in two groups") {
    check(two_groups<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1}, 0.05, 0.0));
  }
  SECTION("Adadelta") { check(one_group<optim::Adadelta>(optim::AdadeltaOptions{.rho = 0.8})); }
}

TEST_CASE("state_dict round trip with two groups restores each group's hyper-parameters", "[optim]") {
  // The fresh optimizer is built with other options and lrs: the loaded ones must win.
  SECTION("SGD") {
    check_round_trip(two_groups<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9}, 0.3, 0.05),
                     two_groups<optim::SGD>(optim::SGDOptions{.lr = 0.7, .momentum = 0.5}, 0.01, 0.0));
  }
  SECTION("Adam") {
    check_round_trip(two_groups<optim::Adam>(optim::AdamOptions{.lr = 0.1, .eps = 0.01}, 0.02, 0.1),
                     two_groups<optim::Adam>(optim::AdamOptions{.beta1 = 0.5}, 0.5, 0.0));
  }
  SECTION("AdamW") {
    check_round_trip(two_groups<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1}, 0.05, 0.0),
                     two_groups<optim::AdamW>(optim::AdamWOptions{}, 0.3, 0.2));
  }
  SECTION("Adadelta") {
    check_round_trip(two_groups<optim::Adadelta>(optim::AdadeltaOptions{.rho = 0.8}, 0.5, 0.1),
                     two_groups<optim::Adadelta>(optim::AdadeltaOptions{.rho = 0.95}, 2.0, 0.0));
  }
}

TEST_CASE("state_dict: keys, live tensors, and loading converts to the parameter's dtype", "[optim]") {
  Variable w(from_vector<float>({1.0f, 2.0f, 3.0f}), true, "fc1.weight");
  Variable unused(from_vector<float>({1.0f}), true, "fc1.bias");
  optim::Adam opt({{"fc1.weight", w}, {"fc1.bias", unused}}, {.lr = 0.1});
  w.set_grad(from_vector<float>({1.0f, -1.0f, 0.5f}));
  opt.step();
  const nn::StateDict sd = opt.state_dict();
  std::vector<std::string> keys;
  for (const auto& [key, tensor] : sd) keys.push_back(key);
  CHECK(keys == std::vector<std::string>{"fc1.weight.exp_avg", "fc1.weight.exp_avg_sq", "fc1.weight.step",
                                         "param_groups.0.lr", "param_groups.0.beta1", "param_groups.0.beta2",
                                         "param_groups.0.eps", "param_groups.0.weight_decay", "step"});
  CHECK(values(sd[3].second) == Vec{0.1});
  CHECK(sd[3].second.dtype() == DType::f64);
  // exp_avg after one step is (1 - beta1) g.
  check_close(sd[0].second, {0.1, -0.1, 0.05});
  check_close(sd[1].second, {0.001, 0.001, 0.00025});

  // The same state saved in f64 loads into the f32 optimizer as f32 copies.
  nn::StateDict as_f64;
  for (const auto& [key, tensor] : sd) {
    as_f64.emplace_back(key, tensor.dtype() == DType::f32 ? tensor.to(DType::f64) : tensor.clone());
  }
  Variable w2(from_vector<float>({1.0f, 2.0f, 3.0f}), true);
  Variable unused2(from_vector<float>({1.0f}), true);
  optim::Adam other({{"fc1.weight", w2}, {"fc1.bias", unused2}}, {.lr = 0.1});
  other.load_state_dict(as_f64);
  const nn::StateDict loaded = other.state_dict();
  REQUIRE(loaded.size() == 9);
  CHECK(loaded[0].second.dtype() == DType::f32);
  check_close(loaded[0].second, {0.1, -0.1, 0.05});
  as_f64[0].second.fill_(7.0);
  check_close(loaded[0].second, {0.1, -0.1, 0.05});
}

TEST_CASE("load_state_dict errors name the key and leave the state unchanged", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w");
  optim::Adam opt({{"w", w}}, {.lr = 0.1});
  w.set_grad(from_vector<double>({1.0, 2.0, 3.0}));
  opt.step();
  const Vec exp_avg_before = values(opt.state_dict()[0].second);

  const auto t3 = [] { return zeros({3}, dtype(DType::f64)); };
  const auto step = [](std::int64_t n) { return scalar_tensor(n, dtype(DType::i64)); };
  const auto f64 = [](double v) { return scalar_tensor(v, dtype(DType::f64)); };
  const nn::StateDict hyper = {{"param_groups.0.lr", f64(0.1)},
                               {"param_groups.0.beta1", f64(0.9)},
                               {"param_groups.0.beta2", f64(0.999)},
                               {"param_groups.0.eps", f64(1e-8)},
                               {"param_groups.0.weight_decay", f64(0.0)}};
  nn::StateDict good = {{"w.exp_avg", t3()}, {"w.exp_avg_sq", t3()}, {"w.step", step(1)}, {"step", step(1)}};
  good.insert(good.end(), hyper.begin(), hyper.end());
  const auto with = [&](const std::string& key, const Tensor& value) {
    nn::StateDict out = good;
    bool replaced = false;
    for (auto& [k, t] : out) {
      if (k == key) {
        t = value;
        replaced = true;
      }
    }
    if (!replaced) out.emplace_back(key, value);
    return out;
  };
  const auto without = [&](const std::string& key) {
    nn::StateDict out;
    for (const auto& [k, t] : good) {
      if (k != key) out.emplace_back(k, t);
    }
    return out;
  };

  CHECK_THROWS_ERROR(opt.load_state_dict(with("bogus", t3())),
                     "Adam.load_state_dict: unexpected key 'bogus' (keys are '<parameter>.<slot>', "
                     "'param_groups.<group>.<hyper-parameter>' or 'step')");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("v.exp_avg", t3())),
                     "Adam.load_state_dict: unexpected key 'v.exp_avg': no parameter 'v'");
  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("w.momentum_buffer", t3())),
      "Adam.load_state_dict: unexpected key 'w.momentum_buffer': Adam has no state slot 'momentum_buffer' "
      "(its slots: exp_avg, exp_avg_sq, step)");
  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("w.exp_avg", zeros({2}, dtype(DType::f64)))),
      "Adam.load_state_dict: key 'w.exp_avg' has shape [2] in the state dict but [3] in the optimizer");
  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("w.step", zeros({1}, dtype(DType::i64)))),
      "Adam.load_state_dict: key 'w.step' has shape [1] in the state dict but [] in the optimizer");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("w.step", step(-1))),
                     "Adam.load_state_dict: key 'w.step' holds a negative step count -1");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("w.exp_avg", Tensor())),
                     "Adam.load_state_dict: key 'w.exp_avg' holds an undefined tensor");
  CHECK_THROWS_ERROR(opt.load_state_dict(without("w.exp_avg_sq")),
                     "Adam.load_state_dict: missing key 'w.exp_avg_sq' (expected shape [3])");
  CHECK_THROWS_ERROR(opt.load_state_dict(without("w.step")),
                     "Adam.load_state_dict: missing key 'w.step' (expected shape [])");
  CHECK_THROWS_ERROR(opt.load_state_dict(without("step")), "Adam.load_state_dict: missing key 'step'");
  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("step", zeros({2}, dtype(DType::i64)))),
      "Adam.load_state_dict: key 'step' has shape [2] in the state dict but [] in the optimizer");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("step", step(-3))),
                     "Adam.load_state_dict: key 'step' holds a negative step count -3");
  nn::StateDict twice = good;
  twice.emplace_back("w.exp_avg", t3());
  CHECK_THROWS_ERROR(opt.load_state_dict(twice), "Adam.load_state_dict: key 'w.exp_avg' appears twice");

  // Nothing above was applied.
  CHECK(opt.steps() == 1);
  check_equal(opt.state_dict()[0].second, exp_avg_before);
  // The good dict loads, and a dict without parameter keys clears every parameter's state.
  opt.load_state_dict(good);
  check_equal(opt.state_dict()[0].second, {0.0, 0.0, 0.0});
  nn::StateDict only_counter = hyper;
  only_counter.emplace_back("step", step(5));
  opt.load_state_dict(only_counter);
  CHECK(opt.steps() == 5);
  CHECK(opt.state_dict().size() == 6);

  // SGD without momentum keeps only the step counter; with momentum (also when the loaded
  // group sets it) every updated parameter needs its buffer.
  Variable v(from_vector<double>(kStart), true);
  optim::SGD sgd({{"w", v}}, {.lr = 0.1});
  v.set_grad(from_vector<double>({1.0, 2.0, 3.0}));
  sgd.step();
  nn::StateDict with_adam_slot = sgd.state_dict();
  with_adam_slot.emplace_back("w.exp_avg", t3());
  CHECK_THROWS_ERROR(sgd.load_state_dict(with_adam_slot),
                     "SGD.load_state_dict: unexpected key 'w.exp_avg': SGD has no state slot 'exp_avg' "
                     "(its slots: step)");
  nn::StateDict with_momentum = sgd.state_dict();
  for (auto& [key, tensor] : with_momentum) {
    if (key == "param_groups.0.momentum") tensor = f64(0.9);
  }
  CHECK_THROWS_ERROR(sgd.load_state_dict(with_momentum),
                     "SGD.load_state_dict: missing key 'w.momentum_buffer' (expected shape [3])");
}

// --- parameter groups and frozen parameters ------------------------------------------------------

Variable f32_parameter(const Vec& v, const char* name) {
  return Variable(from_vector<double>(v).to(DType::f32), true, name);
}

// Three steps of one optimizer over two groups (a1 and a2 with the options, b with its own lr
// and weight decay) against two single-group optimizers, one per group's options, on copies:
// every parameter must come out bit for bit the same.
template <typename Opt, typename Options>
void check_groups_match_separate_optimizers(Options options, double b_lr, double b_decay) {
  Variable a1 = f32_parameter(kStart, "a1"), a2 = f32_parameter({0.25, -0.5}, "a2");
  Variable b = f32_parameter({1.5, 0.75, -2.0}, "b");
  Opt grouped({{.parameters = {{"a1", a1}, {"a2", a2}}},
               {.parameters = {{"b", b}}, .lr = b_lr, .weight_decay = b_decay}},
              options);
  CHECK(grouped.num_groups() == 2);
  CHECK(grouped.options(0).lr == options.lr);
  CHECK(grouped.options(1).lr == b_lr);
  CHECK(grouped.options(1).weight_decay == b_decay);

  Variable alone_a1(a1.data().clone(), true), alone_a2(a2.data().clone(), true),
      alone_b(b.data().clone(), true);
  Options b_options = options;
  b_options.lr = b_lr;
  b_options.weight_decay = b_decay;
  Opt alone_a({{"a1", alone_a1}, {"a2", alone_a2}}, options);
  Opt alone_group_b({{"b", alone_b}}, b_options);

  for (int t = 1; t <= 3; ++t) {
    INFO("step " << t);
    for (const auto& [param, twin] :
         {std::pair{a1, alone_a1}, std::pair{a2, alone_a2}, std::pair{b, alone_b}}) {
      const Tensor grad = from_vector<double>(test_grad(values(param.data()), t)).to(DType::f32);
      param.set_grad(grad);
      twin.set_grad(grad.clone());
    }
    grouped.step();
    alone_a.step();
    alone_group_b.step();
    check_equal(a1.data(), values(alone_a1.data()));
    check_equal(a2.data(), values(alone_a2.data()));
    check_equal(b.data(), values(alone_b.data()));
  }
  // The groups really differ: b under the first group's options would have moved otherwise.
  Variable b_in_a(from_vector<double>({1.5, 0.75, -2.0}).to(DType::f32), true);
  Opt as_group_a({{"b", b_in_a}}, options);
  for (int t = 1; t <= 3; ++t) {
    b_in_a.set_grad(from_vector<double>(test_grad(values(b_in_a.data()), t)).to(DType::f32));
    as_group_a.step();
  }
  CHECK(test::count_mismatches(values(b_in_a.data()), values(b.data()), {0.0, 0.0}) > 0);
}

TEST_CASE("parameter groups: each group updates exactly as its own optimizer would", "[optim]") {
  SECTION("SGD") {
    check_groups_match_separate_optimizers<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9}, 0.02,
                                                       0.1);
  }
  SECTION("Adam") {
    check_groups_match_separate_optimizers<optim::Adam>(optim::AdamOptions{.lr = 0.1, .weight_decay = 0.05},
                                                        0.01, 0.0);
  }
  SECTION("AdamW") {
    check_groups_match_separate_optimizers<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1},
                                                         0.03, 0.0);
  }
  SECTION("Adadelta") {
    check_groups_match_separate_optimizers<optim::Adadelta>(optim::AdadeltaOptions{.lr = 1.0}, 0.5, 0.2);
  }
}

TEST_CASE("groups override only the fields they set; set_lr per group and for all", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w"), v(from_vector<double>({1.0}), true, "v");
  optim::SGD opt({{.parameters = {{"w", w}}}, {.parameters = {{"v", v}}, .momentum = 0.5, .nesterov = true}},
                 {.lr = 0.1, .momentum = 0.9, .dampening = 0.0, .weight_decay = 0.01});
  const optim::SGDOptions second = opt.options(1);
  CHECK(second.lr == 0.1);
  CHECK(second.momentum == 0.5);
  CHECK(second.weight_decay == 0.01);
  CHECK(second.nesterov);
  CHECK_FALSE(opt.options(0).nesterov);
  CHECK(opt.group_parameters(1).size() == 1);
  CHECK(opt.group_parameters(1)[0].first == "v");
  CHECK(opt.group_parameters(0)[0].second.same(w));

  opt.set_lr(1, 0.7);
  CHECK(opt.lr(0) == 0.1);
  CHECK(opt.lr(1) == 0.7);
  CHECK(opt.options(1).lr == 0.7);
  opt.set_lr(0.3);
  CHECK(opt.lr(0) == 0.3);
  CHECK(opt.lr(1) == 0.3);
  CHECK(opt.lr() == 0.3);
}

TEST_CASE("frozen, unused and empty parameters: accepted, untouched, stateless unless they have a gradient",
          "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w");
  Variable frozen(from_vector<double>({3.0, -4.0}), false, "frozen");
  Variable unused(from_vector<double>({5.0}), true, "unused");
  // A rank's slice of a parameter it holds no element of (FSDP): empty, with an empty gradient.
  Variable empty_slice(zeros({0}, dtype(DType::f64)), true, "empty");
  optim::Adam opt({{.parameters = {}},
                   {.parameters = {{"w", w}, {"frozen", frozen}}},
                   {.parameters = {{"unused", unused}, {"empty", empty_slice}}, .lr = 0.5}},
                  {.lr = 0.1});
  Vec p = kStart;
  AdamRef ref{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0};
  for (int t = 1; t <= 2; ++t) {
    const Vec g = test_grad(p, t);
    w.set_grad(from_vector<double>(g));
    empty_slice.set_grad(zeros({0}, dtype(DType::f64)));
    opt.step();
    ref.step(p, g);
  }
  check_close(w.data(), p, kF64);
  check_equal(frozen.data(), {3.0, -4.0});
  check_equal(unused.data(), {5.0});
  CHECK(empty_slice.data().numel() == 0);
  std::vector<std::string> parameter_keys;
  for (const auto& [key, tensor] : opt.state_dict()) {
    if (key != "step" && !key.starts_with("param_groups.")) parameter_keys.push_back(key);
  }
  CHECK(parameter_keys == std::vector<std::string>{"w.exp_avg", "w.exp_avg_sq", "w.step", "empty.exp_avg",
                                                   "empty.exp_avg_sq", "empty.step"});
}

TEST_CASE("parameter group errors name the optimizer, the group and the field", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w"), v(from_vector<double>({1.0}), true, "v");
  const nn::Named<Variable> first = {{"w", w}}, second = {{"v", v}};

  SECTION("a field the optimizer type does not have") {
    CHECK_THROWS_ERROR(
        optim::AdamW({{.parameters = first}, {.parameters = second, .momentum = 0.9}}, {}),
        "AdamW: group 1 sets momentum, which AdamW does not have (it has lr, beta1, beta2, eps, "
        "weight_decay)");
    CHECK_THROWS_ERROR(optim::SGD({{.parameters = first, .rho = 0.9}}, {}),
                       "SGD: group 0 sets rho, which SGD does not have (it has lr, momentum, dampening, "
                       "weight_decay, nesterov)");
    CHECK_THROWS_ERROR(optim::Adam({{.parameters = first, .nesterov = false}}, {}),
                       "Adam: group 0 sets nesterov, which Adam does not have (it has lr, beta1, beta2, eps, "
                       "weight_decay)");
    CHECK_THROWS_ERROR(optim::Adadelta({{.parameters = first}, {.parameters = second, .beta1 = 0.9}}, {}),
                       "Adadelta: group 1 sets beta1, which Adadelta does not have (it has lr, rho, eps, "
                       "weight_decay)");
  }
  SECTION("a group's resolved options are checked, naming the group") {
    CHECK_THROWS_ERROR(optim::SGD({{.parameters = first}, {.parameters = second, .momentum = -1}}, {}),
                       "SGD: group 1: invalid momentum -1 (must be >= 0)");
    CHECK_THROWS_ERROR(
        optim::SGD({{.parameters = first}, {.parameters = second, .nesterov = true}}, {}),
        "SGD: group 1: nesterov needs momentum > 0 and dampening == 0 (got momentum 0, dampening 0)");
    CHECK_THROWS_ERROR(optim::Adam({{.parameters = first, .lr = -1}, {.parameters = second}}, {}),
                       "Adam: group 0: invalid learning rate -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::AdamW({{.parameters = first}, {.parameters = second, .beta2 = 1.0}}, {}),
                       "AdamW: group 1: invalid beta2 1 (must be in [0, 1))");
    CHECK_THROWS_ERROR(optim::Adadelta({{.parameters = first}, {.parameters = second, .rho = 2.0}}, {}),
                       "Adadelta: group 1: invalid rho 2 (must be in [0, 1])");
    // One group: the messages of a plain parameter list.
    CHECK_THROWS_ERROR(optim::Adam({{.parameters = first, .eps = -1}}, {}),
                       "Adam: invalid eps -1 (must be >= 0)");
  }
  SECTION("parameters across groups") {
    CHECK_THROWS_ERROR(optim::SGD({{.parameters = first}, {.parameters = {{"w", v}}}}, {}),
                       "SGD: parameter name 'w' appears twice");
    CHECK_THROWS_ERROR(optim::SGD({{.parameters = first}, {.parameters = {{"again", w}}}}, {}),
                       "SGD: parameters 'w' and 'again' are the same Variable");
    CHECK_THROWS_ERROR(optim::Adam({{.parameters = {}}, {.parameters = {}}}, {}),
                       "Adam: got an empty parameter list");
    CHECK_THROWS_ERROR(optim::Adam(std::vector<optim::ParamGroup>{}, {}),
                       "Adam: got an empty parameter list");
  }
  SECTION("group indices") {
    optim::SGD opt({{.parameters = first}, {.parameters = second}}, {.lr = 0.1});
    CHECK_THROWS_ERROR(opt.lr(2), "SGD: no parameter group 2 (it has 2)");
    CHECK_THROWS_ERROR(opt.set_lr(2, 0.1), "SGD: no parameter group 2 (it has 2)");
    CHECK_THROWS_ERROR(opt.group_parameters(5), "SGD: no parameter group 5 (it has 2)");
    CHECK_THROWS_ERROR(opt.options(2), "SGD: no parameter group 2 (it has 2)");
    CHECK_THROWS_ERROR(opt.set_lr(1, -1), "SGD: group 1: invalid learning rate -1 (must be >= 0)");
    CHECK_THROWS_ERROR(opt.set_lr(kNaN), "SGD: invalid learning rate nan (must be >= 0)");
    CHECK(opt.lr(0) == 0.1);
    CHECK(opt.lr(1) == 0.1);
  }
}

TEST_CASE("load_state_dict: group keys are checked like the constructor's options, nothing changes on error",
          "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w"), b(from_vector<double>({0.5, -0.5}), true, "b");
  optim::SGD opt({{.parameters = {{"w", w}}}, {.parameters = {{"b", b}}, .lr = 0.2, .momentum = 0.0}},
                 {.lr = 0.1, .momentum = 0.9});
  set_test_grads(w, b, 1);
  opt.step();
  const nn::StateDict good = opt.state_dict();
  const Vec buffer_before = values(good[0].second);
  const auto f64 = [](double v) { return scalar_tensor(v, dtype(DType::f64)); };
  const auto with = [&](const std::string& key, const Tensor& value) {
    nn::StateDict out;
    bool replaced = false;
    for (const auto& [k, t] : good) {
      out.emplace_back(k, k == key ? value : t);
      replaced = replaced || k == key;
    }
    if (!replaced) out.emplace_back(key, value);
    return out;
  };
  const auto without = [&](const std::string& prefix) {
    nn::StateDict out;
    for (const auto& [k, t] : good) {
      if (!k.starts_with(prefix)) out.emplace_back(k, t);
    }
    return out;
  };

  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("param_groups.2.lr", f64(0.1))),
      "SGD.load_state_dict: unexpected key 'param_groups.2.lr': the optimizer has 2 parameter groups");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.x.lr", f64(0.1))),
                     "SGD.load_state_dict: unexpected key 'param_groups.x.lr' (group keys are "
                     "'param_groups.<group>.<hyper-parameter>')");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.1", f64(0.1))),
                     "SGD.load_state_dict: unexpected key 'param_groups.1' (group keys are "
                     "'param_groups.<group>.<hyper-parameter>')");
  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("param_groups.0.rho", f64(0.9))),
      "SGD.load_state_dict: unexpected key 'param_groups.0.rho': SGD has no hyper-parameter 'rho' "
      "(its hyper-parameters: lr, momentum, dampening, weight_decay, nesterov, initial_lr)");
  CHECK_THROWS_ERROR(opt.load_state_dict(without("param_groups.1.dampening")),
                     "SGD.load_state_dict: missing key 'param_groups.1.dampening'");
  // A state dict of a one-group optimizer: the second group is missing.
  CHECK_THROWS_ERROR(opt.load_state_dict(without("param_groups.1.")),
                     "SGD.load_state_dict: missing key 'param_groups.1.lr'");
  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("param_groups.0.lr", zeros({1}, dtype(DType::f64)))),
      "SGD.load_state_dict: key 'param_groups.0.lr' has shape [1] in the state dict but [] in the "
      "optimizer");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.0.lr", f64(kNaN))),
                     "SGD.load_state_dict: param_groups.0: invalid learning rate nan (must be >= 0)");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.1.momentum", f64(-1))),
                     "SGD.load_state_dict: param_groups.1: invalid momentum -1 (must be >= 0)");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.0.nesterov", f64(0.5))),
                     "SGD.load_state_dict: param_groups.0: invalid nesterov 0.5 (a flag is 0 or 1)");
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.0.initial_lr", f64(-1))),
                     "SGD.load_state_dict: param_groups.0: invalid initial_lr -1 (must be >= 0)");
  // Loaded momentum in group 1 asks for a buffer its parameter does not have.
  CHECK_THROWS_ERROR(opt.load_state_dict(with("param_groups.1.momentum", f64(0.5))),
                     "SGD.load_state_dict: missing key 'b.momentum_buffer' (expected shape [2])");

  // Nothing above was applied.
  CHECK(opt.lr(0) == 0.1);
  CHECK(opt.lr(1) == 0.2);
  CHECK(opt.options(1).momentum == 0.0);
  CHECK(opt.steps() == 1);
  check_equal(opt.state_dict()[0].second, buffer_before);

  // A valid dict replaces the groups' values.
  opt.load_state_dict(with("param_groups.1.lr", f64(0.05)));
  CHECK(opt.lr(1) == 0.05);
  CHECK(opt.lr(0) == 0.1);
}

// --- argument errors --------------------------------------------------------------------------

TEST_CASE("optimizer constructors and set_lr reject bad arguments", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w");
  const nn::Named<Variable> params = {{"w", w}};

  SECTION("parameters") {
    CHECK_THROWS_ERROR(optim::SGD(nn::Named<Variable>{}, {}), "SGD: got an empty parameter list");
    CHECK_THROWS_ERROR(optim::Adam({{"w", w}, {"w", Variable(zeros({2}), true)}}, {}),
                       "Adam: parameter name 'w' appears twice");
    CHECK_THROWS_ERROR(optim::SGD({{"x", Variable()}}, {}), "SGD: parameter 'x' is an undefined Variable");
    CHECK_THROWS_ERROR(optim::AdamW({{"idx", Variable(arange(3))}}, {}),
                       "AdamW: parameter 'idx' has dtype i64; only floating parameters can be optimized");
    CHECK_THROWS_ERROR(optim::Adadelta({{"a", w}, {"b", w}}, {}),
                       "Adadelta: parameters 'a' and 'b' are the same Variable");
    CHECK_THROWS_ERROR(optim::SGD({{"param_groups.0", Variable(zeros({2}), true)}}, {}),
                       "SGD: parameter name 'param_groups.0' is reserved: state dict keys starting with "
                       "'param_groups.' name groups");
    const Variable computed = mul(w, 2.0);
    CHECK_THROWS_ERROR(optim::SGD({{"twice", computed}}, {}),
                       "SGD: parameter 'twice' is not a leaf of the graph");
  }
  SECTION("learning rate") {
    CHECK_THROWS_ERROR(optim::SGD(params, {.lr = -0.1}), "SGD: invalid learning rate -0.1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::Adam(params, {.lr = kNaN}), "Adam: invalid learning rate nan (must be >= 0)");
    CHECK_THROWS_ERROR(optim::AdamW(params, {.lr = -1}), "AdamW: invalid learning rate -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::Adadelta(params, {.lr = -2}),
                       "Adadelta: invalid learning rate -2 (must be >= 0)");
    optim::Adam opt(params, {.lr = 0.1});
    CHECK_THROWS_ERROR(opt.set_lr(-1), "Adam: invalid learning rate -1 (must be >= 0)");
    CHECK_THROWS_ERROR(opt.set_lr(kNaN), "Adam: invalid learning rate nan (must be >= 0)");
    CHECK(opt.lr() == 0.1);
    opt.set_lr(0);
    CHECK(opt.lr() == 0);
  }
  SECTION("SGD") {
    CHECK_THROWS_ERROR(optim::SGD(params, {.momentum = -0.5}), "SGD: invalid momentum -0.5 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::SGD(params, {.weight_decay = -1}),
                       "SGD: invalid weight_decay -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::SGD(params, {.nesterov = true}),
                       "SGD: nesterov needs momentum > 0 and dampening == 0 (got momentum 0, dampening 0)");
    CHECK_THROWS_ERROR(
        optim::SGD(params, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}),
        "SGD: nesterov needs momentum > 0 and dampening == 0 (got momentum 0.9, dampening 0.1)");
  }
  SECTION("Adam and AdamW") {
    CHECK_THROWS_ERROR(optim::Adam(params, {.beta1 = 1.0}), "Adam: invalid beta1 1 (must be in [0, 1))");
    CHECK_THROWS_ERROR(optim::Adam(params, {.beta2 = -0.1}), "Adam: invalid beta2 -0.1 (must be in [0, 1))");
    CHECK_THROWS_ERROR(optim::Adam(params, {.eps = -1}), "Adam: invalid eps -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::Adam(params, {.weight_decay = -1}),
                       "Adam: invalid weight_decay -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::AdamW(params, {.beta1 = kNaN}), "AdamW: invalid beta1 nan (must be in [0, 1))");
    CHECK_THROWS_ERROR(optim::AdamW(params, {.beta2 = 1.5}), "AdamW: invalid beta2 1.5 (must be in [0, 1))");
    CHECK_THROWS_ERROR(optim::AdamW(params, {.eps = -1}), "AdamW: invalid eps -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::AdamW(params, {.weight_decay = -0.5}),
                       "AdamW: invalid weight_decay -0.5 (must be >= 0)");
  }
  SECTION("Adadelta") {
    CHECK_THROWS_ERROR(optim::Adadelta(params, {.rho = 1.5}),
                       "Adadelta: invalid rho 1.5 (must be in [0, 1])");
    CHECK_THROWS_ERROR(optim::Adadelta(params, {.rho = -0.1}),
                       "Adadelta: invalid rho -0.1 (must be in [0, 1])");
    CHECK_THROWS_ERROR(optim::Adadelta(params, {.eps = -1}), "Adadelta: invalid eps -1 (must be >= 0)");
    CHECK_THROWS_ERROR(optim::Adadelta(params, {.weight_decay = -1}),
                       "Adadelta: invalid weight_decay -1 (must be >= 0)");
  }
}

TEST_CASE("step: a gradient whose shape no longer matches the parameter is an error", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w");
  optim::SGD opt({{"w", w}}, {.lr = 0.1});
  w.set_grad(from_vector<double>({1.0, 1.0, 1.0}));
  // FSDP swaps parameter data with set_data; a stale gradient must not be applied.
  w.set_data(from_vector<double>({1.0, 2.0}));
  CHECK_THROWS_ERROR(opt.step(), "SGD.step: gradient of 'w' has shape [3] but the parameter has shape [2]");
  check_equal(w.data(), {1.0, 2.0});
}

// --- CUDA ------------------------------------------------------------------------------------

// Three steps of `Opt` on inputs[0] with gradients inputs[1..3], returning the parameter; the
// per-parameter state ("w.<slot>") must stay on the parameter's device (the step count and the
// groups' hyperparameters are host scalars).
template <typename Opt, typename Options>
Tensor three_steps_on(const test::Inputs& inputs, Options options) {
  Variable w(inputs[0].clone(), true, "w");
  Opt opt({{"w", w}}, options);
  for (std::size_t t = 1; t <= 3; ++t) {
    w.set_grad(inputs[t].clone());
    opt.step();
  }
  int slots = 0;
  for (const auto& [key, tensor] : opt.state_dict()) {
    if (!key.starts_with("w.") || key.ends_with(".step")) continue;
    CHECK(tensor.device() == w.device());
    ++slots;
  }
  CHECK(slots > 0);
  return w.data();
}

TEST_CASE("cuda matches cpu: optimizer steps and clip_grad_norm_", "[cuda-vs-cpu][optim]") {
  const test::Inputs inputs = {test::random_tensor({37, 5}, 1), test::random_tensor({37, 5}, 2),
                               test::random_tensor({37, 5}, 3), test::random_tensor({37, 5}, 4)};
  test::compare_cuda_with_cpu(inputs, [](const test::Inputs& x) {
    return three_steps_on<optim::SGD>(x, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true});
  });
  test::compare_cuda_with_cpu(inputs, [](const test::Inputs& x) {
    return three_steps_on<optim::Adam>(x, optim::AdamOptions{.lr = 0.01, .weight_decay = 0.1});
  });
  test::compare_cuda_with_cpu(inputs, [](const test::Inputs& x) {
    return three_steps_on<optim::AdamW>(x, optim::AdamWOptions{.lr = 0.01});
  });
  test::compare_cuda_with_cpu(inputs, [](const test::Inputs& x) {
    return three_steps_on<optim::Adadelta>(x, optim::AdadeltaOptions{.weight_decay = 0.1});
  });
  test::compare_cuda_with_cpu(inputs, [](const test::Inputs& x) {
    // Two groups: one fused launch updates both parameters, each with its group's lr and decay.
    Variable w(x[0].narrow(0, 0, 20).clone(), true), v(x[0].narrow(0, 20, 17).clone(), true);
    optim::AdamW opt(
        {{.parameters = {{"w", w}}}, {.parameters = {{"v", v}}, .lr = 0.05, .weight_decay = 0.0}},
        {.lr = 0.01});
    for (std::size_t t = 1; t <= 3; ++t) {
      w.set_grad(x[t].narrow(0, 0, 20).clone());
      v.set_grad(x[t].narrow(0, 20, 17).clone());
      opt.step();
    }
    return cat({w.data(), v.data()}, 0);
  });
  test::compare_cuda_with_cpu(inputs, [](const test::Inputs& x) {
    Variable w(x[0], true);
    w.set_grad(x[1].clone());
    const Tensor norm = optim::clip_grad_norm_({w}, 0.5);
    CHECK(norm.device() == x[1].device());  // left where the gradients are: no host wait
    const double total = norm.item<double>();
    CHECK(total == Approx(std::sqrt(test::dot(values(x[1]), values(x[1])))).epsilon(1e-6));
    return w.grad();
  });
}

// --- clip_grad_norm_ --------------------------------------------------------------------------

TEST_CASE(
    "clip_grad_norm_exact: the squares added exactly, over any grouping, then clipped as clip_grad_norm_",
    "[optim]") {
  // |(3, 4, 12)| = 13 exactly.
  Variable a(zeros({2}), true), b(zeros({1}), true), no_grad(zeros({5}), true);
  a.set_grad(from_vector<float>({3.0F, -4.0F}));
  b.set_grad(from_vector<float>({12.0F}));
  SECTION("clips as clip_grad_norm_") {
    CHECK(optim::clip_grad_norm_exact({a, no_grad, b}, 6.5).item<double>() == 13.0);
    const double factor = 6.5 / (13.0 + 1e-6);
    check_close(a.grad(), {3.0 * factor, -4.0 * factor}, {1e-6, 1e-6});
    check_close(b.grad(), {12.0 * factor}, {1e-6, 1e-6});
  }
  SECTION("the combiner gets the limbs, whose sum over ranks is exact") {
    std::vector<Shape> seen;
    // As an all-reduce over 4 ranks holding equal shards would: 4 x 169 = 26^2.
    const double total = optim::clip_grad_norm_exact({a, b}, 100.0, [&](const Tensor& limbs) {
                           seen.push_back(limbs.shape());
                           return mul(limbs, 4);
                         }).item<double>();
    CHECK(seen == std::vector<Shape>{Shape{kExactLimbs}});
    CHECK(total == 26.0);
  }
  SECTION("no square is lost to rounding, in any order") {
    // 2^60 + 1000 x 1: added in this order in f64 each 1 is lost (the step there is 256); the exact
    // sum rounds once, to 2^60 + 1024, whichever comes first.
    std::vector<float> values(1001, 1.0F);
    values.front() = std::ldexp(1.0F, 30);
    Variable big_first(zeros({1001}), true), big_last(zeros({1001}), true);
    big_first.set_grad(from_vector<float>(values));
    std::reverse(values.begin(), values.end());
    big_last.set_grad(from_vector<float>(values));
    const double expected = std::sqrt(std::ldexp(1.0, 60) + 1024.0);
    CHECK(optim::clip_grad_norm_exact({big_first}, 1e30).item<double>() == expected);
    CHECK(optim::clip_grad_norm_exact({big_last}, 1e30).item<double>() == expected);
  }
  SECTION("errors") {
    CHECK_THROWS_ERROR(optim::clip_grad_norm_exact({a}, 0.0),
                       "clip_grad_norm_exact: max_norm must be > 0, got 0");
    Variable wide(zeros({1}, dtype(DType::f64)), true);
    wide.set_grad(zeros({1}, dtype(DType::f64)));
    CHECK_THROWS_ERROR(optim::clip_grad_norm_exact({wide}, 1.0), "f64");
  }
}

TEST_CASE("clip_grad_norm_: global norm, scaling above max_norm, combine hook", "[optim]") {
  // |(3, 4, 12)| = 13 exactly.
  Variable a(zeros({2}, dtype(DType::f64)), true);
  Variable b(zeros({1}, dtype(DType::f64)), true);
  Variable no_grad(zeros({5}, dtype(DType::f64)), true);
  const std::vector<Variable> params = {a, no_grad, b};
  const auto set_grads = [&] {
    a.set_grad(from_vector<double>({3.0, -4.0}));
    b.set_grad(from_vector<double>({12.0}));
  };

  SECTION("scales when the norm is above max_norm") {
    set_grads();
    CHECK(optim::clip_grad_norm_(params, 6.5).item<double>() == 13.0);
    const double factor = 6.5 / (13.0 + 1e-6);
    check_close(a.grad(), {3.0 * factor, -4.0 * factor}, kF64);
    check_close(b.grad(), {12.0 * factor}, kF64);
    CHECK_FALSE(no_grad.grad().defined());
  }
  SECTION("leaves gradients alone below max_norm") {
    set_grads();
    CHECK(optim::clip_grad_norm_(params, 20.0).item<double>() == 13.0);
    check_equal(a.grad(), {3.0, -4.0});
    check_equal(b.grad(), {12.0});
  }
  SECTION("combine receives the local sum of squares and its result decides") {
    set_grads();
    std::vector<double> seen;
    // As an all-reduce over 4 ranks holding equal shards would: 4 x 169 = 26^2.
    const double total = optim::clip_grad_norm_(params, 13.0, [&](const Tensor& local) {
                           seen.push_back(local.item<double>());
                           return local * 4.0;
                         }).item<double>();
    CHECK(seen == std::vector<double>{169.0});
    CHECK(total == 26.0);
    const double factor = 13.0 / (26.0 + 1e-6);
    check_close(a.grad(), {3.0 * factor, -4.0 * factor}, kF64);
    check_close(b.grad(), {12.0 * factor}, kF64);
  }
  SECTION("combine is called even when no gradient is defined") {
    int calls = 0;
    const double total = optim::clip_grad_norm_(params, 1.0, [&](const Tensor& local) {
                           ++calls;
                           CHECK(local.item<double>() == 0.0);
                           return full({}, 9.0, dtype(DType::f64));  // other ranks had gradients
                         }).item<double>();
    CHECK(calls == 1);
    CHECK(total == 3.0);
  }
  SECTION("the scale is cast once per gradient dtype, not once per gradient") {
    // Five f32 gradients and two bf16 ones of |(3, 4)| each: the norm is 5 sqrt(7), the scale
    // 1 / (5 sqrt(7) + 1e-6), rounded to each dtype as mul_ would round it.
    std::vector<Variable> mixed;
    for (const DType dtype : {DType::f32, DType::f32, DType::bf16, DType::f32, DType::f32, DType::bf16, DType::f32}) {
      Variable v(zeros({2}, shardlab::dtype(dtype)), true);
      v.set_grad(from_vector<double>({3.0, -4.0}).to(dtype));
      mixed.push_back(v);
    }
    call_log::start();
    const double total = optim::clip_grad_norm_(mixed, 1.0).item<double>();
    const std::vector<call_log::Call> calls = call_log::stop();
    CHECK(total == Approx(5.0 * std::sqrt(7.0)).epsilon(1e-6));
    const auto count = [&](const char* op) {
      return std::count_if(calls.begin(), calls.end(), [&](const call_log::Call& call) { return call.op == op; });
    };
    CHECK(count("cast") == 2);  // the f64 scale to f32, and to bf16
    CHECK(count("mul") == 7);
    const double scale = 1.0 / (5.0 * std::sqrt(7.0) + 1e-6);
    for (const Variable& v : mixed) {
      const Tensor scale_in_dtype = full({}, scale, shardlab::dtype(v.dtype()));
      check_equal(v.grad(), mul(from_vector<double>({3.0, -4.0}).to(v.dtype()), scale_in_dtype).to_vector<double>());
    }
  }
  SECTION("bf16 gradients are summed in f32") {
    // 301 x 0.5^2 = 75.25, which bf16 cannot hold (its spacing near 75 is 0.5): a sum
    // returned in bf16 would be off by 0.25, far beyond the tolerance.
    Variable h(zeros({301}, dtype(DType::bf16)), true);
    h.set_grad(full({301}, 0.5, dtype(DType::bf16)));
    CHECK(optim::clip_grad_norm_({h}, 100.0).item<double>() == Approx(std::sqrt(75.25)).epsilon(1e-9));
  }
  SECTION("a NaN norm makes the gradients NaN") {
    set_grads();
    const double total =
        optim::clip_grad_norm_(params, 1.0, [](const Tensor& local) { return local * kNaN; }).item<double>();
    CHECK(std::isnan(total));
    CHECK(std::isnan(a.grad().data<double>()[0]));
    CHECK(std::isnan(b.grad().data<double>()[0]));
  }
  SECTION("errors") {
    set_grads();
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, 0.0), "clip_grad_norm_: max_norm must be > 0, got 0");
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, -1.0), "clip_grad_norm_: max_norm must be > 0, got -1");
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, kNaN),
                       "clip_grad_norm_: max_norm must be > 0, got nan");
    check_equal(a.grad(), {3.0, -4.0});
  }
}

// Stands for the ranks holding the other parts of some parameters: they add `others` to every sum.
class OtherRanks final : public ShardRanks {
 public:
  OtherRanks(double others, std::vector<std::string>& log, std::string name)
      : others_(others), log_(&log), name_(std::move(name)) {}
  Tensor sum(const Tensor& value) const override {
    log_->push_back(fmt::format("{} {}", name_, value.item<double>()));
    return value + others_;
  }

 private:
  double others_;
  std::vector<std::string>* log_;
  std::string name_;
};

// A 1-D shard of `count` elements of a parameter of `full` elements, its gradient set.
Variable shard_with_grad(std::vector<double> grad, std::int64_t full, std::shared_ptr<const ShardRanks> ranks,
                         bool counts_once = true) {
  const auto count = static_cast<std::int64_t>(grad.size());
  Variable shard(zeros({count}, dtype(DType::f64)), true);
  shard.set_shard_info({.full_shape = {full},
                        .first = 0,
                        .count = count,
                        .placement = "test",
                        .counts_once = counts_once,
                        .ranks = std::move(ranks)});
  shard.set_grad(from_vector<double>(grad));
  return shard;
}

TEST_CASE("clip_grad_norm_ adds the shards' sums over their ranks, a replicated copy once",
          "[optim][shard]") {
  std::vector<std::string> log;
  const auto first_ranks = std::make_shared<OtherRanks>(11.0, log, "first");
  const auto second_ranks = std::make_shared<OtherRanks>(20.0, log, "second");
  Variable whole(zeros({2}, dtype(DType::f64)), true);
  whole.set_grad(from_vector<double>({3.0, 4.0}));                         // 25, combined by `combine`
  const Variable a = shard_with_grad({1.0, 2.0}, 8, second_ranks);         // 5
  const Variable b = shard_with_grad({2.0}, 4, first_ranks);               // 4
  const Variable replica = shard_with_grad({9.0}, 4, first_ranks, false);  // another rank counts it
  const Variable no_grad = shard_with_grad({0.0}, 4, second_ranks);
  no_grad.set_grad(Tensor());
  // 25 * 2 (combine) + (5 + 20) + (4 + 11) = 90, one sum per set of ranks in order of first use.
  const double norm = optim::clip_grad_norm_({a, whole, replica, b, no_grad}, 1e9, [](const Tensor& local) {
                        return local * 2.0;
                      }).item<double>();
  CHECK(norm == Approx(std::sqrt(90.0)).epsilon(1e-12));
  CHECK(log == std::vector<std::string>{"second 5", "first 4"});
  check_equal(replica.grad(), {9.0});  // below max_norm: untouched
  // The sums are called even when no shard of theirs has a gradient, so every rank joins.
  log.clear();
  CHECK(optim::clip_grad_norm_({no_grad}, 1.0).item<double>() == Approx(std::sqrt(20.0)).epsilon(1e-12));
  CHECK(log == std::vector<std::string>{"second 0"});
}

TEST_CASE("optimizers and clipping refuse a Variable marked not trainable, with its reason",
          "[optim][errors]") {
  Variable gathered(zeros({2}), true, "w");
  gathered.set_not_trainable("it is a gathered copy; use the shard");
  CHECK_THROWS_ERROR(optim::SGD(nn::Named<Variable>{{"w", gathered}}, {.lr = 0.1}),
                     "SGD: parameter 'w' cannot be trained here: it is a gathered copy; use the shard");
  CHECK_THROWS_ERROR(optim::clip_grad_norm_({gathered}, 1.0),
                     "clip_grad_norm_: parameter 'w' cannot be trained here: it is a gathered copy");
  // Marked after the optimizer was built: its first step refuses, before anything changes.
  Variable later(ones({2}), true, "v");
  optim::SGD sgd(nn::Named<Variable>{{"v", later}}, {.lr = 0.1});
  later.set_grad(ones({2}));
  later.set_not_trainable("sharded since");
  CHECK_THROWS_ERROR(sgd.step(), "SGD.step: parameter 'v' cannot be trained here: sharded since");
  check_equal(later.data(), {1.0, 1.0});
}

TEST_CASE("update_seconds_per_element times each optimizer's rule on scratch data and changes nothing",
          "[optim]") {
  Variable w(from_vector<double>({1.0, -2.0, 3.0}).to(DType::f32), true, "w");
  w.set_grad(from_vector<double>({0.5, 0.5, 0.5}).to(DType::f32));
  optim::SGD sgd(nn::Named<Variable>{{"w", w}}, {.lr = 0.1, .momentum = 0.9});
  optim::AdamW adamw(nn::Named<Variable>{{"w", w}}, {});
  optim::Adadelta adadelta(nn::Named<Variable>{{"w", w}}, {});
  for (const optim::Optimizer* opt : std::vector<const optim::Optimizer*>{&sgd, &adamw, &adadelta}) {
    const double seconds = opt->update_seconds_per_element(Device::cpu(), 4096);
    CHECK(seconds > 0);
    CHECK(seconds < 1e-3);  // a thousandth of a second per element would be no fused update
  }
  check_equal(w.data(), {1.0, -2.0, 3.0});  // the parameter untouched
  CHECK(adamw.steps() == 0);
  for (const auto& [name, value] : adamw.state_dict()) CHECK(!name.starts_with("w."));  // no state made for w
  CHECK_THROWS_ERROR(adamw.update_seconds_per_element(Device::cpu(), 0),
                     "AdamW.update_seconds_per_element: elements must be positive, got 0");
}

}  // namespace
}  // namespace shardlab
