// dist/fsdp/host_step.h: internal to dist/fsdp: dist::overlap_host_step's update runner, which applies an
// optimizer step to the shards in host memory on a thread of its own, one unit after another in the
// order of the forward, so that each unit's next gather waits for its own part only.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dist/fsdp/unit.h"
#include "optim/optimizer.h"

namespace shardlab::dist::detail {

// One step cut into parts: the updates of the parameters in no unit first, then each unit's in
// the order `units` gives (the recorded forward order), units without updates left out.
struct StepPart {
  Unit* unit = nullptr;  // null for the parameters in no unit
  std::vector<optim::ParamUpdate> updates;
};
std::vector<StepPart> split_by_unit(std::vector<optim::ParamUpdate> updates, const std::vector<Unit*>& units);

class HostStepRunner final : public optim::UpdateRunner {
 public:
  // The thread works on `device`, the units' (a GPU, whose shards it steps in host memory).
  HostStepRunner(std::weak_ptr<RootState> root, Device device);
  ~HostStepRunner() override;  // waits for the queued steps, then ends the thread
  HostStepRunner(const HostStepRunner&) = delete;
  HostStepRunner& operator=(const HostStepRunner&) = delete;

  void run(std::vector<optim::ParamUpdate> updates, optim::UpdateRule rule) override;
  void wait() override;

 private:
  void enqueue(std::function<void()> job);
  void work();  // the thread: runs the jobs in order

  std::weak_ptr<RootState> root_;
  Device device_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;
  bool busy_ = false, stopping_ = false;
  std::exception_ptr error_;  // the first failure since the last wait()
  std::thread thread_;        // last: started once the members above exist
};

}  // namespace shardlab::dist::detail
