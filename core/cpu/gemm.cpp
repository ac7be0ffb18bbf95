// core/cpu/gemm.cpp: the GEMM's cache blocks, packing and split over threads around the register
// tiles of core/cpu/gemm_tiles.h.
#include "core/cpu/gemm.h"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>

#include "core/cpu/gemm_tiles.h"
#include "core/cpu/transpose.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

// Multiply-adds below which a GEMM stays on the calling thread: waking the pool costs more.
constexpr std::int64_t kMinParallelWork = std::int64_t{1} << 18;

// The cache blocks: a depth block of k (a tile's rows of A over it, 12 KiB in f32, stay in L1 while
// B's panel streams past them), a panel of B over a depth block (stays in L2: half of a 2 MiB L2,
// or most of a 1 MiB one, with room for A), and a block of A's rows packed at a time (the pack
// buffer's size).
constexpr std::int64_t kDepthBytes = 1024;
constexpr std::int64_t kPanelOfBBytes = 1024 * 1024;
constexpr std::int64_t kBlockOfABytes = 192 * 1024;
template <typename T>
constexpr std::int64_t kLineElements = 64 / sizeof(T);

// A per-thread buffer of 64-byte aligned elements that only grows.
template <typename T>
T* scratch(std::unique_ptr<T[], void (*)(T*)>& buffer, std::int64_t& capacity, std::int64_t elements) {
  if (capacity < elements) {
    buffer = {static_cast<T*>(::operator new[](elements * sizeof(T), std::align_val_t{64})),
              [](T* p) { ::operator delete[](p, std::align_val_t{64}); }};
    capacity = elements;
  }
  return buffer.get();
}

template <typename T>
struct PackBuffers {
  std::unique_ptr<T[], void (*)(T*)> a{nullptr, nullptr}, b{nullptr, nullptr};
  std::int64_t a_capacity = 0, b_capacity = 0;
};

template <typename T>
PackBuffers<T>& pack_buffers() {
  thread_local PackBuffers<T> buffers;
  return buffers;
}

// Packs `lines` lines (stride line_stride: columns of B) over `depth` steps of k
// (stride step_stride) into panels of `width` lines, zero past the last line: panel q holds, step
// after step, the values of its `width` lines. Walks the source along its unit stride.
template <typename T>
void pack_panels(const T* __restrict src, std::int64_t lines, std::int64_t depth, std::int64_t line_stride,
                 std::int64_t step_stride, int width, T* __restrict out) {
  for (std::int64_t first = 0; first < lines; first += width, out += width * depth) {
    const std::int64_t count = std::min<std::int64_t>(width, lines - first);
    const T* panel_src = src + first * line_stride;
    if (step_stride == 1) {
      transpose_block(panel_src, line_stride, count, depth, out, width);
    } else {
      for (std::int64_t p = 0; p < depth; ++p) {
        const T* from = panel_src + p * step_stride;
        for (std::int64_t line = 0; line < count; ++line) out[p * width + line] = from[line * line_stride];
      }
    }
    if (count < width) {
      for (std::int64_t p = 0; p < depth; ++p)
        std::fill(out + p * width + count, out + (p + 1) * width, T(0));
    }
  }
}

// A block of A's rows as the tiles read it: element (r, p) at data[r * row_stride + p * step_stride].
template <typename T>
struct PackedRows {
  const T* data;
  std::int64_t row_stride, step_stride;
};

// Copies rows [0, rows) x steps [0, depth) of A into `out` along A's unit stride (a row after
// another, or a step after another). Rows are laid one cache line longer than `depth` apart, so
// that rows of a power-of-two length do not all fall in the same L1 sets.
template <typename T>
PackedRows<T> pack_rows(MatrixView<T> a, std::int64_t rows, std::int64_t depth, T* __restrict out) {
  if (a.row_stride == 1) {
    for (std::int64_t p = 0; p < depth; ++p) std::copy_n(a.data + p * a.col_stride, rows, out + p * rows);
    return {out, 1, rows};
  }
  const std::int64_t ld = depth + kLineElements<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* __restrict from = a.data + r * a.row_stride;
    T* to = out + r * ld;
    if (a.col_stride == 1) {
      std::copy_n(from, depth, to);
    } else {
      for (std::int64_t p = 0; p < depth; ++p) to[p] = from[p * a.col_stride];
    }
  }
  return {out, ld, 1};
}

// One tile of C at `c` with `rows` x `cols` of it inside C: a tile cut by C's right edge runs on
// a full-width copy (B's panel is zero there); one cut by the bottom edge has fewer rows.
template <typename T>
void run_tile(const TileKernel<T>& kernel, std::int64_t depth, PackedRows<T> a, const T* b, T* c,
              std::int64_t ldc, std::int64_t rows, std::int64_t cols, bool from_c) {
  const typename TileKernel<T>::Run run = kernel.runs[rows - 1];
  if (cols == kernel.cols) return run(depth, a.data, a.row_stride, a.step_stride, b, c, ldc, from_c);
  T tile[kMaxTileRows * kMaxTileCols];
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) tile[r * kernel.cols + j] = from_c ? c[r * ldc + j] : T(0);
  }
  run(depth, a.data, a.row_stride, a.step_stride, b, tile, kernel.cols, from_c);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) c[r * ldc + j] = tile[r * kernel.cols + j];
  }
}

