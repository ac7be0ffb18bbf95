// core/cuda/loss.cu: cross-entropy from logits (core/cpu/loss.cpp's CUDA side): one block per row
// keeps the online softmax's running pair (core/cuda/online_softmax.cuh) over the row, then one thread
// writes the row's loss and logsumexp; the backward is elementwise from them, in 16-byte packs where
// rows are whole packs. Computed in the compute type. Then the family's entries (core/loss.h).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"
#include "core/cuda/online_softmax.cuh"

namespace shardlab::cuda {
namespace {

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

// Contiguous logits [rows, classes], i64 targets (in range or ignore_index): losses and logsumexp
// [rows] in the logits' compute type (f32 for bf16/f16); floating dtypes only.
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

// grad [rows, classes] = grad_losses[r] * (softmax - onehot), 0 in ignored rows; grad_losses in the
// compute type.
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

// --- entries --------------------------------------------------------------------------------------

void cuda_cross_entropy_forward(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                                const Tensor& losses, const Tensor& logsumexp) {
  const LaunchContext context(logits);
  SHARDLAB_CHECK(launch_cross_entropy(logits.dtype(), logits.raw_data(), targets.data<std::int64_t>(),
                                      ignore_index, logits.size(0), logits.size(1), losses.raw_data(),
                                      logsumexp.raw_data(), context.stream()),
                 "cross_entropy: no CUDA kernel for {}", dtype_name(logits.dtype()));
}

void cuda_cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                                 std::int64_t ignore_index, const Tensor& logsumexp,
                                 const Tensor& grad_logits) {
  const LaunchContext context(logits);
  SHARDLAB_CHECK(
      launch_cross_entropy_backward(logits.dtype(), grad_losses.raw_data(), logits.raw_data(),
                                    targets.data<std::int64_t>(), ignore_index, logsumexp.raw_data(),
                                    logits.size(0), logits.size(1), grad_logits.raw_data(), context.stream()),
      "cross_entropy_backward: no CUDA kernel for {}", dtype_name(logits.dtype()));
}

}  // namespace

LossKernels loss_kernels() {
  return {.cross_entropy_forward = cuda_cross_entropy_forward,
          .cross_entropy_backward = cuda_cross_entropy_backward};
}

}  // namespace shardlab::cuda
