// core/cuda/table.cpp: the CUDA kernel table (core/kernels.h): unpacks Tensors into the plain
// launchers of core/cuda/launch.h, on the tensors' device and its current stream.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/column_sums.h"
#include "core/cuda/check.h"
#include "core/cuda/cudnn_conv.h"
#include "core/cuda/gemm.h"
#include "core/cuda/launch.h"
#include "core/cuda/runtime.h"
#include "core/kernel_choice.h"
#include "core/kernels.h"
#include "core/square_sums.h"

namespace shardlab {
namespace {

// Where a kernel for tensors on `device` runs: on that device (kernels launch on the current
// device, which need not be theirs: rank r of mpirun uses cuda:r), in this thread's current
// stream of it.
class LaunchContext {
 public:
  explicit LaunchContext(const Tensor& tensor)
      : stream_(static_cast<cudaStream_t>(cuda::current_stream(tensor.device().index).handle())),
        guard_(tensor.device().index) {}
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;  // first: current_stream checks the device before the guard selects it
  cuda::DeviceGuard guard_;
};

// The launchers' Layout of N operands of one shape (the last is the output): the merged dims of
// elementwise_layout (core/kernel_choice.h), at most kMaxDims of them.
template <int N>
cuda::Layout<N> layout_of(const char* op, const std::array<const Tensor*, N>& operands) {
  std::vector<OperandLayout> layouts;
  for (const Tensor* operand : operands) layouts.push_back(layout_of(*operand));
  const ElementwiseLayout merged = elementwise_layout(layouts);
  cuda::Layout<N> layout;
  layout.numel = merged.numel;
  SHARDLAB_CHECK(merged.sizes.size() <= static_cast<std::size_t>(cuda::kMaxDims),
                 "{} on cuda: the operands of shape {} need {} dimensions after merging the "
                 "contiguous ones, and CUDA kernels index at most {}; make them contiguous first",
                 op, shape_str(operands[N - 1]->shape()), merged.sizes.size(), cuda::kMaxDims);
  layout.rank = static_cast<int>(merged.sizes.size());
  for (int d = 0; d < layout.rank; ++d) {
    layout.sizes[d] = merged.sizes[d];
    for (int k = 0; k < N; ++k) layout.strides[k][d] = merged.strides[d][k];
  }
  layout.packed = merged.packed;
  layout.narrow_index = merged.narrow_index;
  return layout;
}

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

void cuda_binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const LaunchContext context(out);
  const bool launched = launch_binary_op(op, a.dtype(), a.raw_data(), b.raw_data(), out.raw_data(),
                                         layout_of<3>(op_name(op), {&a, &b, &out}), context.stream());
  SHARDLAB_CHECK(launched, "{}: no CUDA kernel for dtype {}", op_name(op), dtype_name(a.dtype()));
}

void cuda_where(const Tensor& condition, const Tensor& a, const Tensor& b, const Tensor& out) {
  const LaunchContext context(out);
  cuda::launch_where(condition.data<bool>(), out.dtype(), a.raw_data(), b.raw_data(), out.raw_data(),
                     layout_of<4>("where", {&condition, &a, &b, &out}), context.stream());
}

void cuda_random(const RandomSpec& spec, const Tensor& out) {
  SHARDLAB_CHECK(out.is_contiguous(), "random draws on cuda: the output must be contiguous");
  const LaunchContext context(out);
  const cuda::PhiloxDraw draw{spec.distribution,
                              spec.key.seed,
                              spec.key.stream,
                              static_cast<std::uint64_t>(spec.first_index),
                              spec.a,
                              spec.b};
  cuda::launch_random(out.dtype(), out.raw_data(), out.numel(), draw, context.stream());
}

// The CPU kernel's contract allows any strides for `in`; the kernel reads a contiguous copy.
void cuda_softmax(const Tensor& in, std::int64_t dim, bool log, const Tensor& out) {
  const LaunchContext context(out);
  const Tensor x = in.contiguous();
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (std::int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
  SHARDLAB_CHECK(cuda::launch_softmax(x.dtype(), x.raw_data(), out.raw_data(), outer, x.size(dim), inner, log,
                                      context.stream()),
                 "{}: no CUDA kernel for {}", log ? "log_softmax" : "softmax", dtype_name(x.dtype()));
}

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

void cuda_cross_entropy_forward(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index,
                                const Tensor& losses, const Tensor& logsumexp) {
  const LaunchContext context(logits);
  SHARDLAB_CHECK(cuda::launch_cross_entropy(logits.dtype(), logits.raw_data(), targets.data<std::int64_t>(),
                                            ignore_index, logits.size(0), logits.size(1), losses.raw_data(),
                                            logsumexp.raw_data(), context.stream()),
                 "cross_entropy: no CUDA kernel for {}", dtype_name(logits.dtype()));
}

void cuda_cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                                 std::int64_t ignore_index, const Tensor& logsumexp,
                                 const Tensor& grad_logits) {
  const LaunchContext context(logits);
  SHARDLAB_CHECK(cuda::launch_cross_entropy_backward(
                     logits.dtype(), grad_losses.raw_data(), logits.raw_data(), targets.data<std::int64_t>(),
                     ignore_index, logsumexp.raw_data(), logits.size(0), logits.size(1),
                     grad_logits.raw_data(), context.stream()),
                 "cross_entropy_backward: no CUDA kernel for {}", dtype_name(logits.dtype()));
}

// The kept dims first and the reduced ones last, both in order: each output's inputs are then
// one contiguous row, in the row-major order argmax counts in, and the outputs follow out's order.
// launch_reduce over `outputs` contiguous rows of `count` elements of `rows`, with the partials'
// scratch it needs for few long rows.
bool reduce_rows(ReduceOp op, const Tensor& rows, const Tensor& out, std::int64_t outputs, std::int64_t count,
                 cudaStream_t stream) {
  // Scratch only for the two-pass case: a one-pass reduction (most of them) allocates nothing.
  const std::int64_t chunks = reduce_chunks(op, outputs, count);
  const DType accumulator = is_floating(rows.dtype()) ? DType::f64 : DType::i64;
  const Tensor partials =
      chunks > 1 ? empty({outputs * chunks}, TensorOptions{accumulator, out.device()}) : Tensor();
  return cuda::launch_reduce(op, rows.dtype(), out.dtype(), rows.raw_data(), out.raw_data(), outputs, count,
                             partials.defined() ? partials.raw_data() : nullptr, stream);
}

void cuda_reduce(ReduceOp op, const Tensor& in, const Dims& dims, const Tensor& out) {
  const LaunchContext context(out);
  std::vector<std::int64_t> order;
  std::int64_t count = 1;
  for (std::int64_t d = 0; d < in.dim(); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) order.push_back(d);
  }
  for (const std::int64_t d : dims) {
    order.push_back(d);
    count *= in.size(d);
  }
  const Tensor rows = in.permute(order).contiguous();
  SHARDLAB_CHECK(reduce_rows(op, rows, out, out.numel(), count, context.stream()),
                 "{}: no CUDA kernel from {} to {}", op_name(op), dtype_name(in.dtype()),
                 dtype_name(out.dtype()));
}

