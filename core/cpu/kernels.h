// core/cpu/kernels.h: internal to core/cpu: what the families' CPU kernels share: the elementwise copy
// and binary kernels, and computing 16-bit floats in f32 precision.
#pragma once

#include "core/kernels.h"

namespace shardlab::cpu {

// The elementwise kernels other families' kernels use (the rest of each family's are its file's own).
void copy(const Tensor& dst, const Tensor& src);
void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);

inline Tensor as_f32(const Tensor& t) { return t.defined() ? t.to(DType::f32) : t; }

// Runs fn(out32, inputs32...) on f32 copies when `out` is bf16/f16 and writes the result
// back rounded once; runs fn(out, inputs...) otherwise. GEMM-based kernels use it because
// OpenBLAS has no 16-bit GEMM (products accumulate in f32, as cuBLAS does for halves), and
// accumulating kernels so that a sum is not rounded to 8 or 11 bits after every addition.
template <typename Fn, typename... Inputs>
void in_f32_precision(const Tensor& out, Fn fn, const Inputs&... inputs) {
  if (out.dtype() != DType::bf16 && out.dtype() != DType::f16) return fn(out, inputs...);
  const Tensor out32 = out.to(DType::f32);
  fn(out32, as_f32(inputs)...);
  copy(out, out32);
}

}  // namespace shardlab::cpu
