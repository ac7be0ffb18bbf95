// autograd/functional.h: differentiable building blocks of networks, composed from the
// ops in autograd/ops.h: losses, dropout, normalisations, attention (fused where core has it).
#pragma once

#include <cstdint>
#include <optional>

#include "autograd/ops.h"

namespace shardlab {

enum class Reduction : unsigned char { mean, sum, none };

// log_probs [N, C], targets [N] (i64/i32). Rows whose target is ignore_index contribute
// nothing; mean divides by the number of rows that count (NaN when none does, as PyTorch).
Variable nll_loss(const Variable& log_probs, const Tensor& targets, std::int64_t ignore_index = -100,
                  Reduction reduction = Reduction::mean);
// nll_loss(log_softmax(logits, 1), ...), for logits [N, C]: one node over core's fused
// cross_entropy_forward/backward, with no log-softmax [N, C] in memory. The loss of bf16/f16 logits
// is f32 (PyTorch's would be in the logits' dtype), computed without an f32 copy of them; their
// gradient keeps the logits' dtype.
Variable cross_entropy(const Variable& logits, const Tensor& targets, std::int64_t ignore_index = -100,
                       Reduction reduction = Reduction::mean);

// Zeroes each element with probability p and scales the rest by 1 / (1 - p) when training;
// the identity otherwise. The mask of batch row r (dim 0) is drawn from Philox with key
// (random_context().seed, a stream mixed from `stream` and the step) at element offset
// sample_index(r) * row_size, so it depends only on (seed, stream, step, global sample index):
// a rank holding rows 4..7 of the global batch draws the masks the 1-rank run draws for them.
Variable dropout(const Variable& x, double p, bool training, std::uint64_t stream);

// x * rsqrt(mean(x^2, last dim) + eps) * weight; weight has x's last dim. One fused node (core's
// rms_norm_forward/backward) when x and weight share a floating dtype.
Variable rms_norm(const Variable& x, const Variable& weight, double eps = 1e-6);
// The residual stream's `sum = add(x, y)` and `out = rms_norm(sum, weight, eps)`, with their values
// and gradients, as one forward kernel (core's add_rms_norm_forward) when x and y share a shape and
// x, y and weight a floating dtype: the sum is read back from cache, not memory. Two nodes, as the
// composition records.
struct AddRmsNorm {
  Variable sum, out;
};
AddRmsNorm add_rms_norm(const Variable& x, const Variable& y, const Variable& weight, double eps = 1e-6);
// silu(gate) * up, the Llama MLP's gate: one fused node (core's swiglu) for operands of one shape
// and floating dtype, mul(silu(gate), up) otherwise.
Variable swiglu(const Variable& gate, const Variable& up);
// (x - mean) * rsqrt(var + eps) * weight + bias over the last dim (biased variance);
// weight and bias may be undefined.
Variable layer_norm(const Variable& x, const Variable& weight, const Variable& bias, double eps = 1e-5);

struct AttentionOptions {
  bool causal = false;          // query t attends to keys 0..t (top-left aligned, as PyTorch)
  Tensor padding;               // optional bool [B, S]: true marks a padding token
  Tensor documents;             // optional i64 [B, T], T == S: each token's document
  Tensor mask;                  // optional additive mask broadcastable to [B, H, T, S]
  std::optional<double> scale;  // default 1 / sqrt(head_dim)
};
// q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with H a multiple of Hkv
// (grouped-query attention: query head h uses key/value head h / (H / Hkv)) -> [B, H, T, Dv].
// No query attends to a padding key, to a key of another document (a different value in
// documents) or to a key the mask sets to -inf; when T == S the queries are the keys' tokens and a
// padding query attends to nothing. Causal with documents is the block-causal mask of documents
// packed into one sequence: each attends as it would alone. A query that attends to nothing
// outputs zeros and passes no gradient (not NaN).
//
//   Variable y = scaled_dot_product_attention(q, k, v, {.causal = true, .padding = eq(ids, pad_id)});
//
// f32 and f64 without an additive mask run fused (core's attention_forward/backward: no [T, S]
// scores in memory) on devices with that kernel; everything else runs the composed reference.
Variable scaled_dot_product_attention(const Variable& q, const Variable& k, const Variable& v,
                                      const AttentionOptions& options = {});

namespace detail {
// The two paths scaled_dot_product_attention chooses between, to compare them directly.
// Composed from differentiable ops: any device, dtype and mask; scores [B, H, T, S] in memory.
Variable naive_attention(const Variable& q, const Variable& k, const Variable& v,
                         const AttentionOptions& options = {});
// One node over attention_forward/backward: f32/f64, no additive mask.
Variable fused_attention(const Variable& q, const Variable& k, const Variable& v,
                         const AttentionOptions& options = {});
}  // namespace detail

// Rotary position embedding, rotate-half convention (Hugging Face's apply_rotary_pos_emb):
// x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]).
// x [..., T, D] with D even; cos and sin [T, D] (broadcast over the leading dims), x's dtype. One
// fused node (core's rotary), whose backward is the rotation's transpose.
Variable rotary_embedding(const Variable& x, const Tensor& cos, const Tensor& sin);

}  // namespace shardlab