// A multi-tensor launch's table goes up through pinned memory, queued on the device's current
// stream: from pageable memory the copy would first wait for the stream's queued work. `table`
// holds the device copy until the launch is queued (then it is freed into the stream's cache,
// reused only by later work on that stream); the pinned block is held until its copy ran.
cuda::TableUpload upload_into(Tensor& table, Device device) {
  return [&table, device](const void* host_table, std::size_t bytes) {
    const Tensor staged =
        empty({static_cast<std::int64_t>(bytes)}, TensorOptions{DType::u8, Device::cpu(), true});
    std::memcpy(staged.raw_data(), host_table, bytes);
    table = staged.to(device, /*non_blocking=*/true);
    return table.raw_data();
  };
}

void cuda_foreach_sum_squares(std::span<const Tensor> tensors, const Tensor& out) {
  const LaunchContext context(out);
  std::vector<cuda::SquareSumArgs> args;
  std::int64_t chunks = 0;
  for (const Tensor& t : tensors) {
    args.push_back({t.raw_data(), t.numel(), t.dtype()});
    chunks += square_chunks(t.numel());
  }
  const Tensor partials = empty({chunks}, TensorOptions{DType::f64, out.device()});
  Tensor table;
  cuda::launch_foreach_sum_squares(args, upload_into(table, out.device()), partials.data<double>(),
                                   out.data<double>(), context.stream());
}

