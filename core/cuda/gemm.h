// core/cuda/gemm.h: internal to core/cuda: batched GEMM through cuBLAS, loaded at first use
// (dlopen), so binaries still start where the toolkit's shared libraries are absent.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace shardlab::cuda {

// One column-major operand of cublasGemmStridedBatchedEx.
struct GemmOperand {
  const void* data;
  bool transposed;
  std::int64_t leading;  // leading dimension, in elements
  std::int64_t batch_stride;
};

// out[b] (column-major rows x cols, leading dimension out_leading) = op(a[b]) * op(b[b]) with
// inner dimension `inner`, in f32 (f64 for f64) whatever the storage dtype. f32, f64, bf16,
// f16; throws Error for others or when cuBLAS cannot be loaded. With `bias` ([rows] in the dtype,
// f32, bf16 or f16), it is added to every column in the compute type before the one rounding, in
// cuBLASLt's epilogue.
void gemm_batched(DType dtype, std::int64_t batches, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                  const GemmOperand& a, const GemmOperand& b, void* out, std::int64_t out_leading,
                  std::int64_t out_batch_stride, int device, cudaStream_t stream, const void* bias = nullptr);

}  // namespace shardlab::cuda
