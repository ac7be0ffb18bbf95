// dist/fsdp/offload.cpp: CPU offload's copies on their own stream (dist/fsdp/offload.h).
#include "dist/fsdp/offload.h"

#include <map>
#include <mutex>

namespace shardlab::dist::detail {

namespace {

// `waiter` waits for the work queued on `stream` so far.
void order_after(cuda::Stream& stream, cuda::Stream& waiter) {
  cuda::Event done(stream.device());
  done.record(stream);
  done.wait(waiter);
}

}  // namespace

OffloadCopies::OffloadCopies(int device) : device_(device), stream_(device) {}

Tensor OffloadCopies::to_device(const Tensor& pinned) {
  cuda::Stream& compute = cuda::current_stream(device_);
  Tensor out;
  {
    // Made on the offload stream, which the copy runs on; the compute stream reads it after the
    // copy, so its block is also recorded there (reused by neither before both are done).
    cuda::StreamGuard guard(stream_);
    out = pinned.to(Device::cuda(device_), /*non_blocking=*/true);
  }
  order_after(stream_, compute);
  if (out.numel() > 0) cuda::record_stream(out.storage()->data(), compute);
  pending_ = true;
  return out;
}

Tensor OffloadCopies::to_host(const Tensor& on_device) {
  const Tensor source = on_device.contiguous();
  Tensor out = empty(source.shape(), TensorOptions{source.dtype(), Device::cpu(), /*pinned=*/true});
  order_after(cuda::current_stream(device_), stream_);
  cuda::copy_to_host_async(out.raw_data(), source.raw_data(),
                           static_cast<std::size_t>(source.numel()) * source.element_size(), stream_);
  pending_ = true;
  return out;
}

void OffloadCopies::wait_for_host() {
  if (!pending_) return;
  cuda::Event done(device_);
  done.record(stream_);
  done.synchronize("offloaded gradients to the host");
  pending_ = false;
}

OffloadCopies& offload_copies(int device) {
  static std::mutex mutex;
  // Never destroyed: a stream destroyed during exit may outlive the CUDA runtime's own teardown.
  static auto* copies = new std::map<int, std::unique_ptr<OffloadCopies>>();
  const std::lock_guard lock(mutex);
  auto& slot = (*copies)[device];
  if (!slot) slot = std::make_unique<OffloadCopies>(device);
  return *slot;
}

}  // namespace shardlab::dist::detail
