// core/cuda/launch.h: internal to core/cuda: the kernel launchers, in plain types (llm.c style),
// between the Tensor-facing table (table.cpp, g++) and the kernels (*.cu, nvcc).
//
// Every launcher queues its kernel on `stream`, which must belong to the calling thread's
// current device, and checks the launch (throws shardlab::Error). A launcher returning bool
// returns false, launching nothing, when its kernel has no version for the dtype.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <type_traits>

#include "core/adam_math.h"
#include "core/cuda/conv_shape.h"
#include "core/dtype.h"
#include "core/kernel_choice.h"
#include "core/op_codes.h"

namespace shardlab::cuda {

// Most dimensions an elementwise kernel indexes, after table.cpp merged every run of dims
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

// What a random kernel draws: element i of the output is draw number first_index + i of Philox
// stream (seed, stream) (core/philox.h). a, b: uniform low and high, normal mean and std,
// bernoulli p (b unused).
struct PhiloxDraw {
  Distribution kind = Distribution::uniform;
  std::uint64_t seed = 0;
  std::uint64_t stream = 0;
  std::uint64_t first_index = 0;
  double a = 0.0;
  double b = 1.0;
};

// --- core/cuda/elementwise.cu ----------------------------------------------------------------

// Writes the dtype_size(dtype) bytes at host address `value` to every element of out.
void launch_fill(void* out, DType dtype, const void* value, const Layout<1>& layout, cudaStream_t stream);
// Operands: src, dst. Converts like the CPU: narrow<Dst>(widen(src value)); equal dtypes copy bits.
void launch_copy(const void* src, DType src_dtype, void* dst, DType dst_dtype, const Layout<2>& layout,
                 cudaStream_t stream);
// Operands: in, out (same dtype). Floating dtypes: every op but isfinite, computed in float (f32, bf16,
// f16) or double (f64). i64/i32/u8: neg, abs and relu, wrapping like unsigned arithmetic.
[[nodiscard]] bool launch_unary(UnaryOp op, DType dtype, const void* in, void* out, const Layout<2>& layout,
                                cudaStream_t stream);
// Operands: in (floating), out (bool).
[[nodiscard]] bool launch_isfinite(DType dtype, const void* in, bool* out, const Layout<2>& layout,
                                   cudaStream_t stream);
// Operands: a, b, out, all of `dtype`. Arithmetic ops only (comparisons: launch_compare);
// every dtype and op except div on i64/i32/u8/bool (the
// op layer divides integers in f32). Integers wrap; bool computes in int and narrows (add is
// or, mul is and); integer pow is exact repeated multiplication.
[[nodiscard]] bool launch_arithmetic(BinaryOp op, DType dtype, const void* a, const void* b, void* out,
                                     const Layout<3>& layout, cudaStream_t stream);
// Operands: a, b (both `dtype`, any of the 8), out (bool). Comparison ops only.
void launch_compare(BinaryOp op, DType dtype, const void* a, const void* b, bool* out,
                    const Layout<3>& layout, cudaStream_t stream);
// Operands: condition (bool), a, b, out (a, b and out all of `dtype`).
void launch_where(const bool* condition, DType dtype, const void* a, const void* b, void* out,
                  const Layout<4>& layout, cudaStream_t stream);

// --- core/cuda/random.cu ------------------------------------------------------------------------

// Fills n contiguous elements of any dtype like the CPU kernel: the double that philox::uniform24
// (uniform53 for f64), philox::normal or philox::bernoulli (1 or 0) gives, narrowed to the dtype.
void launch_random(DType dtype, void* out, std::int64_t n, const PhiloxDraw& draw, cudaStream_t stream);

// --- core/cuda/softmax.cu ----------------------------------------------------------------------

// in, out: contiguous [outer, n, inner]; softmax (or log_softmax) along n, for floating dtypes
// (false for the others).
[[nodiscard]] bool launch_softmax(DType dtype, const void* in, void* out, std::int64_t outer, std::int64_t n,
                                  std::int64_t inner, bool log, cudaStream_t stream);
// Contiguous logits [rows, classes], i64 targets (in range or ignore_index): losses and logsumexp
// [rows] in the logits' compute type (f32 for bf16/f16); floating dtypes only.
[[nodiscard]] bool launch_cross_entropy(DType dtype, const void* logits, const std::int64_t* targets,
                                        std::int64_t ignore_index, std::int64_t rows, std::int64_t classes,
                                        void* losses, void* logsumexp, cudaStream_t stream);
// grad [rows, classes] = grad_losses[r] * (softmax - onehot), 0 in ignored rows; grad_losses in the
// compute type.
[[nodiscard]] bool launch_cross_entropy_backward(DType dtype, const void* grad_losses, const void* logits,
                                                 const std::int64_t* targets, std::int64_t ignore_index,
                                                 const void* logsumexp, std::int64_t rows,
                                                 std::int64_t classes, void* grad, cudaStream_t stream);

// --- core/cuda/reduce.cu -----------------------------------------------------------------------

// in: contiguous [outputs, count], each row reduced into out[row]. Pairs: in_dtype == out_dtype,
// or out i64 (integer sums, argmax); false for others.
// Sums that reduce_chunks (core/kernel_choice.h) cuts into chunks go in two passes; partials: scratch
// of 8-byte accumulators [outputs, reduce_chunks(...)] (f64 for floating inputs, i64 for integers),
// unused (may be null) when reduce_chunks is 1.
[[nodiscard]] bool launch_reduce(ReduceOp op, DType in_dtype, DType out_dtype, const void* in, void* out,
                                 std::int64_t outputs, std::int64_t count, void* partials,
                                 cudaStream_t stream);

// --- core/cuda/attention.cu --------------------------------------------------------------------

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

// q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]; padding bool [B, S] or null.
struct AttentionGeometry {
  std::int64_t batch, heads, kv_heads, queries, keys, head_dim, value_dim;
  bool causal;
  double scale;
};
// A warp holds a row of D or Dv elements, kMaxValuesPerLane per lane.
inline constexpr int kMaxValuesPerLane = 8;
inline constexpr std::int64_t kMaxAttentionHeadDim = 32 * kMaxValuesPerLane;
// The operands of one attention call: out [B, H, T, Dv], logsumexp and delta [B, H, T] contiguous; in
// backward, grad_out has out's shape and the gradients q's, k's and v's (written whole).
struct AttentionOperands {
  Heads q, k, v, out, grad_out;
  const bool* padding;  // [B, S] or null
  void* logsumexp;
  void* delta;  // backward's scratch
  MutableHeads grad_q, grad_k, grad_v;
};
// f32 and f64 (false, launching nothing, for others): the forward writes out and logsumexp.
[[nodiscard]] bool launch_attention_forward(DType dtype, const AttentionOperands& operands,
                                            const AttentionGeometry& geometry, MutableHeads out,
                                            cudaStream_t stream);
[[nodiscard]] bool launch_attention_backward(DType dtype, const AttentionOperands& operands,
                                             const AttentionGeometry& geometry, cudaStream_t stream);

// --- core/cuda/flash_attention.cu --------------------------------------------------------------

// bf16 and f16 on tensor cores, head dims 64 and 128 with Dv == D (false, launching nothing, for any
// other), every operand's data on 16 bytes and its strides multiples of 8 elements; logsumexp and
// delta in f32.
[[nodiscard]] bool launch_flash_attention_forward(DType dtype, const AttentionOperands& operands,
                                                  const AttentionGeometry& geometry, MutableHeads out,
                                                  cudaStream_t stream);
[[nodiscard]] bool launch_flash_attention_backward(DType dtype, const AttentionOperands& operands,
                                                   const AttentionGeometry& geometry, cudaStream_t stream);

// --- core/cuda/transformer.cu ------------------------------------------------------------------

// Contiguous operands of one floating dtype (false, launching nothing, for the others); rstd in the
// compute type. x [rows, width] with weight [width]; with `added` non-null (x's shape) the rows
// normalised are x + added, written to `sum`.
[[nodiscard]] bool launch_rms_norm(DType dtype, const void* x, const void* added, const void* weight,
                                   double eps, std::int64_t rows, std::int64_t width, void* sum, void* out,
                                   void* rstd, cudaStream_t stream);
// partials: f64 scratch of [column_chunks(rows), width] (core/column_sums.h) for grad_weight's sums.
[[nodiscard]] bool launch_rms_norm_backward(DType dtype, const void* grad_out, const void* x,
                                            const void* weight, const void* rstd, std::int64_t rows,
                                            std::int64_t width, void* grad_x, void* grad_weight,
                                            double* partials, cudaStream_t stream);
[[nodiscard]] bool launch_swiglu(DType dtype, const void* gate, const void* up, std::int64_t n, void* out,
                                 cudaStream_t stream);
[[nodiscard]] bool launch_swiglu_backward(DType dtype, const void* grad_out, const void* gate, const void* up,
                                          std::int64_t n, void* grad_gate, void* grad_up,
                                          cudaStream_t stream);
// x and out [rows / (heads * length), heads, length, width] (through their strides) by cos, sin [length,
// width]: row r is position r % length.
[[nodiscard]] bool launch_rotary(DType dtype, Heads x, const void* cos, const void* sin, std::int64_t rows,
                                 std::int64_t heads, std::int64_t length, std::int64_t width, bool transpose,
                                 MutableHeads out, cudaStream_t stream);

// --- core/cuda/index.cu ------------------------------------------------------------------------

// The shape of an index tensor (rank <= kMaxDims) and the element strides of the tensors its
// positions address: `in_strides` for gather's input and scatter_add's source, `out_strides`
// for scatter_add's output.
struct IndexGeometry {
  int rank = 0;
  int dim = 0;
  std::int64_t bound = 0;  // the indexed operand's size along dim (gather's input, scatter_add's output)
  std::int64_t shape[kMaxDims] = {};
  std::int64_t in_strides[kMaxDims] = {};
  std::int64_t out_strides[kMaxDims] = {};
};

// Records the first value of index[0, n) outside [0, size) in index_fault() (index_fault.h);
// `op` and `what` are string literals of the host, for the message.
void launch_check_index(const std::int64_t* index, std::int64_t n, std::int64_t size, const char* op,
                        const char* what, int device, cudaStream_t stream);

// Contiguous operands and i64 indices checked by launch_check_index, the CPU kernels' contracts
// (core/kernels.h); an out-of-range index is skipped (its fault is reported at the next host wait).
// in [outer, size, inner] -> out [outer, picks, inner].
void launch_index_select(DType dtype, const void* in, const std::int64_t* index, void* out,
                         std::int64_t outer, std::int64_t picks, std::int64_t size, std::int64_t inner,
                         cudaStream_t stream);
void launch_gather(DType dtype, const void* in, const std::int64_t* index, void* out, std::int64_t total,
                   const IndexGeometry& geometry, cudaStream_t stream);
// The index has shape [outer, length, inner] around geometry.dim.
void launch_scatter_add(DType dtype, void* out, const std::int64_t* index, const void* src,
                        std::int64_t outer, std::int64_t length, std::int64_t inner,
                        const IndexGeometry& geometry, cudaStream_t stream);
// index_add's scratch on the device: the picks' positions, sorted keys and order (i64 [picks] each),
// and sort_bytes (index_add_sort_bytes) for the sort.
struct IndexAddScratch {
  std::int64_t *positions, *keys, *order;
  void* sort;
  std::size_t sort_bytes;
};
std::size_t index_add_sort_bytes(std::int64_t picks);
// out [outer, size, inner] += src [outer, picks, inner] at rows index[j] (picks up to INT_MAX, CUB's
// count): the picks sorted stably by row, each row's added in their order (core/segments.h).
void launch_index_add(DType dtype, void* out, const std::int64_t* index, const void* src, std::int64_t outer,
                      std::int64_t picks, std::int64_t size, std::int64_t inner,
                      const IndexAddScratch& scratch, cudaStream_t stream);

// --- core/cuda/pool.cu -------------------------------------------------------------------------

struct PoolGeometry {
  std::int64_t height = 0, width = 0, out_h = 0, out_w = 0;
  std::int64_t kernel = 2, stride = 2, padding = 0;
};
// in [planes, height, width] -> out, indices [planes, out_h, out_w] (flat h * width + w).
void launch_max_pool2d(DType dtype, const void* in, void* out, std::int64_t* indices, std::int64_t planes,
                       const PoolGeometry& geometry, cudaStream_t stream);
// grad_in (zeroed by the caller) += grad_out at indices, per plane.
void launch_max_pool2d_backward(DType dtype, const void* grad_out, const std::int64_t* indices, void* grad_in,
                                std::int64_t planes, std::int64_t plane_in, std::int64_t plane_out,
                                cudaStream_t stream);

// --- core/cuda/conv.cu --------------------------------------------------------------------------

// Floating dtypes (false for others). cols is [batch, channels*kernel_h*kernel_w, out_h*out_w].
[[nodiscard]] bool launch_im2col(DType dtype, const void* input, void* cols, const ConvShape& shape,
                                 cudaStream_t stream);
// grad_in (overwritten) = the adjoint of im2col applied to cols.
[[nodiscard]] bool launch_col2im(DType dtype, const void* cols, void* grad_in, const ConvShape& shape,
                                 cudaStream_t stream);
// out [batch, channels, pixels] += bias [channels].
[[nodiscard]] bool launch_add_bias(DType dtype, void* out, const void* bias, std::int64_t batch,
                                   std::int64_t channels, std::int64_t pixels, cudaStream_t stream);

// --- core/cuda/optimizer.cu ---------------------------------------------------------------------

// core/ops.h's AdadeltaHyper, in plain types.
struct AdadeltaScalars {
  double lr = 1.0, rho = 0.9, eps = 1e-6, weight_decay = 0.0;
};
// Operands: param, grad, square_avg, acc_delta (one floating dtype, any strides); false for
// other dtypes. Every optimizer launch takes `apply`: null, or one bool in device memory that
// the kernel reads first, writing nothing where it is false (core/ops.h's gate).
[[nodiscard]] bool launch_adadelta_step(DType dtype, void* param, const void* grad, void* square_avg,
                                        void* acc_delta, const Layout<4>& layout,
                                        const AdadeltaScalars& hyper, const bool* apply, cudaStream_t stream);

// Operands: param, grad, exp_avg, exp_avg_sq (one floating dtype), copy (copy_dtype, floating:
// the updated parameter in its dtype; the parameter itself when there is no copy-out).
[[nodiscard]] bool launch_adam_step(DType dtype, DType copy_dtype, void* param, const void* grad,
                                    void* exp_avg, void* exp_avg_sq, void* copy, const Layout<5>& layout,
                                    const AdamScalars& hyper, const bool* apply, cudaStream_t stream);

// Multi-segment launches: one kernel for many parameters, each a segment of `numel` (> 0)
// contiguous elements per operand with its own hyper-parameters. The kernel reads a table of
// the segments from the device memory `upload` returns (called once with the host table and its
// bytes; it queues the copy on `stream` without the host waiting, and the memory must stay valid
// for the work queued there, as a caching-allocator block of that stream does). False, launching
// nothing, for dtypes without a kernel.
using TableUpload = std::function<const void*(const void* host_table, std::size_t bytes)>;

struct AdadeltaSegmentArgs {
  void* param;
  const void* grad;
  void* square_avg;
  void* acc_delta;
  std::int64_t numel;
  AdadeltaScalars hyper;
};
[[nodiscard]] bool launch_adadelta_segments(DType dtype, std::span<const AdadeltaSegmentArgs> segments,
                                            const TableUpload& upload, const bool* apply,
                                            cudaStream_t stream);

struct AdamSegmentArgs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* copy;  // as launch_adam_step's copy, in copy_dtype
  std::int64_t numel;
  AdamScalars hyper;
};
[[nodiscard]] bool launch_adam_segments(DType dtype, DType copy_dtype,
                                        std::span<const AdamSegmentArgs> segments, const TableUpload& upload,
                                        const bool* apply, cudaStream_t stream);

// --- core/cuda/reduce.cu: the multi-tensor sum of squares ------------------------------------------

// A tensor of foreach_sum_squares: numel (> 0) contiguous elements of a floating dtype.
struct SquareSumArgs {
  const void* data;
  std::int64_t numel;
  DType dtype;
};
// out (one double) = the sum of squares over all tensors in core/square_sums.h's order: a block per
// chunk of every tensor in one launch, writing partials[chunks] (the sum of square_chunks over the
// tensors), then one block folding the partials.
void launch_foreach_sum_squares(std::span<const SquareSumArgs> tensors, const TableUpload& upload,
                                double* partials, double* out, cudaStream_t stream);

}  // namespace shardlab::cuda
