// core/cuda/random.cpp: the random draws' entry.
#include "core/cuda/launch.h"
#include "core/cuda/tensor_launch.h"
#include "core/kernels.h"

namespace shardlab::cuda {
namespace {

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

}  // namespace

RandomKernels random_kernels() { return {.random = cuda_random}; }

}  // namespace shardlab::cuda
