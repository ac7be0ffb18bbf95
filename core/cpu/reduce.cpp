// core/cpu/reduce.cpp: CPU reductions over any set of dims (sum, mean, sum of squares, max,
// min, argmax), one output element per task, each accumulated in a fixed order so results are
// deterministic.
#include <array>
#include <cmath>
#include <type_traits>

#include "core/cpu/isa.h"
#include "core/cpu/kernels.h"
#include "core/cpu/loops.h"
#include "core/parallel.h"
#include "core/square_sums.h"

namespace shardlab::cpu {
namespace {

// Floating values accumulate in double and integers in int64, whatever the input width.
template <typename T>
using accumulate_t = std::conditional_t<std::is_floating_point_v<compute_t<T>>, double, std::int64_t>;

template <typename A>
bool is_nan(A value) {
  if constexpr (std::is_floating_point_v<A>) return std::isnan(value);
  return false;
}

// Walks the reduced sub-block of one output element in row-major order of the reduced dims.
struct ReducedBlock {
  std::vector<std::int64_t> sizes;    // coalesced
  std::vector<std::int64_t> strides;  // bytes

  template <typename Visit>
  void for_each(const char* base, Visit&& visit) const {
    if (sizes.empty()) return visit(base, std::int64_t{0});
    std::int64_t position = 0;
    for_each_row(base, [&](const char* row, std::int64_t inner, std::int64_t inner_stride) {
      for (std::int64_t i = 0; i < inner; ++i) visit(row + i * inner_stride, position++);
    });
  }

