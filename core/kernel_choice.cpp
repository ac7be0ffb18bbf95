// core/kernel_choice.cpp: the CUDA kernel choices of core/kernel_choice.h.
#include "core/kernel_choice.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/op_info.h"
#include "core/ops.h"
#include "core/tensor.h"

namespace shardlab {

namespace {

// Whether every operand steps by 1 from an address on 16 bytes, or by 0, along the layout's one dim.
bool packs(const ElementwiseLayout& layout, const std::vector<std::uintptr_t>& addresses) {
  if (layout.sizes.size() > 1 || layout.numel > kMaxNarrowIndex) return false;
  for (std::size_t k = 0; k < addresses.size(); ++k) {
    const std::int64_t step = layout.sizes.empty() ? 0 : layout.strides[0][k];
    const bool output = k + 1 == addresses.size();
    const bool aligned = addresses[k] % kPackBytes == 0;
    if (!(step == 1 && aligned) && !(step == 0 && !output) && !layout.sizes.empty()) return false;
  }
  return true;
}

// Whether every operand's farthest element and the element count stay below 2^31.
bool fits_narrow_index(const ElementwiseLayout& layout, std::size_t operands) {
  if (layout.numel > kMaxNarrowIndex) return false;
  for (std::size_t k = 0; k < operands; ++k) {
    std::int64_t farthest = 0;
    for (std::size_t d = 0; d < layout.sizes.size(); ++d)
      farthest += (layout.sizes[d] - 1) * std::llabs(layout.strides[d][k]);
    if (farthest > kMaxNarrowIndex) return false;
  }
  return true;
}

}  // namespace

OperandLayout layout_of(const Tensor& tensor) {
  return {tensor.dtype(), tensor.shape(), tensor.strides(),
          reinterpret_cast<std::uintptr_t>(tensor.raw_data())};
}

ElementwiseLayout elementwise_layout(const std::vector<OperandLayout>& operands) {
  std::vector<Strides> strides;
  std::vector<std::uintptr_t> addresses;
  for (const OperandLayout& operand : operands) {
    strides.push_back(operand.strides);
    addresses.push_back(operand.address);
  }
  return elementwise_layout(operands.back().shape, strides, addresses);
}

ElementwiseLayout elementwise_layout(const Shape& shape, const std::vector<Strides>& strides,
                                     const std::vector<std::uintptr_t>& addresses) {
  const std::size_t count = addresses.size();
  ElementwiseLayout layout;
  layout.numel = shape_numel(shape);
  if (layout.numel == 0) return layout;  // kernels skip empty outputs: no dims needed
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    std::vector<std::int64_t> step(count);
    bool mergeable = !layout.sizes.empty();
    for (std::size_t k = 0; k < count; ++k) {
      step[k] = strides[k][d];
      mergeable = mergeable && layout.strides.back()[k] == shape[d] * step[k];
    }
    if (mergeable) {
      layout.sizes.back() *= shape[d];
      layout.strides.back() = step;
    } else {
      layout.sizes.push_back(shape[d]);
      layout.strides.push_back(step);
    }
  }
  layout.packed = packs(layout, addresses);
  layout.narrow_index = fits_narrow_index(layout, count);
  return layout;
}

ElementwiseKernel elementwise_kernel(const ElementwiseLayout& layout) {
  if (layout.packed) return ElementwiseKernel::packed;
  return layout.narrow_index ? ElementwiseKernel::strided_32bit : ElementwiseKernel::strided_64bit;
}

const char* kernel_name(ElementwiseKernel kernel) {
  switch (kernel) {
    case ElementwiseKernel::packed:
      return "packed";
    case ElementwiseKernel::strided_32bit:
      return "strided (32-bit index)";
    case ElementwiseKernel::strided_64bit:
      return "strided (64-bit index)";
  }
  return "?";
}

bool folds_into_one_gemm(const OperandLayout& a, const OperandLayout& b) {
  return a.shape[0] > 1 && b.strides[0] == 0 && a.strides[2] == 1 &&
         a.strides[1] >= std::max<std::int64_t>(1, a.shape[2]) && a.strides[0] == a.shape[1] * a.strides[1];
}

bool cuda_takes_heads_in_place(const OperandLayout& operand) {
  if (operand.shape.size() != 4 || operand.strides[3] != 1) return false;
  if (operand.dtype != DType::bf16 && operand.dtype != DType::f16) return true;
  return std::all_of(operand.strides.begin(), operand.strides.end() - 1,
                     [](std::int64_t stride) { return stride % 8 == 0; });
}

std::int64_t reduce_chunks(ReduceOp op, std::int64_t outputs, std::int64_t count) {
  const bool additive = op == ReduceOp::sum || op == ReduceOp::mean || op == ReduceOp::sum_squares;
  return additive && outputs < 128 && count > kReduceChunk ? (count + kReduceChunk - 1) / kReduceChunk : 1;
}

