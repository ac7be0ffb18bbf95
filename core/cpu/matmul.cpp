// core/cpu/matmul.cpp: batched matmul on shardlab's GEMM (core/cpu/gemm.h), operands read through
// their strides as they are, and a Linear's bias added to the unrounded product.
#include "core/cpu/gemm.h"
#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

// Multiply-adds of one product below which a batch is split over the threads product by product
// (each GEMM then runs on one thread) rather than each product over all of them.
constexpr std::int64_t kSmallProduct = std::int64_t{1} << 22;

template <typename T>
void matmul_typed(const Tensor& a, const Tensor& b, const Tensor& out) {
  const std::int64_t batch = out.size(0), m = out.size(1), n = out.size(2), k = a.size(2);
  const T* a_data = static_cast<const T*>(a.raw_data());
  const T* b_data = static_cast<const T*>(b.raw_data());
  T* out_data = static_cast<T*>(out.raw_data());
  // One B for the whole batch (a Linear's weight) and A's batches one after the other at its row
  // stride: a single [batch * m, k] x [k, n] product, which packs B once.
  if (batch > 1 && b.stride(0) == 0 && a.stride(0) == m * a.stride(1)) {
    return gemm<T>(batch * m, n, k, {a_data, a.stride(1), a.stride(2)}, {b_data, b.stride(1), b.stride(2)},
                   out_data, n, false);
  }
  const auto products = [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) {
      gemm<T>(m, n, k, {a_data + i * a.stride(0), a.stride(1), a.stride(2)},
              {b_data + i * b.stride(0), b.stride(1), b.stride(2)}, out_data + i * m * n, n, false);
    }
  };
  if (batch > 1 && m * n * k < kSmallProduct) return parallel_for(0, batch, 1, products);
  products(0, batch);
}

void matmul(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out) {
  in_f32_precision(
      out,
      [](const Tensor& o, const Tensor& x, const Tensor& y, const Tensor& c) {
        if (o.dtype() == DType::f64) {
          matmul_typed<double>(x, y, o);
        } else {
          matmul_typed<float>(x, y, o);
        }
        // The bias joins the f32 (f64) product before a half's one rounding, as in cuBLASLt's epilogue.
        if (c.defined()) binary(BinaryOp::add, o, c.expand(o.shape()), o);
      },
      a, b, bias);
}

}  // namespace

MatmulKernels matmul_kernels() { return {.matmul = matmul}; }

}  // namespace shardlab::cpu
