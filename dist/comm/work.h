// dist/comm/work.h: Work, the handle every collective returns.
#pragma once

#include <memory>

namespace shardlab::dist {

// What a backend's in-flight collective looks like to its Work handle.
class WorkState {
 public:
  virtual ~WorkState() = default;
  virtual void wait() = 0;
  virtual bool completed() = 0;
};

// A collective in flight. Blocking forms are `comm.all_reduce(t).wait()`.
//   auto gathered = comm.all_gather_into(full, shard);  // returns at once
//   ... compute that does not touch `full` ...
//   gathered.wait();
// Handles may be waited in any order, more than once, or not at all (the collective still
// completes; the tensors stay alive until it has).
class Work {
 public:
  Work() = default;  // an empty handle: already complete
  explicit Work(std::shared_ptr<WorkState> state) : state_(std::move(state)) {}

  // MPI backend: returns once the collective completed (its output is in place), rethrowing
  // the Error it failed with. NCCL backend: makes the caller's current CUDA stream wait for
  // it, without blocking the host, as every later kernel on that stream needs.
  void wait() const {
    if (state_) state_->wait();
  }
  // True once the collective finished (successfully or not); never blocks.
  bool completed() const { return !state_ || state_->completed(); }

 private:
  std::shared_ptr<WorkState> state_;
};

}  // namespace shardlab::dist
