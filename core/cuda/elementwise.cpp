// core/cuda/elementwise.cpp: the elementwise kernels' entries: Tensors unpacked into
// core/cuda/elementwise.cu's launchers.
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"
#include "core/op_codes.h"

namespace shardlab::cuda {
namespace {

void cuda_fill(const Tensor& out, Scalar value) {
  const LaunchContext context(out);
  visit_dtype(out.dtype(), [&]<typename T>() {
    const T element = value.as<T>();
    cuda::launch_fill(out.raw_data(), out.dtype(), &element, layout_of<1>("fill", {&out}), context.stream());
  });
}

void cuda_copy(const Tensor& dst, const Tensor& src) {
  const LaunchContext context(dst);
  cuda::launch_copy(src.raw_data(), src.dtype(), dst.raw_data(), dst.dtype(),
                    layout_of<2>("copy", {&src, &dst}), context.stream());
}

// False when the op has no kernel for the dtype.
bool launch_unary_op(UnaryOp op, DType dtype, const void* in, void* out, const cuda::Layout<2>& layout,
                     cudaStream_t stream) {
  if (op == UnaryOp::isfinite) {
    return cuda::launch_isfinite(dtype, in, static_cast<bool*>(out), layout, stream);
  }
  return cuda::launch_unary(op, dtype, in, out, layout, stream);
}

void cuda_unary(UnaryOp op, const Tensor& in, const Tensor& out) {
  const LaunchContext context(out);
  const bool launched = launch_unary_op(op, in.dtype(), in.raw_data(), out.raw_data(),
                                        layout_of<2>(op_name(op), {&in, &out}), context.stream());
  SHARDLAB_CHECK(launched, "{}: no CUDA kernel for dtype {}", op_name(op), dtype_name(in.dtype()));
}

// False when the op has no kernel for the dtype.
bool launch_binary_op(BinaryOp op, DType dtype, const void* a, const void* b, void* out,
                      const cuda::Layout<3>& layout, cudaStream_t stream) {
  if (!is_comparison(op)) return cuda::launch_arithmetic(op, dtype, a, b, out, layout, stream);
  cuda::launch_compare(op, dtype, a, b, static_cast<bool*>(out), layout, stream);
  return true;
}

}  // namespace

void cuda_binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const LaunchContext context(out);
  const bool launched = launch_binary_op(op, a.dtype(), a.raw_data(), b.raw_data(), out.raw_data(),
                                         layout_of<3>(op_name(op), {&a, &b, &out}), context.stream());
  SHARDLAB_CHECK(launched, "{}: no CUDA kernel for dtype {}", op_name(op), dtype_name(a.dtype()));
}

namespace {

void cuda_where(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out) {
  const LaunchContext context(out);
  cuda::launch_where(condition.data<bool>(), out.dtype(), a.raw_data(), b.raw_data(), out.raw_data(),
                     layout_of<4>("where", {&condition, &a, &b, &out}), context.stream());
}

}  // namespace

ElementwiseKernels elementwise_kernels() {
  return {
      .fill = cuda_fill, .copy = cuda_copy, .unary = cuda_unary, .binary = cuda_binary, .where = cuda_where};
}

}  // namespace shardlab::cuda
