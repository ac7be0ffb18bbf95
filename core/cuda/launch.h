// core/cuda/launch.h: internal to core/cuda: what the families' CUDA files share (each
// core/cuda/<family>.cu holds its kernels, their launchers and the entries that unpack Tensors into
// them): the launch geometry, the dtype dispatch of floating kernels, elementwise operand layouts,
// the device and stream to launch on, f32 accumulation for halves, a multi-tensor table's upload and
// the heads' views of attention operands.
//
// Every launcher queues its kernel on `stream`, which must belong to the calling thread's current
// device, and checks the launch (throws shardlab::Error). A launcher returning bool returns false,
// launching nothing, when its kernel has no version for the dtype.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "core/cuda/check.h"
#include "core/cuda/runtime.h"
#include "core/kernel_choice.h"
#include "core/kernels.h"

namespace shardlab::cuda {

#ifdef __CUDACC__
// The CUDA math functions by their plain names here, where the Tensor ops of the same names in
// namespace shardlab (core/elementwise.h) would otherwise hide them from the kernels.
using ::erf;
using ::exp;
using ::isfinite;
using ::log;
using ::pow;
using ::sqrt;
using ::tanh;
#endif

// Most dimensions an elementwise kernel indexes, after layout_of merged every run of dims
// that is contiguous in all operands (so a dense tensor of any rank is one dim).
inline constexpr int kMaxDims = 8;

// Launch geometry of every kernel here: 256-thread blocks and a grid-stride loop over at most
// kMaxBlocks blocks (enough to fill any current GPU many times over), so no size overflows
// the grid limits.
inline constexpr int kBlockSize = 256;
inline constexpr std::int64_t kMaxBlocks = 65536;
inline unsigned grid_size(std::int64_t n) {
  const std::int64_t blocks = (n + kBlockSize - 1) / kBlockSize;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Runs fn<T>() for the floating dtypes and returns true; false, running nothing, for the others:
// the body of a launcher whose kernels exist for floating dtypes only.
template <typename Fn>
bool floating(DType dtype, Fn&& fn) {
  return visit_dtype(dtype, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      fn.template operator()<T>();
      return true;
    } else {
      return false;
    }
  });
}

// The index space of an elementwise kernel with N operands: one shape, each operand's element
// strides in it (0 where broadcast). Element i of the row-major order of `sizes` is at
// sum_d index_d * strides[k][d] in operand k; the last operand is the output.
template <int N>
struct Layout {
  int rank = 0;
  std::int64_t numel = 0;
  std::int64_t sizes[kMaxDims] = {};
  std::int64_t strides[N][kMaxDims] = {};
  bool packed = false;        // ElementwiseLayout::packed (core/kernel_choice.h): rank <= 1
  bool narrow_index = false;  // ElementwiseLayout::narrow_index: indices and offsets in 32 bits
};

// A [B, H, T, D] operand of the attention and rotary kernels: its data and the element strides of its
// batch, head and row (T) dims, its last dim in unit stride. q, k and v split from a [B, T, H * D]
// projection are read where they lie, and outputs written in the layout the op chose.
template <typename Pointer>
struct HeadsOf {
  Pointer data;
  std::int64_t batch, head, row;
};
using Heads = HeadsOf<const void*>;
using MutableHeads = HeadsOf<void*>;

// How a multi-tensor launch gets its table of segments onto the device: called once with the host
// table and its bytes, it queues the copy on the launch's stream without the host waiting and returns
// device memory that stays valid for the work queued there (upload_into below).
using TableUpload = std::function<const void*(const void* host_table, std::size_t bytes)>;

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
