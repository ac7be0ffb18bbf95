// core/storage.cpp: Storage owns its bytes through the device's allocator.
#include "core/storage.h"

#include "core/allocator.h"

namespace shardlab {

Storage::Storage(Device device, std::size_t nbytes) : device_(device) { reallocate(nbytes); }

Storage::~Storage() {
  if (data_ != nullptr) allocator_for(device_).deallocate(data_, nbytes_);
}

void Storage::reallocate(std::size_t nbytes) {
  // Zero bytes need no allocator (and no device), which also lets empty tensors exist
  // on a device as pure metadata.
  if (data_ != nullptr) allocator_for(device_).deallocate(data_, nbytes_);
  data_ = nullptr;
  nbytes_ = 0;
  if (nbytes > 0) data_ = allocator_for(device_).allocate(nbytes);
  nbytes_ = nbytes;
}

}  // namespace shardlab
