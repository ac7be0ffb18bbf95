// core/cuda/table.cpp: the CUDA kernel table (core/kernels.h), each family's entries from its own file
// (core/cuda/<family>.cpp), which unpacks Tensors into the launchers of core/cuda/launch.h.
#include "core/cuda/tensor_launch.h"

namespace shardlab {

const Kernels& cuda_kernels() {
  static const Kernels table{
      cuda::elementwise_kernels(), cuda::reduction_kernels(), cuda::matmul_kernels(),
      cuda::softmax_kernels(),     cuda::loss_kernels(),      cuda::transformer_kernels(),
      cuda::conv_kernels(),        cuda::pool_kernels(),      cuda::attention_kernels(),
      cuda::index_kernels(),       cuda::random_kernels(),    cuda::optimizer_kernels()};
  return table;
}

}  // namespace shardlab
