// core/cuda/softmax.cu: softmax and log_softmax along one dim, one block per row, and cross-entropy
// from logits (core/cpu/loss.cpp's CUDA side). Each thread reads its strided part of the row once,
// keeping a running (max, sum of exp(x - max)) pair (the online softmax recurrence); the pairs are
// merged across the warp and the block; a second sweep writes the outputs (softmax) or one thread
// the row's loss and logsumexp (cross-entropy, whose backward is elementwise from them, in 16-byte
// packs where rows are whole packs). Computed in float (double for f64).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
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
                                     std::int64_t rows, std::int64_t classes, compute_t<T>* losses,
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
      losses[r] = counted ? lse - widen(row[target]) : C(0);
    }
    __syncthreads();  // `all` in shared memory is reused by the next row
  }
}

// The gradient of logit (r, c): grad_losses[r] (softmax - onehot), 0 in an ignored row.
template <typename T>
__device__ T cross_entropy_grad(T logit, std::int64_t c, std::int64_t target, std::int64_t ignore_index,
                                compute_t<T> lse, compute_t<T> grad_loss) {
  using C = compute_t<T>;
  if (target == ignore_index) return T{};
  const C probability = exp(widen(logit) - lse);
  return narrow<T>(grad_loss * (probability - (c == target ? C(1) : C(0))));
}

// Packed (rows of a whole number of 16-byte packs, starting on 16 bytes, fewer than 2^31 logits): a
// thread a pack, its row found once; else a thread an element.
template <typename T>
__global__ void cross_entropy_backward_kernel(const compute_t<T>* grad_losses, const T* logits,
                                              const std::int64_t* targets, std::int64_t ignore_index,
                                              const compute_t<T>* logsumexp, std::int64_t rows,
                                              std::int64_t classes, T* grad, bool packed) {
  if (!packed) {
    for (std::int64_t i = first_thread(); i < rows * classes; i += thread_step()) {
      const std::int64_t r = i / classes;
      grad[i] =
          cross_entropy_grad(logits[i], i % classes, targets[r], ignore_index, logsumexp[r], grad_losses[r]);
    }
    return;
  }
  constexpr int V = pack_width<T>();
  const auto width = static_cast<std::uint32_t>(classes);
  for_each_pack<V>(
      static_cast<std::uint32_t>(rows * classes),
      [&](std::uint32_t p) {
        const std::uint32_t r = p * V / width, c = p * V % width;
        const Pack<T, V> x = load_pack<V>(logits, 1, p);
        Pack<T, V> g;
#pragma unroll
        for (int v = 0; v < V; ++v)
          g.lane[v] =
              cross_entropy_grad(x.lane[v], c + v, targets[r], ignore_index, logsumexp[r], grad_losses[r]);
        store_pack(grad, p, g);
      },
      [](std::uint32_t) {});  // whole rows of whole packs: no element is left over
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
          static_cast<const T*>(logits), targets, ignore_index, rows, classes,
          static_cast<compute_t<T>*>(losses), static_cast<compute_t<T>*>(logsumexp));
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
      constexpr int V = pack_width<T>();
      const bool packed = classes % V == 0 && packable(rows * classes, {logits, grad});
      cross_entropy_backward_kernel<T>
          <<<grid_size(packed ? rows * classes / V : rows * classes), kBlockSize, 0, stream>>>(
              static_cast<const compute_t<T>*>(grad_losses), static_cast<const T*>(logits), targets,
              ignore_index, static_cast<const compute_t<T>*>(logsumexp), rows, classes, static_cast<T*>(grad),
              packed);
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
