// core/roofline.cpp: measured device rates and roofline times (core/roofline.h).
#include "core/roofline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <utility>

#include "core/call_log.h"
#include "core/cpu/isa.h"
#include "core/cuda/runtime.h"
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

// The cost of `work`'s call of `op`, by kernel_cost's rule (the one the roofline divides by the rates).
KernelCost cost_of(const char* op, const std::function<void()>& work) {
  for (const call_log::Call& call : call_log::calls_of(work))
    if (call.op == op) return kernel_cost(call);
  throw Error(fmt::format("measure_rates: {} logged no call of its kernel", op));
}

// Causal attention forward and backward over the same pairs with heads of 64 and of 128 per dtype (the
// sizes Llamas use: fitted there, the line between them is exact where most models run):
// t = pairs s + flops / r at both gives s and r (a noisy difference kept physical: s and 1 / r not
// negative). Each call's pairs and flops are counted by kernel_cost's rule, the one the roofline uses.
void measure_attention(Device device, const std::vector<DType>& dtypes, double budget, DeviceRates& rates) {
  const std::vector<std::int64_t> head_dims = {64, 128};
  // On a GPU, enough (sequence, head, query block) tiles to fill every multiprocessor, as a training
  // batch does: one sequence of 8 heads leaves most of them idle and reads as a slower kernel.
  const std::int64_t batch = device.is_cuda() ? 4 : 1, tokens = device.is_cuda() ? 1024 : 256;
  const double per_call = budget / static_cast<double>(2 * head_dims.size() * dtypes.size());
  const AttentionParams causal{.causal = true};
  for (const DType dtype : dtypes) {
    std::map<std::string, std::vector<std::pair<KernelCost, double>>> timed;  // per op, per head dim
    for (const std::int64_t d : head_dims) {
      const Tensor q = random_on(device, {batch, 8, tokens, d}, dtype, 6),
                   k = random_on(device, {batch, 2, tokens, d}, dtype, 7),
                   v = random_on(device, {batch, 2, tokens, d}, dtype, 8),
                   grad = random_on(device, {batch, 8, tokens, d}, dtype, 9);
      const AttentionResult forward = attention_forward(q, k, v, causal);
      const auto run_forward = [&] { return attention_forward(q, k, v, causal).out; };
      const auto run_backward = [&] { return attention_backward(grad, q, k, v, forward, causal).q; };
      timed["attention_forward"].emplace_back(cost_of("attention_forward", [&] { (void)run_forward(); }),
                                              seconds_per_call_of(device, run_forward, per_call));
      timed["attention_backward"].emplace_back(cost_of("attention_backward", [&] { (void)run_backward(); }),
                                               seconds_per_call_of(device, run_backward, per_call));
    }
    for (const auto& [op, calls] : timed) {
      const auto& [narrow, narrow_seconds] = calls.front();
      const auto& [wide, wide_seconds] = calls.back();
      const double per_flop = std::max(0.0, (wide_seconds - narrow_seconds) / (wide.flops - narrow.flops));
      const double per_pair = std::max(0.0, (narrow_seconds - narrow.flops * per_flop) / narrow.pairs);
      rates.attention[op][dtype] = {per_pair, per_flop > 0 ? 1 / per_flop : wide.flops / wide_seconds};
    }
  }
}

