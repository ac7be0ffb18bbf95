// core/cpu/loops.h: internal to core/cpu: strided loops shared by the CPU kernels: rows of N operands
// in parallel.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/parallel.h"
#include "core/tensor.h"

namespace shardlab::cpu {

template <std::size_t N>
using Pointers = std::array<char*, N>;
template <std::size_t N>
using ByteStrides = std::array<std::int64_t, N>;

// Dims of `shape` with each operand's byte strides, size-1 dims dropped and dims merged
// wherever every operand is contiguous across them. When keep_last is set the last dim
// of `shape` is never merged or dropped (softmax needs its rows whole).
template <std::size_t N>
struct Layout {
  std::vector<std::int64_t> sizes;
  std::vector<ByteStrides<N>> strides;  // per dim, per operand
};

template <std::size_t N>
Layout<N> coalesce(const Shape& shape, const std::array<const Tensor*, N>& tensors, bool keep_last) {
  Layout<N> layout;
  const std::size_t rank = shape.size();
  for (std::size_t d = 0; d < rank; ++d) {
    const bool last = d + 1 == rank;
    if (shape[d] == 1 && !(keep_last && last)) continue;
    ByteStrides<N> s;
    for (std::size_t k = 0; k < N; ++k) {
      s[k] = tensors[k]->stride(static_cast<std::int64_t>(d)) *
             static_cast<std::int64_t>(tensors[k]->element_size());
    }
    const bool can_merge = !layout.sizes.empty() && !(keep_last && last) && [&] {
      for (std::size_t k = 0; k < N; ++k) {
        if (layout.strides.back()[k] != s[k] * shape[d]) return false;
      }
      return true;
    }();
    if (can_merge) {
      layout.sizes.back() *= shape[d];
      layout.strides.back() = s;
    } else {
      layout.sizes.push_back(shape[d]);
      layout.strides.push_back(s);
    }
  }
  return layout;
}

// Calls row(pointers, inner_byte_strides, length) for every innermost row of `shape` (long
// rows cut into pieces unless keep_last), split over the thread pool. Operand k starts at
// tensors[k]->raw_data().
template <std::size_t N, typename Row>
void for_each_row(const Shape& shape, const std::array<const Tensor*, N>& tensors, Row&& row,
                  bool keep_last = false) {
  if (shape_numel(shape) == 0) return;
  Layout<N> layout = coalesce(shape, tensors, keep_last);
  Pointers<N> base;
  for (std::size_t k = 0; k < N; ++k) base[k] = static_cast<char*>(tensors[k]->raw_data());
  if (layout.sizes.empty()) {  // a single element
    row(base, ByteStrides<N>{}, std::int64_t{1});
    return;
  }
  const std::int64_t length = layout.sizes.back();
  const ByteStrides<N> inner = layout.strides.back();
  layout.sizes.pop_back();
  layout.strides.pop_back();
  const std::int64_t rows = shape_numel(layout.sizes);
  // Work is split in pieces of at least kPiece elements: many short rows are grouped, one
  // long (e.g. fully contiguous) row is cut, so every thread gets a share either way.
  constexpr std::int64_t kPiece = 16384;
  const std::int64_t pieces_per_row = keep_last ? 1 : std::max<std::int64_t>(1, length / kPiece);
  const std::int64_t piece = (length + pieces_per_row - 1) / pieces_per_row;
  const std::int64_t grain = std::max<std::int64_t>(1, kPiece / std::max<std::int64_t>(piece, 1));
  // The first row of a share is found by division, each next one by stepping its index like an
  // odometer: short rows (a transpose's 32 elements) no longer pay a division per dimension.
  const auto row_start = [&](std::int64_t r, std::vector<std::int64_t>& index) {
    Pointers<N> p = base;
    for (std::size_t d = layout.sizes.size(); d-- > 0;) {
      index[d] = r % layout.sizes[d];
      r /= layout.sizes[d];
      for (std::size_t k = 0; k < N; ++k) p[k] += index[d] * layout.strides[d][k];
    }
    return p;
  };
  const auto next_row = [&](Pointers<N>& p, std::vector<std::int64_t>& index) {
    for (std::size_t d = layout.sizes.size(); d-- > 0;) {
      for (std::size_t k = 0; k < N; ++k) p[k] += layout.strides[d][k];
      if (++index[d] < layout.sizes[d]) return;
      for (std::size_t k = 0; k < N; ++k) p[k] -= layout.sizes[d] * layout.strides[d][k];
      index[d] = 0;
    }
  };
  parallel_for(0, rows * pieces_per_row, grain, [&](std::int64_t first, std::int64_t last) {
    std::vector<std::int64_t> index(layout.sizes.size());
    if (pieces_per_row == 1) {
      Pointers<N> p = row_start(first, index);
      for (std::int64_t r = first; r < last; ++r, next_row(p, index)) row(p, inner, length);
      return;
    }
    for (std::int64_t task = first; task < last; ++task) {
      const std::int64_t start = task % pieces_per_row * piece;
      Pointers<N> p = row_start(task / pieces_per_row, index);
      for (std::size_t k = 0; k < N; ++k) p[k] += start * inner[k];
      row(p, inner, std::min(piece, length - start));
    }
  });
}

template <typename T>
inline T& at(char* p, std::int64_t byte_stride, std::int64_t i) {
  return *reinterpret_cast<T*>(p + i * byte_stride);
}

}  // namespace shardlab::cpu
