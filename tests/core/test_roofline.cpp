// tests/core/test_roofline.cpp: the roofline's arithmetic on fixed rates, by hand (dense rates between
// and beyond the measured sizes, compute- and memory-bound dense calls, memory calls, the per-call time
// added or overlapped),
// its refusals, and a short measurement on the CPU whose rates are all there (positive, sizes ascending;
// their values are the machine's, not checked).
#include <cmath>

#include "core/roofline.h"
#include "tests/check.h"

namespace shardlab {
namespace {

DeviceRates fixed_rates() {
  return {.device = "test device",
          .dense = {{DType::f32, {{1e3, 1e9}, {1e6, 4e9}}}},
          .bytes_per_second = 1e9,
          .seconds_per_call = 1e-6};
}

}  // namespace

TEST_CASE("roofline: dense rates by size, and each call's time, by hand", "[roofline]") {
  const DeviceRates rates = fixed_rates();
  CHECK(dense_rate(rates, DType::f32, 1e2) == 1e9);  // below the smallest size: its rate
  CHECK(dense_rate(rates, DType::f32, 1e9) == 4e9);  // above the largest: its rate
  CHECK(dense_rate(rates, DType::f32, 1e3) == 1e9);
  // 10^4.5 lies halfway between 10^3 and 10^6 in log(flops): halfway between the rates.
  CHECK(std::abs(dense_rate(rates, DType::f32, std::pow(10.0, 4.5)) - 2.5e9) < 1.0);
  // A GEMM of 10^6 operations and 8000 bytes: 250 us of compute, 8 us of memory, 1 us per call.
  const KernelCost gemm{.op = "matmul", .dtype = DType::f32, .dense = true, .flops = 1e6, .bytes = 8e3};
  CHECK(std::abs(roofline_seconds(gemm, rates) - (2.5e-4 + 1e-6)) < 1e-15);
  // The same bytes but 10^7 of them: memory-bound, 10 ms.
  const KernelCost wide{.op = "matmul", .dtype = DType::f32, .dense = true, .flops = 1e3, .bytes = 1e7};
  CHECK(std::abs(roofline_seconds(wide, rates) - (1e-2 + 1e-6)) < 1e-15);
  // A memory kernel: its bytes only, whatever its dtype.
  const KernelCost added{.op = "add", .dtype = DType::f64, .flops = 1e9, .bytes = 3e6};
  CHECK(std::abs(roofline_seconds(added, rates) - (3e-3 + 1e-6)) < 1e-15);
}

TEST_CASE("roofline: where calls are queued ahead (a GPU), a call takes the longer of its issue and its work",
          "[roofline]") {
  DeviceRates rates = fixed_rates();
  rates.seconds_per_call = 5e-6;
  rates.calls_overlap = true;
  // 250 us of compute hide the 5 us issue; 8 bytes of an add (8 ns) do not: the 5 us.
  const KernelCost gemm{.op = "matmul", .dtype = DType::f32, .dense = true, .flops = 1e6, .bytes = 8e3};
  CHECK(std::abs(roofline_seconds(gemm, rates) - 2.5e-4) < 1e-15);
  CHECK(work_seconds(gemm, rates) == roofline_seconds(gemm, rates));
  const KernelCost tiny{.op = "add", .dtype = DType::f32, .bytes = 8};
  CHECK(roofline_seconds(tiny, rates) == 5e-6);
  // 100 calls of 300 us of work in all: 500 us of issue, the longer; 10 calls: the work's 300 us.
  CHECK(std::abs(with_calls(3e-4, 100, rates) - 5e-4) < 1e-15);
  CHECK(std::abs(with_calls(3e-4, 10, rates) - 3e-4) < 1e-15);
  rates.calls_overlap = false;  // the CPU: they add
  CHECK(std::abs(with_calls(3e-4, 10, rates) - 3.5e-4) < 1e-15);
}

TEST_CASE("roofline: rates that lack what a call needs are refused by name", "[roofline]") {
  const DeviceRates rates = fixed_rates();
  const KernelCost bf16_gemm{.op = "linear", .dtype = DType::bf16, .dense = true, .flops = 1e6, .bytes = 1e3};
  CHECK_THROWS_ERROR(roofline_seconds(bf16_gemm, rates),
                     "dense_rate: the rates of test device hold no dense rate for bf16");
  DeviceRates no_memory = rates;
  no_memory.bytes_per_second = 0;
  CHECK_THROWS_ERROR(roofline_seconds(KernelCost{.op = "add", .bytes = 1}, no_memory),
                     "roofline_seconds: the rates of test device hold no memory rate");
  CHECK_THROWS_ERROR(measure_rates(Device::cpu(), 0), "measure_rates: the budget must be positive, got 0 s");
}

TEST_CASE("roofline: a short measurement on the CPU gives every rate", "[roofline]") {
  const DeviceRates rates = measure_rates(Device::cpu(), 0.2);
  CHECK(rates.device.starts_with("cpu ("));
  for (const DType dtype : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dtype));
    REQUIRE(rates.dense.count(dtype) == 1);
    const std::vector<DenseRate>& sizes = rates.dense.at(dtype);
    REQUIRE(sizes.size() == 4);
    CHECK(sizes.front().flops == 2.0 * 64 * 64 * 64);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      CHECK(std::isfinite(sizes[i].per_second));
      CHECK(sizes[i].per_second > 0);
      if (i > 0) CHECK(sizes[i].flops > sizes[i - 1].flops);
    }
  }
  CHECK(std::isfinite(rates.bytes_per_second));
  CHECK(rates.bytes_per_second > 0);
  CHECK(rates.seconds_per_call > 0);
}

}  // namespace shardlab
