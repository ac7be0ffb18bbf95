// core/cuda/table.cpp: the CUDA kernel table (core/kernels.h), each family's entries from its own file
// (core/cuda/<family>.cu, or matmul.cpp for cuBLAS), which unpacks Tensors into its kernels' launchers.
#include "core/kernels.h"

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
