// core/cuda/index.cu: the index range check, and index_select, gather, scatter_add and index_add
// on contiguous operands with i64 indices. Additions never race: each thread owns the output elements
// it adds into and adds in the CPU kernels' order, so results are deterministic and equal to the
// CPU's bit for bit (index_add: the picks sorted stably by row with CUB, every row's segment at once,
// core/segments.h). The check does not make the host wait: it records the first bad value where
// the host reads it at its next wait (index_fault.h), and the kernels skip out-of-range values, so a
// bad index never makes them touch memory outside their operands. Then the family's entries.
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <utility>

#include "core/cuda/check.h"
#include "core/cuda/index_fault.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"
#include "core/segments.h"

namespace shardlab::cuda {
namespace {

// The shape of an index tensor (rank <= kMaxDims) and the element strides of the tensors its
// positions address: `in_strides` for gather's input and scatter_add's source, `out_strides`
// for scatter_add's output.
struct IndexGeometry {
  int rank = 0;
  int dim = 0;
  std::int64_t bound = 0;  // the indexed operand's size along dim (gather's input, scatter_add's output)
  std::int64_t shape[kMaxDims] = {};
  std::int64_t in_strides[kMaxDims] = {};
  std::int64_t out_strides[kMaxDims] = {};
};

// index_add's scratch on the device: the picks' positions, sorted keys and order (i64 [picks] each),
// and sort_bytes (index_add_sort_bytes) for the sort.
struct IndexAddScratch {
  std::int64_t *positions, *keys, *order;
  void* sort;
  std::size_t sort_bytes;
};
std::size_t index_add_sort_bytes(std::int64_t picks);

// Offset, with `strides`, of the element at `position` of a contiguous tensor of geometry.shape,
// its coordinate along `dim` replaced by `along`.
__device__ std::int64_t remapped(const IndexGeometry& g, const std::int64_t* strides, std::int64_t position,
                                 std::int64_t along) {
  std::int64_t offset = 0;
  for (int d = g.rank - 1; d >= 0; --d) {
    const std::int64_t coordinate = position % g.shape[d];
    position /= g.shape[d];
    offset += (d == g.dim ? along : coordinate) * strides[d];
  }
  return offset;
}

__device__ inline bool in_range(std::int64_t value, std::int64_t size) { return value >= 0 && value < size; }

// CUB's item count, an int (the entry refuses more picks first).
int as_items(std::int64_t picks) { return static_cast<int>(picks); }

__global__ void check_index_kernel(const std::int64_t* index, std::int64_t n, std::int64_t size,
                                   IndexFault* fault, const char* op, const char* what, int device) {
  for (std::int64_t i = first_thread(); i < n; i += thread_step()) {
    if (in_range(index[i], size)) continue;
    if (atomicCAS(&fault->claimed, 0, 1) == 0) {
      fault->op = op;
      fault->what = what;
      fault->value = index[i];
      fault->size = size;
      fault->device = device;
      __threadfence_system();  // the fields reach the host before `ready` does
      atomicExch(&fault->ready, 1);
    }
    return;
  }
}

template <typename T>
__global__ void index_select_kernel(const T* in, const std::int64_t* index, T* out, std::int64_t total,
                                    std::int64_t picks, std::int64_t size, std::int64_t inner) {
  for (std::int64_t e = first_thread(); e < total; e += thread_step()) {
    const std::int64_t o = e / (picks * inner), j = e / inner % picks, i = e % inner;
    out[e] = in_range(index[j], size) ? in[(o * size + index[j]) * inner + i] : T{};
  }
}

template <typename T>
__global__ void gather_kernel(const T* in, const std::int64_t* index, T* out, std::int64_t total,
                              IndexGeometry g) {
  for (std::int64_t p = first_thread(); p < total; p += thread_step())
    out[p] = in_range(index[p], g.bound) ? in[remapped(g, g.in_strides, p, index[p])] : T{};
}

// One thread per line along `dim` of the index, walked in order.
template <typename T>
__global__ void scatter_add_kernel(T* out, const std::int64_t* index, const T* src, std::int64_t lines,
                                   std::int64_t length, std::int64_t inner, IndexGeometry g) {
  for (std::int64_t line = first_thread(); line < lines; line += thread_step()) {
    const std::int64_t o = line / inner, i = line % inner;
    for (std::int64_t j = 0; j < length; ++j) {
      const std::int64_t p = (o * length + j) * inner + i;
      if (!in_range(index[p], g.bound)) continue;
      accumulate(out[remapped(g, g.out_strides, p, index[p])], src[remapped(g, g.in_strides, p, j)]);
    }
  }
}

__global__ void positions_kernel(std::int64_t* positions, std::int64_t n) {
  for (std::int64_t p = first_thread(); p < n; p += thread_step()) positions[p] = p;
}

// Threads (column i, sorted position p, outer o): where p starts a segment (core/segments.h), the
// thread adds the segment's picks to its row's column i, in their original order, onto the row's value:
// the CPU's order, with every segment at once.
template <typename T>
__global__ void index_add_segments_kernel(T* out, const std::int64_t* keys, const std::int64_t* order,
                                          const T* src, std::int64_t outer, std::int64_t picks,
                                          std::int64_t size, std::int64_t inner) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= inner) return;
  for (std::int64_t p = blockIdx.y; p < picks; p += gridDim.y) {
    if (!starts_segment(keys, p) || !in_range(keys[p], size)) continue;
    const std::int64_t end = segment_end(keys, p, picks);
    for (std::int64_t o = blockIdx.z; o < outer; o += gridDim.z) {
      T& target = out[(o * size + keys[p]) * inner + i];
      for (std::int64_t q = p; q < end; ++q) accumulate(target, src[(o * picks + order[q]) * inner + i]);
    }
  }
}

