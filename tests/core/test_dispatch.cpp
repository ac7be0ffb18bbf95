// tests/core/test_dispatch.cpp: the per-device kernel tables: the CPU table is complete, and so is the
// CUDA one in a CUDA build (empty otherwise); which CUDA kernel each op takes (attention by dtype,
// device and head dim; elementwise ops by their operands' layout), answered without a GPU.
#include <cstdint>
#include <limits>
#include <vector>

#include "core/kernel_choice.h"
#include "core/kernels.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

// Each entry of Kernels, by name, for the completeness check.
template <auto... Entries>
std::vector<bool> supported_on(Device device) {
  return {supports<Entries>(device)...};
}

// Every entry, which every device has.
std::vector<bool> all_entries(Device device) {
  return supported_on<&Kernels::fill, &Kernels::copy, &Kernels::unary, &Kernels::binary, &Kernels::where,
                      &Kernels::reduce, &Kernels::matmul, &Kernels::softmax, &Kernels::cross_entropy_forward,
                      &Kernels::cross_entropy_backward, &Kernels::rms_norm_forward,
                      &Kernels::rms_norm_backward, &Kernels::swiglu_forward, &Kernels::swiglu_backward,
                      &Kernels::rotary, &Kernels::conv2d, &Kernels::conv2d_backward_input,
                      &Kernels::conv2d_backward_weight, &Kernels::max_pool2d, &Kernels::max_pool2d_backward,
                      &Kernels::check_index, &Kernels::index_select, &Kernels::gather, &Kernels::scatter_add,
                      &Kernels::index_add, &Kernels::random, &Kernels::adadelta_step, &Kernels::adam_step,
                      &Kernels::attention_forward, &Kernels::attention_backward>(device);
}

}  // namespace

TEST_CASE("the CPU table has a kernel for every entry", "[dispatch]") {
  static_assert(sizeof(Kernels) == 30 * sizeof(void*), "a new Kernels entry must be added to this test");
  for (const bool supported : all_entries(Device::cpu())) CHECK(supported);
}

TEST_CASE("the CUDA table has a kernel for every entry when built with CUDA", "[dispatch]") {
  // Built without CUDA every entry is empty (and the ops say so, naming op and device).
  const bool built = supports<&Kernels::fill>(Device::cuda(0));
  for (const bool supported : all_entries(Device::cuda(0))) CHECK(supported == built);
}

TEST_CASE("conv2d on cuda through the table: the CPU's values", "[dispatch][cuda]") {
  const Tensor x = test::random_tensor({1, 2, 5, 5}, 1), w = test::random_tensor({3, 2, 3, 3}, 2);
  if (supports<&Kernels::conv2d>(Device::cuda(0))) {
    test::check_close(conv2d(x.to(Device::cuda(0)), w.to(Device::cuda(0)), {}, {}).to(Device::cpu()),
                      conv2d(x, w, {}, {}));
  } else {
    CHECK_THROWS_ERROR(conv2d(x.to(Device::cuda(0)), w.to(Device::cuda(0)), {}, {}),
                       "conv2d: not supported on cuda:0 (no kernel for it in this build)");
  }
}

TEST_CASE("the attention kernel is a function of dtype, device and head dims", "[dispatch][attention]") {
  const Device gpu = Device::cuda(0), cpu = Device::cpu();
  // The seed and 1b Llamas' heads (64 and 64 wide) in bf16 on a GPU: flash attention.
  CHECK(attention_kernel(DType::bf16, gpu, 64, 64) == AttentionKernel::flash);
  CHECK(attention_kernel(DType::f16, gpu, 128, 128) == AttentionKernel::flash);
  // Head dims it is not built for, or q's and v's apart: the f32 kernel on widened operands.
  CHECK(attention_kernel(DType::bf16, gpu, 80, 80) == AttentionKernel::in_f32);
  CHECK(attention_kernel(DType::bf16, gpu, 64, 128) == AttentionKernel::in_f32);
  CHECK(attention_kernel(DType::bf16, cpu, 64, 64) == AttentionKernel::in_f32);
  for (const Device device : {cpu, gpu}) {
    CHECK(attention_kernel(DType::f32, device, 64, 64) == AttentionKernel::fused);
    CHECK(attention_kernel(DType::f64, device, 40, 24) == AttentionKernel::fused);
  }
}