// The convolutions of a small image net at three sizes, each op's calls counted by kernel_cost's rule.
void measure_convolutions(Device device, const std::vector<DType>& dtypes, double budget,
                          DeviceRates& rates) {
  struct Layer {
    std::int64_t in, out, size;
  };
  const std::vector<Layer> layers = {{1, 32, 28}, {32, 64, 28}, {64, 128, 14}};
  const double per_call = budget / static_cast<double>(3 * layers.size() * dtypes.size());
  for (const DType dtype : dtypes) {
    for (const Layer& layer : layers) {
      const Shape input_shape = {8, layer.in, layer.size, layer.size},
                  weight_shape = {layer.out, layer.in, 3, 3};
      const Tensor input = random_on(device, input_shape, dtype, 10),
                   weight = random_on(device, weight_shape, dtype, 11);
      const Tensor grad = random_on(device, {8, layer.out, layer.size - 2, layer.size - 2}, dtype, 12);
      const std::vector<std::pair<const char*, std::function<Tensor()>>> ops = {
          {"conv2d", [&] { return conv2d(input, weight); }},
          {"conv2d_backward_input", [&] { return conv2d_backward_input(grad, weight, input_shape); }},
          {"conv2d_backward_weight", [&] { return conv2d_backward_weight(grad, input, weight_shape); }}};
      for (const auto& op : ops) {  // clang before 16 captures no structured binding
        const std::function<Tensor()>& run = op.second;
        const double flops = cost_of(op.first, [&] { (void)run(); }).flops;
        rates.kernels[op.first][dtype].push_back({flops, flops / seconds_per_call_of(device, run, per_call)});
      }
    }
    for (auto& [op, table] : rates.kernels) {
      std::sort(table[dtype].begin(), table[dtype].end(),
                [](const DenseRate& a, const DenseRate& b) { return a.flops < b.flops; });
    }
  }
}

// 16 MiB from pinned host memory to the GPU and back, each direction half the budget.
void measure_host_link(Device device, double budget, DeviceRates& rates) {
  constexpr std::int64_t kElements = std::int64_t{4} << 20;
  constexpr double kBytes = 4.0 * kElements;
  Tensor pinned = random_on(Device::cpu(), {kElements}, DType::f32, 13).pin_memory();
  const Tensor on_device = pinned.to(device);
  rates.host_to_device_bytes_per_second = kBytes / seconds_per_call_of(
                                                       device, [&] { return pinned.to(device); }, budget / 2);
  rates.device_to_host_bytes_per_second =
      kBytes / seconds_per_call_of(
                   device,
                   [&] {
                     cuda::copy_bytes(pinned.raw_data(), false, on_device.raw_data(), true,
                                      static_cast<std::size_t>(kBytes), device.index);
                     return on_device;
                   },
                   budget / 2);
}

}  // namespace

double attention_seconds(const KernelCost& cost, const DeviceRates& rates) {
  if (const auto op = rates.attention.find(cost.op); op != rates.attention.end()) {
    if (const auto rate = op->second.find(cost.dtype); rate != op->second.end())
      return cost.pairs * rate->second.seconds_per_pair + cost.flops / rate->second.flops_per_second;
  }
  return cost.flops / dense_rate(rates, cost.dtype, cost.flops);  // not measured apart: a GEMM's rate
}

std::string describe_device(Device device) {
  if (device.is_cuda()) return device.str();
  const int threads = num_threads();
  return fmt::format("cpu ({}), {} thread{}", cpu::isa_name(cpu::kernel_isa()), threads,
                     threads == 1 ? "" : "s");
}

