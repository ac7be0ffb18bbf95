// core/cpu/gemm.h: one typed entry to OpenBLAS GEMM (row-major), for matmul and conv2d.
#pragma once

#include <cblas.h>

#include <cstdint>

namespace shardlab::cpu {

// C[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C, row-major with leading dims.
template <typename T>
void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
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

}  // namespace shardlab::cpu