// One [B, R, C] operand as cuBLAS sees it: row-major rows (last stride 1) are the column-major
// transpose with leading dimension stride(1); column-major ones (stride(1) == 1) need the
// transpose flag; anything else is copied contiguous first (kept alive in `storage`).
cuda::GemmOperand gemm_operand(const Tensor& x, Tensor& storage) {
  const std::int64_t rows = x.size(1), cols = x.size(2);
  if (x.stride(2) == 1 && x.stride(1) >= std::max<std::int64_t>(1, cols)) {
    return {x.raw_data(), false, x.stride(1), x.stride(0)};
  }
  if (x.stride(1) == 1 && x.stride(2) >= std::max<std::int64_t>(1, rows)) {
    return {x.raw_data(), true, x.stride(2), x.stride(0)};
  }
  storage = x.contiguous();
  return {storage.raw_data(), false, std::max<std::int64_t>(1, cols), rows * cols};
}

// Row-major out = a b is column-major out^T = b^T a^T: cuBLAS's first operand is b, and a bias per
// column of out is one per row of out^T, as cuBLASLt's bias epilogue adds it. f64 has no such
// epilogue to rely on: its bias is added after the GEMM, the same bits (an f64 product is rounded
// once either way).
void cuda_matmul(const Tensor& a, const Tensor& b, const Tensor& bias, const Tensor& out) {
  const LaunchContext context(out);
  const bool in_epilogue = bias.defined() && out.dtype() != DType::f64;
  const void* epilogue_bias = in_epilogue ? bias.raw_data() : nullptr;
  Tensor a_copy, b_copy;
  const cuda::GemmOperand left = gemm_operand(b, b_copy);
  const std::int64_t m = out.size(1), n = out.size(2), leading = std::max<std::int64_t>(1, n);
  if (folds_into_one_gemm(layout_of(a), layout_of(b))) {
    const cuda::GemmOperand rows{a.raw_data(), false, a.stride(1), 0};
    cuda::gemm_batched(out.dtype(), 1, n, out.size(0) * m, a.size(2), left, rows, out.raw_data(), leading, 0,
                       out.device().index, context.stream(), epilogue_bias);
  } else {
    const cuda::GemmOperand right = gemm_operand(a, a_copy);
    cuda::gemm_batched(out.dtype(), out.size(0), n, m, a.size(2), left, right, out.raw_data(), leading, m * n,
                       out.device().index, context.stream(), epilogue_bias);
  }
  if (bias.defined() && !in_epilogue) cuda_binary(BinaryOp::add, out, bias.expand(out.shape()), out);
}

// Sizes around `dim` of `shape`: the product of the dims before and of those after.
std::pair<std::int64_t, std::int64_t> outer_inner(const Shape& shape, std::int64_t dim) {
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 0; d < static_cast<std::int64_t>(shape.size()); ++d) {
    if (d < dim) outer *= shape[d];
    if (d > dim) inner *= shape[d];
  }
  return {outer, inner};
}

cuda::IndexGeometry index_geometry(const char* op, const Tensor& index, std::int64_t dim, const Tensor& in,
                                   const Tensor& out) {
  SHARDLAB_CHECK(index.dim() <= cuda::kMaxDims, "{} on cuda: at most {} dimensions, got {}", op,
                 cuda::kMaxDims, index.dim());
  cuda::IndexGeometry g;
  g.rank = static_cast<int>(index.dim());
  g.dim = static_cast<int>(dim);
  g.bound = out.defined() ? out.size(dim) : in.size(dim);
  for (std::int64_t d = 0; d < index.dim(); ++d) {
    g.shape[d] = index.size(d);
    g.in_strides[d] = in.stride(d);
    if (out.defined()) g.out_strides[d] = out.stride(d);
  }
  return g;
}

void cuda_check_index(const char* op, const Tensor& index, std::int64_t size, const char* what) {
  const LaunchContext context(index);
  cuda::launch_check_index(index.data<std::int64_t>(), index.numel(), size, op, what, index.device().index,
                           context.stream());
}

