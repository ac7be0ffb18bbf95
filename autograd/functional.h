// autograd/functional.h: differentiable building blocks of networks, composed from the
// ops in autograd/ops.h: losses, dropout, normalisations, attention.
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
// nll_loss(log_softmax(logits, 1), ...), for logits [N, C].
Variable cross_entropy(const Variable& logits, const Tensor& targets, std::int64_t ignore_index = -100,
                       Reduction reduction = Reduction::mean);

// Zeroes each element with probability p and scales the rest by 1 / (1 - p) when training;
// the identity otherwise. The mask of batch row r (dim 0) is drawn from Philox with key
// (random_context().seed, a stream mixed from `stream` and the step) at element offset
// sample_index(r) * row_size, so it depends only on (seed, stream, step, global sample index):
// a rank holding rows 4..7 of the global batch draws the masks the 1-rank run draws for them.
Variable dropout(const Variable& x, double p, bool training, std::uint64_t stream);

// x * rsqrt(mean(x^2, last dim) + eps) * weight; weight has x's last dim.
Variable rms_norm(const Variable& x, const Variable& weight, double eps = 1e-6);
// (x - mean) * rsqrt(var + eps) * weight + bias over the last dim (biased variance);
// weight and bias may be undefined.
Variable layer_norm(const Variable& x, const Variable& weight, const Variable& bias, double eps = 1e-5);

struct AttentionOptions {
  bool causal = false;          // query t attends to keys 0..t (top-left aligned, as PyTorch)
  Tensor mask;                  // optional additive mask broadcastable to [B, H, T, S]
  std::optional<double> scale;  // default 1 / sqrt(head_dim)
};
// q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with H a multiple of Hkv
// (grouped-query attention: query head h uses key/value head h / (H / Hkv)) -> [B, H, T, Dv].
Variable scaled_dot_product_attention(const Variable& q, const Variable& k, const Variable& v,
                                      const AttentionOptions& options = {});

}  // namespace shardlab
