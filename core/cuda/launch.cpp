// core/cuda/launch.cpp: the table upload and heads' views that core/cuda/launch.h declares.
#include "core/cuda/launch.h"

#include <cstring>

namespace shardlab::cuda {

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
