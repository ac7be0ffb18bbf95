// core/cpu/gemm.h: internal to core/cpu: one typed entry to OpenBLAS GEMM (row-major) for matmul
// and conv2d, split across shardlab's thread pool.
//
// OpenBLAS runs single-threaded (core/parallel.cpp): its own worker threads spin-wait after
// every call (sched_yield for ~2^28 cycles), which steals the cores from the pool threads
// running the elementwise kernels in between GEMMs. Instead each pool thread runs its own
// single-threaded GEMM on a block of C's rows or columns.
//
// The blocks depend on the shape alone, never on the thread count: OpenBLAS's kernels for
// Haswell, Zen and older processors round an element of C differently depending on where it falls
// in the call (its driver computes the first panel of rows unlike the later ones), so a block
// computed on its own does not always have the bits of the same rows inside a larger call. With
// the same calls whatever the thread count, a product has the same bits on 1 thread or 64.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdint>

#include "core/parallel.h"

namespace shardlab::cpu {

template <typename T>
void gemm_block(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  const auto ta = transpose_a ? CblasTrans : CblasNoTrans;
  const auto tb = transpose_b ? CblasTrans : CblasNoTrans;
  const auto i = [](std::int64_t v) { return static_cast<blasint>(v); };
  if constexpr (sizeof(T) == 8) {
    cblas_dgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  } else {
    cblas_sgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  }
}

// Multiply-adds a block must have before a GEMM is cut: the default, and for GEMMs whose caller
// already splits its work over the threads (conv2d's images), which cut only very large ones.
inline constexpr std::int64_t kBlockWork = std::int64_t{1} << 20;
inline constexpr std::int64_t kLargeBlockWork = std::int64_t{1} << 26;

// C[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C, row-major with leading dims, in blocks of
// C's rows or columns of at least 128 and `min_block_work` multiply-adds. Each call packs all of
// the operand the blocks share: 128 keeps that to a few percent of a single call's time.
template <typename T>
void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
          const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc,
          std::int64_t min_block_work = kBlockWork) {
  constexpr std::int64_t kMinBlock = 128;
  const bool split_rows = m >= n;
  const std::int64_t extent = split_rows ? m : n;
  const std::int64_t blocks =
      std::max<std::int64_t>(1, std::min(extent / kMinBlock, m * n * k / min_block_work));
  if (blocks == 1) return gemm_block(transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  parallel_for(0, blocks, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t block = first; block < last; ++block) {
      const std::int64_t lo = extent * block / blocks, hi = extent * (block + 1) / blocks;
      if (split_rows) {
        // Rows lo..hi of op(A): row r of A, or column r of A when transposed.
        const T* a_rows = a + (transpose_a ? lo : lo * lda);
        gemm_block(transpose_a, transpose_b, hi - lo, n, k, alpha, a_rows, lda, b, ldb, beta, c + lo * ldc,
                   ldc);
      } else {
        // Columns lo..hi of op(B): column c of B, or row c of B when transposed.
        const T* b_columns = b + (transpose_b ? lo * ldb : lo);
        gemm_block(transpose_a, transpose_b, m, hi - lo, k, alpha, a, lda, b_columns, ldb, beta, c + lo, ldc);
      }
    }
  });
}

}  // namespace shardlab::cpu
