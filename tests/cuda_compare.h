// tests/cuda_compare.h: the CUDA-vs-CPU harness. One line registers a test case that runs an op on
// CPU inputs and, where a GPU answers, on their CUDA copies, and compares every output element
// (per-dtype tolerance, NaN-aware). Both halves must leave their inputs as they were: a case whose
// op writes into its inputs would compare runs that started from different values. The cases are
// tagged [cuda-vs-cpu], not [cuda]: their CPU half (the op, and the unchanged inputs) runs on every
// machine, CI's included; without a GPU tests/main.cpp says that only the CPU halves ran.
//
//   SHARDLAB_CUDA_VS_CPU("softmax [7, 13]", {random_tensor({7, 13}, 1)},
//                        [](const Inputs& x) { return softmax(x[0], -1); });
#pragma once

#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/cuda/runtime.h"
#include "tests/check.h"

namespace shardlab::test {

using Inputs = std::vector<Tensor>;
using CaseFn = std::function<Tensor(const Inputs&)>;

// Whether `tensor` holds the bits of `original` (NaNs included), element by element.
inline bool same_bits(const Tensor& tensor, const Tensor& original) {
  const Tensor a = tensor.to(Device::cpu()).contiguous(), b = original.contiguous();
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         (a.numel() == 0 ||  // an empty tensor's data may be null, which memcmp must not see
          std::memcmp(a.raw_data(), b.raw_data(), static_cast<std::size_t>(a.numel()) * a.element_size()) ==
              0);
}

inline void check_inputs_unchanged(const Inputs& inputs, const Inputs& originals, const char* side) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    INFO("the " << side << " half wrote into its input " << i << " (clone it before writing)");
    CHECK(same_bits(inputs[i], originals[i]));
  }
}

inline void compare_cuda_with_cpu(const Inputs& cpu_inputs, const CaseFn& fn,
                                  std::optional<Tolerance> tolerance = std::nullopt) {
  Inputs originals;
  for (const Tensor& t : cpu_inputs) originals.push_back(t.clone());
  const Tensor expected = fn(cpu_inputs);
  check_inputs_unchanged(cpu_inputs, originals, "CPU");
  if (!cuda::available()) return;
  Inputs cuda_inputs;
  for (const Tensor& t : cpu_inputs) cuda_inputs.push_back(t.to(Device::cuda(0)));
  const Tensor actual = fn(cuda_inputs);
  check_inputs_unchanged(cuda_inputs, originals, "CUDA");
  REQUIRE(actual.device() == Device::cuda(0));
  REQUIRE(actual.dtype() == expected.dtype());
  check_close(actual.to(Device::cpu()), expected, tolerance.value_or(default_tolerance(expected.dtype())));
}

}  // namespace shardlab::test

// SHARDLAB_CUDA_VS_CPU(name, inputs, fn [, tolerance])
#define SHARDLAB_CUDA_VS_CPU(name, ...)                   \
  TEST_CASE("cuda matches cpu: " name, "[cuda-vs-cpu]") { \
    ::shardlab::test::compare_cuda_with_cpu(__VA_ARGS__); \
  }
