// core/matmul.h: matrix products (matmul, linear) and their kernel entry.
#pragma once

#include <cstdint>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// torch.matmul semantics: 1-D operands are promoted and the added dim removed; leading
// (batch) dims broadcast. Floating dtypes only; bf16/f16 accumulate in f32.
Tensor matmul(const Tensor& a, const Tensor& b);
// torch.nn.functional.linear: x [..., in] times weight [out, in] transposed, plus bias [out] (may be
// undefined) added to every row in the compute type before the product is rounded (on CUDA in
// cuBLASLt's epilogue, not a second pass over the output).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

// The GEMM.
struct MatmulKernels {
  // a [B, M, K], b [B, K, N] (any strides, batch stride may be 0) -> out [B, M, N]; bias undefined, or
  // [N] (contiguous) added to every row of each product in the compute type before it is rounded.
  void (*matmul)(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> matmul_ops();

// This family's entries on each device: core/cpu/matmul.cpp, core/cuda/matmul.cpp.
namespace cpu {
MatmulKernels matmul_kernels();
}
namespace cuda {
MatmulKernels matmul_kernels();
}

}  // namespace shardlab
