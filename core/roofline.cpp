// core/roofline.cpp: measured device rates and roofline times (core/roofline.h).
#include "core/roofline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>

#include "core/cpu/isa.h"
#include "core/error.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/random.h"

namespace shardlab {
namespace {

// Seconds per call of `work` on `device`: one call first (caches, the allocator's blocks, kernels
// loaded), then calls until `budget` seconds have passed (at least two), the device waited for after.
double seconds_per_call_of(Device device, const std::function<Tensor()>& work, double budget) {
  const auto wait = [&](const Tensor& made) {
    if (device.is_cuda()) (void)made.reshape({-1}).narrow(0, 0, 1).to(Device::cpu());
  };
  wait(work());
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  Tensor last;
  int calls = 0;
  do {
    last = work();
    ++calls;
  } while (calls < 2 || elapsed() < budget);
  wait(last);
  return elapsed() / calls;
}

Tensor random_on(Device device, const Shape& shape, DType dtype, std::uint64_t seed) {
  return uniform(shape, RandomKey{seed, 7}, -1.0, 1.0, TensorOptions{dtype, device});
}

std::string describe(Device device) {
  if (device.is_cuda()) return device.str();
  const int threads = num_threads();
  return fmt::format("cpu ({}), {} thread{}", cpu::isa_name(cpu::kernel_isa()), threads,
                     threads == 1 ? "" : "s");
}

}  // namespace

double dense_rate(const DeviceRates& rates, DType dtype, double flops) {
  const auto found = rates.dense.find(dtype);
  SHARDLAB_CHECK(found != rates.dense.end() && !found->second.empty(),
                 "dense_rate: the rates of {} hold no dense rate for {}", rates.device, dtype_name(dtype));
  const std::vector<DenseRate>& sizes = found->second;
  if (flops <= sizes.front().flops) return sizes.front().per_second;
  if (flops >= sizes.back().flops) return sizes.back().per_second;
  const auto above =
      std::find_if(sizes.begin(), sizes.end(), [&](const DenseRate& s) { return s.flops > flops; });
  const DenseRate &high = *above, &low = *(above - 1);
  const double t = std::log(flops / low.flops) / std::log(high.flops / low.flops);
  return low.per_second + t * (high.per_second - low.per_second);
}

double roofline_seconds(const KernelCost& cost, const DeviceRates& rates) {
  SHARDLAB_CHECK(rates.bytes_per_second > 0, "roofline_seconds: the rates of {} hold no memory rate",
                 rates.device);
  const double memory = cost.bytes / rates.bytes_per_second;
  const double compute = cost.dense ? cost.flops / dense_rate(rates, cost.dtype, cost.flops) : 0;
  return std::max(compute, memory) + rates.seconds_per_call;
}

DeviceRates measure_rates(Device device, double budget_seconds) {
  SHARDLAB_CHECK(budget_seconds > 0, "measure_rates: the budget must be positive, got {} s", budget_seconds);
  DeviceRates rates{.device = describe(device)};
  const std::vector<std::int64_t> rows = {64, 128, 256, 512};
  const std::vector<DType> dtypes = {DType::f32, DType::bf16};
  // Most of the budget to the dense sizes, a tenth each to the memory rate and the call time.
  const double per_size = 0.8 * budget_seconds / static_cast<double>(rows.size() * dtypes.size());
  for (const DType dtype : dtypes) {
    for (const std::int64_t n : rows) {
      const Tensor a = random_on(device, {n, n}, dtype, 1), b = random_on(device, {n, n}, dtype, 2);
      const double seconds = seconds_per_call_of(
          device, [&] { return matmul(a, b); }, per_size);
      const double flops = 2.0 * static_cast<double>(n * n * n);
      rates.dense[dtype].push_back({flops, flops / seconds});
    }
  }
  constexpr std::int64_t kLarge = std::int64_t{4} << 20;
  const Tensor x = random_on(device, {kLarge}, DType::f32, 3), y = random_on(device, {kLarge}, DType::f32, 4);
  const double large = seconds_per_call_of(
      device, [&] { return add(x, y); }, 0.1 * budget_seconds);
  rates.bytes_per_second = 3.0 * kLarge * 4 / large;
  const Tensor small = random_on(device, {16}, DType::f32, 5);
  rates.seconds_per_call = seconds_per_call_of(
      device, [&] { return add(small, small); }, 0.1 * budget_seconds);
  return rates;
}

}  // namespace shardlab
