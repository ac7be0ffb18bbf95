// core/cuda/attention.cpp: attention's entries: the fused kernel in f32 and f64, flash attention for halves,
// and which operands they read in place.
#include <cstdint>

#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernel_choice.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

cuda::AttentionGeometry attention_geometry(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                           const AttentionParams& params) {
  SHARDLAB_CHECK(q.size(3) <= cuda::kMaxAttentionHeadDim && v.size(3) <= cuda::kMaxAttentionHeadDim,
                 "{} on cuda: head dims of at most {} (q {}, v {})", op, cuda::kMaxAttentionHeadDim,
                 shape_str(q.shape()), shape_str(v.shape()));
  return {.batch = q.size(0),
          .heads = q.size(1),
          .kv_heads = k.size(1),
          .queries = q.size(2),
          .keys = k.size(2),
          .head_dim = q.size(3),
          .value_dim = v.size(3),
          .causal = params.causal,
          .scale = *params.scale};
}

const bool* padding_of(const AttentionParams& params) {
  return params.padding.defined() ? params.padding.data<bool>() : nullptr;
}

bool is_half(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16; }

// `t`, or a copy of it where its data does not start on 16 bytes (a view's offset), as flash
// attention's 16-byte loads need. The copy is freed after the call, stream-ordered behind the kernel.
Tensor aligned(const Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.raw_data()) % 16 == 0 ? t : t.clone();
}

void cuda_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& params,
                            const AttentionResult& result) {
  const LaunchContext context(q);
  const cuda::AttentionGeometry geometry = attention_geometry("attention", q, k, v, params);
  if (is_half(q.dtype())) {  // core/attention.cpp's attention_kernel sends only the head dims flash attention
                             // takes
    const Tensor q16 = aligned(q), k16 = aligned(k), v16 = aligned(v);
    const cuda::AttentionOperands operands{.q = heads_in(q16),
                                           .k = heads_in(k16),
                                           .v = heads_in(v16),
                                           .padding = padding_of(params),
                                           .logsumexp = result.logsumexp.raw_data()};
    SHARDLAB_CHECK(cuda::launch_flash_attention_forward(q.dtype(), operands, geometry, heads_out(result.out),
                                                        context.stream()),
                   "attention: flash attention does not take {} with head dims {} and {}",
                   dtype_name(q.dtype()), q.size(3), v.size(3));
    return;
  }
  const cuda::AttentionOperands operands{.q = heads_in(q),
                                         .k = heads_in(k),
                                         .v = heads_in(v),
                                         .padding = padding_of(params),
                                         .logsumexp = result.logsumexp.raw_data()};
  SHARDLAB_CHECK(
      cuda::launch_attention_forward(q.dtype(), operands, geometry, heads_out(result.out), context.stream()),
      "attention: no CUDA kernel for {}", dtype_name(q.dtype()));
}

void cuda_attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionResult& forward, const AttentionParams& params,
                             const AttentionGrads& grads) {
  const LaunchContext context(q);
  const cuda::AttentionGeometry geometry = attention_geometry("attention_backward", q, k, v, params);
  const bool half = is_half(q.dtype());
  const auto operand = [half](const Tensor& t) { return half ? aligned(t) : t; };
  const Tensor dout = operand(grad_out), q_in = operand(q), k_in = operand(k), v_in = operand(v),
               out = operand(forward.out);
  // f32 for the flash kernels, the compute dtype of the fused ones.
  const Tensor delta =
      empty(forward.logsumexp.shape(), TensorOptions{half ? DType::f32 : q.dtype(), q.device()});
  const cuda::AttentionOperands operands{.q = heads_in(q_in),
                                         .k = heads_in(k_in),
                                         .v = heads_in(v_in),
                                         .out = heads_in(out),
                                         .grad_out = heads_in(dout),
                                         .padding = padding_of(params),
                                         .logsumexp = forward.logsumexp.raw_data(),
                                         .delta = delta.raw_data(),
                                         .grad_q = heads_out(grads.q),
                                         .grad_k = heads_out(grads.k),
                                         .grad_v = heads_out(grads.v)};
  if (half) {
    SHARDLAB_CHECK(cuda::launch_flash_attention_backward(q.dtype(), operands, geometry, context.stream()),
                   "attention_backward: flash attention does not take {} with head dims {} and {}",
                   dtype_name(q.dtype()), q.size(3), v.size(3));
    return;
  }
  SHARDLAB_CHECK(cuda::launch_attention_backward(q.dtype(), operands, geometry, context.stream()),
                 "attention_backward: no CUDA kernel for {}", dtype_name(q.dtype()));
}

}  // namespace

AttentionKernels attention_kernels() {
  return {.attention_forward = cuda_attention_forward,
          .attention_backward = cuda_attention_backward,
          .strided_heads = [](const Tensor& t) { return cuda_takes_heads_in_place(layout_of(t)); }};
}

}  // namespace shardlab::cuda
