// tests/core/test_cuda_attention.cpp: fused attention on CUDA (core/cuda/attention.cu, and flash
// attention in bf16 and f16, core/cuda/flash_attention.cu) against the CPU kernel: outputs, logsumexp
// and the three gradients, causal and not, with padding (blind queries included), grouped-query
// heads, more keys than queries, head dims below and above a warp's width and flash's 64 and 128,
// in f32, f64, bf16 and f16; flash's bits the same every run; and the head dims it refuses.
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
  // In logsumexp's dtype: the operands' own, f32 for halves.
  const auto flat = [&](const Tensor& t) { return t.to(lse.dtype()).reshape({-1}); };
  return cat({flat(forward.out), flat(lse), flat(grads.q), flat(grads.k), flat(grads.v)}, 0);
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

// Flash attention's operands: B 2, H 4 over Hkv 2, T queries, S keys, q, k, v and grad_out D wide.
Inputs flash_operands(std::int64_t queries, std::int64_t keys, std::int64_t dim, DType dtype,
                      std::uint64_t seed) {
  return {random_tensor({2, 4, queries, dim}, seed, dtype), random_tensor({2, 2, keys, dim}, seed + 1, dtype),
          random_tensor({2, 2, keys, dim}, seed + 2, dtype),
          random_tensor({2, 4, queries, dim}, seed + 3, dtype)};
}

TEST_CASE("cuda matches cpu: flash attention in bf16 and f16, head dims 64 and 128, every mask, GQA",
          "[cuda-vs-cpu][attention]") {
  // The CPU computes in f32 from the same 16-bit operands and rounds once; on the GPU the
  // probabilities and dS also meet the tensor cores in 16 bits: a few units of the last place.
  for (const DType dtype : {DType::bf16, DType::f16}) {
    const test::Tolerance tolerance =
        dtype == DType::bf16 ? test::Tolerance{5e-2, 2e-2} : test::Tolerance{1e-2, 5e-3};
    for (const std::int64_t dim : {64, 128}) {
      for (const bool causal : {false, true}) {
        INFO(dtype_name(dtype) << ", head dim " << dim << (causal ? ", causal" : ""));
        const auto outputs = [&](const Inputs& x) { return attention_outputs(x, causal); };
        // T and S not multiples of the 64-row tiles; padding (blind queries too when T == S); more keys
        // than queries; three key tiles with the causal diagonal crossing them.
        test::compare_cuda_with_cpu(flash_operands(70, 70, dim, dtype, 41), outputs, tolerance);
        Inputs padded = flash_operands(70, 70, dim, dtype, 51);
        padded.push_back(padding_of(70));
        test::compare_cuda_with_cpu(padded, outputs, tolerance);
        Inputs wide = flash_operands(37, 70, dim, dtype, 61);
        wide.push_back(padding_of(70));
        test::compare_cuda_with_cpu(wide, outputs, tolerance);
        test::compare_cuda_with_cpu(flash_operands(150, 150, dim, dtype, 71), outputs, tolerance);
      }
    }
  }
}

TEST_CASE("flash attention gives the same bits every run", "[cuda][attention]") {
  const Inputs x = flash_operands(150, 150, 64, DType::bf16, 81);
  Inputs on_gpu;
  for (const Tensor& t : x) on_gpu.push_back(t.to(Device::cuda(0)));
  const Tensor first = attention_outputs(on_gpu, true).to(Device::cpu());
  CHECK(test::same_bits(attention_outputs(on_gpu, true), first));
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
