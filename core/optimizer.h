// core/optimizer.h: fused optimizer updates (Adadelta, Adam, AdamW) over one parameter or many
// segments at once, and their kernel entries.
#pragma once

#include <cstdint>
#include <span>

#include "core/adam_math.h"
#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// Fused in-place updates over a parameter and its state (one pass instead of one per op).
struct AdadeltaHyper {
  double lr = 1.0, rho = 0.9, eps = 1e-6, weight_decay = 0.0;
};
// PyTorch's Adadelta on one parameter: g = grad + wd p; square_avg = rho sa + (1 - rho) g^2;
// delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) g; acc_delta = rho ad + (1 - rho)
// delta^2; p -= lr delta. All four tensors share shape, dtype and device.
void adadelta_step(const Tensor& param, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                   const AdadeltaHyper& hyper);
// One Adam or AdamW update (PyTorch's, at the given step >= 1):
//   AdamW: p *= 1 - lr wd (decoupled);  Adam: g = grad + wd p (L2)
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
struct AdamHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled = false;  // AdamW's decay instead of Adam's L2
  std::int64_t step = 1;
};
inline AdamScalars adam_scalars(const AdamHyper& h) {
  return {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.step};
}
// param, grad, exp_avg and exp_avg_sq share shape, dtype and device. When `copy_out` is defined
// (same shape and device, any floating dtype, e.g. bf16) it receives the updated parameter in
// its dtype in the same pass: FSDP's next all-gather reads it.
void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const AdamHyper& hyper, const Tensor& copy_out = {});

// The same updates over many parameters at once, each with its own hyper-parameters (an
// optimizer's step: its lr, weight decay and step count per parameter): one pass per device,
// on CUDA one kernel launch per dtype for all contiguous segments. Each segment is checked as
// the single-parameter call checks its operands (errors name "segment <i>" when there are
// several, and then nothing is updated); segments may differ in shape, dtype and device but
// must not share memory. On CPU each segment's result is bit-identical to the single-parameter
// call on it (which is a one-segment call).
//
//   std::vector<AdamSegment> segments;
//   for (...) segments.push_back({.param = p, .grad = g, .exp_avg = m, .exp_avg_sq = v, .hyper = h});
//   adam_step(segments);
//
// `apply`, when defined, gates the whole call on the device: a one-element bool tensor on the
// segments' device (all of them on it), read by the kernels and never by the host, so a GPU
// decides without the host waiting (an optimizer step skipped because the step's loss or
// gradient norm was found not finite there). Where it is false nothing is written.
struct AdadeltaSegment {
  Tensor param, grad, square_avg, acc_delta;
  AdadeltaHyper hyper;
};
void adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply = {});
struct AdamSegment {
  Tensor param, grad, exp_avg, exp_avg_sq;
  AdamHyper hyper;
  Tensor copy_out;  // undefined, or as adam_step's copy_out
};
void adam_step(std::span<const AdamSegment> segments, const Tensor& apply = {});

// The fused updates.
struct OptimizerKernels {
  // Non-empty segments on the table's device, each valid as in core/ops.h (operands of one
  // segment share shape, dtype (floating) and device, any strides; copy_out is undefined or has
  // param's shape, any floating dtype); segments may differ in dtype and do not share memory.
  // `apply`: undefined, or a one-element bool on the same device that gates every write.
  void (*adadelta_step)(std::span<const AdadeltaSegment> segments, const Tensor& apply);
  void (*adam_step)(std::span<const AdamSegment> segments, const Tensor& apply);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> optimizer_ops();

// This family's entries on each device: core/cpu/optimizer.cpp, core/cuda/optimizer.cu.
namespace cpu {
OptimizerKernels optimizer_kernels();
}
namespace cuda {
OptimizerKernels optimizer_kernels();
}

}  // namespace shardlab
