// tests/optim/test_schedulers.cpp: StepLR, LinearLR, CosineAnnealingLR and SequentialLR against
// PyTorch's recursive (chainable) update rules, re-implemented here, on two parameter groups
// against the closed forms, and their argument errors.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "optim/scheduler.h"
#include "tests/check.h"

namespace shardlab {
namespace {

using Vec = std::vector<double>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The library uses closed forms; PyTorch's get_lr() computes each lr from the previous one.
// Agreeing with the recursion over many epochs checks both the formula and the epoch count.

Vec step_lr_recursive(double base, std::int64_t step_size, double gamma, int epochs) {
  Vec lr = {base};
  for (int e = 1; e < epochs; ++e) lr.push_back(e % step_size == 0 ? lr.back() * gamma : lr.back());
  return lr;
}

Vec linear_lr_recursive(double base, double start, double end, std::int64_t total, int epochs) {
  Vec lr = {base * start};
  for (int e = 1; e < epochs; ++e) {
    if (e > total) {
      lr.push_back(lr.back());
    } else {
      lr.push_back(lr.back() * (1 + (end - start) / (total * start + (e - 1) * (end - start))));
    }
  }
  return lr;
}

Vec cosine_recursive(double base, std::int64_t t_max, double eta_min, int epochs) {
  const double pi = std::numbers::pi;
  Vec lr = {base};
  for (int e = 1; e < epochs; ++e) {
    const double prev = lr.back();
    if ((e - 1 - t_max) % (2 * t_max) == 0) {
      lr.push_back(prev + (base - eta_min) * (1 - std::cos(pi / t_max)) / 2);
    } else {
      lr.push_back((1 + std::cos(pi * e / t_max)) / (1 + std::cos(pi * (e - 1) / t_max)) * (prev - eta_min) +
                   eta_min);
    }
  }
  return lr;
}

// Walks the schedule: the optimizer's lr at epoch e must be expected[e], and lr_at(e) with it.
void check_schedule(optim::LRScheduler& scheduler, const optim::Optimizer& opt, const Vec& expected) {
  Vec seen;
  for (std::size_t e = 0; e < expected.size(); ++e) {
    if (e > 0) scheduler.step();
    REQUIRE(scheduler.epoch() == static_cast<std::int64_t>(e));
    CHECK(scheduler.last_lr() == opt.lr());
    CHECK(scheduler.lr_at(static_cast<std::int64_t>(e), scheduler.base_lrs()[0]) == opt.lr());
    seen.push_back(opt.lr());
  }
  INFO("expected " << Catch::Detail::stringify(expected) << "\nseen " << Catch::Detail::stringify(seen));
  CHECK(test::count_mismatches(seen, expected, {1e-15, 1e-12}) == 0);
}

Variable parameter() { return Variable(from_vector<double>({1.0, -2.0}), true, "w"); }

TEST_CASE("StepLR: the FSDP tutorial's gamma 0.7 every epoch, and longer steps", "[optim][scheduler]") {
  SECTION("Adadelta(lr = 1), StepLR(step_size = 1, gamma = 0.7)") {
    optim::Adadelta opt({{"w", parameter()}}, {.lr = 1.0});
    optim::StepLR scheduler(opt, 1, 0.7);
    check_schedule(scheduler, opt, step_lr_recursive(1.0, 1, 0.7, 11));
    CHECK(opt.lr() == Approx(std::pow(0.7, 10)).epsilon(1e-12));
  }
  SECTION("step_size 3, default gamma 0.1") {
    optim::SGD opt({{"w", parameter()}}, {.lr = 0.5});
    optim::StepLR scheduler(opt, 3);
    CHECK(scheduler.gamma == 0.1);
    check_schedule(scheduler, opt, step_lr_recursive(0.5, 3, 0.1, 11));
  }
}

TEST_CASE("LinearLR: warm-up from start_factor to end_factor, then constant", "[optim][scheduler]") {
  SECTION("defaults: 1/3 to 1 over 5 epochs") {
    optim::SGD opt({{"w", parameter()}}, {.lr = 0.3});
    optim::LinearLR scheduler(opt);
    CHECK(opt.lr() == Approx(0.1).epsilon(1e-12));
    check_schedule(scheduler, opt, linear_lr_recursive(0.3, 1.0 / 3, 1.0, 5, 11));
  }
  SECTION("0.25 to 0.75 over 4 epochs") {
    optim::Adam opt({{"w", parameter()}}, {.lr = 0.02});
    optim::LinearLR scheduler(opt, 0.25, 0.75, 4);
    check_schedule(scheduler, opt, linear_lr_recursive(0.02, 0.25, 0.75, 4, 11));
  }
}

TEST_CASE("CosineAnnealingLR: half a cosine to eta_min, then back up", "[optim][scheduler]") {
  SECTION("t_max 10, eta_min 0") {
    optim::SGD opt({{"w", parameter()}}, {.lr = 0.1});
    optim::CosineAnnealingLR scheduler(opt, 10);
    check_schedule(scheduler, opt, cosine_recursive(0.1, 10, 0.0, 11));
    CHECK(opt.lr() == Approx(0.0).margin(1e-15));
  }
  SECTION("t_max 4, eta_min 0.01, past t_max") {
    optim::AdamW opt({{"w", parameter()}}, {.lr = 0.1});
    optim::CosineAnnealingLR scheduler(opt, 4, 0.01);
    check_schedule(scheduler, opt, cosine_recursive(0.1, 4, 0.01, 13));
  }
}

TEST_CASE("SequentialLR: linear warm-up then cosine, each from its own start", "[optim][scheduler]") {
  optim::SGD opt({{"w", parameter()}}, {.lr = 0.1});
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  parts.push_back(std::make_unique<optim::LinearLR>(opt, 0.1, 1.0, 3));
  // Created while the warm-up holds the lr at 0.01: its base must still be 0.1.
  parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, 7, 0.001));
  optim::SequentialLR scheduler(opt, std::move(parts), {3});

