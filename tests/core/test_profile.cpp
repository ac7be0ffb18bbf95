// tests/core/test_profile.cpp: the kernel profiler: nothing while off; while on, each kernel call counted
// once under its op's name (the outermost only), its time inside the wall time around it.
#include <chrono>
#include <cmath>
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

TEST_CASE("each op falls in one category of a step, collectives and unknown names included", "[profile]") {
  CHECK(profile::category_of("matmul") == "GEMM");
  CHECK(profile::category_of("conv2d_backward_weight") == "GEMM");
  CHECK(profile::category_of("attention_backward") == "attention");
  CHECK(profile::category_of("rms_norm_backward") == "reductions");
  CHECK(profile::category_of("sum") == "reductions");
  CHECK(profile::category_of("cross_entropy") == "reductions");
  CHECK(profile::category_of("embedding_backward") == "indexing");
  CHECK(profile::category_of("adam_step") == "optimizer");
  CHECK(profile::category_of("swiglu") == "elementwise");
  CHECK(profile::category_of("cast") == "elementwise");
  CHECK(profile::category_of("nccl reduce_scatter") == "communication");
  CHECK(profile::category_of("a kernel nobody named") == "other");
}

TEST_CASE("a step's time by category: device time where measured, and the host gaps left", "[profile]") {
  // 10 ms steps: 4 ms of GEMM on the GPU (launched in 0.5 ms), 1 + 0.5 ms of elementwise ops (one
  // measured on the CPU only), 3 ms of a collective overlapping them: 4.5 ms no compute covers.
  const std::vector<profile::OpTotal> totals = {
      {.op = "matmul", .calls = 3, .seconds = 0.0005, .device_seconds = 0.004},
      {.op = "add", .calls = 2, .seconds = 0.0002, .device_seconds = 0.001},
      {.op = "copy", .calls = 1, .seconds = 0.0005, .device_seconds = 0},
      {.op = "nccl all_gather", .calls = 1, .seconds = 0, .device_seconds = 0.003}};
  const std::vector<profile::CategoryTotal> split = profile::by_category(totals, 0.010);
  REQUIRE(split.size() == 4);
  CHECK(split[0].category == "GEMM");
  CHECK(std::abs(split[0].seconds - 0.004) < 1e-12);
  CHECK(split[1].category == "communication");
  CHECK(std::abs(split[1].seconds - 0.003) < 1e-12);
  CHECK(split[2].category == "elementwise");
  CHECK(std::abs(split[2].seconds - 0.0015) < 1e-12);
  CHECK(split[3].category == "host gaps");
  CHECK(std::abs(split[3].seconds - 0.0045) < 1e-12);
  // Kernels longer than the steps (timed on several streams) leave no negative gap.
  CHECK(profile::by_category({{.op = "matmul", .calls = 1, .seconds = 0.002, .device_seconds = 0.02}}, 0.010)
            .back()
            .seconds == 0.0);
}
