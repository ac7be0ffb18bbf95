// core/kernel_choice.h: internal to core: which CUDA kernel an op takes, as pure functions of its
// operands (dtype, shape, strides, where the data starts), compiled in every build so that a test
// reads each choice of a training step without a GPU; the entries of core/cuda/ launch what they say.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/reduce.h"

namespace shardlab {

class Tensor;

// What a kernel choice reads of a tensor operand: dtype, shape, strides and where its data starts.
struct OperandLayout {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::uintptr_t address = 0;
};
OperandLayout layout_of(const Tensor& tensor);

// --- elementwise ---------------------------------------------------------------------------------

// A pack: the bytes of an operand a kernel moves in one load or store, from an address on that many
// bytes. Indices below kMaxNarrowIndex run in 32-bit math.
inline constexpr std::uintptr_t kPackBytes = 16;
inline constexpr std::int64_t kMaxNarrowIndex = 0x7fffffff;

// How an elementwise kernel walks N operands of one shape (the last is the output): size-1 dims
// dropped, and a dim merged into the one before it when that one steps over it exactly in every
// operand, so dense operands of any rank are one dim.
struct ElementwiseLayout {
  std::int64_t numel = 0;
  std::vector<std::int64_t> sizes;                 // the merged dims
  std::vector<std::vector<std::int64_t>> strides;  // [dim][operand]
  // One dim at most, each operand stepping by 1 (from an address on 16 bytes) or 0 (one element for
  // all), fewer than 2^31 elements: the kernel moves 16 bytes of each operand per load and store.
  bool packed = false;
  // Every element index and operand offset below 2^31: the strided kernel's index math in 32 bits.
  bool narrow_index = false;
};
ElementwiseLayout elementwise_layout(const std::vector<OperandLayout>& operands);
// The same from each operand's strides (in `shape`, the output's) and the address its data starts at.
ElementwiseLayout elementwise_layout(const std::vector<std::int64_t>& shape,
                                     const std::vector<std::vector<std::int64_t>>& strides,
                                     const std::vector<std::uintptr_t>& addresses);

enum class ElementwiseKernel : unsigned char { packed, strided_32bit, strided_64bit };
ElementwiseKernel elementwise_kernel(const ElementwiseLayout& layout);
const char* kernel_name(ElementwiseKernel kernel);

// --- matmul --------------------------------------------------------------------------------------

// Whether the batches of a [B, M, K] are rows evenly spaced one after another (row-major, batch stride
// = rows times row stride) and b [B, K, N] is one matrix for all of them (batch stride 0): a Linear's
// input times its weight, which is then one GEMM over all the rows, [B * M, K] x [K, N], not B small
// ones.
bool folds_into_one_gemm(const OperandLayout& a, const OperandLayout& b);

// --- attention and rotary ------------------------------------------------------------------------

// Whether the CUDA attention and rotary kernels read (or write) an operand where it lies: 4-D
// [B, H, T, D] with rows in unit stride, and for bf16 and f16 (flash attention's 16-byte row loads)
// every other stride a multiple of 8 elements. Any other operand is made contiguous first.
bool cuda_takes_heads_in_place(const OperandLayout& operand);

// --- reductions ----------------------------------------------------------------------------------

// Sums (sum, mean, sum_squares) of fewer than 128 rows longer than kReduceChunk go in two passes: a
// block per chunk of kReduceChunk elements, then each row's chunks in a fixed tree; the rest in one
// pass, a block per row. The number of chunks per row (1: one pass).
inline constexpr std::int64_t kReduceChunk = 32768;
std::int64_t reduce_chunks(ReduceOp op, std::int64_t outputs, std::int64_t count);

// --- every op ------------------------------------------------------------------------------------

// The CUDA kernel a call of `op` (its name as the profiler shows it) takes for its tensor operands
// in the kernel entry's argument order (core/call_log.h records them so): elementwise ops their
// inputs then the output (copy and cast: dst, src); matmul and linear a [B, M, K], b [B, K, N], the
// bias [N] if any, out;
// reductions the input and the output; attention q, k, v; adam_step and adadelta_step each
// segment's parameter and gradient; the fused ops their inputs.
// Naive: a path that does much more memory traffic or far fewer useful FLOPs than the op needs
// (a 64-bit strided elementwise loop, a GEMM per batch for one shared matrix, attention in f32 on
// widened halves, one block reading a long row). An op without a rule is an Error naming it.
struct KernelChoice {
  std::string kernel;
  bool naive = false;
};
KernelChoice cuda_kernel_choice(std::string_view op, const std::vector<OperandLayout>& operands);

}  // namespace shardlab