  Vec expected = linear_lr_recursive(0.1, 0.1, 1.0, 3, 3);
  for (double lr : cosine_recursive(0.1, 7, 0.001, 9)) expected.push_back(lr);
  check_schedule(scheduler, opt, expected);
}

TEST_CASE("set_epoch resumes a schedule where stepping would be", "[optim][scheduler]") {
  optim::SGD stepped({{"w", parameter()}}, {.lr = 0.1}), jumped({{"w", parameter()}}, {.lr = 0.1});
  auto schedule = [](optim::Optimizer& opt) {
    std::vector<std::unique_ptr<optim::LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::LinearLR>(opt, 0.1, 1.0, 3));
    parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, 7, 0.001));
    return optim::SequentialLR(opt, std::move(parts), {3});
  };
  optim::SequentialLR a = schedule(stepped), b = schedule(jumped);
  for (int i = 0; i < 5; ++i) a.step();
  b.set_epoch(5);
  CHECK(b.epoch() == 5);
  CHECK(jumped.lr() == stepped.lr());
  a.step();
  b.step();
  CHECK(jumped.lr() == stepped.lr());
  CHECK_THROWS_ERROR(b.set_epoch(-1), "LRScheduler: set_epoch needs an epoch >= 0, got -1");
}

TEST_CASE("SequentialLR: three parts and two milestones", "[optim][scheduler]") {
  optim::SGD opt({{"w", parameter()}}, {.lr = 1.0});
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  parts.push_back(std::make_unique<optim::LinearLR>(opt, 0.5, 1.0, 2));
  parts.push_back(std::make_unique<optim::StepLR>(opt, 1, 0.5));
  parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, 3));
  optim::SequentialLR scheduler(opt, std::move(parts), {2, 5});

  Vec expected = linear_lr_recursive(1.0, 0.5, 1.0, 2, 2);
  for (double lr : step_lr_recursive(1.0, 1, 0.5, 3)) expected.push_back(lr);
  for (double lr : cosine_recursive(1.0, 3, 0.0, 5)) expected.push_back(lr);
  check_schedule(scheduler, opt, expected);
}

