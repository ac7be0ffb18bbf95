// tests/core/test_dispatch.cpp: the per-device kernel tables: the CPU table is complete, and so is the
// CUDA one in a CUDA build (empty otherwise); which attention kernel each dtype, device and head dim
// takes, answered without a GPU.
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
