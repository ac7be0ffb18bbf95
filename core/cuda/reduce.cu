// core/cuda/reduce.cu: reductions (sum, mean, sum of squares, max, min, argmax), one block per
// output element over a contiguous row of its inputs (the entry moves the reduced dims last); the
// sums of few long rows (a gradient's norm) in two passes, a block per chunk of a row and then the
// chunks' partials (reduce_chunks), so that every SM reads; and the sum of squares over many
// tensors (a gradient norm) in one launch, in core/square_sums.h's order.
// Like the CPU kernel, floating values accumulate in double and integers in int64; max, min and
// argmax keep the first NaN and, on ties, the first index. Threads combine in a fixed tree, so
// results are deterministic. Then the family's entries (core/reduce.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/cuda/check.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"
#include "core/square_sums.h"

namespace shardlab::cuda {
namespace {

// A tensor of foreach_sum_squares: numel (> 0) contiguous elements of a floating dtype.
struct SquareSumArgs {
  const void* data;
  std::int64_t numel;
  DType dtype;
};

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

// The block's sum of row[begin, end) (squared for sum_squares), threads striding, in a fixed tree.
template <typename T, typename A>
__device__ A block_sum(ReduceOp op, const T* row, std::int64_t begin, std::int64_t end, A* slots) {
  A acc = 0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const A v = static_cast<A>(widen(row[i]));
    acc += op == ReduceOp::sum_squares ? v * v : v;
  }
  return combine_across_block(acc, slots, [](A a, A b) { return a + b; });
}

template <typename A, typename Out>
__device__ Out finished_sum(ReduceOp op, A total, std::int64_t count) {
  return op == ReduceOp::mean ? narrow<Out>(static_cast<double>(total) / static_cast<double>(count))
                              : narrow<Out>(total);
}

// A long row's chunk per block (blockIdx.x: chunk, blockIdx.y: output): its partial sum.
template <typename T>
__global__ void partial_sums_kernel(ReduceOp op, const T* in, accumulate_t<T>* partials, std::int64_t count,
                                    std::int64_t chunks) {
  using A = accumulate_t<T>;
  __shared__ A sums[kBlockSize];
  const std::int64_t o = blockIdx.y, begin = static_cast<std::int64_t>(blockIdx.x) * kReduceChunk;
  const std::int64_t end = begin + kReduceChunk < count ? begin + kReduceChunk : count;
  const A part = block_sum(op, in + o * count, begin, end, sums);
  if (threadIdx.x == 0) partials[o * chunks + blockIdx.x] = part;
}

// Each output's partials, summed in the same fixed tree, finished as the op says.
template <typename A, typename Out>
__global__ void finish_sums_kernel(ReduceOp op, const A* partials, Out* out, std::int64_t count,
                                   std::int64_t chunks) {
  __shared__ A sums[kBlockSize];
  const std::int64_t o = blockIdx.x;
  const A total = block_sum(ReduceOp::sum, partials + o * chunks, 0, chunks, sums);
  if (threadIdx.x == 0) out[o] = finished_sum<A, Out>(op, total, count);
}

template <typename T, typename Out>
__global__ void reduce_kernel(ReduceOp op, const T* in, Out* out, std::int64_t outputs, std::int64_t count) {
  using A = accumulate_t<T>;
  __shared__ A sums[kBlockSize];
  __shared__ Best<A> bests[kBlockSize];
  for (std::int64_t o = blockIdx.x; o < outputs; o += gridDim.x) {
    const T* row = in + o * count;
    if (op == ReduceOp::sum || op == ReduceOp::mean || op == ReduceOp::sum_squares) {
      const A total = block_sum(op, row, 0, count, sums);
      if (threadIdx.x == 0) out[o] = finished_sum<A, Out>(op, total, count);
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

// --- the multi-tensor sum of squares ----------------------------------------------------------------

struct SquareSumDescriptor {
  const void* data;
  std::int64_t numel, first_chunk;
  DType dtype;
};

// This thread's lane of a chunk [begin, end) of `data`: elements begin + lane, + kSquareLanes, ...
template <typename T>
__device__ double lane_squares(const T* data, std::int64_t begin, std::int64_t end) {
  double lane = 0.0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kSquareLanes) {
    lane = add_square(lane, static_cast<double>(widen(data[i])));
  }
  return lane;
}

// The block's lanes folded pairwise (fold_step); the total, read by every thread.
__device__ double fold_block(double mine, double* lanes) {
  lanes[threadIdx.x] = mine;
  __syncthreads();
  for (int s = kSquareLanes / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) fold_step(lanes, s, static_cast<int>(threadIdx.x));
    __syncthreads();
  }
  const double total = lanes[0];
  __syncthreads();  // the lanes are reused by the next chunk
  return total;
}

// A block per chunk: its partial in partials[chunk]. kSquareLanes threads a block.
__global__ void chunk_squares_kernel(const SquareSumDescriptor* table, std::int64_t tensors,
                                     std::int64_t chunks, double* partials) {
  __shared__ double lanes[kSquareLanes];
  for (std::int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const SquareSumDescriptor t = table[segment_of(table, tensors, chunk)];
    const std::int64_t begin = (chunk - t.first_chunk) * kSquareChunk;
    const std::int64_t end = begin + kSquareChunk < t.numel ? begin + kSquareChunk : t.numel;
    double lane = 0.0;
    switch (t.dtype) {  // uniform over the block
      case DType::f32:
        lane = lane_squares(static_cast<const float*>(t.data), begin, end);
        break;
      case DType::f64:
        lane = lane_squares(static_cast<const double*>(t.data), begin, end);
        break;
      case DType::bf16:
        lane = lane_squares(static_cast<const bf16*>(t.data), begin, end);
        break;
      case DType::f16:
        lane = lane_squares(static_cast<const f16*>(t.data), begin, end);
        break;
      default:
        break;  // the op layer passes floating tensors only
    }
    const double total = fold_block(lane, lanes);
    if (threadIdx.x == 0) partials[chunk] = total;
  }
}

// One block: partial p to lane p % kSquareLanes in order, the lanes folded into out.
__global__ void fold_partials_kernel(const double* partials, std::int64_t count, double* out) {
  __shared__ double lanes[kSquareLanes];
  double lane = 0.0;
  for (std::int64_t p = threadIdx.x; p < count; p += kSquareLanes) lane = lane + partials[p];
  const double total = fold_block(lane, lanes);
  if (threadIdx.x == 0) *out = total;
}

static_assert(kSquareLanes == kBlockSize, "a chunk's lanes are the threads of one block");

// out (one double) = the sum of squares over all tensors in core/square_sums.h's order: a block per
// chunk of every tensor in one launch, writing partials[chunks] (the sum of square_chunks over the
// tensors), then one block folding the partials.
void launch_foreach_sum_squares(std::span<const SquareSumArgs> tensors, const TableUpload& upload,
                                double* partials, double* out, cudaStream_t stream) {
  std::vector<SquareSumDescriptor> table;
  std::int64_t chunks = 0;
  for (const SquareSumArgs& t : tensors) {
    table.push_back({t.data, t.numel, chunks, t.dtype});
    chunks += square_chunks(t.numel);
  }
  const auto* device_table = static_cast<const SquareSumDescriptor*>(
      upload(table.data(), table.size() * sizeof(SquareSumDescriptor)));
  const auto blocks = static_cast<unsigned>(chunks < kMaxBlocks ? chunks : kMaxBlocks);
  chunk_squares_kernel<<<blocks, kSquareLanes, 0, stream>>>(
      device_table, static_cast<std::int64_t>(table.size()), chunks, partials);
  SHARDLAB_CUDA_CHECK_LAUNCH();
  fold_partials_kernel<<<1, kSquareLanes, 0, stream>>>(partials, chunks, out);
  SHARDLAB_CUDA_CHECK_LAUNCH();
}

// in: contiguous [outputs, count], each row reduced into out[row]. Pairs: in_dtype == out_dtype,
// or out i64 (integer sums, argmax); false for others.
// Sums that reduce_chunks (core/kernel_choice.h) cuts into chunks go in two passes; partials: scratch
// of 8-byte accumulators [outputs, reduce_chunks(...)] (f64 for floating inputs, i64 for integers),
// unused (may be null) when reduce_chunks is 1.
bool launch_reduce(ReduceOp op, DType in_dtype, DType out_dtype, const void* in, void* out,
                   std::int64_t outputs, std::int64_t count, void* partials, cudaStream_t stream) {
  return visit_dtype(in_dtype, [&]<typename T>() {
    return visit_dtype(out_dtype, [&]<typename Out>() {
      // The pairs the op layer produces: the same dtype, or i64 for integer sums and argmax.
      if constexpr (std::is_same_v<T, Out> || std::is_same_v<Out, std::int64_t>) {
        if (outputs == 0) return true;
        if (const std::int64_t chunks = reduce_chunks(op, outputs, count); chunks > 1) {
          using A = accumulate_t<T>;
          auto* parts = static_cast<A*>(partials);
          partial_sums_kernel<T>
              <<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(outputs)), kBlockSize, 0,
                 stream>>>(op, static_cast<const T*>(in), parts, count, chunks);
          SHARDLAB_CUDA_CHECK_LAUNCH();
          finish_sums_kernel<A, Out><<<static_cast<unsigned>(outputs), kBlockSize, 0, stream>>>(
              op, parts, static_cast<Out*>(out), count, chunks);
          SHARDLAB_CUDA_CHECK_LAUNCH();
          return true;
        }
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

// --- entries --------------------------------------------------------------------------------------

// launch_reduce over `outputs` contiguous rows of `count` elements of `rows`, with the partials' scratch
// it needs for few long rows: a one-pass reduction (most of them) allocates nothing.
bool reduce_rows(ReduceOp op, const Tensor& rows, const Tensor& out, std::int64_t outputs, std::int64_t count,
                 cudaStream_t stream) {
  const std::int64_t chunks = reduce_chunks(op, outputs, count);
  const DType accumulator = is_floating(rows.dtype()) ? DType::f64 : DType::i64;
  const Tensor partials =
      chunks > 1 ? empty({outputs * chunks}, TensorOptions{accumulator, out.device()}) : Tensor();
  return launch_reduce(op, rows.dtype(), out.dtype(), rows.raw_data(), out.raw_data(), outputs, count,
                       partials.defined() ? partials.raw_data() : nullptr, stream);
}

// The kept dims first and the reduced ones last, both in order: each output's inputs are then one
// contiguous row, in the row-major order argmax counts in, and the outputs follow out's order.
void cuda_reduce(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out) {
  const LaunchContext context(out);
  std::vector<std::int64_t> order;
  std::int64_t count = 1;
  for (std::int64_t d = 0; d < in.dim(); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) order.push_back(d);
  }
  for (const std::int64_t d : dims) {
    order.push_back(d);
    count *= in.size(d);
  }
  const Tensor rows = in.permute(order).contiguous();
  SHARDLAB_CHECK(reduce_rows(op, rows, out, out.numel(), count, context.stream()),
                 "{}: no CUDA kernel from {} to {}", op_name(op), dtype_name(in.dtype()),
                 dtype_name(out.dtype()));
}

void cuda_foreach_sum_squares(std::span<const Tensor> tensors, const Tensor& out) {
  const LaunchContext context(out);
  std::vector<SquareSumArgs> args;
  std::int64_t chunks = 0;
  for (const Tensor& t : tensors) {
    args.push_back({t.raw_data(), t.numel(), t.dtype()});
    chunks += square_chunks(t.numel());
  }
  const Tensor partials = empty({chunks}, TensorOptions{DType::f64, out.device()});
  Tensor table;
  launch_foreach_sum_squares(args, upload_into(table, out.device()), partials.data<double>(),
                             out.data<double>(), context.stream());
}

}  // namespace

ReductionKernels reduction_kernels() {
  return {.reduce = cuda_reduce, .foreach_sum_squares = cuda_foreach_sum_squares};
}

}  // namespace shardlab::cuda
