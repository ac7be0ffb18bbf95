// autograd/batch_chunks.h: a batch cut into chunks of a fixed number of samples, for training whose bits
// do not depend on how the global batch is split over ranks. Inside a BatchChunking scope an op whose
// backward sums over the batch (a weight's or a bias's gradient) computes each chunk's part with the
// chunk's shapes and delivers the parts one by one to the parameter's BinnedSum (Variable::
// set_binned_grad), which adds them whatever their order or grouping.
//
//   Variable w(..., true, "w");
//   auto sum = std::make_shared<BinnedSum>(w.numel());
//   w.set_binned_grad(sum);
//   {
//     const autograd::BatchChunking chunking({.samples = 8, .chunk = 2});
//     sum_loss(linear(x, w)).backward();  // w's gradient: four chunk parts added into *sum
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/tensor.h"

namespace shardlab::autograd {

struct BatchChunks {
  std::int64_t samples = 0;  // this rank's batch
  std::int64_t chunk = 0;    // samples per chunk: divides samples
};

// Ops recorded while it lives cut their batch into `chunks` (the innermost scope's).
class BatchChunking {
 public:
  explicit BatchChunking(BatchChunks chunks);
  ~BatchChunking();
  BatchChunking(const BatchChunking&) = delete;
  BatchChunking& operator=(const BatchChunking&) = delete;

 private:
  std::optional<BatchChunks> previous_;
};

// The chunking of the innermost scope on this thread, if any.
std::optional<BatchChunks> batch_chunks();

// The rows [start, start + count) of each chunk of an operand whose `rows` (its first dims flattened)
// hold the batch's samples one after another; throws, naming `op`, where rows do not split by samples.
struct RowRange {
  std::int64_t start = 0, count = 0;
};
std::vector<RowRange> chunk_rows(const BatchChunks& chunks, std::int64_t rows, const char* op);

// Inside an op's backward function: hands one chunk's part of the gradient of the op's input `input`
// (in the input's shape) to that input's BinnedSum. The input must be a leaf with set_binned_grad.
void deliver_gradient_part(std::size_t input, const Tensor& part);
// The same for a part that is zero outside rows `rows` (i64 [n], distinct) of the input's first dim,
// given as those rows' `values` [n, ...]: an embedding's part, which touches the rows its chunk looks up.
void deliver_gradient_rows(std::size_t input, const Tensor& rows, const Tensor& values);

}  // namespace shardlab::autograd
