// core/cuda/transformer.cpp: the Llama block's fused kernels' entries: RMSNorm, SwiGLU, rotary.
#include "core/column_sums.h"
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

void cuda_rms_norm_forward(const Tensor& x, const Tensor& added, const Tensor& weight, double eps,
                           const Tensor& sum, const Tensor& out, const Tensor& rstd) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1);
  const auto data_or_null = [](const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; };
  SHARDLAB_CHECK(cuda::launch_rms_norm(x.dtype(), x.raw_data(), data_or_null(added), weight.raw_data(), eps,
                                       x.numel() / width, width, data_or_null(sum), out.raw_data(),
                                       rstd.raw_data(), context.stream()),
                 "rms_norm: no CUDA kernel for {}", dtype_name(x.dtype()));
}

void cuda_rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            const Tensor& grad_x, const Tensor& grad_weight) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1), rows = x.numel() / width;
  const Tensor partials = empty({column_chunks(rows), width}, TensorOptions{DType::f64, x.device()});
  SHARDLAB_CHECK(
      cuda::launch_rms_norm_backward(x.dtype(), grad_out.raw_data(), x.raw_data(), weight.raw_data(),
                                     rstd.raw_data(), rows, width, grad_x.raw_data(), grad_weight.raw_data(),
                                     partials.data<double>(), context.stream()),
      "rms_norm_backward: no CUDA kernel for {}", dtype_name(x.dtype()));
}

void cuda_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  const LaunchContext context(gate);
  SHARDLAB_CHECK(cuda::launch_swiglu(gate.dtype(), gate.raw_data(), up.raw_data(), gate.numel(),
                                     out.raw_data(), context.stream()),
                 "swiglu: no CUDA kernel for {}", dtype_name(gate.dtype()));
}

void cuda_swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up,
                          const Tensor& grad_gate, const Tensor& grad_up) {
  const LaunchContext context(gate);
  SHARDLAB_CHECK(
      cuda::launch_swiglu_backward(gate.dtype(), grad_out.raw_data(), gate.raw_data(), up.raw_data(),
                                   gate.numel(), grad_gate.raw_data(), grad_up.raw_data(), context.stream()),
      "swiglu_backward: no CUDA kernel for {}", dtype_name(gate.dtype()));
}

void cuda_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const Tensor& out) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1);
  SHARDLAB_CHECK(cuda::launch_rotary(x.dtype(), heads_in(x), cos.raw_data(), sin.raw_data(),
                                     x.numel() / width, x.dim() == 4 ? x.size(1) : 1, x.size(-2), width,
                                     transpose, heads_out(out), context.stream()),
                 "rotary_embedding: no CUDA kernel for {}", dtype_name(x.dtype()));
}

}  // namespace

TransformerKernels transformer_kernels() {
  return {.rms_norm_forward = cuda_rms_norm_forward,
          .rms_norm_backward = cuda_rms_norm_backward,
          .swiglu_forward = cuda_swiglu_forward,
          .swiglu_backward = cuda_swiglu_backward,
          .rotary = cuda_rotary};
}

}  // namespace shardlab::cuda