void cuda_index_select(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const LaunchContext context(out);
  const auto [outer, inner] = outer_inner(in.shape(), dim);
  cuda::launch_index_select(in.dtype(), in.raw_data(), index.data<std::int64_t>(), out.raw_data(), outer,
                            index.numel(), in.size(dim), inner, context.stream());
}

void cuda_gather(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out) {
  const LaunchContext context(out);
  cuda::launch_gather(in.dtype(), in.raw_data(), index.data<std::int64_t>(), out.raw_data(), index.numel(),
                      index_geometry("gather", index, dim, in, Tensor()), context.stream());
}

// Accumulating kernels sum 16-bit floats in f32 and round once at the end, as the CPU's do
// (kernel(out, src) on f32 copies, then out gets the rounded sums).
template <typename Kernel>
void accumulate_in_f32(const Tensor& out, const Tensor& src, const Kernel& kernel) {
  if (out.dtype() != DType::bf16 && out.dtype() != DType::f16) return kernel(out, src);
  const Tensor wide = out.to(DType::f32);
  kernel(wide, src.to(DType::f32));
  out.copy_(wide);
}

void cuda_scatter_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  accumulate_in_f32(out, src, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    const auto [outer, inner] = outer_inner(index.shape(), dim);
    cuda::launch_scatter_add(sums.dtype(), sums.raw_data(), index.data<std::int64_t>(), terms.raw_data(),
                             outer, index.size(dim), inner,
                             index_geometry("scatter_add", index, dim, terms, sums), context.stream());
  });
}

// The embedding backward's: the picks sorted by row, each row's segment added in order.
void cuda_index_add(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  accumulate_in_f32(out, src, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    const auto [outer, inner] = outer_inner(sums.shape(), dim);
    const std::int64_t picks = index.numel();
    SHARDLAB_CHECK(picks <= std::numeric_limits<int>::max(), "index_add on cuda: at most {} indices, got {}",
                   std::numeric_limits<int>::max(), picks);
    const TensorOptions longs{DType::i64, sums.device()};
    const Tensor positions = empty({picks}, longs), keys = empty({picks}, longs),
                 order = empty({picks}, longs);
    const std::size_t sort_bytes = picks > 0 ? cuda::index_add_sort_bytes(picks) : 0;
    const Tensor sort =
        empty({static_cast<std::int64_t>(sort_bytes)}, TensorOptions{DType::u8, sums.device()});
    cuda::launch_index_add(sums.dtype(), sums.raw_data(), index.data<std::int64_t>(), terms.raw_data(), outer,
                           picks, sums.size(dim), inner,
                           {positions.data<std::int64_t>(), keys.data<std::int64_t>(),
                            order.data<std::int64_t>(), sort.raw_data(), sort_bytes},
                           context.stream());
  });
}

void cuda_max_pool2d(const Tensor& input, MaxPool2dParams p, const Tensor& out, const Tensor& indices) {
  const LaunchContext context(out);
  const cuda::PoolGeometry geometry{.height = input.size(2),
                                    .width = input.size(3),
                                    .out_h = out.size(2),
                                    .out_w = out.size(3),
                                    .kernel = p.kernel_size,
                                    .stride = p.stride,
                                    .padding = p.padding};
  cuda::launch_max_pool2d(input.dtype(), input.raw_data(), out.raw_data(), indices.data<std::int64_t>(),
                          input.size(0) * input.size(1), geometry, context.stream());
}

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

// The attention and rotary kernels' view of t [..., T, D]: a 4-D operand through its strides, any other
// (contiguous, as cuda_takes_strided_heads has core/attention.cpp make it) as [rows / T, 1, T, D].
template <typename Pointer>
cuda::HeadsOf<Pointer> heads_of(const Tensor& t, Pointer data) {
  if (t.dim() == 4) return {data, t.stride(0), t.stride(1), t.stride(2)};
  return {data, t.size(-2) * t.size(-1), 0, t.size(-1)};
}
cuda::Heads heads_in(const Tensor& t) { return heads_of<const void*>(t, t.raw_data()); }
cuda::MutableHeads heads_out(const Tensor& t) { return heads_of<void*>(t, t.raw_data()); }

