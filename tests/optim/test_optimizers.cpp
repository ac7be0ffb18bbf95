// tests/optim/test_optimizers.cpp: SGD, Adam, AdamW and Adadelta against naive per-element
// re-implementations, their state dicts, argument errors, and clip_grad_norm_.
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "autograd/ops.h"
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
    // Gradients arrive in f64 whatever the parameter's dtype: step() casts them.
    w.set_grad(from_vector<double>(g));
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
    // State lives in the parameter's dtype; the step counters are i64.
    CHECK(tensor.dtype() == (key == "step" || key == "w.step" ? DType::i64 : dtype));
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
  SECTION("defaults (the seed MNIST tutorial's optimizer)") {
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
  CHECK(opt.options.lr == 0.1);
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

// Saves after 2 steps, loads into a fresh optimizer over equal parameters, and steps both:
// they must agree exactly, while an optimizer that did not load must not.
template <typename Opt, typename Options>
void check_round_trip(Options options) {
  // Dotted names, as a model gives them: the key splits at the last dot.
  Variable w(from_vector<double>(kStart), true, "layer.weight");
  Variable b(from_vector<double>({0.1, -0.2}), true, "layer.bias");
  Opt first({{"layer.weight", w}, {"layer.bias", b}}, options);
  for (int t = 1; t <= 2; ++t) {
    set_test_grads(w, b, t);
    first.step();
  }
  const nn::StateDict saved = first.state_dict();

  Variable w2(w.data().clone(), true), b2(b.data().clone(), true);
  Opt second({{"layer.weight", w2}, {"layer.bias", b2}}, options);
  second.load_state_dict(saved);
  CHECK(second.steps() == 2);
  Variable w3(w.data().clone(), true), b3(b.data().clone(), true);
  Opt control({{"layer.weight", w3}, {"layer.bias", b3}}, options);

  for (int t = 3; t <= 4; ++t) {
    // `first` steps before `second`: `saved` holds first's live state, so a load that kept
    // those tensors instead of copying them would see them advance and diverge here.
    set_test_grads(w, b, t);
    first.step();
    set_test_grads(w2, b2, t);
    second.step();
    set_test_grads(w3, b3, t);
    control.step();
    check_equal(w2.data(), values(w.data()));
    check_equal(b2.data(), values(b.data()));
  }
  CHECK(test::count_mismatches(values(w3.data()), values(w.data()), kF64) > 0);

  std::vector<std::string> keys_first, keys_second;
  for (const auto& [key, tensor] : first.state_dict()) keys_first.push_back(key);
  for (const auto& [key, tensor] : second.state_dict()) keys_second.push_back(key);
  CHECK(keys_first == keys_second);
}

TEST_CASE("state_dict round trip gives identical continued training", "[optim]") {
  SECTION("SGD with momentum") {
    check_round_trip<optim::SGD>(optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
  }
  SECTION("Adam") { check_round_trip<optim::Adam>(optim::AdamOptions{.lr = 0.1, .eps = 0.01}); }
  SECTION("AdamW") { check_round_trip<optim::AdamW>(optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1}); }
  SECTION("Adadelta") { check_round_trip<optim::Adadelta>(optim::AdadeltaOptions{.rho = 0.8}); }
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
  CHECK(keys ==
        std::vector<std::string>{"fc1.weight.exp_avg", "fc1.weight.exp_avg_sq", "fc1.weight.step", "step"});
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
  REQUIRE(loaded.size() == 4);
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
  const nn::StateDict good = {
      {"w.exp_avg", t3()}, {"w.exp_avg_sq", t3()}, {"w.step", step(1)}, {"step", step(1)}};
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

  CHECK_THROWS_ERROR(
      opt.load_state_dict(with("bogus", t3())),
      "Adam.load_state_dict: unexpected key 'bogus' (keys are '<parameter>.<slot>' or 'step')");
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
  // The good dict loads, and a dict with only "step" clears every parameter's state.
  opt.load_state_dict(good);
  check_equal(opt.state_dict()[0].second, {0.0, 0.0, 0.0});
  opt.load_state_dict({{"step", step(5)}});
  CHECK(opt.steps() == 5);
  CHECK(opt.state_dict().size() == 1);

  // SGD without momentum keeps only the step counter.
  Variable v(from_vector<double>(kStart), true);
  optim::SGD sgd({{"w", v}}, {.lr = 0.1});
  CHECK_THROWS_ERROR(sgd.load_state_dict(good),
                     "SGD.load_state_dict: unexpected key 'w.exp_avg': SGD has no state slot 'exp_avg' "
                     "(its slots: step)");
}

// --- argument errors --------------------------------------------------------------------------

TEST_CASE("optimizer constructors and set_lr reject bad arguments", "[optim]") {
  Variable w(from_vector<double>(kStart), true, "w");
  const nn::Named<Variable> params = {{"w", w}};

  SECTION("parameters") {
    CHECK_THROWS_ERROR(optim::SGD({}, {}), "SGD: got an empty parameter list");
    CHECK_THROWS_ERROR(optim::Adam({{"w", w}, {"w", Variable(zeros({2}), true)}}, {}),
                       "Adam: parameter name 'w' appears twice");
    CHECK_THROWS_ERROR(optim::SGD({{"x", Variable()}}, {}), "SGD: parameter 'x' is an undefined Variable");
    CHECK_THROWS_ERROR(optim::AdamW({{"idx", Variable(arange(3))}}, {}),
                       "AdamW: parameter 'idx' has dtype i64; only floating parameters can be optimized");
    CHECK_THROWS_ERROR(optim::Adadelta({{"c", Variable(zeros({2}), false)}}, {}),
                       "Adadelta: parameter 'c' does not require grad");
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
// state must stay on the parameter's device.
template <typename Opt, typename Options>
Tensor three_steps_on(const test::Inputs& inputs, Options options) {
  Variable w(inputs[0].clone(), true, "w");
  Opt opt({{"w", w}}, options);
  for (std::size_t t = 1; t <= 3; ++t) {
    w.set_grad(inputs[t].clone());
    opt.step();
  }
  for (const auto& [key, tensor] : opt.state_dict()) {
    if (!key.ends_with("step")) CHECK(tensor.device() == w.device());
  }
  return w.data();
}

TEST_CASE("cuda matches cpu: optimizer steps and clip_grad_norm_", "[cuda][optim]") {
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
    Variable w(x[0], true);
    w.set_grad(x[1].clone());
    const double total = optim::clip_grad_norm_({w}, 0.5);
    CHECK(total == Approx(std::sqrt(test::dot(values(x[1]), values(x[1])))).epsilon(1e-6));
    return w.grad();
  });
}

// --- clip_grad_norm_ --------------------------------------------------------------------------

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
    CHECK(optim::clip_grad_norm_(params, 6.5) == 13.0);
    const double factor = 6.5 / (13.0 + 1e-6);
    check_close(a.grad(), {3.0 * factor, -4.0 * factor}, kF64);
    check_close(b.grad(), {12.0 * factor}, kF64);
    CHECK_FALSE(no_grad.grad().defined());
  }
  SECTION("leaves gradients alone below max_norm") {
    set_grads();
    CHECK(optim::clip_grad_norm_(params, 20.0) == 13.0);
    check_equal(a.grad(), {3.0, -4.0});
    check_equal(b.grad(), {12.0});
  }
  SECTION("combine receives the local sum of squares and its result decides") {
    set_grads();
    std::vector<double> seen;
    // As an all-reduce over 4 ranks holding equal shards would: 4 x 169 = 26^2.
    const double total = optim::clip_grad_norm_(params, 13.0, [&](double local) {
      seen.push_back(local);
      return 4 * local;
    });
    CHECK(seen == std::vector<double>{169.0});
    CHECK(total == 26.0);
    const double factor = 13.0 / (26.0 + 1e-6);
    check_close(a.grad(), {3.0 * factor, -4.0 * factor}, kF64);
    check_close(b.grad(), {12.0 * factor}, kF64);
  }
  SECTION("combine is called even when no gradient is defined") {
    int calls = 0;
    const double total = optim::clip_grad_norm_(params, 1.0, [&](double local) {
      ++calls;
      CHECK(local == 0.0);
      return 9.0;  // other ranks had gradients
    });
    CHECK(calls == 1);
    CHECK(total == 3.0);
  }
  SECTION("bf16 gradients are summed in f32") {
    // 301 x 0.5^2 = 75.25, which bf16 cannot hold (its spacing near 75 is 0.5): a sum
    // returned in bf16 would be off by 0.25, far beyond the tolerance.
    Variable h(zeros({301}, dtype(DType::bf16)), true);
    h.set_grad(full({301}, 0.5, dtype(DType::bf16)));
    CHECK(optim::clip_grad_norm_({h}, 100.0) == Approx(std::sqrt(75.25)).epsilon(1e-9));
  }
  SECTION("errors") {
    set_grads();
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, 0.0), "clip_grad_norm_: max_norm must be > 0, got 0");
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, -1.0), "clip_grad_norm_: max_norm must be > 0, got -1");
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, kNaN),
                       "clip_grad_norm_: max_norm must be > 0, got nan");
    CHECK_THROWS_ERROR(optim::clip_grad_norm_(params, 1.0, [](double) { return -2.0; }),
                       "clip_grad_norm_: combine returned a negative sum of squares -2");
    check_equal(a.grad(), {3.0, -4.0});
  }
}

}  // namespace
}  // namespace shardlab
