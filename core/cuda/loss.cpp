// core/cuda/loss.cpp: cross-entropy's entries.
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

void cuda_cross_entropy_forward(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                                const Tensor& losses, const Tensor& logsumexp) {
  const LaunchContext context(logits);
  SHARDLAB_CHECK(cuda::launch_cross_entropy(logits.dtype(), logits.raw_data(), targets.data<std::int64_t>(),
                                            ignore_index, logits.size(0), logits.size(1), losses.raw_data(),
                                            logsumexp.raw_data(), context.stream()),
                 "cross_entropy: no CUDA kernel for {}", dtype_name(logits.dtype()));
}

void cuda_cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                                 std::int64_t ignore_index, const Tensor& logsumexp,
                                 const Tensor& grad_logits) {
  const LaunchContext context(logits);
  SHARDLAB_CHECK(cuda::launch_cross_entropy_backward(
                     logits.dtype(), grad_losses.raw_data(), logits.raw_data(), targets.data<std::int64_t>(),
                     ignore_index, logsumexp.raw_data(), logits.size(0), logits.size(1),
                     grad_logits.raw_data(), context.stream()),
                 "cross_entropy_backward: no CUDA kernel for {}", dtype_name(logits.dtype()));
}

}  // namespace

LossKernels loss_kernels() {
  return {.cross_entropy_forward = cuda_cross_entropy_forward,
          .cross_entropy_backward = cuda_cross_entropy_backward};
}

}  // namespace shardlab::cuda
