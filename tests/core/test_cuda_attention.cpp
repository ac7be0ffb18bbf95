// tests/core/test_cuda_attention.cpp: fused attention on CUDA (core/cuda/attention.cu) against the
// CPU kernel: outputs, logsumexp and the three gradients, causal and not, with padding (blind
// queries included), grouped-query heads, more keys than queries, head dims below and above a
// warp's width, in f32 and f64; and the head dims it refuses.
#include <cmath>
#include <limits>

#include "core/kernels.h"
#include "tests/cuda_compare.h"

namespace shardlab {
namespace {

using test::Inputs;
using test::random_tensor;

// Every output of forward and backward, flattened into one tensor; -inf logsumexp (a query that
// sees no key) as 0, so both sides compare as numbers. x: q, k, v, grad_out[, padding].
Tensor attention_outputs(const Inputs& x, bool causal) {
  const AttentionParams params{.causal = causal, .padding = x.size() > 4 ? x[4] : Tensor()};
  const AttentionResult forward = attention_forward(x[0], x[1], x[2], params);
  const AttentionGrads grads = attention_backward(x[3], x[0], x[1], x[2], forward, params);
  const Tensor lse = where(eq(forward.logsumexp, -std::numeric_limits<double>::infinity()),
                           zeros_like(forward.logsumexp), forward.logsumexp);
  return cat({forward.out.reshape({-1}), lse.reshape({-1}), grads.q.reshape({-1}), grads.k.reshape({-1}),
              grads.v.reshape({-1})},
             0);
}

// B 2, H 4 over Hkv 2, T queries, S keys, D 40 and Dv 24 (one lane's share above and below 32).
Inputs operands(std::int64_t queries, std::int64_t keys, DType dtype, std::uint64_t seed) {
  return {random_tensor({2, 4, queries, 40}, seed, dtype), random_tensor({2, 2, keys, 40}, seed + 1, dtype),
          random_tensor({2, 2, keys, 24}, seed + 2, dtype),
          random_tensor({2, 4, queries, 24}, seed + 3, dtype)};
}

// Row 0: its last 5 tokens padding; row 1: its first 3 (those queries see nothing when T == S).
Tensor padding_of(std::int64_t keys) {
  std::vector<std::uint8_t> flags(static_cast<std::size_t>(2 * keys), 0);
  for (std::int64_t s = keys - 5; s < keys; ++s) flags[static_cast<std::size_t>(s)] = 1;
  for (std::int64_t s = 0; s < 3; ++s) flags[static_cast<std::size_t>(keys + s)] = 1;
  return from_vector(flags, {2, keys}).to(DType::boolean);
}

TEST_CASE("cuda matches cpu: fused attention forward and backward, every mask, GQA, f32 and f64",
          "[cuda-vs-cpu][attention]") {
  for (const DType dtype : {DType::f32, DType::f64}) {
    const test::Tolerance tolerance =
        dtype == DType::f32 ? test::Tolerance{1e-5, 1e-4} : test::Tolerance{1e-12, 1e-10};
    for (const bool causal : {false, true}) {
      INFO(dtype_name(dtype) << (causal ? ", causal" : ""));
      test::compare_cuda_with_cpu(
          operands(70, 70, dtype, 11), [&](const Inputs& x) { return attention_outputs(x, causal); },
          tolerance);
      Inputs padded = operands(70, 70, dtype, 21);
      padded.push_back(padding_of(70));
      test::compare_cuda_with_cpu(
          padded, [&](const Inputs& x) { return attention_outputs(x, causal); }, tolerance);
      // More keys than queries (causal: top-left aligned, as PyTorch), padding keys only.
      Inputs wide = operands(37, 70, dtype, 31);
      wide.push_back(padding_of(70));
      test::compare_cuda_with_cpu(
          wide, [&](const Inputs& x) { return attention_outputs(x, causal); }, tolerance);
    }
  }
}

TEST_CASE("cuda attention refuses head dims beyond its warp rows, naming the shapes", "[cuda][attention]") {
  const Device gpu = Device::cuda(0);
  const Tensor q =
      zeros({1, 1, 2, 257}, TensorOptions{}.with_device(gpu));  // 8 values per lane of a warp at most
  CHECK_THROWS_ERROR(attention_forward(q, q, q),
                     "attention on cuda: head dims of at most 256 (q [1, 1, 2, 257]");
}

}  // namespace
}  // namespace shardlab