namespace {

std::int64_t numel_of(const OperandLayout& operand) { return shape_numel(operand.shape); }

// Row-major dense: each dim of size above 1 steps over the dims after it exactly.
bool is_dense(const OperandLayout& operand) {
  std::int64_t expected = 1;
  for (std::size_t d = operand.shape.size(); d-- > 0;) {
    if (operand.shape[d] != 1 && operand.strides[d] != expected) return false;
    expected *= operand.shape[d];
  }
  return true;
}

// copy and cast take (dst, src): the output goes last for the layout.
KernelChoice elementwise_choice(std::string_view op, std::vector<OperandLayout> operands) {
  if ((op == "copy" || op == "cast") && operands.size() == 2) std::swap(operands[0], operands[1]);
  const ElementwiseKernel kernel = elementwise_kernel(elementwise_layout(operands));
  return {kernel_name(kernel), kernel == ElementwiseKernel::strided_64bit};
}

KernelChoice matmul_choice(const OperandLayout& a, const OperandLayout& b) {
  if (a.shape[0] == 1) return {"one cuBLAS GEMM", false};
  if (folds_into_one_gemm(a, b)) return {"one cuBLAS GEMM over the batch's rows", false};
  if (b.strides[0] == 0) return {"a cuBLAS GEMM per batch for one shared matrix", true};
  return {"strided-batched cuBLAS GEMM", false};
}

KernelChoice reduce_choice(ReduceOp op, const OperandLayout& in, const OperandLayout& out) {
  const std::int64_t outputs = std::max<std::int64_t>(1, numel_of(out));
  const std::int64_t count = numel_of(in) / outputs;
  if (reduce_chunks(op, outputs, count) > 1)
    return {"two passes: a block per chunk, then each row's chunks", false};
  return {"a block per output", outputs < 128 && count > kReduceChunk};
}

KernelChoice attention_choice(const OperandLayout& q, const OperandLayout& v) {
  switch (attention_kernel(q.dtype, Device::cuda(0), q.shape.back(), v.shape.back())) {
    case AttentionKernel::flash:
      return {"flash attention (mma.sync tensor cores, K/V tiles in shared memory)", false};
    case AttentionKernel::fused:
      return {"fused attention, a warp per query row", false};
    case AttentionKernel::in_f32:
      return {"fused f32 attention on widened operands", true};
  }
  return {"?", true};
}

// The CUDA rotary and attention kernels read operands where they lie where cuda_takes_heads_in_place
// says so; any other strided operand is copied first.
KernelChoice after_copies_of_strided(KernelChoice choice, const std::vector<OperandLayout>& operands) {
  const auto copied = [](const OperandLayout& operand) {
    return !is_dense(operand) && !cuda_takes_heads_in_place(operand);
  };
  if (std::any_of(operands.begin(), operands.end(), copied))
    choice.kernel = "strided copies, then " + choice.kernel;
  return choice;
}

// An op's fixed kernel is its family's word for it (core/op_info.h); the rest are chosen by their
// category's rule from the operands.
KernelChoice choice_by_rule(const OpInfo& info, const std::vector<OperandLayout>& operands) {
  const std::string_view op = info.name;
  const auto needs = [&](std::size_t count) {
    SHARDLAB_CHECK(operands.size() >= count, "cuda_kernel_choice: {} needs {} operands, got {}", op, count,
                   operands.size());
  };
  if (!info.cuda_kernel.empty()) return {std::string(info.cuda_kernel), false};
  switch (info.category) {
    case OpCategory::gemm: {
      if (op.starts_with("conv2d")) break;
      needs(2);
      KernelChoice choice = matmul_choice(operands[0], operands[1]);
      if (operands.size() > 3)  // a bias: f64 has no epilogue that takes it
        choice.kernel +=
            operands[2].dtype == DType::f64 ? ", then the bias added" : ", the bias in cuBLASLt's epilogue";
      return choice;
    }
    case OpCategory::attention:
      needs(3);
      return attention_choice(operands[0], operands[2]);
    case OpCategory::optimizer: {
      needs(1);
      const bool contiguous = std::all_of(operands.begin(), operands.end(), is_dense);
      return {contiguous ? "multi-tensor: one launch per dtype" : "strided, a launch per parameter", false};
    }
    case OpCategory::reductions:
      for (const ReduceOp code : {ReduceOp::sum, ReduceOp::mean, ReduceOp::sum_squares, ReduceOp::max,
                                  ReduceOp::min, ReduceOp::argmax}) {
        if (op != op_name(code)) continue;
        needs(2);
        return reduce_choice(code, operands[0], operands[1]);
      }
      break;
    case OpCategory::elementwise:
      needs(1);
      return elementwise_choice(op, operands);
    case OpCategory::indexing:
      break;
  }
  fail("cuda_kernel_choice: no rule for op '{}'", op);
}

}  // namespace

KernelChoice cuda_kernel_choice(std::string_view op, const std::vector<OperandLayout>& operands) {
  const OpInfo* info = find_op_info(op);
  SHARDLAB_CHECK(info != nullptr, "cuda_kernel_choice: no rule for op '{}'", op);
  const KernelChoice choice = choice_by_rule(*info, operands);
  return info->heads_in_place ? after_copies_of_strided(choice, operands) : choice;
}

}  // namespace shardlab