TEST_CASE("schedulers scale every group from its own initial lr (closed forms)", "[optim][scheduler]") {
  const double pi = std::numbers::pi;
  const Vec bases = {0.1, 0.02};
  // A fresh two-group optimizer: group 1 overrides the lr.
  const auto two_groups = [] {
    return std::make_unique<optim::SGD>(
        std::vector<optim::ParamGroup>{{.parameters = {{"w", parameter()}}},
                                       {.parameters = {{"v", parameter()}}, .lr = 0.02}},
        optim::SGDOptions{.lr = 0.1});
  };
  // Walks 12 epochs: each group's lr must be closed_form(epoch, its base).
  const auto check = [&](optim::LRScheduler& scheduler, const optim::Optimizer& opt,
                         const std::function<double(double, double)>& closed_form) {
    CHECK(scheduler.base_lrs() == bases);
    for (int e = 0; e < 12; ++e) {
      if (e > 0) scheduler.step();
      for (std::size_t g = 0; g < 2; ++g) {
        INFO("epoch " << e << " group " << g);
        CHECK(opt.lr(g) == Approx(closed_form(e, bases[g])).epsilon(1e-12).margin(1e-15));
        CHECK(scheduler.last_lr(g) == opt.lr(g));
      }
    }
  };

  SECTION("StepLR") {
    const auto opt = two_groups();
    optim::StepLR scheduler(*opt, 3, 0.5);
    check(scheduler, *opt, [](double e, double base) { return base * std::pow(0.5, std::floor(e / 3)); });
  }
  SECTION("LinearLR") {
    const auto opt = two_groups();
    optim::LinearLR scheduler(*opt, 0.25, 0.75, 4);
    check(scheduler, *opt, [](double e, double base) { return base * (0.25 + 0.5 * std::min(e, 4.0) / 4); });
  }
  SECTION("CosineAnnealingLR with eta_min") {
    const auto opt = two_groups();
    optim::CosineAnnealingLR scheduler(*opt, 5, 0.01);
    check(scheduler, *opt,
          [&](double e, double base) { return 0.01 + (base - 0.01) * (1 + std::cos(pi * e / 5)) / 2; });
  }
  SECTION("SequentialLR: warm-up, then cosine from the original lrs") {
    const auto opt = two_groups();
    std::vector<std::unique_ptr<optim::LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::LinearLR>(*opt, 0.1, 1.0, 3));
    parts.push_back(std::make_unique<optim::CosineAnnealingLR>(*opt, 6));
    optim::SequentialLR scheduler(*opt, std::move(parts), {3});
    check(scheduler, *opt, [&](double e, double base) {
      return e < 3 ? base * (0.1 + 0.9 * e / 3) : base * (1 + std::cos(pi * (e - 3) / 6)) / 2;
    });
  }
}

TEST_CASE("the groups' initial lrs travel in the optimizer's state dict", "[optim][scheduler]") {
  optim::SGD opt({{.parameters = {{"w", parameter()}}}, {.parameters = {{"v", parameter()}}, .lr = 0.02}},
                 {.lr = 0.1});
  std::vector<std::string> keys;
  for (const auto& [key, tensor] : opt.state_dict()) keys.push_back(key);
  CHECK(std::count(keys.begin(), keys.end(), "param_groups.0.initial_lr") == 0);

  optim::StepLR scheduler(opt, 1, 0.5);
  scheduler.step();
  const nn::StateDict saved = opt.state_dict();
  std::map<std::string, double> group_values;
  for (const auto& [key, tensor] : saved) {
    if (key.starts_with("param_groups.")) group_values[key] = tensor.item<double>();
  }
  CHECK(group_values.at("param_groups.0.initial_lr") == 0.1);
  CHECK(group_values.at("param_groups.1.initial_lr") == 0.02);
  CHECK(group_values.at("param_groups.0.lr") == 0.05);
  CHECK(group_values.at("param_groups.1.lr") == 0.01);

  // A resumed optimizer's first scheduler starts from the loaded initial lrs, not the current lrs.
  optim::SGD resumed({{.parameters = {{"w", parameter()}}}, {.parameters = {{"v", parameter()}}}},
                     {.lr = 1.0});
  resumed.load_state_dict(saved);
  optim::StepLR continued(resumed, 1, 0.5);
  CHECK(continued.base_lrs() == Vec{0.1, 0.02});
}

