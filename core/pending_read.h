// core/pending_read.h: a few device values read on the host one step later, without making the
// host wait now: the copy to pinned host memory is queued behind the work that computes them, and
// reading waits only if that work has not run by then (a training loop's loss, read while the
// next step's work is already queued, as PyTorch users log the previous step's loss).
//
//   PendingRead loss({loss_on_gpu, norm_on_gpu});  // queues the copy, returns at once
//   ... queue the next step ...
//   const std::vector<double> values = loss.take();
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"

namespace shardlab {

namespace cuda {
class Event;
}

class PendingRead {
 public:
  PendingRead();  // nothing to read
  // Queues the copy of `values`: one-element tensors of any dtype on one device, read as doubles.
  explicit PendingRead(const std::vector<Tensor>& values);
  ~PendingRead();
  PendingRead(PendingRead&&) noexcept;
  PendingRead& operator=(PendingRead&&) noexcept;

  bool empty() const { return !host_.defined(); }
  // The values, in order, once: a host wait (counted under "read values queued earlier") only when
  // the copy has not run yet. Throws when empty.
  std::vector<double> take();

 private:
  Tensor host_;                          // the f64 values: pinned on a GPU's way, else the CPU's
  std::unique_ptr<cuda::Event> copied_;  // recorded after the copy to host_, for values on a GPU
};

}  // namespace shardlab
