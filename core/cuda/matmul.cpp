// core/cuda/matmul.cpp: the GEMM's entry, through cuBLAS(Lt) (core/cuda/gemm.h).
#include <algorithm>

#include "core/cuda/gemm.h"
#include "core/cuda/launch.h"
#include "core/kernel_choice.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

// One [B, R, C] operand as cuBLAS sees it: row-major rows (last stride 1) are the column-major
// transpose with leading dimension stride(1); column-major ones (stride(1) == 1) need the
// transpose flag; anything else is copied contiguous first (kept alive in `storage`).
cuda::GemmOperand gemm_operand(const Tensor& x, Tensor& storage) {
  const std::int64_t rows = x.size(1), cols = x.size(2);
  if (x.stride(2) == 1 && x.stride(1) >= std::max<std::int64_t>(1, cols)) {
    return {x.raw_data(), false, x.stride(1), x.stride(0)};
  }
  if (x.stride(1) == 1 && x.stride(2) >= std::max<std::int64_t>(1, rows)) {
    return {x.raw_data(), true, x.stride(2), x.stride(0)};
  }
  storage = x.contiguous();
  return {storage.raw_data(), false, std::max<std::int64_t>(1, cols), rows * cols};
}

// Row-major out = a b is column-major out^T = b^T a^T: cuBLAS's first operand is b, and a bias per
// column of out is one per row of out^T, as cuBLASLt's bias epilogue adds it. f64 has no such
// epilogue to rely on: its bias is added after the GEMM, the same bits (an f64 product is rounded
// once either way).
void cuda_matmul(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out) {
  const LaunchContext context(out);
  const bool in_epilogue = bias.defined() && out.dtype() != DType::f64;
  const void* epilogue_bias = in_epilogue ? bias.raw_data() : nullptr;
  Tensor a_copy, b_copy;
  const cuda::GemmOperand left = gemm_operand(b, b_copy);
  const std::int64_t m = out.size(1), n = out.size(2), leading = std::max<std::int64_t>(1, n);
  if (folds_into_one_gemm(layout_of(a), layout_of(b))) {
    const cuda::GemmOperand rows{a.raw_data(), false, a.stride(1), 0};
    cuda::gemm_batched(out.dtype(), 1, n, out.size(0) * m, a.size(2), left, rows, out.raw_data(), leading, 0,
                       out.device().index, context.stream(), epilogue_bias);
  } else {
    const cuda::GemmOperand right = gemm_operand(a, a_copy);
    cuda::gemm_batched(out.dtype(), out.size(0), n, m, a.size(2), left, right, out.raw_data(), leading, m * n,
                       out.device().index, context.stream(), epilogue_bias);
  }
  if (bias.defined() && !in_epilogue)
    elementwise_kernels().binary(BinaryOp::add, out, bias.expand(out.shape()), out);
}

}  // namespace

MatmulKernels matmul_kernels() { return {.matmul = cuda_matmul}; }

}  // namespace shardlab::cuda