double dense_rate(const DeviceRates& rates, DType dtype, double flops, const std::string& op) {
  const auto own = rates.kernels.find(op);
  const bool apart = own != rates.kernels.end() && own->second.count(dtype) == 1;
  const DenseRates& table = apart ? own->second : rates.dense;
  const auto found = table.find(dtype);
  SHARDLAB_CHECK(found != table.end() && !found->second.empty(),
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

double work_seconds(const KernelCost& cost, const DeviceRates& rates) {
  SHARDLAB_CHECK(rates.bytes_per_second > 0, "roofline_seconds: the rates of {} hold no memory rate",
                 rates.device);
  const double memory = cost.bytes / rates.bytes_per_second;
  const double compute = !cost.dense      ? 0
                         : cost.pairs > 0 ? attention_seconds(cost, rates)
                                          : cost.flops / dense_rate(rates, cost.dtype, cost.flops, cost.op);
  return std::max(compute, memory);
}

double with_calls(double work, double calls, const DeviceRates& rates) {
  const double issue = calls * rates.seconds_per_call;
  return rates.calls_overlap ? std::max(work, issue) : work + issue;
}

double roofline_seconds(const KernelCost& cost, const DeviceRates& rates) {
  return with_calls(work_seconds(cost, rates), 1, rates);
}

DeviceRates with_assumed_rates(DeviceRates measured, const AssumedRates& assumed) {
  std::string said;
  const auto check = [](const std::optional<double>& rate, const char* what) {
    SHARDLAB_CHECK(!rate || *rate > 0, "with_assumed_rates: {} must be positive, got {}", what, *rate);
  };
  check(assumed.dense_flops_per_second, "the dense rate");
  check(assumed.bytes_per_second, "the memory rate");
  SHARDLAB_CHECK(!assumed.seconds_per_call || *assumed.seconds_per_call >= 0,
                 "with_assumed_rates: the time a call must not be negative, got {}",
                 *assumed.seconds_per_call);
  if (assumed.dense_flops_per_second) {
    measured.kernels.clear();
    measured.attention.clear();
    for (const DType dtype : {DType::f32, DType::bf16, DType::f16})
      measured.dense[dtype] = {{.flops = 1, .per_second = *assumed.dense_flops_per_second}};
    said += fmt::format("dense {:g} TFLOP/s", 1e-12 * *assumed.dense_flops_per_second);
  }
  if (assumed.bytes_per_second) {
    measured.bytes_per_second = *assumed.bytes_per_second;
    said += fmt::format("{}memory {:g} GB/s", said.empty() ? "" : ", ", 1e-9 * *assumed.bytes_per_second);
  }
  if (assumed.seconds_per_call) {
    measured.seconds_per_call = *assumed.seconds_per_call;
    said += fmt::format("{}{:g} us a call", said.empty() ? "" : ", ", 1e6 * *assumed.seconds_per_call);
  }
  if (!said.empty()) measured.device += fmt::format(" with assumed {}", said);
  return measured;
}

DeviceRates measure_rates(Device device, double budget_seconds) {
  SHARDLAB_CHECK(budget_seconds > 0, "measure_rates: the budget must be positive, got {} s", budget_seconds);
  DeviceRates rates{.device = describe_device(device), .calls_overlap = device.is_cuda()};
  const std::vector<std::int64_t> rows = device.is_cuda()
                                             ? std::vector<std::int64_t>{256, 512, 1024, 2048, 4096}
                                             : std::vector<std::int64_t>{64, 128, 256, 512};
  const std::vector<DType> dtypes = {DType::f32, DType::bf16};
  // A third of the budget to the GEMMs, a sixth to attention, a third to convolutions, the rest to the
  // memory rate and the call time.
  const double per_size = 0.3 * budget_seconds / static_cast<double>(rows.size() * dtypes.size());
  for (const DType dtype : dtypes) {
    for (const std::int64_t n : rows) {
      // A training step's GEMMs in equal parts, as a Linear makes them: x W^T forward, g W and g^T x
      // backward (the transposed operands read through their strides).
      const Tensor a = random_on(device, {n, n}, dtype, 1), b = random_on(device, {n, n}, dtype, 2);
      const double seconds = seconds_per_call_of(
                                 device, [&] { return matmul(a, b.transpose(0, 1)); }, per_size / 3) +
                             seconds_per_call_of(
                                 device, [&] { return matmul(a, b); }, per_size / 3) +
                             seconds_per_call_of(
                                 device, [&] { return matmul(a.transpose(0, 1), b); }, per_size / 3);
      const double flops = 2.0 * static_cast<double>(n * n * n);
      rates.dense[dtype].push_back({flops, 3 * flops / seconds});
    }
  }
  measure_attention(device, dtypes, 0.17 * budget_seconds, rates);
  measure_convolutions(device, dtypes, 0.33 * budget_seconds, rates);
  const std::int64_t large = std::int64_t{device.is_cuda() ? 64 : 4} << 20;
  const Tensor x = random_on(device, {large}, DType::f32, 3), y = random_on(device, {large}, DType::f32, 4);
  rates.bytes_per_second = 3.0 * static_cast<double>(large) * 4 /
                           seconds_per_call_of(
                               device, [&] { return add(x, y); }, 0.1 * budget_seconds);
  const Tensor small = random_on(device, {16}, DType::f32, 5);
  rates.seconds_per_call = seconds_per_call_of(
      device, [&] { return add(small, small); }, 0.1 * budget_seconds);
  if (device.is_cuda()) measure_host_link(device, 0.1 * budget_seconds, rates);
  return rates;
}

}  // namespace shardlab
