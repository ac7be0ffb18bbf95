// core/cuda/reduce.cu: reductions (sum, mean, sum of squares, max, min, argmax), one block per
// output element over a contiguous row of its inputs (table.cpp moves the reduced dims last).
// Like the CPU kernel, floating values accumulate in double and integers in int64; max, min and
// argmax keep the first NaN and, on ties, the first index. Threads combine in a fixed tree, so
// results are deterministic.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"
#include "core/cuda/launch.h"

namespace shardlab::cuda {
namespace {

template <typename T>
using accumulate_t = std::conditional_t<std::is_floating_point_v<compute_t<T>>, double, std::int64_t>;

template <typename A>
__device__ bool is_nan(A value) {
  if constexpr (std::is_floating_point_v<A>) {
    return isnan(value);
  } else {
    return false;
  }
}

// The running max/min/argmax of part of a row.
template <typename A>
struct Best {
  A value;
  std::int64_t index;
  bool valid;
};

template <typename A>
__device__ Best<A> better_of(Best<A> a, Best<A> b, bool smallest) {
  if (!a.valid) return b;
  if (!b.valid) return a;
  const bool a_nan = is_nan(a.value), b_nan = is_nan(b.value);
  if (a_nan || b_nan) return (a_nan && (!b_nan || a.index < b.index)) ? a : b;
  if (a.value == b.value) return a.index < b.index ? a : b;
  return (smallest ? b.value < a.value : b.value > a.value) ? b : a;
}

// Tree reduction over the block's shared slots; thread 0 ends with the block's result.
template <typename V, typename Combine>
__device__ V combine_across_block(V mine, V* slots, Combine combine) {
  slots[threadIdx.x] = mine;
  __syncthreads();
  for (int half = kBlockSize / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half)
      slots[threadIdx.x] = combine(slots[threadIdx.x], slots[threadIdx.x + half]);
    __syncthreads();
  }
  const V all = slots[0];
  __syncthreads();  // the slots are reused by the next row
  return all;
}

template <typename T, typename Out>
__global__ void reduce_kernel(ReduceOp op, const T* in, Out* out, std::int64_t outputs, std::int64_t count) {
  using A = accumulate_t<T>;
  __shared__ A sums[kBlockSize];
  __shared__ Best<A> bests[kBlockSize];
  for (std::int64_t o = blockIdx.x; o < outputs; o += gridDim.x) {
    const T* row = in + o * count;
    if (op == ReduceOp::sum || op == ReduceOp::mean || op == ReduceOp::sum_squares) {
      A acc = 0;
      for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
        const A v = static_cast<A>(widen(row[i]));
        acc += op == ReduceOp::sum_squares ? v * v : v;
      }
      const A total = combine_across_block(acc, sums, [](A a, A b) { return a + b; });
      if (threadIdx.x == 0) {
        out[o] = op == ReduceOp::mean ? narrow<Out>(static_cast<double>(total) / static_cast<double>(count))
                                      : narrow<Out>(total);
      }
    } else {
      const bool smallest = op == ReduceOp::min;
      Best<A> best{A(0), 0, false};
      for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
        best = better_of(best, Best<A>{static_cast<A>(widen(row[i])), i, true}, smallest);
      }
      const Best<A> winner = combine_across_block(
          best, bests, [smallest](Best<A> a, Best<A> b) { return better_of(a, b, smallest); });
      if (threadIdx.x == 0)
        out[o] = op == ReduceOp::argmax ? narrow<Out>(winner.index) : narrow<Out>(winner.value);
    }
  }
}

}  // namespace

bool launch_reduce(ReduceOp op, DType in_dtype, DType out_dtype, const void* in, void* out,
                   std::int64_t outputs, std::int64_t count, cudaStream_t stream) {
  return visit_dtype(in_dtype, [&]<typename T>() {
    return visit_dtype(out_dtype, [&]<typename Out>() {
      // The pairs the op layer produces: the same dtype, or i64 for integer sums and argmax.
      if constexpr (std::is_same_v<T, Out> || std::is_same_v<Out, std::int64_t>) {
        if (outputs == 0) return true;
        const auto blocks = static_cast<unsigned>(outputs < kMaxBlocks ? outputs : kMaxBlocks);
        reduce_kernel<T, Out><<<blocks, kBlockSize, 0, stream>>>(op, static_cast<const T*>(in),
                                                                 static_cast<Out*>(out), outputs, count);
        SHARDLAB_CUDA_CHECK_LAUNCH();
        return true;
      } else {
        return false;
      }
    });
  });
}

}  // namespace shardlab::cuda
