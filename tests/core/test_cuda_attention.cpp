// tests/core/test_cuda_attention.cpp: fused attention on CUDA (core/cuda/attention.cu, and flash
// attention in bf16 and f16, core/cuda/flash_attention.cu) against the CPU kernel: outputs, logsumexp
// and the three gradients, causal and not, with padding (blind queries included), documents,
// grouped-query heads, more keys than queries, head dims below and above a warp's width and flash's 64
// and 128,
// in f32, f64, bf16 and f16; q, k and v split from projections and read where they lie; flash's bits
// the same every run; every gradient element written by the backward kernels, on either device; and
// the head dims it refuses.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/kernels.h"
#include "tests/cuda_compare.h"

namespace shardlab {
namespace {

using test::Inputs;
using test::random_tensor;

// Every output of forward and backward, flattened into one tensor; -inf logsumexp (a query that
// sees no key) as 0, so both sides compare as numbers. x: q, k, v, grad_out[, padding[, documents]].
Tensor attention_outputs(const Inputs& x, bool causal) {
  const AttentionParams params{.causal = causal,
                               .padding = x.size() > 4 ? x[4] : Tensor(),
                               .documents = x.size() > 5 ? x[5] : Tensor()};
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

// i64 [2, length]: row 0 documents of 20 tokens, 45 and the rest; row 1 of 64 (a boundary on the
// 64-row tile's edge) and the rest.
Tensor documents_of(std::int64_t length) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(2 * length));
  for (std::int64_t t = 0; t < length; ++t) {
    ids[static_cast<std::size_t>(t)] = t < 20 ? 0 : t < 65 ? 1 : 2;
    ids[static_cast<std::size_t>(length + t)] = t < 64 ? 0 : 1;
  }
  return from_vector<std::int64_t>(ids, {2, length});
}

// Operands with padding_of's padding and documents_of's documents.
Inputs with_documents(Inputs x) {
  const std::int64_t length = x[0].size(2);
  x.push_back(padding_of(length));
  x.push_back(documents_of(length));
  return x;
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
      // Documents packed into each row (with padding): a query sees its own document's keys.
      test::compare_cuda_with_cpu(
          with_documents(operands(70, 70, dtype, 36)),
          [&](const Inputs& x) { return attention_outputs(x, causal); }, tolerance);
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

// The gradients of x's device's backward kernel written over buffers full of NaN (an element it left
// would stay NaN), checked against the op's and flattened in f32; halves on the CPU, which the op
// computes in f32 with no kernel of their own, are the op's.
Tensor backward_over_nan(const Inputs& x, bool causal) {
  const AttentionParams params{.causal = causal,
                               .padding = x.size() > 4 ? x[4] : Tensor(),
                               .documents = x.size() > 5 ? x[5] : Tensor(),
                               .scale = 1.0 / std::sqrt(static_cast<double>(x[0].size(3)))};
  const AttentionResult forward = attention_forward(x[0], x[1], x[2], params);
  const AttentionGrads grads = attention_backward(x[3], x[0], x[1], x[2], forward, params);
  const bool half = x[0].dtype() == DType::bf16 || x[0].dtype() == DType::f16;
  if (x[0].device().is_cuda() || !half) {
    const auto nan_like = [](const Tensor& like) {
      return full(like.shape(), std::numeric_limits<double>::quiet_NaN(), TensorOptions{like.dtype(), like.device()});
    };
    const AttentionGrads written{nan_like(grads.q), nan_like(grads.k), nan_like(grads.v)};
    kernels_for(x[0].device()).attention_backward(x[3], x[0], x[1], x[2], forward, params, written);
    for (const auto& [mine, op] : {std::pair{written.q, grads.q}, {written.k, grads.k}, {written.v, grads.v}}) {
      const std::vector<double> got = test::values(mine.to(Device::cpu()));
      CHECK(std::count_if(got.begin(), got.end(), [](double value) { return std::isnan(value); }) == 0);
      // The op's kernel: its bits.
      CHECK(test::count_mismatches(got, test::values(op.to(Device::cpu())), {0.0, 0.0}) == 0);
    }
  }
  const auto flat = [](const Tensor& t) { return t.to(DType::f32).reshape({-1}); };
  return cat({flat(grads.q), flat(grads.k), flat(grads.v)}, 0);
}

TEST_CASE("cuda matches cpu: the attention backward kernels write every element of their gradients",
          "[cuda-vs-cpu][attention]") {
  for (const bool causal : {false, true}) {
    INFO((causal ? "causal" : "not causal"));
    // f32 and f64: the fused kernels; padding with blind queries and keys no query sees, more keys
    // than queries. B 2 x Hkv 2 owners: the CPU kernel splits dQ's key tiles over partial copies.
    for (const DType dtype : {DType::f32, DType::f64}) {
      Inputs padded = operands(70, 70, dtype, 81);
      padded.push_back(padding_of(70));
      const auto written = [&](const Inputs& x) { return backward_over_nan(x, causal); };
      test::compare_cuda_with_cpu(padded, written, test::Tolerance{1e-5, 1e-4});
      Inputs wide = operands(37, 150, dtype, 91);
      wide.push_back(padding_of(150));
      test::compare_cuda_with_cpu(wide, written, test::Tolerance{1e-5, 1e-4});
      test::compare_cuda_with_cpu(with_documents(operands(70, 70, dtype, 96)), written,
                                  test::Tolerance{1e-5, 1e-4});
    }
    // 16 owners (B 8 x Hkv 2): one task owns each dQ row, which it zeroes first.
    const Inputs many{random_tensor({8, 4, 70, 16}, 101, DType::f32), random_tensor({8, 2, 70, 16}, 102, DType::f32),
                      random_tensor({8, 2, 70, 16}, 103, DType::f32), random_tensor({8, 4, 70, 16}, 104, DType::f32)};
    test::compare_cuda_with_cpu(many, [&](const Inputs& x) { return backward_over_nan(x, causal); },
                                test::Tolerance{1e-5, 1e-4});
    // bf16 with head dims 64: flash attention's two kernels on a GPU.
    Inputs flash = flash_operands(70, 70, 64, DType::bf16, 111);
    flash.push_back(padding_of(70));
    test::compare_cuda_with_cpu(flash, [&](const Inputs& x) { return backward_over_nan(x, causal); },
                                test::Tolerance{5e-2, 2e-2});
    test::compare_cuda_with_cpu(
        with_documents(flash_operands(70, 70, 64, DType::bf16, 116)),
        [&](const Inputs& x) { return backward_over_nan(x, causal); }, test::Tolerance{5e-2, 2e-2});
  }
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
        // Documents with padding: every warp's block takes the per-pair mask.
        test::compare_cuda_with_cpu(with_documents(flash_operands(150, 150, dim, dtype, 76)), outputs,
                                    tolerance);
      }
    }
  }
}