// Records the first value of index[0, n) outside [0, size) in index_fault() (index_fault.h);
// `op` and `what` are string literals of the host, for the message.
void launch_check_index(const std::int64_t* index, std::int64_t n, std::int64_t size, const char* op,
                        const char* what, int device, cudaStream_t stream) {
  if (n == 0) return;
  check_index_kernel<<<grid_size(n), kBlockSize, 0, stream>>>(index, n, size, index_fault(), op, what,
                                                              device);
  SHARDLAB_CUDA_CHECK_LAUNCH();
}

// Contiguous operands and i64 indices checked by launch_check_index, the CPU kernels' contracts
// (core/kernels.h); an out-of-range index is skipped (its fault is reported at the next host wait).
// in [outer, size, inner] -> out [outer, picks, inner].
void launch_index_select(DType dtype, const void* in, const std::int64_t* index, void* out,
                         std::int64_t outer, std::int64_t picks, std::int64_t size, std::int64_t inner,
                         cudaStream_t stream) {
  const std::int64_t total = outer * picks * inner;
  if (total == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    index_select_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(
        static_cast<const T*>(in), index, static_cast<T*>(out), total, picks, size, inner);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

void launch_gather(DType dtype, const void* in, const std::int64_t* index, void* out, std::int64_t total,
                   const IndexGeometry& geometry, cudaStream_t stream) {
  if (total == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    gather_kernel<T><<<grid_size(total), kBlockSize, 0, stream>>>(static_cast<const T*>(in), index,
                                                                  static_cast<T*>(out), total, geometry);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// The index has shape [outer, length, inner] around geometry.dim.
void launch_scatter_add(DType dtype, void* out, const std::int64_t* index, const void* src,
                        std::int64_t outer, std::int64_t length, std::int64_t inner,
                        const IndexGeometry& geometry, cudaStream_t stream) {
  const std::int64_t lines = outer * inner;
  if (lines == 0 || length == 0) return;
  visit_dtype(dtype, [&]<typename T>() {
    scatter_add_kernel<T><<<grid_size(lines), kBlockSize, 0, stream>>>(
        static_cast<T*>(out), index, static_cast<const T*>(src), lines, length, inner, geometry);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

std::size_t index_add_sort_bytes(std::int64_t picks) {
  std::size_t bytes = 0;
  SHARDLAB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const std::int64_t*>(nullptr), static_cast<std::int64_t*>(nullptr),
      static_cast<const std::int64_t*>(nullptr), static_cast<std::int64_t*>(nullptr), as_items(picks)));
  return bytes;
}

// out [outer, size, inner] += src [outer, picks, inner] at rows index[j] (picks up to INT_MAX, CUB's
// count): the picks sorted stably by row, each row's added in their order (core/segments.h).
void launch_index_add(DType dtype, void* out, const std::int64_t* index, const void* src, std::int64_t outer,
                      std::int64_t picks, std::int64_t size, std::int64_t inner,
                      const IndexAddScratch& scratch, cudaStream_t stream) {
  if (outer == 0 || inner == 0 || picks == 0) return;
  positions_kernel<<<grid_size(picks), kBlockSize, 0, stream>>>(scratch.positions, picks);
  SHARDLAB_CUDA_CHECK_LAUNCH();
  // Radix sort is stable: equal keys keep their positions' order.
  std::size_t bytes = scratch.sort_bytes;
  SHARDLAB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch.sort, bytes, index, scratch.keys,
                                                      scratch.positions, scratch.order, as_items(picks), 0,
                                                      64, stream));
  const dim3 blocks(static_cast<unsigned>((inner + kBlockSize - 1) / kBlockSize),
                    static_cast<unsigned>(picks < 65535 ? picks : 65535),
                    static_cast<unsigned>(outer < 65535 ? outer : 65535));
  visit_dtype(dtype, [&]<typename T>() {
    index_add_segments_kernel<T><<<blocks, kBlockSize, 0, stream>>>(static_cast<T*>(out), scratch.keys,
                                                                    scratch.order, static_cast<const T*>(src),
                                                                    outer, picks, size, inner);
    SHARDLAB_CUDA_CHECK_LAUNCH();
  });
}

// --- entries --------------------------------------------------------------------------------------

// Sizes around `dim` of `shape`: the product of the dims before and of those after.
std::pair<std::int64_t, std::int64_t> outer_inner(const Shape& shape, std::int64_t dim) {
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 0; d < static_cast<std::int64_t>(shape.size()); ++d) {
    if (d < dim) outer *= shape[d];
    if (d > dim) inner *= shape[d];
  }
  return {outer, inner};
}

IndexGeometry index_geometry(const char* op, const Tensor& index, std::int64_t dim, const Tensor& in,
                             const Tensor& out) {
  SHARDLAB_CHECK(index.dim() <= kMaxDims, "{} on cuda: at most {} dimensions, got {}", op, kMaxDims,
                 index.dim());
  IndexGeometry g;
  g.rank = static_cast<int>(index.dim());
  g.dim = static_cast<int>(dim);
  g.bound = out.defined() ? out.size(dim) : in.size(dim);
  for (std::int64_t d = 0; d < index.dim(); ++d) {
    g.shape[d] = index.size(d);
    g.in_strides[d] = in.stride(d);
    if (out.defined()) g.out_strides[d] = out.stride(d);
  }
  return g;
}

void cuda_check_index(const char* op, const Tensor& index, std::int64_t size, const char* what) {
  const LaunchContext context(index);
  launch_check_index(index.data<std::int64_t>(), index.numel(), size, op, what, index.device().index,
                     context.stream());
}

void cuda_index_select(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const LaunchContext context(out);
  const auto [outer, inner] = outer_inner(in.shape(), dim);
  launch_index_select(in.dtype(), in.raw_data(), index.data<std::int64_t>(), out.raw_data(), outer,
                      index.numel(), in.size(dim), inner, context.stream());
}

void cuda_gather(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const LaunchContext context(out);
  launch_gather(in.dtype(), in.raw_data(), index.data<std::int64_t>(), out.raw_data(), index.numel(),
                index_geometry("gather", index, dim, in, Tensor()), context.stream());
}

void cuda_scatter_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  accumulate_in_f32(out, src, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    const auto [outer, inner] = outer_inner(index.shape(), dim);
    launch_scatter_add(sums.dtype(), sums.raw_data(), index.data<std::int64_t>(), terms.raw_data(), outer,
                       index.size(dim), inner, index_geometry("scatter_add", index, dim, terms, sums),
                       context.stream());
  });
}

