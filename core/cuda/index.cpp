// core/cuda/index.cpp: the indexing kernels' entries.
#include <cstdint>
#include <limits>
#include <utility>

#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

// Sizes around `dim` of `shape`: the product of the dims before and of those after.
std::pair<std::int64_t, std::int64_t> outer_inner(const Shape& shape, std::int64_t dim) {
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 0; d < static_cast<std::int64_t>(shape.size()); ++d) {
    if (d < dim) outer *= shape[d];
    if (d > dim) inner *= shape[d];
  }
  return {outer, inner};
}

cuda::IndexGeometry index_geometry(const char* op, const Tensor& index, std::int64_t dim, const Tensor& in,
                                   const Tensor& out) {
  SHARDLAB_CHECK(index.dim() <= cuda::kMaxDims, "{} on cuda: at most {} dimensions, got {}", op,
                 cuda::kMaxDims, index.dim());
  cuda::IndexGeometry g;
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
  cuda::launch_check_index(index.data<std::int64_t>(), index.numel(), size, op, what, index.device().index,
                           context.stream());
}

void cuda_index_select(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const LaunchContext context(out);
  const auto [outer, inner] = outer_inner(in.shape(), dim);
  cuda::launch_index_select(in.dtype(), in.raw_data(), index.data<std::int64_t>(), out.raw_data(), outer,
                            index.numel(), in.size(dim), inner, context.stream());
}

void cuda_gather(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const LaunchContext context(out);
  cuda::launch_gather(in.dtype(), in.raw_data(), index.data<std::int64_t>(), out.raw_data(), index.numel(),
                      index_geometry("gather", index, dim, in, Tensor()), context.stream());
}

void cuda_scatter_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  accumulate_in_f32(out, src, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    const auto [outer, inner] = outer_inner(index.shape(), dim);
    cuda::launch_scatter_add(sums.dtype(), sums.raw_data(), index.data<std::int64_t>(), terms.raw_data(),
                             outer, index.size(dim), inner,
                             index_geometry("scatter_add", index, dim, terms, sums), context.stream());
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
    const std::size_t sort_bytes = picks > 0 ? cuda::index_add_sort_bytes(picks) : 0;
    const Tensor sort =
        empty({static_cast<std::int64_t>(sort_bytes)}, TensorOptions{DType::u8, sums.device()});
    cuda::launch_index_add(sums.dtype(), sums.raw_data(), index.data<std::int64_t>(), terms.raw_data(), outer,
                           picks, sums.size(dim), inner,
                           {positions.data<std::int64_t>(), keys.data<std::int64_t>(),
                            order.data<std::int64_t>(), sort.raw_data(), sort_bytes},
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
