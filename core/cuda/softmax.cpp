// core/cuda/softmax.cpp: softmax's entry.
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

// The CPU kernel's contract allows any strides for `in`; the kernel reads a contiguous copy.
void cuda_softmax(const Tensor& in, std::int64_t dim, bool log, const Tensor& out) {
  const LaunchContext context(out);
  const Tensor x = in.contiguous();
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (std::int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
  SHARDLAB_CHECK(cuda::launch_softmax(x.dtype(), x.raw_data(), out.raw_data(), outer, x.size(dim), inner, log,
                                      context.stream()),
                 "{}: no CUDA kernel for {}", log ? "log_softmax" : "softmax", dtype_name(x.dtype()));
}

}  // namespace

SoftmaxKernels softmax_kernels() { return {.softmax = cuda_softmax}; }

}  // namespace shardlab::cuda