// Whether the tiles read A's rows where they are: rows in unit stride whose length in bytes is not
// a multiple of 2 KiB (12 rows 4 KiB apart would share one set of L1's 12 ways with B's stream).
template <typename T>
bool reads_a_in_place(MatrixView<T> a) {
  return a.col_stride == 1 && a.row_stride * static_cast<std::int64_t>(sizeof(T)) % 2048 != 0;
}

// C[m, n] = (accumulate ? C : 0) + A B on the calling thread, block after block: a panel of B
// (a depth block of k by up to kPanelOfBBytes of columns), then blocks of A's rows against it,
// each tile of rows against every tile of the panel's columns in turn.
template <typename T>
void gemm_serial(std::int64_t m, std::int64_t n, std::int64_t k, MatrixView<T> a, MatrixView<T> b, T* c,
                 std::int64_t ldc, bool accumulate, const TileKernel<T>& kernel) {
  // k in equal depth blocks of at most kDepthBytes: 288 as 144 + 144, not 256 + a short 32 whose
  // tiles would reload and store C for a few steps each.
  const std::int64_t depth_limit = kDepthBytes / static_cast<std::int64_t>(sizeof(T));
  const std::int64_t depth_blocks = (k + depth_limit - 1) / depth_limit;
  const std::int64_t depth_max = (k + depth_blocks - 1) / depth_blocks;
  const std::int64_t block_rows =
      std::max<std::int64_t>(1, kBlockOfABytes / (depth_max * sizeof(T)) / kernel.rows) * kernel.rows;
  const std::int64_t panel_cols =
      std::max<std::int64_t>(1, kPanelOfBBytes / (depth_max * sizeof(T)) / kernel.cols) * kernel.cols;
  PackBuffers<T>& buffers = pack_buffers<T>();
  T* packed_a = scratch(buffers.a, buffers.a_capacity, block_rows * (depth_max + kLineElements<T>));
  const bool in_place = reads_a_in_place(a);
  T* packed_b = scratch(buffers.b, buffers.b_capacity, panel_cols * depth_max);
  for (std::int64_t col0 = 0; col0 < n; col0 += panel_cols) {
    const std::int64_t cols = std::min(panel_cols, n - col0);
    for (std::int64_t p0 = 0; p0 < k; p0 += depth_max) {
      const std::int64_t depth = std::min(depth_max, k - p0);
      const bool from_c = accumulate || p0 > 0;  // later steps continue each element's chain
      pack_panels(b.data + p0 * b.row_stride + col0 * b.col_stride, cols, depth, b.col_stride, b.row_stride,
                  kernel.cols, packed_b);
      for (std::int64_t row0 = 0; row0 < m; row0 += block_rows) {
        const std::int64_t rows = std::min(block_rows, m - row0);
        const MatrixView<T> a_block{a.data + row0 * a.row_stride + p0 * a.col_stride, a.row_stride,
                                    a.col_stride};
        const PackedRows<T> block = in_place ? PackedRows<T>{a_block.data, a.row_stride, 1}
                                             : pack_rows(a_block, rows, depth, packed_a);
        for (std::int64_t i = 0; i < rows; i += kernel.rows) {
          const PackedRows<T> tile_rows{block.data + i * block.row_stride, block.row_stride,
                                        block.step_stride};
          for (std::int64_t j = 0; j < cols; j += kernel.cols) {
            run_tile(kernel, depth, tile_rows, packed_b + j * depth, c + (row0 + i) * ldc + col0 + j, ldc,
                     std::min<std::int64_t>(kernel.rows, rows - i),
                     std::min<std::int64_t>(kernel.cols, cols - j), from_c);
          }
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void gemm(std::int64_t m, std::int64_t n, std::int64_t k, MatrixView<T> a, MatrixView<T> b, T* c,
          std::int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) {
      for (std::int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, T(0));
    }
    return;
  }
  const TileKernel<T> kernel = tile_kernel<T>(kernel_isa());
  // Each thread takes a band of C's rows (or columns, when C is wider than tall) in whole tiles,
  // and packs what it reads itself: one wake-up of the pool per GEMM.
  const bool split_rows = m >= n;
  const std::int64_t unit = split_rows ? kernel.rows : kernel.cols;
  const std::int64_t units = ((split_rows ? m : n) + unit - 1) / unit;
  const std::int64_t bands = m * n * k < kMinParallelWork ? 1 : std::min<std::int64_t>(num_threads(), units);
  if (bands <= 1) return gemm_serial(m, n, k, a, b, c, ldc, accumulate, kernel);
  parallel_for(0, bands, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t band = first; band < last; ++band) {
      const std::int64_t lo = std::min(units * band / bands * unit, split_rows ? m : n);
      const std::int64_t hi = std::min(units * (band + 1) / bands * unit, split_rows ? m : n);
      if (split_rows) {
        const MatrixView<T> a_rows{a.data + lo * a.row_stride, a.row_stride, a.col_stride};
        gemm_serial(hi - lo, n, k, a_rows, b, c + lo * ldc, ldc, accumulate, kernel);
      } else {
        const MatrixView<T> b_cols{b.data + lo * b.col_stride, b.row_stride, b.col_stride};
        gemm_serial(m, hi - lo, k, a, b_cols, c + lo, ldc, accumulate, kernel);
      }
    }
  });
}

template void gemm<float>(std::int64_t, std::int64_t, std::int64_t, MatrixView<float>, MatrixView<float>,
                          float*, std::int64_t, bool);
template void gemm<double>(std::int64_t, std::int64_t, std::int64_t, MatrixView<double>, MatrixView<double>,
                           double*, std::int64_t, bool);

}  // namespace shardlab::cpu
