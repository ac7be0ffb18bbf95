// core/cuda/tensor_launch.h: internal to core/cuda: what the families' CUDA entries share to unpack
// Tensors into the launchers of core/cuda/launch.h: the device and stream to launch on, operand
// layouts, f32 accumulation for halves, a multi-tensor table's upload, row reductions, heads' views.
#pragma once

#include <array>
#include <vector>

#include "core/cuda/check.h"
#include "core/cuda/launch.h"
#include "core/cuda/runtime.h"
#include "core/kernel_choice.h"
#include "core/kernels.h"

namespace shardlab::cuda {

// Where a kernel for tensors on `device` runs: on that device (kernels launch on the current
// device, which need not be theirs: rank r of mpirun uses cuda:r), in this thread's current
// stream of it.
class LaunchContext {
 public:
  explicit LaunchContext(const Tensor& tensor)
      : stream_(static_cast<cudaStream_t>(current_stream(tensor.device().index).handle())),
        guard_(tensor.device().index) {}
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;  // first: current_stream checks the device before the guard selects it
  DeviceGuard guard_;
};

// The launchers' Layout of N operands of one shape (the last is the output): the merged dims of
// elementwise_layout (core/kernel_choice.h), at most kMaxDims of them.
template <int N>
Layout<N> layout_of(const char* op, const std::array<const Tensor*, N>& operands) {
  std::vector<OperandLayout> layouts;
  for (const Tensor* operand : operands) layouts.push_back(layout_of(*operand));
  const ElementwiseLayout merged = elementwise_layout(layouts);
  Layout<N> layout;
  layout.numel = merged.numel;
  SHARDLAB_CHECK(merged.sizes.size() <= static_cast<std::size_t>(kMaxDims),
                 "{} on cuda: the operands of shape {} need {} dimensions after merging the "
                 "contiguous ones, and CUDA kernels index at most {}; make them contiguous first",
                 op, shape_str(operands[N - 1]->shape()), merged.sizes.size(), kMaxDims);
  layout.rank = static_cast<int>(merged.sizes.size());
  for (int d = 0; d < layout.rank; ++d) {
    layout.sizes[d] = merged.sizes[d];
    for (int k = 0; k < N; ++k) layout.strides[k][d] = merged.strides[d][k];
  }
  layout.packed = merged.packed;
  layout.narrow_index = merged.narrow_index;
  return layout;
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

// The elementwise binary entry (core/cuda/elementwise.cpp), which others use for a bias.
void cuda_binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);

// The kept dims first and the reduced ones last, both in order: each output's inputs are then
// one contiguous row, in the row-major order argmax counts in, and the outputs follow out's order.
// launch_reduce over `outputs` contiguous rows of `count` elements of `rows`, with the partials'
// scratch it needs for few long rows.
bool reduce_rows(ReduceOp op, const Tensor& rows, const Tensor& out, std::int64_t outputs, std::int64_t count,
                 cudaStream_t stream);

// A multi-tensor launch's table goes up through pinned memory, queued on the device's current
// stream: from pageable memory the copy would first wait for the stream's queued work. `table`
// holds the device copy until the launch is queued (then it is freed into the stream's cache,
// reused only by later work on that stream); the pinned block is held until its copy ran.
TableUpload upload_into(Tensor& table, Device device);

// The attention and rotary kernels' view of t [..., T, D]: a 4-D operand through its strides, any other
// (contiguous, as cuda_takes_strided_heads has core/attention.cpp make it) as [rows / T, 1, T, D].
template <typename Pointer>
HeadsOf<Pointer> heads_of(const Tensor& t, Pointer data) {
  if (t.dim() == 4) return {data, t.stride(0), t.stride(1), t.stride(2)};
  return {data, t.size(-2) * t.size(-1), 0, t.size(-1)};
}
Heads heads_in(const Tensor& t);
MutableHeads heads_out(const Tensor& t);

}  // namespace shardlab::cuda
