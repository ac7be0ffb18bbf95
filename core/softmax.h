// core/softmax.h: softmax and log_softmax over one dim, and their kernel entry.
#pragma once

#include <cstdint>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

Tensor softmax(const Tensor& x, std::int64_t dim);
Tensor log_softmax(const Tensor& x, std::int64_t dim);

// in: any strides; out contiguous.
struct SoftmaxKernels {
  void (*softmax)(const Tensor& in, std::int64_t dim, bool log, const Tensor& out);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> softmax_ops();

// This family's entries on each device: core/cpu/softmax.cpp, core/cuda/softmax.cu.
namespace cpu {
SoftmaxKernels softmax_kernels();
}
namespace cuda {
SoftmaxKernels softmax_kernels();
}

}  // namespace shardlab
