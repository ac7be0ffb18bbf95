// core/index.h: indexing: embedding, index_select, gather, scatter_add, index_add; their kernel
// entries, the index check among them.
#pragma once

#include <cstdint>

#include "core/op_info.h"
#include "core/tensor.h"

namespace shardlab {

// weight [V, D], indices (i64/i32, any shape) -> [..., D].
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Sums the rows of grad [..., D] into a [num_embeddings, D] gradient (scatter-add).
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, std::int64_t num_embeddings);

// index is 1-D (i64/i32); picks slices of x along dim.
Tensor index_select(const Tensor& x, std::int64_t dim, const Tensor& index);
// out[i][j] = x[i][index[i][j]] (dim 1); index has x's rank, no larger in other dims.
Tensor gather(const Tensor& x, std::int64_t dim, const Tensor& index);
// A copy of self with src added at the positions index names along dim (gather's adjoint).
Tensor scatter_add(const Tensor& self, std::int64_t dim, const Tensor& index, const Tensor& src);
// A copy of self with src.select(dim, j) added to self.select(dim, index[j]).
Tensor index_add(const Tensor& self, std::int64_t dim, const Tensor& index, const Tensor& src);

// Indexing's kernels.
struct IndexKernels {
  // Checks every value of `index` (contiguous i64, not empty) against [0, size); `op` and `what`
  // are string literals. The CPU throws at once. CUDA does not make the host wait for the answer:
  // a kernel records the first bad value, the next host wait (core/host_wait.h) on any device
  // throws the Error, and the index kernels meanwhile skip out-of-range values.
  void (*check_index)(const char* op, const Tensor& index, std::int64_t size, const char* what);
  // Index tensors are contiguous i64 and checked by check_index; data operands contiguous.
  void (*index_select)(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out);
  void (*gather)(const Tensor& in, std::int64_t dim, const Tensor& index, const Tensor& out);
  // out already holds a copy of self; these add src into it.
  void (*scatter_add)(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src);
  void (*index_add)(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src);
};

// This family's ops by the names their kernel calls are logged under (core/op_info.h).
std::span<const OpInfo> index_ops();

// This family's entries on each device: core/cpu/index.cpp, core/cuda/index.cu.
namespace cpu {
IndexKernels index_kernels();
}
namespace cuda {
IndexKernels index_kernels();
}

}  // namespace shardlab