void cuda_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose, const Tensor& out) {
  const LaunchContext context(x);
  const std::int64_t width = x.size(-1);
  SHARDLAB_CHECK(cuda::launch_rotary(x.dtype(), heads_in(x), cos.raw_data(), sin.raw_data(),
                                     x.numel() / width, x.dim() == 4 ? x.size(1) : 1, x.size(-2), width,
                                     transpose, heads_out(out), context.stream()),
                 "rotary_embedding: no CUDA kernel for {}", dtype_name(x.dtype()));
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

void cuda_max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in) {
  accumulate_in_f32(grad_in, grad_out, [&](const Tensor& sums, const Tensor& terms) {
    const LaunchContext context(sums);
    cuda::launch_max_pool2d_backward(sums.dtype(), terms.raw_data(), indices.data<std::int64_t>(),
                                     sums.raw_data(), sums.size(0) * sums.size(1),
                                     sums.size(2) * sums.size(3), terms.size(2) * terms.size(3),
                                     context.stream());
  });
}

// --- conv2d: cuDNN where it takes the case, else im2col + cuBLAS GEMM ---------------------------------

// Builds that found cuDNN convolve through it (core/cuda/cudnn_conv.h); the others, and the cases cuDNN
// declines, take im2col + cuBLAS.
#ifdef SHARDLAB_CUDNN
constexpr bool kCudnn = true;
#else
constexpr bool kCudnn = false;
#endif

cuda::ConvShape conv_shape(const Shape& input, const Shape& weight, const Shape& output, Conv2dParams p) {
  return {.batch = input[0],
          .channels = input[1],
          .height = input[2],
          .width = input[3],
          .outs = weight[0],
          .kernel_h = weight[2],
          .kernel_w = weight[3],
          .out_h = output[2],
          .out_w = output[3],
          .stride = p.stride,
          .padding = p.padding};
}

std::int64_t patch_of(const cuda::ConvShape& g) { return g.channels * g.kernel_h * g.kernel_w; }
std::int64_t pixels_of(const cuda::ConvShape& g) { return g.out_h * g.out_w; }

Tensor im2col(const char* op, const Tensor& input, const cuda::ConvShape& g, cudaStream_t stream) {
  Tensor cols = empty({g.batch, patch_of(g), pixels_of(g)}, TensorOptions{input.dtype(), input.device()});
  SHARDLAB_CHECK(cuda::launch_im2col(input.dtype(), input.raw_data(), cols.raw_data(), g, stream),
                 "{}: no CUDA kernel for {}", op, dtype_name(input.dtype()));
  return cols;
}

// Per image: out[n] [O, pixels] = W [O, patch] cols[n] [patch, pixels], the column-major
// out^T = cols^T W^T; then the bias.
void cuda_conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p,
                 const Tensor& out) {
  const LaunchContext context(out);
  const cuda::ConvShape g = conv_shape(input.shape(), weight.shape(), out.shape(), p);
  const std::int64_t patch = patch_of(g), pixels = pixels_of(g), outs = weight.size(0);
  bool by_cudnn = false;
  if constexpr (kCudnn)
    by_cudnn = cuda::cudnn::conv2d(out.dtype(), input.raw_data(), weight.raw_data(), out.raw_data(), g,
                                   out.device().index, context.stream());
  if (!by_cudnn) {
    const Tensor cols = im2col("conv2d", input, g, context.stream());
    cuda::gemm_batched(out.dtype(), g.batch, pixels, outs, patch,
                       {cols.raw_data(), false, pixels, patch * pixels}, {weight.raw_data(), false, patch, 0},
                       out.raw_data(), pixels, outs * pixels, out.device().index, context.stream());
  }
  if (bias.defined()) {
    SHARDLAB_CHECK(cuda::launch_add_bias(out.dtype(), out.raw_data(), bias.raw_data(), g.batch, outs, pixels,
                                         context.stream()),
                   "conv2d: no CUDA kernel for {}", dtype_name(out.dtype()));
  }
}

