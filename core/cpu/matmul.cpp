// core/cpu/matmul.cpp: batched matmul on OpenBLAS (sgemm/dgemm), any operand strides that
// BLAS can take directly; others are made contiguous first.
#include <algorithm>
#include <optional>

#include "core/cpu/gemm.h"
#include "core/cpu/kernels.h"

namespace shardlab::cpu {
namespace {

// How BLAS reads a [rows, cols] matrix with element strides (row_stride, col_stride).
struct BlasOperand {
  bool transposed;
  std::int64_t leading;
};

std::optional<BlasOperand> blas_layout(std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                       std::int64_t col_stride) {
  // Strides of size-1 dims are arbitrary; pick the ones BLAS expects.
  if (rows == 1) row_stride = std::max<std::int64_t>(cols, 1);
  if (cols == 1) col_stride = 1;
  if (col_stride == 1 && row_stride >= std::max<std::int64_t>(cols, 1)) return BlasOperand{false, row_stride};
  if (row_stride == 1 && col_stride >= std::max<std::int64_t>(rows, 1)) return BlasOperand{true, col_stride};
  return std::nullopt;
}

template <typename T>
void matmul_typed(const Tensor& a_in, const Tensor& b_in, const Tensor& out) {
  const std::int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a_in.size(2);
  Tensor a = a_in, b = b_in;
  auto a_layout = blas_layout(m, k, a.stride(1), a.stride(2));
  if (!a_layout) {
    a = a.contiguous();
    a_layout = blas_layout(m, k, a.stride(1), a.stride(2));
  }
  auto b_layout = blas_layout(k, n, b.stride(1), b.stride(2));
  if (!b_layout) {
    b = b.contiguous();
    b_layout = blas_layout(k, n, b.stride(1), b.stride(2));
  }
  const T* a_data = static_cast<const T*>(a.raw_data());
  const T* b_data = static_cast<const T*>(b.raw_data());
  T* out_data = static_cast<T*>(out.raw_data());
  for (std::int64_t i = 0; i < batch; ++i) {
    gemm<T>(a_layout->transposed, b_layout->transposed, m, n, k, T(1), a_data + i * a.stride(0),
            a_layout->leading, b_data + i * b.stride(0), b_layout->leading, T(0), out_data + i * m * n, n);
  }
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (a.size(2) == 0) {  // an empty sum: BLAS may leave C untouched
    fill(out, 0);
    return;
  }
  in_f32_precision(
      out,
      [](const Tensor& o, const Tensor& x, const Tensor& y) {
        if (o.dtype() == DType::f64) return matmul_typed<double>(x, y, o);
        matmul_typed<float>(x, y, o);
      },
      a, b);
}

}  // namespace shardlab::cpu