TEST_CASE("schedulers drive the optimizer's update", "[optim][scheduler]") {
  Variable w(from_vector<double>({1.0}), true, "w");
  optim::SGD opt({{"w", w}}, {.lr = 1.0});
  optim::StepLR scheduler(opt, 1, 0.5);
  for (int epoch = 0; epoch < 4; ++epoch) {
    w.set_grad(from_vector<double>({1.0}));
    opt.step();
    scheduler.step();
  }
  // Steps of 1, 0.5, 0.25 and 0.125 times the gradient 1.
  test::check_equal(w.data(), {1.0 - 1.875});
}

TEST_CASE("schedulers reject bad arguments", "[optim][scheduler]") {
  optim::SGD opt({{"w", parameter()}}, {.lr = 0.1});
  CHECK_THROWS_ERROR(optim::StepLR(opt, 0), "StepLR: step_size must be >= 1, got 0");
  CHECK_THROWS_ERROR(optim::StepLR(opt, 1, 0.0), "StepLR: gamma must be > 0, got 0");
  CHECK_THROWS_ERROR(optim::StepLR(opt, 1, kNaN), "StepLR: gamma must be > 0, got nan");
  CHECK_THROWS_ERROR(optim::LinearLR(opt, 0.0), "LinearLR: start_factor must be in (0, 1], got 0");
  CHECK_THROWS_ERROR(optim::LinearLR(opt, 1.5), "LinearLR: start_factor must be in (0, 1], got 1.5");
  CHECK_THROWS_ERROR(optim::LinearLR(opt, 0.5, -0.1), "LinearLR: end_factor must be in [0, 1], got -0.1");
  CHECK_THROWS_ERROR(optim::LinearLR(opt, 0.5, 2.0), "LinearLR: end_factor must be in [0, 1], got 2");
  CHECK_THROWS_ERROR(optim::LinearLR(opt, 0.5, 1.0, 0), "LinearLR: total_iters must be >= 1, got 0");
  CHECK_THROWS_ERROR(optim::CosineAnnealingLR(opt, 0), "CosineAnnealingLR: t_max must be >= 1, got 0");
  CHECK_THROWS_ERROR(optim::CosineAnnealingLR(opt, 5, -0.01),
                     "CosineAnnealingLR: eta_min must be >= 0, got -0.01");
  CHECK(opt.lr() == 0.1);

  const auto two_parts = [&](optim::Optimizer& second_optimizer) {
    std::vector<std::unique_ptr<optim::LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::LinearLR>(opt));
    parts.push_back(std::make_unique<optim::StepLR>(second_optimizer, 2));
    return parts;
  };
  CHECK_THROWS_ERROR(optim::SequentialLR(opt, {}, {}), "SequentialLR: needs at least one scheduler");
  {
    std::vector<std::unique_ptr<optim::LRScheduler>> parts;
    parts.push_back(std::make_unique<optim::StepLR>(opt, 2));
    parts.push_back(nullptr);
    CHECK_THROWS_ERROR(optim::SequentialLR(opt, std::move(parts), {3}), "SequentialLR: scheduler 1 is null");
  }
  optim::SGD other({{"w", parameter()}}, {.lr = 0.1});
  CHECK_THROWS_ERROR(optim::SequentialLR(opt, two_parts(other), {3}),
                     "SequentialLR: scheduler 1 drives another optimizer than the SequentialLR");
  CHECK_THROWS_ERROR(optim::SequentialLR(opt, two_parts(opt), {}),
                     "SequentialLR: 2 schedulers need 1 milestones, got 0");
  CHECK_THROWS_ERROR(optim::SequentialLR(opt, two_parts(opt), {2, 4}),
                     "SequentialLR: 2 schedulers need 1 milestones, got 2");
  CHECK_THROWS_ERROR(optim::SequentialLR(opt, two_parts(opt), {0}),
                     "SequentialLR: milestones must be >= 1, got 0");
  {
    std::vector<std::unique_ptr<optim::LRScheduler>> parts = two_parts(opt);
    parts.push_back(std::make_unique<optim::StepLR>(opt, 2));
    CHECK_THROWS_ERROR(optim::SequentialLR(opt, std::move(parts), {4, 4}),
                       "SequentialLR: milestones must be strictly increasing, got 4 after 4");
  }
}

}  // namespace
}  // namespace shardlab
