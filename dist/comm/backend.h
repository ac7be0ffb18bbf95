// dist/comm/backend.h: internal to dist/: what a Communicator asks of the backend that moves the
// bytes (MPI on CPU, NCCL on CUDA), and the host-side Work state both can complete.
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string_view>

#include "core/tensor.h"
#include "dist/comm/collective.h"
#include "dist/comm/monitor.h"
#include "dist/comm/work.h"

namespace shardlab::dist {

// One validated collective. For in-place collectives (all_reduce, broadcast) input and
// output are the same tensor; barrier has neither.
struct CollectiveCall {
  Fingerprint fingerprint;
  Tensor input, output;
  std::uint64_t ledger_id = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;  // "mpi", "nccl"
  // Throws an Error naming `op` when the backend cannot move `tensor`'s device.
  virtual void check_device(const Tensor& tensor, std::string_view op) const = 0;
  // Starts `call` after every call launched before it; the returned Work completes with it.
  // The backend moves the call's ledger entry to running and then completed or failed.
  virtual Work launch(CollectiveCall call) = 0;
  // The backend of the sub-communicator of the ranks that pass the same color, ordered by
  // (key, rank). Collective: every rank calls it, in the same order as its other splits.
  virtual std::unique_ptr<Backend> split(int color, int key) = 0;
};

// Work completed by a host thread: wait() blocks until then and rethrows its error.
class HostWork final : public WorkState {
 public:
  void complete(std::exception_ptr error);
  void wait() override;
  bool completed() override;

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  bool completed_ = false;
  std::exception_ptr error_;
};

}  // namespace shardlab::dist
