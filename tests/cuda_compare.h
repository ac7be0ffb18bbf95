// tests/cuda_compare.h: the CUDA-vs-CPU harness. One line registers a [cuda] test case that
// runs an op on CPU inputs and on their CUDA copies and compares every output element
// (per-dtype tolerance, NaN-aware). Without a GPU the case is reported as skipped.
//
//   SHARDLAB_CUDA_VS_CPU("softmax [7, 13]", {random_tensor({7, 13}, 1)},
//                        [](const Inputs& x) { return softmax(x[0], -1); });
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "tests/check.h"

namespace shardlab::test {

using Inputs = std::vector<Tensor>;
using CaseFn = std::function<Tensor(const Inputs&)>;

inline void compare_cuda_with_cpu(const Inputs& cpu_inputs, const CaseFn& fn,
                                  std::optional<Tolerance> tolerance = std::nullopt) {
  Inputs cuda_inputs;
  for (const Tensor& t : cpu_inputs) cuda_inputs.push_back(t.to(Device::cuda(0)));
  const Tensor expected = fn(cpu_inputs);
  const Tensor actual = fn(cuda_inputs);
  REQUIRE(actual.device() == Device::cuda(0));
  REQUIRE(actual.dtype() == expected.dtype());
  check_close(actual.to(Device::cpu()), expected, tolerance.value_or(default_tolerance(expected.dtype())));
}

}  // namespace shardlab::test

// SHARDLAB_CUDA_VS_CPU(name, inputs, fn [, tolerance])
#define SHARDLAB_CUDA_VS_CPU(name, ...) \
  TEST_CASE("cuda matches cpu: " name, "[cuda]") { ::shardlab::test::compare_cuda_with_cpu(__VA_ARGS__); }
