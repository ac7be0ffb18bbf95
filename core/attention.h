// core/attention.h: fused scaled dot-product attention (forward, backward, which kernel runs) and its
// kernel entries.
#pragma once

#include <cstdint>
#include <optional>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// Fused scaled dot-product attention (FlashAttention-2: blocked over keys with an online softmax,
// no [T, S] score matrix), the core of autograd's scaled_dot_product_attention:
//   out[b, h, t] = sum_s softmax_s(scale * q[b, h, t] . k[b, h / G, s]) v[b, h / G, s]
// over the keys s query t may see, for q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv],
// H = G * Hkv (grouped-query attention). f32 or f64.
struct AttentionParams {
  bool causal = false;          // query t sees keys 0..t (top-left aligned, as PyTorch)
  Tensor padding;               // optional bool [B, S]: true marks a padding token (see below)
  Tensor documents;             // optional i64 [B, T], T == S: each token's document (see below)
  std::optional<double> scale;  // default 1 / sqrt(D)
};
// No query sees a padding key; when T == S the queries are the same tokens, and a padding
// query sees nothing. With documents, a query sees only the keys of its own document (equal
// values): with causal, the block-causal mask of documents packed into one sequence, under which
// each document attends as it would alone. The documents need not be contiguous: any two tokens
// of equal value are one document. A query that sees no key outputs zeros (logsumexp -inf) and
// passes no gradient.
struct AttentionResult {
  Tensor out;        // [B, H, T, Dv]
  Tensor logsumexp;  // [B, H, T]: of each query's scaled scores over the keys it sees (f32 for halves)
};
AttentionResult attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionParams& params = {});
// The kernel attention_forward and attention_backward run, a pure function of the operands (the same
// answer on any machine): f32 and f64 take the device's fused kernel; bf16 and f16 take flash
// attention on tensor cores on a GPU where q's and v's head dims are both 64 or both 128, and
// elsewhere the f32 kernel on operands cast to f32, the results cast back. logsumexp is f32 for
// bf16 and f16.
enum class AttentionKernel : unsigned char { fused, flash, in_f32 };
AttentionKernel attention_kernel(DType dtype, Device device, std::int64_t head_dim, std::int64_t value_dim);
struct AttentionGrads {
  Tensor q, k, v;  // in the shapes of q, k and v: k and v summed over each group's query heads
};
AttentionGrads attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionResult& forward, const AttentionParams& params = {});
// The shape checks attention_forward makes (4-D operands that agree, H a multiple of Hkv, a
// bool [B, S] padding, i64 [B, T] documents with T == S), with errors that start with `op` and name
// the shapes.
void check_attention_operands(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& padding, const Tensor& documents);

// Attention's kernels, and whether they and rotary's read operands where they lie.
struct AttentionKernels {
  // Fused attention (core/ops.h): q, k, v, grad_out, the forward's out and the gradients contiguous
  // (or as strided_heads says) and of one dtype (f32 or f64); logsumexp, params.padding and
  // params.documents (undefined or) contiguous; params.scale set; at least one query and one key.
  // Backward writes every element of the gradients, which arrive uninitialised.
  void (*attention_forward)(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                            const AttentionResult& result);
  void (*attention_backward)(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionResult& forward, const AttentionParams& params,
                             const AttentionGrads& grads);
  // Whether rotary and attention read operand t where it lies (rows in unit stride along the last
  // dim, the other dims through their strides) and take outputs and gradients laid out as t (dense,
  // core/tensor.h's empty_in_layout_of): then q, k and v split from a [B, T, H * D] projection, and
  // the output merged back into one, need no copies. Where it says no, t is made contiguous.
  bool (*strided_heads)(const Tensor& t) = nullptr;
  // The query-key pairs of one head the kernels score, summed over the batch rows, for documents (i64
  // [B, T] on the device): a kernel that skips the tiles between documents (the CPU's) counts the pairs
  // its mask lets through (causal or all) in the tiles it visits; one that visits the same tiles
  // whatever the documents (CUDA's) says 0: the shapes decide (core/op_cost.h's attention_pairs).
  double (*scored_pairs)(const Tensor& documents, bool causal) = nullptr;
};

// AttentionKernels::scored_pairs of `device`'s kernel for params with documents; 0 without documents:
// the cost model's count of attention's pairs (core/op_cost.h).
double attention_scored_pairs(Device device, const AttentionParams& params);

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> attention_ops();

// This family's entries on each device: core/cpu/attention.cpp, core/cuda/attention.cu.
namespace cpu {
AttentionKernels attention_kernels();
}
namespace cuda {
AttentionKernels attention_kernels();
}

}  // namespace shardlab
