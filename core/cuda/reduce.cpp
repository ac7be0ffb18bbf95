// core/cuda/reduce.cpp: the reductions' entries.
#include <algorithm>
#include <vector>

#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"
#include "core/square_sums.h"

namespace shardlab::cuda {
namespace {

void cuda_reduce(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out) {
  const LaunchContext context(out);
  std::vector<std::int64_t> order;
  std::int64_t count = 1;
  for (std::int64_t d = 0; d < in.dim(); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) order.push_back(d);
  }
  for (const std::int64_t d : dims) {
    order.push_back(d);
    count *= in.size(d);
  }
  const Tensor rows = in.permute(order).contiguous();
  SHARDLAB_CHECK(reduce_rows(op, rows, out, out.numel(), count, context.stream()),
                 "{}: no CUDA kernel from {} to {}", op_name(op), dtype_name(in.dtype()),
                 dtype_name(out.dtype()));
}

void cuda_foreach_sum_squares(std::span<const Tensor> tensors, const Tensor& out) {
  const LaunchContext context(out);
  std::vector<cuda::SquareSumArgs> args;
  std::int64_t chunks = 0;
  for (const Tensor& t : tensors) {
    args.push_back({t.raw_data(), t.numel(), t.dtype()});
    chunks += square_chunks(t.numel());
  }
  const Tensor partials = empty({chunks}, TensorOptions{DType::f64, out.device()});
  Tensor table;
  cuda::launch_foreach_sum_squares(args, upload_into(table, out.device()), partials.data<double>(),
                                   out.data<double>(), context.stream());
}

}  // namespace

ReductionKernels reduction_kernels() {
  return {.reduce = cuda_reduce, .foreach_sum_squares = cuda_foreach_sum_squares};
}

}  // namespace shardlab::cuda
