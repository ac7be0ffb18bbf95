// core/cpu/gemm.h: internal to core/cpu: shardlab's own GEMM for matmul and conv2d, packed
// register tiles on AVX-512, AVX2 + FMA or plain x86-64, split across the thread pool.
//
// Every element of C is one chain of fused multiply-adds over k in order, started from 0 (or from C
// when accumulating): the bits of the naive loop `c = fma(a[i][p], b[p][j], c)` for p = 0, 1, ...
// The tiles, the cache blocks, the split over threads and the vector width change only which
// elements are computed together, never the order within one, so a product has the same bits
// on 1 thread or 64 and on every instruction set (the plain x86-64 path calls std::fma).
#pragma once

#include <cstdint>

namespace shardlab::cpu {

// A [rows, cols] matrix read through element strides: row-major is (cols, 1), its transpose
// (1, rows); any other strides work too (packing reads them one element at a time).
template <typename T>
struct MatrixView {
  const T* data;
  std::int64_t row_stride;
  std::int64_t col_stride;
};

// A row-major matrix with leading dimension ld, and the transpose of one.
template <typename T>
MatrixView<T> row_major(const T* data, std::int64_t ld) {
  return {data, ld, 1};
}
template <typename T>
MatrixView<T> transposed(const T* data, std::int64_t ld) {
  return {data, 1, ld};
}

// C[m, n] (row-major, leading dimension ldc) = A[m, k] B[k, n], or C + A B when `accumulate`.
// With k = 0 that is C = 0, or C unchanged. Splits over the pool unless called from inside it.
template <typename T>
void gemm(std::int64_t m, std::int64_t n, std::int64_t k, MatrixView<T> a, MatrixView<T> b, T* c,
          std::int64_t ldc, bool accumulate);

extern template void gemm<float>(std::int64_t, std::int64_t, std::int64_t, MatrixView<float>,
                                 MatrixView<float>, float*, std::int64_t, bool);
extern template void gemm<double>(std::int64_t, std::int64_t, std::int64_t, MatrixView<double>,
                                  MatrixView<double>, double*, std::int64_t, bool);

}  // namespace shardlab::cpu
