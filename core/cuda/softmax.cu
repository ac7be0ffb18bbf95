// core/cuda/softmax.cu: softmax and log_softmax along one dim (core/cpu/softmax.cpp's CUDA side), one
// block per row: each thread reads its strided part of the row once, keeping the online softmax's
// running pair (core/cuda/online_softmax.cuh), merged across the block; a second sweep writes the
// outputs. Computed in float (double for f64). Then the entry.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"
#include "core/cuda/online_softmax.cuh"

namespace shardlab::cuda {
namespace {

// Rows are (outer, inner) pairs of a contiguous [outer, n, inner] tensor.
template <typename T>
__global__ void softmax_kernel(const T* in, T* out, std::int64_t rows, std::int64_t n, std::int64_t inner,
                               bool take_log) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = (r / inner) * n * inner + r % inner;
    Running<C> mine{-INFINITY, C(0)};
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const C x = static_cast<C>(widen(in[base + i * inner]));
      mine = merge(mine, Running<C>{x, C(1)});
    }
    const Running<C> row = merge_across_block(mine);
    // As the CPU kernel: an all -inf row is shifted by 0 (no -inf - -inf = NaN).
    const C shift = isfinite(row.largest) ? row.largest : C(0);
    const C log_total = log(row.total * exp(row.largest - shift));
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const C shifted = static_cast<C>(widen(in[base + i * inner])) - shift;
      out[base + i * inner] = narrow<T>(take_log ? shifted - log_total : exp(shifted - log_total));
    }
    __syncthreads();  // `row` in shared memory is reused by the next row
  }
}

// in, out: contiguous [outer, n, inner]; softmax (or log_softmax) along n, for floating dtypes
// (false for the others).
bool launch_softmax(DType dtype, const void* in, void* out, std::int64_t outer, std::int64_t n,
                    std::int64_t inner, bool take_log, cudaStream_t stream) {
  const std::int64_t rows = outer * inner;
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      if (rows == 0 || n == 0) return true;
      const auto blocks = static_cast<unsigned>(rows < kMaxBlocks ? rows : kMaxBlocks);
      softmax_kernel<T><<<blocks, kBlockSize, 0, stream>>>(static_cast<const T*>(in), static_cast<T*>(out),
                                                           rows, n, inner, take_log);
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

// --- entries --------------------------------------------------------------------------------------

// The CPU kernel's contract allows any strides for `in`; the kernel reads a contiguous copy.
void cuda_softmax(const Tensor& in, std::int64_t dim, bool log, const Tensor& out) {
  const LaunchContext context(out);
  const Tensor x = in.contiguous();
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (std::int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
  SHARDLAB_CHECK(launch_softmax(x.dtype(), x.raw_data(), out.raw_data(), outer, x.size(dim), inner, log,
                                context.stream()),
                 "{}: no CUDA kernel for {}", log ? "log_softmax" : "softmax", dtype_name(x.dtype()));
}

}  // namespace

SoftmaxKernels softmax_kernels() { return {.softmax = cuda_softmax}; }

}  // namespace shardlab::cuda
