// core/loss.h: the loss building blocks: gather_targets and fused cross-entropy, and their kernel entries.
#pragma once

#include <cstdint>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// values [N, C], targets [N] (i64/i32) -> [N]: values[i, targets[i]], or 0 where
// targets[i] == ignore_index. Targets outside [0, C) are an error.
Tensor gather_targets(const Tensor& values, const Tensor& targets, std::int64_t ignore_index = -100);

// Cross-entropy from logits [N, C] (floating) and targets [N] (i64/i32, each in [0, C) or
// ignore_index), row by row without a softmax [N, C] in memory: losses [N] = logsumexp(logits[i]) -
// logits[i, targets[i]], 0 where ignored, and logsumexp [N] for the backward, both in f32 for
// bf16/f16 logits (the logits' dtype otherwise): half logits need no f32 copy for an f32 loss. The
// backward gives grad_losses[i] * (softmax(logits[i]) - onehot(targets[i])) in the logits' dtype,
// computed in f32 and rounded once: the bits of the f32 copy's gradient cast back.
struct CrossEntropyResult {
  Tensor losses, logsumexp;
};
CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                         std::int64_t ignore_index = -100);
Tensor cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                              std::int64_t ignore_index, const Tensor& logsumexp);

// Cross-entropy's kernels.
struct LossKernels {
  // Cross-entropy from contiguous logits [N, C] and i64 targets [N] (checked: in [0, C) or
  // ignore_index): losses [N] in the logits' dtype, 0 where ignored; logsumexp [N] in their compute
  // dtype (f32 for halves). Backward: grad_logits [N, C] = grad_losses[i] * (softmax(logits)[i] -
  // onehot(targets[i])), 0 in ignored rows. No softmax [N, C] in memory.
  void (*cross_entropy_forward)(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                                const Tensor& losses, const Tensor& logsumexp);
  void (*cross_entropy_backward)(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                                 std::int64_t ignore_index, const Tensor& logsumexp,
                                 const Tensor& grad_logits);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> loss_ops();

// This family's entries on each device: core/cpu/loss.cpp, core/cuda/loss.cu.
namespace cpu {
LossKernels loss_kernels();
}
namespace cuda {
LossKernels loss_kernels();
}

}  // namespace shardlab