TEST_CASE("an elementwise op's CUDA kernel: packed for dense operands, strided otherwise",
          "[dispatch][elementwise]") {
  const auto kernel_of = [](std::vector<const Tensor*> operands) {
    return elementwise_kernel(elementwise_layout(operands));
  };
  // A residual add of the seed Llama in bf16: dense operands, packed.
  const TensorOptions bf16{DType::bf16, Device::cpu()};
  const Tensor x = empty({4, 16, 48}, bf16), y = empty({4, 16, 48}, bf16), out = empty({4, 16, 48}, bf16);
  CHECK(kernel_of({&x, &y, &out}) == ElementwiseKernel::packed);
  // One element for all (a Scalar operand, expanded): still packed.
  const Tensor scale = empty({}, bf16).expand({4, 16, 48});
  CHECK(kernel_of({&x, &scale, &out}) == ElementwiseKernel::packed);
  // A cast f32 -> bf16 of a dense tensor, and a scalar (rank 0): packed.
  const Tensor wide = empty({4, 16, 48});
  CHECK(kernel_of({&wide, &out}) == ElementwiseKernel::packed);
  const Tensor one = empty({}, bf16), one_out = empty({}, bf16);
  CHECK(kernel_of({&one, &one_out}) == ElementwiseKernel::packed);
  // A view starting one element in is off 16 bytes; a transposed operand or a broadcast row needs
  // two dims; an output that is one element for all is never packed.
  const Tensor shifted = empty({3073}, bf16).narrow(0, 1, 3072), dense = empty({3072}, bf16);
  CHECK(kernel_of({&shifted, &dense}) == ElementwiseKernel::strided_32bit);
  const Tensor square = empty({48, 48}, bf16), square_out = empty({48, 48}, bf16);
  const Tensor transposed = square.transpose(0, 1);
  CHECK(kernel_of({&transposed, &square_out}) == ElementwiseKernel::strided_32bit);
  const Tensor bias = empty({48}, bf16).expand({64, 48}), rows = empty({64, 48}, bf16);
  CHECK(kernel_of({&rows, &bias, &rows}) == ElementwiseKernel::strided_32bit);
  const Tensor broadcast_out = empty({1}, bf16).expand({64});
  const Tensor column = empty({64}, bf16);
  CHECK(kernel_of({&column, &broadcast_out}) == ElementwiseKernel::strided_32bit);
}

TEST_CASE("elementwise index math is 32-bit below 2^31 elements and offsets, 64-bit beyond",
          "[dispatch][elementwise]") {
  const std::int64_t limit = std::numeric_limits<std::int32_t>::max();
  // Dense and aligned, 2^31 - 1 elements: packed; one more: strided with 64-bit indices.
  ElementwiseLayout layout = elementwise_layout({limit}, {{1}, {1}}, {256, 512});
  CHECK(layout.sizes == std::vector<std::int64_t>{limit});
  CHECK(elementwise_kernel(layout) == ElementwiseKernel::packed);
  CHECK(elementwise_kernel(elementwise_layout({limit + 1}, {{1}, {1}}, {256, 512})) ==
        ElementwiseKernel::strided_64bit);
  // Few elements, but an operand whose farthest element is 2^31 away.
  const std::int64_t wide_stride = (std::int64_t{1} << 30) + 1;  // 2 steps: 2^31 + 2
  layout = elementwise_layout({4, 3}, {{1, wide_stride}, {3, 1}}, {0, 0});
  CHECK(layout.sizes.size() == 2);
  CHECK(!layout.narrow_index);
  CHECK(elementwise_kernel(layout) == ElementwiseKernel::strided_64bit);
  // Merging: [2, 3, 4] dense in both operands is one dim of 24.
  layout = elementwise_layout({2, 3, 4}, {{12, 4, 1}, {12, 4, 1}}, {16, 32});
  CHECK(layout.sizes == std::vector<std::int64_t>{24});
  CHECK(layout.packed);
}