// q, k, v and grad_out as the Llama makes them, views of [B, T, H * D] projections transposed to
// [B, H, T, D] (x: the four projections, then cos and sin [T, D]): attention and the rotary embedding,
// forward and backward, read them where they lie on both devices.
Tensor split_head_outputs(const Inputs& x, std::int64_t dim, bool causal) {
  const auto split = [dim](const Tensor& projected) {
    return projected.reshape({projected.size(0), projected.size(1), -1, dim}).transpose(1, 2);
  };
  const Tensor q = split(x[0]);
  const Tensor attended = attention_outputs({q, split(x[1]), split(x[2]), split(x[3])}, causal);
  const auto flat = [&](const Tensor& t) { return t.to(attended.dtype()).reshape({-1}); };
  return cat({attended, flat(rotary(q, x[4], x[5])), flat(rotary(q, x[4], x[5], /*transpose=*/true))}, 0);
}

Inputs projections(std::int64_t length, std::int64_t dim, DType dtype, std::uint64_t seed) {
  return {random_tensor({2, length, 4 * dim}, seed, dtype),
          random_tensor({2, length, 2 * dim}, seed + 1, dtype),
          random_tensor({2, length, 2 * dim}, seed + 2, dtype),
          random_tensor({2, length, 4 * dim}, seed + 3, dtype),
          random_tensor({length, dim}, seed + 4, dtype),
          random_tensor({length, dim}, seed + 5, dtype)};
}

TEST_CASE("cuda matches cpu: attention and rotary on heads split from [B, T, H * D] projections",
          "[cuda-vs-cpu][attention]") {
  for (const bool causal : {false, true}) {
    INFO((causal ? "causal" : "not causal"));
    // f32 through the fused kernel (any head dim); bf16 through flash attention (64, 128) and, at 40,
    // through the f32 kernel on widened copies.
    test::compare_cuda_with_cpu(
        projections(70, 40, DType::f32, 91),
        [&](const Inputs& x) { return split_head_outputs(x, 40, causal); }, test::Tolerance{1e-5, 1e-4});
    for (const std::int64_t dim : {40, 64, 128}) {
      INFO("bf16, head dim " << dim);
      test::compare_cuda_with_cpu(
          projections(70, dim, DType::bf16, 92),
          [&](const Inputs& x) { return split_head_outputs(x, dim, causal); }, test::Tolerance{5e-2, 2e-2});
    }
  }
}

TEST_CASE("cuda attention and rotary write their outputs and gradients in the layout of split heads",
          "[cuda][attention]") {
  const Device gpu = Device::cuda(0);
  for (const DType dtype : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dtype));
    const auto heads = [&](std::int64_t count, std::uint64_t seed) {
      return random_tensor({2, 70, count * 64}, seed, dtype)
          .to(gpu)
          .reshape({2, 70, count, 64})
          .transpose(1, 2);
    };
    const Tensor q = heads(4, 93), k = heads(2, 94), v = heads(2, 95), grad_out = heads(4, 96);
    const AttentionResult forward = attention_forward(q, k, v, {.causal = true});
    const AttentionGrads grads = attention_backward(grad_out, q, k, v, forward, {.causal = true});
    // Merging the heads back into [B, T, H * D] is a view, not a copy.
    for (const Tensor& t : {forward.out, grads.q, grads.k, grads.v,
                            rotary(q, q.select(0, 0).select(0, 0), q.select(0, 0).select(0, 1))})
      CHECK(t.transpose(1, 2).is_contiguous());
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