// Per image: cols[n] [patch, pixels] = W^T grad_out[n], then col2im sums the taps of each pixel.
void cuda_conv2d_backward_input(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                                const Tensor& grad_in) {
  const LaunchContext context(grad_in);
  const cuda::ConvShape g = conv_shape(grad_in.shape(), weight.shape(), grad_out.shape(), p);
  if constexpr (kCudnn) {
    if (cuda::cudnn::conv2d_backward_input(grad_in.dtype(), grad_out.raw_data(), weight.raw_data(),
                                           grad_in.raw_data(), g, grad_in.device().index, context.stream()))
      return;
  }
  const std::int64_t patch = patch_of(g), pixels = pixels_of(g), outs = weight.size(0);
  const Tensor cols = empty({g.batch, patch, pixels}, TensorOptions{grad_in.dtype(), grad_in.device()});
  cuda::gemm_batched(grad_in.dtype(), g.batch, pixels, patch, outs,
                     {grad_out.raw_data(), false, pixels, outs * pixels}, {weight.raw_data(), true, patch, 0},
                     cols.raw_data(), pixels, patch * pixels, grad_in.device().index, context.stream());
  SHARDLAB_CHECK(
      cuda::launch_col2im(grad_in.dtype(), cols.raw_data(), grad_in.raw_data(), g, context.stream()),
      "conv2d_backward_input: no CUDA kernel for {}", dtype_name(grad_in.dtype()));
}

// Per image: products[n] [O, patch] = grad_out[n] cols[n]^T; then the sum over images, in a fixed
// order (the reduction kernel), written into grad_weight, which the op layer hands over zeroed.
void cuda_conv2d_backward_weight(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                                 const Tensor& grad_weight) {
  const LaunchContext context(grad_weight);
  const cuda::ConvShape g = conv_shape(input.shape(), grad_weight.shape(), grad_out.shape(), p);
  if constexpr (kCudnn) {
    if (cuda::cudnn::conv2d_backward_weight(grad_weight.dtype(), grad_out.raw_data(), input.raw_data(),
                                            grad_weight.raw_data(), g, grad_weight.device().index,
                                            context.stream()))
      return;
  }
  const std::int64_t patch = patch_of(g), pixels = pixels_of(g), outs = grad_weight.size(0);
  const Tensor cols = im2col("conv2d_backward_weight", input, g, context.stream());
  const Tensor products =
      empty({g.batch, outs * patch}, TensorOptions{grad_weight.dtype(), grad_weight.device()});
  cuda::gemm_batched(grad_weight.dtype(), g.batch, patch, outs, pixels,
                     {cols.raw_data(), true, pixels, patch * pixels},
                     {grad_out.raw_data(), false, pixels, outs * pixels}, products.raw_data(), patch,
                     outs * patch, grad_weight.device().index, context.stream());
  const Tensor per_weight = products.transpose(0, 1).contiguous();  // [O * patch, batch]
  SHARDLAB_CHECK(reduce_rows(ReduceOp::sum, per_weight, grad_weight, outs * patch, g.batch, context.stream()),
                 "conv2d_backward_weight: no CUDA kernel for {}", dtype_name(grad_weight.dtype()));
}

bool all_contiguous(std::initializer_list<const Tensor*> tensors) {
  return std::all_of(tensors.begin(), tensors.end(), [](const Tensor* t) { return t->is_contiguous(); });
}

// Contiguous segments go to one multi-segment launch per dtype (pair); segments with a strided
// operand each take the strided kernel.
void cuda_adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply) {
  const LaunchContext context(segments.front().param);
  const bool* gate = apply.defined() ? apply.data<bool>() : nullptr;
  const Device device = segments.front().param.device();
  std::map<DType, std::vector<cuda::AdadeltaSegmentArgs>> contiguous;
  for (const auto& [param, grad, square_avg, acc_delta, hyper] : segments) {
    const cuda::AdadeltaScalars scalars{hyper.lr, hyper.rho, hyper.eps, hyper.weight_decay};
    if (all_contiguous({&param, &grad, &square_avg, &acc_delta})) {
      contiguous[param.dtype()].push_back({param.raw_data(), grad.raw_data(), square_avg.raw_data(),
                                           acc_delta.raw_data(), param.numel(), scalars});
      continue;
    }
    SHARDLAB_CHECK(
        cuda::launch_adadelta_step(param.dtype(), param.raw_data(), grad.raw_data(), square_avg.raw_data(),
                                   acc_delta.raw_data(),
                                   layout_of<4>("adadelta_step", {&param, &grad, &square_avg, &acc_delta}),
                                   scalars, gate, context.stream()),
        "adadelta_step: no CUDA kernel for {}", dtype_name(param.dtype()));
  }
  for (const auto& [dtype, args] : contiguous) {
    Tensor table;
    SHARDLAB_CHECK(
        cuda::launch_adadelta_segments(dtype, args, upload_into(table, device), gate, context.stream()),
        "adadelta_step: no CUDA kernel for {}", dtype_name(dtype));
  }
}

