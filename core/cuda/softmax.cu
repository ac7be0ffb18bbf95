// core/cuda/softmax.cu: softmax and log_softmax along one dim, one block per row, and cross-entropy
// from logits (core/cpu/loss.cpp's CUDA side). Each thread reads its strided part of the row once,
// keeping a running (max, sum of exp(x - max)) pair (the online softmax recurrence); the pairs are
// merged across the warp and the block; a second sweep writes the outputs (softmax) or one thread
// the row's loss and logsumexp (cross-entropy, whose backward is elementwise from them). Computed
// in float (double for f64).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

// (largest value seen, sum of exp(value - largest)) over part of a row.
template <typename C>
struct Running {
  C largest;
  C total;
};

template <typename C>
__device__ Running<C> merge(Running<C> a, Running<C> b) {
  const C largest = a.largest > b.largest ? a.largest : b.largest;
  if (largest == -INFINITY) return {largest, C(0)};  // both empty (or all -inf so far)
  return {largest, a.total * exp(a.largest - largest) + b.total * exp(b.largest - largest)};
}

template <typename C>
__device__ Running<C> merge_across_block(Running<C> mine) {
  constexpr unsigned kAll = 0xffffffffu;
  for (int offset = 16; offset > 0; offset /= 2) {
    const Running<C> other{__shfl_down_sync(kAll, mine.largest, offset),
                           __shfl_down_sync(kAll, mine.total, offset)};
    mine = merge(mine, other);
  }
  __shared__ Running<C> per_warp[kBlockSize / 32];
  __shared__ Running<C> row;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) per_warp[warp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    Running<C> all = per_warp[0];
    for (int w = 1; w < kBlockSize / 32; ++w) all = merge(all, per_warp[w]);
    row = all;
  }
  __syncthreads();
  return row;
}

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

// One block per row of logits [rows, classes]: its logsumexp and, unless ignored, its loss.
template <typename T>
__global__ void cross_entropy_kernel(const T* logits, const std::int64_t* targets, std::int64_t ignore_index,
                                     std::int64_t rows, std::int64_t classes, T* losses,
                                     compute_t<T>* logsumexp) {
  using C = compute_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = logits + r * classes;
    Running<C> mine{-INFINITY, C(0)};
    for (std::int64_t c = threadIdx.x; c < classes; c += blockDim.x)
      mine = merge(mine, Running<C>{widen(row[c]), C(1)});
    const Running<C> all = merge_across_block(mine);
    if (threadIdx.x == 0) {
      const C shift = isfinite(all.largest) ? all.largest : C(0);
      const C lse = shift + log(all.total * exp(all.largest - shift));
      logsumexp[r] = lse;
      // A target out of [0, classes) was recorded by the op's index check, reported at the host's
      // next wait: skipped here as the index kernels skip one, not read outside the row.
      const std::int64_t target = targets[r];
      const bool counted = target != ignore_index && target >= 0 && target < classes;
      losses[r] = counted ? narrow<T>(lse - widen(row[target])) : T{};
    }
    __syncthreads();  // `all` in shared memory is reused by the next row
  }
}

template <typename T>
__global__ void cross_entropy_backward_kernel(const T* grad_losses, const T* logits,
                                              const std::int64_t* targets, std::int64_t ignore_index,
                                              const compute_t<T>* logsumexp, std::int64_t rows,
                                              std::int64_t classes, T* grad) {
  using C = compute_t<T>;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * classes;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / classes, c = i % classes;
    if (targets[r] == ignore_index) {
      grad[i] = T{};
      continue;
    }
    const C probability = exp(widen(logits[i]) - logsumexp[r]);
    grad[i] = narrow<T>(widen(grad_losses[r]) * (probability - (c == targets[r] ? C(1) : C(0))));
  }
}

}  // namespace

bool launch_cross_entropy(DType dtype, const void* logits, const std::int64_t* targets,
                          std::int64_t ignore_index, std::int64_t rows, std::int64_t classes, void* losses,
                          void* logsumexp, cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      if (rows == 0) return true;
      const auto blocks = static_cast<unsigned>(rows < kMaxBlocks ? rows : kMaxBlocks);
      cross_entropy_kernel<T><<<blocks, kBlockSize, 0, stream>>>(
          static_cast<const T*>(logits), targets, ignore_index, rows, classes, static_cast<T*>(losses),
          static_cast<compute_t<T>*>(logsumexp));
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

bool launch_cross_entropy_backward(DType dtype, const void* grad_losses, const void* logits,
                                   const std::int64_t* targets, std::int64_t ignore_index,
                                   const void* logsumexp, std::int64_t rows, std::int64_t classes, void* grad,
                                   cudaStream_t stream) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      if (rows * classes == 0) return true;
      cross_entropy_backward_kernel<T><<<grid_size(rows * classes), kBlockSize, 0, stream>>>(
          static_cast<const T*>(grad_losses), static_cast<const T*>(logits), targets, ignore_index,
          static_cast<const compute_t<T>*>(logsumexp), rows, classes, static_cast<T*>(grad));
      SHARDLAB_CUDA_CHECK_LAUNCH();
      return true;
    } else {
      return false;
    }
  });
}

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

}  // namespace shardlab::cuda
