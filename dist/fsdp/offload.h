// dist/fsdp/offload.h: internal to dist/fsdp: the copies of CPU offload between a unit's pinned host
// shards and its GPU, on a stream of their own per device, ordered against the compute stream by
// events: the host never waits for a copy to the device, and waits for the copies to the host once
// per backward, where the optimizer step on the host needs the gradients.
#pragma once

#include <memory>

#include "core/cuda/runtime.h"
#include "core/tensor.h"

namespace shardlab::dist::detail {

class OffloadCopies {
 public:
  explicit OffloadCopies(int device);

  // `pinned` (pinned host memory) copied to the device, ready for the work queued after it on the
  // device's current stream.
  Tensor to_device(const Tensor& pinned);
  // Starts copying `on_device` into new pinned host memory once the work queued so far on the
  // current stream (which wrote it) has run; the result may be read after wait_for_host().
  Tensor to_host(const Tensor& on_device);
  // The host waits until every copy queued so far on the offload stream has run (a host wait):
  // the copies to the host have landed and the host shards are no longer read by copies.
  void wait_for_host();

 private:
  int device_;
  cuda::Stream stream_;
  bool pending_ = false;  // copies queued since the last wait_for_host
};

// The offload copies of GPU `device`, shared by every unit on it (made on first use).
OffloadCopies& offload_copies(int device);

}  // namespace shardlab::dist::detail
