// core/cuda/tensor_launch.cpp: the shared unpacking of core/cuda/tensor_launch.h.
#include "core/cuda/tensor_launch.h"

#include <cstring>

namespace shardlab::cuda {

bool reduce_rows(ReduceOp op, const Tensor& rows, const Tensor& out, std::int64_t outputs, std::int64_t count,
                 cudaStream_t stream) {
  // Scratch only for the two-pass case: a one-pass reduction (most of them) allocates nothing.
  const std::int64_t chunks = reduce_chunks(op, outputs, count);
  const DType accumulator = is_floating(rows.dtype()) ? DType::f64 : DType::i64;
  const Tensor partials =
      chunks > 1 ? empty({outputs * chunks}, TensorOptions{accumulator, out.device()}) : Tensor();
  return launch_reduce(op, rows.dtype(), out.dtype(), rows.raw_data(), out.raw_data(), outputs, count,
                       partials.defined() ? partials.raw_data() : nullptr, stream);
}

TableUpload upload_into(Tensor& table, Device device) {
  return [&table, device](const void* host_table, std::size_t bytes) {
    const Tensor staged =
        empty({static_cast<std::int64_t>(bytes)}, TensorOptions{DType::u8, Device::cpu(), true});
    std::memcpy(staged.raw_data(), host_table, bytes);
    table = staged.to(device, /*non_blocking=*/true);
    return table.raw_data();
  };
}

Heads heads_in(const Tensor& t) { return heads_of<const void*>(t, t.raw_data()); }
MutableHeads heads_out(const Tensor& t) { return heads_of<void*>(t, t.raw_data()); }

}  // namespace shardlab::cuda