  // visit_row(row, length, byte stride) for each innermost row, in order; sizes must not be empty.
  template <typename VisitRow>
  void for_each_row(const char* base, VisitRow&& visit_row) const {
    std::vector<std::int64_t> counter(sizes.size(), 0);
    const std::int64_t inner = sizes.back(), inner_stride = strides.back();
    for (;;) {
      const char* row = base;
      for (std::size_t d = 0; d + 1 < sizes.size(); ++d) row += counter[d] * strides[d];
      visit_row(row, inner, inner_stride);
      std::size_t d = sizes.size() - 1;
      for (;;) {
        if (d == 0) return;
        --d;
        if (++counter[d] < sizes[d]) break;
        counter[d] = 0;
      }
    }
  }
};

// The sum (or sum of squares) of a contiguous f32 row in double, in 8 interleaved partial sums
// added in a fixed order: vectorisable (built for AVX-512, AVX2 and the baseline: core/cpu/isa.h)
// and the same result on every run and thread count. One loop per mode: with the choice inside,
// the compiler kept the eight partial sums in scalar registers.
template <bool kSquares>
[[gnu::always_inline]] inline double sum_row_lanes(const float* row, std::int64_t n) {
  constexpr std::int64_t kLanes = 8;
  double partial[kLanes] = {};
  const std::int64_t whole = n / kLanes * kLanes;
  for (std::int64_t i = 0; i < whole; i += kLanes) {
    for (std::int64_t lane = 0; lane < kLanes; ++lane) {
      const double v = row[i + lane];
      partial[lane] += kSquares ? v * v : v;
    }
  }
  double total = 0;
  for (const double p : partial) total += p;
  for (std::int64_t i = whole; i < n; ++i) {
    const double v = row[i];
    total += kSquares ? v * v : v;
  }
  return total;
}

SHARDLAB_CPU_CLONES(double, sum_row_f32, (const float* row, std::int64_t n, bool squares),
                    (row, n, squares)) {
  return squares ? sum_row_lanes<true>(row, n) : sum_row_lanes<false>(row, n);
}

// The smallest (kMin) or largest element of a contiguous i64 row folded into acc: no NaN and no
// index to track, so a plain loop the compiler vectorises (index checks run it over every index;
// 64-bit integer min/max needs AVX-512 or AVX2's compare-and-blend, hence the clones).
template <bool kMin>
[[gnu::always_inline]] inline std::int64_t extreme_of_row(const std::int64_t* row, std::int64_t n,
                                                          std::int64_t acc) {
  for (std::int64_t i = 0; i < n; ++i) acc = kMin ? std::min(acc, row[i]) : std::max(acc, row[i]);
  return acc;
}

SHARDLAB_CPU_CLONES(std::int64_t, extreme_of_i64_row,
                    (const std::int64_t* row, std::int64_t n, std::int64_t acc, bool smallest),
                    (row, n, acc, smallest)) {
  return smallest ? extreme_of_row<true>(row, n, acc) : extreme_of_row<false>(row, n, acc);
}

template <typename T, typename Out>
void reduce_typed(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out) {
  using A = accumulate_t<T>;
  // Kept dims index the outputs (out is contiguous in kept-dim order); reduced dims form
  // the block each output walks. Reduced dims stay in order so argmax counts row-major.
  std::vector<std::int64_t> kept_sizes, kept_strides;
  ReducedBlock block;
  const std::int64_t esize = static_cast<std::int64_t>(in.element_size());
  for (std::int64_t d = 0; d < in.dim(); ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    auto& sizes = reduced ? block.sizes : kept_sizes;
    auto& strides = reduced ? block.strides : kept_strides;
    if (reduced && in.size(d) == 1) continue;
    sizes.push_back(in.size(d));
    strides.push_back(in.stride(d) * esize);
  }
  for (std::size_t d = block.sizes.size(); d-- > 1;) {  // merge reduced dims contiguous in memory
    if (block.strides[d - 1] == block.strides[d] * block.sizes[d]) {
      block.sizes[d - 1] *= block.sizes[d];
      block.strides[d - 1] = block.strides[d];
      block.sizes.erase(block.sizes.begin() + d);
      block.strides.erase(block.strides.begin() + d);
    }
  }
  std::int64_t count = 1;
  for (const std::int64_t s : block.sizes) count *= s;
  const char* base = static_cast<const char*>(in.raw_data());
  Out* result = static_cast<Out*>(out.raw_data());
  const std::int64_t outputs = out.numel();
  const std::int64_t grain = std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(count, 1));
  const bool contiguous_rows = count > 0 && !block.sizes.empty() && block.strides.back() == esize;
  // Over contiguous innermost rows, a sum takes sum_row_f32's path (for f32) and a min or max
  // extreme_of_i64_row's (for i64).
  [[maybe_unused]] const bool contiguous_sum =
      (op == ReduceOp::sum || op == ReduceOp::mean || op == ReduceOp::sum_squares) && contiguous_rows;
  [[maybe_unused]] const bool contiguous_extreme =
      (op == ReduceOp::min || op == ReduceOp::max) && contiguous_rows;
  parallel_for(0, outputs, grain, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t o = first; o < last; ++o) {
      const char* start = base;
      std::int64_t rest = o;
      for (std::size_t d = kept_sizes.size(); d-- > 0;) {
        start += (rest % kept_sizes[d]) * kept_strides[d];
        rest /= kept_sizes[d];
      }
      const auto value_at = [](const char* p) {
        return static_cast<A>(widen(*reinterpret_cast<const T*>(p)));
      };
      A acc = 0;
      std::int64_t best_index = 0;
      bool first_seen = false;
      if constexpr (std::is_same_v<T, float>) {
        if (contiguous_sum) {
          block.for_each_row(start, [&](const char* row, std::int64_t length, std::int64_t) {
            acc += sum_row_f32(reinterpret_cast<const float*>(row), length, op == ReduceOp::sum_squares);
          });
          result[o] = narrow<Out>(op == ReduceOp::mean ? acc / static_cast<double>(count) : acc);
          continue;
        }
      }
      if constexpr (std::is_same_v<T, std::int64_t>) {
        if (contiguous_extreme) {
          std::int64_t extreme = *reinterpret_cast<const std::int64_t*>(start);
          block.for_each_row(start, [&](const char* row, std::int64_t length, std::int64_t) {
            extreme = extreme_of_i64_row(reinterpret_cast<const std::int64_t*>(row), length, extreme,
                                         op == ReduceOp::min);
          });
          result[o] = narrow<Out>(extreme);
          continue;
        }
      }
      if (count > 0)
        block.for_each(start, [&](const char* p, std::int64_t position) {
          const A v = value_at(p);
          switch (op) {
            case ReduceOp::sum:
            case ReduceOp::mean:
              acc += v;
              break;
            case ReduceOp::sum_squares:
              acc += v * v;
              break;
            case ReduceOp::max:
            case ReduceOp::min:
            case ReduceOp::argmax: {
              // NaN wins and stays; otherwise strictly better replaces (first index on ties).
              const bool better = op == ReduceOp::min ? v < acc : v > acc;
              if (!first_seen || (!is_nan(acc) && (is_nan(v) || better))) {
                acc = v;
                best_index = position;
              }
              first_seen = true;
              break;
            }
          }
        });
      if (op == ReduceOp::argmax) {
        result[o] = narrow<Out>(best_index);
      } else if (op == ReduceOp::mean) {
        result[o] = narrow<Out>(static_cast<double>(acc) / static_cast<double>(count));
      } else {
        result[o] = narrow<Out>(acc);
      }
    }
  });
}

