// core/cuda/attention_operands.cuh: internal to core/cuda: one attention call's operands and geometry,
// which core/cuda/attention.cu (the fused kernels and attention's entries) and
// core/cuda/flash_attention.cu (the tensor-core kernels for halves) share, and the flash launchers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/attention_mask.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"

namespace shardlab::cuda {

// q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv].
struct AttentionGeometry {
  std::int64_t batch, heads, kv_heads, queries, keys, head_dim, value_dim;
  bool causal;
  double scale;
};

// A warp holds a row of D or Dv elements, kMaxValuesPerLane per lane.
inline constexpr int kMaxValuesPerLane = 8;
inline constexpr std::int64_t kMaxAttentionHeadDim = 32 * kMaxValuesPerLane;

// The operands of one attention call: out [B, H, T, Dv], logsumexp and delta [B, H, T] contiguous; in
// backward, grad_out has out's shape and the gradients q's, k's and v's (written whole).
struct AttentionOperands {
  Heads q, k, v, out, grad_out;
  const bool* padding;            // [B, S] or null
  const std::int64_t* documents;  // [B, T] (T == S) or null
  void* logsumexp;
  void* delta;  // backward's scratch
  MutableHeads grad_q, grad_k, grad_v;
};

// An attention call's operands typed: elements T, logsumexp and delta
// in S (the element type for f32 and f64, f32 for flash attention's halves).
template <typename T, typename S>
struct TypedAttentionOperands {
  HeadView<const T> q, k, v, out, grad_out;
  const bool* padding;
  const std::int64_t* documents;
  S* logsumexp;
  S* delta;
  HeadView<T> grad_q, grad_k, grad_v;
};
template <typename T, typename S>
TypedAttentionOperands<T, S> typed_attention_operands(const AttentionOperands& o) {
  return {head_view<const T>(o.q),
          head_view<const T>(o.k),
          head_view<const T>(o.v),
          head_view<const T>(o.out),
          head_view<const T>(o.grad_out),
          o.padding,
          o.documents,
          static_cast<S*>(o.logsumexp),
          static_cast<S*>(o.delta),
          head_view<T>(o.grad_q),
          head_view<T>(o.grad_k),
          head_view<T>(o.grad_v)};
}

// Which keys each query of the call sees (core/attention_mask.h, shared with the CPU).
template <typename T, typename S>
__device__ AttentionMask attention_mask(const AttentionGeometry& g, const TypedAttentionOperands<T, S>& o) {
  return {g.causal, o.padding, o.documents, g.queries, g.keys};
}

// bf16 and f16 on tensor cores, head dims 64 and 128 with Dv == D (false, launching nothing, for any
// other), every operand's data on 16 bytes and its strides multiples of 8 elements; logsumexp and
// delta in f32.
[[nodiscard]] bool launch_flash_attention_forward(DType dtype, const AttentionOperands& operands,
                                                  const AttentionGeometry& geometry, MutableHeads out,
                                                  cudaStream_t stream);
[[nodiscard]] bool launch_flash_attention_backward(DType dtype, const AttentionOperands& operands,
                                                   const AttentionGeometry& geometry, cudaStream_t stream);

}  // namespace shardlab::cuda
