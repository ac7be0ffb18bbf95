// core/cpu/index.cpp: index_select, gather, scatter_add and index_add on contiguous operands
// with validated i64 indices. Additions run in a fixed order per output, so results are
// deterministic, and parallel tasks never write the same element.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/cpu/kernels.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/segments.h"

namespace shardlab::cpu {
namespace {

// Sizes around `dim`: outer = product of dims before, inner = product after.
struct Around {
  std::int64_t outer = 1, inner = 1;
};

Around around(const Shape& shape, std::int64_t dim) {
  Around a;
  for (std::int64_t d = 0; d < static_cast<std::int64_t>(shape.size()); ++d) {
    if (d < dim) a.outer *= shape[d];
    if (d > dim) a.inner *= shape[d];
  }
  return a;
}

template <typename T>
void accumulate(T& target, T value) {
  target = narrow<T>(widen(target) + widen(value));
}

// Offset into a contiguous tensor of `shape` of the element at `position` of a contiguous
// tensor of `index_shape`, with the coordinate along `dim` replaced by `along`.
std::int64_t remapped_offset(const Shape& index_shape, const Strides& strides, std::int64_t dim,
                             std::int64_t position, std::int64_t along) {
  std::int64_t offset = 0;
  for (std::int64_t d = static_cast<std::int64_t>(index_shape.size()) - 1; d >= 0; --d) {
    const std::int64_t coordinate = position % index_shape[d];
    position /= index_shape[d];
    offset += (d == dim ? along : coordinate) * strides[d];
  }
  return offset;
}

void check_index(const char* op, const Tensor& index, std::int64_t size, const char* what) {
  const std::int64_t* values = index.data<std::int64_t>();
  const auto [lowest, highest] = std::minmax_element(values, values + index.numel());
  const std::int64_t bad = *lowest < 0 ? *lowest : *highest;
  SHARDLAB_CHECK(*lowest >= 0 && *highest < size, "{}: index {} is out of range for {} of size {}", op, bad,
                 what, size);
}

void index_select(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const Around a = around(in.shape(), dim);
  const std::int64_t picks = index.numel(), size = in.size(dim);
  const std::size_t row_bytes = static_cast<std::size_t>(a.inner) * in.element_size();
  const std::int64_t* idx = static_cast<const std::int64_t*>(index.raw_data());
  const char* src = static_cast<const char*>(in.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  parallel_for(0, a.outer * picks, 64, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t task = first; task < last; ++task) {
      const std::int64_t o = task / picks, j = task % picks;
      std::memcpy(dst + task * row_bytes, src + (o * size + idx[j]) * static_cast<std::int64_t>(row_bytes),
                  row_bytes);
    }
  });
}

void gather(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const std::int64_t* idx = static_cast<const std::int64_t*>(index.raw_data());
  const Strides in_strides = in.strides();
  const std::size_t esize = in.element_size();
  const char* src = static_cast<const char*>(in.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  parallel_for(0, index.numel(), 1024, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t p = first; p < last; ++p) {
      const std::int64_t offset = remapped_offset(index.shape(), in_strides, dim, p, idx[p]);
      std::memcpy(dst + p * static_cast<std::int64_t>(esize), src + offset * static_cast<std::int64_t>(esize),
                  esize);
    }
  });
}

void scatter_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  // Lines along `dim` of the index are independent: they differ in another coordinate, so
  // they write to different elements of out. Each line is walked in order.
  const Shape& shape = index.shape();
  const std::int64_t length = shape[dim];
  const Around a = around(shape, dim);
  const std::int64_t* idx = static_cast<const std::int64_t*>(index.raw_data());
  visit_dtype(out.dtype(), [&]<typename T>() {
    T* dst = static_cast<T*>(out.raw_data());
    const T* values = static_cast<const T*>(src.raw_data());
    parallel_for(0, a.outer * a.inner, 256, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t line = first; line < last; ++line) {
        const std::int64_t o = line / a.inner, i = line % a.inner;
        for (std::int64_t j = 0; j < length; ++j) {
          const std::int64_t p = (o * length + j) * a.inner + i;
          const std::int64_t target = remapped_offset(shape, out.strides(), dim, p, idx[p]);
          const std::int64_t source = remapped_offset(shape, src.strides(), dim, p, j);
          accumulate(dst[target], values[source]);
        }
      }
    });
  });
}

void index_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  // Tasks own a segment of picks of one row (core/segments.h) and a slab of `inner` columns for one
  // outer position, and add the picks in their order: deterministic, no two tasks write one element.
  const Around a = around(out.shape(), dim);
  const std::int64_t picks = index.numel(), size = out.size(dim);
  constexpr std::int64_t kSlab = 256;
  const std::int64_t slabs = (a.inner + kSlab - 1) / kSlab;
  const std::int64_t* idx = static_cast<const std::int64_t*>(index.raw_data());
  std::vector<std::int64_t> order(static_cast<std::size_t>(picks)), keys(static_cast<std::size_t>(picks));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t x, std::int64_t y) { return idx[x] < idx[y]; });
  std::vector<std::int64_t> starts;
  for (std::int64_t p = 0; p < picks; ++p) {
    keys[static_cast<std::size_t>(p)] = idx[order[static_cast<std::size_t>(p)]];
    if (starts_segment(keys.data(), p)) starts.push_back(p);
  }
  const auto segments = static_cast<std::int64_t>(starts.size());
  visit_dtype(out.dtype(), [&]<typename T>() {
    T* dst = static_cast<T*>(out.raw_data());
    const T* values = static_cast<const T*>(src.raw_data());
    parallel_for(0, a.outer * segments * slabs, 1, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t task = first; task < last; ++task) {
        const std::int64_t o = task / (segments * slabs), segment = task / slabs % segments;
        const std::int64_t begin = task % slabs * kSlab, end = std::min(begin + kSlab, a.inner);
        const std::int64_t start = starts[static_cast<std::size_t>(segment)];
        T* row = dst + (o * size + keys[static_cast<std::size_t>(start)]) * a.inner;
        for (std::int64_t p = start; p < segment_end(keys.data(), start, picks); ++p) {
          const T* from = values + (o * picks + order[static_cast<std::size_t>(p)]) * a.inner;
          for (std::int64_t i = begin; i < end; ++i) accumulate(row[i], from[i]);
        }
      }
    });
  });
}

// Accumulating kernels sum 16-bit floats in f32 and round once at the end.
void scatter_add_f32(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  in_f32_precision(
      out, [&](const Tensor& o, const Tensor& s) { cpu::scatter_add(o, dim, index, s); }, src);
}
void index_add_f32(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  in_f32_precision(
      out, [&](const Tensor& o, const Tensor& s) { cpu::index_add(o, dim, index, s); }, src);
}

}  // namespace

IndexKernels index_kernels() {
  return {.check_index = check_index,
          .index_select = index_select,
          .gather = gather,
          .scatter_add = scatter_add_f32,
          .index_add = index_add_f32};
}

}  // namespace shardlab::cpu
