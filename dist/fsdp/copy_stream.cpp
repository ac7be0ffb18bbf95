// dist/fsdp/copy_stream.cpp: the per-device copy-in stream of FSDP's collectives
// (dist/fsdp/copy_stream.h).
#include "dist/fsdp/copy_stream.h"

#include <map>
#include <memory>
#include <mutex>

#include "core/cuda/runtime.h"
#include "core/storage.h"

namespace shardlab::dist::detail {

namespace {

cuda::Stream& copy_stream(int device) {
  static std::mutex mutex;
  // Never destroyed, as the offload streams: a stream destroyed during exit may outlive the runtime.
  static auto* streams = new std::map<int, std::unique_ptr<cuda::Stream>>();
  const std::lock_guard lock(mutex);
  auto& slot = (*streams)[device];
  if (!slot) slot = std::make_unique<cuda::Stream>(device);
  return *slot;
}

}  // namespace

void on_copy_stream(Device device, const std::vector<Tensor>& reads, const std::function<void()>& work) {
  if (!device.is_cuda()) return work();
  cuda::Stream& copy = copy_stream(device.index);
  cuda::Event ready(device.index);
  ready.record(cuda::current_stream(device.index));
  ready.wait(copy);
  for (const Tensor& tensor : reads) {
    if (tensor.defined() && tensor.numel() > 0 && tensor.device() == device)
      cuda::record_stream(tensor.storage()->data(), copy);
  }
  const cuda::StreamGuard guard(copy);
  work();
}

}  // namespace shardlab::dist::detail
