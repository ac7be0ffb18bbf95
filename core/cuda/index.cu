// core/cuda/index.cu: the index range check, and index_select, gather, scatter_add and index_add
// on contiguous operands with i64 indices. Additions never race: each thread owns the output elements
// it adds into and adds in the CPU kernels' order, so results are deterministic and equal to the
// CPU's bit for bit (index_add: the picks sorted stably by row with CUB, every row's segment at once,
// core/segments.h). The check does not make the host wait: it records the first bad value where
// the host reads it at its next wait (index_fault.h), and the kernels skip out-of-range values, so a
// bad index never makes them touch memory outside their operands.
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "core/cuda/check.h"
#include "core/cuda/index_fault.h"
#include "core/cuda/indexing.cuh"
#include "core/cuda/launch.h"
#include "core/segments.h"

namespace shardlab::cuda {
namespace {

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

// CUB's item count, an int (table.cpp refuses more picks first).
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

}  // namespace

void launch_check_index(const std::int64_t* index, std::int64_t n, std::int64_t size, const char* op,
                        const char* what, int device, cudaStream_t stream) {
  if (n == 0) return;
  check_index_kernel<<<grid_size(n), kBlockSize, 0, stream>>>(index, n, size, index_fault(), op, what,
                                                              device);
  SHARDLAB_CUDA_CHECK_LAUNCH();
}

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

}  // namespace shardlab::cuda