void reduce(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out) {
  visit_dtype(in.dtype(), [&]<typename T>() {
    visit_dtype(out.dtype(), [&]<typename Out>() {
      // Only the pairs the op layer produces: same dtype, or i64 for sums and argmax.
      if constexpr (std::is_same_v<T, Out> || std::is_same_v<Out, std::int64_t>) {
        reduce_typed<T, Out>(op, in, dims, out);
      } else {
        fail("{}: no CPU kernel from {} to {}", op_name(op), dtype_name(in.dtype()), dtype_name(out.dtype()));
      }
    });
  });
}

// Chunk `chunk` of a tensor's elements: its squares dealt to the lanes, folded.
template <typename T>
double chunk_squares(const T* data, std::int64_t numel, std::int64_t chunk) {
  std::array<double, kSquareLanes> lanes{};
  const std::int64_t begin = chunk * kSquareChunk, end = std::min(begin + kSquareChunk, numel);
  for (std::int64_t i = begin; i < end; ++i) {
    double& lane = lanes[static_cast<std::size_t>((i - begin) % kSquareLanes)];
    lane = add_square(lane, static_cast<double>(widen(data[i])));
  }
  return fold_lanes(lanes.data());
}

void foreach_sum_squares(std::span<const Tensor> tensors, const Tensor& out) {
  // Every chunk's partial at once, in the tensors' order; then the partials dealt to lanes and folded.
  std::vector<std::pair<const Tensor*, std::int64_t>> chunks;  // (tensor, chunk within it)
  for (const Tensor& t : tensors) {
    for (std::int64_t c = 0; c < square_chunks(t.numel()); ++c) chunks.emplace_back(&t, c);
  }
  std::vector<double> partials(chunks.size());
  parallel_for(0, static_cast<std::int64_t>(chunks.size()), 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t c = begin; c < end; ++c) {
      const Tensor& tensor = *chunks[static_cast<std::size_t>(c)].first;
      const std::int64_t chunk = chunks[static_cast<std::size_t>(c)].second;
      visit_dtype(tensor.dtype(), [&]<typename T>() {
        if constexpr (std::is_floating_point_v<compute_t<T>>) {
          partials[static_cast<std::size_t>(c)] = chunk_squares(tensor.data<T>(), tensor.numel(), chunk);
        }
      });
    }
  });
  std::array<double, kSquareLanes> lanes{};
  for (std::size_t p = 0; p < partials.size(); ++p) lanes[p % kSquareLanes] += partials[p];
  *out.data<double>() = fold_lanes(lanes.data());
}

}  // namespace

ReductionKernels reduction_kernels() {
  return {.reduce = reduce, .foreach_sum_squares = foreach_sum_squares};
}

}  // namespace shardlab::cpu