void cuda_adam_step(std::span<const AdamSegment> segments, const Tensor& apply) {
  const LaunchContext context(segments.front().param);
  const bool* gate = apply.defined() ? apply.data<bool>() : nullptr;
  const Device device = segments.front().param.device();
  std::map<std::pair<DType, DType>, std::vector<cuda::AdamSegmentArgs>> contiguous;
  for (const auto& [param, grad, exp_avg, exp_avg_sq, hyper, copy_out] : segments) {
    const Tensor& copy = copy_out.defined() ? copy_out : param;
    if (all_contiguous({&param, &grad, &exp_avg, &exp_avg_sq, &copy})) {
      contiguous[{param.dtype(), copy.dtype()}].push_back(
          {param.raw_data(), grad.raw_data(), exp_avg.raw_data(), exp_avg_sq.raw_data(), copy.raw_data(),
           param.numel(), adam_scalars(hyper)});
      continue;
    }
    SHARDLAB_CHECK(
        cuda::launch_adam_step(param.dtype(), copy.dtype(), param.raw_data(), grad.raw_data(),
                               exp_avg.raw_data(), exp_avg_sq.raw_data(), copy.raw_data(),
                               layout_of<5>("adam_step", {&param, &grad, &exp_avg, &exp_avg_sq, &copy}),
                               adam_scalars(hyper), gate, context.stream()),
        "adam_step: no CUDA kernel for {} to {}", dtype_name(param.dtype()), dtype_name(copy.dtype()));
  }
  for (const auto& [dtypes, args] : contiguous) {
    Tensor table;
    SHARDLAB_CHECK(cuda::launch_adam_segments(dtypes.first, dtypes.second, args, upload_into(table, device),
                                              gate, context.stream()),
                   "adam_step: no CUDA kernel for {} to {}", dtype_name(dtypes.first),
                   dtype_name(dtypes.second));
  }
}

}  // namespace

const Kernels& cuda_kernels() {
  // Each family's entries designated in its header's order; an entry left out would stay null: its op
  // would have no CUDA kernel.
  static const Kernels table{
      ElementwiseKernels{.fill = cuda_fill,
                         .copy = cuda_copy,
                         .unary = cuda_unary,
                         .binary = cuda_binary,
                         .where = cuda_where},
      ReductionKernels{.reduce = cuda_reduce, .foreach_sum_squares = cuda_foreach_sum_squares},
      MatmulKernels{.matmul = cuda_matmul},
      SoftmaxKernels{.softmax = cuda_softmax},
      LossKernels{.cross_entropy_forward = cuda_cross_entropy_forward,
                  .cross_entropy_backward = cuda_cross_entropy_backward},
      TransformerKernels{.rms_norm_forward = cuda_rms_norm_forward,
                         .rms_norm_backward = cuda_rms_norm_backward,
                         .swiglu_forward = cuda_swiglu_forward,
                         .swiglu_backward = cuda_swiglu_backward,
                         .rotary = cuda_rotary},
      ConvKernels{.conv2d = cuda_conv2d,
                  .conv2d_backward_input = cuda_conv2d_backward_input,
                  .conv2d_backward_weight = cuda_conv2d_backward_weight},
      PoolKernels{.max_pool2d = cuda_max_pool2d, .max_pool2d_backward = cuda_max_pool2d_backward},
      AttentionKernels{
          .attention_forward = cuda_attention_forward,
          .attention_backward = cuda_attention_backward,
          .strided_heads = [](const Tensor& t) { return cuda_takes_heads_in_place(layout_of(t)); }},
      IndexKernels{.check_index = cuda_check_index,
                   .index_select = cuda_index_select,
                   .gather = cuda_gather,
                   .scatter_add = cuda_scatter_add,
                   .index_add = cuda_index_add},
      RandomKernels{.random = cuda_random},
      OptimizerKernels{.adadelta_step = cuda_adadelta_step, .adam_step = cuda_adam_step},
  };
  return table;
}

}  // namespace shardlab
