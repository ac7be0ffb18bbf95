// core/kernel_choice.cpp: the CUDA kernel choices of core/kernel_choice.h.
#include "core/kernel_choice.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "core/tensor.h"

namespace shardlab {

namespace {

constexpr std::int64_t kMaxNarrow = std::numeric_limits<std::int32_t>::max();
constexpr std::uintptr_t kPackBytes = 16;

// Whether every operand steps by 1 from an address on 16 bytes, or by 0, along the layout's one dim.
bool packs(const ElementwiseLayout& layout, const std::vector<std::uintptr_t>& addresses) {
  if (layout.sizes.size() > 1 || layout.numel > kMaxNarrow) return false;
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
  if (layout.numel > kMaxNarrow) return false;
  for (std::size_t k = 0; k < operands; ++k) {
    std::int64_t farthest = 0;
    for (std::size_t d = 0; d < layout.sizes.size(); ++d)
      farthest += (layout.sizes[d] - 1) * std::llabs(layout.strides[d][k]);
    if (farthest > kMaxNarrow) return false;
  }
  return true;
}

}  // namespace

ElementwiseLayout elementwise_layout(const std::vector<const Tensor*>& operands) {
  std::vector<Strides> strides;
  std::vector<std::uintptr_t> addresses;
  for (const Tensor* operand : operands) {
    strides.push_back(operand->strides());
    addresses.push_back(reinterpret_cast<std::uintptr_t>(operand->raw_data()));
  }
  return elementwise_layout(operands.back()->shape(), strides, addresses);
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

bool folds_into_one_gemm(const Tensor& a, const Tensor& b) {
  return a.size(0) > 1 && b.stride(0) == 0 && a.stride(2) == 1 &&
         a.stride(1) >= std::max<std::int64_t>(1, a.size(2)) && a.stride(0) == a.size(1) * a.stride(1);
}

std::int64_t reduce_chunks(ReduceOp op, std::int64_t outputs, std::int64_t count) {
  const bool additive = op == ReduceOp::sum || op == ReduceOp::mean || op == ReduceOp::sum_squares;
  return additive && outputs < 128 && count > kReduceChunk ? (count + kReduceChunk - 1) / kReduceChunk : 1;
}

}  // namespace shardlab
