// core/storage.cpp: Storage owns its bytes through the device's allocator.
#include "core/storage.h"

#include "core/allocator.h"
#include "core/cuda/runtime.h"
#include "core/error.h"

namespace shardlab {

Storage::Storage(Device device, std::size_t nbytes, bool pinned) : device_(device), pinned_(pinned) {
  SHARDLAB_CHECK(!pinned || device.is_cpu(), "pinned memory is host memory: it cannot be on {}",
                 device.str());
  // Asked first even for zero bytes, so that pinning without a GPU fails alike for every size.
  if (pinned) cuda::pinned_host_allocator();
  reallocate(nbytes);
}

Storage::~Storage() {
  if (data_ != nullptr) allocator().deallocate(data_, nbytes_);
}

Allocator& Storage::allocator() const {
  return pinned_ ? cuda::pinned_host_allocator() : allocator_for(device_);
}

void Storage::reallocate(std::size_t nbytes) {
  // Zero bytes need no allocator (and no device), which also lets empty tensors exist
  // on a device as pure metadata.
  if (data_ != nullptr) allocator().deallocate(data_, nbytes_);
  data_ = nullptr;
  nbytes_ = 0;
  if (nbytes > 0) data_ = allocator().allocate(nbytes);
  nbytes_ = nbytes;
}

}  // namespace shardlab
