// tests/core/test_profile.cpp: the kernel profiler: nothing while off; while on, each kernel call counted
// once under its op's name (the outermost only), its time inside the wall time around it.
#include <chrono>
#include <thread>

#include "core/ops.h"
#include "core/profile.h"
#include "core/tensor.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

const profile::OpTotal* find(const std::vector<profile::OpTotal>& totals, const std::string& op) {
  for (const profile::OpTotal& total : totals)
    if (total.op == op) return &total;
  return nullptr;
}

}  // namespace

TEST_CASE("the profiler counts each kernel call once under its op, and nothing while off", "[profile]") {
  const Tensor a = ones({64, 64}), b = ones({64, 64});
  profile::start();
  profile::stop();
  (void)matmul(a, b);
  CHECK(profile::totals().empty());

  profile::start();
  const auto began = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) (void)matmul(a, b);
  (void)add(a, b);
  (void)a.to(DType::f64);  // a copy kernel under the name "cast"
  zeros({10}).fill_(2.0);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  profile::stop();
  (void)add(a, b);  // after stop: not counted
  const std::vector<profile::OpTotal> totals = profile::totals();
  const profile::OpTotal* mm = find(totals, "matmul");
  REQUIRE(mm != nullptr);
  CHECK(mm->calls == 3);
  REQUIRE(find(totals, "add") != nullptr);
  CHECK(find(totals, "add")->calls == 1);
  REQUIRE(find(totals, "cast") != nullptr);
  CHECK(find(totals, "cast")->calls == 1);
  REQUIRE(find(totals, "fill") != nullptr);
  double sum = 0;
  for (const profile::OpTotal& total : totals) {
    CHECK(total.seconds >= 0);
    sum += total.seconds;
  }
  CHECK(sum <= wall);
  for (std::size_t i = 1; i < totals.size(); ++i) CHECK(totals[i - 1].seconds >= totals[i].seconds);

  // resume() keeps the totals; start() clears them.
  profile::resume();
  (void)matmul(a, b);
  profile::stop();
  CHECK(find(profile::totals(), "matmul")->calls == 4);
  profile::start();
  profile::stop();
  CHECK(profile::totals().empty());
}

TEST_CASE("a kernel timed inside another is counted in the outer one only", "[profile]") {
  profile::start();
  {
    const profile::KernelTimer outer("outer");
    const profile::KernelTimer inner("inner");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  { const profile::KernelTimer after("after"); }  // the nesting depth went back to 0
  profile::stop();
  const std::vector<profile::OpTotal> totals = profile::totals();
  REQUIRE(totals.size() == 2);
  CHECK(totals[0].op == "outer");
  CHECK(totals[0].seconds >= 0.002);
  CHECK(totals[1].op == "after");
}
