// core/storage.h: a reference-counted buffer of bytes on one device.
#pragma once

#include <cstddef>
#include <memory>

#include "core/device.h"

namespace shardlab {

class Allocator;

// Tensors share a Storage through std::shared_ptr; the bytes go back to the device's
// allocator when the last tensor viewing them is gone.
class Storage {
 public:
  // `pinned` takes page-locked host memory (device must be the CPU) from
  // cuda::pinned_host_allocator().
  Storage(Device device, std::size_t nbytes, bool pinned = false);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  Device device() const { return device_; }
  bool pinned() const { return pinned_; }
  std::size_t nbytes() const { return nbytes_; }
  void* data() const { return data_; }

  // Frees the current bytes and allocates `nbytes` fresh ones (contents undefined), while
  // every tensor viewing this Storage keeps pointing at it. FSDP frees a gathered
  // parameter buffer with reallocate(0) after forward and gathers back into the same
  // Storage before backward, so tensors saved by autograd stay valid.
  void reallocate(std::size_t nbytes);

 private:
  Allocator& allocator() const;

  Device device_;
  bool pinned_;
  std::size_t nbytes_ = 0;
  void* data_ = nullptr;
};

}  // namespace shardlab
