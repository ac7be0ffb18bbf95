// core/cuda/optimizer.cpp: the fused optimizer updates' entries: one launch per dtype for contiguous
// segments.
#include <algorithm>
#include <initializer_list>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

bool all_contiguous(std::initializer_list<const Tensor*> tensors) {
  return std::all_of(tensors.begin(), tensors.end(), [](const Tensor* t) { return t->is_contiguous(); });
}

// Contiguous segments go to one multi-segment launch per dtype (pair); segments with a strided
// operand each take the strided kernel.
void cuda_adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply) {
  const LaunchContext context(segments.front().param);
  const bool* gate = apply.defined() ? apply.data<bool>() : nullptr;
  const Device device = segments.front().param.device();
  std::map<DType, std::vector<cuda::AdadeltaSegmentArgs>> contiguous;
  for (const auto& [param, grad, square_avg, acc_delta, hyper] : segments) {
    const cuda::AdadeltaScalars scalars{hyper.lr, hyper.rho, hyper.eps, hyper.weight_decay};
    if (all_contiguous({&param, &grad, &square_avg, &acc_delta})) {
      contiguous[param.dtype()].push_back({param.raw_data(), grad.raw_data(), square_avg.raw_data(),
                                           acc_delta.raw_data(), param.numel(), scalars});
      continue;
    }
    SHARDLAB_CHECK(
        cuda::launch_adadelta_step(param.dtype(), param.raw_data(), grad.raw_data(), square_avg.raw_data(),
                                   acc_delta.raw_data(),
                                   layout_of<4>("adadelta_step", {&param, &grad, &square_avg, &acc_delta}),
                                   scalars, gate, context.stream()),
        "adadelta_step: no CUDA kernel for {}", dtype_name(param.dtype()));
  }
  for (const auto& [dtype, args] : contiguous) {
    Tensor table;
    SHARDLAB_CHECK(
        cuda::launch_adadelta_segments(dtype, args, upload_into(table, device), gate, context.stream()),
        "adadelta_step: no CUDA kernel for {}", dtype_name(dtype));
  }
}

void cuda_adam_step(std::span<const AdamSegment> segments, const Tensor& apply) {
  const LaunchContext context(segments.front().param);
  const bool* gate = apply.defined() ? apply.data<bool>() : nullptr;
  const Device device = segments.front().param.device();
  std::map<std::pair<DType, DType>, std::vector<cuda::AdamSegmentArgs>> contiguous;
  for (const auto& [param, grad, exp_avg, exp_avg_sq, hyper, copy_out] : segments) {
    const Tensor& copy = copy_out.defined() ? copy_out : param;
    if (all_contiguous({&param, &grad, &exp_avg, &exp_avg_sq, &copy})) {
      contiguous[{param.dtype(), copy.dtype()}].push_back(
          {param.raw_data(), grad.raw_data(), exp_avg.raw_data(), exp_avg_sq.raw_data(), copy.raw_data(),
           param.numel(), adam_scalars(hyper)});
      continue;
    }
    SHARDLAB_CHECK(
        cuda::launch_adam_step(param.dtype(), copy.dtype(), param.raw_data(), grad.raw_data(),
                               exp_avg.raw_data(), exp_avg_sq.raw_data(), copy.raw_data(),
                               layout_of<5>("adam_step", {&param, &grad, &exp_avg, &exp_avg_sq, &copy}),
                               adam_scalars(hyper), gate, context.stream()),
        "adam_step: no CUDA kernel for {} to {}", dtype_name(param.dtype()), dtype_name(copy.dtype()));
  }
  for (const auto& [dtypes, args] : contiguous) {
    Tensor table;
    SHARDLAB_CHECK(cuda::launch_adam_segments(dtypes.first, dtypes.second, args, upload_into(table, device),
                                              gate, context.stream()),
                   "adam_step: no CUDA kernel for {} to {}", dtype_name(dtypes.first),
                   dtype_name(dtypes.second));
  }
}

}  // namespace

OptimizerKernels optimizer_kernels() {
  return {.adadelta_step = cuda_adadelta_step, .adam_step = cuda_adam_step};
}

}  // namespace shardlab::cuda
