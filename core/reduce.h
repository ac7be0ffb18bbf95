// core/reduce.h: reductions over any set of dims (empty = all), with keepdim; their kernel entries.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

using Dims = std::vector<std::int64_t>;

// The reduce entry's op codes, and their names for error messages and traces.
enum class ReduceOp : unsigned char { sum, mean, sum_squares, max, min, argmax };
const char* op_name(ReduceOp op);

// sum of integers and bools gives i64; mean needs a floating input. Floating sums
// accumulate in double on CPU.
Tensor sum(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor sum_squares(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
// The sum of the squares of every element of all `tensors` (at least one; floating, any dtypes and
// shapes, all on one device), as an f64 scalar there: a gradient norm's square over many parameters
// in one pass over memory, one launch on a GPU (PyTorch's _foreach_norm), the same bits on every
// device (core/square_sums.h). Not differentiable.
Tensor foreach_sum_squares(std::span<const Tensor> tensors);
Tensor max(const Tensor& x, const Dims& dims = {}, bool keepdim = false);  // NaN propagates
Tensor min(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
// i64 index of the first maximum within the reduced dims, counted in row-major order over
// those dims (the usual index when one dim is reduced).
Tensor argmax(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
// log(sum(exp(x))) computed stably; rows of -inf give -inf.
Tensor logsumexp(const Tensor& x, const Dims& dims, bool keepdim = false);

// The reductions' kernels.
struct ReductionKernels {
  // out has the keepdim shape (reduced dims of size 1); dims are sorted and distinct.
  void (*reduce)(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out);
  // out (f64 scalar) = the sum of every element's square over `tensors` (contiguous, floating, not
  // empty; dtypes may differ), in core/square_sums.h's order.
  void (*foreach_sum_squares)(std::span<const Tensor> tensors, const Tensor& out);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> reduction_ops();

// This family's entries on each device: core/cpu/reduce.cpp, core/cuda/reduce.cu.
namespace cpu {
ReductionKernels reduction_kernels();
}
namespace cuda {
ReductionKernels reduction_kernels();
}

}  // namespace shardlab