// The embedding backward's: the picks sorted by row, each row's segment added in order.
void cuda_index_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  accumulate_in_f32(out, src, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    const auto [outer, inner] = outer_inner(sums.shape(), dim);
    const std::int64_t picks = index.numel();
    SHARDLAB_CHECK(picks <= std::numeric_limits<int>::max(), "index_add on cuda: at most {} indices, got {}",
                   std::numeric_limits<int>::max(), picks);
    const TensorOptions longs{DType::i64, sums.device()};
    const Tensor positions = empty({picks}, longs), keys = empty({picks}, longs),
                 order = empty({picks}, longs);
    const std::size_t sort_bytes = picks > 0 ? index_add_sort_bytes(picks) : 0;
    const Tensor sort =
        empty({static_cast<std::int64_t>(sort_bytes)}, TensorOptions{DType::u8, sums.device()});
    launch_index_add(sums.dtype(), sums.raw_data(), index.data<std::int64_t>(), terms.raw_data(), outer,
                     picks, sums.size(dim), inner,
                     {positions.data<std::int64_t>(), keys.data<std::int64_t>(), order.data<std::int64_t>(),
                      sort.raw_data(), sort_bytes},
                     context.stream());
  });
}

}  // namespace

IndexKernels index_kernels() {
  return {.check_index = cuda_check_index,
          .index_select = cuda_index_select,
          .gather = cuda_gather,
          .scatter_add = cuda_scatter_add,
          .index_add = cuda_index_add};
}

}  // namespace shardlab::cuda
